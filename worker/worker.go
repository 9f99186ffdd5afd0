// Package worker runs Go handlers on the tasks of orderdelay's poll queues,
// for programs that would otherwise call the poll API: register a handler
// per queue, and a Worker claims due tasks, runs them with bounded
// concurrency, extends their leases while they run, acks, retries or
// dead-letters them, and shuts down gracefully.
//
//	w, err := worker.New(rdb, worker.Config{Registerer: prometheus.DefaultRegisterer})
//	q, err := worker.FromQueuesFile("/etc/orderdelay/queues.yaml", "emails")
//	err = w.Handle(q, func(ctx context.Context, t *worker.Task) error {
//		var p struct{ To string }
//		if err := json.Unmarshal(t.Payload, &p); err != nil {
//			return worker.SkipRetry(err) // dead-letter now: retrying cannot help
//		}
//		return send(ctx, p.To)         // an error: retried by the queue's policy
//	})
//	err = w.Run(ctx) // until ctx ends, then a graceful shutdown
//
// # The protocol
//
// A Worker speaks the daemon's own poll protocol on the same Redis keys
// (docs/tasks.md, "poll"), so workers, HTTP polls and other workers share
// a queue safely:
//
//   - A claim moves due tasks into the queue's lease set under a random
//     token of its own (the claim POST /v1/queues/{q}/poll makes). While a
//     lease holds, no other worker or poll gets the task.
//   - While the handler runs, a heartbeat every Lease/3 extends the lease,
//     but only while the lease record still carries this claim's token
//     (compare-and-set). If it does not — the lease ran out and another
//     claim took the task, or a producer rescheduled or deleted it — the
//     handler's context is cancelled with cause ErrLeaseLost and its
//     result is ignored.
//   - A handler's nil acks the task (compare-and-set: removed with its
//     payload). An error spends an attempt: the task backs off for the
//     queue's Retry policy (or the RetryAfter delay) and any worker or poll
//     claims it then; with no attempts left, or with SkipRetry, it is
//     dead-lettered as "failed" with its attempts and last error, as GET
//     /v1/queues/{q}/tasks/{id} shows. Recording the outcome is tried
//     again while Redis fails, for up to 10s, while the lease is still the
//     worker's on its clock and the shutdown has not timed out.
//   - A worker that dies holding a task (crash, lost network, a handler
//     abandoned at shutdown) stops extending its lease: after the lease
//     any worker or poll claims the task again, with Attempts one higher,
//     and one past MaxAttempts is dead-lettered instead.
//
// Delivery is at least once: a handler can run again after a crash
// between its side effect and the ack, so make handlers idempotent
// (Task.ID is stable across attempts).
//
// # Shutdown
//
// When Run's context ends, the Worker stops claiming, hands back at once
// any task it claimed but had not started (due again for any worker or
// poll, attempts unchanged), and waits up to Config.ShutdownTimeout for
// running handlers, extending their leases meanwhile. Handlers still
// running then have their context cancelled (cause ErrShutdown): a task
// whose handler returns an error within ShutdownGrace is handed back, no
// attempt spent (a nil still acks it); a handler still running after that
// is abandoned: its result is dropped and its task comes back after the
// lease with one more attempt, like a crash's.
package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/lifecycle"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Task is a claimed task, as a handler sees it.
type Task struct {
	ID       string          // the producer's id, stable across attempts
	Queue    string          // Queue.Name
	Deadline time.Time       // when it was due
	Attempts int             // failed attempts before this one (expired leases included)
	Payload  json.RawMessage // the JSON the producer stored
}

// Handler runs one task. nil acks it; an error retries it (see SkipRetry
// and RetryAfter). It should return soon after ctx ends.
type Handler func(ctx context.Context, t *Task) error

// Defaults of a Config's zero fields.
const (
	DefaultShutdownTimeout = 30 * time.Second
	DefaultPollInterval    = time.Second
)

// bookkeepingTimeout bounds each Redis call that settles a task; it runs
// on a context of its own, so a shutdown cannot cut a settle in half.
const bookkeepingTimeout = 10 * time.Second

// maxErrorBytes bounds the last error recorded with a task.
const maxErrorBytes = 1024

