// Package orders owns what orderdelay does in PostgreSQL with orders, and
// what every part of it shares there: the reference schema (embedded,
// versioned migrations, the durable task tier's table among them), the
// three statements that close, look up and find overdue orders (defaults
// for the reference schema, replaceable by configuration and verified at
// start), and the classification of database errors into transient and
// permanent. The operator's tools (internal/admin) run its statements on
// the reference schema too (tools.go: ExtendPending, PendingPage,
// GetRow), and the reconciler and the durable task loader steer their
// transactions with its helpers (tx.go: the advisory lock, savepoints).
// The durable tier's own statements on orderdelay_tasks, and a task
// queue's SQL action, are package tasks'.
//
// The SQL decides. Closing is one set-based, conditional statement, so an
// order paid a microsecond earlier is never closed and a close that runs
// twice closes once.
//
// Two paths close a batch (Store.Settle). With the reference schema's
// statements (neither the close nor the lookup configured: OneStatement)
// one statement, DefaultSettleSQL, closes the pending orders and says which
// of the others are settled, and carries the transaction id: one round trip
// per batch between BEGIN and COMMIT. With a custom close or lookup
// statement the close statement runs alone and a query fetches the
// transaction id. Either way the caller asks the lookup, after the commit,
// about what the close could not answer for (Outcome.Unknown).
//
// The statements a batch runs (the one statement; the close statement and
// the transaction id's query; the lookup) are server-side prepared
// statements, prepared once per connection: a batch then takes one round
// trip per statement instead of two (Parse/Describe, then Bind/Execute),
// and PostgreSQL may keep a generic plan rather than plan every batch. A
// table altered under them (0A000 "cached plan must not change result
// type") makes the store prepare them again and run the batch again at
// once; a pooler that loses them or mixes them up (PgBouncer in
// transaction pooling before 1.21 or without max_prepared_statements:
// 26000, 42P05) makes it fall back to unprepared statements for good, with
// one Warn; a connection that dies takes its statements along and the next
// one prepares its own. Neither costs a batch an attempt. The reconciler's
// and the start-up checks' statements run unprepared.
package orders

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"
	"go.uber.org/zap"
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

// DefaultLookupSQL returns each serial among $1 that has an order row, and
// whether that row is still pending. A pending row the close left alone was
// invisible to it (its producer committed after the close's snapshot) and
// is retried; only a row that is no longer pending is settled.
const DefaultLookupSQL = `SELECT serial_no, status = 'pending' FROM orders WHERE serial_no = ANY($1)`

// DefaultSettleSQL is the close and the lookup of the reference schema in
// one statement, which Store.Settle runs when neither the close nor the
// lookup statement is configured: one round trip per batch where the two
// statements take a close, a query for the transaction id and a lookup.
//
// One snapshot answers for every serial among $1: closed updates the rows
// that are pending, re-checking the status on the newest row version (a row
// paid or closed by another transaction while this one waited for its lock
// is left alone); the second branch reads the rows of the serials it did
// not close — about one in ten in a shop where one order in ten is paid —
// as the snapshot has them. The answer is one row per kind of outcome, not
// per serial (a batch's 500 rows cost the daemon more to read than
// anything else it does with PostgreSQL's answer): (closed, pending in the
// snapshot, the kind's serials as a text[], and on the closed row the
// transaction id and the server's start time, else NULL). The serials are
// cast to text whatever the column's type: a char(n) column's come back
// trimmed, as the cast trims them, and no change of the column's type
// makes a prepared plan of the statement stale (0A000). Closed: the
// transaction id settles a COMMIT whose answer is lost (committed). Not
// closed and not pending is settled; not closed but pending was changed by
// another transaction while the statement ran. A
// serial with no row in the snapshot is in no row: its producer may have
// committed after the snapshot. The caller asks the lookup about those two
// (a second statement, only for them). A kind without serials has no row.
//
// No FOR UPDATE pass: the update takes its serials from an array built by
// a subquery, which the planner cannot size, so it scans the primary key
// whatever the batch size (TestSettleUpdatesThroughThePrimaryKey), and that
// scan takes the array in index order: rows are locked in serial order, as
// the pre-pass did, without locking each row twice. (A plan other than the
// primary key — a table of a few pages read whole — locks in table order;
// a deadlock with another closer is then possible and is answered like any
// other 40P01: retried without an attempt, the batch closed order by order.)
const DefaultSettleSQL = settleClose + "\n" + settleRest

// The one statement in two parts: its update and the closed row, and the
// row or two of the rest. shapedSettleSQL puts its prepared form's extra
// parameters between them.
const (
	settleClose = `WITH closed AS (
  UPDATE orders
  SET status = 'closed', closed_at = now(), close_reason = 'timeout',
      closed_by = current_setting('application_name')
  WHERE serial_no = ANY(ARRAY(SELECT unnest($1::text[])))
    AND status = 'pending'
  RETURNING serial_no)
SELECT true, true, array_agg(serial_no::text), txid_current(), (SELECT ` + serverSQL + `)
FROM closed HAVING count(*) > 0`
	settleRest = `UNION ALL
SELECT false, status = 'pending', array_agg(serial_no::text), NULL, NULL FROM orders
WHERE serial_no = ANY(ARRAY(SELECT unnest($1::text[]) EXCEPT SELECT serial_no FROM closed))
GROUP BY status = 'pending'`
)

