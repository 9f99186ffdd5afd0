package orders

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"
)

// RunIDsLimited runs a `$1 text[]` statement (a task queue's sql action) in
// a transaction of its own under server-side limits, and returns the ids it
// returns. statement and lock, when positive, are set as the transaction's
// statement_timeout and lock_timeout (SET LOCAL), so a slow statement or a
// row held too long is cut by PostgreSQL itself (57014, 55P03: see
// Contended) with nothing committed, never by a client-side cancel.
//
// Errors classify like the close's (Transient, Contended, TimedOut): a
// failed BEGIN is a *BeginError, and a 57014 that came because ctx ended
// is wrapped with ctx's error, so it is not taken for the statement's
// timeout. A COMMIT whose answer is lost is an error (Transient): the
// statement may have committed, and the caller runs it again, which its
// WHERE guard makes harmless.
func RunIDsLimited(ctx context.Context, db *sqlx.DB, query string, ids []string, statement, lock time.Duration) ([]string, error) {
	out, err := runIDsLimited(ctx, db, query, ids, statement, lock)
	return out, clientCut(ctx, err)
}

func runIDsLimited(ctx context.Context, db *sqlx.DB, query string, ids []string, statement, lock time.Duration) ([]string, error) {
	tx, err := db.BeginTxx(ctx, nil)
	if err != nil {
		return nil, &BeginError{Err: err}
	}
	// Roll back even if ctx was cancelled meanwhile; after Commit a no-op.
	defer tx.Rollback() //nolint:errcheck // nothing to keep
	var set []string    // zero or negative: the session's own setting stays
	if statement > 0 {
		set = append(set, fmt.Sprintf("SET LOCAL statement_timeout = %d", millisUp(statement)))
	}
	if lock > 0 {
		set = append(set, fmt.Sprintf("SET LOCAL lock_timeout = %d", millisUp(lock)))
	}
	if len(set) > 0 {
		if _, err := tx.ExecContext(ctx, strings.Join(set, "; ")); err != nil {
			return nil, err
		}
	}
	out, err := querySerials(ctx, tx, query, len(ids), pq.Array(ids))
	if err != nil {
		return nil, sessionEnded(ctx, err)
	}
	if err := tx.Commit(); err != nil {
		return nil, err
	}
	return out, nil
}

// millisUp is d in whole milliseconds, rounded up (0 would mean "no limit").
func millisUp(d time.Duration) int64 { return int64((d + time.Millisecond - 1) / time.Millisecond) }
