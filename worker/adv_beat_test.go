package worker

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// The heartbeat's promise in 04f1488, "a lease is counted lost once"
// (orderdelay_worker_leases_lost_total: tasks whose lease was lost while
// held). The clock now cancels, at every tick, a handler whose lease ran
// out on the worker's clock, counting the loss in lose — also while the
// handler has already returned and run() is settling its outcome, since
// the task stays in r.held until run returns. When that settle then finds
// the lease gone (!ok on its first try), run counts the same loss again.
// Interleaving: the handler returns nil just after a producer deleted its
// task (the lease is gone on Redis) and as Redis stops answering (replies
// held for 3 s, under go-redis's 5 s ReadTimeout); run passes its
// ErrLeaseLost check and sends the ack, which runs on Redis (missed) but
// whose answer is held; the heartbeat's calls hang, the lease runs out on
// the worker's clock, lose counts 1 and cancels ctx; the answer arrives,
// ok=false with no earlier failure, and run counts 2.
func TestAdvBeatLostLeaseCountedTwice(t *testing.T) {
	e := newEnv(t)
	rdb, proxy := proxied(t)
	lease := time.Second
	q := e.queue(lease)
	q.Concurrency = 1
	e.put("j", `{}`)
	sig := newLogCount("lease lost; cancelling the handler")
	w := newWorker(t, rdb, Config{Logger: slog.New(sig)})
	returned := make(chan struct{})
	if err := w.Handle(q, func(ctx context.Context, tk *Task) error {
		defer close(returned)
		if _, err := e.cl.DeleteTasks(context.Background(), tk.ID); err != nil {
			t.Error(err)
		}
		proxy.Stall(3 * time.Second)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	stop, wait := start(t, w)
	select {
	case <-returned:
	case <-time.After(30 * time.Second):
		t.Fatal("handler did not run")
	}
	sig.waitHits(t, 1) // the clock cancelled it while the ack's answer was held
	eventually(t, "run returned", func() bool {
		r := w.runners[0]
		r.mu.Lock()
		defer r.mu.Unlock()
		return len(r.held) == 0
	})
	proxy.Stall(0)
	stop()
	_ = wait()
	if got := testutil.ToFloat64(w.m.lost.WithLabelValues("jobs")); got != 1 {
		t.Fatalf("leases_lost_total = %v for one task's one lost lease; logs: %v", got, sig.messages())
	}
}
