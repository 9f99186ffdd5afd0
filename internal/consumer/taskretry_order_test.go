package consumer

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// How a task batch's retries that spend no attempt come due
// (retryNoAttempt): the tasks the batch never tried first, then the
// unavailable ones, then those tried alone, so the next claim meets first
// what the batch never reached. Written from an adversary's tests of the
// change that brought the order in.

// outcomeByName maps a task id's first letter to what an action said of
// it: l Later, u Unavailable, n NotTried, f an attempt spent, else done.
func outcomeByName(_ context.Context, ts []Task) []error {
	errs := make([]error, len(ts))
	for i, tk := range ts {
		switch tk.ID[0] {
		case 'l':
			errs[i] = Later(errors.New("row locked"))
		case 'u':
			errs[i] = Unavailable(errors.New("database away"))
		case 'n':
			errs[i] = NotTried(errors.New("not tried: the batch's time ran out"))
		case 'f':
			errs[i] = errors.New("the task's own failure")
		}
	}
	return errs
}

// retryExpiry is when the task id's retry is due (its {Q}:inflight score).
func (e *env) retryExpiry(id string) float64 {
	e.T.Helper()
	s, err := e.RDB.ZScore(context.Background(), e.Keys.Inflight, id).Result()
	if err != nil {
		e.T.Fatalf("%s is not backing off: %v", id, err)
	}
	return s
}

// spentNone checks that each of ids is still there, alive, with no
// attempt spent.
func (e *env) spentNone(ids ...string) {
	e.T.Helper()
	for _, id := range ids {
		tk, err := e.cl.GetTask(context.Background(), id)
		if err != nil {
			e.T.Errorf("%s lost: %v", id, err)
			continue
		}
		if tk.Attempts != 0 || tk.State == client.StateDead {
			e.T.Errorf("%s: %s with %d attempts, want 0 spent", id, tk.State, tk.Attempts)
		}
	}
}

func TestTaskRetriesComeDueUntriedThenUnavailableThenTriedAlone(t *testing.T) {
	t.Parallel()
	for _, withDown := range []bool{true, false} {
		t.Run(fmt.Sprint("unavailable tasks: ", withDown), func(t *testing.T) {
			e := newRedisEnv(t)
			ids := []string{"l1", "n1", "f1", "g1", "n2", "l2"}
			if withDown {
				ids = append(ids, "u1", "u2")
			}
			for _, id := range ids {
				e.putDue(id, `{}`)
			}
			c := e.consumer(Config{MaxAttempts: 3, Process: outcomeByName, Retry: func(int) time.Duration { return time.Hour }})
			res, err := c.claimBatch(context.Background())
			if err != nil || len(res.items) != len(ids) {
				t.Fatalf("claim: %v, %d items, want %d", err, len(res.items), len(ids))
			}
			start := time.Now()
			c.process(context.Background(), res.items)
			took := time.Since(start)
			lastUntried := max(e.retryExpiry("n1"), e.retryExpiry("n2"))
			firstAlone := min(e.retryExpiry("l1"), e.retryExpiry("l2"))
			if withDown {
				firstDown, lastDown := min(e.retryExpiry("u1"), e.retryExpiry("u2")), max(e.retryExpiry("u1"), e.retryExpiry("u2"))
				if !(lastUntried < firstDown && lastDown < firstAlone) {
					t.Errorf("due: untried up to %v, unavailable %v–%v, tried alone from %v; want them in that order",
						lastUntried, firstDown, lastDown, firstAlone)
				}
				e.spentNone("u1", "u2")
				// The worker waits out the dependency backoff (from 50 ms).
				if took < 40*time.Millisecond {
					t.Errorf("the batch's bookkeeping took %v: no dependency wait with unavailable tasks", took)
				}
			} else if !(lastUntried < firstAlone) {
				t.Errorf("due: untried up to %v, tried alone from %v; want the untried first", lastUntried, firstAlone)
			}
			e.spentNone("l1", "l2", "n1", "n2")
			if tk, err := e.cl.GetTask(context.Background(), "f1"); err != nil || tk.Attempts != 1 {
				t.Errorf("f1, its own failure: %+v, %v; want one attempt spent", tk, err)
			}
			// Every task that was not done counts as a failed close, the
			// untried included (their batch's statement failed for them).
			want := float64(len(ids) - 1)
			if got := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageClose)); got != want {
				t.Errorf("errors_total{stage=close} = %v, want %v", got, want)
			}
		})
	}
}

