// Package orders owns everything orderdelay does in PostgreSQL: the
// reference schema (embedded, versioned migrations), the three statements
// that close, look up and find overdue orders (defaults for the reference
// schema, replaceable by configuration and verified at start), and the
// classification of database errors into transient and permanent.
//
// The SQL decides. Closing is one set-based, conditional statement, so an
// order paid a microsecond earlier is never closed and a close that runs
// twice closes once.
package orders

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"
)

// DefaultCloseSQL closes the pending orders among $1 and returns the serials
// it closed. The inner query locks the rows in serial order, so concurrent
// closers, the reconciler and a shop's own jobs cannot deadlock on them; a
// row paid while this statement waited for its lock is re-checked and left
// alone. Feeding the locked serials back as an array keeps the primary-key
// plan at any batch size (a CTE joined back to the UPDATE switches to a hash
// join over the whole table around 1,000 serials: see BENCHMARKS.md).
const DefaultCloseSQL = `UPDATE orders
SET status = 'closed', closed_at = now(), close_reason = 'timeout',
    closed_by = current_setting('application_name')
WHERE serial_no = ANY(ARRAY(
        SELECT serial_no FROM orders
        WHERE serial_no = ANY($1) AND status = 'pending'
        ORDER BY serial_no
        FOR UPDATE))
  AND status = 'pending'
RETURNING serial_no`

// DefaultLookupSQL returns the serials among $1 that have an order row.
const DefaultLookupSQL = `SELECT serial_no FROM orders WHERE serial_no = ANY($1)`

// DefaultOverdueSQL returns up to $2 pending orders whose deadline passed
// more than $1 milliseconds ago, oldest first, locking them and skipping rows
// someone else holds (a payment in progress is never waited for).
const DefaultOverdueSQL = `SELECT serial_no FROM orders
WHERE status = 'pending' AND expires_at < now() - $1::bigint * interval '1 millisecond'
ORDER BY expires_at
LIMIT $2::bigint
FOR UPDATE SKIP LOCKED`

// Statements are the three statements a Store runs.
type Statements struct {
	Close   string // $1 text[] -> serials closed
	Lookup  string // $1 text[] -> serials that exist
	Overdue string // $1 bigint grace ms, $2 bigint limit -> serials
}

// DefaultStatements returns the statements for the reference schema.
func DefaultStatements() Statements {
	return Statements{Close: DefaultCloseSQL, Lookup: DefaultLookupSQL, Overdue: DefaultOverdueSQL}
}

// Store runs the statements on a database.
type Store struct {
	db    *sqlx.DB
	stmts Statements
}

// NewStore returns a Store; empty statements take their defaults. Call
// Verify before relying on custom statements.
func NewStore(db *sqlx.DB, s Statements) *Store {
	d := DefaultStatements()
	if s.Close == "" {
		s.Close = d.Close
	}
	if s.Lookup == "" {
		s.Lookup = d.Lookup
	}
	if s.Overdue == "" {
		s.Overdue = d.Overdue
	}
	return &Store{db: db, stmts: s}
}

// DB returns the store's database handle.
func (s *Store) DB() *sqlx.DB { return s.db }

// Querier is what the statements run on: the pool or a transaction.
type Querier interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// Close closes the pending orders among serials and returns those it closed.
func (s *Store) Close(ctx context.Context, serials []string) ([]string, error) {
	return s.CloseOn(ctx, s.db, serials)
}

// CloseOn is Close on q (a transaction, for the reconciler).
func (s *Store) CloseOn(ctx context.Context, q Querier, serials []string) ([]string, error) {
	return querySerials(ctx, q, s.stmts.Close, len(serials), pq.Array(serials))
}

// Lookup returns the serials among serials that have an order row.
func (s *Store) Lookup(ctx context.Context, serials []string) ([]string, error) {
	return querySerials(ctx, s.db, s.stmts.Lookup, len(serials), pq.Array(serials))
}

// Overdue returns up to limit pending orders whose deadline passed more than
// graceMillis ago, locked in tx until it ends.
func (s *Store) Overdue(ctx context.Context, tx Querier, graceMillis, limit int64) ([]string, error) {
	return querySerials(ctx, tx, s.stmts.Overdue, int(limit), graceMillis, limit)
}

// ErrBadResult is wrapped when a statement returns something other than one
// non-NULL text column.
var ErrBadResult = errors.New("statement result")

func querySerials(ctx context.Context, q Querier, query string, sizeHint int, args ...any) ([]string, error) {
	rows, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := make([]string, 0, sizeHint)
	for rows.Next() {
		var s sql.NullString
		if err := rows.Scan(&s); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrBadResult, err)
		}
		if !s.Valid {
			return nil, fmt.Errorf("%w: NULL serial", ErrBadResult)
		}
		out = append(out, s.String)
	}
	return out, rows.Err()
}

