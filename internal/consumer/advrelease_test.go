package consumer

import (
	"context"
	"encoding/json"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/metrics"
)

// A task queue's consumer hands back what a stop cut (taskHandler.handBack,
// queue.Store.Release). A task whose earlier run failed goes back as a
// backoff due now in {Q}:inflight; one never run goes back into the queue
// key. Either way the other replicas must take it at once: README and
// docs/tasks.md promise a handed-back entry to any replica, and the
// stopping replica's lease had told every other replica's scanner to
// sleep until that lease's end (its next expiry), so only the idle head
// check (every HeadCheck, 350 ms by default) can wake them sooner. The
// head check reads the queue key alone: a task handed back as a backoff
// is invisible to it, and the other replicas sleep on until the old
// lease would have ended (or ScanInterval) — a rolling deploy of a task
// queue with a 5 min lease leaves every retried task it cut waiting up
// to ScanInterval instead of at once (before 0a8253b the hand-back put
// them all into the queue key, where the head check sees them).
func TestAdvReleaseHandedBackTaskIsTakenAtOnceByAnotherReplica(t *testing.T) {
	for _, tc := range []struct {
		name  string
		retry bool // the task's first run failed before the cut one
	}{{"never run", false}, {"retried once", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newRedisEnv(t)
			ctx := context.Background()
			if _, _, err := e.cl.PutTask(ctx, "t1", json.RawMessage(`{}`), time.Now().Add(-time.Second), client.Create); err != nil {
				t.Fatal(err)
			}
			cfg := Config{Process: func(context.Context, []Task) []error { return []error{nil} },
				Workers: 1, BatchSize: 10, Lease: 10 * time.Minute, MaxAttempts: 5, ScanInterval: time.Hour}
			// Replica A: claims the task (and, for "retried once", fails
			// its first run and claims it again), then is stopped mid-run.
			a := e.consumer(cfg)
			res := claimN(t, a, 1)
			if tc.retry {
				a.retry(res.items, 0, true, "boom")
				res = claimN(t, a, 1)
				if res.items[0].attempts != 1 {
					t.Fatalf("re-claimed with attempts %d, want 1", res.items[0].attempts)
				}
			}
			// Replica B: idle, its first claim done while A holds the lease.
			mB := metrics.New(prometheus.NewRegistry(), "test", "test")
			var runs atomic.Int32
			cfgB := cfg
			cfgB.Keys, cfgB.HeadCheck = e.Keys, 20*time.Millisecond
			cfgB.Process = func(_ context.Context, ts []Task) []error {
				runs.Add(int32(len(ts)))
				return make([]error, len(ts))
			}
			b, err := New(cfgB, e.RDB, unusedStore{}, mB, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
			if err != nil {
				t.Fatal(err)
			}
			runConsumer(t, b)
			eventually(t, "B's first claim", 30*time.Second, func() bool { return testutil.ToFloat64(mB.LastScan) > 0 })
			if n := runs.Load(); n != 0 {
				t.Fatalf("B ran %d tasks while A held the lease", n)
			}

			a.handBack(res.items) // the drain's cut

			// What B's idle head check sees.
			hd, found, err := b.h.head(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if now := time.Now().UnixMilli(); !found || hd > now {
				t.Errorf("after the hand-back B's head check sees found=%v head=%d (now %d): the handed-back task is due now, and B sleeps until A's old lease ends", found, hd, now)
			}
			// And so whether B takes it before its hour-long scan interval
			// or A's ten-minute lease would have woken it.
			eventually(t, "B runs the task A handed back", 30*time.Second, func() bool { return runs.Load() == 1 })
		})
	}
}

// A producer re-adds a task with a raw ZADD while a replica runs its
// retry (attempts 1), and a stop cuts the run: the hand-back turns the
// lease into a backoff due now (Release) while the queue key holds the
// producer's entry, so the task is in both. The producer's write must
// win, as with the order queue's hand-back (ZADD NX, record dropped):
// no claim takes the task before the producer's deadline, none takes it
// twice, and when it comes due it is a new schedule (attempts 0), not
// the old run's backoff.
func TestAdvReleaseOfARetryAProducerReAddedKeepsTheProducersEntry(t *testing.T) {
	for _, tc := range []struct {
		name  string
		ahead time.Duration // the producer's deadline, from now
	}{{"later", time.Hour}, {"due now", -time.Second}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newRedisEnv(t)
			ctx := context.Background()
			if _, _, err := e.cl.PutTask(ctx, "t1", json.RawMessage(`{}`), time.Now().Add(-time.Minute), client.Create); err != nil {
				t.Fatal(err)
			}
			a := e.consumer(Config{Process: func(context.Context, []Task) []error { return []error{nil} },
				Workers: 1, BatchSize: 10, Lease: 10 * time.Minute, MaxAttempts: 5})
			res := claimN(t, a, 1)
			a.retry(res.items, 0, true, "boom")
			res = claimN(t, a, 1)
			due := time.Now().Add(tc.ahead).UnixMilli()
			if err := e.RDB.ZAdd(ctx, e.Keys.Queue, redis.Z{Score: float64(due), Member: "t1"}).Err(); err != nil {
				t.Fatal(err)
			}
			a.handBack(res.items)

			got, err := a.claimBatch(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if tc.ahead > 0 {
				if len(got.items) != 0 {
					t.Fatalf("claimed %+v an hour before the producer's deadline", got.items)
				}
				tk, err := e.cl.GetTask(ctx, "t1")
				if err != nil {
					t.Fatalf("t1 after the hand-back: %v (lost)", err)
				}
				if tk.State != client.StateQueued || tk.Deadline.UnixMilli() != due {
					t.Fatalf("t1 after the hand-back and a claim: %s due %v, want queued at the producer's %v", tk.State, tk.Deadline, time.UnixMilli(due))
				}
				if n, _ := e.RDB.HExists(ctx, e.Keys.Lease, "t1").Result(); n {
					t.Errorf("t1 keeps a lease record after the claim dropped its stale backoff")
				}
				// The producer's deadline comes (moved, as data, to now).
				e.RDB.ZAdd(ctx, e.Keys.Queue, redis.Z{Score: float64(time.Now().Add(-time.Second).UnixMilli()), Member: "t1"})
				if got, err = a.claimBatch(ctx); err != nil {
					t.Fatal(err)
				}
			}
			if len(got.items) != 1 || got.items[0].serial != "t1" {
				t.Fatalf("claim of the due producer's entry: %+v, want t1 once", got.items)
			}
			if got.items[0].attempts != 0 {
				t.Errorf("the producer's new schedule claimed with attempts %d, want 0", got.items[0].attempts)
			}
			if n := e.card(e.Keys.Queue) + e.card(e.Keys.Inflight); n != 1 {
				t.Errorf("t1 in %d places after its claim, want 1 ({Q}:inflight)", n)
			}
		})
	}
}