// shapedSettleSQL is DefaultSettleSQL in the form it is prepared in: with
// three parameters more, bound to shapeArg, in a one-time filter of the
// closed row (see shapeLookup: the release before this one prepared its
// one statement, which answered per serial, with one parameter, as this
// one takes).
const shapedSettleSQL = settleClose +
	" AND $2::int IS NOT NULL AND $3::int IS NOT NULL AND $4::int IS NOT NULL\n" + settleRest

// DefaultOverdueSQL returns up to $2 pending orders whose deadline passed
// more than $1 milliseconds ago, in (deadline, serial) order, starting after
// the cursor ($3 deadline, $4 serial: the last row of the previous page;
// -infinity and the empty string for the first), with their deadlines. It
// locks them and skips rows someone else holds (a payment in progress is
// never waited for).
// The row comparison runs on the partial index on pending expires_at (its
// leading column bounds the scan), and the serial breaks ties among orders
// with the same deadline, so a page never repeats or misses one.
const DefaultOverdueSQL = `SELECT serial_no, expires_at FROM orders
WHERE status = 'pending' AND expires_at < now() - $1::bigint * interval '1 millisecond'
  AND (expires_at, serial_no) > ($3::timestamptz, $4::text)
ORDER BY expires_at, serial_no
LIMIT $2::bigint
FOR UPDATE SKIP LOCKED`

// relockOverdueSQL locks again, in serial order, the rows among $1 that
// are still pending and more than $2 milliseconds past their deadline, and
// returns their serials: the reconciler's page, once it has let go of the
// rows of its read (see Store.RelockOverdue). Rows someone else holds are
// skipped, like the read's.
const relockOverdueSQL = `SELECT serial_no FROM orders
WHERE serial_no = ANY($1) AND status = 'pending' AND expires_at < now() - $2::bigint * interval '1 millisecond'
ORDER BY serial_no
FOR UPDATE SKIP LOCKED`

// OverdueParams and OverdueColumns are the overdue statement's contract,
// as Verify reports it.
const (
	OverdueParams  = "$1 bigint grace ms, $2 bigint limit, $3 timestamptz and $4 text: the deadline and serial of the previous page's last row ('-infinity' and '' for the first page)"
	OverdueColumns = "serial (text), deadline (timestamptz), ordered by deadline then serial, only rows after ($3, $4)"
)

// Statements are the three statements a Store runs.
type Statements struct {
	Close   string // $1 text[] -> serials closed
	Lookup  string // $1 text[] -> (serial, still pending) of the serials that exist
	Overdue string // $1 bigint grace ms, $2 bigint limit, $3 timestamptz, $4 text cursor -> serials, deadlines
}

// DefaultStatements returns the statements for the reference schema.
func DefaultStatements() Statements {
	return Statements{Close: DefaultCloseSQL, Lookup: DefaultLookupSQL, Overdue: DefaultOverdueSQL}
}

// Store runs the statements on a database.
type Store struct {
	db    *sqlx.DB
	stmts Statements
	// settleSQL closes and looks up in one statement (DefaultSettleSQL);
	// empty when the close or the lookup statement is a custom one: Settle
	// then runs the close statement alone.
	settleSQL string
	// Server-side limits of a close transaction (SET LOCAL); zero: the
	// session's. See SetTimeouts.
	statementTimeout, lockTimeout time.Duration
	// prep runs the statements of a batch as prepared statements.
	prep *prepared
	// statusWait: commitStatusWait, unless a test shortened it.
	statusWait time.Duration
}

// SetLogger sets where the store reports what it does on its own (falling
// back to unprepared statements). Call it before use; the default logs
// nothing.
func (s *Store) SetLogger(l *zap.Logger) {
	if l != nil {
		s.prep.log.Store(l)
	}
}

// Unprepared makes the store send its statements unprepared, as lib/pq
// does a query with parameters (ORDERDELAY_PREPARED_STATEMENTS=false): for
// a pooler that hands each transaction to any server session and does not
// track prepared statements, where a statement prepared on one client's
// behalf could be found, by name, by another. Call it before use.
func (s *Store) Unprepared() { s.prep.off.Store(true) }

// SetLocalTimeouts applies the timeouts of SetTimeouts to the transaction
// tx (SET LOCAL), for callers that run statements in transactions of their
// own, such as the reconciler. Without timeouts it does nothing.
func (s *Store) SetLocalTimeouts(ctx context.Context, tx *sqlx.Tx) error {
	if s.statementTimeout <= 0 && s.lockTimeout <= 0 {
		return nil
	}
	set := fmt.Sprintf("SET LOCAL statement_timeout = %d; SET LOCAL lock_timeout = %d",
		s.statementTimeout.Milliseconds(), s.lockTimeout.Milliseconds())
	_, err := tx.ExecContext(ctx, set)
	return err
}

// SetCommitStatusWait sets how long a close whose COMMIT got no answer
// asks the server what became of it before it is in doubt (InDoubtError);
// zero or less: 5 s. Call it before use.
func (s *Store) SetCommitStatusWait(d time.Duration) { s.statusWait = d }

