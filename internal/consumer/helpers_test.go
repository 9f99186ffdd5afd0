package consumer

import (
	"context"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// go-redis and lib/pq keep pool reapers that end asynchronously.
		goleak.IgnoreTopFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).reaper"),
		goleak.IgnoreTopFunction("database/sql.(*DB).connectionOpener"),
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
	)
}

// env is one test's slice of the real servers.
type env struct {
	t     testing.TB
	rdb   *redis.Client
	keys  queue.Keys
	db    *sqlx.DB
	store *orders.Store
	m     *metrics.Metrics
	cl    *client.Client
	st    *queue.Store // the store of keys
}

func newEnv(t *testing.T, stmts orders.Statements) *env {
	t.Helper()
	e := newRedisEnv(t)
	e.db, _ = testenv.Postgres(t)
	e.store = orders.NewStore(e.db, stmts)
	return e
}

// newRedisEnv is an env without a database, for tests of the scripts alone.
func newRedisEnv(t testing.TB) *env {
	t.Helper()
	rdb, keys := testenv.Redis(t)
	cl, err := client.New(rdb, keys.Queue)
	if err != nil {
		t.Fatal(err)
	}
	return &env{t: t, rdb: rdb, keys: keys, m: metrics.New(prometheus.NewRegistry(), "test", "test"), cl: cl,
		st: queue.NewStore(rdb, keys)}
}

func (e *env) consumer(cfg Config) *Consumer {
	cfg.Keys = e.keys
	if cfg.HeadCheck == 0 {
		cfg.HeadCheck = 20 * time.Millisecond
	}
	// A Redis-only env still needs a Store for an order queue (New refuses
	// none); its tests never reach a close, and one that did would panic.
	var store Store = unusedStore{}
	if e.store != nil {
		store = e.store
	}
	c, err := New(cfg, e.rdb, store, e.m, zaptest.NewLogger(e.t, zaptest.Level(zap.WarnLevel)))
	if err != nil {
		e.t.Fatal(err)
	}
	return c
}

// unusedStore is a Store for consumers a test builds but never runs: New
// wants one for the order queue.
type unusedStore struct{ Store }

// redisNow is Redis's clock.
func (e *env) redisNow() time.Time {
	e.t.Helper()
	return testenv.RedisNow(e.t, e.rdb)
}

// The fixtures of internal/testenv (orders.go) on e's servers.

func (e *env) orders(prefix string, n int, deadline time.Time) []string {
	e.t.Helper()
	return testenv.InsertOrders(e.t, e.db, prefix, n, deadline)
}

func (e *env) enqueue(serials []string, deadline time.Time) {
	e.t.Helper()
	testenv.Enqueue(e.t, e.rdb, e.keys.Queue, serials, deadline)
}

func (e *env) zadd(key string, serials []string, deadline time.Time) {
	e.t.Helper()
	testenv.Enqueue(e.t, e.rdb, key, serials, deadline)
}

func (e *env) shardKeys(shards int) []queue.Keys {
	e.t.Helper()
	return testenv.ShardKeys(e.t, e.rdb, e.keys, shards)
}

func (e *env) status(serial string) string {
	e.t.Helper()
	return testenv.OrderStatus(e.t, e.db, serial)
}

func (e *env) closeTrigger(name, when, action string) {
	e.t.Helper()
	testenv.CloseTrigger(e.t, e.db, name, when, action)
}

func (e *env) failClose(serial, code string) {
	e.t.Helper()
	testenv.FailClose(e.t, e.db, serial, code)
}

func (e *env) poisonOrder(serial string) {
	e.t.Helper()
	testenv.PoisonOrder(e.t, e.db, serial)
}

func (e *env) closeFailures() int {
	e.t.Helper()
	return testenv.CloseFailures(e.t, e.db)
}

func (e *env) slowCloseOf(serial string) {
	e.t.Helper()
	testenv.SlowCloseOf(e.t, e.db, serial)
}

func (e *env) slowEveryClose() {
	e.t.Helper()
	testenv.SlowEveryClose(e.t, e.db)
}

func (e *env) slowCloses() int {
	e.t.Helper()
	return testenv.SlowCloses(e.t, e.db)
}

func (e *env) statusCounts() map[string]int {
	e.t.Helper()
	rows, err := e.db.Query("SELECT status, count(*) FROM orders GROUP BY status")
	if err != nil {
		e.t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var s string
		var n int
		if err := rows.Scan(&s, &n); err != nil {
			e.t.Fatal(err)
		}
		out[s] = n
	}
	return out
}

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
	e.t.Helper()
	n, err := e.rdb.ZCard(context.Background(), key).Result()
	if err != nil {
		e.t.Fatal(err)
	}
	return n
}

// claimBatch claims up to a full batch.
func (c *Consumer) claimBatch(ctx context.Context) (claimResult, error) {
	return c.claim(ctx, c.cfg.BatchSize)
}

// held is how many entries of the queue are leased or backing off, in
// either layout (batch leases and per-member entries).
func (e *env) held() int64 { return e.heldIn(e.keys) }

func (e *env) heldIn(k queue.Keys) int64 {
	e.t.Helper()
	st, err := queue.ReadStats(context.Background(), e.rdb, k)
	if err != nil {
		e.t.Fatal(err)
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
