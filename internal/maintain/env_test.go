package maintain

import (
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

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

// env is one test's slice of the real servers: a queue's keys and a
// database of its own with the reference orders table.
type env struct {
	t     testing.TB
	rdb   *redis.Client
	keys  queue.Keys
	db    *sqlx.DB // the test's own checks
	store *orders.Store
	m     *metrics.Metrics
}

func orderStatements() orders.Statements { return orders.DefaultStatements() }

func newEnv(t *testing.T, stmts orders.Statements) *env {
	t.Helper()
	e := newRedisEnv(t)
	e.db, _ = testenv.Postgres(t)
	e.store = orders.NewStore(e.db, stmts)
	return e
}

// newRedisEnv is an env whose test gives it its database.
func newRedisEnv(t *testing.T) *env {
	t.Helper()
	rdb, keys := testenv.Redis(t)
	return &env{t: t, rdb: rdb, keys: keys, m: metrics.New(prometheus.NewRegistry(), "test", "test")}
}

// newProxiedEnv is an env whose order store reaches PostgreSQL through a
// proxy the test controls (e.db does not).
func newProxiedEnv(t *testing.T) (*env, *testenv.Proxy) {
	t.Helper()
	e := newRedisEnv(t)
	db, viaProxy, _, px := testenv.PostgresViaProxy(t)
	e.db = db
	e.store = orders.NewStore(viaProxy, orderStatements())
	return e, px
}

// The fixtures of internal/testenv (orders.go) on e's servers.

func (e *env) redisNow() time.Time {
	e.t.Helper()
	return testenv.RedisNow(e.t, e.rdb)
}

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
