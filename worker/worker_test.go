package worker

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/orderdelay/orderdelay/client"
)

// A worker that dies holding a task (here: its handler abandoned at
// shutdown, so nothing extends, acks or hands back the lease) loses the
// task to the next claim after the lease, with one more attempt.
func TestCrashMidHandlerRedeliveredAfterLease(t *testing.T) {
	e := newEnv(t)
	q := e.queue(time.Second)
	e.put("c1", `{"n":1}`)

	started, release := make(chan struct{}), make(chan struct{})
	w1 := newWorker(t, e.rdb, Config{ShutdownTimeout: time.Millisecond})
	if err := w1.Handle(q, func(ctx context.Context, t *Task) error {
		close(started)
		<-release // ignores ctx: only the process's death would stop it
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	stop1, wait1 := start(t, w1)
	<-started
	stop1()
	if err := wait1(); !errors.Is(err, ErrShutdownTimeout) {
		t.Fatalf("Run: %v, want ErrShutdownTimeout", err)
	}
	// The abandoned handler now succeeds: its result must be dropped, as a
	// dead process's would be.
	close(release)

	got := make(chan *Task, 2)
	w2 := newWorker(t, e.rdb, Config{})
	if err := w2.Handle(q, func(ctx context.Context, t *Task) error { got <- t; return nil }); err != nil {
		t.Fatal(err)
	}
	start(t, w2)
	var tk *Task
	select {
	case tk = <-got:
	case <-time.After(30 * time.Second):
		t.Fatal("the task was not redelivered after its lease")
	}
	if tk.ID != "c1" || tk.Attempts != 1 || string(tk.Payload) != `{"n":1}` {
		t.Fatalf("redelivered %+v, want c1 with attempts 1 and its payload", tk)
	}
	eventually(t, "c1 acked by the second worker", func() bool {
		_, err := e.get("c1")
		return errors.Is(err, client.ErrNotFound)
	})
}

// While a handler runs past several leases, the heartbeat keeps the task
// from both an HTTP poll and another worker.
func TestLeaseExtendedWhileHandlerRuns(t *testing.T) {
	e := newEnv(t)
	lease := time.Second
	q := e.queue(lease)
	e.put("long", `{}`)

	started, release := make(chan struct{}), make(chan struct{})
	var runs atomic.Int32
	h := func(ctx context.Context, t *Task) error {
		if runs.Add(1) == 1 {
			close(started)
		}
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}
	w1, w2 := newWorker(t, e.rdb, Config{}), newWorker(t, e.rdb, Config{})
	if err := w1.Handle(q, h); err != nil {
		t.Fatal(err)
	}
	if err := w2.Handle(q, h); err != nil {
		t.Fatal(err)
	}
	start(t, w1)
	<-started
	start(t, w2)
	// Poll through four leases' worth of time: the task stays leased.
	until := time.Now().Add(4 * lease)
	for time.Now().Before(until) {
		if ts, _ := e.poll(10, lease, 10); len(ts) > 0 {
			t.Fatalf("a poll got %s while a worker's handler held it", ts[0].ID)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if n := runs.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want 1", n)
	}
	tk, err := e.get("long")
	if err != nil || tk.State != client.StateLeased || tk.Attempts != 0 {
		t.Fatalf("task: %+v, %v; want leased, attempts 0", tk, err)
	}
	close(release)
	eventually(t, "the task acked", func() bool {
		_, err := e.get("long")
		return errors.Is(err, client.ErrNotFound)
	})
	lost := testutil.ToFloat64(w1.m.lost.WithLabelValues("jobs")) + testutil.ToFloat64(w2.m.lost.WithLabelValues("jobs"))
	if lost != 0 || runs.Load() != 1 {
		t.Fatalf("leases lost %v, runs %d; want 0 and 1", lost, runs.Load())
	}
}

// RetryAfter's delay is a lower bound on the next attempt; the backoff is
// visible to GET with attempts and last error.
func TestRetryAfterDelayHonoured(t *testing.T) {
	e := newEnv(t)
	q := e.queue(5 * time.Second)
	q.Retry.Backoff = []time.Duration{time.Millisecond} // the policy alone would retry at once
	e.put("r1", `{}`)

	const delay = 1500 * time.Millisecond
	type call struct {
		at       time.Time
		attempts int
	}
	calls := make(chan call, 4)
	w := newWorker(t, e.rdb, Config{})
	if err := w.Handle(q, func(ctx context.Context, t *Task) error {
		calls <- call{time.Now(), t.Attempts}
		if t.Attempts == 0 {
			return RetryAfter(delay, errors.New("partner busy"))
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	start(t, w)
	first := <-calls
	eventually(t, "the backoff recorded", func() bool {
		tk, err := e.get("r1")
		return err == nil && tk.State == client.StateBackoff && tk.Attempts == 1 && tk.LastError == "partner busy"
	})
	second := <-calls
	if gap := second.at.Sub(first.at); gap < delay {
		t.Fatalf("retried %v after the first attempt, want at least %v", gap, delay)
	}
	if first.attempts != 0 || second.attempts != 1 {
		t.Fatalf("attempts %d then %d, want 0 then 1", first.attempts, second.attempts)
	}
	// The counter moves after the retry script answers, so it may trail
	// what Redis shows.
	eventually(t, "retried_total 1", func() bool { return testutil.ToFloat64(w.m.retried.WithLabelValues("jobs")) == 1 })
}

// SkipRetry dead-letters at once, with the handler's error.
func TestSkipRetryDeadLetters(t *testing.T) {
	e := newEnv(t)
	q := e.queue(5 * time.Second)
	q.MaxAttempts = 5
	e.put("s1", `{"to":""}`)
	var runs atomic.Int32
	w := newWorker(t, e.rdb, Config{})
	if err := w.Handle(q, func(ctx context.Context, t *Task) error {
		runs.Add(1)
		return SkipRetry(errors.New("no recipient"))
	}); err != nil {
		t.Fatal(err)
	}
	start(t, w)
	var tk client.Task
	eventually(t, "s1 dead-lettered", func() bool {
		var err error
		tk, err = e.get("s1")
		return err == nil && tk.State == client.StateDead
	})
	if tk.Reason != "failed" || tk.Attempts != 1 || tk.LastError != "no recipient" || string(tk.Payload) != `{"to":""}` {
		t.Fatalf("dead letter %+v, want reason failed, attempts 1, last error \"no recipient\", payload kept", tk)
	}
	// The counter moves after the bury script answers, so it may trail
	// what Redis shows.
	eventually(t, "dead_lettered_total 1", func() bool { return testutil.ToFloat64(w.m.dead.WithLabelValues("jobs")) == 1 })
	if n := runs.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want 1", n)
	}
}

// A task that fails MaxAttempts times is dead-lettered with its attempts
// and last error.
func TestExhaustionDeadLetters(t *testing.T) {
	e := newEnv(t)
	q := e.queue(5 * time.Second)
	q.MaxAttempts = 3
	q.Retry.Backoff = []time.Duration{10 * time.Millisecond}
	e.put("x1", `{}`)
	var mu sync.Mutex
	var seen []int
	w := newWorker(t, e.rdb, Config{})
	if err := w.Handle(q, func(ctx context.Context, t *Task) error {
		mu.Lock()
		seen = append(seen, t.Attempts)
		mu.Unlock()
		return fmt.Errorf("boom %d", t.Attempts)
	}); err != nil {
		t.Fatal(err)
	}
	start(t, w)
	var tk client.Task
	eventually(t, "x1 dead-lettered", func() bool {
		var err error
		tk, err = e.get("x1")
		return err == nil && tk.State == client.StateDead
	})
	if tk.Reason != "failed" || tk.Attempts != 3 || tk.LastError != "boom 2" {
		t.Fatalf("dead letter %+v, want reason failed, attempts 3, last error \"boom 2\"", tk)
	}
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(seen) != "[0 1 2]" {
		t.Fatalf("handler saw attempts %v, want [0 1 2]", seen)
	}
}

// At shutdown a task claimed but not started is due again at once (long
// before its 60 s lease), with its attempts; a running handler finishes
// and is acked before Run returns.
func TestShutdownHandsBackUnstartedAndWaitsForRunning(t *testing.T) {
	e := newEnv(t)
	q := e.queue(time.Minute)
	q.Concurrency = 3
	e.put("a", `{}`)

	startedA, releaseA := make(chan struct{}), make(chan struct{})
	var ran sync.Map
	w := newWorker(t, e.rdb, Config{})
	if err := w.Handle(q, func(ctx context.Context, t *Task) error {
		ran.Store(t.ID, true)
		if t.ID == "a" {
			close(startedA)
			<-releaseA
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var handed atomic.Int32
	w.claimed = func(_ string, n int) {
		select {
		case <-startedA: // a later claim: shut down before its tasks start
			handed.Store(int32(n))
			cancel()
		default:
		}
	}
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	<-startedA
	e.put("b", `{}`)
	e.put("c", `{}`)
	eventually(t, "the shutdown to begin", func() bool { return ctx.Err() != nil })
	eventually(t, "the hand-back", func() bool {
		return testutil.ToFloat64(w.m.handedBack.WithLabelValues("jobs")) == float64(handed.Load())
	})
	// Due again now: a poll gets both (one handed back, maybe one never
	// claimed), with no attempt spent.
	ts, _ := e.poll(10, time.Minute, 10)
	if len(ts) != 2 {
		t.Fatalf("poll after shutdown got %d tasks, want b and c", len(ts))
	}
	for _, tk := range ts {
		if tk.Attempts != 0 {
			t.Fatalf("%s handed back with attempts %d, want 0", tk.ID, tk.Attempts)
		}
		if _, ok := ran.Load(tk.ID); ok {
			t.Fatalf("%s ran though it was handed back", tk.ID)
		}
	}
	select {
	case err := <-done:
		t.Fatalf("Run returned (%v) while handler a was running", err)
	default:
	}
	close(releaseA)
	if err := <-done; err != nil {
		t.Fatalf("Run: %v, want nil", err)
	}
	done <- nil // for the cleanup
	if _, err := e.get("a"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("a after shutdown: %v, want acked (not found)", err)
	}
}

// A handler cancelled by a shutdown that ran out of time, and that returns
// promptly, hands its task back: due again at once, no attempt spent.
func TestShutdownTimeoutHandsBackCancelledHandlers(t *testing.T) {
	e := newEnv(t)
	q := e.queue(time.Minute)
	e.put("slow", `{}`)
	started := make(chan struct{})
	w := newWorker(t, e.rdb, Config{ShutdownTimeout: 50 * time.Millisecond})
	if err := w.Handle(q, func(ctx context.Context, t *Task) error {
		close(started)
		<-ctx.Done()
		return ctx.Err()
	}); err != nil {
		t.Fatal(err)
	}
	stop, wait := start(t, w)
	<-started
	stop()
	if err := wait(); !errors.Is(err, ErrShutdownTimeout) {
		t.Fatalf("Run: %v, want ErrShutdownTimeout", err)
	}
	ts, _ := e.poll(10, time.Minute, 10)
	if len(ts) != 1 || ts[0].ID != "slow" || ts[0].Attempts != 0 {
		t.Fatalf("poll right after shutdown got %+v, want slow with attempts 0 (its lease is a minute)", ts)
	}
}
