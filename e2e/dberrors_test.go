package e2e

import (
	"testing"
	"time"
)

// TestIntegrationReadOnlyDatabaseDeadLettersNothing: the database refuses
// writes as a standby does (25006) while orders fall due. Nothing is
// dead-lettered; every order closes once it is writable again (issue 11,
// item 5). The close runs in a transaction that lib/pq opens with BEGIN READ
// WRITE, which overrides default_transaction_read_only, so the refusal is
// made by a trigger raising 25006 while a flag row exists (a real standby is
// TestFailoverPostgresPromoteStandby's).
func TestIntegrationReadOnlyDatabaseDeadLettersNothing(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	// Read-only from the start, so every close meets it.
	w.db.MustExec(`CREATE TABLE read_only (on_ boolean)`)
	w.db.MustExec(`CREATE FUNCTION refuse_writes() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF EXISTS (SELECT 1 FROM read_only) THEN
				RAISE EXCEPTION 'cannot execute UPDATE in a read-only transaction' USING ERRCODE = '25006';
			END IF;
			RETURN NEW;
		END $$`)
	w.db.MustExec(`CREATE TRIGGER refuse_writes BEFORE UPDATE ON orders FOR EACH ROW EXECUTE FUNCTION refuse_writes()`)
	w.db.MustExec(`INSERT INTO read_only VALUES (true)`)
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

	w.db.MustExec(`DELETE FROM read_only`)
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
