// Package admin holds the operator's tools, shared by the CLI and the admin
// API (/admin/v1, its own token): pause and resume closing, extend the
// deadlines of a time window, resync the queue from PostgreSQL, look at one
// order in both stores, and purge old dead letters. Each tool works in
// bounded steps, so none blocks Redis or holds long transactions.
package admin

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"
	"github.com/redis/go-redis/v9"
	"golang.org/x/time/rate"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Tools operate on one queue and (optionally) its reference orders table.
type Tools struct {
	rdb  redis.UniversalClient
	keys queue.Keys
	all  []queue.Keys // keys, then the shards' keys (client.WithShards)
	cl   *client.Client
	db   *sqlx.DB // nil: Redis-only tools
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
	return &Tools{rdb: rdb, keys: cl.Keys(), all: cl.AllKeys(), cl: cl, db: db}, nil
}

// ErrNoDatabase is returned by tools that need PostgreSQL when none is set.
var ErrNoDatabase = errors.New("this tool needs the database")

// PauseState says whether closing is paused.
type PauseState struct {
	Paused bool      `json:"paused"`
	Reason string    `json:"reason,omitempty"`
	Since  time.Time `json:"since,omitzero"`
}

// Pause stops every replica from claiming (each notices at its next scan,
// within one scan interval). Producers keep enqueueing; the queue stays
// intact. Pausing again keeps the first pause's time and reason.
func (t *Tools) Pause(ctx context.Context, reason string) (PauseState, error) {
	if reason == "" {
		reason = "paused by an operator"
	}
	val := strconv.FormatInt(time.Now().UnixMilli(), 10) + "|" + strings.ReplaceAll(reason, "\n", " ")
	// Each shard's claim script reads its own flag (one slot per script).
	for _, k := range t.all {
		if err := t.rdb.SetNX(ctx, k.Paused, val, 0).Err(); err != nil {
			return PauseState{}, fmt.Errorf("pause: %w", err)
		}
	}
	return t.PauseState(ctx)
}

// Resume lets replicas claim again and wakes those waiting.
func (t *Tools) Resume(ctx context.Context) error {
	for _, k := range t.all {
		if err := t.rdb.Del(ctx, k.Paused).Err(); err != nil {
			return fmt.Errorf("resume: %w", err)
		}
		// Any deadline wakes a paused scanner; 0 is earlier than all of them.
		if err := t.rdb.Publish(ctx, k.Wake, 0).Err(); err != nil {
			return fmt.Errorf("resume: wake replicas: %w", err)
		}
	}
	return nil
}

// PauseState reads the pause flag.
func (t *Tools) PauseState(ctx context.Context) (PauseState, error) {
	v, err := t.rdb.Get(ctx, t.keys.Paused).Result()
	if errors.Is(err, redis.Nil) {
		return PauseState{}, nil
	}
	if err != nil {
		return PauseState{}, fmt.Errorf("pause state: %w", err)
	}
	st := PauseState{Paused: true, Reason: v}
	if at, reason, ok := strings.Cut(v, "|"); ok {
		if ms, err := strconv.ParseInt(at, 10, 64); err == nil {
			st.Since, st.Reason = time.UnixMilli(ms), reason
		}
	}
	return st, nil
}

// extendBatch bounds one extend script call.
const extendBatch = 500

// extendScript moves entries later, each only if its deadline is still the
// one read (compare-and-set against claims and reschedules meanwhile).
//
//	KEYS[1] -> queue
//	ARGV[1] -> how much later, ms; ARGV[2k], ARGV[2k+1] -> serial, expected deadline
//
// Returns the serials moved.
var extendScript = redis.NewScript(`
local by = tonumber(ARGV[1])
local moved = {}
for i = 2, #ARGV, 2 do
  local cur = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if cur and tonumber(cur) == tonumber(ARGV[i+1]) then
    redis.call('ZADD', KEYS[1], 'XX', tonumber(cur) + by, ARGV[i])
    moved[#moved+1] = ARGV[i]
  end
end
return moved
`)

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
	now, err := t.rdb.Time(ctx).Result()
	if err != nil {
		return res, fmt.Errorf("extend: %w", err)
	}
	// An order can have an entry in the queue key and one in its shard
	// (see client.WithShards): its row moves once.
	var rowMoved map[string]struct{}
	if len(t.all) > 1 {
		rowMoved = map[string]struct{}{}
	}
	for _, k := range t.all {
		if err := t.extend(ctx, k, now.Add(within), by, moveRows, rowMoved, &res); err != nil {
			return res, err
		}
	}
	return res, nil
}