// SetTimeouts makes every close transaction set statement_timeout and
// lock_timeout on the server (SET LOCAL), so a slow statement or a row lock
// held too long is cut by PostgreSQL itself: the outcome is an error the
// server reports (57014, 55P03) and nothing committed, never a client-side
// cancel that leaves the commit in doubt. Call it before use.
func (s *Store) SetTimeouts(statement, lock time.Duration) {
	s.statementTimeout, s.lockTimeout = statement, lock
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
	st := &Store{db: db, stmts: s, prep: newPrepared(db, s.Lookup, s.Close)}
	if s.Close == d.Close && s.Lookup == d.Lookup {
		st.settleSQL = DefaultSettleSQL
		st.prep.shapes[DefaultSettleSQL] = shape{form: shapedSettleSQL, extra: 3}
	}
	return st
}

// OneStatement reports whether Settle closes and looks up in one statement
// (the reference schema's: neither the close nor the lookup statement is
// configured) rather than running the close statement alone.
func (s *Store) OneStatement() bool { return s.settleSQL != "" }

// DB returns the store's database handle.
func (s *Store) DB() *sqlx.DB { return s.db }

// Ping reports whether the database answers a statement on a connection of
// the pool (one that broke is replaced by a new one).
func (s *Store) Ping(ctx context.Context) error { return s.db.PingContext(ctx) }

// Querier is what the statements run on: the pool or a transaction.
type Querier interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// Fence is asked, after the close statement ran and before its
// transaction commits (the closed rows are locked then), which of the
// serials it closed must not be closed after all: their queue entry is no
// longer the caller's (another replica took it over, a producer moved its
// deadline). An error means that could not be known: nothing commits.
type Fence func(ctx context.Context, closed []string) (drop []string, err error)

// FenceError wraps an error of a Fence: the close was rolled back because
// the queue could not be asked, or answered only after the close's
// context ended (the error then carries the context's), which says
// nothing about the orders.
type FenceError struct{ Err error }

func (e *FenceError) Error() string { return "close rolled back: queue check failed: " + e.Err.Error() }

func (e *FenceError) Unwrap() error { return e.Err }

// Outcome is what a close knows of each serial it was asked about
// (Settle). A serial is in at most one list; one the fence dropped is in
// none.
type Outcome struct {
	// Closed were closed by this call, and the transaction committed.
	Closed []string
	// Settled had a row that was no longer pending (paid, or closed
	// before) in the statement's snapshot: nothing is left to do.
	Settled []string
	// Unknown is what the statement cannot answer for; ask Lookup after
	// the commit: a serial with no row in its snapshot (the producer may
	// have committed after it), a row another transaction changed while
	// the statement ran (found pending, then paid, closed or deleted
	// before the update reached it) and, when the close statement runs
	// alone, every serial it did not close.
	Unknown []string
}

// Close closes the pending orders among serials in one transaction and
// returns those it closed, with the close statement. If fence is not nil it
// is called before COMMIT; when it drops serials the transaction is rolled
// back and the close runs again without them, so a dropped serial is never
// closed.
func (s *Store) Close(ctx context.Context, serials []string, fence Fence) ([]string, error) {
	out, err := s.closeTx(ctx, serials, fence, "", false, false)
	return out.Closed, clientCut(ctx, err)
}

// Settle closes the pending orders among serials, fenced as Close, and says
// what it knows of the others. With the reference schema's statements
// (OneStatement) that takes one statement, DefaultSettleSQL, which also
// tells the orders that are settled and carries the transaction id; with
// a custom close or lookup statement it is Close, and every serial not
// closed is Unknown.
func (s *Store) Settle(ctx context.Context, serials []string, fence Fence) (Outcome, error) {
	out, err := s.closeTx(ctx, serials, fence, "", false, s.OneStatement())
	return out, clientCut(ctx, err)
}

// closeTx is Close, or Settle when one is set (run DefaultSettleSQL);
// outbox, if not empty, is the reason of the close events recorded in the
// same transaction; dryRun rolls back instead of committing.
//
// A prepared statement that went stale (StalePlan) or that a pooler lost
// (see prepared) rolls the transaction back like any error; the
// transaction is run again at once, with the statements prepared again or
// unprepared, since the batch has nothing to do with it.
func (s *Store) closeTx(ctx context.Context, serials []string, fence Fence, outbox string, dryRun, one bool) (Outcome, error) {
	cured := 0 // for the whole call, across the runs without fence-dropped serials
	for {
		var out Outcome
		var drop []string
		err := s.runCured(ctx, &cured, func(st *callState) (err error) {
			out, drop, err = s.closeOnce(ctx, serials, fence, outbox, dryRun, one, st)
			return err
		})
		if err != nil {
			return Outcome{}, err
		}
		if len(drop) == 0 {
			return out, nil
		}
		kept := without(serials, drop)
		if len(kept) == len(serials) { // the fence dropped nothing we asked for
			return Outcome{}, fmt.Errorf("close: fence dropped serials that were not closed: %q", drop)
		}
		if serials = kept; len(serials) == 0 {
			return Outcome{}, nil
		}
	}
}

// maxCures bounds how often one call runs its statements again after a
// prepared statement went stale or was lost (prepared.cure): a table
// altered again meanwhile, then a pooler.
const maxCures = 2

