package orders

import (
	"context"

	"github.com/jmoiron/sqlx"
)

// Statements that steer a transaction of a caller's own (the reconciler's
// page, the durable task loader's pass, a statement's verification) rather
// than touch a table: its advisory lock and its savepoints. Errors are
// returned as the driver gave them.

// TryAdvisoryXactLock takes the transaction-level advisory lock key in tx
// if no other session holds it, without waiting
// (pg_try_advisory_xact_lock), and reports whether it did. A lock taken is
// held until tx ends; there is no unlock.
func TryAdvisoryXactLock(ctx context.Context, tx *sqlx.Tx, key int64) (bool, error) {
	var got bool
	err := tx.QueryRowContext(ctx, "SELECT pg_try_advisory_xact_lock($1)", key).Scan(&got)
	return got, err
}

// Savepoint sets the savepoint name in tx (SAVEPOINT name). name is an SQL
// identifier written as it is, not quoted: a constant of the caller's.
func Savepoint(ctx context.Context, tx *sqlx.Tx, name string) error {
	_, err := tx.ExecContext(ctx, "SAVEPOINT "+name)
	return err
}

// RollbackToSavepoint undoes what tx did since the savepoint name, which
// stays set (ROLLBACK TO SAVEPOINT name). It also clears the error state a
// failed statement leaves tx in.
func RollbackToSavepoint(ctx context.Context, tx *sqlx.Tx, name string) error {
	_, err := tx.ExecContext(ctx, "ROLLBACK TO SAVEPOINT "+name)
	return err
}

// ReleaseSavepoint forgets the savepoint name in tx, keeping what tx did
// since (RELEASE SAVEPOINT name).
func ReleaseSavepoint(ctx context.Context, tx *sqlx.Tx, name string) error {
	_, err := tx.ExecContext(ctx, "RELEASE SAVEPOINT "+name)
	return err
}