// Verify checks that each statement prepares, takes the parameter types it
// must and returns one text column, without changing any data: it runs them
// with empty input inside a transaction it rolls back. A misconfigured
// statement is a configuration error.
func (s *Store) Verify(ctx context.Context) error {
	checks := []struct {
		name, setting, query string
		params               []string
		args                 []any
	}{
		{"close", "ORDERDELAY_CLOSE_SQL", s.stmts.Close, []string{"text[]"}, []any{pq.Array([]string{})}},
		{"lookup", "ORDERDELAY_LOOKUP_SQL", s.stmts.Lookup, []string{"text[]"}, []any{pq.Array([]string{})}},
		{"overdue", "ORDERDELAY_OVERDUE_SQL", s.stmts.Overdue, []string{"bigint", "bigint"}, []any{int64(1 << 40), int64(0)}},
	}
	tx, err := s.db.BeginTxx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback() //nolint:errcheck // read-only check; rollback is the point
	for _, c := range checks {
		if err := verifyOne(ctx, tx, c.query, c.params, c.args); err != nil {
			if Unavailable(err) {
				return err // the database, not the statement: retried
			}
			return &StatementError{Name: c.name, Setting: c.setting, Err: err}
		}
	}
	return nil
}

// StatementError says which configured statement failed verification.
type StatementError struct {
	Name, Setting string
	Err           error
}

func (e *StatementError) Error() string {
	return fmt.Sprintf("%s statement (%s): %v", e.Name, e.Setting, e.Err)
}

func (e *StatementError) Unwrap() error { return e.Err }

func verifyOne(ctx context.Context, tx *sqlx.Tx, query string, params []string, args []any) error {
	if _, err := tx.ExecContext(ctx, "SAVEPOINT orderdelay_verify"); err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, "PREPARE orderdelay_verify AS "+query); err != nil {
		return fmt.Errorf("does not prepare: %w", err)
	}
	var got pq.StringArray
	err := tx.QueryRowxContext(ctx,
		`SELECT parameter_types::text[] FROM pg_prepared_statements WHERE name = 'orderdelay_verify'`).Scan(&got)
	if err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, "DEALLOCATE orderdelay_verify"); err != nil {
		return err
	}
	if !slices.Equal([]string(got), params) {
		return fmt.Errorf("takes parameters (%s), want (%s)", strings.Join(got, ", "), strings.Join(params, ", "))
	}
	rows, err := tx.QueryContext(ctx, query, args...)
	if err != nil {
		return fmt.Errorf("does not run: %w", err)
	}
	cols, err := rows.ColumnTypes()
	rows.Close()
	if err != nil {
		return err
	}
	if len(cols) != 1 {
		return fmt.Errorf("returns %d columns, want 1 (the serial)", len(cols))
	}
	if t := cols[0].DatabaseTypeName(); t != "TEXT" && t != "VARCHAR" && t != "BPCHAR" {
		return fmt.Errorf("returns a column of type %s, want text", t)
	}
	_, err = tx.ExecContext(ctx, "ROLLBACK TO SAVEPOINT orderdelay_verify")
	return err
}

// DryRun is a Store whose Close runs the close statement in a transaction
// that it always rolls back: it returns what would have been closed and
// changes nothing (side effects of a custom statement are rolled back too).
type DryRun struct{ *Store }

// Close reports which of serials the close statement would close.
func (d DryRun) Close(ctx context.Context, serials []string) ([]string, error) {
	tx, err := d.db.BeginTxx(ctx, nil)
	if err != nil {
		return nil, err
	}
	// Roll back even if ctx was cancelled meanwhile.
	defer tx.Rollback() //nolint:errcheck // rolling back is the point
	return d.CloseOn(ctx, tx, serials)
}

// VerifyStatement checks that a task queue's statement takes `$1 text[]`
// and returns one text column, without changing data.
func VerifyStatement(ctx context.Context, db *sqlx.DB, query string) error {
	tx, err := db.BeginTxx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback() //nolint:errcheck // read-only check
	if err := verifyOne(ctx, tx, query, []string{"text[]"}, []any{pq.Array([]string{})}); err != nil {
		if Unavailable(err) {
			return err
		}
		return &StatementError{Name: "task queue", Setting: "ORDERDELAY_QUEUES_FILE", Err: err}
	}
	return nil
}

// RunIDs runs a `$1 text[]` statement and returns the ids it returns.
func RunIDs(ctx context.Context, db *sqlx.DB, query string, ids []string) ([]string, error) {
	return querySerials(ctx, db, query, len(ids), pq.Array(ids))
}

// OutboxTable holds close events until the relay has published them.
const OutboxTable = "orderdelay_close_outbox"

// RecordClosed writes a close event per serial into the outbox, on q (the
// transaction that closed them).
func RecordClosed(ctx context.Context, q Querier, serials []string, reason string) error {
	if len(serials) == 0 {
		return nil
	}
	rows, err := q.QueryContext(ctx, "INSERT INTO "+OutboxTable+" (serial_no, reason) SELECT unnest($1::text[]), $2", pq.Array(serials), reason)
	if err != nil {
		return fmt.Errorf("record close events: %w", err)
	}
	return rows.Close()
}

// WithOutbox is a Store whose Close also writes a close event per closed
// order into the outbox, in the same transaction as the close.
type WithOutbox struct{ *Store }

// Close closes the pending orders among serials and records their events.
func (o WithOutbox) Close(ctx context.Context, serials []string) ([]string, error) {
	tx, err := o.db.BeginTxx(ctx, nil)
	if err != nil {
		return nil, err
	}
	defer tx.Rollback() //nolint:errcheck // after Commit this is a no-op
	closed, err := o.CloseOn(ctx, tx, serials)
	if err != nil {
		return nil, err
	}
	if err := RecordClosed(ctx, tx, closed, "timeout"); err != nil {
		return nil, err
	}
	return closed, tx.Commit()
}
