// Package admin holds the operator's tools, shared by the CLI and the admin
// API (/admin/v1, its own token): pause and resume closing, extend the
// deadlines of a time window, resync the queue from PostgreSQL, look at one
// order in both stores, and purge old dead letters. Each tool works in
// bounded steps, so none blocks Redis or holds long transactions.
//
// The daemon's background use of them is the Janitor of package maintain,
// which applies the dead-letter retention to the order queue and the task
// queues once a minute.
package admin

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/redis/go-redis/v9"
	"golang.org/x/time/rate"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Tools operate on one queue and (optionally) its reference orders table.
// The Redis side of every tool is a method of the queue's store
// (internal/queue), the SQL side a function of package orders on the
// reference schema (ExtendPending, PendingPage, GetRow); the tools add the
// fan-out over a sharded queue's keys and the steps that join the two.
type Tools struct {
	// stores are the queue key's store, then its shards' (client.WithShards).
	stores []*queue.Store
	cl     *client.Client
	db     *sqlx.DB // nil: Redis-only tools
}

// New returns the tools for the queue named key. db may be nil for tools
// that need only Redis. opts configure the client the tools write through;
// with client.WithShards every tool covers the queue key and all its
// shards.
func New(rdb redis.UniversalClient, key string, db *sqlx.DB, opts ...client.Option) (*Tools, error) {
	cl, err := client.New(rdb, key, opts...)
	if err != nil {
		return nil, err
	}
	t := &Tools{cl: cl, db: db}
	for _, k := range cl.AllKeys() {
		t.stores = append(t.stores, queue.NewStore(rdb, k))
	}
	return t, nil
}

// ErrNoDatabase is returned by tools that need PostgreSQL when none is set.
var ErrNoDatabase = errors.New("this tool needs the database")

// PauseState says whether closing is paused.
type PauseState = queue.PauseState

// Pause stops every replica from claiming (each notices at its next scan,
// within one scan interval). Producers keep enqueueing; the queue stays
// intact. Pausing again keeps the first pause's time and reason.
func (t *Tools) Pause(ctx context.Context, reason string) (PauseState, error) {
	now := time.Now()
	// Each shard's claim script reads its own flag (one slot per script).
	for _, st := range t.stores {
		if err := st.Pause(ctx, now, reason); err != nil {
			return PauseState{}, err
		}
	}
	return t.PauseState(ctx)
}

// Resume lets replicas claim again and wakes those waiting.
func (t *Tools) Resume(ctx context.Context) error {
	for _, st := range t.stores {
		if err := st.Resume(ctx); err != nil {
			return err
		}
	}
	return nil
}

// PauseState reads the pause flag (the queue key's).
func (t *Tools) PauseState(ctx context.Context) (PauseState, error) {
	return t.stores[0].PauseState(ctx)
}

// ExtendResult reports what Extend did.
type ExtendResult struct {
	Moved      int `json:"moved"`       // queue entries moved later
	RowsMoved  int `json:"rows_moved"`  // reference-schema rows whose expires_at moved in step
	BatchCalls int `json:"batch_calls"` // script calls made (each bounded)
}

// Extend gives every queued entry due within the next window (including
// those already overdue and waiting) by more time. It walks the window from
// its end downwards in batches of 500, so moved entries are never met
// again. With moveRows, the reference schema's expires_at of pending orders
// moves in step, so the reconciler agrees. Entries leased right now are
// being closed and are not moved.
func (t *Tools) Extend(ctx context.Context, within, by time.Duration, moveRows bool) (ExtendResult, error) {
	var res ExtendResult
	if err := CheckExtend(within, by); err != nil {
		return res, err
	}
	if moveRows && t.db == nil {
		return res, ErrNoDatabase
	}
	now, err := t.stores[0].Now(ctx)
	if err != nil {
		return res, fmt.Errorf("extend: %w", err)
	}
	// An order can have an entry in the queue key and one in its shard
	// (see client.WithShards): its row moves once.
	var rowMoved map[string]struct{}
	if len(t.stores) > 1 {
		rowMoved = map[string]struct{}{}
	}
	for _, st := range t.stores {
		if err := t.extend(ctx, st, now.Add(within), by, moveRows, rowMoved, &res); err != nil {
			return res, err
		}
	}
	return res, nil
}

