package consumer

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Task is a claimed task of a named queue, as a ProcessFunc runs it.
type Task = queue.Task

// ProcessFunc runs a queue's action on claimed tasks and returns one error
// per task: nil, done; an error, an attempt spent (retried by the queue's
// policy, dead-lettered after MaxAttempts); an error wrapped by
// Unavailable or Later, retried without spending an attempt (see
// NoAttemptError). It must return within ctx's deadline.
type ProcessFunc func(ctx context.Context, tasks []Task) []error

// ReasonFailed dead-letters a task whose action kept failing.
const ReasonFailed = queue.ReasonFailed

// processTasks is process for task queues: the action runs, done tasks are
// removed with their payloads, failed ones are retried by the queue's
// policy and dead-lettered as "failed" after MaxAttempts.
func (c *Consumer) processTasks(workCtx, ctx context.Context, items []item) {
	tasks, err := c.loadTasks(items)
	if err != nil {
		c.m.Errors.WithLabelValues(metrics.StageClaim).Inc()
		c.log.Warn("reading task payloads failed; the tasks return when their lease expires", zap.Error(err))
		return
	}
	errs := c.cfg.Process(c.withHeld(ctx, items), tasks)
	if len(errs) != len(tasks) {
		errs = make([]error, len(tasks))
		for i := range errs {
			errs[i] = errors.New("action returned no outcome")
		}
	}
	now := c.now()
	var done, later, down, untried, cut []item
	var untriedErr, laterErr, downErr error
	failed := map[int][]item{} // by attempts after this one
	lastErr := map[int]string{}
	for i, it := range items {
		if errs[i] == nil {
			done = append(done, it)
			c.m.Lateness.Observe(now.Sub(time.UnixMilli(it.deadline)).Seconds())
			continue
		}
		if workCtx.Err() != nil {
			cut = append(cut, it) // handed back below, in one call
			continue
		}
		if na := noAttempt(errs[i]); na != nil { // see NoAttemptError
			if na.Unavailable {
				down, downErr = append(down, it), na.Err
			} else if na.Untried {
				untried, untriedErr = append(untried, it), na.Err
			} else {
				later, laterErr = append(later, it), na.Err
			}
			continue
		}
		a := it.attempts + 1
		failed[a] = append(failed[a], it)
		lastErr[a] = errs[i].Error()
	}
	c.handBack(cut)
	c.finish(done)
	c.m.Closed.Add(float64(len(done)))
	for a, group := range failed {
		c.m.Errors.WithLabelValues(metrics.StageClose).Add(float64(len(group)))
		if a >= c.cfg.MaxAttempts {
			c.bury(group, ReasonFailed, lastErr[a])
			continue
		}
		delay := time.Second << min(a-1, 10)
		if c.cfg.Retry != nil {
			delay = c.cfg.Retry(a)
		}
		c.retry(group, delay, true, lastErr[a])
	}
	if len(done) > 0 && len(down) == 0 {
		c.pgBackReset()
	}
	c.retryNoAttempt(workCtx, untried, later, down, untriedErr, laterErr, downErr)
}

// loadTasks reads the payloads of claimed items.
func (c *Consumer) loadTasks(items []item) ([]Task, error) {
	ctx, cancel := c.bookkeeping()
	defer cancel()
	leased := make([]queue.Leased, len(items))
	for i, it := range items {
		leased[i] = queue.Leased{Serial: it.serial, Deadline: it.deadline, Attempts: it.attempts}
	}
	return c.q.ReadTasks(ctx, leased)
}

// Forward configures a stream or list action.
type Forward struct {
	Kind  string // "stream" or "list"
	Queue string // queue name, written into each stream entry
	// MaxLen, stream: approximate cap (XADD MAXLEN ~). List: most items
	// the ready list may hold; while it holds that many, due tasks stay in
	// the queue (0: no cap).
	MaxLen int64
	// Reliable list: taken items not acknowledged within AckTimeout return
	// to the ready list (recovered in the same script), or are
	// dead-lettered once taken Config.MaxAttempts times.
	Reliable bool
	// AckTimeout is how long a taken list item or a delivered stream entry
	// may stay unacknowledged before that delivery counts as failed.
	AckTimeout time.Duration
}

// DefaultAckTimeout is a stream or reliable list queue's ack_timeout when
// Forward.AckTimeout is zero.
const DefaultAckTimeout = 5 * time.Minute

// ackTimeout is the Forward's ack timeout, or its default.
func (c *Consumer) ackTimeout() time.Duration {
	if c.cfg.Forward == nil || c.cfg.Forward.AckTimeout <= 0 {
		return DefaultAckTimeout
	}
	return c.cfg.Forward.AckTimeout
}

// forward is claim for stream and list actions.
func (c *Consumer) forward(ctx context.Context, limit int) (claimResult, error) {
	f := c.cfg.Forward
	fr, err := c.q.Forward(ctx, queue.ForwardArgs{Kind: f.Kind, Limit: limit, MaxLen: f.MaxLen, Queue: f.Queue,
		Reliable: f.Reliable, AckTimeout: c.ackTimeout(), MaxAttempts: c.cfg.MaxAttempts})
	if err != nil {
		return claimResult{}, err
	}
	// Forwarding is a stream or list task's last step the daemon sees:
	// its lateness is measured there.
	for _, l := range fr.Late {
		c.m.Lateness.Observe(l.Seconds())
	}
	res := fromStore(fr.ClaimResult, "")
	res.forwarded = fr.Forwarded
	c.readyFull(&res, fr.Full)
	c.m.Claimed.Add(float64(fr.Forwarded))
	c.m.Forwarded.Add(float64(fr.Forwarded))
	for reason, k := range res.dead {
		c.m.DeadLettered.WithLabelValues(reason).Add(float64(k))
	}
	if fr.Recovered > 0 {
		c.log.Info("unacknowledged list items redelivered or dead-lettered", zap.Int("count", fr.Recovered),
			zap.Int("dead_lettered", res.dead[ReasonFailed]))
	}
	if f.Kind == "stream" && !res.paused {
		c.sweepStream(ctx, res.now)
	}
	return res, nil
}