// A batch whose only failures are tasks it never tried (its time ran out
// before it could isolate anything) says so, and backs them off as it
// would a task tried and found locked: a batch that keeps running out of
// time must not come back every few hundred milliseconds, unseen.
func TestTaskBatchOfOnlyUntriedTasksBacksOffAndSaysSo(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	hourAgo := time.Now().Add(-time.Hour)
	for _, id := range []string{"n1", "n2", "g1"} {
		if _, _, err := e.cl.PutTask(ctx, id, []byte(`{}`), hourAgo, client.Create); err != nil {
			t.Fatal(err)
		}
	}
	core, logs := observer.New(zap.WarnLevel)
	c := e.consumer(Config{MaxAttempts: 3, Process: outcomeByName})
	c.log = zap.New(core)
	res := claimN(t, c, 3)
	c.process(ctx, res.items)
	// An hour overdue: contendedBackoff gives at least a quarter of
	// BackoffMax (5 min by default), untriedBackoff at most half a second.
	due := time.UnixMilli(int64(e.retryExpiry("n1"))).Sub(e.RedisNow())
	if due < time.Minute {
		t.Errorf("untried tasks an hour overdue due again in %v, want the backoff of a contended task (minutes)", due)
	}
	e.spentNone("n1", "n2")
	if got := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageClose)); got != 2 {
		t.Errorf("errors_total{stage=close} = %v, want 2", got)
	}
	if logs.FilterMessageSnippet("not tried").Len() != 1 {
		t.Errorf("logged %v, want one warning about the untried tasks", logs.All())
	}
	tk, err := e.cl.GetTask(ctx, "n1")
	if err != nil || tk.LastError != "not tried: the batch's time ran out" {
		t.Errorf("n1: %+v, %v; want the action's reason as last_error", tk, err)
	}
}

// A producer reschedules an untried and an unavailable task and deletes
// one tried alone while the batch runs: every group's retry is a
// compare-and-set on the lease, so the producer's writes stand.
func TestTaskRetryGroupsLeaveTheProducersWritesAlone(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	for _, id := range []string{"n1", "n2", "l1", "l2", "u1", "u2"} {
		e.putDue(id, `{"v":1}`)
	}
	far := time.Now().Add(time.Hour)
	c := e.consumer(Config{MaxAttempts: 3, Process: func(ctx context.Context, ts []Task) []error {
		for _, id := range []string{"n1", "u1"} {
			if _, _, err := e.cl.PutTask(ctx, id, []byte(`{"v":2}`), far, client.Reschedule); err != nil {
				t.Error(err)
			}
		}
		if _, err := e.cl.DeleteTasks(ctx, "l1"); err != nil {
			t.Error(err)
		}
		return outcomeByName(ctx, ts)
	}})
	stop := make(chan struct{})
	close(stop)
	c.stopping = stop // cut the dependency wait
	res := claimN(t, c, 6)
	c.process(ctx, res.items)
	for _, id := range []string{"n1", "u1"} {
		tk, err := e.cl.GetTask(ctx, id)
		if err != nil || tk.State != client.StateQueued || tk.Deadline.Sub(far).Abs() > 2*time.Millisecond {
			t.Errorf("%s: the producer's reschedule lost: %+v, %v", id, tk, err)
		}
		if p := e.payloadOf(id); p != `{"v":2}` {
			t.Errorf("%s: payload %q, want the producer's", id, p)
		}
		if _, err := e.RDB.ZScore(ctx, e.Keys.Inflight, id).Result(); err == nil {
			t.Errorf("%s is backing off as well as queued", id)
		}
	}
	if _, err := e.cl.GetTask(ctx, "l1"); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("l1, deleted by its producer, came back: %v", err)
	}
	e.spentNone("n2", "l2", "u2")
}