// extend is Extend on the sorted set of st, for entries due by until.
// rowMoved, if not nil, holds the serials whose rows have moved already.
func (t *Tools) extend(ctx context.Context, st *queue.Store, until time.Time, by time.Duration, moveRows bool,
	rowMoved map[string]struct{}, res *ExtendResult) error {
	step, err := st.ExtendDeadlines(ctx, until, by, func(moved []string) error {
		if rowMoved != nil {
			moved = slices.DeleteFunc(moved, func(s string) bool {
				_, done := rowMoved[s]
				rowMoved[s] = struct{}{}
				return done
			})
		}
		if moveRows && len(moved) > 0 {
			n, err := orders.ExtendPending(ctx, t.db, moved, by)
			if err != nil {
				return fmt.Errorf("extend: move expires_at: %w", err)
			}
			res.RowsMoved += n
		}
		return nil
	})
	res.BatchCalls += step.Calls
	res.Moved += step.Moved
	return err
}

// ResyncResult reports what Resync did.
type ResyncResult struct {
	Scanned int `json:"scanned"` // pending orders read
	Added   int `json:"added"`   // entries that were missing and were added
	Invalid int `json:"invalid"` // orders skipped: serial or deadline a queue refuses
}

// DefaultResyncPage is Resync's page size when it is given none (0 or
// less): the admin API's, and the CLI's --page default.
const DefaultResyncPage = 1000

// Resync loads pending orders of the reference schema into the queue, in
// pages of page orders (keyset pagination on serial_no), at most perSecond
// orders a second (0: unlimited). Entries that exist keep their deadline
// (NX), so it is safe on a live queue.
func (t *Tools) Resync(ctx context.Context, page int, perSecond float64) (ResyncResult, error) {
	var res ResyncResult
	if t.db == nil {
		return res, ErrNoDatabase
	}
	if page <= 0 {
		page = DefaultResyncPage
	}
	var lim *rate.Limiter
	if perSecond > 0 {
		lim = rate.NewLimiter(rate.Limit(perSecond), max(page, int(perSecond)))
	}
	after := ""
	now := time.Now()
	for {
		rows, err := orders.PendingPage(ctx, t.db, after, page)
		if err != nil {
			return res, fmt.Errorf("resync: %w", err)
		}
		if len(rows) == 0 {
			return res, nil
		}
		if lim != nil {
			if err := lim.WaitN(ctx, len(rows)); err != nil {
				return res, fmt.Errorf("resync: %w", err)
			}
		}
		items := make([]client.Item, 0, len(rows))
		for _, r := range rows {
			if queue.ValidateSerial(r.Serial) != nil || queue.ValidateDeadline(queue.DeadlineMillis(r.ExpiresAt), now) != nil {
				res.Invalid++
				continue
			}
			items = append(items, client.Item{Serial: r.Serial, Deadline: r.ExpiresAt})
		}
		res.Scanned += len(rows)
		after = rows[len(rows)-1].Serial
		if len(items) == 0 {
			continue
		}
		out, err := t.cl.EnqueueMany(ctx, items, client.Create)
		if err != nil {
			return res, fmt.Errorf("resync: %w", err)
		}
		for _, o := range out {
			if o.Result == client.Created {
				res.Added++
			}
		}
	}
}

// OrderRow is an order's row in the reference schema.
type OrderRow = orders.Row

// OrderReport is one order as both stores see it.
type OrderReport struct {
	Serial   string        `json:"serial"`
	Queue    *client.Entry `json:"queue"`               // nil: not in Redis
	Row      *OrderRow     `json:"row"`                 // nil: no row (or no database)
	RowError string        `json:"row_error,omitempty"` // why the row could not be read
}

// Order reports serial's state in Redis (queued, leased by which replica
// until when, backing off, dead, with attempts and last error) and its row
// in PostgreSQL.
func (t *Tools) Order(ctx context.Context, serial string) (OrderReport, error) {
	rep := OrderReport{Serial: serial}
	e, err := t.cl.Get(ctx, serial)
	switch {
	case err == nil:
		rep.Queue = &e
	case !errors.Is(err, client.ErrNotFound):
		return rep, err
	}
	if t.db == nil {
		rep.RowError = ErrNoDatabase.Error()
		return rep, nil
	}
	row, err := orders.GetRow(ctx, t.db, serial)
	switch {
	case err == nil:
		rep.Row = &row
	case errors.Is(err, sql.ErrNoRows):
	default:
		rep.RowError = err.Error()
	}
	return rep, nil
}

