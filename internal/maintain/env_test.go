package maintain

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

func TestMain(m *testing.M) { testenv.VerifyNoLeaks(m) }

// env is one test's slice of the real servers: a queue's keys and a
// database of its own with the reference orders table, with the fixtures
// of testenv.Env on them.
type env struct {
	testenv.Env
	m *metrics.Metrics
}

func orderStatements() orders.Statements { return orders.DefaultStatements() }

func newEnv(t *testing.T, stmts orders.Statements) *env {
	t.Helper()
	e := newRedisEnv(t)
	e.Postgres(stmts)
	return e
}

// newRedisEnv is an env whose test gives it its database.
func newRedisEnv(t *testing.T) *env {
	t.Helper()
	return &env{Env: testenv.NewEnv(t), m: metrics.New(prometheus.NewRegistry(), "test", "test")}
}

// newProxiedEnv is an env whose order store reaches PostgreSQL through a
// proxy the test controls (e.DB does not).
func newProxiedEnv(t *testing.T) (*env, *testenv.Proxy) {
	t.Helper()
	e := newRedisEnv(t)
	return e, e.PostgresViaProxy(orderStatements())
}
