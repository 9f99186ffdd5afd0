package tasks

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/lib/pq"

	"github.com/orderdelay/orderdelay/internal/queue"
)

// Operating a queue: list its tasks and dead letters, requeue and purge
// dead letters, read its stats, pause and resume it. The HTTP API
// (/v1/queues/...) and the CLI (orderdelay task ...) both call these.

// List states: which of a queue's sorted sets a listing pages through.
const (
	ListPending  = "pending"  // the queue key: waiting for their due time (or due, not yet claimed), by due time
	ListInflight = "inflight" // leased or backing off before a retry, by when that ends
	ListDead     = "dead"     // dead letters, by when they were dead-lettered
)

// MaxList bounds one page of a listing.
const MaxList = 1000

// MaxRequeue bounds the ids of one requeue or purge by ids, and the dead
// letters one "requeue all" moves.
const MaxRequeue = 1000

// TaskInfo is one task of a listing.
type TaskInfo struct {
	ID        string          `json:"id"`
	State     string          `json:"state"` // queued, leased, backoff or dead
	Due       time.Time       `json:"due"`   // the task's true due time (unknown for some dead letters: zero)
	Attempts  int             `json:"attempts"`
	Until     *time.Time      `json:"until,omitempty"` // leased or backoff: when that ends
	Reason    string          `json:"reason,omitempty"`
	LastError string          `json:"last_error,omitempty"`
	DeadAt    *time.Time      `json:"dead_lettered_at,omitempty"`
	Payload   json.RawMessage `json:"payload,omitempty"`
}

// TaskPage is a page of a listing. Next, if not empty, is the cursor of
// the next page.
type TaskPage struct {
	Tasks []TaskInfo `json:"tasks"`
	Next  string     `json:"next,omitempty"`
}

// ErrBadState: a listing state other than pending, inflight or dead.
var ErrBadState = errors.New("state: want pending, inflight or dead")

// List returns up to limit tasks in state after cursor ("": from the
// start), with their payloads if withPayload. Each page is one bounded
// script call and one pipeline; it lists what Redis holds, so a durable
// queue's listing shows only the tasks inside its window (and its dead
// letters), not the rows of tasks due later.
func (r *Runtime) List(ctx context.Context, state, cursor string, limit int, withPayload bool) (TaskPage, error) {
	var key string
	switch state {
	case ListPending:
		key = r.Keys.Queue
	case ListInflight:
		key = r.Keys.Inflight
	case ListDead:
		key = r.Keys.Dead
	default:
		return TaskPage{}, ErrBadState
	}
	var after *queue.Cursor
	if cursor != "" {
		c, err := queue.ParseCursor(cursor)
		if err != nil {
			return TaskPage{}, err
		}
		after = &c
	}
	zs, err := r.Store.Page(ctx, key, after, limit)
	if err != nil {
		return TaskPage{}, err
	}
	page := TaskPage{Tasks: make([]TaskInfo, len(zs))}
	if len(zs) == 0 {
		return page, nil
	}
	ids := make([]string, len(zs))
	for i, z := range zs {
		ids[i], _ = z.Member.(string) // Page returns strings
	}
	recs, err := r.Store.Records(ctx, ids, state == ListDead, withPayload)
	if err != nil {
		return TaskPage{}, fmt.Errorf("list %s: %w", state, err)
	}
	for i, z := range zs {
		t := TaskInfo{ID: ids[i]}
		rec := recs[i].Rec
		switch state {
		case ListDead:
			t.State = "dead"
			at := time.UnixMilli(int64(z.Score)).UTC()
			t.DeadAt = &at
			if d, ok := queue.ParseDeadRecord(rec); ok {
				t.Reason, t.Attempts, t.LastError = d.Reason, d.Attempts, d.LastError
				if ms, err := strconv.ParseFloat(d.Deadline, 64); err == nil {
					t.Due = time.UnixMilli(int64(ms)).UTC()
				}
			}
		case ListPending:
			t.State, t.Due = "queued", time.UnixMilli(int64(z.Score)).UTC()
		case ListInflight:
			until := time.UnixMilli(int64(z.Score)).UTC()
			t.State, t.Until = "leased", &until
			if l, ok := queue.ParseLeaseRecord(rec); ok {
				if l.Deadline != 0 {
					t.Due = time.UnixMilli(l.Deadline).UTC()
				}
				t.Attempts, t.LastError = l.Attempts, l.LastError
				if l.Backoff() {
					t.State = "backoff"
				}
			}
		}
		if p := recs[i]; p.HasPayload {
			t.Payload = json.RawMessage(p.Payload)
			if !json.Valid(t.Payload) { // only a raw HSET can store this
				t.Payload, _ = json.Marshal(p.Payload)
			}
		}
		page.Tasks[i] = t
	}
	if len(zs) == limit {
		last := zs[len(zs)-1]
		page.Next = queue.Cursor{Score: last.Score, ID: ids[len(ids)-1]}.String()
	}
	return page, nil
}

