package lifecycle

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// journal records events from several goroutines.
type journal struct {
	mu sync.Mutex
	ev []string
}

func (j *journal) add(s string) {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.ev = append(j.ev, s)
}

func (j *journal) events() []string {
	j.mu.Lock()
	defer j.mu.Unlock()
	return slices.Clone(j.ev)
}

// loop is an actor that records its start and stop and, when it is told
// to stop, closes draining (if set) and waits for release (work still in
// flight).
func loop(j *journal, name string, draining chan<- struct{}, release <-chan struct{}) Actor {
	return Actor{Name: name, Run: func(ctx context.Context) error {
		j.add("run " + name)
		<-ctx.Done()
		if draining != nil {
			close(draining)
			<-release
		}
		j.add("stopped " + name)
		return nil
	}}
}

// TestStagesStartInOrderAndStopInReverseEachAwaited: the parent context
// ending stops the last stage first, and a stage is stopped only after
// every actor of the stage after it has returned — a slow drain included.
func TestStagesStartInOrderAndStopInReverseEachAwaited(t *testing.T) {
	j := &journal{}
	ctx, cancel := context.WithCancel(context.Background())
	draining, release := make(chan struct{}), make(chan struct{})
	ready := make(chan struct{})
	g := Group{
		Stages: []Stage{
			{Name: "http", Actors: []Actor{
				{Name: "listen", Start: func(context.Context) error { j.add("start listen"); return nil }},
				loop(j, "serve", nil, nil),
			}},
			{Name: "work", Actors: []Actor{
				{Name: "db", Start: func(context.Context) error { j.add("start db"); return nil }},
				loop(j, "consumer", draining, release),
				{Name: "last", Run: func(ctx context.Context) error { close(ready); <-ctx.Done(); return nil }},
			}},
		},
		Stopping: func(cause error) { j.add("stopping") },
		Stopped:  func(stage string) { j.add("stage " + stage + " stopped") },
	}
	done := make(chan error, 1)
	go func() { done <- g.Run(ctx) }()
	<-ready
	cancel()
	<-draining
	close(release)
	if err := <-done; err != nil {
		t.Fatalf("Run: %v, want nil after the parent context ended", err)
	}
	ev := j.events()
	idx := func(s string) int {
		i := slices.Index(ev, s)
		if i < 0 {
			t.Fatalf("no %q in %q", s, ev)
		}
		return i
	}
	order := []string{"start listen", "start db", "stopping", "stopped consumer", "stage work stopped", "stopped serve", "stage http stopped"}
	for i := 1; i < len(order); i++ {
		if idx(order[i-1]) > idx(order[i]) {
			t.Errorf("%q came after %q; events: %q", order[i-1], order[i], ev)
		}
	}
}

// TestAFailingRunEndsTheRun: an actor whose Run fails (an HTTP server
// whose listener broke) stops everything, and Run returns its error, named.
func TestAFailingRunEndsTheRun(t *testing.T) {
	j := &journal{}
	broken := errors.New("accept tcp: use of closed network connection")
	var cause error
	g := Group{
		Stages: []Stage{
			{Name: "http", Actors: []Actor{{Name: "http server", Run: func(ctx context.Context) error { return broken }}}},
			{Name: "work", Actors: []Actor{loop(j, "consumer", nil, nil)}},
		},
		Stopping: func(err error) { cause = err },
	}
	err := g.Run(context.Background())
	if !errors.Is(err, broken) || !strings.HasPrefix(err.Error(), "http server: ") {
		t.Fatalf("Run: %v, want the server's error named by its actor", err)
	}
	if !errors.Is(cause, broken) {
		t.Errorf("Stopping was told %v, want the failure", cause)
	}
	if ev := j.events(); len(ev) > 0 && !slices.Contains(ev, "stopped consumer") {
		t.Errorf("the consumer was not stopped: %q", ev)
	}
}

// TestAFailingStartStopsWhatStartedAndStartsNothingAfter: a start-up step
// that fails (a statement that does not verify) ends the run; what started
// before it is stopped, what comes after never starts.
func TestAFailingStartStopsWhatStartedAndStartsNothingAfter(t *testing.T) {
	j := &journal{}
	bad := errors.New("close statement: wrong result type")
	g := Group{Stages: []Stage{
		{Name: "http", Actors: []Actor{loop(j, "serve", nil, nil)}},
		{Name: "work", Actors: []Actor{
			{Name: "postgres", Start: func(context.Context) error { return bad }},
			loop(j, "consumer", nil, nil),
		}},
	}}
	if err := g.Run(context.Background()); !errors.Is(err, bad) {
		t.Fatalf("Run: %v, want %v", err, bad)
	}
	if ev := j.events(); slices.Contains(ev, "run consumer") || !slices.Contains(ev, "stopped serve") {
		t.Errorf("events %q: want serve stopped and the consumer never run", ev)
	}
}