// runCured runs attempt, a call's statements, and runs it again at once
// when its error says nothing about the orders but about the prepared
// statements: one that went stale or that a pooler lost (prepared.cure, at
// most maxCures times), or a data exception that a pooler's mix-up may
// have caused (suspect), which is probed once unprepared — if that run
// succeeds, the prepared statement was not ours and the store falls back
// to unprepared statements for good. Nothing is run again once ctx ended.
// cured counts the cures of the whole call (a close runs again without the
// serials its fence dropped, under the same bound). It returns attempt's
// last error.
func (s *Store) runCured(ctx context.Context, cured *int, attempt func(*callState) error) error {
	var probe error // a suspect error of a prepared run, being probed unprepared
	for {
		st := callState{unprepared: probe != nil}
		err := attempt(&st)
		switch {
		case err == nil:
			if probe != nil {
				s.prep.fallBack(probe) // unprepared, it ran: the prepared one was not ours
			}
			return nil
		case ctx.Err() != nil:
			return err
		case *cured < maxCures && s.prep.cure(err):
			*cured++
		case probe == nil && st.ranPrepared && suspect(err):
			probe = err
		default:
			return err
		}
	}
}

// callState is what one run of a call is told (run unprepared) and tells
// (a statement ran prepared).
type callState struct{ unprepared, ranPrepared bool }

func (s *Store) closeOnce(ctx context.Context, serials []string, fence Fence, outbox string, dryRun, one bool, st *callState) (out Outcome, drop []string, err error) {
	// The statements are made on the pool before the transaction takes
	// its connection (once per store; each is then prepared on a
	// connection the first time it runs there).
	if one {
		s.prep.ensure(ctx, s.settleSQL)
	} else {
		s.prep.ensure(ctx, s.stmts.Close, txRefSQL)
	}
	tx, err := s.db.BeginTxx(ctx, nil)
	if err != nil {
		return Outcome{}, nil, &BeginError{Err: err}
	}
	// Roll back even if ctx was cancelled meanwhile; after Commit a no-op.
	defer tx.Rollback() //nolint:errcheck // nothing to keep
	if err := ctx.Err(); err != nil {
		// The driver cannot cut a BEGIN (lib/pq waits for its answer):
		// one answered only after the deadline says the database did not
		// answer in time, and no statement of ours ran.
		return Outcome{}, nil, &BeginError{Err: err}
	}
	if err := s.SetLocalTimeouts(ctx, tx); err != nil {
		return Outcome{}, nil, err
	}
	// The transaction's id and the server that gave it, so that a COMMIT
	// whose answer is lost (the connection dropped, the client's deadline
	// passed while the server committed) can be settled by asking that
	// server (committed). The one statement returns them with the closed
	// rows; after the close statement alone they take a query.
	var xid txRef
	q := s.prep.on(tx.Tx, st.unprepared)
	defer func() { st.ranPrepared = *q.used }()
	if one {
		out, xid, err = s.settleOn(ctx, q, serials)
		if err != nil {
			return Outcome{}, nil, sessionEnded(ctx, err)
		}
	} else {
		closed, err := s.CloseOn(ctx, q, serials)
		if err != nil {
			return Outcome{}, nil, sessionEnded(ctx, err)
		}
		out = Outcome{Closed: closed, Unknown: without(serials, closed)}
	}
	if dryRun {
		return out, nil, nil // rolled back by the deferred Rollback
	}
	if outbox != "" {
		if err := RecordClosed(ctx, tx, out.Closed, outbox); err != nil {
			return Outcome{}, nil, sessionEnded(ctx, err)
		}
	}
	if !one && len(out.Closed) > 0 {
		if xid, err = queryTxRef(ctx, q); err != nil {
			return Outcome{}, nil, err
		}
	}
	if fence != nil && len(out.Closed) > 0 {
		drop, err := fence(ctx, out.Closed)
		if err == nil && ctx.Err() != nil {
			// The queue answered only after ctx ended (go-redis does not
			// cut a read at a deadline): database/sql has rolled the
			// transaction back and never sends the COMMIT, so nothing
			// commits. That is the queue's lateness, not the database's,
			// and no COMMIT whose outcome to ask the server about.
			err = fmt.Errorf("answered after the close's deadline: %w", ctx.Err())
		}
		if err != nil {
			return Outcome{}, nil, &FenceError{Err: err}
		}
		if len(drop) > 0 {
			return Outcome{}, drop, nil // rolled back; the caller retries without them
		}
	}
	if err := tx.Commit(); err != nil {
		if xid.id == 0 {
			return Outcome{}, nil, err // nothing closed
		}
		switch s.committed(xid, out.Closed) {
		case commitLanded:
			return out, nil, nil // the COMMIT landed; only its answer was lost
		case commitFailed:
			return Outcome{}, nil, err
		}
		// Nobody could say: in doubt, unless the COMMIT's error was itself
		// the answer (the server refused it).
		return Outcome{}, nil, CommitError(err, len(out.Closed))
	}
	return out, nil, nil
}

