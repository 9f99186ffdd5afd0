package worker

import (
	"errors"
	"fmt"
	"time"
)

// ErrSkipRetry marks a handler's error as final: the task is dead-lettered
// now, whatever attempts it has left. Wrap it (fmt.Errorf("…: %w",
// worker.ErrSkipRetry)) or use SkipRetry.
var ErrSkipRetry = errors.New("skip retry")

// SkipRetry returns err marked as final (errors.Is(…, ErrSkipRetry)): the
// task is dead-lettered now with err as its last error. A nil err becomes
// ErrSkipRetry itself.
func SkipRetry(err error) error {
	if err == nil {
		return ErrSkipRetry
	}
	return &skipRetry{err}
}

type skipRetry struct{ err error }

func (e *skipRetry) Error() string        { return e.err.Error() }
func (e *skipRetry) Unwrap() []error      { return []error{e.err, ErrSkipRetry} }
func (e *skipRetry) Is(target error) bool { return target == ErrSkipRetry }

// RetryAfter returns err with the delay before the next attempt: the task
// runs again no sooner than d from now (on Redis's clock) instead of after
// the queue's retry policy. It still spends an attempt, so a task out of
// attempts is dead-lettered instead. A negative d is zero; a nil err
// becomes an error saying "retry after d".
func RetryAfter(d time.Duration, err error) error {
	if err == nil {
		err = fmt.Errorf("retry after %v", d)
	}
	return &retryAfter{d: max(d, 0), err: err}
}

type retryAfter struct {
	d   time.Duration
	err error
}

func (e *retryAfter) Error() string { return e.err.Error() }
func (e *retryAfter) Unwrap() error { return e.err }

// retryDelay reports the delay RetryAfter put on err, if any.
func retryDelay(err error) (time.Duration, bool) {
	var r *retryAfter
	if errors.As(err, &r) {
		return r.d, true
	}
	return 0, false
}

// ErrLeaseLost is the cause (context.Cause) of a handler's context when
// the worker could not extend the task's lease because it is no longer
// this worker's: it expired and another worker or poll took the task, or a
// producer moved or deleted it. The handler should stop; whatever it
// returns is ignored.
var ErrLeaseLost = errors.New("lease lost")

// ErrShutdown is the cause of a handler's context when a graceful
// shutdown ran out of time.
var ErrShutdown = errors.New("worker shut down")