// TestCancelDuringAStartIsNoFailure: a signal while a Start still waits
// (for the database, say) ends the run cleanly.
func TestCancelDuringAStartIsNoFailure(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	waiting := make(chan struct{})
	g := Group{Stages: []Stage{{Name: "work", Actors: []Actor{
		{Name: "postgres", Start: func(ctx context.Context) error { close(waiting); <-ctx.Done(); return ctx.Err() }},
	}}}}
	done := make(chan error, 1)
	go func() { done <- g.Run(ctx) }()
	<-waiting
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v, want nil", err)
	}
}

// TestAFinishedRunEndsNothing: a one-shot actor returning nil does not
// stop the others.
func TestAFinishedRunEndsNothing(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	finished := make(chan struct{})
	j := &journal{}
	g := Group{Stages: []Stage{{Name: "work", Actors: []Actor{
		{Name: "check", Run: func(context.Context) error { close(finished); return nil }},
		loop(j, "consumer", nil, nil),
	}}}}
	done := make(chan error, 1)
	go func() { done <- g.Run(ctx) }()
	<-finished
	select {
	case err := <-done:
		t.Fatalf("Run returned %v after a one-shot actor finished", err)
	default:
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestAFailureWhileStoppingIsReported: an actor that cannot stop cleanly
// (a hand-back that failed) makes the run's result an error even when
// the signal ended it; a plain context.Canceled does not.
func TestAFailureWhileStoppingIsReported(t *testing.T) {
	handBack := errors.New("hand back: redis down")
	for _, tc := range []struct {
		stopErr error
		want    error
	}{{handBack, handBack}, {context.Canceled, nil}} {
		ctx, cancel := context.WithCancel(context.Background())
		running := make(chan struct{})
		g := Group{Stages: []Stage{{Name: "work", Actors: []Actor{{Name: "consumer", Run: func(ctx context.Context) error {
			close(running)
			<-ctx.Done()
			return tc.stopErr
		}}}}}}
		done := make(chan error, 1)
		go func() { done <- g.Run(ctx) }()
		<-running
		cancel()
		if err := <-done; !errors.Is(err, tc.want) || (tc.want == nil) != (err == nil) {
			t.Errorf("stop error %v: Run returned %v, want %v", tc.stopErr, err, tc.want)
		}
	}
}

// TestStoppingRunsWhileAStartCannotBeInterrupted: readiness must turn 503
// on the signal even while a Start that ignores its context (a migration)
// is still running.
func TestStoppingRunsWhileAStartCannotBeInterrupted(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	inStart, release, stopping := make(chan struct{}), make(chan struct{}), make(chan struct{})
	g := Group{
		Stages: []Stage{{Name: "work", Actors: []Actor{{Name: "migrate", Start: func(context.Context) error {
			close(inStart)
			<-release
			return nil
		}}}}},
		Stopping: func(error) { close(stopping) },
	}
	done := make(chan error, 1)
	go func() { done <- g.Run(ctx) }()
	<-inStart
	cancel()
	select {
	case <-stopping:
	case <-time.After(time.Minute):
		t.Error("Stopping was not called while the Start ran")
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestAWatchEndsTheRunCleanlyAndStopsLast: an actor that watches for the
// end (a signal handler) ends the run by calling stop — not a failure —
// while it keeps running until its own stage is stopped, after every
// stage listed after it; a second stop changes nothing.
func TestAWatchEndsTheRunCleanlyAndStopsLast(t *testing.T) {
	j := &journal{}
	signal := make(chan string)
	draining, release := make(chan struct{}), make(chan struct{})
	ready := make(chan struct{}) // every actor has started: a stop now stops them all
	var cause error = errors.New("Stopping not called")
	g := Group{
		Stages: []Stage{
			{Name: "signals", Actors: []Actor{{Name: "signals", Watch: func(ctx context.Context, stop func()) error {
				for {
					select {
					case s := <-signal:
						j.add("signal " + s)
						stop()
					case <-ctx.Done():
						j.add("stopped signals")
						return nil
					}
				}
			}}}},
			{Name: "http", Actors: []Actor{loop(j, "serve", nil, nil)}},
			{Name: "work", Actors: []Actor{
				loop(j, "consumer", draining, release),
				{Name: "last", Run: func(ctx context.Context) error { close(ready); <-ctx.Done(); return nil }},
			}},
		},
		Stopping: func(err error) { cause = err },
		Stopped:  func(stage string) { j.add("stage " + stage + " stopped") },
	}
	done := make(chan error, 1)
	go func() { done <- g.Run(context.Background()) }()
	// A signal before the last stage started would stop the run before
	// the consumer ever ran (nothing starts after a stop), and draining
	// would never come: wait for every actor to start.
	<-ready
	signal <- "TERM"
	<-draining
	signal <- "INT" // still watched while the others stop: no second stop, no failure
	close(release)
	if err := <-done; err != nil {
		t.Fatalf("Run: %v, want nil: a watch that stops the run is no failure", err)
	}
	if cause != nil {
		t.Errorf("Stopping was told %v, want nil", cause)
	}
	ev := j.events()
	want := []string{"stage work stopped", "stage http stopped", "stopped signals", "stage signals stopped"}
	if got := slices.DeleteFunc(slices.Clone(ev), func(s string) bool { return !slices.Contains(want, s) }); !slices.Equal(got, want) {
		t.Errorf("stop order %q, want %q; events: %q", got, want, ev)
	}
	if i := slices.Index(ev, "signal INT"); i < 0 || i > slices.Index(ev, "stopped signals") {
		t.Errorf("the second signal was not seen by the watch before it stopped: %q", ev)
	}
}

// An actor that does not return when stopped (a call blocked on a
// dependency that never answers: lib/pq cannot cut a read) holds its
// stage's stop only for the stage's StopWithin: then the run names it as
// abandoned, stops the stages before it as usual, and returns — with no
// failure: abandoning is not one. An actor of the same stage that returned
// is not named.
func TestAStageThatDoesNotStopWithinItsBoundIsAbandoned(t *testing.T) {
	j := &journal{}
	stuck, left, ready, bReady := make(chan struct{}), make(chan struct{}), make(chan struct{}), make(chan struct{})
	defer func() { close(stuck); <-left }() // let the abandoned actor go before goleak looks
	var abandoned []string
	g := Group{
		Stages: []Stage{
			{Name: "first", Actors: []Actor{loop(j, "a", nil, nil)}},
			{Name: "work", StopWithin: time.Second, Actors: []Actor{
				{Name: "b", Run: func(ctx context.Context) error {
					close(bReady)
					<-ctx.Done()
					j.add("stopped b")
					return nil
				}},
				{Name: "blocked", Run: func(ctx context.Context) error {
					defer close(left)
					close(ready)
					<-ctx.Done()
					<-stuck // never returns while the test runs
					return nil
				}},
			}},
		},
		Abandoned: func(stage string, actors []string) {
			abandoned = append(abandoned, stage+": "+strings.Join(actors, ","))
		},
	}
	if err := runThenStop(t, g, ready, bReady); err != nil {
		t.Errorf("Run = %v, want nil: the parent context ended the run, and abandoning is no failure", err)
	}
	if want := []string{"work: blocked"}; !slices.Equal(abandoned, want) {
		t.Errorf("Abandoned told %q, want %q", abandoned, want)
	}
	if ev := j.events(); !slices.Contains(ev, "stopped a") || !slices.Contains(ev, "stopped b") {
		t.Errorf("events %q: the other actors were not stopped", ev)
	}
}

// A Start still running when the run stops (a start-up check blocked on a
// dependency that never answers) holds the stop only for its stage's
// StopWithin too: it is abandoned, named, nothing after it starts, and the
// stages before it stop as usual.
func TestAStartThatDoesNotReturnWithinItsStagesBoundIsAbandoned(t *testing.T) {
	j := &journal{}
	stuck, left, ready := make(chan struct{}), make(chan struct{}), make(chan struct{})
	defer func() { close(stuck); <-left }()
	var abandoned []string
	g := Group{
		Stages: []Stage{
			{Name: "first", Actors: []Actor{loop(j, "a", nil, nil)}},
			{Name: "work", StopWithin: 100 * time.Millisecond, Actors: []Actor{
				{Name: "preflight", Start: func(ctx context.Context) error {
					defer close(left)
					close(ready)
					<-ctx.Done()
					<-stuck
					return nil
				}},
				{Name: "after", Run: func(ctx context.Context) error { j.add("run after"); return nil }},
			}},
		},
		Abandoned: func(stage string, actors []string) {
			abandoned = append(abandoned, stage+": "+strings.Join(actors, ","))
		},
	}
	if err := runThenStop(t, g, ready); err != nil {
		t.Errorf("Run = %v, want nil", err)
	}
	if want := []string{"work: preflight"}; !slices.Equal(abandoned, want) {
		t.Errorf("Abandoned told %q, want %q", abandoned, want)
	}
	if ev := j.events(); !slices.Contains(ev, "stopped a") || slices.Contains(ev, "run after") {
		t.Errorf("events %q: want the first stage stopped and nothing after the abandoned Start run", ev)
	}
}

// runThenStop runs g, waits until every channel of ready is closed, ends
// the run and returns Run's error; a run that does not return fails the
// test (a guard against a hang, not a budget).
func runThenStop(t *testing.T, g Group, ready ...<-chan struct{}) error {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- g.Run(ctx) }()
	for _, ch := range ready {
		<-ch
	}
	cancel()
	select {
	case err := <-done:
		return err
	case <-time.After(time.Minute):
		t.Fatal("the run did not return: its stop waited for an actor that does not return")
		return nil
	}
}
