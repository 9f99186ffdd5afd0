package orders_test

import (
	"errors"
	"testing"
	"time"

	"github.com/lib/pq"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// TestTryAdvisoryXactLockHeldUntilTheTransactionEnds: a second
// transaction does not get the lock, without waiting, while the first
// holds it; once the first ends, it does.
func TestTryAdvisoryXactLockHeldUntilTheTransactionEnds(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	ctx := ctxT(t)
	const key = 7134920051
	a, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Rollback() //nolint:errcheck
	if got, err := orders.TryAdvisoryXactLock(ctx, a, key); err != nil || !got {
		t.Fatalf("first: %v, %v; want the lock", got, err)
	}
	if got, err := orders.TryAdvisoryXactLock(ctx, a, key); err != nil || !got {
		t.Fatalf("again in the same transaction: %v, %v; want the lock", got, err)
	}
	b, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Rollback() //nolint:errcheck
	start := time.Now()
	if got, err := orders.TryAdvisoryXactLock(ctx, b, key); err != nil || got {
		t.Fatalf("second while the first holds it: %v, %v; want no lock", got, err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("the try waited %s", d)
	}
	if err := b.Rollback(); err != nil {
		t.Fatal(err)
	}
	if err := a.Commit(); err != nil {
		t.Fatal(err)
	}
	c, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Rollback() //nolint:errcheck
	if got, err := orders.TryAdvisoryXactLock(ctx, c, key); err != nil || !got {
		t.Fatalf("after the first ended: %v, %v; want the lock", got, err)
	}
}

// TestSavepoints: rolling back to a savepoint undoes what followed it and
// clears a failed statement's error state, the savepoint staying set;
// releasing keeps the work and forgets the savepoint (3B001 after).
func TestSavepoints(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	ctx := ctxT(t)
	tx, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback() //nolint:errcheck
	exec := func(q string) error { _, err := tx.ExecContext(ctx, q); return err }
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(exec("INSERT INTO orders (serial_no, expires_at) VALUES ('sp-kept', now())"))
	must(orders.Savepoint(ctx, tx, "orderdelay_test_sp"))
	must(exec("INSERT INTO orders (serial_no, expires_at) VALUES ('sp-undone', now())"))
	if err := exec("INSERT INTO orders (serial_no, expires_at) VALUES ('sp-kept', now())"); err == nil {
		t.Fatal("a duplicate serial was inserted")
	}
	must(orders.RollbackToSavepoint(ctx, tx, "orderdelay_test_sp"))
	must(exec("INSERT INTO orders (serial_no, expires_at) VALUES ('sp-again', now())"))
	must(orders.RollbackToSavepoint(ctx, tx, "orderdelay_test_sp")) // still set
	must(exec("INSERT INTO orders (serial_no, expires_at) VALUES ('sp-released', now())"))
	must(orders.ReleaseSavepoint(ctx, tx, "orderdelay_test_sp"))
	var pqErr *pq.Error
	if err := orders.RollbackToSavepoint(ctx, tx, "orderdelay_test_sp"); !errors.As(err, &pqErr) || pqErr.Code != "3B001" {
		t.Fatalf("rollback to a released savepoint: %v, want 3B001", err)
	}
	if err := orders.ReleaseSavepoint(ctx, tx, "orderdelay_test_sp"); err == nil {
		t.Fatal("released a savepoint twice")
	}
	tx.Rollback() //nolint:errcheck // the failed release aborted it
	tx, err = db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback() //nolint:errcheck
	must(orders.Savepoint(ctx, tx, "orderdelay_test_sp"))
	must(exec("INSERT INTO orders (serial_no, expires_at) VALUES ('sp-committed', now())"))
	must(orders.ReleaseSavepoint(ctx, tx, "orderdelay_test_sp"))
	must(tx.Commit())
	var serials []string
	must(db.Select(&serials, "SELECT serial_no FROM orders ORDER BY serial_no"))
	if len(serials) != 1 || serials[0] != "sp-committed" {
		t.Errorf("rows %v, want [sp-committed]", serials)
	}
}