// Config configures a Worker. Every zero field takes its default.
type Config struct {
	// MaxConcurrency bounds handlers running at once across all queues.
	// Zero: no bound beyond each Queue.Concurrency.
	MaxConcurrency int
	// ShutdownTimeout is how long Run waits for running handlers after its
	// context ends (counted from then, however long a claim in progress
	// takes to return). Zero: 30s.
	ShutdownTimeout time.Duration
	// PollInterval is the wait between claims while a queue has nothing
	// due, drawn from [0.8, 1.2] times it. Zero: 1s.
	PollInterval time.Duration
	// Registerer receives the Worker's collectors (see Collectors). Nil:
	// none are registered.
	Registerer prometheus.Registerer
	// Logger receives lease losses and Redis errors. Nil: discarded.
	Logger *slog.Logger
}

// Worker runs handlers on the tasks of poll queues. Build it with New,
// register handlers with Handle, then call Run once.
type Worker struct {
	rdb     redis.UniversalClient
	cfg     Config
	log     *slog.Logger
	m       *metrics
	global  chan struct{} // MaxConcurrency slots, or nil
	mu      sync.Mutex
	runners []*runner
	started atomic.Bool
	// abandoned is set when a shutdown runs out of time: later results
	// are dropped.
	abandoned atomic.Bool

	// claimed, if set (tests), runs after each claim that returned tasks,
	// before they start.
	claimed func(queue string, n int)
}

// New returns a Worker using rdb, the Redis the daemon uses.
func New(rdb redis.UniversalClient, cfg Config) (*Worker, error) {
	if rdb == nil {
		return nil, fmt.Errorf("%w: no Redis client", ErrConfig)
	}
	switch {
	case cfg.MaxConcurrency < 0:
		return nil, fmt.Errorf("%w: MaxConcurrency %d is negative", ErrConfig, cfg.MaxConcurrency)
	case cfg.ShutdownTimeout < 0:
		return nil, fmt.Errorf("%w: ShutdownTimeout %v is negative", ErrConfig, cfg.ShutdownTimeout)
	case cfg.PollInterval < 0:
		return nil, fmt.Errorf("%w: PollInterval %v is negative", ErrConfig, cfg.PollInterval)
	}
	if cfg.ShutdownTimeout == 0 {
		cfg.ShutdownTimeout = DefaultShutdownTimeout
	}
	if cfg.PollInterval == 0 {
		cfg.PollInterval = DefaultPollInterval
	}
	w := &Worker{rdb: rdb, cfg: cfg, log: cfg.Logger, m: newMetrics()}
	if w.log == nil {
		w.log = slog.New(slog.DiscardHandler)
	}
	if cfg.MaxConcurrency > 0 {
		w.global = make(chan struct{}, cfg.MaxConcurrency)
	}
	if cfg.Registerer != nil {
		for _, c := range w.m.collectors() {
			if err := cfg.Registerer.Register(c); err != nil {
				return nil, fmt.Errorf("register metrics: %w", err)
			}
		}
	}
	return w, nil
}

// Collectors returns the Worker's Prometheus collectors, for a program
// that registers them itself rather than through Config.Registerer:
//
//	orderdelay_worker_processed_total{queue}        handlers that returned nil
//	orderdelay_worker_failed_total{queue}           handlers that returned an error or panicked
//	orderdelay_worker_retried_total{queue}          failed tasks scheduled for another attempt
//	orderdelay_worker_dead_lettered_total{queue}    failed tasks dead-lettered
//	orderdelay_worker_leases_lost_total{queue}      tasks whose lease was lost while held
//	orderdelay_worker_handed_back_total{queue}      tasks handed back at shutdown (unstarted, or cut short)
//	orderdelay_worker_in_flight{queue}              handlers running now
//	orderdelay_worker_handler_duration_seconds{queue}
func (w *Worker) Collectors() []prometheus.Collector { return w.m.collectors() }

