package tasks

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/orders"
)

// sqlStatementShare is the part of a batch's time one statement of a sql
// action may take (its server-side statement_timeout): a quarter, so a
// batch whose statement timed out still has time to find the slow task one
// by one (maxCostly more timeouts) before its lease ends.
const sqlStatementShare = 4

// maxCostly is how many errors that cost a timeout (orders.Costly) one
// batch spends isolating tasks before it gives the rest back untried, as
// the order worker does (orders.MaxCostly).
const maxCostly = orders.MaxCostly

// sqlAction runs a queue's statement on a batch: `$1 text[]` ids -> the ids
// it handled. Ids it does not return failed (an attempt each).
//
// Each statement runs in a transaction of its own with statement_timeout
// set to a quarter of the batch's time and lock_timeout to a quarter of
// that (orders.LockTimeoutFor), so PostgreSQL itself cuts a slow statement
// or a wait for a row lock. Its errors are classified as the order close's
// are (orders.Transient, orders.Contended):
//
//   - about the database (connection lost, read-only, too many
//     connections, shutdown, ...): no task spends an attempt; the batch is
//     retried after the dependency backoff (consumer.Unavailable);
//   - contended (55P03 lock timeout, 40001, 40P01, 57014 statement
//     timeout): possibly one task's row, so the batch is run task by task;
//     a task that is contended alone is retried without spending an
//     attempt (consumer.Later), never dead-lettered for it;
//   - anything else (a constraint, a trigger's RAISE, bad data): the batch
//     is split in halves until the failing task is alone; only it spends an
//     attempt, its batch-mates succeed.
//
// Cost: a batch of N with one failing task runs at most 1 + 2*ceil(log2 N)
// statements; with a contended task, at most N+1; in any case at most
// 2N-1 (each statement runs on a different node of the halving tree).
// Timeouts: after maxCostly single tasks' timeouts the rest goes back
// untried, and no statement starts without the time to end by the
// server's timeout (a quarter of the batch's time, plus a tenth), so at
// most three statements of a batch hit statement_timeout and the batch
// ends before its lease. Whatever is not tried goes back without spending an attempt.
// Each statement after the first runs only the tasks the batch still holds
// (consumer.Held) and, under a durable queue's executor, whose rows are
// still SCHEDULED at the version it read (withLive): see stillLive.
func sqlAction(db *sqlx.DB, statement string) consumer.ProcessFunc {
	return func(ctx context.Context, tasks []consumer.Task) []error {
		r := &sqlRun{db: db, statement: statement, errs: make([]error, len(tasks))}
		if end, ok := ctx.Deadline(); ok {
			r.timeout = max(time.Until(end)/sqlStatementShare, orders.MinLockTimeout)
			r.lock = orders.LockTimeoutFor(r.timeout)
		}
		idx := make([]int, len(tasks))
		ids := make([]string, len(tasks))
		for i, t := range tasks {
			idx[i], ids[i] = i, t.ID
		}
		r.ids = ids
		r.batch(ctx, idx)
		return r.errs
	}
}

// sqlRun is one batch of a sql action: its tasks' outcomes and what it
// spent isolating a failing task.
type sqlRun struct {
	db             *sqlx.DB
	statement      string
	timeout, lock  time.Duration // server-side limits per statement; 0: none
	ids            []string
	errs           []error
	ran            int   // statements run
	costly, timed  int   // costly errors met isolating (timeouts among them)
	down, lastCost error // the database went away / the last costly error
}

// batch runs the statement on the tasks at idx, and on failure isolates
// the cause.
func (r *sqlRun) batch(ctx context.Context, idx []int) {
	if r.ran > 0 {
		// Isolating: a task cancelled or rescheduled since the batch
		// began is not run.
		if idx = r.stillLive(ctx, idx); len(idx) == 0 {
			return
		}
	}
	ids := make([]string, len(idx))
	for j, i := range idx {
		ids[j] = r.ids[i]
	}
	done, err := orders.RunIDsLimited(ctx, r.db, r.statement, ids, r.timeout, r.lock)
	first := r.ran == 0
	r.ran++
	if err != nil {
		if !first && len(idx) == 1 && orders.Costly(err) {
			// A single task's timeout counts, as in the order worker's
			// oneByOne (a split half's does not, or one locked row would
			// use up the budget twice and leave its batch-mates untried).
			r.costly++
			r.lastCost = err
			if orders.TimedOut(err) {
				r.timed++
			}
		}
		r.failed(ctx, idx, err)
		return
	}
	ok := make(map[string]bool, len(done))
	for _, id := range done {
		ok[id] = true
	}
	for _, i := range idx {
		if !ok[r.ids[i]] {
			r.errs[i] = fmt.Errorf("the statement did not return %q", r.ids[i])
		}
	}
}

