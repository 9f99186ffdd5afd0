package tasks

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Task states in the durable tier.
const (
	StateScheduled = "SCHEDULED"
	StateExecuted  = "EXECUTED"
	StateCancelled = "CANCELLED"
	StateFailed    = "FAILED"
)

// Durable is the PostgreSQL tier of a durable queue (seeds 001 and 002):
// every task is a row in orderdelay_tasks, every state change a row in
// orderdelay_task_log, and Redis holds only the tasks due within Window.
// A loader, on one replica at a time, moves tasks into Redis as their
// window opens (tasks already due are picked up at once); executors check
// a task's state and version before the side effect, because the loader may
// re-add a task that was just executed or cancelled.
type Durable struct {
	DB     *sqlx.DB
	Queue  string
	Window time.Duration
	Client *client.Client
	Log    *zap.Logger
	now    func() time.Time
	// lockedHook, for tests, runs while Load holds the loader lock.
	lockedHook func()
}

func (d *Durable) clock() time.Time {
	if d.now != nil {
		return d.now()
	}
	return time.Now()
}

// ErrNotScheduled is returned by Cancel for a task that is not scheduled.
var ErrNotScheduled = errors.New("task is not scheduled")

// Put schedules a task in PostgreSQL first (the source of truth), then, when
// it is due within the window, in Redis. Create keeps an existing scheduled
// task as it is; Reschedule and OnlyLater move it (and bump its version).
func (d *Durable) Put(ctx context.Context, id string, payload json.RawMessage, due time.Time, mode client.Mode) (client.Result, time.Time, error) {
	if err := queue.ValidateSerial(id); err != nil {
		return client.Unchanged, time.Time{}, err
	}
	if err := queue.ValidateDeadline(queue.DeadlineMillis(due), d.clock()); err != nil {
		return client.Unchanged, time.Time{}, err
	}
	if len(payload) == 0 {
		payload = json.RawMessage("null")
	}
	if err := client.ValidatePayload(payload); err != nil {
		return client.Unchanged, time.Time{}, err
	}
	tx, err := d.DB.BeginTxx(ctx, nil)
	if err != nil {
		return client.Unchanged, time.Time{}, err
	}
	defer tx.Rollback() //nolint:errcheck // after Commit this is a no-op
	var cur struct {
		Due     time.Time `db:"due_at"`
		State   string    `db:"state"`
		Version int64     `db:"version"`
	}
	err = tx.GetContext(ctx, &cur, `SELECT due_at, state, version FROM orderdelay_tasks WHERE queue = $1 AND id = $2 FOR UPDATE`, d.Queue, id)
	res := client.Created
	switch {
	case errors.Is(err, sql.ErrNoRows):
		cur.Version = 1
		_, err = tx.ExecContext(ctx, `INSERT INTO orderdelay_tasks (queue, id, due_at, payload) VALUES ($1, $2, $3, $4)`,
			d.Queue, id, due, string(payload))
	case err != nil:
	case cur.State == StateScheduled && (mode == client.Create || (mode == client.OnlyLater && !due.After(cur.Due))):
		return client.Unchanged, cur.Due, nil
	default:
		res = client.Moved
		if cur.State != StateScheduled {
			res = client.Created // scheduled anew
		}
		cur.Version++
		_, err = tx.ExecContext(ctx, `UPDATE orderdelay_tasks SET due_at = $3, payload = $4, state = 'SCHEDULED',
			attempts = 0, version = $5, updated_at = now() WHERE queue = $1 AND id = $2`, d.Queue, id, due, string(payload), cur.Version)
	}
	if err == nil {
		err = d.log(ctx, tx, id, StateScheduled, cur.Version, "due "+due.UTC().Format(time.RFC3339Nano))
	}
	if err == nil {
		err = tx.Commit()
	}
	if err != nil {
		return client.Unchanged, time.Time{}, fmt.Errorf("durable put %q: %w", id, err)
	}
	// Redis follows: due within the window, the task is there with this
	// deadline; later, it is not there at all until the loader adds it.
	if due.Before(d.clock().Add(d.Window)) {
		_, _, err = d.Client.PutTask(ctx, id, payload, due, client.Reschedule)
	} else {
		_, err = d.Client.DeleteTasks(ctx, id)
	}
	switch {
	case errors.Is(err, client.ErrQueueFull):
		// The cap bounds Redis; the row is the task. The loader adds it
		// once the queue has room.
		d.Log.Info("durable task saved; Redis holds max_pending tasks, so it waits in PostgreSQL for the loader", zap.String("id", id))
	case err != nil:
		d.Log.Warn("durable task saved; Redis not updated, the loader will catch up", zap.String("id", id), zap.Error(err))
	}
	return res, due, nil
}

