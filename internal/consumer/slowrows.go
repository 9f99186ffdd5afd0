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
//
// A suspect is an order of a batch whose statement timed out with no time
// left to try its orders alone (a lease under about three statement
// timeouts leaves less than one after the cut): one of them is slow, which
// is not known. Suspects are tried alone too, before the rows known to be
// slow, so the good ones close and the slow one is found (and then known):
// without that, the same batch timed out round after round and none of its
// orders ever closed.
type slowRows struct {
	mu sync.Mutex
	m  map[string]slowRow
}

type slowRow struct {
	until   time.Time // remembered until
	suspect bool      // in a batch that timed out; not known to be slow itself
}

// rowKind is what slowRows knows of an order.
type rowKind uint8

const (
	rowUnknown rowKind = iota
	rowSuspect
	rowSlow
)

// mark records that serial's close cost a timeout at now and reports
// whether it was not known then (a new offender). When the set is full
// and nothing in it has expired, serial is not recorded.
func (s *slowRows) mark(serial string, now time.Time) (first bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.m[serial]
	first = !ok || r.suspect || !now.Before(r.until)
	if s.room(serial, now) {
		s.m[serial] = slowRow{until: now.Add(slowRowMemory)}
	}
	return first
}

// suspect records serials as suspects (see slowRows); those already
// remembered are left as they are.
func (s *slowRows) suspect(serials []string, now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, sn := range serials {
		if r, ok := s.m[sn]; ok && now.Before(r.until) {
			continue
		}
		if !s.room(sn, now) {
			return
		}
		s.m[sn] = slowRow{until: now.Add(slowRowMemory), suspect: true}
	}
}

// room reports whether serial may be recorded: it is already, or the set
// has room once what expired is dropped. s.mu is held.
func (s *slowRows) room(serial string, now time.Time) bool {
	if s.m == nil {
		s.m = map[string]slowRow{}
	}
	if _, ok := s.m[serial]; ok || len(s.m) < maxSkipped {
		return true
	}
	for k, r := range s.m {
		if !now.Before(r.until) {
			delete(s.m, k)
		}
	}
	return len(s.m) < maxSkipped
}

// known reports whether serial's close cost a timeout within slowRowMemory.
func (s *slowRows) known(serial string, now time.Time) bool {
	return s.kind(serial, now) == rowSlow
}

// kind reports what is remembered of serial at now.
func (s *slowRows) kind(serial string, now time.Time) rowKind {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch r, ok := s.m[serial]; {
	case !ok || !now.Before(r.until):
		return rowUnknown
	case r.suspect:
		return rowSuspect
	}
	return rowSlow
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
// to be slow or suspect (slowRows): those are closed after it, alone
// (closeSlowRows), suspects first,
// so one row that always times out is isolated for good once found,
// rather than cutting every batch it comes back in.
func (c *Consumer) closeBatch(workCtx, batchCtx context.Context, stmt time.Duration, items []item) {
	now := c.now()
	var rest, suspects, slow []item
	for _, it := range items {
		switch c.slow.kind(it.serial, now) {
		case rowSlow:
			slow = append(slow, it)
		case rowSuspect:
			suspects = append(suspects, it)
		default:
			rest = append(rest, it)
		}
	}
	if len(rest) > 0 {
		err := c.closeItems(workCtx, batchCtx, stmt, rest)
		if len(rest) == 1 && orders.Costly(err) {
			c.slow.mark(rest[0].serial, c.now())
		}
	}
	// Suspects first: most of them are good orders, and the one that is
	// slow is known once it has cost its timeout here, so it goes last
	// next time.
	c.closeSlowRows(workCtx, batchCtx, stmt, append(suspects, slow...))
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
	c.log.Warn("closing alone, after their batch, orders whose close (or whose batch's) timed out before", zap.Int("orders", len(items)))
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
