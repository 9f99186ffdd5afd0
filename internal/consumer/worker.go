package consumer

import (
	"context"
	"math/rand/v2"
	"time"

	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// process closes one claimed batch. workCtx is cancelled only when the drain
// timeout passes during shutdown; the batch itself runs under
// StatementTimeout, which is below the lease, so the lease outlives the work.
func (c *Consumer) process(workCtx context.Context, items []item) {
	defer c.m.Inflight.Sub(float64(len(items)))
	ctx, cancel := context.WithTimeout(workCtx, c.cfg.StatementTimeout)
	defer cancel()
	if c.cfg.Process != nil {
		c.processTasks(workCtx, ctx, items)
		return
	}
	c.closeItems(workCtx, ctx, items)
}

// closeItems closes what it can of items and settles the rest. A permanent
// error splits the batch in halves until the serial that causes it is alone,
// so good orders are not held back by a bad one.
func (c *Consumer) closeItems(workCtx, ctx context.Context, items []item) {
	serials := serialsOf(items)
	closed, err := c.store.Close(ctx, serials)
	if err != nil {
		c.m.Errors.WithLabelValues(metrics.StageClose).Inc()
		c.failed(workCtx, ctx, items, err, "close")
		return
	}
	c.m.SetUp(metrics.DepPostgres, true)
	c.pgBackReset()
	committed := c.now()
	isClosed := make(map[string]struct{}, len(closed))
	for _, s := range closed {
		isClosed[s] = struct{}{}
	}
	var done, rest []item
	for _, it := range items {
		if _, ok := isClosed[it.serial]; ok {
			done = append(done, it)
			if !c.cfg.DryRun {
				c.m.Lateness.Observe(committed.Sub(time.UnixMilli(it.deadline)).Seconds())
			}
		} else {
			rest = append(rest, it)
		}
	}
	if c.cfg.DryRun {
		c.m.DryRunWouldClose.Add(float64(len(done)))
		if len(closed) > 0 {
			c.log.Info("dry run: would close", zap.Strings("serials", closed))
		}
	} else {
		c.m.Closed.Add(float64(len(done)))
	}

	if len(rest) > 0 {
		exists, err := c.store.Lookup(ctx, serialsOf(rest))
		if err != nil {
			c.m.Errors.WithLabelValues(metrics.StageLookup).Inc()
			c.finish(done)
			c.failed(workCtx, ctx, rest, err, "lookup")
			return
		}
		found := make(map[string]struct{}, len(exists))
		for _, s := range exists {
			found[s] = struct{}{}
		}
		var missing []item
		for _, it := range rest {
			if _, ok := found[it.serial]; ok {
				done = append(done, it) // paid or closed already: settled
			} else {
				missing = append(missing, it)
			}
		}
		c.m.Skipped.WithLabelValues(metrics.SkipSettled).Add(float64(len(rest) - len(missing)))
		c.m.Skipped.WithLabelValues(metrics.SkipNotFound).Add(float64(len(missing)))
		c.notFound(missing)
	}
	c.finish(done)
	c.log.Debug("batch done", zap.Int("claimed", len(items)), zap.Int("closed", len(closed)),
		zap.Int("settled", len(done)-len(closed)), zap.Strings("closed_serials", closed))
}

// failed handles a batch whose statement failed.
func (c *Consumer) failed(workCtx, ctx context.Context, items []item, err error, stage string) {
	switch {
	case workCtx.Err() != nil:
		// Shutdown ran out of drain time: nothing was committed that the
		// SQL guard would not make harmless; give the claims back.
		c.handBack(items)
	case orders.Transient(err):
		c.m.SetUp(metrics.DepPostgres, false)
		d := c.pgBackoff()
		c.log.Warn("database unavailable; batch will be retried", zap.String("stage", stage),
			zap.Int("orders", len(items)), zap.Duration("retry_in", d), zap.Error(err))
		c.retry(items, d, false, err.Error())
		// Hold this worker for the backoff, so errors per second stay
		// bounded while the database is away; shutdown cuts the wait.
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
		case <-c.stopping:
		case <-workCtx.Done():
		}
	case len(items) > 1:
		c.log.Warn("statement failed; splitting the batch to isolate the cause", zap.String("stage", stage),
			zap.Int("orders", len(items)), zap.Error(err))
		half := len(items) / 2
		c.closeItems(workCtx, ctx, items[:half])
		c.closeItems(workCtx, ctx, items[half:])
	default:
		c.log.Error("statement fails for this order; dead-lettering it", zap.String("stage", stage),
			zap.String("serial", items[0].serial), zap.Error(err))
		c.bury(items, queue.ReasonCloseFailed, err.Error())
	}
}

// notFound backs off orders that have no row yet (the producer may have
// enqueued before its own commit), and dead-letters them after MaxAttempts.
func (c *Consumer) notFound(items []item) {
	byAttempts := map[int][]item{}
	var give []item
	for _, it := range items {
		if it.attempts+1 >= c.cfg.MaxAttempts {
			give = append(give, it)
		} else {
			byAttempts[it.attempts] = append(byAttempts[it.attempts], it)
		}
	}
	for a, group := range byAttempts {
		c.retry(group, c.entryBackoff(a), true, "no order row")
	}
	if len(give) > 0 {
		c.bury(give, queue.ReasonNotFound, "no order row")
	}
}

