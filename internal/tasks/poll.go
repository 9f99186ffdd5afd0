package tasks

import (
	"context"
	"time"

	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Poll leases up to limit due tasks of poll queue q for lease, under a
// token of this call's own, as POST /v1/queues/{q}/poll does: PollStore on
// the queue's store with its max attempts, counted in its metrics.
// maxBytes > 0 bounds the tasks' encoded size (the first task is taken
// whatever its size).
func (q *Runtime) Poll(ctx context.Context, limit, maxBytes int, lease time.Duration, log *zap.Logger) ([]queue.Task, string, error) {
	return PollStore(ctx, q.Store, queue.PollArgs{Limit: limit, MaxBytes: maxBytes, Lease: lease,
		MaxAttempts: q.Config.Retry.MaxAttempts}, q.Metrics, log)
}

// PollStore runs a poll on st (queue.Store.PollTasks, DefaultLease when
// a.Lease <= 0) and counts what its claims did in m, as the scan loop
// counts its own claims: tasks claimed and re-claimed, entries
// dead-lettered (malformed ones logged), and a failed dead-lettering of
// tasks over their attempts as a remove error. Polled tasks are held by
// whoever polled, not this replica: they are not counted in flight. It
// returns the tasks and the lease token that acknowledges them ("" with no
// tasks).
func PollStore(ctx context.Context, st *queue.Store, a queue.PollArgs, m *metrics.Metrics, log *zap.Logger) ([]queue.Task, string, error) {
	if a.Lease <= 0 {
		a.Lease = DefaultLease
	}
	p, err := st.PollTasks(ctx, a)
	for _, c := range p.Claims {
		countPollClaim(m, log, c)
	}
	return p.Tasks, p.Token, err
}

// countPollClaim accounts for one claim of a poll.
func countPollClaim(m *metrics.Metrics, log *zap.Logger, c queue.PollClaim) {
	consumer.CountClaim(m, log, c.ClaimResult)
	if c.Over == 0 {
		return
	}
	if c.BuryErr != nil {
		m.Errors.WithLabelValues(metrics.StageRemove).Inc()
		log.Warn("dead-lettering failed; the entries return when their lease expires",
			zap.Int("orders", c.Over), zap.Error(c.BuryErr))
		return
	}
	m.DeadLettered.WithLabelValues(queue.ReasonFailed).Add(float64(c.Buried))
}
