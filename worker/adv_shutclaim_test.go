package worker

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/testenv"
)

// holdNext is a go-redis hook that, once armed, holds the first command
// sent until release closes: a claim whose reply a stuck primary (or a
// half-open connection) holds until go-redis's read timeout. Only that
// one command is held; held closes when it arrives.
type holdNext struct {
	armed   atomic.Bool
	held    chan struct{}
	release chan struct{}
}

func newHoldNext() *holdNext {
	return &holdNext{held: make(chan struct{}), release: make(chan struct{})}
}

func (h *holdNext) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *holdNext) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if h.armed.CompareAndSwap(true, false) {
			close(h.held)
			<-h.release
		}
		return next(ctx, cmd)
	}
}

func (h *holdNext) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if h.armed.CompareAndSwap(true, false) {
			close(h.held)
			<-h.release
		}
		return next(ctx, cmds)
	}
}

// hookedClient is a client of its own on the test Redis, with hook added.
func hookedClient(t *testing.T, hook redis.Hook) *redis.Client {
	t.Helper()
	o, err := redis.ParseURL(testenv.RedisURL())
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(o)
	t.Cleanup(func() { rdb.Close() })
	rdb.AddHook(hook)
	return rdb
}

// docs/tasks.md, "Shutdown": Run "waits up to ShutdownTimeout for running
// handlers ...; then Run returns nil. Handlers still running at the
// timeout get their context cancelled ... and Run returns
// ErrShutdownTimeout" (and ErrShutdownTimeout's own doc: "returned by Run
// when handlers were still running at the end of
// Config.ShutdownTimeout"). With ShutdownTimeout now counted from the end
// of ctx, a claim loop whose poll is slow to return is enough to keep
// `done` open past the timer: Run cancels hctx, waits the whole
// ShutdownGrace, logs "shutdown timed out; cancelled handlers' tasks
// handed back" and returns ErrShutdownTimeout although no handler was
// running at all. Before the change such a shutdown returned nil (the
// timer started after the claim loops returned). A program that treats
// ErrShutdownTimeout as "work was cut short" (alerts, a non-zero exit)
// now reports that on every shutdown that meets a slow Redis reply.
//
// FAILS with the change under review: Run returns ErrShutdownTimeout.
func TestAdvShutdownSlowClaimNoHandlerReturnsNil(t *testing.T) {
	e := newEnv(t)
	hook := newHoldNext()
	rdb := hookedClient(t, hook)
	// A long lease: the heartbeat never ticks, so the first command after
	// arming is the claim loop's next poll. No task: no handler runs.
	q := e.queue(3 * time.Minute)
	sig := newLogCount("shutdown timed out")
	const timeout = 200 * time.Millisecond
	w := newWorker(t, rdb, Config{Logger: slog.New(sig), ShutdownTimeout: timeout})
	if err := w.Handle(q, func(context.Context, *Task) error { return nil }); err != nil {
		t.Fatal(err)
	}
	stop, wait := start(t, w)
	released := false
	release := func() {
		if !released {
			released = true
			close(hook.release)
		}
	}
	t.Cleanup(release)
	hook.armed.Store(true)
	select {
	case <-hook.held:
	case <-time.After(30 * time.Second):
		t.Fatal("the claim loop sent nothing to Redis within 30 s")
	}
	stop()
	// The poll stays held past ShutdownTimeout + ShutdownGrace: with the
	// change the timeout's log marks that point; without it nothing
	// happens, so the wait is bounded (generous, well under a read
	// timeout one would configure).
	select {
	case <-sig.hits:
	case <-time.After(timeout + ShutdownGrace + 5*time.Second):
	}
	release()
	err := wait()
	var logged []string
	for _, m := range sig.messages() {
		if strings.Contains(m, "shutdown timed out") {
			logged = append(logged, m)
		}
	}
	if err != nil || len(logged) > 0 {
		t.Fatalf("no handler was running when ctx ended (only a claim was slow to return), yet Run returned %v "+
			"and logged %q; want nil and no timeout", err, logged)
	}
}

// The claim loop hands back what a poll answered after ctx ended, also
// when the answer comes after the shutdown timed out and abandoned a
// handler (w.abandoned set, hctx cancelled): the task is due again at
// once with no attempt spent, and Run does not return before that. Holds
// with the change under review.
func TestAdvShutdownClaimAnsweredAfterAbandonHandsBack(t *testing.T) {
	e := newEnv(t)
	hook := newHoldNext()
	rdb := hookedClient(t, hook)
	q := e.queue(3 * time.Minute)
	q.Concurrency = 2
	e.put("run", `{}`)
	sig := newLogCount("handlers still running abandoned")
	began, free := make(chan struct{}), make(chan struct{})
	var started atomic.Int32
	w := newWorker(t, rdb, Config{Logger: slog.New(sig), ShutdownTimeout: 100 * time.Millisecond})
	if err := w.Handle(q, func(_ context.Context, t *Task) error {
		started.Add(1)
		if t.ID == "run" {
			close(began)
			<-free // ignores its context: abandoned
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	stop, wait := start(t, w)
	freed := false
	freeHandler := func() {
		if !freed {
			freed = true
			close(free)
		}
	}
	released := false
	release := func() {
		if !released {
			released = true
			close(hook.release)
		}
	}
	t.Cleanup(func() { release(); freeHandler() })
	<-began
	hook.armed.Store(true)
	select {
	case <-hook.held:
	case <-time.After(30 * time.Second):
		t.Fatal("the claim loop sent nothing to Redis within 30 s")
	}
	e.put("late", `{}`) // the held poll claims it once it goes on
	stop()
	sig.waitHits(t, 1) // timed out, grace over, "run" abandoned
	release()
	if err := wait(); !errors.Is(err, ErrShutdownTimeout) {
		t.Errorf("Run returned %v, want ErrShutdownTimeout", err)
	}
	freeHandler()
	if n := started.Load(); n != 1 {
		t.Errorf("%d handlers started, want 1 (the late poll's task must not start)", n)
	}
	ts, _ := e.poll(10, time.Minute, 10)
	if len(ts) != 1 || ts[0].ID != "late" || ts[0].Attempts != 0 {
		t.Fatalf("after Run returned, a poll got %+v; want only \"late\", handed back with 0 attempts", ts)
	}
}
