package maintain

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Defaults of ReconcilerConfig.
const (
	DefaultReconcileInterval = time.Minute
	DefaultReconcileGrace    = 5 * time.Minute
	DefaultReconcilePage     = 500
	// DefaultReconcilePassTimeout bounds one pass (at most maxPagesPerRun
	// pages, each statement bounded by the server's statement_timeout too).
	DefaultReconcilePassTimeout = 5 * time.Minute
	// maxPagesPerRun bounds one pass, so a huge backlog is worked off over
	// several passes instead of one long transaction chain.
	maxPagesPerRun = 20
	// maxCostly is how many errors that cost a timeout (orders.Costly) one
	// page spends isolating rows before it leaves the rest for the next
	// pass: as many as the fast path's batch spends (orders.MaxCostly).
	maxCostly = orders.MaxCostly
)

// ReconcilerConfig configures a Reconciler. Zero values take the defaults.
type ReconcilerConfig struct {
	Keys queue.Keys
	// Shards are the logical queue's further keys (ORDERDELAY_QUEUE_SHARDS);
	// a serial in any of them is not missing.
	Shards   []queue.Keys
	Interval time.Duration // time between passes (jittered ±20%)
	Grace    time.Duration // how long past its deadline an order must be
	PageSize int           // orders per transaction
	// PassTimeout bounds one pass; what it did not reach waits for the next.
	PassTimeout time.Duration
	Outbox      bool // record a close event per reconciled order
}

// Reconciler closes pending orders that are past their deadline by more
// than the grace and missing from the queue: Redis lost them, or the
// checkout died between its commit and its ZADD. The orders table is the
// source of truth; this is the safety net under the fast path.
//
// One replica at a time does a page, under a transaction-level advisory lock
// derived from the queue key; rows are read with FOR UPDATE SKIP LOCKED so a
// payment in progress is never waited for, and serials still in Redis
// (queued, leased or backing off) are skipped, so a long backlog or a
// reschedule never triggers it; the page then lets go of their rows and
// keeps the lost ones locked (keepOnlyLost). If Redis cannot be asked, the
// pass is skipped: a rescheduled deadline lives only there.
//
// A pass pages by keyset, so orders still in Redis never hide the ones
// behind them, and an order whose close fails on its own data is isolated
// and skipped (closeIsolating), so one poisoned row never stops the rest.
type Reconciler struct {
	cfg   ReconcilerConfig
	loop  Loop
	rdb   redis.UniversalClient
	store *orders.Store
	m     *metrics.Metrics
	log   *zap.Logger
	lock  int64

	// afterClose, when set (tests only), runs after a page's close statement
	// and before the fence, with the serials it closed.
	afterClose func(closed []string)

	// skip holds the orders whose close cost a timeout (a row locked, a
	// slow row), each until a time that doubles with every failure, from
	// one Interval up to maxSkipIntervals: passes leave them out until
	// then, and try them last in their page, so a few such rows at the
	// head of the first page cannot take every pass's timeout budget and
	// keep the pass from the lost orders behind them. An entry goes when
	// its order closes, or maxSkipIntervals after it was last due.
	skip map[string]*skipEntry
	now  func() time.Time

	// resume is where the next pass starts: after the last row the pass
	// before read, when that pass stopped at maxPagesPerRun pages or on
	// an error; the beginning once a pass read to the end. failedAt is the
	// page the pass before failed on, if it did (see failed).
	resume   orders.Cursor
	failedAt *orders.Cursor
	// narrow, when set, is a page that failed twice being read again in
	// smaller pages, down to the row that fails it (see failed).
	narrow *narrowing
}

// narrowing: left rows of a page that failed twice are still to be read
// again, in pages of size rows.
type narrowing struct{ left, size int }

// skipEntry is one order the reconciler leaves out for a while.
type skipEntry struct {
	until    time.Time
	failures int
}

const (
	maxSkipIntervals = 16
	// maxSkipped bounds the skip set; beyond it, failing orders are not
	// remembered (and cost their timeout again next pass).
	maxSkipped = 10000
)

