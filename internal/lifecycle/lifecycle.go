// Package lifecycle runs a daemon's actors — listeners, loops, one-off
// start-up steps — and stops them in an order written down in one place.
//
// A Group is a list of stages in start order. Starting walks the stages in
// that order and, within a stage, the actors in theirs: an actor's Start,
// if it has one, runs to completion (a listener binding its port, a wait
// for the database) before the next actor starts, and then its Run goes on
// in a goroutine of its own. So everything listed after a Start happens
// after it.
//
// The run ends when the parent context ends, when an actor's Watch calls
// its stop (a signal handler: the daemon's SIGTERM and SIGINT), or when any
// actor fails: a Start, a Run or a Watch that returns an error. The first
// two are no failure. Stopping (if set) is called at once — even while a
// Start is still on its way out — and then the stages that started are
// stopped in reverse order: it cancels the context of every actor of a
// stage at once and waits until all of them have returned before it stops
// the stage listed before. The last stage is the first stopped, the first
// the last: in the daemon, the signal handler's, listed before the
// listeners'.
//
// A stage may bound its stop (Stage.StopWithin): actors still running when
// it passes are abandoned, named to Group.Abandoned, and the stop goes on.
//
// A Watch goes on like a Run until its own stage is stopped, even after it
// called stop: a signal handler listed first keeps the signals caught (a
// second one ignored) until everything after it has stopped.
//
// Run returns the first failure, named by its actor, or nil when the parent
// context or a Watch ended the run. A Run or a Watch that returns nil
// before it is stopped has simply finished (a one-shot check): that ends
// nothing. Errors that say only "context canceled" once stopping has begun
// are not failures.
//
// Why not github.com/oklog/run: it starts every actor at once and calls
// the interrupts one after the other without waiting for each actor to
// return, so neither "the consumer starts after the database is ready" nor
// "HTTP stops only after the consumer has drained" can be said with it.
package lifecycle

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"
)

// Actor is one part of the daemon.
type Actor struct {
	Name string
	// Start, if set, runs before Run and before any later actor starts;
	// its context ends when the run does. An error ends the run.
	Start func(ctx context.Context) error
	// Run, if set, works until ctx ends and then returns nil (after
	// finishing or handing back its work). An error ends the run.
	Run func(ctx context.Context) error
	// Watch, if set, runs like Run and may also end the run — cleanly,
	// as the parent context ending does — by calling stop (more calls do
	// nothing). It keeps running until its stage is stopped.
	Watch func(ctx context.Context, stop func()) error
}

// Stage is a set of actors stopped together.
type Stage struct {
	Name   string
	Actors []Actor
	// StopWithin, if set, bounds how long stopping the stage waits for
	// its actors once their context is cancelled (for a Start still
	// running when the run ends, once the run's context has). Those still
	// running then are abandoned (Group.Abandoned is told their names) and the
	// stop goes on with the stage before: an actor blocked on a dependency
	// that never answers (a read no deadline can cut) cannot hold the
	// whole stop. They end with the process. An abandoned stage is no
	// failure of the run (Run's error is unchanged by it).
	StopWithin time.Duration
}

// Group is the daemon: its stages in start order.
type Group struct {
	Stages []Stage
	// Stopping, if set, runs once when the run begins to stop, before any
	// stage is stopped; cause is the failure, or nil when the parent
	// context ended the run.
	Stopping func(cause error)
	// Stopped, if set, is told each stage's name once all of its actors
	// have returned (logs, tests).
	Stopped func(stage string)
	// Abandoned, if set, is told a stage's name and the actors still
	// running when its StopWithin passed.
	Abandoned func(stage string, actors []string)
}

