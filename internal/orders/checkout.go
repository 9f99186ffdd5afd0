package orders

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"
)

// What a shop's checkout does to the reference schema, for the demo's
// simulated checkout (orderdelay demo); a real shop writes its own rows.

// Create inserts a pending order that expires at expires.
func Create(ctx context.Context, db sqlx.ExecerContext, serial string, expires time.Time) error {
	if _, err := db.ExecContext(ctx, "INSERT INTO orders (serial_no, expires_at) VALUES ($1, $2)", serial, expires); err != nil {
		return fmt.Errorf("create order: %w", err)
	}
	return nil
}

// Pay marks a pending order paid and reports whether it was pending.
func Pay(ctx context.Context, db sqlx.ExecerContext, serial string) (bool, error) {
	res, err := db.ExecContext(ctx, "UPDATE orders SET status = 'paid', paid_at = now() WHERE serial_no = $1 AND status = 'pending'", serial)
	if err != nil {
		return false, fmt.Errorf("pay order: %w", err)
	}
	n, err := res.RowsAffected()
	return n == 1, err
}

// StatusCount is how many orders have a status.
type StatusCount struct {
	Status string `db:"status"`
	N      int    `db:"n"`
}

// CountByStatus counts the orders whose serial starts with prefix, per
// status, in status order.
func CountByStatus(ctx context.Context, db sqlx.QueryerContext, prefix string) ([]StatusCount, error) {
	var out []StatusCount
	err := sqlx.SelectContext(ctx, db, &out, "SELECT status, count(*) AS n FROM orders WHERE starts_with(serial_no, $1) GROUP BY status ORDER BY status", prefix)
	if err != nil {
		return nil, fmt.Errorf("count orders: %w", err)
	}
	return out, nil
}

// EnsureDatabase creates the database name unless it exists, connected to
// the database of dsn (the server's "postgres", say) with its credentials.
func EnsureDatabase(ctx context.Context, dsn, name string) error {
	db, err := sqlx.Open("postgres", dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	var exists bool
	if err := db.GetContext(ctx, &exists, "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", name); err != nil {
		return err
	}
	if exists {
		return nil
	}
	_, err = db.ExecContext(ctx, "CREATE DATABASE "+pq.QuoteIdentifier(name))
	var pqErr *pq.Error
	if err != nil && !(errors.As(err, &pqErr) && pqErr.Code == "42P04") { // created meanwhile
		return err
	}
	return nil
}
