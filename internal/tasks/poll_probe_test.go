package tasks

import (
	"context"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/queue"
)

type probeTask struct {
	ID       string
	Attempts int
	Payload  string
}

// advPoll runs a poll through tasks.PollStore and flattens its tasks, so
// the probes compare plain values (they were first run, through the same
// shim, against the consumer.ClaimTasks that PollStore replaced).
func advPoll(ctx context.Context, rdb redis.UniversalClient, k queue.Keys, limit, maxBytes int, lease time.Duration,
	maxAttempts int, m *metrics.Metrics, log *zap.Logger) ([]probeTask, string, error) {
	ts, tok, err := PollStore(ctx, queue.NewStore(rdb, k), queue.PollArgs{Limit: limit, MaxBytes: maxBytes, Lease: lease, MaxAttempts: maxAttempts}, m, log)
	var out []probeTask
	for _, t := range ts {
		out = append(out, probeTask{t.ID, t.Attempts, string(t.Payload)})
	}
	return out, tok, err
}