// Dead lists up to limit dead letters, oldest first (over every shard).
func (t *Tools) Dead(ctx context.Context, limit int64) ([]queue.DeadEntry, error) {
	if len(t.stores) == 1 {
		return t.stores[0].Dead(ctx, limit)
	}
	var out []queue.DeadEntry
	for _, st := range t.stores {
		es, err := st.Dead(ctx, limit)
		if err != nil {
			return nil, err
		}
		out = append(out, es...)
	}
	slices.SortStableFunc(out, func(a, b queue.DeadEntry) int { return a.At.Compare(b.At) })
	return out[:min(int64(len(out)), limit)], nil
}

// Requeue puts the named dead letters back on the queue (the shard they
// died in), due now.
func (t *Tools) Requeue(ctx context.Context, serials ...string) (int, error) {
	if len(t.stores) == 1 {
		return t.stores[0].Requeue(ctx, serials...)
	}
	total := 0
	for _, st := range t.stores {
		n, err := st.Requeue(ctx, serials...)
		total += n
		if err != nil && !errors.Is(err, queue.ErrNotDead) {
			return total, err
		}
	}
	if total == 0 && len(serials) == 1 {
		return 0, fmt.Errorf("%s: %w", serials[0], queue.ErrNotDead)
	}
	return total, nil
}

// RequeueAll puts every dead letter back on the queue, due now.
func (t *Tools) RequeueAll(ctx context.Context) (int, error) {
	total := 0
	for _, st := range t.stores {
		n, err := st.RequeueAll(ctx)
		total += n
		if err != nil {
			return total, err
		}
	}
	return total, nil
}

// PurgeDead removes dead letters older than olderThan (0: none by age) and
// the oldest beyond keepMax (0: no cap). A sharded queue keeps at most
// keepMax / (shards + 1), rounded up, per key.
func (t *Tools) PurgeDead(ctx context.Context, olderThan time.Duration, keepMax int) (int, error) {
	if len(t.stores) == 1 {
		return t.stores[0].PurgeDead(ctx, olderThan, keepMax)
	}
	per := (keepMax + len(t.stores) - 1) / len(t.stores)
	total := 0
	for _, st := range t.stores {
		n, err := st.PurgeDead(ctx, olderThan, per)
		total += n
		if err != nil {
			return total, err
		}
	}
	return total, nil
}

// MaxExtend bounds Extend: the window plus the extension. An entry moved
// further than queue.MaxAhead from now is out of the queue's range and
// would be dead-lettered instead of closed.
const MaxExtend = queue.MaxAhead

// ErrBadExtend is an Extend the tools refuse.
var ErrBadExtend = errors.New("extend")

// CheckExtend refuses a window or extension that is not positive, or whose
// sum passes MaxExtend, with a message that names the bound.
func CheckExtend(within, by time.Duration) error {
	if within <= 0 || by <= 0 {
		return fmt.Errorf("%w: within and by must both be positive, got %s and %s", ErrBadExtend, within, by)
	}
	if within > MaxExtend || by > MaxExtend || within+by > MaxExtend {
		return fmt.Errorf("%w: within (%s) + by (%s) must be at most %s, the furthest deadline the queue accepts "+
			"(ten years ahead): entries moved further would be dead-lettered as out of range", ErrBadExtend, within, by, MaxExtend)
	}
	return nil
}

// UnbatchKey is what Unbatch did to one key of the queue.
type UnbatchKey struct {
	Key string `json:"key"`
	queue.UnbatchResult
}

// Unbatch turns the batch leases of the queue (and of each shard) into
// per-member leases, perCall batches per bounded script call (see
// queue.Store.UnbatchLeases): before, or after, a rollback to a release
// that leases per member only, so the batches of a pod that was killed
// are re-claimed by the older release. It returns one result per key, the
// queue key first.
func (t *Tools) Unbatch(ctx context.Context, perCall int) ([]UnbatchKey, error) {
	out := make([]UnbatchKey, 0, len(t.stores))
	for _, st := range t.stores {
		res, err := st.UnbatchLeases(ctx, perCall)
		out = append(out, UnbatchKey{Key: st.Keys().Queue, UnbatchResult: res})
		if err != nil {
			return out, fmt.Errorf("%s: %w", st.Keys().Queue, err)
		}
	}
	return out, nil
}
