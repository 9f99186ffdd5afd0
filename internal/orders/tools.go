package orders

import (
	"context"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"
)

// The operator's tools' statements on the reference schema (internal/admin:
// extend, resync, the order report). A shop with its own table has none of
// them; the tools use them only with a database. Errors are returned as the
// driver gave them: the tools say which step failed.

// ExtendPending moves the expires_at of the pending orders among serials
// by later, in step with their queue entries (admin's extend), and returns
// how many rows moved. Orders no longer pending, and serials without a row,
// are left alone. by counts in whole milliseconds.
func ExtendPending(ctx context.Context, db sqlx.ExecerContext, serials []string, by time.Duration) (int, error) {
	r, err := db.ExecContext(ctx, `UPDATE orders SET expires_at = expires_at + $2 * interval '1 millisecond'
				WHERE serial_no = ANY($1) AND status = 'pending'`, pq.Array(serials), by.Milliseconds())
	if err != nil {
		return 0, err
	}
	n, _ := r.RowsAffected()
	return int(n), nil
}

// PendingOrder is a pending order's serial and deadline (PendingPage).
type PendingOrder struct {
	Serial    string    `db:"serial_no"`
	ExpiresAt time.Time `db:"expires_at"`
}

// PendingPage returns up to limit pending orders whose serial sorts after
// after ("" for the first page), in serial order: keyset pagination for
// admin's resync, which starts the next page after the last serial
// returned. An empty page is the end.
func PendingPage(ctx context.Context, db sqlx.QueryerContext, after string, limit int) ([]PendingOrder, error) {
	var rows []PendingOrder
	err := sqlx.SelectContext(ctx, db, &rows, `SELECT serial_no, expires_at FROM orders
			WHERE status = 'pending' AND serial_no > $1 ORDER BY serial_no LIMIT $2`, after, limit)
	return rows, err
}

// Row is an order's row in the reference schema, as admin's order report
// shows it (the JSON names are that report's).
type Row struct {
	Status      string     `json:"status" db:"status"`
	ExpiresAt   time.Time  `json:"expires_at" db:"expires_at"`
	CreatedAt   time.Time  `json:"created_at" db:"created_at"`
	PaidAt      *time.Time `json:"paid_at,omitempty" db:"paid_at"`
	ClosedAt    *time.Time `json:"closed_at,omitempty" db:"closed_at"`
	CloseReason *string    `json:"close_reason,omitempty" db:"close_reason"`
	ClosedBy    *string    `json:"closed_by,omitempty" db:"closed_by"`
}

// GetRow reads the row of serial; sql.ErrNoRows if it has none.
func GetRow(ctx context.Context, db sqlx.QueryerContext, serial string) (Row, error) {
	var row Row
	err := sqlx.GetContext(ctx, db, &row, `SELECT status, expires_at, created_at, paid_at, closed_at, close_reason, closed_by
		FROM orders WHERE serial_no = $1`, serial)
	return row, err
}