// Cancel cancels a scheduled task in both tiers.
func (d *Durable) Cancel(ctx context.Context, id string) error {
	var version int64
	err := d.DB.GetContext(ctx, &version, `UPDATE orderdelay_tasks SET state = 'CANCELLED', version = version + 1, updated_at = now()
		WHERE queue = $1 AND id = $2 AND state = 'SCHEDULED' RETURNING version`, d.Queue, id)
	if errors.Is(err, sql.ErrNoRows) {
		return ErrNotScheduled
	}
	if err != nil {
		return fmt.Errorf("durable cancel %q: %w", id, err)
	}
	if err := d.log(ctx, d.DB, id, StateCancelled, version, ""); err != nil {
		return err
	}
	if _, err := d.Client.DeleteTasks(ctx, id); err != nil {
		// The executor checks the state before acting, so a stale Redis
		// entry cannot fire a cancelled task.
		d.Log.Warn("durable task cancelled; its Redis entry stays until it is seen", zap.String("id", id), zap.Error(err))
	}
	return nil
}

// Row is a durable task's row.
type Row struct {
	ID       string          `json:"id" db:"id"`
	Due      time.Time       `json:"due_at" db:"due_at"`
	Payload  json.RawMessage `json:"payload" db:"payload"`
	State    string          `json:"state" db:"state"`
	Attempts int             `json:"attempts" db:"attempts"`
	Version  int64           `json:"version" db:"version"`
}

// Get returns a durable task's row.
func (d *Durable) Get(ctx context.Context, id string) (Row, error) {
	var r Row
	err := d.DB.GetContext(ctx, &r, `SELECT id, due_at, payload, state, attempts, version FROM orderdelay_tasks
		WHERE queue = $1 AND id = $2`, d.Queue, id)
	if errors.Is(err, sql.ErrNoRows) {
		return r, client.ErrNotFound
	}
	return r, err
}

type execer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

func (d *Durable) log(ctx context.Context, q execer, id, state string, version int64, detail string) error {
	_, err := q.ExecContext(ctx, `INSERT INTO orderdelay_task_log (queue, task_id, state, version, detail) VALUES ($1, $2, $3, $4, $5)`,
		d.Queue, id, state, version, detail)
	return err
}

// loaderPage bounds one loader query and pipeline.
const loaderPage = 2000

// Load moves scheduled tasks due within the window into Redis (NX: a task
// already there keeps its entry), under a transaction-level advisory lock
// so one replica loads at a time. It returns how many it added.
func (d *Durable) Load(ctx context.Context) (int, error) {
	tx, err := d.DB.BeginTxx(ctx, nil)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback() //nolint:errcheck // read-only apart from the lock
	h := fnv.New64a()
	h.Write([]byte("orderdelay loader " + d.Queue))
	if got, err := orders.TryAdvisoryXactLock(ctx, tx, int64(h.Sum64())); err != nil || !got {
		return 0, err
	}
	if d.lockedHook != nil {
		d.lockedHook()
	}
	// Walk the whole window in keyset order, so tasks loaded earlier (and
	// not yet executed) do not hide the ones behind them.
	added := 0
	after := struct {
		due time.Time
		id  string
	}{time.Unix(0, 0), ""}
	for {
		var rows []Row
		err = tx.SelectContext(ctx, &rows, `SELECT id, due_at, payload, state, attempts, version FROM orderdelay_tasks
			WHERE queue = $1 AND state = 'SCHEDULED' AND due_at < now() + $2 * interval '1 millisecond'
			  AND (due_at, id) > ($4, $5)
			ORDER BY due_at, id LIMIT $3`, d.Queue, d.Window.Milliseconds(), loaderPage, after.due, after.id)
		if err != nil || len(rows) == 0 {
			return added, err
		}
		items := make([]client.TaskItem, 0, len(rows))
		for _, r := range rows {
			// A row stored before payloads were bounded as they are now
			// (nesting depth) stays in the table, reported, rather than
			// failing every page it is on and so stopping the loader.
			if err := client.ValidatePayload(r.Payload); err != nil {
				d.Log.Warn("durable task not loaded: its payload is refused now", zap.String("id", r.ID), zap.Error(err))
				continue
			}
			items = append(items, client.TaskItem{ID: r.ID, Payload: r.Payload, Deadline: r.Due})
		}
		var res []client.Result
		if len(items) > 0 {
			res, err = d.Client.PutTasks(ctx, items, client.Create)
			var full *client.QueueFullError
			if errors.As(err, &full) {
				// Redis holds max_pending tasks: the refused ones stay
				// SCHEDULED in PostgreSQL and are loaded on a later
				// pass, once executed tasks have left room.
				d.Log.Debug("durable loader: the queue is at max_pending; tasks wait in PostgreSQL",
					zap.Int("tasks", len(full.Refused)), zap.Int64("max_pending", full.MaxPending))
				err = nil
			}
			if err != nil {
				return added, err
			}
		}
		for _, r := range res {
			if r == client.Created {
				added++
			}
		}
		last := rows[len(rows)-1]
		after.due, after.id = last.Due, last.ID
		if len(rows) < loaderPage {
			return added, nil
		}
	}
}

