package consumer

import (
	"context"
	"errors"
	"iter"
	"math/rand/v2"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// process closes one claimed batch as processClaim does, its claim taken
// to have been sent now.
func (c *Consumer) process(workCtx context.Context, items []item) {
	c.processClaim(workCtx, items, time.Now())
}

// processClaim closes one claimed batch whose claim was sent at sent.
// workCtx is cancelled only when the drain timeout passes during shutdown.
// The batch runs under a deadline that ends before its lease does (see
// batchBudget), counted from sent — Redis ran the claim, and its lease
// began, after that — so the lease outlives the work however late the
// claim's reply came. A reply that came after the batch's whole time
// (Redis held its answers for most of the lease, or all of it: a stall)
// is not acted on, since another replica may hold those entries by now:
// the claim is handed back (a compare-and-set: what another replica took
// over, or a producer rewrote, stays theirs).
func (c *Consumer) processClaim(workCtx context.Context, items []item, sent time.Time) {
	defer c.m.Inflight.Sub(float64(len(items)))
	if workCtx.Err() != nil {
		// The drain's cut came first (a claim whose reply came after it,
		// or a batch that had not started): hand back on a deadline of
		// its own (handBackWith), before any bookkeeping call, whose
		// deadline ends soon after the cut, could fail and leave the
		// claim to its lease.
		c.handBack(items)
		return
	}
	batch, stmt := c.batchBudget()
	if late := time.Since(sent); late >= batch {
		c.log.Warn("a claim's reply came after its batch's time, too near the end of its lease (or past it) to act on; "+
			"handing the claim back. If this repeats, Redis answers more slowly than ORDERDELAY_LEASE allows for",
			zap.Int("orders", len(items)), zap.Duration("reply_after", late.Round(time.Millisecond)),
			zap.Duration("batch_time", batch), zap.Duration("lease", c.cfg.Lease))
		c.handBack(items)
		return
	}
	ctx, cancel := context.WithDeadline(workCtx, sent.Add(batch))
	defer cancel()
	c.h.process(workCtx, ctx, stmt, items)
}

// batchBudget returns how long a batch may run and how long the client
// waits for one statement. The server cuts a statement at StatementTimeout
// (the order pool sets it: orders.Open), so the client's own deadline is a backstop a
// little later: a timeout is the server's answer, never a cancel that
// leaves a commit in doubt. Both end before the lease does, with half the
// gap between StatementTimeout and Lease to spare for the bookkeeping.
func (c *Consumer) batchBudget() (batch, stmt time.Duration) {
	slack := (c.cfg.Lease - c.cfg.StatementTimeout) / 2
	if slack <= 0 {
		return c.cfg.StatementTimeout, c.cfg.StatementTimeout
	}
	return c.cfg.StatementTimeout + slack, c.cfg.StatementTimeout + slack/2
}

// dedupe keeps the first item of each serial: one statement never works on
// a serial twice, and each closed order is counted once. A claim leases a
// serial once, so a batch without repeats (the rule) comes back as it is,
// allocating nothing (queue.DistinctBy).
func dedupe(items []item) []item {
	return queue.DistinctBy(items, func(it item) string { return it.serial })
}

// closeItems closes what it can of items and settles the rest. An error
// about the data splits the batch in halves until the serial that causes it
// is alone, so good orders are not held back by a bad one. It returns the
// close or lookup statement's error, once handled (oneByOne counts them).
//
// The close (Store.Settle) answers for the orders it closed and, with the
// reference schema's statements, for those it found settled; what it cannot
// answer for (no row in its snapshot, a row changed while it ran, or —
// with custom statements — anything it did not close) is asked again with
// the lookup, after the commit, in a new snapshot: a pending row there was
// invisible to the close (its producer committed after the close began) and
// is retried without an attempt spent, never settled.
func (c *Consumer) closeItems(workCtx, batchCtx context.Context, stmt time.Duration, items []item) error {
	return c.closeItemsHeld(workCtx, batchCtx, stmt, items, nil)
}

// closeItemsHeld is closeItems; held, if not nil, collects the orders whose
// retry oneByOne issues itself, after the untried rest of its batch
// (failed).
func (c *Consumer) closeItemsHeld(workCtx, batchCtx context.Context, stmt time.Duration, items []item, held *heldRetries) error {
	ctx, cancel := context.WithTimeout(batchCtx, stmt)
	defer cancel()
	fence, dropped := c.fence(items)
	out, err := c.store.Settle(ctx, serialsOf(items), fence)
	if err != nil {
		c.m.Errors.WithLabelValues(metrics.StageClose).Inc()
		c.m.InDoubt.Add(float64(orders.InDoubt(err)))
		if workCtx.Err() == nil && ownDeadline(ctx, batchCtx) && batchCtx.Err() != nil && errors.As(err, new(*orders.BeginError)) {
			// The close had a deadline of its own, before the batch's,
			// and its BEGIN (which the driver cannot cut) answered only
			// after both: the database did not answer for a whole
			// statement's time — an outage or a stall, never a row cut by
			// the batch's running out while it isolated one. Not after the
			// drain's cut, which ends every batch's context: failed hands
			// the batch back then.
			c.unavailableAfter(workCtx, items, err, "close", true, held)
			return err
		}
		return c.failed(workCtx, batchCtx, stmt, items, err, "close", held)
	}
	c.m.SetUp(metrics.DepPostgres, true)
	c.pgBackReset()
	committed := c.now()
	answer := answers.Get().(map[string]bool) // true: closed
	defer func() { clear(answer); answers.Put(answer) }()
	for _, s := range out.Closed {
		answer[s] = true
	}
	for _, s := range out.Settled {
		answer[s] = false
	}
	// done ends with the settled appended: sized for the batch once, not
	// grown by doubling per batch (most of a batch closes).
	done := make([]item, 0, len(items))
	var settled, rest, gone []item
	for _, it := range items {
		closed, known := answer[it.serial]
		if _, ok := dropped[it.serial]; ok && !known {
			gone = append(gone, it)
			continue
		}
		switch {
		case closed:
			done = append(done, it)
		case known:
			settled = append(settled, it)
		default:
			rest = append(rest, it)
		}
	}
	if len(gone) > 0 {
		// No longer this claim's: another replica or the producer's new
		// entry has it. finish is a compare-and-set on the lease, so it
		// only drops what is still ours, never the producer's entry.
		c.log.Info("left orders a producer or another replica took over since the claim", zap.Int("orders", len(gone)))
		c.finish(gone)
	}
	c.h.closed(done, out.Closed, committed)
	nSettled := len(settled)
	done = append(done, settled...) // paid or closed already: settled

	var missing int
	if len(rest) > 0 {
		lctx, lcancel := context.WithTimeout(batchCtx, stmt)
		found, err := c.store.Lookup(lctx, serialsOf(rest))
		lcancel()
		if err != nil {
			c.m.Errors.WithLabelValues(metrics.StageLookup).Inc()
			c.m.Skipped.WithLabelValues(metrics.SkipSettled).Add(float64(nSettled))
			c.finish(done)
			return c.failed(workCtx, batchCtx, stmt, rest, err, "lookup", held)
		}
		state := make(map[string]bool, len(found))
		for _, f := range found {
			state[f.Serial] = f.Pending
		}
		var notFound, pending []item
		for _, it := range rest {
			switch p, ok := state[it.serial]; {
			case !ok:
				notFound = append(notFound, it)
			case p:
				pending = append(pending, it)
			default:
				done = append(done, it) // paid or closed already: settled
				nSettled++
			}
		}
		missing = len(notFound)
		c.stillPending(pending)
		c.notFound(notFound)
	}
	c.m.Skipped.WithLabelValues(metrics.SkipSettled).Add(float64(nSettled))
	c.m.Skipped.WithLabelValues(metrics.SkipNotFound).Add(float64(missing))
	c.finish(done)
	c.log.Debug("batch done", zap.Int("claimed", len(items)), zap.Int("closed", len(out.Closed)),
		zap.Int("settled", nSettled), zap.Strings("closed_serials", out.Closed))
	return nil
}

// answers keeps closeItemsHeld's maps of a batch's outcomes: cleared and
// reused, they cost no allocation per batch.
var answers = sync.Pool{New: func() any { return map[string]bool{} }}

// fence returns the check a close runs before it commits (handler.fence).
func (c *Consumer) fence(items []item) (orders.Fence, map[string]struct{}) { return c.h.fence(items) }

// fence returns the check a close runs before it commits (queue.Store.Fence):
// which of the serials it closed are no longer this claim's. Serials it
// drops are recorded in the returned set.
func (h orderHandler) fence(items []item) (orders.Fence, map[string]struct{}) {
	c := h.c
	dropped := map[string]struct{}{}
	// A batch no script has changed since its claim is fenced without its
	// records read back (queue.Store.FenceBatch), for serials its claim
	// leased: what the reference schema's one statement returns (it
	// refuses a row it was not asked about). A custom close statement
	// might return others, so its serials get the full check.
	trusted := false
	if o, ok := c.store.(interface{ OneStatement() bool }); ok {
		trusted = o.OneStatement()
	}
	claimedOf := func(it item) int {
		if trusted {
			return it.claimed
		}
		return 0
	}
	// A batch is one claim's, under one token (splits keep it); only
	// items from several claims need the map of serial to claim.
	var claims map[string]item
	if _, one := oneToken(items); !one {
		claims = make(map[string]item, len(items))
		for _, it := range items {
			claims[it.serial] = it
		}
	}
	return func(ctx context.Context, closed []string) ([]string, error) {
		var drop []string
		if claims == nil {
			got, err := c.q.FenceBatch(ctx, items[0].token, claimedOf(items[0]), c.cfg.CloseDelay, closed)
			if err != nil {
				return nil, err
			}
			drop = got
		} else {
			byClaim := map[item][]string{} // by token and claim size
			for _, s := range closed {
				it := claims[s]
				key := item{token: it.token, claimed: claimedOf(it)}
				byClaim[key] = append(byClaim[key], s)
			}
			for key, serials := range byClaim {
				got, err := c.q.FenceBatch(ctx, key.token, key.claimed, c.cfg.CloseDelay, serials)
				if err != nil {
					return nil, err
				}
				drop = append(drop, got...)
			}
		}
		more, err := c.fenceFamily(ctx, closed, drop)
		if err != nil {
			return nil, err
		}
		drop = append(drop, more...)
		for _, s := range drop {
			dropped[s] = struct{}{}
		}
		return drop, nil
	}, dropped
}

// fenceFamily returns the serials among closed (less those in drop) that
// a producer wrote with a later deadline into another key of the logical
// queue: the queue key for a shard's consumer, a serial's shard for the
// queue key's. Each key is asked on its own (keys of different shards lie
// in different slots); the rows stay locked meanwhile, so no atomicity
// across keys is needed.
func (c *Consumer) fenceFamily(ctx context.Context, closed, drop []string) ([]string, error) {
	fam := c.cfg.Family
	if len(fam) < 2 {
		return nil, nil
	}
	skip := make(map[string]struct{}, len(drop))
	for _, s := range drop {
		skip[s] = struct{}{}
	}
	byKey := map[queue.Keys][]string{}
	for _, s := range closed {
		if _, ok := skip[s]; ok {
			continue
		}
		for _, k := range []queue.Keys{fam[0], fam[1+queue.ShardOf(s, len(fam)-1)]} {
			if k.Queue != c.cfg.Keys.Queue {
				byKey[k] = append(byKey[k], s)
			}
		}
	}
	var out []string
	seen := map[string]struct{}{}
	for k, serials := range byKey {
		got, err := queue.NewStore(c.rdb, k).Later(ctx, c.cfg.CloseDelay, serials)
		if err != nil {
			return nil, err
		}
		for _, s := range got {
			if _, ok := seen[s]; !ok {
				seen[s] = struct{}{}
				out = append(out, s)
			}
		}
	}
	return out, nil
}

// stillPending retries orders whose row was pending after the close left it
// alone: the producer committed after the close's snapshot (it enqueued
// before its own commit). They are retried soon, spending no attempt;
// they are never "settled".
func (c *Consumer) stillPending(items []item) {
	byAttempts := map[int][]item{}
	for _, it := range items {
		byAttempts[it.attempts] = append(byAttempts[it.attempts], it)
	}
	for a, group := range byAttempts {
		c.retry(group, c.entryBackoff(min(a, 1)), false, "row still pending after the close (committed after it began)")
	}
}

// failed handles a batch whose statement failed, and returns err, as a
// rowSessionError when it took err for one of these orders' (a close that
// ends its own session). held is oneByOne's (nil elsewhere): an order it
// tried alone that may close later is recorded there instead of retried
// at once, so that it comes due after the batch's untried rest.
func (c *Consumer) failed(workCtx, batchCtx context.Context, stmt time.Duration, items []item, err error, stage string, held *heldRetries) error {
	var fenceErr *orders.FenceError
	// A statement the client cut at its own deadline (not the batch's)
	// while the server ran it is taken for a statement timeout: under
	// load BEGIN can use up the gap between the server's timeout and the
	// client's deadline, counted from before BEGIN (slowStatement).
	slow := c.slowStatement(batchCtx, err)
	switch {
	case workCtx.Err() != nil:
		// Shutdown ran out of drain time: nothing was committed that the
		// SQL guard would not make harmless; give the claims back.
		c.handBack(items)
	case (orders.Contended(err) || slow) && len(items) > 1 && batchCtx.Err() == nil:
		// A row stayed locked past lock_timeout, a shop's trigger failed a
		// serialization check or deadlocked on one order, or one slow row
		// ran the statement past its timeout: transient, but possibly one
		// row's, so find it rather than hold the rest of the batch back
		// with it. No attempt is spent.
		c.log.Warn("a transient error that one row can cause; closing the batch order by order to isolate it",
			zap.String("stage", stage), zap.Int("orders", len(items)), zap.Error(err))
		c.oneByOne(workCtx, batchCtx, stmt, items)
	case orders.Contended(err) || slow:
		// Alone now (or out of time): back off and try again, spending no
		// attempt. A lock or a conflict is someone else's transaction,
		// never this order's fault; and a lock held by a stalled replica
		// that has already closed the order must not end in a dead letter
		// (its session is cut after idle_in_transaction_session_timeout,
		// see orders.PoolOptions). A statement timeout of one order is
		// taken for a slow row, not a slow database: the database is
		// taken to be slow when two orders of a batch time out alone
		// (oneByOne).
		c.log.Warn("this order's row is locked, in conflict or slow to close; retrying it alone",
			zap.String("serial", items[0].serial), zap.Error(err))
		if held != nil {
			held.add(c, items, c.contendedBackoff(items[0]), err.Error())
			return err
		}
		c.retry(items, c.contendedBackoff(items[0]), false, err.Error())
	case batchCtx.Err() != nil && (errors.As(err, &fenceErr) || orders.Transient(err)):
		// The batch's own time ran out while it isolated a row (a half
		// of a split, an order of oneByOne; a whole batch's statement
		// ends by its shorter statement deadline first): the client cut
		// the statement, or database/sql rolled the transaction back when
		// the batch's context ended (sql.ErrTxDone). That says nothing
		// about the database, which answered the statements before it:
		// no dependency backoff, no "down". These orders are part of a
		// group a row of which failed, so they come back after the
		// untried rest of the batch (split), which then closes without
		// them. Or, on a whole batch as on a part, the queue's check
		// before the commit answered only after the batch's deadline
		// (a FenceError: Redis was slow, go-redis does not cut its read
		// at the deadline): nothing committed, and no row was being
		// isolated, so the log says that instead.
		why := "the batch's time ran out isolating a row"
		if fenceErr != nil {
			why = "the batch's time ran out waiting for the queue's check before the commit (the fence); nothing committed"
		}
		c.log.Info(why+"; retrying these orders", zap.String("stage", stage),
			zap.Int("orders", len(items)), zap.Error(err))
		if held != nil {
			held.add(c, items, c.entryBackoff(1), "not finished: "+why)
			return err
		}
		c.retry(items, c.entryBackoff(1), false, "not finished: "+why)
	case errors.As(err, new(*orders.SessionEndedError)) && c.databaseAnswers(batchCtx, stmt):
		// The close's own session ended under it, yet the database
		// answers a fresh connection at once: not an outage (that fails
		// the ping too, and is the case below) but, as far as anyone can
		// tell, one of these orders whose close ends its backend (a
		// shop's trigger or extension that terminates it; one that
		// crashes the server fails the ping: an outage for everyone).
		// Retried whole, it would hold its batch mates back with it on
		// every claim, so it is isolated like a row's error: in halves,
		// down to the order, which alone is retried with no attempt
		// spent (sessionEnder: a session ended from outside looks the
		// same).
		if len(items) > 1 {
			c.log.Warn("the statement's database session ended while the database answers; splitting the batch to isolate the order that ends it",
				zap.String("stage", stage), zap.Int("orders", len(items)), zap.Error(err))
			c.split(workCtx, batchCtx, stmt, items)
		} else {
			c.sessionEnder(items[0], err, stage, held)
		}
		return rowSessionError{err}
	case errors.As(err, &fenceErr) || orders.Transient(err):
		// A fence error is the queue's, not PostgreSQL's; one that is
		// Redis refusing the fence's script (an ACL changed) is logged
		// as that, once (refused). A database error is never asked.
		refused := fenceErr != nil && c.refused(fenceErr.Err, stage)
		c.unavailable(workCtx, items, err, stage, fenceErr == nil, refused)
	case len(items) > 1:
		c.log.Warn("statement failed; splitting the batch to isolate the cause", zap.String("stage", stage),
			zap.Int("orders", len(items)), zap.Error(err))
		c.split(workCtx, batchCtx, stmt, items)
	default:
		c.log.Error("statement fails for this order; dead-lettering it", zap.String("stage", stage),
			zap.String("serial", items[0].serial), zap.Error(err))
		c.bury(items, queue.ReasonCloseFailed, err.Error())
	}
	return err
}

// rowSessionError is a statement's error that failed took for one of its
// orders': the close's session ended while the database answered.
type rowSessionError struct{ error }

func (e rowSessionError) Unwrap() error { return e.error }

// databaseAnswers reports whether the database answers a statement on a
// connection of the pool within the statement timeout, the batch's time
// not yet out (a Store without Ping never does).
func (c *Consumer) databaseAnswers(batchCtx context.Context, stmt time.Duration) bool {
	p, ok := c.store.(interface{ Ping(context.Context) error })
	if !ok || batchCtx.Err() != nil {
		return false
	}
	ctx, cancel := context.WithTimeout(batchCtx, stmt)
	defer cancel()
	return p.Ping(ctx) == nil
}

// sessionEnder retries an order whose close, alone, ended its database
// session while the database answered (failed), alone and with no attempt
// spent, like a contended row: nothing tells an order whose close ends
// its backend from a session something else ended (an operator's or a
// pooler's watchdog cutting slow statements, a load balancer cutting
// connections), so it is never dead-lettered for it. A truly poisonous
// order stays overdue, logged at each try, and never holds its batch
// mates back.
func (c *Consumer) sessionEnder(it item, err error, stage string, held *heldRetries) {
	c.log.Warn("closing this order ended its database session while the database answers; retrying it alone",
		zap.String("stage", stage), zap.String("serial", it.serial), zap.Error(err))
	why := "its close ended its database session while the database answered: " + err.Error()
	if held != nil {
		held.add(c, []item{it}, c.contendedBackoff(it), why)
		return
	}
	c.retry([]item{it}, c.contendedBackoff(it), false, why)
}

// unavailable retries items after the database (or, for a fence error, the
// queue) could not do the work: no attempt spent, and this worker holds
// back for the dependency backoff so errors per second stay bounded while
// it is away; shutdown cuts the wait. down marks PostgreSQL down; logged
// says err was logged already (the fence's refusal: refused), so no
// warning repeats it.
func (c *Consumer) unavailable(workCtx context.Context, items []item, err error, stage string, down, logged bool) {
	c.unavailableFrom(workCtx, items, err, stage, down, logged, nil, 0)
}

// unavailableAfter is unavailable for a database error (PostgreSQL marked
// down when down); items come due in the order given (retryInOrder), and
// the orders in held after them, before the wait.
func (c *Consumer) unavailableAfter(workCtx context.Context, items []item, err error, stage string, down bool, held *heldRetries) {
	c.unavailableFrom(workCtx, items, err, stage, down, false, held, 0)
}

// unavailableFrom is unavailable and unavailableAfter; with notBefore
// above zero, items come due no earlier than just after notBefore (the
// tasks a batch never tried, retried just before with that delay:
// retryNoAttempt). The wait is the dependency backoff either way.
func (c *Consumer) unavailableFrom(workCtx context.Context, items []item, err error, stage string, down, logged bool, held *heldRetries, notBefore time.Duration) {
	if down {
		c.m.SetUp(metrics.DepPostgres, false)
	}
	d := c.pgBackoff()
	rd := d
	if notBefore > 0 {
		rd = max(d, notBefore+time.Millisecond)
	}
	if !logged {
		c.log.Warn("database or queue unavailable; batch will be retried", zap.String("stage", stage),
			zap.Int("orders", len(items)), zap.Duration("retry_in", rd), zap.Error(err))
	}
	if held == nil {
		c.retry(items, rd, false, err.Error())
	} else {
		held.flush(c, c.retryInOrder(items, rd, err.Error()))
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-c.stopping:
	case <-workCtx.Done():
	}
}

// maxCostly is how many errors that cost a timeout (orders.Costly) one
// batch spends isolating rows before it gives the rest back
// (orders.MaxCostly).
const maxCostly = orders.MaxCostly

// oneByOne closes items one order per transaction, after their batch
// failed with an error one row can cause (orders.Contended): every order
// that can close does, and only the rows that cause the error are held
// back (retried alone, no attempt spent). One order per statement finds a
// slow or locked row for the price of one timeout, where halving the batch
// would pay one per level. Errors that cost a timeout are bounded: after
// maxCostly of them, or when the batch's time runs out, the rest goes back
// untried; and if those were all statement timeouts, the database itself
// is taken to be slow, as for an outage.
//
// Every round makes progress without remembering any order: it tries
// orders for as long as the batch has time (the batch's own statement
// may have left less than a statement timeout: an order that closes
// takes milliseconds, and one the batch's deadline cuts is simply not
// finished), and what it sends back comes due in this order — the
// untried rest first, in the order it came in (retryInOrder), then the
// orders it tried alone and could not close (heldRetries), each no later
// than its own retry delay would have made it unless that fell before the
// rest. A claim that takes them again in one batch (a backlog) therefore
// meets, one by one, the orders this round never reached before those
// that stopped it, instead of the same rows first every round.
func (c *Consumer) oneByOne(workCtx, batchCtx context.Context, stmt time.Duration, items []item) {
	costly, timeouts := 0, 0
	var last error
	var held heldRetries
	for i, it := range items {
		rest := items[i:]
		switch {
		case workCtx.Err() != nil:
			c.handBack(rest)
			held.flush(c, 0)
			return
		case timeouts >= maxCostly:
			c.unavailableAfter(workCtx, rest, last, "close", true, &held)
			return
		case costly >= maxCostly || batchCtx.Err() != nil:
			held.flush(c, c.retryInOrder(rest, c.untriedBackoff(), "not tried: the batch's time ran out isolating a row"))
			return
		}
		err := c.closeItemsHeld(workCtx, batchCtx, stmt, []item{it}, &held)
		slow := c.slowStatement(batchCtx, err)
		switch {
		case orders.Costly(err) || slow:
			costly++
			last = err
			if orders.TimedOut(err) || slow {
				timeouts++
			}
		case err != nil && batchCtx.Err() != nil:
			// The batch's deadline cut it (failed held it): the rest
			// goes back untried, above.
		case errors.As(err, new(rowSessionError)):
			// Its close ended its own session, the database up: that
			// order's, retried alone (failed); the rest goes on.
		case err != nil && !orders.Contended(err) && orders.Transient(err):
			// The database (or the queue) went away: that order was
			// retried after the dependency backoff; the rest goes back
			// untried rather than fail one by one.
			if workCtx.Err() == nil {
				c.retry(items[i+1:], c.entryBackoff(0), false, "not tried: the database went away isolating a row")
			} else {
				c.handBack(items[i+1:])
			}
			held.flush(c, 0)
			return
		}
	}
	held.flush(c, 0)
}

// ownDeadline reports whether ctx, made from batchCtx, ends before the
// batch does: the statement had its own deadline, not the rest of the
// batch's time.
func ownDeadline(ctx, batchCtx context.Context) bool {
	d, _ := ctx.Deadline()
	b, ok := batchCtx.Deadline()
	return !ok || d.Before(b)
}

// slowStatement reports a statement cut by the client at its own deadline
// while the server ran it (orders.CutWhileRunning), the batch's time not
// yet out: it counts as a statement timeout. One the batch's deadline cut
// is only "not finished".
func (c *Consumer) slowStatement(batchCtx context.Context, err error) bool {
	return batchCtx.Err() == nil && orders.CutWhileRunning(err)
}

// untriedBackoff is the delay before orders a batch never got to try come
// due again: a quarter to half of retryBase, below every delay of an
// order that was tried (contendedBackoff, entryBackoff), so they come
// first when a claim takes both.
func (c *Consumer) untriedBackoff() time.Duration {
	return retryBase/4 + rand.N(retryBase/4)
}

// maxRetryRuns bounds the retries one retryInOrder issues.
const maxRetryRuns = 8

// retryInOrder retries items (no attempt spent) so that they come due in
// the order given, starting after delay, and returns the delay after
// which the last of them is due. A retry makes its entries due at one
// time, and a claim takes entries due at one time in serial order; so the
// items go in runs of ascending serials, each one millisecond after the
// one before (at most maxRetryRuns: the last run takes the rest, in serial
// order). A claim's batch is such runs already (one per retry or deadline
// it holds), so that costs a few scripts, on this path only.
func (c *Consumer) retryInOrder(items []item, delay time.Duration, reason string) time.Duration {
	start, runs := 0, 0
	for i := 1; i <= len(items); i++ {
		if i < len(items) && (items[i].serial > items[i-1].serial || runs == maxRetryRuns-1) {
			continue
		}
		c.retry(items[start:i], delay+time.Duration(runs)*time.Millisecond, false, reason)
		start = i
		runs++
	}
	return delay + time.Duration(runs)*time.Millisecond
}

// heldRetries are the orders oneByOne tried alone and could not close for
// a reason that may pass (a contended or slow row, a statement its
// batch's deadline cut), each with the time its retry would have been due
// had it been retried at once (failed). They are retried after the
// batch's untried rest (flush), so they come due after it.
type heldRetries []heldRetry

type heldRetry struct {
	items  []item
	due    time.Time
	reason string
}

func (h *heldRetries) add(c *Consumer, items []item, delay time.Duration, reason string) {
	*h = append(*h, heldRetry{items: items, due: c.now().Add(delay), reason: reason})
}

// flush retries the held orders, each due when its own delay made it but
// not before after (the delay of the untried rest retried just before).
func (h *heldRetries) flush(c *Consumer, after time.Duration) {
	now := c.now()
	for _, r := range *h {
		c.retry(r.items, max(r.due.Sub(now), after+time.Millisecond), false, r.reason)
	}
	*h = nil
}

// contendedBackoff is the delay before an order whose row was locked, in
// conflict or slow is tried again. It spends no attempt, so it cannot grow
// with attempts: it grows with how overdue the order is instead (half of
// it, from retryBase up to BackoffMax, with jitter down to half), so a
// brief lock is retried at once and a row that stays bad costs little.
func (c *Consumer) contendedBackoff(it item) time.Duration {
	d := min(max(c.now().Sub(time.UnixMilli(it.deadline))/2, retryBase), c.cfg.BackoffMax)
	return d/2 + rand.N(d/2+1)
}

// split closes the two halves of items one after the other. If the batch's
// budget ran out on the first half, the second goes back to the queue
// untried (no attempt spent) rather than fail on a spent deadline: soon
// if the first half's own data error says the row that failed items may
// be there, later if the first half closed or was cut (the row is then in
// the second half, or not yet placed): the next claims then take the
// untried parts of the batch without the group that holds the failing
// row, so every round closes something even when a loaded database lets
// a batch's budget hold only a few statements.
func (c *Consumer) split(workCtx, batchCtx context.Context, stmt time.Duration, items []item) {
	half := len(items) / 2
	err := c.closeItems(workCtx, batchCtx, stmt, items[:half])
	if batchCtx.Err() != nil && workCtx.Err() == nil {
		delay := c.entryBackoff(1)
		if err != nil && (!orders.Transient(err) || errors.As(err, new(rowSessionError))) {
			delay = c.entryBackoff(0)
		}
		c.retry(items[half:], delay, false, "not tried: the batch's time ran out isolating an order")
		return
	}
	c.closeItems(workCtx, batchCtx, stmt, items[half:])
}

// notFound backs off orders that have no row yet (the producer may have
// enqueued before its own commit), and dead-letters them after MaxAttempts.
func (c *Consumer) notFound(items []item) {
	byAttempts := map[int][]item{}
	var give []item
	for _, it := range items {
		if it.attempts+1 >= c.cfg.MaxAttempts {
			give = append(give, it)
		} else {
			byAttempts[it.attempts] = append(byAttempts[it.attempts], it)
		}
	}
	for a, group := range byAttempts {
		c.retry(group, c.entryBackoff(a), true, "no order row")
	}
	if len(give) > 0 {
		c.bury(give, queue.ReasonNotFound, "no order row")
	}
}

// entryBackoff is the delay before retry number attempts+1: retryBase
// doubled per attempt, capped at BackoffMax, with jitter down to half.
func (c *Consumer) entryBackoff(attempts int) time.Duration {
	d := c.cfg.BackoffMax
	if attempts < 30 {
		d = min(retryBase<<attempts, c.cfg.BackoffMax)
	}
	return d/2 + rand.N(d/2+1)
}

func (c *Consumer) pgBackoff() time.Duration {
	c.pgMu.Lock()
	defer c.pgMu.Unlock()
	return c.pgBack.NextBackOff()
}

func (c *Consumer) pgBackReset() {
	c.pgMu.Lock()
	c.pgBack.Reset()
	c.pgMu.Unlock()
}

// byToken groups items by the claim that leased them (a split batch keeps
// one token, but the scripts take one token per call), tokens in the order
// they first appear. A batch is one claim's: that group is the batch's
// serials, with no map to build.
func byToken(items []item) iter.Seq2[string, []string] {
	return func(yield func(string, []string) bool) {
		if tok, one := oneToken(items); one {
			yield(tok, serialsOf(items))
			return
		}
		g := map[string][]string{}
		var order []string
		for _, it := range items {
			if _, ok := g[it.token]; !ok {
				order = append(order, it.token)
			}
			g[it.token] = append(g[it.token], it.serial)
		}
		for _, tok := range order {
			if !yield(tok, g[tok]) {
				return
			}
		}
	}
}

// oneToken reports whether every item has the same lease token, and it.
func oneToken(items []item) (string, bool) {
	if len(items) == 0 {
		return "", false
	}
	for _, it := range items[1:] {
		if it.token != items[0].token {
			return "", false
		}
	}
	return items[0].token, true
}

func serialsOf(items []item) []string {
	out := make([]string, len(items))
	for i, it := range items {
		out[i] = it.serial
	}
	return out
}

// bookkeeping returns the context of one call recording a batch's
// outcome: BookkeepingTimeout, and never past BookkeepingTimeout after
// the drain's cut (Run). However many calls the batches still running
// make after the cut — a batch whose close committed just before Redis
// hung records its finish, retries and dead letters one after the other
// — they end by then, or at the read in flight then: once the deadline
// has passed, go-redis sends no command. The hand-back is the exception
// (handBackWith): it keeps a deadline of its own.
func (c *Consumer) bookkeeping() (context.Context, context.CancelFunc) {
	d := time.Now().Add(BookkeepingTimeout)
	if cut := c.bookEnd.Load(); cut != 0 && cut < d.UnixNano() {
		d = time.Unix(0, cut)
	}
	return context.WithDeadline(context.Background(), d)
}

// The lease bookkeeping after a batch: each is the handler's (a dry run
// changes nothing in Redis).

func (c *Consumer) finish(items []item) { c.h.finish(items) }

func (c *Consumer) retry(items []item, delay time.Duration, spend bool, reason string) {
	c.h.retry(items, delay, spend, reason)
}

func (c *Consumer) bury(items []item, reason, lastErr string) { c.h.bury(items, reason, lastErr) }

func (c *Consumer) handBack(items []item) { c.h.handBack(items) }

// finish removes settled entries (compare-and-set on the lease).
func (h orderHandler) finish(items []item) { h.finishLeases(items, false) }

// finishLeases is finish; payloads drops task payloads with the entries.
func (h orderHandler) finishLeases(items []item, payloads bool) {
	c := h.c
	if len(items) == 0 {
		return
	}
	ctx, cancel := c.bookkeeping()
	defer cancel()
	// By token: the entries its claim leased as one batch.
	claimed := map[string]int{items[0].token: items[0].claimed}
	if _, one := oneToken(items); !one {
		for _, it := range items {
			claimed[it.token] = it.claimed
		}
	}
	for tok, serials := range byToken(items) {
		var n int
		var err error
		if payloads {
			n, err = c.q.Finish(ctx, tok, serials, true)
		} else {
			// A batch no script has changed is finished without its
			// records read back (queue.Store.FinishBatch).
			n, err = c.q.FinishBatch(ctx, tok, claimed[tok], serials)
		}
		if err != nil {
			c.m.Errors.WithLabelValues(metrics.StageRemove).Inc()
			if !c.refused(err, metrics.StageRemove) {
				c.log.Warn("removing settled entries failed; they return when their lease expires and are settled then",
					zap.Int("orders", len(serials)), zap.Error(err))
			}
		} else if n < len(serials) {
			// The lease record went between the claim and now: a producer
			// rescheduled or cancelled the entry through the API or the
			// client (possibly after the fence, while the close
			// committed), or another replica took it over. Whatever entry
			// they wrote stays, and is settled when it comes due.
			c.log.Info("settled entries were no longer this claim's to remove; an entry a producer wrote meanwhile is settled when it comes due",
				zap.Int("orders", len(serials)-n))
		}
	}
}

// retry turns leases into backoffs due after delay.
func (h orderHandler) retry(items []item, delay time.Duration, spend bool, reason string) {
	c := h.c
	ctx, cancel := c.bookkeeping()
	defer cancel()
	for tok, serials := range byToken(items) {
		res, err := c.q.Retry(ctx, queue.RetryArgs{Token: tok, Serials: serials, Delay: delay, Spend: spend, LastError: reason})
		if err != nil {
			c.m.Errors.WithLabelValues(metrics.StageRemove).Inc()
			if !c.refused(err, metrics.StageRemove) {
				c.log.Warn("scheduling a retry failed; the entries return when their lease expires",
					zap.Int("orders", len(serials)), zap.Error(err))
			}
			continue
		}
		// Wake the scanner for the retry if it sleeps longer than that.
		// The time is on Redis's clock; wake-ups carry producer deadlines,
		// to which the scanner adds the close delay, so take it off here.
		select {
		case c.wake <- res.At - c.cfg.CloseDelay.Milliseconds():
		default:
		}
	}
}

// bury dead-letters items, adding the run that failed to their attempts.
func (h orderHandler) bury(items []item, reason, lastErr string) {
	c := h.c
	ctx, cancel := c.bookkeeping()
	defer cancel()
	for tok, serials := range byToken(items) {
		n, err := c.q.Bury(ctx, queue.BuryArgs{Token: tok, Serials: serials, Reason: reason, LastError: lastErr, CountRun: true})
		if err != nil {
			c.m.Errors.WithLabelValues(metrics.StageRemove).Inc()
			if !c.refused(err, metrics.StageRemove) {
				c.log.Warn("dead-lettering failed; the entries return when their lease expires",
					zap.Int("orders", len(serials)), zap.Error(err))
			}
			continue
		}
		c.m.DeadLettered.WithLabelValues(reason).Add(float64(n))
	}
}

// handBack returns claims to the queue with their true deadlines.
func (h orderHandler) handBack(items []item) { h.handBackWith(items, h.c.q.HandBack) }

// handBackWith hands items back with the store's call for it, one call
// per lease token.
func (h orderHandler) handBackWith(items []item, call func(ctx context.Context, token string, serials []string) (int, error)) {
	c := h.c
	if len(items) == 0 {
		return
	}
	// A hand-back has a deadline of its own, even past the drain's cut
	// (Run, step 3): a batch reaches it only after its database work,
	// which may itself outlast the cut's bookkeeping deadline (a COMMIT
	// whose answer was lost, asked about for commitStatusWait) while Redis
	// answers all along; its entries would otherwise wait out their lease.
	ctx, cancel := context.WithTimeout(context.Background(), BookkeepingTimeout)
	defer cancel()
	total := 0
	for tok, serials := range byToken(items) {
		n, err := call(ctx, tok, serials)
		if err != nil {
			c.m.Errors.WithLabelValues(metrics.StageRemove).Inc()
			if !c.refused(err, metrics.StageRemove) {
				c.log.Warn("hand-back failed; the entries return when their lease expires",
					zap.Int("orders", len(serials)), zap.Error(err))
			}
			continue
		}
		total += n
	}
	c.log.Info("handed back unfinished claims", zap.Int("orders", total))
}
