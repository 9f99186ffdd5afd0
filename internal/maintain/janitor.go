package maintain

import (
	"context"
	"time"

	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/admin"
)

// Defaults of JanitorConfig.
const (
	// DefaultJanitorInterval is the time between two purge passes.
	DefaultJanitorInterval = time.Minute
	// DefaultJanitorPassTimeout bounds one pass over every queue.
	DefaultJanitorPassTimeout = 30 * time.Second
)

// TaskPurger is what the janitor needs from the task queues
// (tasks.Manager): apply each queue's dead-letter retention, falling back
// to the global one, and say how many each queue lost.
type TaskPurger interface {
	PurgeDead(ctx context.Context, globalAge time.Duration, globalMax int) (map[string]int, error)
}

// JanitorConfig configures a Janitor. Zero durations take the defaults.
type JanitorConfig struct {
	// Retention and Max are ORDERDELAY_DEAD_LETTER_RETENTION and
	// ORDERDELAY_DEAD_LETTER_MAX: dead letters older than Retention (0:
	// none by age), and the oldest beyond Max (0: no cap), are purged.
	Retention time.Duration
	Max       int
	// Tasks, if set, purges the task queues' dead letters (with their
	// payloads) in the same pass; nil: the order queue only.
	Tasks       TaskPurger
	Interval    time.Duration // between passes (jittered ±10%)
	PassTimeout time.Duration // bound of one pass
}

// JanitorResult is what one pass purged.
type JanitorResult struct {
	Orders int            // order queue dead letters
	Tasks  map[string]int // per task queue, only those that lost any
}

// Janitor purges old dead letters — the order queue's and the task
// queues' — so Redis memory cannot grow without bound. It works with the
// operator's tools (admin.Tools) it was given; nothing is built per pass.
type Janitor struct {
	cfg   JanitorConfig
	loop  Loop
	tools *admin.Tools
	log   *zap.Logger
}

// NewJanitor returns a Janitor over the queue of tools.
func NewJanitor(cfg JanitorConfig, tools *admin.Tools, log *zap.Logger) *Janitor {
	cfg.Interval = orDefault(cfg.Interval, DefaultJanitorInterval)
	cfg.PassTimeout = orDefault(cfg.PassTimeout, DefaultJanitorPassTimeout)
	j := &Janitor{cfg: cfg, tools: tools, log: log}
	j.loop = Loop{Interval: cfg.Interval, Spread: 10, PassTimeout: cfg.PassTimeout,
		Failed: func(err error) { j.log.Debug("dead-letter purge failed; retrying later", zap.Error(err)) }}
	return j
}

// orders reports whether the order queue has a retention to apply.
func (j *Janitor) orders() bool { return j.cfg.Retention > 0 || j.cfg.Max > 0 }

// RunOnce does one pass, under its own deadline. Both sides are tried
// even when the first fails; the first error is returned.
func (j *Janitor) RunOnce(ctx context.Context) (JanitorResult, error) {
	ctx, cancel := j.loop.Bound(ctx)
	defer cancel()
	var res JanitorResult
	var first error
	if j.orders() {
		n, err := j.tools.PurgeDead(ctx, j.cfg.Retention, j.cfg.Max)
		res.Orders, first = n, err
	}
	if j.cfg.Tasks != nil {
		per, err := j.cfg.Tasks.PurgeDead(ctx, j.cfg.Retention, j.cfg.Max)
		res.Tasks = per
		if first == nil {
			first = err
		}
	}
	return res, first
}

// Run purges at once and then every Interval (±10%) until ctx ends; it
// returns nil then, or at once when there is nothing to purge. A failed
// pass is logged and tried again at the next.
func (j *Janitor) Run(ctx context.Context) error {
	if !j.orders() && j.cfg.Tasks == nil {
		return nil
	}
	return j.loop.Run(ctx, func(ctx context.Context) (bool, error) {
		res, err := j.RunOnce(ctx)
		if res.Orders > 0 {
			j.log.Info("purged old dead letters", zap.Int("count", res.Orders))
		}
		for q, n := range res.Tasks {
			j.log.Info("purged old task dead letters and their payloads", zap.String("queue", q), zap.Int("count", n))
		}
		return false, err
	})
}
