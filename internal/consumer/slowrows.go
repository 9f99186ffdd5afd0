package consumer

import (
	"context"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/orders"
)

// slowRowMemory is how long the fast path remembers an order whose close,
// alone, cost a timeout (orders.Costly): each new timeout renews it. A
// contended order is retried within BackoffMax (five minutes by default),
// so a row that stays bad stays known.
const slowRowMemory = 30 * time.Minute

// slowRows remembers the orders whose close cost a timeout when tried
// alone (a slow or locked row: a shop's trigger calling out, a hot row),
// so the next batch that claims one tries it alone, after the others,
// instead of letting it time out the batch's statement again, and so
// their timeouts are not taken for a slow database. Like the reconciler's
// skip set, it is bounded (maxSkipped) and per replica: another replica
// learns a row by paying its timeout once. Safe for concurrent use; the
// zero value is ready.
type slowRows struct {
	mu sync.Mutex
	m  map[string]time.Time // serial -> remembered until
}

// mark records that serial's close cost a timeout at now and reports
// whether it was not known then (a new offender). When the set is full
// and nothing in it has expired, serial is not recorded.
func (s *slowRows) mark(serial string, now time.Time) (first bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	until, ok := s.m[serial]
	first = !ok || !now.Before(until)
	if s.m == nil {
		s.m = map[string]time.Time{}
	}
	if !ok && len(s.m) >= maxSkipped {
		for k, u := range s.m {
			if !now.Before(u) {
				delete(s.m, k)
			}
		}
		if len(s.m) >= maxSkipped {
			return first
		}
	}
	s.m[serial] = now.Add(slowRowMemory)
	return first
}

// known reports whether serial's close cost a timeout within slowRowMemory.
func (s *slowRows) known(serial string, now time.Time) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	until, ok := s.m[serial]
	return ok && now.Before(until)
}

// forget drops serial: its close went through.
func (s *slowRows) forget(serial string) {
	s.mu.Lock()
	delete(s.m, serial)
	s.mu.Unlock()
}

func (s *slowRows) size() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.m)
}

// closeBatch closes a claimed batch (closeItems), except its orders known
// to be slow (slowRows): those are closed after it, alone (closeSlowRows),
// so one row that always times out is isolated for good once found,
// rather than cutting every batch it comes back in.
func (c *Consumer) closeBatch(workCtx, batchCtx context.Context, stmt time.Duration, items []item) {
	now := c.now()
	var rest, slow []item
	for _, it := range items {
		if c.slow.known(it.serial, now) {
			slow = append(slow, it)
		} else {
			rest = append(rest, it)
		}
	}
	if len(rest) > 0 {
		err := c.closeItems(workCtx, batchCtx, stmt, rest)
		if len(rest) == 1 && orders.Costly(err) {
			c.slow.mark(rest[0].serial, c.now())
		}
	}
	c.closeSlowRows(workCtx, batchCtx, stmt, slow)
}

// closeSlowRows closes orders known to be slow one statement each, at
// most maxCostly of them cutting a timeout per batch, each retried alone
// on the contended backoff when it fails again (failed); those it has no
// time or budget left for go back on that backoff untried. Their
// timeouts say nothing about the database: it is a row that is slow.
func (c *Consumer) closeSlowRows(workCtx, batchCtx context.Context, stmt time.Duration, items []item) {
	if len(items) == 0 {
		return
	}
	c.log.Warn("closing orders whose close timed out before alone, after their batch", zap.Int("orders", len(items)))
	costly := 0
	for i, it := range items {
		switch {
		case workCtx.Err() != nil:
			c.handBack(items[i:])
			return
		case costly >= maxCostly || !c.timeForAStatement(batchCtx):
			for _, r := range items[i:] {
				c.retry([]item{r}, c.contendedBackoff(r), false, "not tried: a row that timed out before, and the batch's budget ran out")
			}
			return
		}
		err := c.closeItems(workCtx, batchCtx, stmt, []item{it})
		switch {
		case err == nil:
			c.slow.forget(it.serial)
		case orders.Costly(err):
			costly++
			c.slow.mark(it.serial, c.now())
		case !orders.Contended(err) && orders.Transient(err):
			// The database went away: as in oneByOne.
			if workCtx.Err() == nil {
				c.retry(items[i+1:], c.entryBackoff(0), false, "not tried: the database went away")
			} else {
				c.handBack(items[i+1:])
			}
			return
		}
	}
}