// NewReconciler returns a Reconciler.
func NewReconciler(cfg ReconcilerConfig, rdb redis.UniversalClient, store *orders.Store, m *metrics.Metrics, log *zap.Logger) *Reconciler {
	cfg.Interval = orDefault(cfg.Interval, DefaultReconcileInterval)
	cfg.Grace = orDefault(cfg.Grace, DefaultReconcileGrace)
	cfg.PageSize = orDefault(cfg.PageSize, DefaultReconcilePage)
	cfg.PassTimeout = orDefault(cfg.PassTimeout, DefaultReconcilePassTimeout)
	h := fnv.New64a()
	h.Write([]byte("orderdelay reconcile " + cfg.Keys.Queue))
	r := &Reconciler{cfg: cfg, rdb: rdb, store: store, m: m, log: log, lock: int64(h.Sum64()), now: time.Now}
	r.loop = Loop{Interval: cfg.Interval, Spread: 5, PassTimeout: cfg.PassTimeout, WaitFirst: true,
		Failed: func(err error) {
			r.m.Errors.WithLabelValues(metrics.StageReconcile).Inc()
			r.log.Warn("reconcile pass failed", zap.Error(err))
		}}
	return r
}

// Run reconciles every Interval (±20%), the first time an Interval after
// it starts, until ctx ends; then it returns nil.
func (r *Reconciler) Run(ctx context.Context) error {
	return r.loop.Run(ctx, func(ctx context.Context) (bool, error) {
		n, err := r.RunOnce(ctx)
		// What a pass that failed closed is not reported, unless the run
		// ended (the loop reports the failure, and only while it runs).
		if n > 0 && (err == nil || ctx.Err() != nil) {
			r.log.Warn("reconciler closed orders the queue had lost", zap.Int("orders", n))
		}
		return false, err
	})
}

// RunOnce does one pass and returns how many orders it closed. A pass walks
// the overdue orders by keyset, in (deadline, serial) order, each page
// starting after the last row of the one before, so overdue orders that are
// legitimately still in Redis (a backlog, a reschedule that did not move the
// row's deadline) never hide the lost ones behind them. At most
// maxPagesPerRun pages, within PassTimeout. A pass that stops before the
// end (its pages used up, or an error) leaves the next one to go on from
// the page it had reached, so however many overdue rows stay pending ahead
// of a lost order (queued ones, poisonous ones dead-lettered by the fast
// path), the walk reaches it; a pass that reads to the end leaves the next
// to start from the beginning. An order that is lost behind where the walk
// has reached is found when the walk comes round again: within one pass
// when the overdue rows fill at most maxPagesPerRun pages.
func (r *Reconciler) RunOnce(ctx context.Context) (int, error) {
	ctx, cancel := r.loop.Bound(ctx)
	defer cancel()
	if r.skip == nil {
		r.skip = map[string]*skipEntry{}
	}
	now := r.now()
	for sn, e := range r.skip {
		if now.Sub(e.until) > maxSkipIntervals*r.cfg.Interval {
			delete(r.skip, sn) // no longer failing here: closed elsewhere, paid, or back in Redis
		}
	}
	total := 0
	cur := r.resume
	q := queue.NewStore(r.rdb, r.cfg.Keys)
	for range maxPagesPerRun {
		// A pause means nobody is closed (the payment provider is down,
		// say): the safety net waits too, from the next page on when it
		// is set while the pass runs.
		if paused, err := q.Paused(ctx); err != nil || paused {
			r.resume = cur
			if err != nil {
				return total, fmt.Errorf("reconcile: %w", err)
			}
			return total, nil
		}
		size := r.cfg.PageSize
		if r.narrow != nil {
			size = r.narrow.size
		}
		n, next, more, err := r.page(ctx, cur, size)
		total += n
		if errors.Is(err, errOtherReplica) {
			r.resume = cur // its pass goes on where this one stopped
			return total, nil
		}
		if err != nil {
			r.failed(cur, next, size)
			return total, err
		}
		r.failedAt = nil
		if r.narrow != nil {
			if r.narrow.left -= size; r.narrow.left <= 0 || !more {
				r.narrow = nil // past the page that failed: full pages again
			}
		}
		if !more {
			r.resume = orders.Cursor{}
			return total, nil
		}
		cur = next
	}
	r.resume = cur
	return total, nil
}

