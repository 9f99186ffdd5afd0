package consumer

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/orderdelay/orderdelay/internal/metrics"
)

// The one statement has no FOR UPDATE pass: its update locks rows in the
// order of its scan (the primary key: serial order). A shop's job that
// locks the same orders in another order deadlocks with it, as it did with
// the pre-pass. Here the close waits for the job's row and the job then
// waits for one the close holds: PostgreSQL aborts the close (40P01, it
// detects the cycle first), the error is classified as one a row can
// cause, the batch is closed order by order, and every order closes in
// this round, none dead-lettered, no attempt spent.
func TestRealDeadlockWithAShopJobLosesNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	// The lock timeout must outlast deadlock_timeout (1s) for the cycle to
	// be found rather than cut.
	e.Store.SetTimeouts(10*time.Second, 5*time.Second)
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	serials := e.Orders("dl", 10, past)
	e.Enqueue(serials, past)
	first, last := serials[0], serials[len(serials)-1]

	job, err := e.DB.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer job.Rollback() //nolint:errcheck
	var jobPID int
	if err := job.Get(&jobPID, `SELECT pg_backend_pid()`); err != nil {
		t.Fatal(err)
	}
	// The job finds no deadlock itself; the close's backend does.
	if _, err := job.Exec(`SET LOCAL deadlock_timeout = '60s'`); err != nil {
		t.Fatal(err)
	}
	if _, err := job.Exec(`UPDATE orders SET created_at = created_at WHERE serial_no = $1`, last); err != nil {
		t.Fatal(err)
	}

	core, logs := observer.New(zap.WarnLevel)
	c, err := New(Config{Keys: e.Keys, BatchSize: 10, StatementTimeout: 10 * time.Second, Lease: time.Minute},
		e.RDB, e.Store, e.m, zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	c.stopping = make(chan struct{})
	res := claimN(t, c, 10)
	processed := make(chan struct{})
	go func() { defer close(processed); c.process(ctx, res.items) }()
	e.waitBlockedBy(t, jobPID) // the close holds the others and waits for the last
	jobDone := make(chan error, 1)
	go func() {
		_, err := job.Exec(`UPDATE orders SET created_at = created_at WHERE serial_no = $1`, first)
		jobDone <- err
	}()
	if err := <-jobDone; err != nil {
		t.Fatalf("the job's second update: %v (the close should have been the deadlock's victim)", err)
	}
	if err := job.Commit(); err != nil {
		t.Fatal(err)
	}
	<-processed

	if logs.FilterMessageSnippet("order by order").FilterFieldKey("error").Len() == 0 ||
		!strings.Contains(logs.FilterMessageSnippet("order by order").All()[0].ContextMap()["error"].(string), "40P01") {
		t.Fatalf("no deadlock (40P01) was handled; logs: %v", logs.All())
	}
	if got := e.StatusCounts(); got["closed"] != 10 {
		t.Errorf("statuses %v, want all 10 closed in this round", got)
	}
	if n := testutil.ToFloat64(e.m.DeadLettered.WithLabelValues("close_failed")); n != 0 || e.card(e.Keys.Dead) != 0 {
		t.Errorf("%v orders dead-lettered after a deadlock", n)
	}
	if n := e.card(e.Keys.Queue) + e.held(); n != 0 {
		t.Errorf("%d entries left, want none", n)
	}
	if v := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageClose)); v != 1 {
		t.Errorf("close errors %v, want 1 (the deadlock)", v)
	}
}

// waitBlockedBy waits until some backend waits for a lock held by pid.
func (e *env) waitBlockedBy(t *testing.T, pid int) {
	eventually(t, "a close blocked by the shop's job", 30*time.Second, func() bool {
		var n int
		err := e.DB.Get(&n, `SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))`, pid)
		return err == nil && n > 0
	})
}
