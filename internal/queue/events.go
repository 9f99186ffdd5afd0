package queue

import (
	"context"
	"time"

	"github.com/redis/go-redis/v9"
)

// CloseEvent is one close event, as the relay publishes it from the
// PostgreSQL outbox (orders.CloseEvent) to the events stream.
type CloseEvent struct {
	ID       int64 // the outbox row's id: the stream's event_id
	Serial   string
	Reason   string // "timeout" or "reconciled"
	ClosedAt time.Time
}

// AddCloseEvents appends events to the queue's events stream (Keys.Events),
// one XADD each, in one pipeline and in order, with the fields serial,
// reason, closed_at (RFC 3339, UTC, nanoseconds) and event_id. maxLen caps
// the stream approximately (XADD MAXLEN ~ maxLen); 0: no cap. It returns
// the first failed command's error, as Redis or the connection gave it.
// Redis runs every command of the pipeline, so events before and after a
// failed one may have been added: the relay publishes them all again on
// its next pass (at least once).
func (s *Store) AddCloseEvents(ctx context.Context, maxLen int64, events []CloseEvent) error {
	if len(events) == 0 {
		return nil
	}
	_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, e := range events {
			p.XAdd(ctx, &redis.XAddArgs{Stream: s.keys.Events, MaxLen: maxLen, Approx: true, Values: []any{
				"serial", e.Serial, "reason", e.Reason,
				"closed_at", e.ClosedAt.UTC().Format(time.RFC3339Nano), "event_id", e.ID,
			}})
		}
		return nil
	})
	return err
}
