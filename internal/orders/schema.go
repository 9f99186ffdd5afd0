package orders

import (
	"context"
	"fmt"

	"github.com/jmoiron/sqlx"
)

// Start-up questions about the reference schema, asked by the daemon's
// preflight (internal/preflight); they read only catalogs and our own
// tables.

// AppliedVersion is the reference schema's version in the database: the
// version golang-migrate recorded, if that migration completed (not dirty).
func AppliedVersion(ctx context.Context, db sqlx.QueryerContext) (int, error) {
	var v int
	if err := sqlx.GetContext(ctx, db, &v, "SELECT version FROM "+MigrationsTable+" WHERE NOT dirty"); err != nil {
		return 0, fmt.Errorf("schema version: %w", err)
	}
	return v, nil
}

// HasPendingIndex reports whether orders has the partial index on
// expires_at for pending rows the reconciler's overdue statement needs.
func HasPendingIndex(ctx context.Context, db sqlx.QueryerContext) (bool, error) {
	var ok bool
	err := sqlx.GetContext(ctx, db, &ok, `SELECT EXISTS (SELECT 1 FROM pg_indexes
		WHERE tablename = 'orders' AND indexdef ILIKE '%(expires_at)%' AND indexdef ILIKE '%WHERE%pending%')`)
	if err != nil {
		return false, fmt.Errorf("pending index: %w", err)
	}
	return ok, nil
}

// CheckOutbox checks that the close-event outbox table exists. An
// unreachable database is returned as it is (retried); a missing table is
// a StatementError naming ORDERDELAY_CLOSE_EVENTS.
func CheckOutbox(ctx context.Context, db sqlx.ExecerContext) error {
	if _, err := db.ExecContext(ctx, "SELECT 1 FROM "+OutboxTable+" LIMIT 0"); err != nil {
		if Unavailable(err) {
			return err
		}
		return &StatementError{Name: "close events", Setting: "ORDERDELAY_CLOSE_EVENTS",
			Err: fmt.Errorf("the outbox table is missing (run orderdelay migrate): %w", err)}
	}
	return nil
}