// failed sets where the next pass starts after the page at cur, of size
// rows, failed (next: after its rows, or cur when it failed before reading
// them). The first time, the next pass tries that page again, isolating
// as a row's any error the server answers (pageState.suspect): an order
// whose close raises an error taken for the database's is then skipped
// alone. A page that still fails holds a row whose close fails in a way
// no page can isolate (one that ends its own session): its rows are read
// again in pages halved at each failure (narrowing), so its other orders
// close, down to the one row, which is passed by and comes round with the
// walk, full pages resuming after it (a second such row on the page fails
// a full page twice and is narrowed down to in turn). A page that failed
// before its rows were known (a custom overdue
// statement failing on a row) starts the walk again from the beginning,
// so the pages before it still get their passes — the rows behind such a
// row wait until the statement is mended (every pass logs the error and
// counts it in errors_total{stage="reconcile"}).
func (r *Reconciler) failed(cur, next orders.Cursor, size int) {
	known := !sameCursor(next, cur)
	switch {
	case r.narrow != nil && known && size > 1:
		r.narrow.size, r.resume = size/2, cur
	case r.narrow != nil && known: // the row itself: passed by, full pages after it
		r.resume, r.narrow = next, nil
	case r.failedAt == nil || !sameCursor(*r.failedAt, cur):
		r.failedAt, r.resume = &cur, cur
	case !known: // from the beginning, in full pages
		r.failedAt, r.resume, r.narrow = nil, orders.Cursor{}, nil
	case size > 1:
		r.failedAt, r.resume = nil, cur
		r.narrow = &narrowing{left: size, size: size / 2}
	default: // a page of one row failed twice: that row
		r.failedAt, r.resume = nil, next
	}
}

func sameCursor(a, b orders.Cursor) bool {
	return a.Serial == b.Serial && a.ExpiresAt.Equal(b.ExpiresAt)
}

// errOtherReplica ends a pass whose page found another replica
// reconciling (the advisory lock taken): not a failure.
var errOtherReplica = errors.New("another replica is reconciling")

// page reconciles the page of overdue orders after cur, in one transaction,
// and returns how many it closed and where the next page starts.
func (r *Reconciler) page(ctx context.Context, cur orders.Cursor, size int) (closed int, next orders.Cursor, more bool, err error) {
	tx, err := r.store.DB().BeginTxx(ctx, nil)
	if err != nil {
		return 0, cur, false, fmt.Errorf("reconcile: %w", err)
	}
	defer func() {
		if err != nil || closed == 0 {
			tx.Rollback() //nolint:errcheck // nothing to keep
		}
	}()
	got, err := orders.TryAdvisoryXactLock(ctx, tx, r.lock)
	if err != nil {
		return 0, cur, false, fmt.Errorf("reconcile lock: %w", err)
	}
	if !got {
		return 0, cur, false, errOtherReplica
	}
	// The server bounds every statement of the page, like the fast path's.
	if err := r.store.SetLocalTimeouts(ctx, tx); err != nil {
		return 0, cur, false, fmt.Errorf("reconcile: %w", err)
	}
	// The overdue statement locks every row of the page (FOR UPDATE SKIP
	// LOCKED), the rows of orders still in Redis too; overdueSavepoint lets
	// the page let go of them below (keepOnlyLost).
	if err := orders.Savepoint(ctx, tx, overdueSavepoint); err != nil {
		return 0, cur, false, fmt.Errorf("reconcile: %w", err)
	}
	rows, err := r.store.Overdue(ctx, tx, r.cfg.Grace.Milliseconds(), int64(size), cur)
	if err != nil {
		return 0, cur, false, fmt.Errorf("reconcile overdue: %w", err)
	}
	if len(rows) == 0 {
		return 0, cur, false, nil
	}
	last := rows[len(rows)-1]
	next = orders.Cursor{ExpiresAt: last.ExpiresAt, Serial: last.Serial}
	more = len(rows) == size
	serials := make([]string, len(rows))
	for i, o := range rows {
		serials[i] = o.Serial
	}
	lost, err := r.missing(ctx, serials)
	if err != nil {
		return 0, next, false, err
	}
	now := r.now()
	lost = slices.DeleteFunc(lost, func(s string) bool { e := r.skip[s]; return e != nil && now.Before(e.until) })
	if len(lost) < len(rows) {
		if lost, err = r.keepOnlyLost(ctx, tx, lost); err != nil {
			return 0, next, false, fmt.Errorf("reconcile: %w", err)
		}
	}
	// Orders that failed before are tried last: the others close first.
	slices.SortStableFunc(lost, func(a, b string) int {
		_, fa := r.skip[a]
		_, fb := r.skip[b]
		switch {
		case fa == fb:
			return 0
		case fb:
			return -1
		}
		return 1
	})
	// A page that failed the pass before (see failed) may hold a row whose
	// close raises an error taken for the database's: this time such an
	// error, if the server answered it, is isolated as a row's.
	st := pageState{suspect: r.failedAt != nil && sameCursor(*r.failedAt, cur)}
	if len(lost) > 0 {
		done, err := r.closeFenced(ctx, tx, lost, &st)
		if err != nil {
			return 0, next, false, fmt.Errorf("reconcile close: %w", err)
		}
		closed = len(done)
		for _, sn := range done {
			delete(r.skip, sn)
		}
		if closed > 0 {
			if err := tx.Commit(); err != nil {
				if errors.Is(err, sql.ErrTxDone) || (ctx.Err() != nil && errors.Is(err, ctx.Err())) {
					// The pass ended before its COMMIT (typically the
					// queue's check answered after the pass's deadline:
					// go-redis does not cut a read at one): database/sql
					// answered for itself, having rolled the transaction
					// back, and sent no COMMIT. Nothing closed, and
					// nothing in doubt.
					return 0, next, false, fmt.Errorf("reconcile: the pass ended before its commit, nothing closed: %w", err)
				}
				err = orders.CommitError(err, closed)
				r.m.InDoubt.Add(float64(orders.InDoubt(err)))
				return 0, next, false, fmt.Errorf("reconcile commit: %w", err)
			}
			r.m.Reconciled.Add(float64(closed))
		}
	}
	if st.slow != nil {
		// Every row tried alone timed out: the database is slow, not a
		// row. What closed is committed; the pass ends here.
		return closed, next, false, fmt.Errorf("reconcile close: %w", st.slow)
	}
	return closed, next, more, nil
}

