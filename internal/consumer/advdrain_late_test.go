package consumer

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
)

// Since the drain's timer counts from the stop (Run starts it when ctx
// ends, not when the scan loop returns), the cut (workCtx cancelled,
// bookEnd set) can come while the scan loop is still inside a claim:
// Redis ran the claim (the entries are leased) and its reply comes after
// the cut — a stalled primary, a client whose read timeout is longer than
// the drain timeout. scan then dispatches that claim to a worker whose
// workCtx is already cancelled, and whose bookkeeping deadline
// (c.bookEnd) may already have passed. Run's contract (step 3): what is
// still running is handed back to the queue with its true deadlines, on a
// fresh, bounded context. Such a claim must be handed back too — never
// closed, never left leased until its lease expires.

// holdClaim is a go-redis hook that, once armed, holds the reply of the
// first claim of queue after which want reports true (Redis ran it: its
// entries are leased), until release is closed. Every other command
// passes.
type holdClaim struct {
	queue   string
	want    func() bool
	armed   atomic.Bool
	taken   atomic.Bool
	held    chan struct{} // closed when the claim's reply is being held
	release chan struct{}
}

func newHoldClaim(queue string, want func() bool) *holdClaim {
	return &holdClaim{queue: queue, want: want, held: make(chan struct{}), release: make(chan struct{})}
}

func (h *holdClaim) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *holdClaim) isClaim(cmd redis.Cmder) bool {
	a := cmd.Args()
	return len(a) > 3 && fmt.Sprint(a[0]) == "evalsha" && fmt.Sprint(a[2]) == "10" && fmt.Sprint(a[3]) == h.queue
}

func (h *holdClaim) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if err == nil && h.armed.Load() && h.isClaim(cmd) && !h.taken.Load() && h.want() && h.taken.CompareAndSwap(false, true) {
			close(h.held)
			<-h.release
		}
		return err
	}
}

func (h *holdClaim) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// awaitBookEndPassed waits until the drain's cut has come and its
// bookkeeping deadline (BookkeepingTimeout after it) has passed.
func awaitBookEndPassed(t *testing.T, c *Consumer) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		end := c.bookEnd.Load()
		if end != 0 && time.Now().UnixNano() > end+int64(100*time.Millisecond) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the drain's cut did not come, or its bookkeeping deadline did not pass, within a minute (bookEnd %d)", end)
		}
		time.Sleep(20 * time.Millisecond) // polling a deadline that passes with time
	}
}