// RunLoader loads every tenth of the window (at most every 30 s) until ctx
// ends.
func (d *Durable) RunLoader(ctx context.Context) {
	every := min(d.Window/10, 30*time.Second)
	for {
		n, err := d.Load(ctx)
		switch {
		case err != nil && ctx.Err() == nil:
			d.Log.Warn("durable loader failed; retrying", zap.Error(err))
		case n > 0:
			d.Log.Debug("durable loader moved tasks into Redis", zap.Int("tasks", n))
		}
		wait := every
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
	}
}

// Executor wraps a queue's action: tasks that are no longer SCHEDULED in
// PostgreSQL are dropped without a side effect; after the action, the row
// moves to EXECUTED (or FAILED after the last attempt) with an optimistic
// lock on its version. A failure that spends no attempt (the action's
// consumer.Unavailable or consumer.Later, or the state check itself failing
// for a reason orders.Transient gives) leaves the row as it is: its
// attempts are not bumped. Outcomes are recorded even when the batch's
// context ended during the action, so a task the action did is EXECUTED
// and not loaded again; on a shutdown (ctx cancelled) failed tasks' rows
// stay as they are, as the consumer hands those tasks back.
func (d *Durable) Executor(action consumer.ProcessFunc, maxAttempts int) consumer.ProcessFunc {
	return func(ctx context.Context, tasks []consumer.Task) []error {
		errs := make([]error, len(tasks))
		ids := make([]string, len(tasks))
		for i, t := range tasks {
			ids[i] = t.ID
		}
		var rows []struct {
			ID      string    `db:"id"`
			State   string    `db:"state"`
			Version int64     `db:"version"`
			Due     time.Time `db:"due_at"`
			NotDue  bool      `db:"not_due"`
		}
		if err := d.DB.SelectContext(ctx, &rows, `SELECT id, state, version, due_at, due_at > now() AS not_due
			FROM orderdelay_tasks WHERE queue = $1 AND id = ANY($2)`,
			d.Queue, pq.Array(ids)); err != nil {
			if orders.Transient(err) {
				err = consumer.Unavailable(err) // the database's, not the tasks': no attempt
			}
			for i := range errs {
				errs[i] = err
			}
			return errs
		}
		version := map[string]int64{}
		later := map[string]int64{} // rows not due yet: due time, Unix ms rounded up as in Redis
		known := make(map[string]bool, len(rows))
		for _, r := range rows {
			known[r.ID] = true
			if r.State == StateScheduled {
				version[r.ID] = r.Version
				if r.NotDue {
					later[r.ID] = queue.DeadlineMillis(r.Due)
				}
			}
		}
		var live []consumer.Task
		var at []int
		for i, t := range tasks {
			_, ok := version[t.ID]
			if due, notDue := later[t.ID]; ok && notDue && !t.Deadline.IsZero() && due > t.Deadline.UnixMilli() {
				// The row is not due yet, and due later than this entry: a
				// stale copy (a
				// loader that read the row before a reschedule moved it
				// out of the window re-added it after the reschedule
				// removed it from Redis). Dropped without a side effect;
				// the loader adds the task again when its window opens.
				// (A task without a deadline, which the consumer never
				// hands over, is not compared.)
				d.Log.Info("durable task not run: its row is due later than its Redis entry", zap.String("id", t.ID))
				continue
			}
			if ok {
				live = append(live, t)
				at = append(at, i)
			} // else: executed, cancelled, failed or unknown: done, no side effect
			if !known[t.ID] {
				// Only a write past the durable tier makes this: a raw
				// ZADD, an older client that does not read the queue's
				// meta, or a queue made durable with tasks already in Redis.
				d.Log.Warn("durable task dropped: it has no row (written to Redis past the durable tier)", zap.String("id", t.ID))
			}
		}
		if len(live) == 0 {
			return errs
		}
		out := action(withLive(ctx, d.scheduled(version)), live)
		// The outcomes are recorded even if the batch's context ended
		// meanwhile (its time, or a shutdown cutting an isolation): a task
		// the action did is EXECUTED, or the loader would put it back and
		// run it again. On a shutdown (ctx cancelled) the consumer hands
		// failed tasks back without spending an attempt, so their rows
		// stay as they are too.
		bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
		defer cancel()
		shutdown := errors.Is(ctx.Err(), context.Canceled)
		final := map[string][]string{} // state -> ids
		vers := map[string][]int64{}
		details := map[string][]string{}
		for j, t := range live {
			errs[at[j]] = out[j]
			state, detail := StateExecuted, ""
			var na *consumer.NoAttemptError
			if errors.As(out[j], &na) {
				continue // spends no attempt (see consumer.NoAttemptError): the row stays as it is
			}
			if out[j] != nil {
				if t.Attempts+1 < maxAttempts {
					if !shutdown {
						d.bumpAttempts(bctx, t.ID, version[t.ID])
					}
					continue
				}
				state, detail = StateFailed, out[j].Error()
			}
			final[state] = append(final[state], t.ID)
			vers[state] = append(vers[state], version[t.ID])
			details[state] = append(details[state], detail)
		}
		for state, ids := range final {
			if state != StateExecuted && shutdown {
				continue
			}
			d.settle(bctx, state, ids, vers[state], details[state])
		}
		return errs
	}
}