// keepOnlyLost lets go of the rows of a page's read that it will not close
// and keeps the lost ones locked, and returns those it kept. Orders still
// in Redis are the fast path's, whose close of them would otherwise wait
// for these locks until the page ends (and fail with 55P03 while a long
// page isolates poisonous rows, every pass, so a backlog past the grace
// never drained); orders skipped after a failure would hold up their own
// payments. The page rolls back to the savepoint before its read, which
// lets go of every row, and locks the lost rows again with the deadline
// checked anew (RelockOverdue), skipping rows someone took meanwhile: a
// producer that moved a lost order's deadline in the table after the read
// (its row committed, Redis not written yet, or never: it died) keeps its
// order, and the close never waits for a lock. With a custom overdue
// statement, whose deadline only that statement knows, the page keeps the
// rows of its read: the fast path's close of the orders still in Redis on
// that page waits for the page, as the lock timeout allows.
func (r *Reconciler) keepOnlyLost(ctx context.Context, tx *sqlx.Tx, lost []string) ([]string, error) {
	if len(lost) > 0 && !r.store.DefaultOverdue() {
		return lost, nil
	}
	if err := orders.RollbackToSavepoint(ctx, tx, overdueSavepoint); err != nil {
		return nil, err
	}
	if len(lost) == 0 {
		return nil, nil
	}
	locked, err := r.store.RelockOverdue(ctx, tx, lost, r.cfg.Grace.Milliseconds())
	if err != nil {
		return nil, err
	}
	kept := make(map[string]bool, len(locked))
	for _, s := range locked {
		kept[s] = true
	}
	return slices.DeleteFunc(lost, func(s string) bool { return !kept[s] }), nil
}

// The savepoints of a page's transaction: overdueSavepoint before the
// overdue statement (the page rolls back to it to release the rows it
// leaves alone), pageSavepoint before the page's close (closeFenced rolls
// back to it when the fence finds serials back in Redis), closeSavepoint
// around each close statement (closeIsolating).
const (
	overdueSavepoint = "orderdelay_reconcile_overdue"
	pageSavepoint    = "orderdelay_reconcile_page"
	closeSavepoint   = "orderdelay_reconcile_close"
)

// pageState is what one page spent isolating rows that fail with errors
// that cost a timeout (orders.Costly).
type pageState struct {
	costly, timeouts int
	slow             error // set when maxCostly statement timeouts ran: the database is slow
	// suspect: the page failed the pass before; an error the server
	// answered is isolated as a row's (closeIsolating).
	suspect bool
}