// settleOn runs DefaultSettleSQL (or what a test put in its place) on q and
// reads its answer: a row per kind of outcome (closed, pending, the kind's
// serials as a text[], and on the closed row the transaction id and the
// server's start time). Anything else is ErrBadResult, found before the
// fence and COMMIT.
func (s *Store) settleOn(ctx context.Context, q Querier, serials []string) (_ Outcome, xid txRef, err error) {
	defer decodePanic(q, &err)
	rows, err := q.QueryContext(ctx, s.settleSQL, textArray(serials))
	if err != nil {
		return Outcome{}, xid, err
	}
	defer rows.Close()
	if cols, err := rows.Columns(); err == nil && len(cols) != 5 {
		return Outcome{}, xid, fmt.Errorf("%w: %w: %d columns, want 5", ErrBadResult, ErrBadShape, len(cols))
	}
	seen := seenPool.Get().(map[string]bool)
	defer func() {
		clear(seen)
		seenPool.Put(seen)
	}()
	for _, sn := range serials {
		seen[sn] = false
	}
	out := Outcome{Closed: make([]string, 0, len(serials))}
	for rows.Next() {
		var closed, pending sql.NullBool
		var list textList
		var id sql.NullInt64
		var server sql.NullString
		if err := rows.Scan(&closed, &pending, &list, &id, &server); err != nil {
			return Outcome{}, xid, fmt.Errorf("%w: %w", ErrBadResult, err)
		}
		if !closed.Valid || !pending.Valid {
			return Outcome{}, xid, fmt.Errorf("%w: NULL closed or pending flag", ErrBadResult)
		}
		if closed.Bool {
			switch {
			case !pending.Bool:
				return Outcome{}, xid, fmt.Errorf("%w: closed but not pending", ErrBadResult)
			case !id.Valid || !server.Valid:
				return Outcome{}, xid, fmt.Errorf("%w: closed without a transaction id and server", ErrBadResult)
			case xid.id != 0 && (xid.id != id.Int64 || xid.server != server.String):
				return Outcome{}, xid, fmt.Errorf("%w: two transaction ids in one statement", ErrBadResult)
			}
			xid = txRef{id: id.Int64, server: server.String}
		}
		if len(list) == 0 {
			return Outcome{}, xid, fmt.Errorf("%w: a kind of outcome without serials", ErrBadResult)
		}
		for _, serial := range list {
			switch already, asked := seen[serial]; {
			case !asked:
				return Outcome{}, xid, fmt.Errorf("%w: serial %q was not asked about", ErrBadResult, serial)
			case already:
				return Outcome{}, xid, fmt.Errorf("%w: serial %q returned twice", ErrBadResult, serial)
			}
			seen[serial] = true
			switch {
			case closed.Bool:
				out.Closed = append(out.Closed, serial)
			case pending.Bool:
				out.Unknown = append(out.Unknown, serial) // changed while the statement ran
			default:
				out.Settled = append(out.Settled, serial)
			}
		}
	}
	if err := rows.Err(); err != nil {
		return Outcome{}, xid, err
	}
	for _, sn := range serials {
		if !seen[sn] {
			seen[sn] = true // a serial asked twice is unknown once
			out.Unknown = append(out.Unknown, sn)
		}
	}
	return out, xid, nil
}

// seenPool keeps settleOn's maps of the serials asked about: cleared and
// reused, a batch's map costs no allocation once the pool has one of its
// size.
var seenPool = sync.Pool{New: func() any { return map[string]bool{} }}

// without returns the serials not in drop, in order.
func without(serials, drop []string) []string {
	if len(drop) == 0 {
		return serials
	}
	skip := make(map[string]struct{}, len(drop))
	for _, d := range drop {
		skip[d] = struct{}{}
	}
	out := make([]string, 0, len(serials)-min(len(drop), len(serials)))
	for _, sn := range serials {
		if _, ok := skip[sn]; !ok {
			out = append(out, sn)
		}
	}
	return out
}

// commitStatusWait bounds how long a close whose COMMIT answer was lost asks
// the server what became of it (Store.statusWait; tests shorten it).
const commitStatusWait = 5 * time.Second

// commitOutcome is what the server says became of a transaction whose
// COMMIT got no answer.
type commitOutcome int

const (
	commitUnknown commitOutcome = iota // nobody could say: in doubt
	commitLanded                       // committed, and the orders it closed are closed
	commitFailed                       // the server that ran it says it aborted
)

// txRef names a transaction: its id and the server that assigned it. A
// transaction id means something only to the server that handed it out: a
// standby promoted after the primary died can hand the same id to another
// transaction if the first was never replicated. The postmaster's start
// time (as seconds since the epoch, whatever the session's time zone)
// tells servers apart. A server that reinitialises after a backend crash
// keeps its postmaster and may reuse an id whose WAL was never flushed;
// committed therefore also checks the rows.
type txRef struct {
	id     int64
	server string
}

const (
	serverSQL = "extract(epoch FROM pg_postmaster_start_time())::text"
	txRefSQL  = "SELECT txid_current(), " + serverSQL
)

// queryTxRef asks for the current transaction's id and server (txRefSQL)
// on q.
func queryTxRef(ctx context.Context, q Querier) (xid txRef, err error) {
	defer decodePanic(q, &err)
	rows, err := q.QueryContext(ctx, txRefSQL)
	if err != nil {
		return xid, err
	}
	defer rows.Close()
	if !rows.Next() {
		if err := rows.Err(); err != nil {
			return xid, err
		}
		return xid, sql.ErrNoRows
	}
	if err := rows.Scan(&xid.id, &xid.server); err != nil {
		return xid, err
	}
	return xid, rows.Close()
}