// Handle registers h for q. Each queue (by Name, and by Key) is registered
// once, before Run.
func (w *Worker) Handle(q Queue, h Handler) error {
	if h == nil {
		return fmt.Errorf("%w: queue %q: nil handler", ErrConfig, q.Name)
	}
	q, err := q.withDefaults()
	if err != nil {
		return err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.started.Load() {
		return fmt.Errorf("%w: queue %q: Handle after Run", ErrConfig, q.Name)
	}
	for _, r := range w.runners {
		if r.q.Name == q.Name || r.q.Key == q.Key {
			return fmt.Errorf("%w: queue %q (key %q) is registered twice", ErrConfig, q.Name, q.Key)
		}
	}
	w.m.init(q.Name)
	w.runners = append(w.runners, &runner{w: w, q: q, keys: queue.NewKeys(q.Key), st: queue.NewStore(w.rdb, queue.NewKeys(q.Key)), h: h,
		slots: make(chan struct{}, q.Concurrency), held: map[*held]struct{}{}, extending: map[string]bool{}})
	return nil
}

// ErrShutdownTimeout is returned by Run when handlers were still running
// at the end of Config.ShutdownTimeout and were cancelled.
var ErrShutdownTimeout = errors.New("shutdown timed out; running handlers cancelled")

// ShutdownGrace is how long Run waits, after a shutdown timed out and
// cancelled the running handlers, for them to return. A task whose
// handler returns an error within it is handed back (due again at once,
// no attempt spent); a handler still running after it is abandoned.
const ShutdownGrace = time.Second

// Run claims and runs tasks until ctx ends, then shuts down gracefully (see
// the package doc) and returns nil, or ErrShutdownTimeout. It may be
// called once.
func (w *Worker) Run(ctx context.Context) error {
	w.mu.Lock()
	runners := w.runners
	first := w.started.CompareAndSwap(false, true)
	w.mu.Unlock()
	if !first {
		return fmt.Errorf("%w: Run called twice", ErrConfig)
	}
	if len(runners) == 0 {
		return fmt.Errorf("%w: no queue registered (call Handle first)", ErrConfig)
	}
	// Handlers run on a context of their own: the end of ctx stops
	// claiming, not running handlers; hcancel ends them at the timeout.
	hctx, hcancel := context.WithCancelCause(context.WithoutCancel(ctx))
	defer hcancel(nil)
	beatStop := make(chan struct{})
	var claimers, beats sync.WaitGroup
	handlers := &sync.WaitGroup{}
	for _, r := range runners {
		claimers.Add(1)
		go func() { defer claimers.Done(); r.claimLoop(ctx, hctx, handlers) }()
		beats.Add(1)
		go func() { defer beats.Done(); r.heartbeat(beatStop) }()
	}
	// Shutdown order: claim loops stop (handing back what they claimed
	// but did not start), then running handlers finish under heartbeats,
	// then heartbeats stop. ShutdownTimeout counts from the end of ctx,
	// not from the claim loops' return: a claim loop in a poll whose
	// reply Redis holds returns only when go-redis gives up on it, and
	// the handlers are not given that time on top.
	claimed, done := make(chan struct{}), make(chan struct{})
	go func() { claimers.Wait(); close(claimed) }()
	go func() { <-claimed; handlers.Wait(); close(done) }() // no Add after the claim loops end
	select {
	case <-ctx.Done():
	case <-done:
	}
	timer := time.NewTimer(w.cfg.ShutdownTimeout)
	defer timer.Stop()
	var err error
	select {
	case <-done:
	case <-timer.C:
		if w.running() == 0 {
			// No handler to cut short: only a claim loop's Redis call is
			// left, and what it hears of it hands back. Once the claim
			// loops end no handler starts, and those that ran are done.
			<-claimed
		}
		if w.running() == 0 {
			<-done
			break
		}
		// Cancel the handlers; those that return within the grace hand
		// their tasks back, the rest are abandoned.
		hcancel(ErrShutdown)
		err = ErrShutdownTimeout
		grace := time.NewTimer(ShutdownGrace)
		abandon := false
		select {
		case <-done:
		case <-grace.C:
			abandon = w.running() > 0 // none: only a claim loop's Redis call is left (below)
		}
		grace.Stop()
		if abandon {
			w.abandoned.Store(true)
			w.log.Warn("worker: shutdown timed out; handlers still running abandoned, their tasks return after the lease")
		} else {
			w.log.Warn("worker: shutdown timed out; cancelled handlers' tasks handed back")
		}
	}
	// The claim loops end before Run returns, handing back what a poll
	// answered after ctx ended; so do the handlers, unless abandoned.
	<-claimed
	if !w.abandoned.Load() {
		<-done
	}
	close(beatStop)
	beats.Wait()
	return err
}

// running is how many handlers hold a task, across every queue.
func (w *Worker) running() int {
	w.mu.Lock()
	runners := w.runners
	w.mu.Unlock()
	n := 0
	for _, r := range runners {
		r.mu.Lock()
		n += len(r.held)
		r.mu.Unlock()
	}
	return n
}

// runner serves one queue.
type runner struct {
	w     *Worker
	q     Queue
	keys  queue.Keys
	st    *queue.Store // the queue's lease verbs
	h     Handler
	slots chan struct{} // q.Concurrency
	mu    sync.Mutex
	held  map[*held]struct{} // tasks this runner holds a lease on
	// extending holds the tokens whose extension is in flight (under mu);
	// extends counts those calls, which the heartbeat waits for.
	extending map[string]bool
	extends   sync.WaitGroup
}

// held is one task this runner holds under a lease.
type held struct {
	token, id string
	cancel    context.CancelCauseFunc
	extended  time.Time // local time before the call that last set the lease
	lost      bool      // lose ran (under runner.mu)
}

// acquire takes a queue slot and a global one, waiting for the first
// pair, then as many more as are free now, and returns how many (0: ctx
// ended).
func (r *runner) acquire(ctx context.Context) int {
	g := r.w.global
	select {
	case r.slots <- struct{}{}:
	case <-ctx.Done():
		return 0
	}
	if g != nil {
		select {
		case g <- struct{}{}:
		case <-ctx.Done():
			<-r.slots
			return 0
		}
	}
	n := 1
	for n < cap(r.slots) {
		select {
		case r.slots <- struct{}{}:
		default:
			return n
		}
		if g != nil {
			select {
			case g <- struct{}{}:
			default:
				<-r.slots
				return n
			}
		}
		n++
	}
	return n
}

// release gives back n slot pairs.
func (r *runner) release(n int) {
	for range n {
		if r.w.global != nil {
			<-r.w.global
		}
		<-r.slots
	}
}

func (r *runner) claimLoop(ctx, hctx context.Context, handlers *sync.WaitGroup) {
	for {
		n := r.acquire(ctx)
		if n == 0 {
			return
		}
		at := time.Now()
		// The claim runs to completion even if ctx ends meanwhile: a claim
		// cut off after Redis ran it would leave tasks leased until expiry.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), bookkeepingTimeout)
		p, err := r.st.PollTasks(cctx, queue.PollArgs{Limit: n, Lease: r.q.Lease, MaxAttempts: r.q.MaxAttempts})
		cancel()
		ts, tok := p.Tasks, p.Token
		if err != nil {
			r.release(n)
			r.w.log.Warn("worker: claim failed", "queue", r.q.Name, "error", err)
			if !lifecycle.Sleep(ctx, jitter(r.w.cfg.PollInterval)) {
				return
			}
			continue
		}
		r.release(n - len(ts))
		if len(ts) > 0 && r.w.claimed != nil {
			r.w.claimed(r.q.Name, len(ts))
		}
		if ctx.Err() != nil {
			r.handBack(tok, ts)
			r.release(len(ts))
			return
		}
		for _, t := range ts {
			h := &held{token: tok, id: t.ID, extended: at}
			var tctx context.Context
			tctx, h.cancel = context.WithCancelCause(hctx)
			r.mu.Lock()
			r.held[h] = struct{}{}
			r.mu.Unlock()
			handlers.Add(1)
			go func() {
				defer handlers.Done()
				defer r.release(1)
				r.run(tctx, h, t)
			}()
		}
		if len(ts) < n && !lifecycle.Sleep(ctx, jitter(r.w.cfg.PollInterval)) {
			return
		}
	}
}

// handBack returns claimed tasks that never started.
func (r *runner) handBack(tok string, ts []queue.Task) {
	if len(ts) == 0 {
		return
	}
	ids := make([]string, len(ts))
	for i, t := range ts {
		ids[i] = t.ID
	}
	ctx, cancel := context.WithTimeout(context.Background(), bookkeepingTimeout)
	defer cancel()
	n, err := r.st.ReleaseTasks(ctx, tok, ids)
	if err != nil {
		r.w.log.Warn("worker: handing back unstarted tasks failed; they return after the lease",
			"queue", r.q.Name, "tasks", len(ids), "error", err)
		return
	}
	r.w.m.handedBack.WithLabelValues(r.q.Name).Add(float64(n))
}

// run runs the handler on t and settles the outcome.
func (r *runner) run(ctx context.Context, h *held, ct queue.Task) {
	defer func() {
		h.cancel(nil)
		r.mu.Lock()
		delete(r.held, h)
		r.mu.Unlock()
	}()
	name := r.q.Name
	t := &Task{ID: ct.ID, Queue: name, Deadline: ct.Deadline, Attempts: ct.Attempts, Payload: ct.Payload}
	r.w.m.inFlight.WithLabelValues(name).Inc()
	start := time.Now()
	err := r.call(ctx, t)
	r.w.m.duration.WithLabelValues(name).Observe(time.Since(start).Seconds())
	r.w.m.inFlight.WithLabelValues(name).Dec()
	if err == nil {
		r.w.m.processed.WithLabelValues(name).Inc()
	} else {
		r.w.m.failed.WithLabelValues(name).Inc()
	}
	if r.w.abandoned.Load() || errors.Is(context.Cause(ctx), ErrLeaseLost) {
		return // no longer this worker's to settle
	}
	if err != nil && errors.Is(context.Cause(ctx), ErrShutdown) {
		// Cut short by the shutdown, not failed: no attempt spent.
		r.handBack(h.token, []queue.Task{ct})
		return
	}
	// The outcome is recorded with compare-and-set scripts, so trying one
	// again is safe: a Redis blip (a failover, a cut connection) is
	// retried within the bookkeeping budget while the lease is still the
	// worker's (ctx: the heartbeat cancels it once the lease has run out
	// on the worker's clock, and the shutdown at its timeout), instead of
	// leaving the task to its lease's expiry, which counts an attempt and
	// dead-letters a success on its last attempt. The first try runs
	// whatever ctx says: a handler cut short by the shutdown that returns
	// nil still acks.
	sctx, cancel := context.WithTimeout(context.Background(), bookkeepingTimeout)
	defer cancel()
	attempts := ct.Attempts + 1
	bury := err != nil && (errors.Is(err, ErrSkipRetry) || attempts >= r.q.MaxAttempts)
	var delay time.Duration
	if err != nil && !bury {
		var set bool
		if delay, set = retryDelay(err); !set {
			delay = r.q.Retry.delay(attempts, rand.Float64)
		}
	}
	var why string
	if err != nil {
		why = lastError(err)
	}
	settle := func() (bool, error) {
		switch {
		case err == nil:
			missed, _, serr := r.st.AckTasks(sctx, h.token, []string{ct.ID})
			return serr == nil && len(missed) == 0, serr
		case bury:
			n, serr := r.st.BuryTasks(sctx, h.token, queue.ReasonFailed, why, []string{ct.ID})
			return n == 1, serr
		default:
			n, serr := r.st.RetryTasks(sctx, h.token, delay, why, []string{ct.ID})
			return n == 1, serr
		}
	}
	ok, serr := settle()
	// Retries end with the budget (sctx) or the lease (ctx), whichever first.
	retry, stopRetry := context.WithCancel(sctx)
	defer stopRetry()
	defer context.AfterFunc(ctx, stopRetry)()
	failedBefore := false
	for wait := 50 * time.Millisecond; serr != nil && retry.Err() == nil; wait = min(2*wait, time.Second) {
		failedBefore = true
		r.w.log.Warn("worker: settling a task failed; trying again while its lease holds", "queue", name, "id", ct.ID, "error", serr)
		if !lifecycle.Sleep(retry, jitter(wait)) {
			break
		}
		ok, serr = settle()
	}
	switch {
	case serr != nil:
		r.w.log.Warn("worker: settling a task failed; it returns after the lease", "queue", name, "id", ct.ID, "error", serr)
	case !ok && failedBefore:
		// An earlier try may have run on Redis with its answer lost (a
		// connection cut after the script ran): the lease it settled is
		// then gone, as it is when another claim or a producer took it.
		r.w.log.Info("worker: the task's outcome was recorded by an earlier try whose answer was lost, or its lease was lost meanwhile",
			"queue", name, "id", ct.ID)
	case !ok:
		r.mu.Lock()
		counted := h.lost // the heartbeat counted it, its clock having run out meanwhile
		h.lost = true
		r.mu.Unlock()
		if !counted {
			r.w.m.lost.WithLabelValues(name).Inc()
			r.w.log.Warn("worker: the task's lease was lost before its outcome was recorded (another claim or a producer took it)",
				"queue", name, "id", ct.ID)
		}
	case bury:
		r.w.m.dead.WithLabelValues(name).Inc()
	case err != nil:
		r.w.m.retried.WithLabelValues(name).Inc()
	}
}

// call runs the handler, turning a panic into an error.
func (r *runner) call(ctx context.Context, t *Task) (err error) {
	defer func() {
		if p := recover(); p != nil {
			r.w.log.Error("worker: handler panicked", "queue", r.q.Name, "id", t.ID, "panic", p, "stack", string(debug.Stack()))
			err = fmt.Errorf("panic: %v", p)
		}
	}()
	return r.h(ctx, t)
}

// heartbeat extends the leases of held tasks every third of the lease
// until stop closes, then waits for the extensions in flight.
func (r *runner) heartbeat(stop <-chan struct{}) {
	defer r.extends.Wait()
	tick := time.NewTicker(r.q.Lease / 3)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return
		case <-tick.C:
			r.extend()
		}
	}
}