// extend is Extend on the sorted set of k, for entries due by until.
// rowMoved, if not nil, holds the serials whose rows have moved already.
func (t *Tools) extend(ctx context.Context, k queue.Keys, until time.Time, by time.Duration, moveRows bool,
	rowMoved map[string]struct{}, res *ExtendResult) error {
	cursor := strconv.FormatInt(queue.DeadlineMillis(until), 10)
	var cursorScore float64 = -1
	seen := map[string]struct{}{}
	for {
		zs, err := t.rdb.ZRangeArgsWithScores(ctx, redis.ZRangeArgs{Key: k.Queue, Start: cursor, Stop: "-inf",
			ByScore: true, Rev: true, Count: int64(extendBatch + len(seen))}).Result()
		if err != nil {
			return fmt.Errorf("extend: %w", err)
		}
		args := []any{by.Milliseconds()}
		for _, z := range zs {
			m, _ := z.Member.(string)
			if _, dup := seen[m]; dup && z.Score == cursorScore {
				continue
			}
			if z.Score != cursorScore {
				cursorScore = z.Score
				clear(seen)
			}
			seen[m] = struct{}{}
			args = append(args, m, int64(z.Score))
			if len(args) > 2*extendBatch {
				break
			}
		}
		if len(args) == 1 {
			return nil
		}
		cursor = strconv.FormatInt(int64(cursorScore), 10)
		moved, err := extendScript.Run(ctx, t.rdb, []string{k.Queue}, args...).StringSlice()
		if err != nil {
			return fmt.Errorf("extend: %w", err)
		}
		res.BatchCalls++
		res.Moved += len(moved)
		if rowMoved != nil {
			moved = slices.DeleteFunc(moved, func(s string) bool {
				_, done := rowMoved[s]
				rowMoved[s] = struct{}{}
				return done
			})
		}
		if moveRows && len(moved) > 0 {
			r, err := t.db.ExecContext(ctx, `UPDATE orders SET expires_at = expires_at + $2 * interval '1 millisecond'
				WHERE serial_no = ANY($1) AND status = 'pending'`, pq.Array(moved), by.Milliseconds())
			if err != nil {
				return fmt.Errorf("extend: move expires_at: %w", err)
			}
			n, _ := r.RowsAffected()
			res.RowsMoved += int(n)
		}
	}
}

// ResyncResult reports what Resync did.
type ResyncResult struct {
	Scanned int `json:"scanned"` // pending orders read
	Added   int `json:"added"`   // entries that were missing and were added
	Invalid int `json:"invalid"` // orders skipped: serial or deadline a queue refuses
}

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
		page = 1000
	}
	var lim *rate.Limiter
	if perSecond > 0 {
		lim = rate.NewLimiter(rate.Limit(perSecond), max(page, int(perSecond)))
	}
	after := ""
	now := time.Now()
	for {
		var rows []struct {
			Serial  string    `db:"serial_no"`
			Expires time.Time `db:"expires_at"`
		}
		err := t.db.SelectContext(ctx, &rows, `SELECT serial_no, expires_at FROM orders
			WHERE status = 'pending' AND serial_no > $1 ORDER BY serial_no LIMIT $2`, after, page)
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
			if queue.ValidateSerial(r.Serial) != nil || queue.ValidateDeadline(queue.DeadlineMillis(r.Expires), now) != nil {
				res.Invalid++
				continue
			}
			items = append(items, client.Item{Serial: r.Serial, Deadline: r.Expires})
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
type OrderRow struct {
	Status      string     `json:"status" db:"status"`
	ExpiresAt   time.Time  `json:"expires_at" db:"expires_at"`
	CreatedAt   time.Time  `json:"created_at" db:"created_at"`
	PaidAt      *time.Time `json:"paid_at,omitempty" db:"paid_at"`
	ClosedAt    *time.Time `json:"closed_at,omitempty" db:"closed_at"`
	CloseReason *string    `json:"close_reason,omitempty" db:"close_reason"`
	ClosedBy    *string    `json:"closed_by,omitempty" db:"closed_by"`
}

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
	var row OrderRow
	err = t.db.GetContext(ctx, &row, `SELECT status, expires_at, created_at, paid_at, closed_at, close_reason, closed_by
		FROM orders WHERE serial_no = $1`, serial)
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
func (t *Tools) Dead(ctx context.Context, limit int64) ([]consumer.DeadEntry, error) {
	if len(t.all) == 1 {
		return consumer.ListDead(ctx, t.rdb, t.keys, limit)
	}
	var out []consumer.DeadEntry
	for _, k := range t.all {
		es, err := consumer.ListDead(ctx, t.rdb, k, limit)
		if err != nil {
			return nil, err
		}
		out = append(out, es...)
	}
	slices.SortStableFunc(out, func(a, b consumer.DeadEntry) int { return a.At.Compare(b.At) })
	return out[:min(int64(len(out)), limit)], nil
}

// Requeue puts the named dead letters back on the queue (the shard they
// died in), due now.
func (t *Tools) Requeue(ctx context.Context, serials ...string) (int, error) {
	if len(t.all) == 1 {
		return consumer.Requeue(ctx, t.rdb, t.keys, serials...)
	}
	total := 0
	for _, k := range t.all {
		n, err := consumer.Requeue(ctx, t.rdb, k, serials...)
		total += n
		if err != nil && !errors.Is(err, consumer.ErrNotDead) {
			return total, err
		}
	}
	if total == 0 && len(serials) == 1 {
		return 0, fmt.Errorf("%s: %w", serials[0], consumer.ErrNotDead)
	}
	return total, nil
}

// RequeueAll puts every dead letter back on the queue, due now.
func (t *Tools) RequeueAll(ctx context.Context) (int, error) {
	total := 0
	for _, k := range t.all {
		n, err := consumer.RequeueAll(ctx, t.rdb, k)
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
	if len(t.all) == 1 {
		return consumer.PurgeDead(ctx, t.rdb, t.keys, olderThan, keepMax)
	}
	per := (keepMax + len(t.all) - 1) / len(t.all)
	total := 0
	for _, k := range t.all {
		n, err := consumer.PurgeDead(ctx, t.rdb, k, olderThan, per)
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
