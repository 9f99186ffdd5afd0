package consumer

import (
	"context"
	"time"

	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/orders"
)

// handler is what a Consumer does with its queue, chosen once in New from
// Config (newHandler) rather than asked of the configuration at every step:
//
//   - orderHandler claims due orders as one batch lease, closes them in
//     PostgreSQL and keeps their leases in the store (finish, retry,
//     dead-letter, hand back);
//   - taskHandler (Config.Process) leases per member, runs the queue's
//     action on each batch, and drops payloads with the finished entries;
//   - forwardHandler (Config.Forward) forwards due tasks to a stream or a
//     list instead of claiming them: nothing is left to process or to
//     keep;
//   - dryRunHandler (Config.DryRun) reads due orders without leasing them,
//     lets the orders store roll its closes back, and changes nothing in
//     Redis.
type handler interface {
	// claim takes (forwards, reads) at most limit due entries.
	claim(ctx context.Context, limit int) (claimResult, error)
	// head is the idle head check: the earliest deadline the next claim
	// would look at, if any.
	head(ctx context.Context) (deadline int64, ok bool, err error)
	// process handles one claimed batch within batchCtx; stmt bounds
	// one statement.
	process(workCtx, batchCtx context.Context, stmt time.Duration, items []item)
	// fence is the check a close runs before it commits, and the set of
	// serials it dropped.
	fence(items []item) (orders.Fence, map[string]struct{})
	// closed counts the orders a close committed (done), at committed.
	closed(done []item, serials []string, committed time.Time)
	// The lease bookkeeping after a batch.
	finish(items []item)
	retry(items []item, delay time.Duration, spend bool, reason string)
	bury(items []item, reason, lastErr string)
	handBack(items []item)
}

// newHandler returns c's handler. At most one of DryRun, Forward and
// Process is set: New refuses the others (Config.check).
func newHandler(c *Consumer) handler {
	o := orderHandler{c: c}
	switch {
	case c.cfg.DryRun:
		return dryRunHandler{o}
	case c.cfg.Forward != nil:
		return forwardHandler{o}
	case c.cfg.Process != nil:
		return taskHandler{o}
	}
	return o
}

// orderHandler closes orders; its lease bookkeeping (fence, finish, retry,
// bury, hand back: worker.go) is the one the task handlers share.
type orderHandler struct{ c *Consumer }

func (h orderHandler) claim(ctx context.Context, limit int) (claimResult, error) {
	return h.c.claimAs(ctx, limit, h.c.token(), true)
}

func (h orderHandler) head(ctx context.Context) (int64, bool, error) { return h.c.q.Head(ctx, -1) }

func (h orderHandler) process(workCtx, batchCtx context.Context, stmt time.Duration, items []item) {
	h.c.closeItems(workCtx, batchCtx, stmt, dedupe(items)) //nolint:errcheck // handled and counted inside
}

func (h orderHandler) closed(done []item, _ []string, committed time.Time) {
	for _, it := range done {
		h.c.m.Lateness.Observe(committed.Sub(time.UnixMilli(it.deadline)).Seconds())
	}
	h.c.m.Closed.Add(float64(len(done)))
}

// taskHandler runs a task queue's action (Config.Process).
type taskHandler struct{ orderHandler }

func (h taskHandler) claim(ctx context.Context, limit int) (claimResult, error) {
	return h.c.claimAs(ctx, limit, h.c.token(), false)
}

// head also reads {Q}:inflight (queue.Store.NextDue): a task another
// replica handed back with its attempts, or turned into a backoff, waits
// there, due, where the order queue's head check (the queue key alone)
// would not see it before the scan interval.
func (h taskHandler) head(ctx context.Context) (int64, bool, error) {
	_, next, err := h.c.q.NextDue(ctx)
	return next, next >= 0, err
}

func (h taskHandler) process(workCtx, batchCtx context.Context, _ time.Duration, items []item) {
	h.c.processTasks(workCtx, batchCtx, items)
}

func (h taskHandler) finish(items []item) { h.finishLeases(items, true) }

// handBack keeps what the tasks have spent (queue.Store.Release): a task
// cut mid-run by a stop, after an earlier run failed, keeps its attempts,
// so a stop never gives a task back the attempts its failed runs spent
// (the cut run spends none).
func (h taskHandler) handBack(items []item) { h.handBackWith(items, h.c.q.Release) }

// forwardHandler forwards due tasks to a stream or a list (Config.Forward).
type forwardHandler struct{ orderHandler }

func (h forwardHandler) claim(ctx context.Context, limit int) (claimResult, error) {
	return h.c.forward(ctx, limit)
}

// dryRunHandler reads instead of claiming and changes nothing in Redis.
type dryRunHandler struct{ orderHandler }

func (h dryRunHandler) claim(ctx context.Context, limit int) (claimResult, error) {
	return h.c.peek(ctx, limit)
}

// fence: a dry run commits nothing and needs none.
func (dryRunHandler) fence([]item) (orders.Fence, map[string]struct{}) {
	return nil, map[string]struct{}{}
}

func (h dryRunHandler) closed(done []item, serials []string, _ time.Time) {
	h.c.m.DryRunWouldClose.Add(float64(len(done)))
	if len(serials) > 0 {
		h.c.log.Info("dry run: would close", zap.Strings("serials", serials))
	}
}

// The queue is left as it is.
func (dryRunHandler) finish([]item)                             {}
func (dryRunHandler) retry([]item, time.Duration, bool, string) {}
func (dryRunHandler) bury([]item, string, string)               {}
func (dryRunHandler) handBack([]item)                           {}