// extend cancels, with ErrLeaseLost, the handlers whose lease has run out
// on the worker's clock (a lease after its last extension), and extends
// every other held lease, each claim's token in a call of its own. The
// clock decides, not the calls: when Redis stops answering (a partition
// that drops packets) a call can hang for the client's whole ReadTimeout
// (go-redis ignores a context's deadline unless ContextTimeoutEnabled),
// so the calls run apart from the tick, one per token at a time, and a
// token whose call still hangs is skipped until it returns.
func (r *runner) extend() {
	byToken := map[string][]*held{}
	var expired []*held
	r.mu.Lock()
	for h := range r.held {
		switch {
		case h.lost:
		case time.Since(h.extended) >= r.q.Lease:
			expired = append(expired, h)
		case !r.extending[h.token]:
			byToken[h.token] = append(byToken[h.token], h)
		}
	}
	for tok := range byToken {
		r.extending[tok] = true
	}
	r.mu.Unlock()
	for _, h := range expired {
		r.lose(h)
	}
	for tok, hs := range byToken {
		r.extends.Add(1)
		go func() {
			defer r.extends.Done()
			r.extendToken(tok, hs)
			r.mu.Lock()
			delete(r.extending, tok)
			r.mu.Unlock()
		}()
	}
}

// extendToken extends the leases of hs, all held under tok; a task whose
// lease is gone has its handler cancelled with ErrLeaseLost.
func (r *runner) extendToken(tok string, hs []*held) {
	ids := make([]string, len(hs))
	for i, h := range hs {
		ids[i] = h.id
	}
	at := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), r.q.Lease/3)
	lost, err := r.st.ExtendTasks(ctx, tok, r.q.Lease, ids)
	cancel()
	if err != nil {
		// Redis is unreachable: the lease may run out and be taken; the
		// next ticks cancel the handlers once it has on our clock.
		r.w.log.Warn("worker: extending leases failed", "queue", r.q.Name, "tasks", len(ids), "error", err)
		return
	}
	gone := make(map[string]bool, len(lost))
	for _, id := range lost {
		gone[id] = true
	}
	for _, h := range hs {
		if gone[h.id] {
			r.lose(h)
		} else {
			r.mu.Lock()
			h.extended = at
			r.mu.Unlock()
		}
	}
}