// A task queue's claim whose reply comes after the drain's cut, and after
// the cut's bookkeeping deadline (BookkeepingTimeout later): processTasks
// reads the tasks' payloads (loadTasks) under c.bookkeeping(), whose
// deadline has passed, so the read fails at once and the tasks are left
// leased ("they return when their lease expires") instead of handed back
// (Release, with its own fresh deadline). Before the change the drain's
// timer began only once the scan loop returned, so every claim reached a
// worker before the cut and this could not happen.
//
// FAILS today: the late claim's task is left leased for its whole lease
// (3 minutes here; with CountRedeliveries, its re-claim then spends an
// attempt).
func TestAdvDrainLateTaskClaimAfterTheCutIsHandedBack(t *testing.T) {
	e := newRedisEnv(t)
	ctx := context.Background()
	put := func(id string) {
		t.Helper()
		if _, _, err := e.cl.PutTask(ctx, id, json.RawMessage(`{}`), time.Now().Add(-time.Second), client.Create); err != nil {
			t.Fatal(err)
		}
	}
	state := func(id string) client.State {
		t.Helper()
		tk, err := e.cl.GetTask(ctx, id)
		if err != nil {
			t.Fatalf("get task %s: %v", id, err)
		}
		return tk.State
	}
	hook := newHoldClaim(e.Keys.Queue, func() bool {
		tk, err := e.cl.GetTask(context.Background(), "late")
		return err == nil && tk.State == client.StateLeased
	})
	rdb := redis.NewClient(e.RDB.Options())
	t.Cleanup(func() { rdb.Close() })
	rdb.AddHook(hook)

	began := make(chan struct{})
	var beganOnce sync.Once
	var lateRuns atomic.Int32
	process := func(ctx context.Context, ts []Task) []error {
		errs := make([]error, len(ts))
		for i, tk := range ts {
			if tk.ID == "inflight" {
				beganOnce.Do(func() { close(began) })
				<-ctx.Done() // a batch that never finishes by itself
				errs[i] = ctx.Err()
				continue
			}
			lateRuns.Add(1)
			errs[i] = ctx.Err()
		}
		return errs
	}
	const drain = 300 * time.Millisecond
	m := metrics.New(prometheus.NewRegistry(), "test", "test")
	c, err := New(Config{Keys: e.Keys, Process: process, HeadCheck: 20 * time.Millisecond, Workers: 2, BatchSize: 1,
		Lease: 3 * time.Minute, StatementTimeout: 2 * time.Minute, DrainTimeout: drain}, rdb, nil, m,
		zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	if err != nil {
		t.Fatal(err)
	}
	put("inflight")
	cancel, release, ran := runReleasing(t, c, hook.release)
	select {
	case <-began:
	case <-time.After(30 * time.Second):
		t.Fatal("the first task's action did not begin within 30 s")
	}
	// The scanner, one worker free, claims "late"; Redis runs the claim
	// and its reply is held.
	hook.armed.Store(true)
	put("late")
	select {
	case <-hook.held:
	case <-time.After(30 * time.Second):
		t.Fatal("the scanner did not claim the second task within 30 s")
	}
	cancel()
	// The drain's cut comes while the claim's reply is still held; the
	// reply comes once the cut's bookkeeping deadline has passed.
	awaitBookEndPassed(t, c)
	release()
	select {
	case <-ran:
	case <-time.After(time.Minute):
		t.Fatal("Run did not return within a minute of the held reply's release")
	}
	if got := state("inflight"); got == client.StateLeased {
		t.Errorf("the batch cut by the drain was left leased (%s), want handed back", got)
	}
	if got := state("late"); got == client.StateLeased {
		t.Errorf("the task whose claim's reply came after the drain's cut is left %s until its lease (3m) expires, "+
			"want handed back (Run step 3); its action ran %d times", got, lateRuns.Load())
	}
	if got := testutil.ToFloat64(m.Inflight); got != 0 {
		t.Errorf("%v tasks still counted in flight after Run returned", got)
	}
}

// The order queue's side of the same interleaving: a claim whose reply
// comes after the drain's cut and its bookkeeping deadline is handed back
// (Settle fails at once on the cancelled workCtx; failed hands the claim
// back on handBackWith's own deadline) and none of its orders is closed.
func TestAdvDrainLateOrderClaimAfterTheCutIsHandedBackNotClosed(t *testing.T) {
	e := newEnv(t, orderStatements())
	past := e.RedisNow().Add(-time.Second)
	first := e.Orders("drainlate-a", 2, past)
	late := e.Orders("drainlate-b", 3, past)
	hook := newHoldClaim(e.Keys.Queue, func() bool {
		en, err := e.cl.Get(context.Background(), late[0])
		return err == nil && en.State == client.StateLeased
	})
	rdb := redis.NewClient(e.RDB.Options())
	t.Cleanup(func() { rdb.Close() })
	rdb.AddHook(hook)
	store := &firstHeldStore{heldStore: heldStore{Store: e.Store, began: make(chan struct{}), cut: make(chan struct{})}, first: first[0]}
	const drain = 300 * time.Millisecond
	m := metrics.New(prometheus.NewRegistry(), "test", "test")
	c, err := New(Config{Keys: e.Keys, HeadCheck: 20 * time.Millisecond, Workers: 2, BatchSize: 10,
		Lease: 3 * time.Minute, StatementTimeout: 2 * time.Minute, DrainTimeout: drain}, rdb, store, m,
		zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	if err != nil {
		t.Fatal(err)
	}
	e.Enqueue(first, past)
	cancel, release, ran := runReleasing(t, c, hook.release)
	select {
	case <-store.began:
	case <-time.After(30 * time.Second):
		t.Fatal("the first batch's close did not begin within 30 s")
	}
	hook.armed.Store(true)
	e.Enqueue(late, past)
	select {
	case <-hook.held:
	case <-time.After(30 * time.Second):
		t.Fatal("the scanner did not claim the second batch within 30 s")
	}
	closesBefore := testutil.ToFloat64(m.Closed)
	cancel()
	awaitBookEndPassed(t, c)
	release()
	select {
	case <-ran:
	case <-time.After(time.Minute):
		t.Fatal("Run did not return within a minute of the held reply's release")
	}
	for _, s := range append(append([]string{}, first...), late...) {
		en, err := e.cl.Get(context.Background(), s)
		if err != nil {
			t.Fatalf("get %s: %v", s, err)
		}
		if en.State != client.StateQueued {
			t.Errorf("%s is %s after Run returned, want queued (handed back)", s, en.State)
		}
		if st := e.Status(s); st != "pending" {
			t.Errorf("order %s is %s after a shutdown that closed nothing, want pending", s, st)
		}
	}
	if got := testutil.ToFloat64(m.Closed) - closesBefore; got != 0 {
		t.Errorf("%v orders counted closed after the cut", got)
	}
	if got := testutil.ToFloat64(m.Inflight); got != 0 {
		t.Errorf("%v orders still counted in flight after Run returned", got)
	}
}

// firstHeldStore holds the close of the batch that has first (heldStore);
// every other batch is closed by the real Store.
type firstHeldStore struct {
	heldStore
	first string
}

func (s *firstHeldStore) Settle(ctx context.Context, serials []string, fence orders.Fence) (orders.Outcome, error) {
	for _, sn := range serials {
		if sn == s.first {
			return s.heldStore.Settle(ctx, serials, fence)
		}
	}
	return s.Store.Settle(ctx, serials, fence)
}

// holdNext is a go-redis hook that, once armed, holds the first command
// sent (after Redis answered it) until release is closed.
type holdNext struct {
	armed   atomic.Bool
	taken   atomic.Bool
	held    chan struct{}
	release chan struct{}
}

func (h *holdNext) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *holdNext) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if h.armed.Load() && h.taken.CompareAndSwap(false, true) {
			close(h.held)
			<-h.release
		}
		return err
	}
}

