package consumer

import (
	"context"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
)

// pollTasks claims due tasks of k as a poll does (POST /v1/queues/{q}/poll
// and the Go worker: queue.Store.PollTasks), for the tests that play a
// poll beside the consumer.
func pollTasks(ctx context.Context, rdb redis.UniversalClient, k queue.Keys, limit, maxBytes int, lease time.Duration,
	maxAttempts int) ([]Task, string, error) {
	p, err := queue.NewStore(rdb, k).PollTasks(ctx, queue.PollArgs{Limit: limit, MaxBytes: maxBytes, Lease: lease, MaxAttempts: maxAttempts})
	return p.Tasks, p.Token, err
}
