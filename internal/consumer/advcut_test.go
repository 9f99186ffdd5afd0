package consumer

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Adversarial review (advcut) of f92a016: after the drain's cut, every
// bookkeeping call of a batch ends by one deadline, BookkeepingTimeout
// from the cut.
//
// Invariant (Run's doc, step 3; README "Shutdown", step 2): what the drain
// cut is handed back with its true deadline, "on a fresh, bounded
// context". A batch can reach its hand-back more than BookkeepingTimeout
// after the cut without any dependency hanging: its COMMIT was in flight
// at the cut (a deferred trigger, a synchronous standby: lib/pq's Commit
// takes no context, so the cut does not end it) and lost its answer (the
// database's connections cut, as in a failover), so the close asks the
// server what became of it on a context of its own (Store.committed,
// commitStatusWait: 5 s, retrying while the server refuses connections).
// Then the hand-back's deadline has passed before it is made: go-redis
// sends nothing, and the entry stays leased for the whole lease, although
// Redis answered all along. Before f92a016 the hand-back had its own 5 s
// and was sent (the entry queued again at once, with its true deadline).
// Here the database went away just after the cut, before the COMMIT
// committed: the order is still pending, and no replica can close it
// until the lease ends (40 s here, 1 min by default), while its hand-back
// would have made it due again at once. Nothing is lost, but the drain's
// hand-back was skipped for a batch that met no hung dependency (failed
// at d4f9b81); the hand-back now keeps a deadline of its own.
func TestAdvCutAHandBackAfterACommitStatusCheckIsSentWhileRedisAnswers(t *testing.T) {
	t.Parallel()
	e, px := newProxiedEnv(t)
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	serial := e.Orders("cutcommit", 1, past)[0]
	// A shop's deferred constraint trigger: every COMMIT that closed an
	// order takes 3 s (runs at COMMIT, under the 5 s statement_timeout).
	if _, err := e.DB.Exec(`CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep(3); RETURN NULL; END $$;
CREATE CONSTRAINT TRIGGER slow_commit AFTER UPDATE ON orders DEFERRABLE INITIALLY DEFERRED
  FOR EACH ROW EXECUTE FUNCTION slow_commit();`); err != nil {
		t.Fatal(err)
	}
	e.Enqueue([]string{serial}, past)
	core, logs := observer.New(zap.InfoLevel)
	c, err := New(Config{Keys: e.Keys, HeadCheck: 20 * time.Millisecond, BatchSize: 10, Workers: 1,
		StatementTimeout: 5 * time.Second, Lease: 40 * time.Second, DrainTimeout: 100 * time.Millisecond,
		BackoffMax: time.Second, MaxAttempts: 3}, e.RDB, e.Store, e.m, zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	stop := runConsumer(t, c)
	eventually(t, "the close's COMMIT running its deferred trigger", 15*time.Second, func() bool {
		var n int
		if err := e.DB.Get(&n, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
			AND state = 'active' AND query = 'COMMIT'`); err != nil {
			t.Fatal(err)
		}
		return n == 1
	})
	stopped := make(chan struct{})
	go func() { defer close(stopped); stop() }()
	// The drain (100 ms) passes with the COMMIT still running: the cut.
	eventually(t, "the drain's cut", 10*time.Second, func() bool { return c.bookEnd.Load() != 0 })
	cut := time.Now()
	// Just after the cut, the database goes away (a restart, a
	// failover): its connections are cut, the COMMIT's backend is ended
	// before its transaction committed, and the status check finds the
	// server refusing connections for its 5 s.
	px.Down()
	if _, err := e.DB.Exec(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database()
		AND state = 'active' AND query = 'COMMIT'`); err != nil {
		t.Fatal(err)
	}
	select {
	case <-stopped:
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return")
	}
	t.Logf("Run returned %s after the cut", time.Since(cut).Round(time.Millisecond))
	if st := e.Status(serial); st != "pending" {
		t.Fatalf("the order is %s: its COMMIT was to be ended before it committed", st)
	}
	got, err := e.cl.Get(ctx, serial)
	if err != nil {
		t.Fatal(err)
	}
	failedHB := logs.FilterMessageSnippet("hand-back failed").Len()
	if got.State == client.StateLeased || failedHB > 0 {
		t.Errorf("after the stop the entry is %s (owner %q), %d 'hand-back failed' lines: the drain's hand-back was never sent, "+
			"with Redis answering, because its deadline (the cut + %s) passed while the close asked what became of its COMMIT; "+
			"the order, still pending, waits out its %s lease before anyone closes it", got.State, got.Owner, failedHB, BookkeepingTimeout, c.cfg.Lease)
		for _, l := range logs.FilterMessageSnippet("hand-back failed").All() {
			t.Logf("log: %s %v", l.Message, l.ContextMap())
		}
	} else if got.Deadline.UnixMilli() != queue.DeadlineMillis(past) {
		t.Errorf("handed back due at %v, want its true deadline %v", got.Deadline, past)
	}
}