// entryBackoff is the delay before retry number attempts+1: retryBase
// doubled per attempt, capped at BackoffMax, with jitter down to half.
func (c *Consumer) entryBackoff(attempts int) time.Duration {
	d := c.cfg.BackoffMax
	if attempts < 30 {
		d = min(retryBase<<attempts, c.cfg.BackoffMax)
	}
	return d/2 + rand.N(d/2+1)
}

func (c *Consumer) pgBackoff() time.Duration {
	c.pgMu.Lock()
	defer c.pgMu.Unlock()
	return c.pgBack.NextBackOff()
}

func (c *Consumer) pgBackReset() {
	c.pgMu.Lock()
	c.pgBack.Reset()
	c.pgMu.Unlock()
}

// byToken groups items by the claim that leased them (a split batch keeps
// one token, but the scripts take one token per call).
func byToken(items []item) map[string][]string {
	g := map[string][]string{}
	for _, it := range items {
		g[it.token] = append(g[it.token], it.serial)
	}
	return g
}

func serialsOf(items []item) []string {
	out := make([]string, len(items))
	for i, it := range items {
		out[i] = it.serial
	}
	return out
}

func bookkeeping() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), bookkeepingTimeout)
}

// finish removes settled entries (compare-and-set on the lease).
func (c *Consumer) finish(items []item) {
	if c.cfg.DryRun {
		return // the queue is left as it is
	}
	if len(items) == 0 {
		return
	}
	ctx, cancel := bookkeeping()
	defer cancel()
	k := c.cfg.Keys
	keys := []string{k.Inflight, k.Deadlines, k.Lease}
	if c.cfg.Process != nil {
		keys = append(keys, k.Payload)
	}
	for tok, serials := range byToken(items) {
		args := append([]any{tok}, anys(serials)...)
		if err := finishScript.Run(ctx, c.rdb, keys, args...).Err(); err != nil {
			c.m.Errors.WithLabelValues(metrics.StageRemove).Inc()
			c.log.Warn("removing settled entries failed; they return when their lease expires and are settled then",
				zap.Int("orders", len(serials)), zap.Error(err))
		}
	}
}

func (c *Consumer) retry(items []item, delay time.Duration, spend bool, reason string) {
	if c.cfg.DryRun {
		return // the queue is left as it is
	}
	ctx, cancel := bookkeeping()
	defer cancel()
	k := c.cfg.Keys
	sp := 0
	if spend {
		sp = 1
	}
	// Wake the scanner for the retry if it sleeps longer than that.
	select {
	case c.wake <- time.Now().Add(delay).UnixMilli():
	default:
	}
	for tok, serials := range byToken(items) {
		args := append([]any{tok, delay.Milliseconds(), sp, reason}, anys(serials)...)
		if err := retryScript.Run(ctx, c.rdb, []string{k.Inflight, k.Lease}, args...).Err(); err != nil {
			c.m.Errors.WithLabelValues(metrics.StageRemove).Inc()
			c.log.Warn("scheduling a retry failed; the entries return when their lease expires",
				zap.Int("orders", len(serials)), zap.Error(err))
		}
	}
}

func (c *Consumer) bury(items []item, reason, lastErr string) {
	if c.cfg.DryRun {
		return // the queue is left as it is
	}
	ctx, cancel := bookkeeping()
	defer cancel()
	k := c.cfg.Keys
	for tok, serials := range byToken(items) {
		args := append([]any{tok, reason, lastErr}, anys(serials)...)
		n, err := buryScript.Run(ctx, c.rdb, []string{k.Inflight, k.Deadlines, k.Lease, k.Dead, k.DeadInfo}, args...).Int()
		if err != nil {
			c.m.Errors.WithLabelValues(metrics.StageRemove).Inc()
			c.log.Warn("dead-lettering failed; the entries return when their lease expires",
				zap.Int("orders", len(serials)), zap.Error(err))
			continue
		}
		c.m.DeadLettered.WithLabelValues(reason).Add(float64(n))
	}
}

// handBack returns claims to the queue with their true deadlines.
func (c *Consumer) handBack(items []item) {
	if c.cfg.DryRun {
		return // the queue is left as it is
	}
	ctx, cancel := bookkeeping()
	defer cancel()
	k := c.cfg.Keys
	total := 0
	for tok, serials := range byToken(items) {
		args := append([]any{tok}, anys(serials)...)
		n, err := handBackScript.Run(ctx, c.rdb, []string{k.Queue, k.Inflight, k.Deadlines, k.Lease}, args...).Int()
		if err != nil {
			c.log.Warn("hand-back failed; the entries return when their lease expires",
				zap.Int("orders", len(serials)), zap.Error(err))
			continue
		}
		total += n
	}
	c.log.Info("handed back unfinished claims", zap.Int("orders", total))
}

func anys(ss []string) []any {
	out := make([]any, len(ss))
	for i, s := range ss {
		out[i] = s
	}
	return out
}
