package orderdelay_test

import (
	"net/url"
	"strings"
	"testing"
	"time"
)

// TestIntegrationReadOnlyDatabaseDeadLettersNothing: the database turns
// read-only (what a failover to a standby looks like: 25006) while orders
// fall due. Nothing is dead-lettered; every order closes once it is
// writable again (issue 11, item 5).
func TestIntegrationReadOnlyDatabaseDeadLettersNothing(t *testing.T) {
	w := newWorld(t)
	u, err := url.Parse(w.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	dbName := strings.TrimPrefix(u.Path, "/")
	w.db.SetMaxOpenConns(1) // one session of ours, kept read-write
	// Cut every other session of the database, so the next ones read the
	// database's new default.
	cutOthers := func() {
		t.Helper()
		if _, err := w.db.Exec(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity
			WHERE datname = $1 AND pid <> pg_backend_pid()`, dbName); err != nil {
			t.Fatal(err)
		}
	}
	const n = 300
	serials := w.createOrders("ro", n, time.Now().Add(3*time.Second))
	w.zadd(serials, float64(time.Now().Add(3*time.Second).UnixMilli()))
	d := w.start("ORDERDELAY_SCAN_INTERVAL=200ms", "ORDERDELAY_BATCH_SIZE=50")
	waitFor(t, "daemon connected to PostgreSQL", 30*time.Second, func() bool {
		return d.metrics()[`orderdelay_dependency_up{dependency="postgres"}`] == 1
	})
	// Two pools, both exported: the order path's own (4 workers + the
	// reconciler) and the shared one.
	m := d.metrics()
	for series, want := range map[string]float64{
		`go_sql_max_open_connections{db_name="orderdelay"}`:        5,
		`go_sql_max_open_connections{db_name="orderdelay_shared"}`: 2,
	} {
		if got := m[series]; got != want {
			t.Errorf("%s = %v, want %v", series, got, want)
		}
	}

	if _, err := w.db.Exec(`ALTER DATABASE ` + dbName + ` SET default_transaction_read_only = on`); err != nil {
		t.Fatal(err)
	}
	cutOthers()
	waitFor(t, "closes failing on the read-only database", 30*time.Second, func() bool {
		return d.metrics()[`orderdelay_errors_total{stage="close"}`] >= 5
	})
	m = d.metrics()
	dead := m[`orderdelay_dead_lettered_total{reason="close_failed"}`]
	t.Logf("read-only: %v close errors, %v dead-lettered, %d closed", m[`orderdelay_errors_total{stage="close"}`], dead,
		w.count(`SELECT count(*) FROM orders WHERE status = 'closed'`))
	if dead != 0 {
		t.Errorf("%v orders dead-lettered while the database was read-only, want 0", dead)
	}

	if _, err := w.db.Exec(`ALTER DATABASE ` + dbName + ` RESET default_transaction_read_only`); err != nil {
		t.Fatal(err)
	}
	cutOthers()
	waitFor(t, "every order closed once writable", 60*time.Second, func() bool {
		return w.count(`SELECT count(*) FROM orders WHERE status = 'closed'`) == n
	})
	if dead := d.metrics()[`orderdelay_dead_lettered_total{reason="close_failed"}`]; dead != 0 {
		t.Errorf("%v orders dead-lettered, want 0", dead)
	}
	if code := d.stop(); code != 0 {
		t.Fatalf("exit status %d, want 0", code)
	}
}
