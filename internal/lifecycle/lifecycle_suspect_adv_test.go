package lifecycle

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"
)

// Adversarial tests of b8271d2 (a bounded stage stopped mid-Start).

// Invariants "a stage's Runs are told to stop when the run ends, even
// while a later Start of their stage is still on its way out", "a Start
// that returns within its bound is no abandonment: its stage is reported
// Stopped once its actors returned", "the Run of an actor whose Start
// returned after the run ended sees its context ended", and "stages stop
// in reverse order, an unbounded stage (StopWithin 0) waiting as before".
func TestAdvSuspectALateStartWithinItsBoundIsStoppedNotAbandoned(t *testing.T) {
	j := &journal{}
	consumerStopped, startReady, releaseStart := make(chan struct{}), make(chan struct{}), make(chan struct{})
	stoppingCalled := make(chan struct{})
	g := Group{
		Stages: []Stage{
			{Name: "db", Actors: []Actor{loop(j, "pool", nil, nil)}},
			{Name: "work", StopWithin: time.Hour, Actors: []Actor{
				{Name: "consumer", Run: func(ctx context.Context) error {
					<-ctx.Done()
					j.add("stopped consumer")
					close(consumerStopped)
					return nil
				}},
				{Name: "migrate", Start: func(ctx context.Context) error {
					close(startReady)
					<-ctx.Done()
					<-releaseStart
					j.add("start migrate returned")
					return nil
				}, Run: func(ctx context.Context) error {
					if ctx.Err() == nil {
						j.add("run migrate with a live context")
					}
					<-ctx.Done()
					j.add("stopped migrate")
					return nil
				}},
			}},
		},
		Stopping:  func(error) { close(stoppingCalled) },
		Abandoned: func(stage string, actors []string) { j.add("abandoned " + stage + ": " + strings.Join(actors, ",")) },
		Stopped:   func(stage string) { j.add("stopped stage " + stage) },
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- g.Run(ctx) }()
	<-startReady
	cancel()
	guard := time.After(time.Minute) // a guard against a hang, not a budget
	for _, ch := range []chan struct{}{stoppingCalled, consumerStopped} {
		select {
		case <-ch:
		case <-guard:
			close(releaseStart)
			<-done
			t.Fatalf("events %q: the stage's Run was not told to stop while its later Start was on its way out", j.events())
		}
	}
	close(releaseStart)
	var err error
	select {
	case err = <-done:
	case <-guard:
		t.Fatal("the run did not return")
	}
	ev := j.events()
	if err != nil {
		t.Errorf("run: %v", err)
	}
	for _, e := range ev {
		if strings.HasPrefix(e, "abandoned") || e == "run migrate with a live context" {
			t.Errorf("events %q: %s", ev, e)
		}
	}
	iw, id := slices.Index(ev, "stopped stage work"), slices.Index(ev, "stopped stage db")
	if iw < 0 || id < 0 || iw > id || slices.Index(ev, "stopped pool") < iw {
		t.Errorf("events %q: want work stopped, then the pool, then db", ev)
	}
}