// Redis fails one of the ten retry scripts of a batch's groups — the nine
// untried tasks go in eight runs (claimed in descending id order: one run
// each, the last run taking the rest: maxRetryRuns), then the unavailable
// (one run), then the one tried alone — before the script ran or after
// (its reply lost). No task is lost and none spends an attempt: a group
// whose retry failed stays leased, and comes back when its lease ends.
func TestTaskRetryGroupsLoseNothingWhenRedisFailsMidway(t *testing.T) {
	t.Parallel()
	for _, ran := range []bool{false, true} {
		for _, nth := range []int64{1, 2, 5, 8, 9, 10} {
			t.Run(fmt.Sprintf("script %d fails, ran %v", nth, ran), func(t *testing.T) {
				e := newRedisEnv(t)
				ctx := context.Background()
				base := time.Now().Add(-time.Minute)
				var ids []string
				for i := 9; i >= 1; i-- { // descending ids, ascending deadlines
					id := fmt.Sprintf("n%d", i)
					ids = append(ids, id)
					if _, _, err := e.cl.PutTask(ctx, id, []byte(`{}`), base.Add(time.Duration(9-i)*time.Second), client.Create); err != nil {
						t.Fatal(err)
					}
				}
				for _, id := range []string{"u1", "u2", "l1", "g1"} {
					ids = append(ids, id)
					if _, _, err := e.cl.PutTask(ctx, id, []byte(`{}`), base.Add(20*time.Second), client.Create); err != nil {
						t.Fatal(err)
					}
				}
				c := e.consumer(Config{MaxAttempts: 2, Process: outcomeByName, Lease: time.Minute})
				stop := make(chan struct{})
				close(stop)
				c.stopping = stop // cut the dependency wait
				hook := &failNthRetry{fail: map[int64]bool{nth: true}, ran: ran}
				broken := redis.NewClient(e.RDB.Options())
				t.Cleanup(func() { broken.Close() })
				broken.AddHook(hook)
				c.rdb, c.q = broken, queue.NewStore(broken, c.cfg.Keys)
				res, err := c.claimBatch(ctx)
				if err != nil || len(res.items) != len(ids) {
					t.Fatalf("claim: %v, %d items, want %d", err, len(res.items), len(ids))
				}
				c.process(ctx, res.items)
				if n := hook.n.Load(); n < nth {
					t.Fatalf("%d retry scripts ran, fewer than the %d-th this test fails: it proved nothing", n, nth)
				}
				kept := slices.DeleteFunc(slices.Clone(ids), func(id string) bool { return id == "g1" })
				e.spentNone(kept...)
				// Every lease and backoff ends now (task queues lease per
				// member, in {Q}:inflight): moved by data, not waited out.
				e.dueAll()
				var again []string
				ok := e.consumer(Config{MaxAttempts: 2, Process: func(_ context.Context, ts []Task) []error {
					for _, tk := range ts {
						again = append(again, tk.ID)
						if tk.Attempts != 0 {
							t.Errorf("%s ran again with %d attempts spent, want 0", tk.ID, tk.Attempts)
						}
					}
					return make([]error, len(ts))
				}})
				r2, err := ok.claimBatch(ctx)
				if err != nil {
					t.Fatal(err)
				}
				ok.process(ctx, r2.items)
				slices.Sort(again)
				slices.Sort(kept)
				if !slices.Equal(again, kept) {
					t.Errorf("ran again %v, want every task not done the first time: %v", again, kept)
				}
			})
		}
	}
}
