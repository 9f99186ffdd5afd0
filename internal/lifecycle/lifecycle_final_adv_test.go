package lifecycle

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// Adversarial tests of 01052be: a bounded stage's Start is abandoned like
// its Runs.

// stuckStartStage is a bounded stage whose first actor's Run started and
// whose second actor's Start never returns once the run ended (until the
// test lets it go). runStopped is closed when the Run's context ended.
func stuckStartStage(t *testing.T, j *journal) (st Stage, started <-chan struct{}, runStopped <-chan struct{}) {
	stuck, left, ready, stopped := make(chan struct{}), make(chan struct{}), make(chan struct{}), make(chan struct{})
	t.Cleanup(func() { close(stuck); <-left }) // let the abandoned Start go before goleak looks
	return Stage{Name: "work", StopWithin: 200 * time.Millisecond, Actors: []Actor{
		{Name: "consumer", Run: func(ctx context.Context) error {
			j.add("run consumer")
			<-ctx.Done()
			j.add("stopped consumer")
			close(stopped)
			return nil
		}},
		{Name: "check", Start: func(ctx context.Context) error {
			defer close(left)
			close(ready)
			<-ctx.Done()
			<-stuck
			return nil
		}},
	}}, ready, stopped
}

// Invariant "a bounded stage's stop takes at most its StopWithin" and
// "a stage's actors are stopped at once": an actor of the stage whose Run
// started before a Start of the same stage that never returns is told to
// stop only once that Start has been abandoned, StopWithin after the run
// ended — it goes on working (claiming, closing) through the whole bound,
// and the stage's stop then waits for it a second StopWithin. The Run's
// context must have ended by the time the Start is abandoned.
func TestAdvFinalAStageRunIsStoppedWhileItsLaterStartIsAbandoned(t *testing.T) {
	j := &journal{}
	st, ready, runStopped := stuckStartStage(t, j)
	var mu sync.Mutex
	var atAbandon []bool // whether the Run's context had ended, at each Abandoned
	g := Group{
		Stages: []Stage{st},
		Abandoned: func(stage string, actors []string) {
			select {
			case <-runStopped:
				mu.Lock()
				atAbandon = append(atAbandon, true)
				mu.Unlock()
			default:
				mu.Lock()
				atAbandon = append(atAbandon, false)
				mu.Unlock()
			}
			j.add("abandoned " + stage + ": " + strings.Join(actors, ","))
		},
	}
	runThenStop(t, g, ready) //nolint:errcheck // the run's error is not what this test checks
	mu.Lock()
	defer mu.Unlock()
	if len(atAbandon) == 0 {
		t.Fatalf("nothing abandoned (events %q): the test proved nothing", j.events())
	}
	if !atAbandon[0] {
		t.Errorf("events %q: the stage's Run was still running, its context live, when the stage's Start was abandoned "+
			"a StopWithin after the run ended: it is told to stop only then, and the stage's stop can take two bounds", j.events())
	}
}

// Invariant "Stopped is told a stage's name once all of its actors have
// returned": a stage whose Start was abandoned (still running) is reported
// both abandoned and stopped.
func TestAdvFinalAStageWithAnAbandonedStartIsNotReportedStopped(t *testing.T) {
	j := &journal{}
	st, ready, _ := stuckStartStage(t, j)
	g := Group{
		Stages:    []Stage{st},
		Abandoned: func(stage string, actors []string) { j.add("abandoned " + stage + ": " + strings.Join(actors, ",")) },
		Stopped:   func(stage string) { j.add("stopped stage " + stage) },
	}
	runThenStop(t, g, ready) //nolint:errcheck // the run's error is not what this test checks
	ev := j.events()
	if !slices.Contains(ev, "abandoned work: check") {
		t.Fatalf("events %q: the Start was not abandoned, the test proved nothing", ev)
	}
	if slices.Contains(ev, "stopped stage work") {
		t.Errorf("events %q: the stage is reported stopped though its Start is still running (abandoned)", ev)
	}
}
