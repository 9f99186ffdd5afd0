package preflight

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

func warning(m *metrics.Metrics, check string) float64 {
	return testutil.ToFloat64(m.ConfigWarning.WithLabelValues(check))
}

// TestRedisWarnsAboutEvictionAndNoPersistence: a Redis that may evict the
// queue and persists nothing is named in the log and in the gauges.
func TestRedisWarnsAboutEvictionAndNoPersistence(t *testing.T) {
	rdb, _ := testenv.PrivateRedisWith(t, nil, "--maxmemory-policy", "allkeys-lru", "--save", "", "--appendonly", "no")
	m := metrics.New(prometheus.NewRegistry(), "test", "test")
	core, logs := observer.New(zap.WarnLevel)
	if err := Redis(context.Background(), rdb, m, zap.New(core)); err != nil {
		t.Fatal(err)
	}
	if warning(m, metrics.CheckRedisEviction) != 1 || warning(m, metrics.CheckRedisPersistence) != 1 || warning(m, metrics.CheckRedisVersion) != 0 {
		t.Errorf("warnings eviction=%v persistence=%v version=%v, want 1 1 0", warning(m, metrics.CheckRedisEviction),
			warning(m, metrics.CheckRedisPersistence), warning(m, metrics.CheckRedisVersion))
	}
	if logs.FilterMessageSnippet("maxmemory-policy is not noeviction").Len() != 1 || logs.FilterMessageSnippet("persists nothing").Len() != 1 {
		t.Errorf("log: %v", logs.All())
	}
}

// TestDatabaseWarnsWithoutThePendingIndex: the reference schema without
// its partial index is ready (not fatal) but warned about.
func TestDatabaseWarnsWithoutThePendingIndex(t *testing.T) {
	db, dsn := testenv.Postgres(t)
	if _, err := db.Exec(`DO $$ DECLARE i text; BEGIN
		FOR i IN SELECT indexname FROM pg_indexes WHERE tablename = 'orders' AND indexdef ILIKE '%WHERE%' LOOP
			EXECUTE 'DROP INDEX ' || quote_ident(i); END LOOP; END $$`); err != nil {
		t.Fatal(err)
	}
	m := metrics.New(prometheus.NewRegistry(), "test", "test")
	d := Database{DB: db, URL: dsn, ReferenceSchema: true, Metrics: m, Log: zap.NewNop()}
	if err := d.Prepare(context.Background()); err != nil {
		t.Fatal(err)
	}
	if warning(m, metrics.CheckPendingIndex) != 1 || warning(m, metrics.CheckSchemaVersion) != 0 {
		t.Errorf("warnings pending_index=%v schema_version=%v, want 1 0", warning(m, metrics.CheckPendingIndex), warning(m, metrics.CheckSchemaVersion))
	}
}

// TestDatabaseRefusesAWrongStatementWithoutItsPassword: a statement that
// does not verify is a StatementError (the daemon exits 2), and the
// connection string's password never appears in it.
func TestDatabaseRefusesAWrongStatementWithoutItsPassword(t *testing.T) {
	db, dsn := testenv.Postgres(t)
	m := metrics.New(prometheus.NewRegistry(), "test", "test")
	const secret = "hunter2hunter2"
	d := Database{DB: db, URL: dsn, Metrics: m, Log: zap.NewNop(), Secrets: []string{"postgres://u:" + secret + "@h/db"},
		Statements: orders.Statements{Close: "SELECT s FROM " + secret + " s WHERE $1::text[] IS NOT NULL"}}
	err := d.Prepare(context.Background())
	var se *orders.StatementError
	if !errors.As(err, &se) || se.Setting != "ORDERDELAY_CLOSE_SQL" {
		t.Fatalf("Prepare: %v, want a StatementError for ORDERDELAY_CLOSE_SQL", err)
	}
	if strings.Contains(err.Error(), secret) {
		t.Errorf("the error shows the password: %v", err)
	}
}

// TestRedisWithoutInfo: a user refused INFO (an ACL) is told that the
// version cannot be checked, once: Redis returns nil, so WatchRedis does
// not ask again every few seconds for an answer that never comes.
func TestRedisWithoutInfo(t *testing.T) {
	rdb, _ := aclServer(t, nil, "~*", "&*", "+@all", "-info")
	m := metrics.New(prometheus.NewRegistry(), "test", "test")
	core, logs := observer.New(zap.InfoLevel)
	if err := Redis(context.Background(), rdb, m, zap.New(core)); err != nil {
		t.Fatalf("Redis: %v, want nil", err)
	}
	if logs.FilterMessageSnippet("cannot read redis INFO").Len() != 1 || warning(m, metrics.CheckRedisVersion) != 0 {
		t.Errorf("log %v, version warning %v; want one line saying INFO cannot be read, 0", logs.All(), warning(m, metrics.CheckRedisVersion))
	}
}