// Run starts the stages, waits for the parent context to end or an actor
// to fail, stops what started in reverse order and returns the first
// failure.
func (g Group) Run(parent context.Context) error {
	runCtx, end := context.WithCancel(parent)
	defer end()
	var (
		mu    sync.Mutex
		first error
	)
	fail := func(name string, err error) {
		mu.Lock()
		defer mu.Unlock()
		stopping := runCtx.Err() != nil
		if first == nil && !(stopping && errors.Is(err, context.Canceled)) {
			first = fmt.Errorf("%s: %w", name, err)
		}
		end()
	}
	stop := func() { end() }
	// Stopping runs as soon as the run ends, even while a Start is still
	// on its way out (a migration cannot be interrupted).
	stoppingDone := make(chan struct{})
	go func() {
		defer close(stoppingDone)
		<-runCtx.Done()
		if g.Stopping != nil {
			mu.Lock()
			cause := first
			mu.Unlock()
			g.Stopping(cause)
		}
	}()
	type running struct {
		name   string
		cancel context.CancelFunc
		wg     *sync.WaitGroup
		within time.Duration
		// stopBy is when a bounded stage stops waiting: within after its
		// stop began (after the run ended, for a stage stopped mid-Start).
		stopBy time.Time
		mu     sync.Mutex
		active map[string]int // actor name -> its Run and Watch still running
		// startLeft names the Start that was still running at stopBy.
		startLeft []string
	}
	// stopping begins r's stop: its actors' context is cancelled and, for
	// a bounded stage, the time it may take starts (once).
	stopping := func(r *running) {
		r.cancel()
		if r.within > 0 && r.stopBy.IsZero() {
			r.stopBy = time.Now().Add(r.within)
		}
	}
	var started []*running
start:
	for _, st := range g.Stages {
		// A stage's actors stop when the run stops them, not when the
		// parent context ends: that is what keeps the order.
		ctx, cancel := context.WithCancel(context.WithoutCancel(parent))
		r := &running{name: st.Name, cancel: cancel, wg: new(sync.WaitGroup), within: st.StopWithin, active: map[string]int{}}
		started = append(started, r)
		for _, a := range st.Actors {
			if runCtx.Err() != nil {
				break start
			}
			if a.Start != nil {
				returned, err := startWithin(runCtx, a.Start, r.within, func() time.Time { stopping(r); return r.stopBy })
				if !returned {
					r.startLeft = []string{a.Name}
					break start
				}
				if err != nil {
					fail(a.Name, err)
					break start
				}
			}
			for _, run := range []func(context.Context) error{a.Run, watch(a.Watch, stop)} {
				if run == nil {
					continue
				}
				r.wg.Add(1)
				r.mu.Lock()
				r.active[a.Name]++
				r.mu.Unlock()
				go func() {
					defer r.wg.Done()
					defer func() {
						r.mu.Lock()
						if r.active[a.Name]--; r.active[a.Name] == 0 {
							delete(r.active, a.Name)
						}
						r.mu.Unlock()
					}()
					if err := run(ctx); err != nil {
						fail(a.Name, err)
					}
				}()
			}
		}
	}
	<-stoppingDone
	for i := len(started) - 1; i >= 0; i-- {
		r := started[i]
		stopping(r)
		left := waitUntil(r.wg, r.stopBy, &r.mu, r.active)
		if left = append(r.startLeft, left...); len(left) > 0 {
			if g.Abandoned != nil {
				g.Abandoned(r.name, left)
			}
			continue
		}
		if g.Stopped != nil {
			g.Stopped(r.name)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	return first
}

// startWithin runs start and returns its error. With within set, it waits
// for start only until the time stopBy gives once ctx has ended (stopBy
// also begins the stage's stop, so the stage's Runs already started are
// told at once), and reports whether start returned: one that did not is
// left running (abandoned).
func startWithin(ctx context.Context, start func(context.Context) error, within time.Duration, stopBy func() time.Time) (returned bool, err error) {
	if within <= 0 {
		return true, start(ctx)
	}
	ch := make(chan error, 1)
	go func() { ch <- start(ctx) }()
	select {
	case err := <-ch:
		return true, err
	case <-ctx.Done():
	}
	t := time.NewTimer(time.Until(stopBy()))
	defer t.Stop()
	select {
	case err := <-ch:
		return true, err
	case <-t.C:
		return false, nil
	}
}

// waitUntil waits for wg, until by when it is set, and returns the names
// of the actors still running (sorted) if it gave up.
func waitUntil(wg *sync.WaitGroup, by time.Time, mu *sync.Mutex, active map[string]int) []string {
	if by.IsZero() {
		wg.Wait()
		return nil
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	t := time.NewTimer(time.Until(by))
	defer t.Stop()
	select {
	case <-done:
		return nil
	case <-t.C:
	}
	mu.Lock()
	defer mu.Unlock()
	left := make([]string, 0, len(active))
	for name := range active {
		left = append(left, name)
	}
	slices.Sort(left)
	return left
}

// watch is w as a Run, given stop; nil without w.
func watch(w func(context.Context, func()) error, stop func()) func(context.Context) error {
	if w == nil {
		return nil
	}
	return func(ctx context.Context) error { return w(ctx, stop) }
}
