package worker

import (
	"errors"
	"fmt"
	"time"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/tasks"
)

// Defaults of a Queue's zero fields; they are the queues file's
// (internal/tasks), so the two cannot drift apart.
const (
	DefaultLease       = tasks.DefaultLease
	DefaultMaxAttempts = tasks.DefaultMaxAttempts
	DefaultConcurrency = 10
	DefaultInitial     = tasks.DefaultRetryInitial
	DefaultMax         = tasks.DefaultRetryMax
	DefaultMultiplier  = tasks.DefaultRetryMultiplier
)

// MinLease is the shortest lease a Queue accepts: the heartbeat extends it
// every third of it.
const MinLease = time.Second

// Queue is one poll queue a Worker serves: the queue's settings as the
// daemon's queues file declares them (FromQueuesFile reads them from
// there). Every zero field takes its default.
type Queue struct {
	// Name labels the queue in metrics and logs and is Task.Queue:
	// 1-64 of a-z, 0-9, _ and -. Required.
	Name string
	// Key is the queue's Redis key. Zero: "delaytask:<Name>", the queues
	// file's default. The queue's action in the daemon's file must be
	// poll, or the queue absent from it: the daemon runs every other
	// action on its own claims, and a worker beside it would take its
	// tasks.
	Key string
	// Lease is how long a claimed task is held without a heartbeat; the
	// worker extends it every Lease/3 while the handler runs. Zero: 60s;
	// at least MinLease.
	Lease time.Duration
	// MaxAttempts is how many times a task runs before it is
	// dead-lettered as "failed" (an expired lease counts as a run).
	// Zero: 10, or len(Retry.Backoff)+1 if that is larger.
	MaxAttempts int
	// Retry is the delay before each retry.
	Retry Retry
	// Concurrency bounds this queue's handlers running at once. Zero: 10.
	Concurrency int
}

// Retry is a queue's retry policy, as the queues file's retry block: an
// explicit list of delays, or exponential growth from Initial by
// Multiplier capped at Max, each delay drawn from [d/2, d] unless NoJitter.
type Retry struct {
	Backoff    []time.Duration // delay before retry 1, 2, …; the last repeats
	Initial    time.Duration   // zero: 1s
	Max        time.Duration   // zero: 5m
	Multiplier float64         // zero: 2
	NoJitter   bool            // false: jitter on, as the file's default
}

// ErrConfig is wrapped by every error about a Queue or Config.
var ErrConfig = errors.New("worker config")

// withDefaults validates q and fills in its defaults.
func (q Queue) withDefaults() (Queue, error) {
	bad := func(format string, a ...any) (Queue, error) {
		return Queue{}, fmt.Errorf("%w: queue %q: %s", ErrConfig, q.Name, fmt.Sprintf(format, a...))
	}
	if !queue.ValidQueueName(q.Name) {
		return bad("Name must be 1-64 of a-z, 0-9, _ and -")
	}
	if q.Key == "" {
		q.Key = "delaytask:" + q.Name
	}
	if err := queue.ValidateKey(q.Key); err != nil {
		return bad("Key: %v", err)
	}
	if q.Key == queue.DefaultKey {
		return bad("Key %q is the order queue's; a worker serves task queues", q.Key)
	}
	if q.Lease == 0 {
		q.Lease = DefaultLease
	}
	if q.Lease < MinLease {
		return bad("Lease %v is below %v", q.Lease, MinLease)
	}
	if q.Concurrency == 0 {
		q.Concurrency = DefaultConcurrency
	}
	if q.Concurrency < 0 {
		return bad("Concurrency %d is negative", q.Concurrency)
	}
	r := &q.Retry
	for i, d := range r.Backoff {
		if d <= 0 {
			return bad("Retry.Backoff[%d] is %v; delays are positive", i, d)
		}
	}
	if r.Initial == 0 {
		r.Initial = DefaultInitial
	}
	if r.Max == 0 {
		r.Max = DefaultMax
	}
	if r.Multiplier == 0 {
		r.Multiplier = DefaultMultiplier
	}
	switch {
	case r.Initial < 0 || r.Max < r.Initial:
		return bad("Retry needs 0 < Initial <= Max, got %v and %v", r.Initial, r.Max)
	case r.Multiplier < 1:
		return bad("Retry.Multiplier %v is below 1", r.Multiplier)
	}
	if q.MaxAttempts == 0 {
		q.MaxAttempts = max(DefaultMaxAttempts, len(r.Backoff)+1)
	}
	if q.MaxAttempts < 1 {
		return bad("MaxAttempts %d is below 1", q.MaxAttempts)
	}
	return q, nil
}

// delay is the wait before retry number attempts (failed attempts so far,
// from 1), by the same rule as the daemon's (tasks.Retry.Delay).
func (r Retry) delay(attempts int, rnd func() float64) time.Duration {
	t := tasks.Retry{Initial: tasks.Duration(r.Initial), Max: tasks.Duration(r.Max), Multiplier: r.Multiplier}
	for _, d := range r.Backoff {
		t.Backoff = append(t.Backoff, tasks.Duration(d))
	}
	jitter := !r.NoJitter
	t.Jitter = &jitter
	return t.Delay(attempts, rnd)
}

// FromQueuesFile reads the daemon's queues file (ORDERDELAY_QUEUES_FILE)
// at path, validated as the daemon validates it, and returns the queue
// named name as a Queue with Concurrency left zero. The queue's action must
// be poll: the daemon runs every other action itself, and a worker beside
// it would take its tasks.
func FromQueuesFile(path, name string) (Queue, error) {
	f, err := tasks.Load(path)
	if err != nil {
		return Queue{}, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	for _, c := range f.Queues {
		if c.Name != name {
			continue
		}
		if c.Action.Type != tasks.ActionPoll {
			return Queue{}, fmt.Errorf("%w: queue %q in %s has action %q; a worker serves poll queues only",
				ErrConfig, name, path, c.Action.Type)
		}
		q := Queue{Name: c.Name, Key: c.Key, Lease: time.Duration(c.Lease), MaxAttempts: c.Retry.MaxAttempts,
			Retry: Retry{Initial: time.Duration(c.Retry.Initial), Max: time.Duration(c.Retry.Max),
				Multiplier: c.Retry.Multiplier, NoJitter: c.Retry.Jitter != nil && !*c.Retry.Jitter}}
		for _, d := range c.Retry.Backoff {
			q.Retry.Backoff = append(q.Retry.Backoff, time.Duration(d))
		}
		return q, nil
	}
	return Queue{}, fmt.Errorf("%w: no queue %q in %s", ErrConfig, name, path)
}
