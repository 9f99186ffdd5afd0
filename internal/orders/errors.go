package orders

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"

	"github.com/lib/pq"
)

// Transient reports whether err says something about the DATABASE rather
// than about the orders the statement ran on: retrying the same input later
// can succeed, so no attempt is spent and the batch is not split. Anything
// else is permanent for the statement and input that caused it (the
// consumer splits the batch to isolate the order).
//
// Transient:
//   - the connection: lost, refused, reset, closed (driver.ErrBadConn,
//     sql.ErrConnDone, sql.ErrTxDone, io.EOF, net errors, class 08), and any
//     error while connecting (a *ConnectError from Open, or a FATAL/PANIC
//     report, which ends the session: 57P03 starting up, 28P01 password,
//     3D000 no such database);
//   - the database's state: 25006 read-only transaction (a failover to a
//     standby, default_transaction_read_only), class 53 insufficient
//     resources (disk full, out of memory, too many connections), class 55
//     object not in prerequisite state (55P03 lock not available: a row
//     held past lock_timeout), class 57 operator intervention (57014
//     statement timeout or cancel, 57P01–57P05 shutdown, recovery, database
//     dropped, idle timeout), class 58 system errors (I/O), F0 configuration
//     file errors;
//   - transaction rollback: 40001 serialization failure, 40P01 deadlock,
//     40003 statement completion unknown, 40000;
//   - the statement as a whole: class 42 (undefined table or column,
//     permission denied, syntax) raised by the statement itself is the same
//     for every order, so the schema or a grant changed under the daemon;
//     burying orders cannot fix that; so are a prepared statement whose
//     result type the table changed under it (0A000 "cached plan must not
//     change result type", StalePlan) and one the session does not have
//     (26000, a pooler handing the transaction to another session): the
//     Store prepares again or stops preparing and runs the batch again at
//     once, and only returns them when that went wrong again;
//   - the context's deadline or cancellation, and any error the client
//     side raised because of it (the Store's methods wrap those with the
//     context's error: clientCut).
//
// Permanent, because they can depend on the row: class 22 data exception,
// 23 integrity constraint, 27 triggered data change, 44 WITH CHECK OPTION,
// 21 cardinality, 40002 a deferred constraint at commit, P0 PL/pgSQL (P0001
// a shop's trigger's RAISE), class 42 raised inside a function or trigger
// (dynamic SQL built from row values) or by a row-level security policy,
// and any code not listed above.
func Transient(err error) bool {
	if err == nil {
		return false
	}
	var ce *ConnectError
	if errors.As(err, &ce) {
		return true // nothing about an order can stop a connection opening
	}
	var be *BeginError
	if errors.As(err, &be) {
		return true // no statement of ours ran: nothing about an order
	}
	if errors.Is(err, errMixedUp) {
		return true // a pooler ran another client's statement: nothing about an order
	}
	var pqErr *pq.Error
	if errors.As(err, &pqErr) {
		return transientCode(pqErr)
	}
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) ||
		errors.Is(err, driver.ErrBadConn) || errors.Is(err, sql.ErrConnDone) || errors.Is(err, sql.ErrTxDone) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) {
		return true
	}
	var netErr net.Error
	if errors.As(err, &netErr) {
		return true
	}
	var opErr *net.OpError
	return errors.As(err, &opErr)
}

func transientCode(e *pq.Error) bool {
	// FATAL and PANIC end the session: the server speaks about itself (lib/pq
	// only returns them as *pq.Error while connecting; on a live connection
	// it turns them into driver.ErrBadConn).
	if e.Severity == "FATAL" || e.Severity == "PANIC" {
		return true
	}
	code := string(e.Code)
	if len(code) != 5 {
		return false
	}
	if StalePlan(e) {
		return true
	}
	switch code {
	case "26000", // invalid_sql_statement_name: a prepared statement the session lost
		"25006",                            // read_only_sql_transaction
		"40000", "40001", "40003", "40P01": // rollback, serialization, completion unknown, deadlock
		return true
	}
	switch code[:2] {
	case "08", // connection exception
		"53", // insufficient resources
		"55", // object not in prerequisite state (55P03 lock not available)
		"57", // operator intervention (57014 timeout/cancel, 57P01-05)
		"58", // system error (I/O)
		"F0": // configuration file error
		return true
	case "42":
		return !rowDependent42(e)
	}
	return false
}

// rowDependent42 reports a class 42 error that may depend on the row: raised
// inside a function or trigger (Where names it), where a shop's code can
// build SQL from row values, or a row-level security policy rejecting a row.
// Raised by the statement itself, class 42 is the same for every input.
func rowDependent42(e *pq.Error) bool {
	return e.Where != "" || e.InternalQuery != "" || strings.Contains(e.Message, "row-level security")
}

