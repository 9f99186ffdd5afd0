package worker

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// proxied returns a client to the test Redis through a proxy the test
// controls, with go-redis's default options (MaxRetries 3), as a program
// would build it.
func proxied(t *testing.T) (*redis.Client, *testenv.Proxy) {
	t.Helper()
	o, err := redis.ParseURL(testenv.RedisURL())
	if err != nil {
		t.Fatal(err)
	}
	proxy := testenv.NewProxy(t, o.Addr)
	o.Addr = proxy.Addr()
	c := redis.NewClient(o)
	t.Cleanup(func() { c.Close() })
	return c, proxy
}

// Invariant 3: a handler's success is never turned into a dead letter by
// the runner's own bookkeeping. A Redis blip while the worker acks (a
// failover: longer than go-redis's own three retries) made the ack fail,
// and the runner never tried it again, though the task was still its own
// and the blip was over within a second: the task sat leased until the
// lease ran out, and the next claim counted the expiry as an attempt — on
// the task's last attempt, dead-lettering a success as "failed". The
// runner now tries the ack again within its bookkeeping budget.
func TestAdvAckBlipDeadLettersSucceededTask(t *testing.T) {
	e := newEnv(t)
	rdb, proxy := proxied(t)
	q := e.queue(2 * time.Second)
	q.MaxAttempts = 3
	q.Concurrency = 1
	q.Retry.Backoff = []time.Duration{10 * time.Millisecond}
	e.put("j", `{}`)

	sig := newLogCount("settling a task failed")
	var runs atomic.Int32
	w := newWorker(t, rdb, Config{Logger: slog.New(sig)})
	if err := w.Handle(q, func(ctx context.Context, t *Task) error {
		runs.Add(1)
		if t.Attempts < 2 {
			return errors.New("partner down") // the first two attempts fail
		}
		// The last attempt succeeds; Redis blips just as the worker acks.
		proxy.Down()
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	stop, wait := start(t, w)
	sig.waitHits(t, 1) // the ack failed
	proxy.Up()         // the blip is over, long before the 2 s lease ends

	var tk client.Task
	eventually(t, "the task settled (acked or dead)", func() bool {
		var err error
		tk, err = e.get("j")
		return errors.Is(err, client.ErrNotFound) || (err == nil && tk.State == client.StateDead)
	})
	stop()
	_ = wait()
	if tk.State == client.StateDead {
		t.Fatalf("the handler succeeded on attempt 3 (runs %d, processed_total %v), but the task is dead-lettered: reason %q, attempts %d, last error %q",
			runs.Load(), testutil.ToFloat64(w.m.processed.WithLabelValues("jobs")), tk.Reason, tk.Attempts, tk.LastError)
	}
}

// Invariant 6: "a panic is an error" — but the error a handler returns
// was formatted outside the recover. A handler returning a typed nil
// pointer as its error (the classic Go pitfall) whose Error method
// dereferences the receiver panicked in the runner's goroutine: the whole
// process died, and every task it held waited out its lease with one more
// attempt. Run in a child process, which such a panic kills.
func TestAdvHandlerErrorMethodPanicKillsProcess(t *testing.T) {
	if os.Getenv("ADV_WORKER_CHILD") == "1" {
		advPanickingErrorChild(t)
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestAdvHandlerErrorMethodPanicKillsProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), "ADV_WORKER_CHILD=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		s := string(out)
		if i := strings.Index(s, "panic:"); i >= 0 {
			s = s[i:min(len(s), i+400)]
		}
		t.Fatalf("the worker process died (%v) on a handler's error value:\n%s", err, s)
	}
}

type advErr struct{ msg string }

func (e *advErr) Error() string { return e.msg } // nil receiver: panics

func advPanickingErrorChild(t *testing.T) {
	e := newEnv(t)
	q := e.queue(5 * time.Second)
	q.MaxAttempts = 5
	e.put("p", `{}`)
	ran := make(chan struct{}, 10)
	w := newWorker(t, e.rdb, Config{})
	if err := w.Handle(q, func(ctx context.Context, t *Task) error {
		ran <- struct{}{}
		var e *advErr // a path that "returns no error"
		return e
	}); err != nil {
		t.Fatal(err)
	}
	stop, wait := start(t, w)
	<-ran
	eventually(t, "p settled (retried)", func() bool {
		tk, err := e.get("p")
		return err == nil && tk.State != client.StateLeased
	})
	stop()
	_ = wait()
}

// A last error longer than the bound whose first byte is not UTF-8 was
// trimmed byte by byte until the whole prefix was valid: to nothing. It
// keeps its text now, invalid bytes as '?', within the bound.
func TestLastErrorKeepsTextAroundInvalidBytes(t *testing.T) {
	for _, tc := range []struct{ name, msg string }{
		{"invalid first byte", "\xff" + strings.Repeat("a", 2*maxErrorBytes)},
		{"a rune cut by the bound", strings.Repeat("a", maxErrorBytes-1) + "é and more"},
		{"short", "boom \xfe"},
	} {
		got := lastError(errors.New(tc.msg))
		if got == "" || len(got) > maxErrorBytes || !utf8.ValidString(got) {
			t.Errorf("%s: lastError = %q (%d bytes, valid %v); want valid UTF-8, not empty, at most %d bytes",
				tc.name, got[:min(len(got), 40)], len(got), utf8.ValidString(got), maxErrorBytes)
		}
	}
	var nilErr *advErr
	if got := lastError(nilErr); !strings.Contains(got, "panicked") {
		t.Errorf("lastError of an error whose Error panics = %q; want it to say so", got)
	}
}

// Invariant 5 / the heartbeat's promise "if Redis is unreachable, a
// handler whose lease has run out on the worker's clock is cancelled": the
// heartbeat extended one claim's token at a time, each call "bounded" by a
// Lease/3 context — which go-redis ignores with its default options
// (ContextTimeoutEnabled off, the package doc's own example client): each
// call waited out the 5 s ReadTimeout instead. A token's handlers were
// checked only after its own call failed, so when Redis stops answering
// (a partition that drops packets, simulated by holding every reply) a
// round over k tokens took about k·5 s: with a 1 s lease the first
// token's handler ran ~5 s past its lease, the k-th ~5k s — while a poll
// or another worker that still reaches Redis had taken their tasks after
// 1 s. Now the worker's clock decides at every tick, whatever the calls
// do: every handler is cancelled while the calls still hang (before the
// first of them returns its ReadTimeout error).
func TestAdvBlackholedHeartbeatCancelsLate(t *testing.T) {
	e := newEnv(t)
	rdb, proxy := proxied(t)
	lease := time.Second
	q := e.queue(lease)
	const n = 3
	q.Concurrency = n
	type ended struct {
		id string
		at time.Time
	}
	started := make(chan string, n)
	cancelled := make(chan ended, n)
	sig := newLogCount("extending leases failed")
	w := newWorker(t, rdb, Config{Logger: slog.New(sig)})
	if err := w.Handle(q, func(ctx context.Context, t *Task) error {
		started <- t.ID
		<-ctx.Done()
		cancelled <- ended{t.ID, time.Now()}
		return ctx.Err()
	}); err != nil {
		t.Fatal(err)
	}
	stop, wait := start(t, w)
	// One task per claim: n tokens.
	for i := range n {
		id := string(rune('a' + i))
		e.put(id, `{}`)
		select {
		case <-started:
		case <-time.After(30 * time.Second):
			t.Fatalf("task %s not started", id)
		}
	}
	// Let one heartbeat round succeed for all of them, so every lease was
	// extended just now, then hold every reply from Redis.
	eventually(t, "all leases extended once", func() bool {
		var hs []*held
		for _, r := range w.runners {
			r.mu.Lock()
			for h := range r.held {
				hs = append(hs, h)
			}
			r.mu.Unlock()
		}
		if len(hs) != n {
			return false
		}
		for _, h := range hs {
			w.runners[0].mu.Lock()
			ok := time.Since(h.extended) < lease/3
			w.runners[0].mu.Unlock()
			if !ok {
				return false
			}
		}
		return true
	})
	cut := time.Now()
	before := len(sig.messages())
	proxy.Stall(time.Minute)
	defer proxy.Stall(0)

	got := map[string]time.Duration{}
	for range n {
		select {
		case c := <-cancelled:
			got[c.id] = c.at.Sub(cut)
		case <-time.After(30 * time.Second):
			t.Fatalf("handlers cancelled: %v of %d", got, n)
		}
	}
	var failed []string
	for _, m := range sig.messages()[before:] {
		if strings.Contains(m, "extending leases failed") {
			failed = append(failed, m)
		}
	}
	proxy.Stall(0)
	stop()
	_ = wait()
	if len(failed) > 0 {
		t.Fatalf("handlers were cancelled only as the hanging extensions failed (%d before the last cancellation: %v); cancelled after: %v",
			len(failed), failed, got)
	}
}