// committed asks the server, on another connection, whether transaction
// xid committed (txid_status), asking again while the server cannot be
// reached or says the transaction is still in progress (it is still
// running the COMMIT) for up to commitStatusWait, and, if it did, that none of the orders it
// closed is still pending (an id reused after a crash cannot have closed
// them). It reports commitFailed only when the server that ran the
// transaction says it aborted, and commitUnknown when nobody could say —
// the server that answers is not the one that ran the transaction (a
// failover), none answered, or the answer does not fit the rows. Either
// way the caller treats the close as failed and retries it, and the SQL
// guard makes the retry harmless (an order that did close is then counted
// as settled rather than closed: InDoubtError says how many may be).
func (s *Store) committed(xid txRef, closed []string) commitOutcome {
	wait := s.statusWait
	if wait <= 0 {
		wait = commitStatusWait
	}
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	for {
		var status sql.NullString
		var server string
		err := s.db.QueryRowContext(ctx, "SELECT txid_status($1), "+serverSQL, xid.id).Scan(&status, &server)
		switch {
		case err == nil && server == xid.server && status.String == "in progress":
			// Not finished yet: the server is still running the COMMIT
			// (a deferred trigger, a flush, a wait for a synchronous
			// standby) or has not yet seen the connection go and roll
			// it back. Ask again, as while it cannot be reached.
		case err == nil:
			switch {
			case server != xid.server:
				return commitUnknown
			case status.String == "aborted":
				return commitFailed
			case status.String != "committed":
				return commitUnknown // NULL: too old to tell
			}
			found, err := s.Lookup(ctx, closed)
			if err != nil {
				return commitUnknown
			}
			for _, f := range found {
				if f.Pending {
					return commitUnknown
				}
			}
			return commitLanded
		case !Transient(err) || ctx.Err() != nil:
			return commitUnknown
		}
		select {
		case <-ctx.Done():
			return commitUnknown
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// CloseOn is Close on q (a transaction, for the reconciler).
func (s *Store) CloseOn(ctx context.Context, q Querier, serials []string) ([]string, error) {
	closed, err := querySerials(ctx, q, s.stmts.Close, len(serials), textArray(serials))
	return closed, clientCut(ctx, err)
}

// Found is one row the lookup statement returned.
type Found struct {
	Serial  string
	Pending bool // still pending: the close did not see it, not settled
}

// Lookup returns the serials among serials that have an order row, and
// whether each is still pending. It runs the lookup statement prepared (as
// Settle runs its statements), again at once if that went stale or was
// lost.
func (s *Store) Lookup(ctx context.Context, serials []string) ([]Found, error) {
	var found []Found
	cured := 0
	err := s.runCured(ctx, &cured, func(st *callState) (err error) {
		s.prep.ensure(ctx, s.stmts.Lookup)
		found, err = s.lookupOnce(ctx, serials, st)
		return err
	})
	if err != nil {
		return nil, clientCut(ctx, err)
	}
	return found, nil
}

func (s *Store) lookupOnce(ctx context.Context, serials []string, st *callState) (_ []Found, err error) {
	q := s.prep.on(nil, st.unprepared)
	defer func() { st.ranPrepared = *q.used }()
	defer decodePanic(q, &err)
	rows, err := q.QueryContext(ctx, s.stmts.Lookup, textArray(serials))
	if err != nil {
		return nil, sessionEnded(ctx, err)
	}
	defer rows.Close()
	trim := blankPadded(rows)
	out := make([]Found, 0, len(serials))
	// Scanned into once per statement, not per row: Scan takes them as
	// pointers, so they live on the heap. Each Scan sets them whole.
	var sn sql.NullString
	var pending sql.NullBool
	for rows.Next() {
		if err := rows.Scan(&sn, &pending); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrBadResult, err)
		}
		if !sn.Valid || !pending.Valid {
			return nil, fmt.Errorf("%w: NULL serial or pending flag", ErrBadResult)
		}
		out = append(out, Found{Serial: trim(sn.String), Pending: pending.Bool})
	}
	return out, sessionEnded(ctx, rows.Err())
}

// Cursor is where a page of overdue orders starts: after the order with
// this deadline and serial. The zero Cursor starts at the beginning.
type Cursor struct {
	ExpiresAt time.Time
	Serial    string
}

// OverdueOrder is a row of the overdue statement.
type OverdueOrder struct {
	Serial    string
	ExpiresAt time.Time
}

// Overdue returns up to limit pending orders whose deadline passed more than
// graceMillis ago, after the cursor, in (deadline, serial) order, locked in
// tx until it ends. The next page starts after the last one returned.
func (s *Store) Overdue(ctx context.Context, tx Querier, graceMillis, limit int64, after Cursor) ([]OverdueOrder, error) {
	out, err := s.overdue(ctx, tx, graceMillis, limit, after)
	return out, clientCut(ctx, err)
}

// RelockOverdue locks again, in tx, the rows among serials that are still
// pending and more than graceMillis past their deadline, skipping rows
// someone else holds, and returns their serials. It needs the reference
// schema's orders table: a custom overdue statement (DefaultOverdue false)
// reads a table whose deadline only that statement knows.
func (s *Store) RelockOverdue(ctx context.Context, tx Querier, serials []string, graceMillis int64) ([]string, error) {
	locked, err := querySerials(ctx, tx, relockOverdueSQL, len(serials), textArray(serials), graceMillis)
	return locked, clientCut(ctx, err)
}

// DefaultOverdue reports whether the overdue statement is the reference
// schema's (DefaultOverdueSQL).
func (s *Store) DefaultOverdue() bool { return s.stmts.Overdue == DefaultOverdueSQL }

func (s *Store) overdue(ctx context.Context, tx Querier, graceMillis, limit int64, after Cursor) ([]OverdueOrder, error) {
	var at any = "-infinity"
	if !after.ExpiresAt.IsZero() {
		at = after.ExpiresAt
	}
	rows, err := tx.QueryContext(ctx, s.stmts.Overdue, graceMillis, limit, at, after.Serial)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	trim := blankPadded(rows)
	out := make([]OverdueOrder, 0, limit)
	for rows.Next() {
		var serial sql.NullString
		var at sql.NullTime
		if err := rows.Scan(&serial, &at); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrBadResult, err)
		}
		if !serial.Valid || !at.Valid {
			return nil, fmt.Errorf("%w: NULL serial or deadline", ErrBadResult)
		}
		out = append(out, OverdueOrder{Serial: trim(serial.String), ExpiresAt: at.Time})
	}
	return out, rows.Err()
}