// Answered reports an error the server raised for a statement on a
// session that lives on (severity ERROR, not a connection exception): the
// transaction can roll back to a savepoint and go on. Whether the error is
// about a row or about the database, the server could still answer.
func Answered(err error) bool {
	var pqErr *pq.Error
	if !errors.As(err, &pqErr) {
		return false
	}
	return pqErr.Severity != "FATAL" && pqErr.Severity != "PANIC" && !strings.HasPrefix(string(pqErr.Code), "08")
}

// Unavailable is Transient less the errors a broken statement causes: at
// start-up, a statement that does not prepare (class 42) is a configuration
// error, not a database to wait for.
func Unavailable(err error) bool {
	var pqErr *pq.Error
	if errors.As(err, &pqErr) && len(pqErr.Code) == 5 && pqErr.Code[:2] == "42" && pqErr.Severity != "FATAL" {
		return false
	}
	return Transient(err)
}

// RowLocked reports a lock that was not available in time (55P03
// lock_not_available: lock_timeout, NOWAIT): a row someone else holds, not
// a database that is down. A row that stays locked should be isolated from
// its batch rather than hold the batch back.
func RowLocked(err error) bool {
	var pqErr *pq.Error
	return errors.As(err, &pqErr) && pqErr.Code == "55P03"
}

// Contended reports a transient error that one row can cause while the
// database is up and answering: 55P03 a lock not available in time, 40001
// a serialization failure, 40P01 a deadlock, 57014 a statement the server's
// statement_timeout cut (one slow row: a shop's trigger calling out, a hot
// row). The same order may well close later, so no attempt is spent, but
// the error may be that one row's, so a batch holding it is closed order by
// order rather than retried whole (which would hold the batch back for as
// long as the row stays bad). A statement cancelled at the client's request
// (57014 too, when lib/pq cancels for a context) is not: that is the
// client's deadline, not the row.
func Contended(err error) bool {
	var pqErr *pq.Error
	if !errors.As(err, &pqErr) {
		return false
	}
	switch pqErr.Code {
	case "55P03", "40001", "40P01":
		return true
	}
	return TimedOut(err)
}

// MaxCostly is how many Costly errors one batch spends isolating rows
// before it gives the rest back untried: the order path's oneByOne, the
// reconciler's page and a task SQL action's batch all stop there, and when
// all of them were statement timeouts they take the database itself to be
// slow. Two: one slow row is that row's; a second says more.
const MaxCostly = 2

// Costly reports a Contended error that took a timeout to arrive (a
// statement timeout, a lock timeout, a deadlock found after
// deadlock_timeout): isolating rows that cause it costs a timeout per try,
// so the callers bound how many they spend.
func Costly(err error) bool {
	var pqErr *pq.Error
	return TimedOut(err) || RowLocked(err) || (errors.As(err, &pqErr) && pqErr.Code == "40P01")
}

// TimedOut reports a statement the server cut (57014) on its own: its
// statement_timeout (a slow row, or a slow database), or an operator's
// pg_cancel_backend. A 57014 that came because the caller's context ended
// (lib/pq then asks the server to cancel, and reports the server's 57014)
// is not: the Store's methods wrap those with the context's error
// (clientCut). Told apart by the context, not by the message, which the
// server writes in its own language (lc_messages).
func TimedOut(err error) bool {
	var pqErr *pq.Error
	return errors.As(err, &pqErr) && pqErr.Code == "57014" &&
		!errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled)
}

// CutWhileRunning reports a statement the caller's deadline cut while the
// server ran it: lib/pq asked the server to cancel it and the server
// answered 57014 (clientCut wrapped that with context.DeadlineExceeded).
// The server had answered BEGIN and was working on the statement, so,
// when the deadline was the statement's own (not a batch's that was
// running out), it says what the server's own timeout would have said a
// little later — a slow row or a slow database — never that the database
// is away: under load a slow BEGIN leaves the statement less than its
// timeout before the client's deadline, which is counted from before
// BEGIN. A transaction that never started (BeginError) is not one.
func CutWhileRunning(err error) bool {
	var pqErr *pq.Error
	var be *BeginError
	return errors.Is(err, context.DeadlineExceeded) && errors.As(err, &pqErr) && pqErr.Code == "57014" &&
		!errors.As(err, &be)
}

// clientCut tells an error that arrived after ctx ended for what it is:
// the deadline's or the cancellation's. It wraps with ctx's error a 57014
// (the client cancelled the statement; the server did not time it out) and
// any error raised on the client's side rather than by the server — by
// database/sql or the driver once the context ended: the transaction's
// copy of a prepared statement closed under its query by the rollback that
// follows the context ("sql: statement is closed"), rows closed, a
// connection lib/pq marked bad — which would otherwise be taken for the
// orders' fault (permanent: the batch split, an order alone dead-lettered).
// Any other error the server sent is its answer, and is left as it is.
func clientCut(ctx context.Context, err error) error {
	cerr := ctx.Err()
	if err == nil || cerr == nil || errors.Is(err, cerr) {
		return err
	}
	var pqErr *pq.Error
	if errors.As(err, &pqErr) && pqErr.Code != "57014" {
		return err
	}
	return fmt.Errorf("%w: %w", cerr, err)
}

