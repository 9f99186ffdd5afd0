package maintain

import (
	"context"
	"fmt"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Defaults of RelayConfig.
const (
	DefaultRelayPage        = 500                    // events per pass
	DefaultRelayInterval    = 250 * time.Millisecond // between passes when the outbox is drained
	DefaultRelayRetry       = 2 * time.Second        // after a failed pass
	DefaultRelayPassTimeout = 30 * time.Second       // bound of one pass
)

// RelayConfig configures a Relay. Zero values take the defaults.
type RelayConfig struct {
	Keys        queue.Keys // the order queue's; events go to Keys.Events, {<queue key>}:events
	MaxLen      int64      // approximate cap of the stream (XADD MAXLEN ~)
	Page        int
	Interval    time.Duration
	Retry       time.Duration
	PassTimeout time.Duration
}

// Relay publishes close events from the outbox table to the Redis Stream
// {<queue key>}:events: each event is XADDed (serial, reason, closed_at,
// event_id: queue.Store.AddCloseEvents) and then deleted from the outbox
// in the transaction that locked it (orders.RelayOutbox). A crash between
// the XADD and the commit publishes the event again on the next pass:
// delivery is at least once, and consumers deduplicate by serial (or
// event_id). Replicas relay concurrently; SKIP LOCKED gives each its own
// rows.
type Relay struct {
	cfg     RelayConfig
	loop    Loop
	db      *sqlx.DB
	store   *queue.Store
	relayed prometheus.Counter
	log     *zap.Logger
}

// NewRelay returns a Relay; relayed counts the events it publishes.
func NewRelay(cfg RelayConfig, db *sqlx.DB, rdb redis.UniversalClient, relayed prometheus.Counter, log *zap.Logger) *Relay {
	cfg.Page = orDefault(cfg.Page, DefaultRelayPage)
	cfg.Interval = orDefault(cfg.Interval, DefaultRelayInterval)
	cfg.Retry = orDefault(cfg.Retry, DefaultRelayRetry)
	cfg.PassTimeout = orDefault(cfg.PassTimeout, DefaultRelayPassTimeout)
	r := &Relay{cfg: cfg, db: db, store: queue.NewStore(rdb, cfg.Keys), relayed: relayed, log: log}
	r.loop = Loop{Interval: cfg.Interval, Retry: cfg.Retry, PassTimeout: cfg.PassTimeout,
		Failed: func(err error) { r.log.Warn("close-event relay failed; retrying", zap.Error(err)) }}
	return r
}

// Run relays until ctx ends, then returns nil: at once when it starts and
// while there is a backlog (a full page), every Interval otherwise, Retry
// after a failure.
func (r *Relay) Run(ctx context.Context) error {
	return r.loop.Run(ctx, func(ctx context.Context) (bool, error) {
		n, err := r.RunOnce(ctx)
		return n == r.cfg.Page, err
	})
}

// RunOnce relays up to one page, under its own deadline, and returns how
// many events it published.
func (r *Relay) RunOnce(ctx context.Context) (int, error) {
	ctx, cancel := r.loop.Bound(ctx)
	defer cancel()
	n, err := orders.RelayOutbox(ctx, r.db, r.cfg.Page, func(ctx context.Context, events []orders.CloseEvent) error {
		out := make([]queue.CloseEvent, len(events))
		for i, e := range events {
			out[i] = queue.CloseEvent{ID: e.ID, Serial: e.Serial, Reason: e.Reason, ClosedAt: e.ClosedAt}
		}
		// The outbox rows are deleted only once this returned nil.
		return r.store.AddCloseEvents(ctx, r.cfg.MaxLen, out)
	})
	if err != nil {
		return 0, fmt.Errorf("relay: %w", err)
	}
	r.relayed.Add(float64(n))
	return n, nil
}
