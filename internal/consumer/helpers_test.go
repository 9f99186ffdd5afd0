package consumer

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// The tests mostly wait (on statement timeouts, leases, outages, a
// database of their own), so more of them run at once than there are
// cores. Those whose assertions need a good statement to finish within a
// sub-second timeout, or a round within a bounded number of short ones,
// do not call t.Parallel: they run first, alone in the package.
func TestMain(m *testing.M) {
	testenv.SetDefaultParallel(4)
	testenv.VerifyNoLeaks(m)
}

// env is one test's slice of the real servers, with the fixtures of
// testenv.Env on them.
type env struct {
	testenv.Env
	m  *metrics.Metrics
	cl *client.Client
	st *queue.Store // the store of keys
	// batches counts poisonBatch's calls: each builds orders of its own.
	batches int
}

func newEnv(t *testing.T, stmts orders.Statements) *env {
	t.Helper()
	e := newRedisEnv(t)
	e.Postgres(stmts)
	return e
}

// newRedisEnv is an env without a database, for tests of the scripts alone.
func newRedisEnv(t testing.TB) *env {
	t.Helper()
	e := &env{Env: testenv.NewEnv(t), m: metrics.New(prometheus.NewRegistry(), "test", "test")}
	cl, err := client.New(e.RDB, e.Keys.Queue)
	if err != nil {
		t.Fatal(err)
	}
	e.cl, e.st = cl, queue.NewStore(e.RDB, e.Keys)
	return e
}

func (e *env) consumer(cfg Config) *Consumer {
	cfg.Keys = e.Keys
	if cfg.HeadCheck == 0 {
		cfg.HeadCheck = 20 * time.Millisecond
	}
	// A Redis-only env still needs a Store for an order queue (New refuses
	// none); its tests never reach a close, and one that did would panic.
	var store Store = unusedStore{}
	if e.Store != nil {
		store = e.Store
	}
	c, err := New(cfg, e.RDB, store, e.m, zaptest.NewLogger(e.T, zaptest.Level(zap.WarnLevel)))
	if err != nil {
		e.T.Fatal(err)
	}
	return c
}

// unusedStore is a Store for consumers a test builds but never runs: New
// wants one for the order queue.
type unusedStore struct{ Store }

// runConsumer runs c until the returned stop is called; stop waits for Run
// to return.
func runConsumer(t *testing.T, c *Consumer) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); c.Run(ctx) }()
	var stopped bool
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		<-done
	}
	t.Cleanup(stop)
	return stop
}

// eventually polls cond (an observable state, not a clock) until it holds
// or the generous bound passes.
func eventually(t *testing.T, what string, within time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not true within %s", what, within)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// progressing polls done (a count of finished work, never falling) until
// it reaches total, and fails only if it stops growing for stuck: a bound
// on a round that makes no progress, not on how fast a loaded machine
// gets through the work.
func progressing(t *testing.T, what string, total int, stuck time.Duration, done func() int) {
	t.Helper()
	last, since := -1, time.Now()
	for {
		n := done()
		switch {
		case n >= total:
			return
		case n > last:
			last, since = n, time.Now()
		case time.Since(since) > stuck:
			t.Fatalf("%s: stuck at %d of %d for %s", what, n, total, stuck)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (e *env) card(key string) int64 {
	e.T.Helper()
	n, err := e.RDB.ZCard(context.Background(), key).Result()
	if err != nil {
		e.T.Fatal(err)
	}
	return n
}

// claimBatch claims up to a full batch.
func (c *Consumer) claimBatch(ctx context.Context) (claimResult, error) {
	return c.claim(ctx, c.cfg.BatchSize)
}

// held is how many entries of the queue are leased or backing off, in
// either layout (batch leases and per-member entries).
func (e *env) held() int64 { return e.heldIn(e.Keys) }

func (e *env) heldIn(k queue.Keys) int64 {
	e.T.Helper()
	st, err := queue.ReadStats(context.Background(), e.RDB, k)
	if err != nil {
		e.T.Fatal(err)
	}
	return st.Held
}

// anys converts serials to command arguments.
func anys(ss []string) []any {
	out := make([]any, len(ss))
	for i, s := range ss {
		out[i] = s
	}
	return out
}

// claimN claims a full batch and requires it to hold n entries.
func claimN(t *testing.T, c *Consumer, n int) claimResult {
	t.Helper()
	res, err := c.claimBatch(context.Background())
	if err != nil || len(res.items) != n {
		t.Fatalf("claim: %v, %d items, want %d", err, len(res.items), n)
	}
	return res
}

// allClosed is a condition for eventually: every one of serials closed.
func (e *env) allClosed(serials []string) func() bool {
	return func() bool {
		for _, s := range serials {
			if e.Status(s) != "closed" {
				return false
			}
		}
		return true
	}
}