func (h *holdNext) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// With nothing in flight, a scan loop whose Redis call (an idle head
// check) is held past the drain timeout now makes Run log "drain timeout
// passed; handing back unfinished claims" — a warning about a drain that
// had nothing to drain, on every stop against a slow Redis. Before the
// change the timer started after the loop returned, and with no batch in
// flight Run returned at once, silently.
//
// FAILS today (a misleading warning only; nothing is lost or closed).
func TestAdvDrainNoWarningWhenNothingWasInFlight(t *testing.T) {
	e := newRedisEnv(t)
	core, logs := observer.New(zap.WarnLevel)
	hook := &holdNext{held: make(chan struct{}), release: make(chan struct{})}
	rdb := redis.NewClient(e.RDB.Options())
	t.Cleanup(func() { rdb.Close() })
	rdb.AddHook(hook)
	const drain = 200 * time.Millisecond
	m := metrics.New(prometheus.NewRegistry(), "test", "test")
	c, err := New(Config{Keys: e.Keys, HeadCheck: 20 * time.Millisecond, SharedWake: true, Workers: 1,
		Lease: time.Minute, StatementTimeout: 30 * time.Second, DrainTimeout: drain}, rdb, unusedStore{}, m, zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	cancel, release, ran := runReleasing(t, c, hook.release)
	hook.armed.Store(true) // the queue is empty: the scanner's next call is a claim or a head check
	select {
	case <-hook.held:
	case <-time.After(30 * time.Second):
		t.Fatal("the scanner sent nothing to Redis within 30 s")
	}
	cancel()
	// The scanner's call is held for ten drain timeouts: long enough for
	// the timer to fire, if it is going to.
	warned := false
	for end := time.Now().Add(10 * drain); time.Now().Before(end) && !warned; time.Sleep(10 * time.Millisecond) {
		warned = logs.FilterMessageSnippet("drain timeout passed").Len() > 0
	}
	release()
	select {
	case <-ran:
	case <-time.After(time.Minute):
		t.Fatal("Run did not return within a minute of the held call's release")
	}
	if warned || logs.FilterMessageSnippet("drain timeout passed").Len() > 0 {
		t.Errorf("Run warned that the drain timed out and handed back unfinished claims, with no batch in flight: %s",
			lastMessages(logs, 5))
	}
}

// runReleasing runs c in the background: cancel ends Run's context,
// release closes hold (once), ran is closed when Run has returned. The
// test's cleanup does all three.
func runReleasing(t *testing.T, c *Consumer, hold chan struct{}) (cancel context.CancelFunc, release func(), ran <-chan struct{}) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); c.Run(ctx) }()
	release = sync.OnceFunc(func() { close(hold) })
	t.Cleanup(func() {
		cancel()
		release()
		<-done
	})
	return cancel, release, done
}
