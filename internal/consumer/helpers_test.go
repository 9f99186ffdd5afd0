package consumer

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"
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
	now, err := e.rdb.Time(context.Background()).Result()
	if err != nil {
		e.t.Fatal(err)
	}
	return now
}

// orders inserts n pending orders named prefix-000i with the given deadline
// and returns their serials.
func (e *env) orders(prefix string, n int, deadline time.Time) []string {
	e.t.Helper()
	serials := make([]string, n)
	for i := range serials {
		serials[i] = fmt.Sprintf("%s-%05d", prefix, i)
	}
	_, err := e.db.Exec(`INSERT INTO orders (serial_no, expires_at) SELECT s, $2 FROM unnest($1::text[]) s`,
		pq.Array(serials), deadline)
	if err != nil {
		e.t.Fatal(err)
	}
	return serials
}

// enqueue ZADDs serials with deadline, as a raw producer would.
func (e *env) enqueue(serials []string, deadline time.Time) {
	e.t.Helper()
	z := make([]redis.Z, len(serials))
	for i, s := range serials {
		z[i] = redis.Z{Score: float64(queue.DeadlineMillis(deadline)), Member: s}
	}
	if err := e.rdb.ZAdd(context.Background(), e.keys.Queue, z...).Err(); err != nil {
		e.t.Fatal(err)
	}
}

func (e *env) status(serial string) string {
	e.t.Helper()
	var s string
	if err := e.db.Get(&s, "SELECT status FROM orders WHERE serial_no = $1", serial); err != nil {
		e.t.Fatal(err)
	}
	return s
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