// blankPadded returns how to read the serials of rows' first column: a
// char(n) column (BPCHAR, which Verify accepts) comes back blank-padded to
// n, and PostgreSQL ignores those trailing blanks when it compares, so they
// are trimmed; any other column is read as it is (a text serial may end in
// a blank that matters).
func blankPadded(rows *sql.Rows) func(string) string {
	if cols, err := rows.ColumnTypes(); err == nil && len(cols) > 0 && cols[0].DatabaseTypeName() == "BPCHAR" {
		return func(s string) string { return strings.TrimRight(s, " ") }
	}
	return func(s string) string { return s }
}

// ErrBadResult is wrapped when a statement returns something other than the
// non-NULL columns it must.
var ErrBadResult = errors.New("statement result")

// ErrBadShape is wrapped (with ErrBadResult) when a `$1 text[]` statement
// returns rows of other than one column: the same for every input (the
// schema changed under the daemon since start-up's Verify), never one
// row's fault.
var ErrBadShape = errors.New("wrong number of columns")

func querySerials(ctx context.Context, q Querier, query string, sizeHint int, args ...any) (_ []string, err error) {
	defer decodePanic(q, &err)
	rows, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	trim := blankPadded(rows)
	out := make([]string, 0, sizeHint)
	var s sql.NullString // once per statement, as in Lookup: each Scan sets it whole
	for rows.Next() {
		if err := rows.Scan(&s); err != nil {
			if cols, cerr := rows.Columns(); cerr == nil && len(cols) != 1 {
				return nil, fmt.Errorf("%w: %w: %d columns, want 1", ErrBadResult, ErrBadShape, len(cols))
			}
			return nil, fmt.Errorf("%w: %w", ErrBadResult, err)
		}
		if !s.Valid {
			return nil, fmt.Errorf("%w: NULL serial", ErrBadResult)
		}
		out = append(out, trim(s.String))
	}
	return out, rows.Err()
}

// Verify checks that each statement prepares, takes the parameter types it
// must and returns the columns it must (one text column; the overdue
// statement a text and a timestamptz, the lookup a text and a boolean),
// without changing any data: it runs them with empty input inside a
// transaction it rolls back. A misconfigured statement is a configuration
// error.
func (s *Store) Verify(ctx context.Context) error {
	type check struct {
		name, setting, query string
		params               []string
		args                 []any
		cols                 []column
		hint                 string
	}
	checks := []check{
		{"close", "ORDERDELAY_CLOSE_SQL", s.stmts.Close, []string{"text[]"}, []any{pq.Array([]string{})}, serialColumn, ""},
		{"lookup", "ORDERDELAY_LOOKUP_SQL", s.stmts.Lookup, []string{"text[]"}, []any{pq.Array([]string{})}, lookupColumns,
			"the lookup returns each serial that has a row and whether it is still pending (see README, Custom statements)"},
		{"overdue", "ORDERDELAY_OVERDUE_SQL", s.stmts.Overdue, []string{"bigint", "bigint", "timestamp with time zone", "text"},
			[]any{int64(1 << 40), int64(0), "-infinity", ""}, overdueColumns,
			"the overdue statement pages by keyset: it takes " + OverdueParams + ", and returns " + OverdueColumns +
				" (see README, Custom statements)"},
	}
	if s.OneStatement() {
		// The built-in statement is checked against the table too: a
		// reference table changed under the defaults fails here, at start,
		// rather than on every batch.
		checks = append(checks, check{"close and lookup in one statement (the reference schema's)", "ORDERDELAY_CLOSE_SQL", s.settleSQL,
			[]string{"text[]"}, []any{pq.Array([]string{})}, settleColumns,
			"the orders table differs from the reference schema; configure the close and lookup statements for it (see README, Custom statements)"})
	}
	tx, err := s.db.BeginTxx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback() //nolint:errcheck // read-only check; rollback is the point
	for _, c := range checks {
		if err := verifyOne(ctx, tx, c.query, c.params, c.args, c.cols); err != nil {
			if Unavailable(err) {
				return err // the database, not the statement: retried
			}
			if c.hint != "" {
				err = fmt.Errorf("%w; %s", err, c.hint)
			}
			return &StatementError{Name: c.name, Setting: c.setting, Err: err}
		}
	}
	return nil
}

// column is a result column a statement must return: what it is, and the
// type names (database/sql's DatabaseTypeName) that are accepted for it.
type column struct {
	what  string
	types []string
}

var (
	textTypes      = []string{"TEXT", "VARCHAR", "BPCHAR"}
	serialColumn   = []column{{"the serial", textTypes}}
	lookupColumns  = []column{{"the serial", textTypes}, {"whether the order is still pending", []string{"BOOL"}}}
	overdueColumns = []column{{"the serial", textTypes}, {"the deadline", []string{"TIMESTAMPTZ"}}}
	settleColumns  = []column{{"whether it closed the orders", []string{"BOOL"}},
		{"whether the orders were pending", []string{"BOOL"}}, {"the serials", []string{"_TEXT"}},
		{"the transaction id", []string{"INT8"}}, {"the server", []string{"TEXT"}}}
)

