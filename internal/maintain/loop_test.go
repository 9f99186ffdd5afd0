package maintain

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
)

// script drives a Loop: each pass returns the next of its results, the
// sleeps are recorded instead of slept, and the run ends (its context
// cancelled, the sleep refused) once the results are used up.
type script struct {
	results []result
	events  []string
	cancel  context.CancelFunc
}

type result struct {
	more bool
	err  error
}

func (s *script) pass(ctx context.Context) (bool, error) {
	if len(s.results) == 0 {
		s.cancel()
		s.events = append(s.events, "pass (ended)")
		return false, ctx.Err()
	}
	r := s.results[0]
	s.results = s.results[1:]
	s.events = append(s.events, fmt.Sprintf("pass more=%v err=%v", r.more, r.err != nil))
	return r.more, r.err
}

func (s *script) sleep(ctx context.Context, d time.Duration) bool {
	s.events = append(s.events, "sleep "+d.String())
	return ctx.Err() == nil
}

func run(t *testing.T, l Loop, results ...result) (events, failed []string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := &script{results: results, cancel: cancel}
	l.sleep = s.sleep
	l.Failed = func(err error) { failed = append(failed, err.Error()) }
	if err := l.Run(ctx, s.pass); err != nil {
		t.Fatalf("Run = %v, want nil when its context ends", err)
	}
	return s.events, failed
}

// TestLoopWaits: a pass that says there is more is followed at once, a
// failed one after Retry, any other after Interval; the first runs at once.
func TestLoopWaits(t *testing.T) {
	boom := errors.New("boom")
	events, failed := run(t, Loop{Interval: time.Minute, Retry: 2 * time.Second},
		result{more: true}, result{err: boom}, result{}, result{more: true})
	want := []string{
		"pass more=true err=false", "sleep 0s",
		"pass more=false err=true", "sleep 2s",
		"pass more=false err=false", "sleep 1m0s",
		"pass more=true err=false", "sleep 0s",
		"pass (ended)", "sleep 2s", // the end's error: Retry, cut short
	}
	if !slices.Equal(events, want) {
		t.Errorf("events\n%q\nwant\n%q", events, want)
	}
	if !slices.Equal(failed, []string{"boom"}) {
		t.Errorf("failures reported %q, want the one pass that failed while the run was live (not the one the end cut)", failed)
	}
}

// TestLoopWithoutRetryWaitsTheIntervalAfterAFailure, spread; WaitFirst
// waits one spread Interval before the first pass.
func TestLoopWithoutRetryWaitsTheIntervalAfterAFailure(t *testing.T) {
	const interval = 100 * time.Second
	events, failed := run(t, Loop{Interval: interval, Spread: 5, WaitFirst: true}, result{err: errors.New("boom")}, result{})
	if len(events) != 7 || len(failed) != 1 {
		t.Fatalf("events %q, failures %q; want sleep, pass, sleep, pass, sleep, pass (ended), sleep and one failure", events, failed)
	}
	for i, e := range events {
		if i%2 == 1 {
			continue
		}
		d, err := time.ParseDuration(strings.TrimPrefix(e, "sleep "))
		if err != nil {
			t.Fatalf("event %d %q is not a sleep", i, e)
		}
		if d < interval-interval/5 || d > interval+interval/5 {
			t.Errorf("event %d: slept %v, want the interval ±20%%", i, d)
		}
	}
}

// TestLoopEndsWithItsContext: the real pause is cut short by the end of
// the run, and Run returns nil.
func TestLoopEndsWithItsContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	passes := 0
	err := Loop{Interval: time.Hour}.Run(ctx, func(context.Context) (bool, error) {
		passes++
		cancel()
		return false, nil
	})
	if err != nil || passes != 1 {
		t.Fatalf("Run = %v after %d passes, want nil after 1", err, passes)
	}
}

// TestLoopBound: a pass's context has PassTimeout as its deadline.
func TestLoopBound(t *testing.T) {
	ctx, cancel := Loop{PassTimeout: time.Minute}.Bound(context.Background())
	defer cancel()
	dl, ok := ctx.Deadline()
	if !ok || time.Until(dl) > time.Minute || time.Until(dl) < 50*time.Second {
		t.Errorf("deadline %v (%v), want in about a minute", dl, ok)
	}
}

// TestServiceLoops pins each service's timing: the reconciler waits a
// spread Interval (±20%) before every pass, the first included; the relay
// passes at once, again at once after a full page, Retry after a failure;
// the janitor purges at once, then every Interval ±10%.
func TestServiceLoops(t *testing.T) {
	log := zap.NewNop()
	for _, tc := range []struct {
		name string
		got  Loop
		want Loop
	}{
		{"reconciler", NewReconciler(ReconcilerConfig{}, nil, nil, nil, log).loop,
			Loop{Interval: DefaultReconcileInterval, Spread: 5, PassTimeout: DefaultReconcilePassTimeout, WaitFirst: true}},
		{"relay", NewRelay(RelayConfig{}, nil, nil, nil, log).loop,
			Loop{Interval: DefaultRelayInterval, Retry: DefaultRelayRetry, PassTimeout: DefaultRelayPassTimeout}},
		{"janitor", NewJanitor(JanitorConfig{}, nil, log).loop,
			Loop{Interval: DefaultJanitorInterval, Spread: 10, PassTimeout: DefaultJanitorPassTimeout}},
	} {
		if tc.got.Failed == nil {
			t.Errorf("%s: no Failed hook: a failed pass would go unreported", tc.name)
		}
		tc.got.Failed = nil
		if !reflect.DeepEqual(tc.got, tc.want) {
			t.Errorf("%s loop %+v, want %+v", tc.name, tc.got, tc.want)
		}
	}
}