// Stats are a queue's numbers, read in one script call and one pipeline
// (counts, never a range of everything).
type Stats struct {
	Queue    string `json:"queue"`
	Action   string `json:"action"`
	Durable  bool   `json:"durable"`
	Pending  int64  `json:"pending"`  // in the queue key: waiting, or due and not yet claimed
	Due      int64  `json:"due"`      // past their due time, leased and backing-off ones included
	Inflight int64  `json:"inflight"` // leased or backing off before a retry
	Dead     int64  `json:"dead"`     // dead letters
	// OldestOverdueSeconds is how long the oldest task past its due time
	// has been due (0 if none).
	OldestOverdueSeconds float64 `json:"oldest_overdue_seconds"`
	Paused               bool    `json:"paused"`
	PausedReason         string  `json:"paused_reason,omitempty"`
}

// Stats reads the queue's numbers.
func (r *Runtime) Stats(ctx context.Context) (Stats, error) {
	s, err := queue.ReadStats(ctx, r.Redis, r.Keys)
	if err != nil {
		return Stats{}, err
	}
	pending, inflight, err := r.Store.Sizes(ctx)
	if err != nil {
		return Stats{}, fmt.Errorf("stats: %w", err)
	}
	ps, err := r.Store.PauseState(ctx)
	if err != nil {
		return Stats{}, err
	}
	return Stats{Queue: r.Config.Name, Action: r.Config.Action.Type, Durable: r.Durable != nil,
		Pending: pending, Due: s.Overdue, Inflight: inflight, Dead: s.DeadLetters,
		OldestOverdueSeconds: s.OldestDue.Seconds(), Paused: ps.Paused, PausedReason: ps.Reason}, nil
}

// Pause stops the queue: no task is claimed, forwarded or polled until
// Resume (each replica notices at its next claim). Producers keep adding
// tasks. Pausing again keeps the first pause's time and reason.
func (r *Runtime) Pause(ctx context.Context, reason string) (queue.PauseState, error) {
	if err := r.Store.Pause(ctx, time.Now(), reason); err != nil {
		return queue.PauseState{}, err
	}
	return r.Store.PauseState(ctx)
}

// Resume lets the queue run again and wakes its consumers.
func (r *Runtime) Resume(ctx context.Context) error {
	return r.Store.Resume(ctx)
}

// RequeueResult reports a requeue.
type RequeueResult struct {
	Requeued int       `json:"requeued"`
	Skipped  []Skipped `json:"skipped"` // ids left alone, with why
}

// Skipped is an id a requeue left alone.
type Skipped struct {
	ID  string `json:"id"`
	Why string `json:"why"`
}

// Why a requeue skipped an id.
const (
	WhyLive      = "a live task has this id; it and the dead letter are left alone"
	WhyNotDead   = "no dead letter with this id"
	WhyNotFailed = "the durable row is not FAILED"
)

