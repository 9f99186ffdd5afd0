package consumer

import (
	"context"
	"fmt"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/orders"
)

// Relay publishes close events from the outbox table to the Redis Stream
// {<queue key>}:events: each event is XADDed (serial, reason, closed_at,
// event_id) and then deleted from the outbox in the transaction that locked
// it. A crash between the XADD and the commit publishes the event again on
// the next pass: delivery is at least once, and consumers deduplicate by
// serial (or event_id). Replicas relay concurrently; SKIP LOCKED gives each
// its own rows.
type Relay struct {
	DB      *sqlx.DB
	Redis   redis.Cmdable
	Stream  string
	MaxLen  int64 // approximate cap of the stream (XADD MAXLEN ~)
	Log     *zap.Logger
	Relayed prometheus.Counter
}

// relayPage bounds one pass.
const relayPage = 500

// Run relays until ctx ends: at once while there is a backlog, every 250 ms
// otherwise.
func (r *Relay) Run(ctx context.Context) {
	for {
		n, err := r.RunOnce(ctx)
		if err != nil && ctx.Err() == nil {
			r.Log.Warn("close-event relay failed; retrying", zap.Error(err))
		}
		wait := 250 * time.Millisecond
		if n == relayPage {
			wait = 0
		} else if err != nil {
			wait = 2 * time.Second
		}
		if !sleepCtx(ctx, wait) {
			return
		}
	}
}

// RunOnce relays up to one page and returns how many events it published.
func (r *Relay) RunOnce(ctx context.Context) (int, error) {
	tx, err := r.DB.BeginTxx(ctx, nil)
	if err != nil {
		return 0, fmt.Errorf("relay: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // after Commit this is a no-op
	var rows []struct {
		ID       int64     `db:"id"`
		Serial   string    `db:"serial_no"`
		Reason   string    `db:"reason"`
		ClosedAt time.Time `db:"closed_at"`
	}
	err = tx.SelectContext(ctx, &rows, `SELECT id, serial_no, reason, closed_at FROM `+orders.OutboxTable+`
		ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED`, relayPage)
	if err != nil || len(rows) == 0 {
		return 0, err
	}
	ids := make([]int64, len(rows))
	_, err = r.Redis.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, row := range rows {
			ids[i] = row.ID
			p.XAdd(ctx, &redis.XAddArgs{Stream: r.Stream, MaxLen: r.MaxLen, Approx: true, Values: []any{
				"serial", row.Serial, "reason", row.Reason,
				"closed_at", row.ClosedAt.UTC().Format(time.RFC3339Nano), "event_id", row.ID,
			}})
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("relay: publish: %w", err)
	}
	if _, err := tx.ExecContext(ctx, "DELETE FROM "+orders.OutboxTable+" WHERE id = ANY($1)", pq.Array(ids)); err != nil {
		return 0, fmt.Errorf("relay: prune outbox: %w", err)
	}
	if err := tx.Commit(); err != nil {
		return 0, fmt.Errorf("relay: %w", err)
	}
	r.Relayed.Add(float64(len(rows)))
	return len(rows), nil
}