func (r *runner) lose(h *held) {
	r.mu.Lock()
	_, still := r.held[h]
	first := still && !h.lost
	h.lost = true
	r.mu.Unlock()
	if !first {
		return // settled meanwhile, or lost already
	}
	r.w.m.lost.WithLabelValues(r.q.Name).Inc()
	r.w.log.Warn("worker: lease lost; cancelling the handler", "queue", r.q.Name, "id", h.id)
	h.cancel(ErrLeaseLost)
}

// lastError is err's text as a task's last error: at most maxErrorBytes
// of valid UTF-8 (invalid bytes become '?'), cut at a rune boundary. An
// Error method that panics (a typed nil pointer returned as the error)
// is reported, not let kill the worker.
func lastError(err error) (s string) {
	defer func() {
		if p := recover(); p != nil {
			s = fmt.Sprintf("%T whose Error method panicked: %v", err, p)
		}
	}()
	s = strings.ToValidUTF8(err.Error(), "?")
	if len(s) <= maxErrorBytes {
		return s
	}
	s = s[:maxErrorBytes]
	for len(s) > 0 && !utf8.ValidString(s) {
		s = s[:len(s)-1] // at most the last rune's first bytes
	}
	return s
}

// jitter spreads a poll interval over ±20%, so workers do not poll in step.
func jitter(d time.Duration) time.Duration { return lifecycle.Jitter(d, 5) }