// bumpAttempts records a spent attempt on the row of the version that ran:
// a producer's reschedule meanwhile (a new version, attempts back to 0) is a
// new schedule that the old run's failure does not count against.
// settleTimeout bounds the executor's recording of outcomes once the
// batch's own context has ended.
const settleTimeout = 5 * time.Second

func (d *Durable) bumpAttempts(ctx context.Context, id string, version int64) {
	if _, err := d.DB.ExecContext(ctx, `UPDATE orderdelay_tasks SET attempts = attempts + 1, updated_at = now()
		WHERE queue = $1 AND id = $2 AND state = 'SCHEDULED' AND version = $3`, d.Queue, id, version); err != nil {
		d.Log.Warn("durable: recording an attempt failed", zap.String("id", id), zap.Error(err))
	}
}

// settle moves rows to their final state, each only if its version is
// unchanged (optimistic locking), and logs the change, in one transaction.
func (d *Durable) settle(ctx context.Context, state string, ids []string, versions []int64, details []string) {
	err := func() error {
		tx, err := d.DB.BeginTxx(ctx, nil)
		if err != nil {
			return err
		}
		defer tx.Rollback() //nolint:errcheck // after Commit this is a no-op
		var moved int
		err = tx.GetContext(ctx, &moved, `WITH v AS (SELECT * FROM unnest($2::text[], $3::bigint[], $5::text[]) AS v(id, version, detail)),
			up AS (UPDATE orderdelay_tasks t SET state = $4, version = t.version + 1, updated_at = now()
				FROM v WHERE t.queue = $1 AND t.id = v.id AND t.version = v.version RETURNING t.id, t.version),
			logged AS (INSERT INTO orderdelay_task_log (queue, task_id, state, version, detail)
				SELECT $1, up.id, $4, up.version, nullif(v.detail, '') FROM up JOIN v USING (id) RETURNING 1)
			SELECT count(*) FROM logged`, d.Queue, pq.Array(ids), pq.Array(versions), state, pq.Array(details))
		if err != nil {
			return err
		}
		if moved < len(ids) {
			// Rows whose version moved on while the action ran (a cancel,
			// a reschedule) keep what that change made of them; the log
			// says the action ran and its outcome was not applied. A row
			// already settled to this very outcome from this version (a
			// twin run whose lease expired under it, a replayed settle)
			// is left alone: the settle is idempotent.
			stale, err := tx.ExecContext(ctx, `INSERT INTO orderdelay_task_log (queue, task_id, state, version, detail)
				SELECT $1, v.id, $4, v.version, 'not applied: the task changed while the action ran (now ' || t.state ||
					' at version ' || t.version || ')' || coalesce('; ' || nullif(v.detail, ''), '')
				FROM unnest($2::text[], $3::bigint[], $5::text[]) AS v(id, version, detail)
				JOIN orderdelay_tasks t ON t.queue = $1 AND t.id = v.id
				WHERE t.version <> v.version AND NOT (t.state = $4 AND t.version = v.version + 1)`,
				d.Queue, pq.Array(ids), pq.Array(versions), state, pq.Array(details))
			if err != nil {
				return err
			}
			n, err := stale.RowsAffected()
			if err != nil {
				return err
			}
			d.Log.Info("durable tasks changed while they ran; their new versions stand",
				zap.Int("tasks", len(ids)-moved), zap.Int64("changed", n), zap.Int64("settled_already", int64(len(ids)-moved)-n))
		}
		return tx.Commit()
	}()
	if err != nil {
		d.Log.Warn("durable: recording outcomes failed", zap.Int("tasks", len(ids)), zap.Error(err))
	}
}
