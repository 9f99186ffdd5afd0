package consumer

import (
	"context"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Stream queues: Redis counts the deliveries of every entry in each
// consumer group's pending entries list (XREADGROUP delivers once,
// XAUTOCLAIM and XCLAIM once more each). The daemon reads those counts and
// dead-letters an entry that was delivered max_attempts times and then
// left unacknowledged for the queue's ack_timeout, instead of letting
// consumers reclaim it forever.

// streamSweepEvery bounds how often a stream queue's groups are swept.
const streamSweepEvery = time.Second

// sweepStream runs sweepStreamOnce at most every streamSweepEvery (on
// Redis's clock, redisNow in ms); a failure is logged and counted, and the
// next forward pass tries again.
func (c *Consumer) sweepStream(ctx context.Context, redisNow int64) {
	if redisNow-c.streamSwept < streamSweepEvery.Milliseconds() {
		return
	}
	c.streamSwept = redisNow
	res, err := c.sweepStreamOnce(ctx)
	if err != nil {
		if ctx.Err() == nil {
			c.m.Errors.WithLabelValues(metrics.StageClaim).Inc()
			if !c.refused(err, metrics.StageClaim) {
				c.log.Warn("sweeping the stream's pending entries failed; retried on the next pass", zap.Error(err))
			}
		}
		return
	}
	if res.DeadLettered+res.Gone > 0 {
		c.m.DeadLettered.WithLabelValues(ReasonFailed).Add(float64(res.DeadLettered))
		c.log.Info("stream entries delivered max_attempts times without an ack were dead-lettered",
			zap.Int("dead_lettered", res.DeadLettered), zap.Int("trimmed", res.Gone))
	}
}

// sweepStreamOnce looks at up to a batch of each group's pending entries
// idle for at least the ack timeout, continuing where the last sweep of
// that group stopped (so a long list of entries still being retried does
// not hide exhausted ones behind it), and dead-letters those delivered
// MaxAttempts times.
func (c *Consumer) sweepStreamOnce(ctx context.Context) (queue.StreamBury, error) {
	var out queue.StreamBury
	st := queue.NewStore(c.rdb, c.cfg.Keys)
	groups, err := st.StreamGroups(ctx)
	if err != nil {
		return out, fmt.Errorf("stream sweep: %w", err)
	}
	if c.pelCursor == nil {
		c.pelCursor = map[string]string{}
	}
	ack := c.ackTimeout()
	for _, g := range groups {
		if g.Pending == 0 {
			delete(c.pelCursor, g.Name)
			continue
		}
		start := c.pelCursor[g.Name]
		if start == "" {
			start = "-"
		}
		batch := int64(c.cfg.BatchSize)
		pend, err := st.StreamPending(ctx, g.Name, ack, start, batch)
		if err != nil {
			return out, fmt.Errorf("stream sweep: group %q: %w", g.Name, err)
		}
		if int64(len(pend)) < batch {
			delete(c.pelCursor, g.Name)
		} else {
			c.pelCursor[g.Name] = "(" + pend[len(pend)-1].ID
		}
		var ids []string
		for _, p := range pend {
			if p.RetryCount >= int64(c.cfg.MaxAttempts) {
				ids = append(ids, p.ID)
			}
		}
		if len(ids) == 0 {
			continue
		}
		res, err := st.BuryStreamEntries(ctx, g.Name, ack, c.cfg.MaxAttempts, ids)
		if err != nil {
			return out, fmt.Errorf("stream sweep: group %q: %w", g.Name, err)
		}
		out.DeadLettered += res.DeadLettered
		out.Gone += res.Gone
	}
	return out, nil
}
