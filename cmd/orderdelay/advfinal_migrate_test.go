package main

import (
	"context"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	_ "github.com/lib/pq"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Adversarial test of 01052be (a bounded stage's Start is abandoned like
// its Runs). The work stage's Start is prepareDB, which with run --migrate
// applies the schema's migrations (golang-migrate: the version is marked
// dirty, the migration runs, the version is marked clean). A stop that
// comes while a migration runs — here its DDL waits on a lock, as an ALTER
// or CREATE INDEX waits behind a long transaction — used to wait for the
// migration ("a migration cannot be interrupted"); the Start is now
// abandoned after workStopBound, computed from Redis's timeouts, and the
// process ends with the migration's connection: the schema is left dirty,
// and every later `migrate` or `run --migrate` refuses it until someone
// forces the version by hand. Here the migration's backend is terminated
// once runDaemon returned, as the process's exit would end it.
func TestAdvFinalAStopDuringRunMigrateLeavesTheSchemaClean(t *testing.T) {
	_, keys := testenv.Redis(t)
	_, dsn := testenv.CreateDatabase(t)
	db, err := sqlx.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ctx := context.Background()
	// The database one migration behind: the last one to apply.
	if _, err := db.Exec(`DROP TABLE IF EXISTS orderdelay_task_log; DROP TABLE IF EXISTS orderdelay_tasks;
UPDATE ` + orders.MigrationsTable + ` SET version = 2, dirty = false;
CREATE FUNCTION wait_for_lock() RETURNS event_trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_advisory_lock(424242); PERFORM pg_advisory_unlock(424242); END $$;
CREATE EVENT TRIGGER wait_for_lock ON ddl_command_start EXECUTE FUNCTION wait_for_lock();`); err != nil {
		t.Fatal(err)
	}
	holder, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close()
	if _, err := holder.ExecContext(ctx, `SELECT pg_advisory_lock(424242)`); err != nil {
		t.Fatal(err)
	}
	released := false
	release := func() {
		if !released {
			released = true
			holder.ExecContext(ctx, `SELECT pg_advisory_unlock(424242)`) //nolint:errcheck
		}
	}
	defer release()
	cfg := daemonConfig(t, keys, dsn, map[string]string{
		"ORDERDELAY_REDIS_URL": redisURLWithReadTimeout(time.Second), "ORDERDELAY_DRAIN_TIMEOUT": "300ms",
		"ORDERDELAY_RECONCILE_INTERVAL": "0",
	})
	d := startDaemon(t, cfg, daemonOptions{migrate: true})
	var pid int
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) {
		err := db.Get(&pid, `SELECT pid FROM pg_stat_activity WHERE datname = current_database()
  AND wait_event_type = 'Lock' AND wait_event = 'advisory' AND pid <> pg_backend_pid() LIMIT 1`)
		if err == nil {
			break
		}
		if d.ended() || time.Now().After(deadline) {
			t.Fatalf("the migration never waited on the lock (ended %v: %v)", d.ended(), d.err)
		}
	}
	var dirty bool
	if err := db.Get(&dirty, `SELECT dirty FROM `+orders.MigrationsTable); err != nil || !dirty {
		t.Fatalf("the migration waits but the version is not dirty (%v, %v): the test proved nothing", dirty, err)
	}
	d.cancel()
	// A stop that abandons the migration ends at the work stage's bound;
	// one that waits for it is still running well after that bound, and
	// the test then lets the migration finish. (On a machine so loaded
	// that an abandoning stop took 5 s past its bound, the test would not
	// see it: it never fails a stop that waits.)
	select {
	case <-d.done:
	case <-time.After(workStopBoundOf(t, cfg) + 5*time.Second):
		release()
		<-d.done
		t.Logf("the stop waited for the migration")
	}
	// The process exits: its connections end.
	if _, err := db.Exec(`SELECT pg_terminate_backend($1)`, pid); err != nil {
		t.Fatal(err)
	}
	release()
	if err := db.Get(&dirty, `SELECT dirty FROM `+orders.MigrationsTable); err != nil {
		t.Fatal(err)
	}
	if dirty {
		_, merr := orders.Migrate(dsn)
		t.Errorf("a stop during run --migrate abandoned the migration (the work stage's Start, bound %v) and the process's exit "+
			"left the schema dirty: the next migrate says %v", workStopBoundOf(t, cfg), merr)
	}
}