// closeFenced closes the lost orders in tx and returns those it closed,
// none of which was back in Redis after the close statement ran. The
// "missing" check happened before the close; a producer may have re-added a
// serial since (a raw ZADD with a later deadline, a replica's lease), and its
// order must not be closed. So the check is repeated once the close
// statement has run, while its rows are locked and before the commit: if
// any closed serial is now in a queue key or a lease hash, the page is rolled
// back to its savepoint and closed again without it, until the fence finds
// none. Each round drops at least one serial, so this ends.
func (r *Reconciler) closeFenced(ctx context.Context, tx *sqlx.Tx, lost []string, st *pageState) ([]string, error) {
	if err := orders.Savepoint(ctx, tx, pageSavepoint); err != nil {
		return nil, err
	}
	for {
		done, poisoned, err := r.closeIsolating(ctx, tx, lost, st)
		if err != nil {
			return nil, err
		}
		if r.afterClose != nil {
			r.afterClose(done)
		}
		in, err := r.inQueue(ctx, done)
		if err != nil {
			return nil, err
		}
		var back []string
		for i, s := range done {
			if in[i] {
				back = append(back, s)
			}
		}
		if len(back) == 0 {
			return done, nil
		}
		r.log.Info("reconcile: orders came back to the queue before the commit; left to the fast path",
			zap.Int("orders", len(back)), zap.Strings("serials", back[:min(len(back), 10)]))
		if err := orders.RollbackToSavepoint(ctx, tx, pageSavepoint); err != nil {
			return nil, err
		}
		lost = slices.DeleteFunc(lost, func(s string) bool {
			return slices.Contains(back, s) || slices.Contains(poisoned, s)
		})
	}
}

// closeIsolating runs the close statement on serials inside tx, under a
// savepoint, and returns what it closed and what it skipped. If it fails
// with an error about this data (a shop's trigger refuses an order, a
// constraint, a bad value) it is rolled back to the savepoint and the
// serials are split in halves, recursively, until the failing order is
// alone: that one is skipped and reported (a Warn with its serial and the
// error, errors_total{stage="reconcile"}), and every other order is closed.
// If it fails with a transient error one row can cause (orders.Contended: a
// lock, a serialization failure or deadlock raised for one order, one slow
// row cut by the statement timeout), the serials are closed one by one
// instead (closeOneByOne), which finds such a row for the price of one
// timeout. The close is conditional on the order being pending, so running
// it again is safe. An error about the database (orders.Transient) is
// returned as it is: the caller rolls back and the pass ends.
func (r *Reconciler) closeIsolating(ctx context.Context, tx *sqlx.Tx, serials []string, st *pageState) (closed, skipped []string, err error) {
	if len(serials) == 0 {
		return nil, nil, nil
	}
	if err := orders.Savepoint(ctx, tx, closeSavepoint); err != nil {
		return nil, nil, err
	}
	done, err := r.store.CloseOn(ctx, tx, serials)
	if err == nil && r.cfg.Outbox {
		err = orders.RecordClosed(ctx, tx, done, "reconciled")
	}
	if err == nil {
		// A shop's deferred constraint or constraint trigger that refuses
		// a close is checked here, inside the savepoint, where the order
		// is isolated, not at COMMIT, where it would fail the whole page
		// every pass; then deferred again, so the next close's events can
		// be written before its checks run.
		err = setConstraints(ctx, tx, "IMMEDIATE")
		if err == nil {
			err = setConstraints(ctx, tx, "DEFERRED")
		}
	}
	if err == nil {
		err = orders.ReleaseSavepoint(ctx, tx, closeSavepoint)
		return done, nil, err
	}
	contended := orders.Contended(err)
	if orders.Transient(err) && !contended && !(st.suspect && orders.Answered(err)) {
		return nil, nil, err
	}
	if rerr := orders.RollbackToSavepoint(ctx, tx, closeSavepoint); rerr != nil {
		return nil, nil, fmt.Errorf("%w (after %w)", rerr, err)
	}
	if rerr := orders.ReleaseSavepoint(ctx, tx, closeSavepoint); rerr != nil {
		return nil, nil, fmt.Errorf("%w (after %w)", rerr, err)
	}
	switch {
	case len(serials) == 1 && contended:
		r.m.Errors.WithLabelValues(metrics.StageReconcile).Inc()
		if orders.Costly(err) {
			st.costly++
			if first := r.skipFailed(serials[0]); first && orders.TimedOut(err) {
				st.timeouts++ // only new offenders say the database is slow
			}
		}
		r.log.Warn("reconcile: closing this order fails with a transient error (a lock, a conflict, a timeout); skipped, the other lost orders are closed",
			zap.String("serial", serials[0]), zap.Error(err))
		return nil, serials, nil
	case len(serials) == 1:
		r.m.Errors.WithLabelValues(metrics.StageReconcile).Inc()
		r.log.Warn("reconcile: closing this order fails; skipped, the other lost orders are closed",
			zap.String("serial", serials[0]), zap.Error(err))
		return nil, serials, nil
	case contended:
		return r.closeOneByOne(ctx, tx, serials, st)
	}
	half := len(serials) / 2
	a, pa, err := r.closeIsolating(ctx, tx, serials[:half], st)
	if err != nil {
		return nil, nil, err
	}
	b, pb, err := r.closeIsolating(ctx, tx, serials[half:], st)
	if err != nil {
		return nil, nil, err
	}
	return append(a, b...), append(pa, pb...), nil
}