// StatementError says which configured statement failed verification.
type StatementError struct {
	Name, Setting string
	Err           error
}

func (e *StatementError) Error() string {
	return fmt.Sprintf("%s statement (%s): %v", e.Name, e.Setting, e.Err)
}

func (e *StatementError) Unwrap() error { return e.Err }

// verifySavepoint is set by verifyOne before it runs a statement and
// rolled back to after, so the next statement's check in the same
// transaction starts where this one did.
const verifySavepoint = "orderdelay_verify"

func verifyOne(ctx context.Context, tx *sqlx.Tx, query string, params []string, args []any, want []column) error {
	if err := Savepoint(ctx, tx, verifySavepoint); err != nil {
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
	if len(cols) != len(want) {
		what := make([]string, len(want))
		for i, w := range want {
			what[i] = w.what
		}
		return fmt.Errorf("returns %d columns, want %d (%s)", len(cols), len(want), strings.Join(what, ", "))
	}
	for i, w := range want {
		if t := cols[i].DatabaseTypeName(); !slices.Contains(w.types, t) {
			return fmt.Errorf("returns %s (column %d) of type %s, want %s", w.what, i+1, t, strings.ToLower(w.types[0]))
		}
	}
	return RollbackToSavepoint(ctx, tx, verifySavepoint)
}

// DryRun is a Store whose Close runs the close statement in a transaction
// that it always rolls back: it returns what would have been closed and
// changes nothing (side effects of a custom statement are rolled back too).
type DryRun struct{ *Store }

// Close reports which of serials the close statement would close. Nothing
// commits, so there is nothing to fence.
func (d DryRun) Close(ctx context.Context, serials []string, _ Fence) ([]string, error) {
	out, err := d.closeTx(ctx, serials, nil, "", true, false)
	return out.Closed, clientCut(ctx, err)
}

// Settle is Store.Settle rolled back: Closed is what would have been
// closed. (Defined here, not promoted from Store, whose Settle commits.)
func (d DryRun) Settle(ctx context.Context, serials []string, _ Fence) (Outcome, error) {
	out, err := d.closeTx(ctx, serials, nil, "", true, d.OneStatement())
	return out, clientCut(ctx, err)
}

// VerifyStatement checks that a task queue's statement takes `$1 text[]`
// and returns one text column, without changing data.
func VerifyStatement(ctx context.Context, db *sqlx.DB, query string) error {
	tx, err := db.BeginTxx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback() //nolint:errcheck // read-only check
	if err := verifyOne(ctx, tx, query, []string{"text[]"}, []any{pq.Array([]string{})}, serialColumn); err != nil {
		if Unavailable(err) {
			return err
		}
		return &StatementError{Name: "task queue", Setting: "ORDERDELAY_QUEUES_FILE", Err: err}
	}
	return nil
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

// Close closes the pending orders among serials and records their events,
// in one transaction, fenced as Store.Close.
func (o WithOutbox) Close(ctx context.Context, serials []string, fence Fence) ([]string, error) {
	out, err := o.closeTx(ctx, serials, fence, "timeout", false, false)
	return out.Closed, clientCut(ctx, err)
}

// Settle is Store.Settle that also records a close event per closed order,
// in the same transaction. (Defined here, not promoted from Store, whose
// Settle records none.)
func (o WithOutbox) Settle(ctx context.Context, serials []string, fence Fence) (Outcome, error) {
	out, err := o.closeTx(ctx, serials, fence, "timeout", false, o.OneStatement())
	return out, clientCut(ctx, err)
}

// CloseEvent is one close event of the outbox.
type CloseEvent struct {
	ID       int64     `db:"id"`
	Serial   string    `db:"serial_no"`
	Reason   string    `db:"reason"`
	ClosedAt time.Time `db:"closed_at"`
}

// RelayOutbox locks up to limit close events, oldest first, skipping rows
// another replica holds (SKIP LOCKED), hands them to publish and, once
// publish succeeded, deletes them in the same transaction. A crash or
// error after publish leaves them for the next call: delivery is at least
// once. It returns how many events it relayed.
func RelayOutbox(ctx context.Context, db *sqlx.DB, limit int, publish func(ctx context.Context, events []CloseEvent) error) (int, error) {
	tx, err := db.BeginTxx(ctx, nil)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback() //nolint:errcheck // after Commit this is a no-op
	var events []CloseEvent
	err = tx.SelectContext(ctx, &events, `SELECT id, serial_no, reason, closed_at FROM `+OutboxTable+`
		ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED`, limit)
	if err != nil || len(events) == 0 {
		return 0, err
	}
	if err := publish(ctx, events); err != nil {
		return 0, fmt.Errorf("publish: %w", err)
	}
	ids := make([]int64, len(events))
	for i, e := range events {
		ids[i] = e.ID
	}
	if _, err := tx.ExecContext(ctx, "DELETE FROM "+OutboxTable+" WHERE id = ANY($1)", pq.Array(ids)); err != nil {
		return 0, fmt.Errorf("prune outbox: %w", err)
	}
	if err := tx.Commit(); err != nil {
		return 0, err
	}
	return len(events), nil
}
