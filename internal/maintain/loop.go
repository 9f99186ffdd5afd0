// Package maintain holds the daemon's maintenance services, which run
// beside the scan loop of package consumer: the Reconciler closes pending
// orders the queue lost, the Relay publishes the outbox's close events to
// a Redis Stream, and the Janitor purges old dead letters.
//
// Each has the same shape: a config whose zero values take the package's
// defaults (Default*), RunOnce — one pass under its own deadline
// (PassTimeout) — and Run, which repeats passes on a Loop until its context
// ends and then returns nil: a lifecycle actor.
package maintain

import (
	"context"
	"time"

	"github.com/orderdelay/orderdelay/internal/lifecycle"
)

// Loop is when a service's passes run and how long each may take.
type Loop struct {
	// Interval is the wait between two passes, spread over Interval ±
	// Interval/Spread (Spread 0: exactly Interval) so replicas do not run
	// in step.
	Interval time.Duration
	Spread   int64
	// Retry, if set, is the wait after a failed pass instead of Interval.
	Retry time.Duration
	// PassTimeout bounds one pass (Bound).
	PassTimeout time.Duration
	// WaitFirst makes the first pass wait an Interval too, instead of
	// running at once.
	WaitFirst bool
	// Failed, if set, is told of each pass that failed while the context
	// was live (a pass cut by the end of the run is not a failure).
	Failed func(error)

	sleep func(ctx context.Context, d time.Duration) bool // tests only; nil: lifecycle.Sleep
}

// Bound returns ctx bounded by PassTimeout: the deadline of one pass.
// Each service's RunOnce starts with it.
func (l Loop) Bound(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, l.PassTimeout)
}

// Run calls pass until ctx ends, then returns nil. After a pass that
// reports more (work left that it could not reach), the next starts at
// once; after one that failed, Retry later (or Interval, if Retry is 0);
// otherwise the next waits Interval, spread.
func (l Loop) Run(ctx context.Context, pass func(context.Context) (more bool, err error)) error {
	sleep := l.sleep
	if sleep == nil {
		sleep = lifecycle.Sleep
	}
	if l.WaitFirst && !sleep(ctx, lifecycle.Jitter(l.Interval, l.Spread)) {
		return nil
	}
	for {
		more, err := pass(ctx)
		if err != nil && ctx.Err() == nil && l.Failed != nil {
			l.Failed(err)
		}
		var wait time.Duration
		switch {
		case more:
		case err != nil && l.Retry > 0:
			wait = l.Retry
		default:
			wait = lifecycle.Jitter(l.Interval, l.Spread)
		}
		if !sleep(ctx, wait) {
			return nil
		}
	}
}

// orDefault is v, or d when v is not above zero: a service config's zero
// values take the package's defaults.
func orDefault[T int | time.Duration](v, d T) T {
	if v <= 0 {
		return d
	}
	return v
}