func (r *sqlRun) set(idx []int, err error) {
	for _, i := range idx {
		r.errs[i] = err
	}
}

// failed handles the tasks at idx after their statement failed with err.
func (r *sqlRun) failed(ctx context.Context, idx []int, err error) {
	switch {
	case ctx.Err() != nil:
		// The batch's time ran out (the client cut the statement) or the
		// daemon is shutting down: nothing about these tasks.
		r.set(idx, consumer.Unavailable(err))
	case orders.Contended(err) && len(idx) > 1 && r.timeForAStatement(ctx):
		r.oneByOne(ctx, idx)
	case orders.Contended(err):
		// Alone (or out of time): someone else's lock or transaction, or
		// this task's slow row; retried without spending an attempt.
		r.set(idx, consumer.Later(err))
	case errors.As(err, new(*orders.SessionEndedError)) && r.databaseAnswers(ctx):
		// The statement's session ended under it, yet the database
		// answers at once: a task whose statement ends its own backend
		// (a trigger or extension that terminates it), not an
		// outage (that fails the ping too: the case below). Isolated like
		// a task's data error, so it does not hold its batch mates back;
		// the task alone is retried later with no attempt spent, since a
		// session ended from outside (a watchdog cutting slow statements,
		// a load balancer cutting connections) looks the same.
		if len(idx) > 1 {
			r.split(ctx, idx)
		} else {
			r.errs[idx[0]] = consumer.Later(fmt.Errorf("the statement ended its database session while the database answered: %w", err))
		}
	case orders.Transient(err) || errors.Is(err, orders.ErrBadShape):
		// ErrBadShape: the result's shape is the statement's, the same for
		// every task, like a class 42 error the statement itself raises.
		r.down = err
		r.set(idx, consumer.Unavailable(err))
	case len(idx) > 1:
		r.split(ctx, idx)
	default:
		r.errs[idx[0]] = err // this task's own failure: an attempt
	}
}

// databaseAnswers reports whether the database answers a statement on a
// connection of the pool, within a statement's timeout and the batch's
// time.
func (r *sqlRun) databaseAnswers(ctx context.Context) bool {
	if ctx.Err() != nil {
		return false
	}
	if r.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, r.timeout)
		defer cancel()
	}
	return r.db.PingContext(ctx) == nil
}

// split runs the two halves of idx one after the other, so a task whose
// data makes the statement fail is isolated in log2(len(idx)) steps.
func (r *sqlRun) split(ctx context.Context, idx []int) {
	half := len(idx) / 2
	for _, part := range [][]int{idx[:half], idx[half:]} {
		if !r.untried(ctx, part) {
			r.batch(ctx, part)
		}
	}
}

// oneByOne runs the tasks at idx one per statement, after an error one row
// can cause (orders.Contended): every task that can succeed does, and only
// the rows that cause the error wait. Errors that cost a timeout are
// bounded (counted in batch): after maxCostly, the rest goes back untried;
// if those were statement timeouts, the database itself is taken to be
// slow.
func (r *sqlRun) oneByOne(ctx context.Context, idx []int) {
	for _, i := range idx {
		if !r.untried(ctx, []int{i}) {
			r.batch(ctx, []int{i})
		}
	}
}

var errNotTried = errors.New("not tried: the batch's time ran out isolating a failing task")

// untried marks the tasks at idx to retry without an attempt, and reports
// true, when the batch should not run another statement: the database went
// away, maxCostly timeouts were spent, or too little time is left for a
// statement to end by the server's timeout rather than the client's.
func (r *sqlRun) untried(ctx context.Context, idx []int) bool {
	switch {
	case r.down != nil:
		r.set(idx, consumer.Unavailable(r.down))
	case r.timed >= maxCostly:
		r.set(idx, consumer.Unavailable(fmt.Errorf("statements time out one task at a time: %w", r.lastCost)))
	case r.costly >= maxCostly || !r.timeForAStatement(ctx):
		r.set(idx, consumer.NotTried(errNotTried))
	default:
		return false
	}
	return true
}

// timeForAStatement reports whether the batch has time left for one more
// statement to end by the server's statement_timeout (with a tenth to
// spare): a statement the client cancels says nothing about the task.
func (r *sqlRun) timeForAStatement(ctx context.Context) bool {
	if ctx.Err() != nil {
		return false
	}
	end, ok := ctx.Deadline()
	return !ok || r.timeout <= 0 || time.Until(end) >= r.timeout+r.timeout/10
}
