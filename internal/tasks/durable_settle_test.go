package tasks

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// newTestDurable is a durable tier on a database and a queue of the
// test's own, with its log observed.
func newTestDurable(t *testing.T) (*Durable, *observer.ObservedLogs) {
	t.Helper()
	rdb, keys := testenv.Redis(t)
	db, _ := testenv.Postgres(t)
	core, logs := observer.New(zapcore.DebugLevel)
	d, err := NewDurable(db, Queue{Name: "q", Key: keys.Queue, Window: Duration(time.Minute)}, rdb, zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	return d, logs
}

// redisDeadline is due as a claimed task carries it: Unix ms, rounded up.
func redisDeadline(due time.Time) time.Time { return time.UnixMilli(queue.DeadlineMillis(due)) }

type logRow struct {
	State   string `db:"state"`
	Version int64  `db:"version"`
	Detail  string `db:"detail"`
}

func taskLog(t *testing.T, d *Durable, id string) []logRow {
	t.Helper()
	var rows []logRow
	if err := d.DB.Select(&rows, `SELECT state, version, coalesce(detail, '') AS detail FROM orderdelay_task_log
		WHERE queue = $1 AND task_id = $2 ORDER BY id`, d.Queue, id); err != nil {
		t.Fatal(err)
	}
	return rows
}

func noWarnings(t *testing.T, logs *observer.ObservedLogs) {
	t.Helper()
	for _, e := range logs.FilterLevelExact(zapcore.WarnLevel).All() {
		t.Errorf("warning logged: %s %v", e.Message, e.ContextMap())
	}
}

// The executor reads a task's version before the action; a cancel or a
// reschedule that lands while the action runs bumps it, so the settle
// leaves the row as the cancel or reschedule made it, and the task log
// records that the action ran at the old version and its outcome was not
// applied.
func TestDurableSettleKeepsAChangeMadeWhileTheTaskRan(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		change func(ctx context.Context, d *Durable, id string) error
		state  string
	}{
		{"cancel", func(ctx context.Context, d *Durable, id string) error { return d.Cancel(ctx, id) }, StateCancelled},
		{"reschedule", func(ctx context.Context, d *Durable, id string) error {
			_, _, err := d.Put(ctx, id, json.RawMessage(`{"moved":true}`), time.Now().Add(time.Hour), client.Reschedule)
			return err
		}, StateScheduled},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, logs := newTestDurable(t)
			ctx := context.Background()
			due := time.Now().Add(time.Second)
			if _, _, err := d.Put(ctx, "t-1", nil, due, client.Create); err != nil {
				t.Fatal(err)
			}
			ran := 0
			action := func(ctx context.Context, ts []consumer.Task) []error {
				ran++
				if err := tc.change(ctx, d, ts[0].ID); err != nil { // lands between the version read and the settle
					t.Fatal(err)
				}
				return make([]error, len(ts))
			}
			errs := d.Executor(action, 3)(ctx, []consumer.Task{{ID: "t-1", Deadline: redisDeadline(due)}})
			if ran != 1 || errs[0] != nil {
				t.Fatalf("action ran %d times, error %v", ran, errs[0])
			}
			row, err := d.Get(ctx, "t-1")
			if err != nil {
				t.Fatal(err)
			}
			if row.State != tc.state || row.Version != 2 {
				t.Errorf("row %s at version %d; want %s at version 2 (the %s's), not overwritten by the settle", row.State, row.Version, tc.state, tc.name)
			}
			log := taskLog(t, d, "t-1")
			last := log[len(log)-1]
			if len(log) != 3 || last.State != StateExecuted || last.Version != 1 || !strings.Contains(last.Detail, "not applied") ||
				!strings.Contains(last.Detail, tc.state) {
				t.Errorf("task log %+v; want SCHEDULED 1, %s 2, then EXECUTED at version 1 saying it was not applied over %s", log, tc.state, tc.state)
			}
			noWarnings(t, logs)
		})
	}
}

// Two executors run the same task at the same version (a lease expired
// while the first still ran): the second settle finds the first one's
// outcome and is a no-op: one EXECUTED log row, no error.
func TestDurableSecondSettleIsIdempotent(t *testing.T) {
	t.Parallel()
	d, logs := newTestDurable(t)
	ctx := context.Background()
	due := time.Now().Add(time.Second)
	if _, _, err := d.Put(ctx, "t-1", nil, due, client.Create); err != nil {
		t.Fatal(err)
	}
	ran := 0
	ok := func(ctx context.Context, ts []consumer.Task) []error { ran++; return make([]error, len(ts)) }
	exec := d.Executor(ok, 3)
	slow := d.Executor(func(ctx context.Context, ts []consumer.Task) []error {
		ran++
		if errs := exec(ctx, ts); errs[0] != nil { // the twin runs and settles meanwhile
			t.Fatal(errs[0])
		}
		return make([]error, len(ts))
	}, 3)
	if errs := slow(ctx, []consumer.Task{{ID: "t-1", Deadline: redisDeadline(due)}}); errs[0] != nil {
		t.Fatal(errs[0])
	}
	if ran != 2 {
		t.Fatalf("action ran %d times, want 2 (at least once: both executors)", ran)
	}
	row, err := d.Get(ctx, "t-1")
	if err != nil || row.State != StateExecuted || row.Version != 2 {
		t.Errorf("row %+v, %v; want EXECUTED at version 2", row, err)
	}
	n := 0
	for _, l := range taskLog(t, d, "t-1") {
		if l.State == StateExecuted {
			n++
		}
	}
	if n != 1 {
		t.Errorf("%d EXECUTED log rows, want 1: %+v", n, taskLog(t, d, "t-1"))
	}
	// And a settle replayed for the same version, later, changes nothing.
	d.settle(ctx, StateExecuted, []string{"t-1"}, []int64{1}, []string{""})
	if got := taskLog(t, d, "t-1"); len(got) != 2 {
		t.Errorf("task log after a replayed settle: %+v; want SCHEDULED, EXECUTED", got)
	}
	noWarnings(t, logs)
}