// BeginError is an error starting a transaction (BEGIN READ WRITE on a
// standby in recovery answers 0A000, for one): no statement ran yet, so it
// speaks about the database, never about the orders.
type BeginError struct{ Err error }

func (e *BeginError) Error() string { return "begin: " + e.Err.Error() }

func (e *BeginError) Unwrap() error { return e.Err }

// SessionEndedError is the error of a close's own statement (the close,
// or its events), or of the lookup, whose session ended while it ran, with no answer to it
// (SessionEnded): the connection broke, or the server ended the backend.
// Either the database went away (an outage, a failover: every session
// ends) or something the statement did ended its own session (a shop's
// trigger or extension that terminates or crashes its backend on one
// row). The error alone cannot tell them apart; a fresh connection can
// (the consumer pings the database before it takes it for a row's).
// Errors of BEGIN, of COMMIT and of the statements around the close are
// never one: nothing about a row ends those.
type SessionEndedError struct{ Err error }

func (e *SessionEndedError) Error() string { return e.Err.Error() }

func (e *SessionEndedError) Unwrap() error { return e.Err }

// SessionEnded reports an error of a statement that was sent and whose
// session ended with no answer to it: a broken connection (driver.ErrBadConn,
// EOF, a reset) or a FATAL or PANIC the server sent. Not one: an
// error the caller's context caused (a deadline, a cancel, a client-side
// timeout), any error before a statement ran (ConnectError, BeginError),
// and any error the server answered on a session that lives on.
func SessionEnded(err error) bool {
	if err == nil || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) ||
		errors.Is(err, sql.ErrTxDone) || errors.Is(err, errMixedUp) ||
		errors.As(err, new(*ConnectError)) || errors.As(err, new(*BeginError)) {
		return false
	}
	var netErr net.Error
	if errors.As(err, &netErr) && netErr.Timeout() {
		return false
	}
	var pqErr *pq.Error
	if errors.As(err, &pqErr) {
		// An ERROR, whatever its code (a trigger can RAISE class 08),
		// is the server answering on a session that lives on.
		return pqErr.Severity == "FATAL" || pqErr.Severity == "PANIC"
	}
	return Transient(err)
}

// sessionEnded marks err, the error of a statement run under ctx, as a
// SessionEndedError when it is one (SessionEnded) and ctx has not ended:
// a connection that broke as the caller's deadline passed may be the
// driver's way of cutting the statement.
func sessionEnded(ctx context.Context, err error) error {
	if ctx.Err() == nil && SessionEnded(err) {
		return &SessionEndedError{Err: err}
	}
	return err
}

// InDoubtError is a close whose COMMIT got no answer (the connection broke,
// the client's deadline passed while the server committed: unanswered) and whose
// outcome the server could not confirm either way within commitStatusWait
// (it could not be reached, or the one that answered is not the one that
// ran the transaction: a failover). The Orders it closed may have closed:
// the caller retries them as after any outage, and the SQL guard makes the
// retry harmless — an order that did close comes back settled. So a
// counter of closed orders misses exactly these; InDoubt tells how many.
type InDoubtError struct {
	Err    error
	Orders int // the orders the close closed, had it committed
}

func (e *InDoubtError) Error() string {
	return fmt.Sprintf("commit of %d closed orders unconfirmed: %v", e.Orders, e.Err)
}

func (e *InDoubtError) Unwrap() error { return e.Err }

// InDoubt returns how many orders err says a close may have closed
// unconfirmed (an InDoubtError), or 0.
func InDoubt(err error) int {
	var d *InDoubtError
	if errors.As(err, &d) {
		return d.Orders
	}
	return 0
}

// CommitError is err, the error of a COMMIT of a transaction that closed n
// orders, as an InDoubtError if it carries no answer (unanswered) and n is
// not 0: for callers that do not ask the server what became of the
// transaction, as Settle does.
func CommitError(err error, n int) error {
	if err == nil || n == 0 || !unanswered(err) {
		return err
	}
	return &InDoubtError{Err: err, Orders: n}
}

// unanswered reports a COMMIT error that says nothing of the transaction's
// fate: the connection broke or the client stopped waiting (Transient, and
// not an error the server sent). Anything else is an answer that it did
// not commit: PostgreSQL answers a COMMIT with an error only before its
// commit record (a deferred constraint or trigger, a serialization check;
// a FATAL, which may come after, reaches us as driver.ErrBadConn), and the
// driver's own refusals (a transaction it knows failed, a command tag other
// than COMMIT) follow a rollback. So an InDoubtError is always Transient.
func unanswered(err error) bool {
	var pqErr *pq.Error
	return !errors.As(err, &pqErr) && Transient(err)
}

// ConnectError is an error opening a connection of a pool made by Open.
type ConnectError struct{ Err error }

func (e *ConnectError) Error() string { return e.Err.Error() }

func (e *ConnectError) Unwrap() error { return e.Err }
