package consumer

import (
	"context"

	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/queue"
)

// peek is the dry-run claim: it reads up to limit due entries it has not
// read before (a cursor on the deadline, plus the members already seen at
// the cursor's deadline) and leases nothing.
func (c *Consumer) peek(ctx context.Context, limit int) (claimResult, error) {
	if c.peekSeen == nil {
		c.peekFrom = 0
		c.peekSeen = map[string]struct{}{}
	}
	parsed, err := c.q.Peek(ctx, c.peekFrom, limit+len(c.peekSeen), c.cfg.CloseDelay)
	if err != nil {
		return claimResult{}, err
	}
	res := fromStore(parsed, "")
	fresh := res.items[:0]
	for _, it := range res.items {
		if _, seen := c.peekSeen[it.serial]; seen && it.deadline == c.peekFrom {
			continue
		}
		if it.deadline != c.peekFrom {
			c.peekFrom = it.deadline
			clear(c.peekSeen)
		}
		c.peekSeen[it.serial] = struct{}{}
		if err := queue.ValidateSerial(it.serial); err != nil || it.deadline < queue.MinDeadline {
			c.log.Info("dry run: would dead-letter", zap.String("serial", it.serial), zap.Int64("deadline", it.deadline))
			continue
		}
		fresh = append(fresh, it)
		if len(fresh) == limit {
			break
		}
	}
	res.items = fresh
	c.m.Inflight.Add(float64(len(res.items)))
	return res, nil
}

// head is the dry run's idle head check: the first entry after the peek
// cursor. A dry run leaves what it read in the queue, so the plain head is
// an entry already read; taking it for a new deadline would peek again on
// every head check. It is one command per check, as the plain one is.
func (h dryRunHandler) head(ctx context.Context) (int64, bool, error) {
	if h.c.peekSeen == nil {
		return h.c.q.Head(ctx, -1)
	}
	return h.c.q.Head(ctx, h.c.peekFrom)
}