// setConstraints sets the mode of every deferrable constraint of tx
// (SET CONSTRAINTS ALL mode): IMMEDIATE also checks those still pending.
func setConstraints(ctx context.Context, tx *sqlx.Tx, mode string) error {
	_, err := tx.ExecContext(ctx, "SET CONSTRAINTS ALL "+mode)
	return err
}

// skipFailed records that closing serial cost a timeout and reports
// whether that is the first time.
func (r *Reconciler) skipFailed(serial string) (first bool) {
	e := r.skip[serial]
	if e == nil {
		if len(r.skip) >= maxSkipped {
			return true
		}
		e = &skipEntry{}
		r.skip[serial] = e
	}
	e.failures++
	e.until = r.now().Add(r.cfg.Interval * time.Duration(min(1<<(e.failures-1), maxSkipIntervals)))
	return e.failures == 1
}

// closeOneByOne closes serials one statement each (closeIsolating), until
// maxCostly of them cost a timeout: the rest is skipped until the walk
// comes round to them (the timed-out ones for longer, see Reconciler.skip), so a page spends
// at most maxCostly timeouts holding its rows locked. If those were
// statement timeouts of orders that had not failed before, the database is
// taken to be slow (st.slow) and the pass ends after this page.
func (r *Reconciler) closeOneByOne(ctx context.Context, tx *sqlx.Tx, serials []string, st *pageState) (closed, skipped []string, err error) {
	for i, s := range serials {
		if st.costly >= maxCostly {
			if st.timeouts >= maxCostly && st.slow == nil {
				st.slow = fmt.Errorf("%d orders in a row timed out closed alone: the database is slow", st.timeouts)
			}
			r.log.Warn("reconcile: rows that cost a timeout each; the rest of the page is left until the walk comes round to it",
				zap.Int("orders", len(serials)-i))
			return closed, append(skipped, serials[i:]...), nil
		}
		c, sk, err := r.closeIsolating(ctx, tx, []string{s}, st)
		if err != nil {
			return nil, nil, err
		}
		closed, skipped = append(closed, c...), append(skipped, sk...)
	}
	return closed, skipped, nil
}

// missing returns the serials that are nowhere in the queue's keys.
func (r *Reconciler) missing(ctx context.Context, serials []string) ([]string, error) {
	in, err := r.inQueue(ctx, serials)
	if err != nil {
		return nil, err
	}
	var out []string
	for i, s := range serials {
		if !in[i] {
			out = append(out, s)
		}
	}
	return out, nil
}

// inQueue reports, for each serial, whether it is in the queue key or the
// lease hash (leased or backing off) of the queue or any shard. Each key
// set is read by one script, atomically: an entry that moves from the lease
// hash back to the queue key (a hand-back) cannot fall between two reads
// and look missing.
func (r *Reconciler) inQueue(ctx context.Context, serials []string) ([]bool, error) {
	found := make([]bool, len(serials))
	if len(serials) == 0 {
		return found, nil
	}
	all := append([]queue.Keys{r.cfg.Keys}, r.cfg.Shards...)
	for _, k := range all {
		in, err := queue.NewStore(r.rdb, k).InQueue(ctx, serials)
		if err != nil {
			return nil, fmt.Errorf("reconcile: check queue: %w", err)
		}
		for j := range serials {
			found[j] = found[j] || in[j]
		}
	}
	return found, nil
}
