package bench

import (
	"context"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// holding is a Store whose close never ends until its batch is cancelled:
// a consumer over it leases what it claims and holds it.
type holding struct{}

func (holding) Close(ctx context.Context, _ []string, _ orders.Fence) ([]string, error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

func (holding) Lookup(ctx context.Context, _ []string) ([]orders.Found, error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

// leasedMemory measures Redis memory per pending and per leased order: n
// due orders are loaded into the queue key (pending), then the real
// consumer, with enough workers to hold them all and a store that never
// answers, leases every one (the order queue's batch leases, default batch
// size). Both are used_memory deltas from an empty server.
func leasedMemory(ctx context.Context, e *env, n int) (pending, leased float64, err error) {
	if err := e.rdb.FlushAll(ctx).Err(); err != nil {
		return 0, 0, err
	}
	keys := queue.NewKeys(benchKey)
	mem0 := usedMemory(ctx, e.rdb)
	if err := zaddAll(ctx, e.rdb, benchKey, backlog(n, time.Now()), 0, n); err != nil {
		return 0, 0, err
	}
	mem1 := usedMemory(ctx, e.rdb)
	batch := consumer.DefaultBatchSize
	c, err := consumer.New(consumer.Config{Keys: keys, Workers: (n + batch - 1) / batch, BatchSize: batch,
		Lease: time.Hour, StatementTimeout: time.Minute, DrainTimeout: 10 * time.Millisecond},
		e.rdb, holding{}, metrics.New(prometheus.NewRegistry(), "bench", "bench"), zap.NewNop())
	if err != nil {
		return 0, 0, err
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); c.Run(runCtx) }() //nolint:errcheck // nil on cancel
	defer func() { cancel(); <-done }()
	for limit := time.Now().Add(time.Minute); ; {
		st, err := queue.ReadStats(ctx, e.rdb, keys)
		if err != nil {
			return 0, 0, err
		}
		if st.Held == int64(n) {
			break
		}
		if time.Now().After(limit) {
			return 0, 0, fmt.Errorf("leased memory: %d of %d held after a minute", st.Held, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
	mem2 := usedMemory(ctx, e.rdb)
	return float64(mem1-mem0) / float64(n), float64(mem2-mem0) / float64(n), nil
}
