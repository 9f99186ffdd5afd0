package tasks

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Tasks whose statement always times out (a function sleeping past the
// statement timeout for their rows), ahead of good tasks in one batch of a
// sql action's queue: the good tasks must be done within a bounded number
// of rounds that make no progress, as the order queue's are
// (consumer.TestPoisonRowsAheadOfTheirBatchDoNotHoldItBack). A round is
// one batch of the daemon's own consumer of the queue
// (Manager.consumerConfig); between rounds the test makes what the round
// sent back due, keeping the order of the expiries (dueAllTasks): a
// backlog, as if it had waited for the last retry.
func TestSQLTaskSlowRowsAheadOfTheirBatchDoNotHoldItBack(t *testing.T) {
	t.Parallel()
	for _, slowRows := range []int{3, 5} {
		t.Run(fmt.Sprintf("%d slow rows", slowRows), func(t *testing.T) {
			t.Parallel()
			testSlowRowsAhead(t, slowRows, 8, false)
		})
	}
	// Rows another transaction holds (each statement waits out its
	// lock_timeout, 55P03, a costly error as a statement timeout is).
	t.Run("3 locked rows", func(t *testing.T) {
		t.Parallel()
		testSlowRowsAhead(t, 3, 8, true)
	})
}

func testSlowRowsAhead(t *testing.T, slowRows, goodRows int, locked bool) {
	db, _ := testenv.Postgres(t)
	sqlFixture(t, db)
	// slow_tries counts the statements that reached a slow row (a sequence
	// survives the rollback of the statement it ran in).
	if _, err := db.Exec(`CREATE SEQUENCE slow_tries;
		CREATE OR REPLACE FUNCTION check_item(id text) RETURNS boolean LANGUAGE plpgsql AS $$
		BEGIN
			IF id LIKE 'a-slow%' THEN PERFORM nextval('slow_tries'); PERFORM pg_sleep(30); END IF;
			RETURN true;
		END $$`); err != nil {
		t.Fatal(err)
	}
	// A lease of 4 s: each batch has most of it, each statement a quarter
	// of what is left (sqlStatementShare), so a loaded machine's overhead
	// still leaves a round time for the batch's statement and two tasks
	// alone.
	s := newShutdownEnv(t, `lease: 4s, batch_size: 20, workers: 1, retry: {max_attempts: 3},
    action: {type: sql, statement: "UPDATE items SET done = true WHERE id = ANY($1) AND check_item(id) RETURNING id"}`, db)
	past := time.Now().Add(-time.Second)
	prefix := "a-slow"
	if locked {
		prefix = "a-lock" // not slow: only locked
	}
	slow := s.put(prefix, slowRows, past) // they sort first: a claim takes them first
	good := s.put("b-good", goodRows, past)
	all := append(append([]string{}, slow...), good...)
	for _, id := range all {
		if _, err := db.Exec(`INSERT INTO items (id) VALUES ($1)`, id); err != nil {
			t.Fatal(err)
		}
	}
	if locked {
		for _, id := range slow {
			holdRow(t, db, id)
		}
	}
	ctx := context.Background()

	// Each batch pauses the queue as it ends, so the next claim waits for
	// the test to make the batch's retries due; its ids go to batches.
	batches := make(chan []string, 1)
	cfg := s.m.consumerConfig(s.r)
	inner := cfg.Process
	cfg.Process = func(ctx context.Context, tasks []consumer.Task) []error {
		errs := inner(ctx, tasks)
		if err := s.r.Store.Pause(context.Background(), time.Now(), "test: between rounds"); err != nil {
			t.Errorf("pause: %v", err)
		}
		ids := make([]string, len(tasks))
		for i, tk := range tasks {
			ids[i] = tk.ID
		}
		batches <- ids
		return errs
	}
	c, err := consumer.New(cfg, s.rdb, nil, s.r.Metrics, zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel)))
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	stopped := make(chan struct{})
	go func() { defer close(stopped); c.Run(runCtx) }() //nolint:errcheck // nil once runCtx ends
	defer func() { cancel(); <-stopped }()

	short := func(id string) string { return id[:1] + id[len(id)-2:] } // a-slow-03 -> a03
	doneGood := func() int {
		n := 0
		for _, id := range good {
			if _, err := s.r.Client.GetTask(ctx, id); errors.Is(err, client.ErrNotFound) {
				n++
			}
		}
		return n
	}
	// settled waits until the round's bookkeeping is done: no task leased.
	settled := func() bool {
		for _, id := range all {
			tk, err := s.r.Client.GetTask(ctx, id)
			if errors.Is(err, client.ErrNotFound) {
				continue
			}
			if err != nil {
				t.Fatal(err)
			}
			if tk.State == client.StateLeased {
				return false
			}
			if tk.Attempts != 0 || tk.State == client.StateDead {
				t.Fatalf("task %s: state %s, %d attempts; a timeout or an untried task must spend none", id, tk.State, tk.Attempts)
			}
		}
		return true
	}

	// The bound is on progress, not time: the run fails after this many
	// rounds in a row in which no good task was done. A round sends at
	// least one slow row behind the good tasks (a loaded machine may leave
	// it time for only one alone), so twice the slow rows is ample.
	stallBound := 2*slowRows + 2
	stalled, before, tries := 0, 0, 0
	for round := 1; ; round++ {
		var ids []string
		select {
		case ids = <-batches:
		case <-time.After(2 * time.Minute): // a hang guard, not a budget
			t.Fatalf("round %d: no batch ran", round)
		}
		eventually(t, "the round's bookkeeping", settled)
		order := make([]string, len(ids))
		for i, id := range ids {
			order[i] = short(id)
		}
		var n int
		if err := db.Get(&n, `SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM slow_tries`); err != nil {
			t.Fatal(err)
		}
		got := doneGood()
		t.Logf("round %d: claimed %v; %d statements reached a slow row; %d of %d good tasks done",
			round, order, n-tries, got, len(good))
		tries = n
		if got == len(good) {
			break
		}
		if got > before {
			stalled = 0
		} else if stalled++; stalled >= stallBound {
			t.Fatalf("after %d rounds, %d in a row without progress, %d of %d good tasks done: slow rows ahead of them hold them back",
				round, stalled, got, len(good))
		}
		before = got
		dueAllTasks(t, s.rdb, s.r.Keys.Inflight)
		if err := s.r.Store.Resume(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if rows := doneRows(t, db); len(rows) != len(good) || !strings.HasPrefix(rows[0], "b-good") {
		t.Errorf("rows done %v, want the good tasks'", rows)
	}
	for _, id := range slow { // kept, backing off, no attempt spent (settled checked)
		if _, err := s.r.Client.GetTask(ctx, id); err != nil {
			t.Errorf("slow task %s lost: %v", id, err)
		}
	}
}

// dueAllTasks makes every backoff in inflight due now, as if the test had
// waited for the last of them, keeping their order: each expiry moves back
// by the same amount (as the consumer tests' dueAll). Only between rounds,
// when nothing is leased.
func dueAllTasks(t *testing.T, rdb *redis.Client, inflight string) {
	t.Helper()
	ctx := context.Background()
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	zs, err := rdb.ZRangeWithScores(ctx, inflight, 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(zs) == 0 {
		return
	}
	shift := int64(zs[len(zs)-1].Score) - (now.UnixMilli() - 1)
	if shift <= 0 {
		return
	}
	moved := make([]redis.Z, len(zs))
	for i, z := range zs {
		moved[i] = redis.Z{Score: z.Score - float64(shift), Member: z.Member}
	}
	if err := rdb.ZAdd(ctx, inflight, moved...).Err(); err != nil {
		t.Fatal(err)
	}
}
