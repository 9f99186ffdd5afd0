package consumer

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/metrics"
)

// A ProcessFunc's plain error for a task spends an attempt: the task is
// retried by the queue's policy and dead-lettered as "failed" after
// MaxAttempts. An action that can tell a failure that says nothing about
// the task wraps it instead, and the task spends no attempt and is never
// dead-lettered for it:
//
//   - Unavailable(err): the database is down, read-only, overloaded or
//     too slow for everyone (orders.Transient). The task is retried after
//     the consumer's dependency backoff, as an order batch is when the
//     database is away, and the worker holds back for that backoff, so
//     errors per second stay bounded.
//   - Later(err): the task's own row was locked, in conflict or slow
//     (orders.Contended), or the task was not tried because its batch ran
//     out of time isolating another. It is retried after a delay that
//     grows with how overdue it is (half of that, from one second up to
//     BackoffMax, jittered), as a contended order is.
//
// The task's last_error records the wrapped error's text.
type NoAttemptError struct {
	Err         error
	Unavailable bool // false: Later
	Untried     bool // Later, not tried: retried before the batch's others (NotTried)
}

func (e *NoAttemptError) Error() string { return e.Err.Error() }

func (e *NoAttemptError) Unwrap() error { return e.Err }

// Unavailable marks err as the database's, not the task's (see
// NoAttemptError).
func Unavailable(err error) error { return &NoAttemptError{Err: err, Unavailable: true} }

// Later marks err as one the task's row caused for a while, or a task not
// tried (see NoAttemptError).
func Later(err error) error { return &NoAttemptError{Err: err} }

// NotTried is Later for a task its batch never tried (its time ran out
// isolating another): it comes due, in the batch's order, before the
// batch's tasks that were tried, so the next claim meets it first.
func NotTried(err error) error { return &NoAttemptError{Err: err, Untried: true} }

// noAttempt is the NoAttemptError in err, or nil.
func noAttempt(err error) *NoAttemptError {
	var na *NoAttemptError
	if errors.As(err, &na) {
		return na
	}
	return nil
}

// retryNoAttempt retries tasks whose action failed with a NoAttemptError,
// spending no attempt. It holds the worker back for the dependency backoff
// when some were Unavailable, so it comes last in a batch's bookkeeping.
//
// The groups come due in this order, each in the batch's order
// (retryInOrder), as in the order worker's oneByOne: the tasks the batch
// never tried, then the unavailable ones, then those tried alone (held),
// so that the next claim meets first what this batch never reached, and
// rows that always fail alone cannot hold their batch-mates back. Untried
// tasks with nothing to come before are retried as Later ones are (a
// backoff that grows with how overdue they are), so a batch that keeps
// running out of time does not come back every few hundred milliseconds.
// Every group counts in errors_total{stage="close"}.
func (c *Consumer) retryNoAttempt(workCtx context.Context, untried, later, down []item, untriedErr, laterErr, downErr error) {
	var held heldRetries
	if len(later) > 0 {
		c.m.Errors.WithLabelValues(metrics.StageClose).Add(float64(len(later)))
		c.log.Warn("task action failed for a reason that spends no attempt; retrying",
			zap.Int("tasks", len(later)), zap.Error(laterErr))
		held.add(c, later, c.contendedBackoff(oldestOf(later)), laterErr.Error())
	}
	var after time.Duration // when the last untried task is due
	if len(untried) > 0 {
		c.m.Errors.WithLabelValues(metrics.StageClose).Add(float64(len(untried)))
		c.log.Warn("tasks not tried by their batch; retrying them first, spending no attempt",
			zap.Int("tasks", len(untried)), zap.Error(untriedErr))
		delay := c.untriedBackoff()
		if len(later) == 0 && len(down) == 0 {
			delay = c.contendedBackoff(oldestOf(untried))
		}
		after = c.retryInOrder(untried, delay, untriedErr.Error())
	}
	if len(down) > 0 {
		c.m.Errors.WithLabelValues(metrics.StageClose).Add(float64(len(down)))
		// down=false: the order path and the daemon's health check own
		// orderdelay_dependency_up; a task queue would set it but never
		// clear it (a webhook queue's success says nothing of PostgreSQL).
		// The unavailable come due after the untried; held, flushed
		// there, after both.
		c.unavailableFrom(workCtx, down, downErr, "close", false, false, &held, after)
		return
	}
	held.flush(c, after)
}

// oldestOf is the item of items with the earliest deadline.
func oldestOf(items []item) item {
	oldest := items[0]
	for _, it := range items[1:] {
		if it.deadline < oldest.deadline {
			oldest = it
		}
	}
	return oldest
}