// Requeue puts the dead letters ids (1 to MaxRequeue) back on the queue,
// due now, with the payloads they died with. An id that is also a live
// task is left alone, and so is its dead letter. On a durable queue the
// row goes back to SCHEDULED first (attempts 0, due now, a new version,
// logged) and decides: a reset row is requeued whatever Redis holds; an
// id whose row is not FAILED is refused.
func (r *Runtime) Requeue(ctx context.Context, ids []string) (RequeueResult, error) {
	res := RequeueResult{Skipped: []Skipped{}}
	if r.Durable != nil {
		reset, err := r.Durable.resetFailed(ctx, ids)
		if err != nil {
			return res, err
		}
		var keep []string
		for _, id := range ids {
			if reset[id] {
				keep = append(keep, id)
			} else {
				res.Skipped = append(res.Skipped, Skipped{ID: id, Why: WhyNotFailed})
			}
		}
		ids = keep
	}
	outs, err := r.Store.RequeueTasks(ctx, ids)
	if err != nil {
		return res, err
	}
	for i, o := range outs {
		switch {
		case o == queue.RequeueDone:
			res.Requeued++
		case r.Durable != nil:
			// The row decides: it is SCHEDULED again, due now, under a new
			// version, whatever Redis holds. No dead letter (purged): the
			// loader brings the row in. A live entry of the id (the task
			// was still leased between the executor's FAILED and the
			// consumer's dead letter): it runs the row if it is still to
			// run, else the loader brings it in once it is gone. Either
			// way the task runs again, so it is not "left alone".
			res.Requeued++
		case o == queue.RequeueLive:
			res.Skipped = append(res.Skipped, Skipped{ID: ids[i], Why: WhyLive})
		default:
			res.Skipped = append(res.Skipped, Skipped{ID: ids[i], Why: WhyNotDead})
		}
	}
	return res, nil
}

// RequeueAll requeues the oldest dead letters, at most MaxRequeue, as
// Requeue does, and says how many dead letters remain.
func (r *Runtime) RequeueAll(ctx context.Context) (RequeueResult, int64, error) {
	ids, err := r.Store.DeadIDs(ctx, MaxRequeue)
	if err != nil {
		return RequeueResult{}, 0, fmt.Errorf("requeue: %w", err)
	}
	res, err := r.Requeue(ctx, ids)
	if err != nil {
		return res, 0, err
	}
	left, err := r.Store.DeadCount(ctx)
	if err != nil {
		return res, 0, fmt.Errorf("requeue: %w", err)
	}
	return res, left, nil
}

// Purge removes the dead letters ids, with their payloads unless a live
// task has the same id, and returns how many there were. A durable
// queue's rows stay FAILED (the record of what happened).
func (r *Runtime) Purge(ctx context.Context, ids []string) (int, error) {
	return r.Store.PurgeTasks(ctx, ids)
}

// PurgeOlder removes the dead letters dead-lettered more than olderThan
// ago (0: all of them), as Purge does.
func (r *Runtime) PurgeOlder(ctx context.Context, olderThan time.Duration) (int, error) {
	var cutoff time.Time
	if olderThan > 0 {
		now, err := r.Redis.Time(ctx).Result()
		if err != nil {
			return 0, fmt.Errorf("purge: %w", err)
		}
		cutoff = now.Add(-olderThan)
	}
	return r.Store.PurgeTasksBefore(ctx, cutoff)
}

// resetFailed moves the FAILED rows of ids back to SCHEDULED, due now,
// with no attempts and a new version, logged, in one statement, and
// returns the ids it moved.
func (d *Durable) resetFailed(ctx context.Context, ids []string) (map[string]bool, error) {
	var moved []string
	err := d.DB.SelectContext(ctx, &moved, `WITH up AS (UPDATE orderdelay_tasks SET state = 'SCHEDULED', due_at = now(),
			attempts = 0, version = version + 1, updated_at = now()
			WHERE queue = $1 AND id = ANY($2) AND state = 'FAILED' RETURNING id, version),
		logged AS (INSERT INTO orderdelay_task_log (queue, task_id, state, version, detail)
			SELECT $1, id, 'SCHEDULED', version, 'requeued by an operator' FROM up)
		SELECT id FROM up`, d.Queue, pq.Array(ids))
	if err != nil {
		return nil, fmt.Errorf("requeue: reset rows: %w", err)
	}
	out := make(map[string]bool, len(moved))
	for _, id := range moved {
		out[id] = true
	}
	return out, nil
}
