package consumer

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/maintain"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Adversarial interleavings against the close path of 1b460ec. Each test
// drives the pieces step by step (claim, process, the reconciler's page) and
// injects the other party's action at the exact point where it hurts.

// pausingStore pauses one close between its fence and its COMMIT, as a
// replica SIGSTOPped there would: the rows stay locked by its open
// transaction, the fence already said yes.
type pausingStore struct {
	*orders.Store
	paused  chan struct{} // closed when the close is paused after its fence
	release chan struct{} // close to let it commit
}

func (p *pausingStore) Settle(ctx context.Context, serials []string, fence orders.Fence) (orders.Outcome, error) {
	return p.Store.Settle(ctx, serials, func(ctx context.Context, closed []string) ([]string, error) {
		drop, err := fence(ctx, closed)
		close(p.paused)
		<-p.release
		return drop, err
	})
}

// Invariant (e) (and (f) for the dead-letter set): replica A's close passed
// its fence and A stops before COMMIT (SIGSTOP, a long GC pause, a stalled
// network) for longer than its lease. Replica B re-claims the order; its
// close finds the row locked by A's open transaction (55P03), spends an
// attempt each time and, after MaxAttempts, dead-letters the order as
// close_failed. A then resumes and commits: the order is closed and also
// sits in the dead-letter set. Nothing about the order was poisonous.
//
// With the defaults this takes a stop of minutes (10 attempts with backoff
// up to 5m), which is what a stopped process does: PostgreSQL keeps an idle
// transaction open forever. Fix: SET LOCAL idle_in_transaction_session_timeout
// (below the lease) in the close transaction, so a stalled replica's
// transaction is ended by the server before its lease can expire (its late
// COMMIT then fails and it closes nothing; B finds the row free); and do not
// spend attempts, or at least never dead-letter, for 55P03 on a row whose
// order is otherwise closable (back off with the cap instead).
func TestAdversaryStalledReplicaBeforeCommitNeverDeadLettersTheOrder(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	e.Store.SetTimeouts(5*time.Second, 50*time.Millisecond)
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	s := e.Orders("stalled", 1, past)[0]
	e.Enqueue([]string{s}, past)

	// Replica A: claims, closes, passes its fence, stops before COMMIT.
	a := e.consumer(Config{Owner: "A"})
	ps := &pausingStore{Store: e.Store, paused: make(chan struct{}), release: make(chan struct{})}
	a.store = ps
	resA, err := a.claimBatch(ctx)
	if err != nil || len(resA.items) != 1 {
		t.Fatalf("A claim: %v, %d items", err, len(resA.items))
	}
	doneA := make(chan struct{})
	go func() { defer close(doneA); a.process(ctx, resA.items) }()
	defer func() {
		select {
		case <-ps.release:
		default:
			close(ps.release)
		}
		<-doneA
	}()
	<-ps.paused

	// A's lease expires while it is stopped; replica B takes over.
	b := e.consumer(Config{Owner: "B", MaxAttempts: 2})
	b.stopping = make(chan struct{})
	for round := 0; round < 2; round++ {
		e.expire(s)
		res, err := b.claimBatch(ctx)
		if err != nil || len(res.items) != 1 {
			t.Fatalf("B claim %d: %v, %d items", round, err, len(res.items))
		}
		b.process(ctx, res.items)
	}
	close(ps.release) // A resumes and commits
	<-doneA

	if st := e.Status(s); st != "closed" {
		t.Fatalf("status %s, want closed (A's commit)", st)
	}
	got, err := e.cl.Get(ctx, s)
	if err == nil && got.State == client.StateDead {
		t.Fatalf("order %s is closed and dead-lettered (%s, %s): a row locked by a stalled replica "+
			"is not a poisonous order", s, got.Reason, got.LastError)
	}
}

// Invariant (e), issue 11 item 5, still open after 1b460ec: the database
// turns read-only (a failover to a standby, 25006). The close statement
// fails with an error about the database, not the order, yet the batch is
// bisected and every order in it dead-lettered.
func TestAdversaryReadOnlyDatabaseDeadLettersNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	serials := e.Orders("readonly", 4, past)
	e.Enqueue(serials, past)
	// The server answers 25006 as a standby does after a failover (BEGIN
	// READ WRITE fails there; lib/pq always asks READ WRITE, so
	// default_transaction_read_only cannot stand in for it: a trigger does).
	if _, err := e.DB.Exec(`CREATE FUNCTION standby() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'cannot execute UPDATE in a read-only transaction' USING ERRCODE = 'read_only_sql_transaction'; END $$;
CREATE TRIGGER standby BEFORE UPDATE ON orders FOR EACH ROW EXECUTE FUNCTION standby()`); err != nil {
		t.Fatal(err)
	}

	c := e.consumer(Config{BatchSize: 4})
	stop := make(chan struct{})
	close(stop) // do not hold the worker for the backoff
	c.stopping = stop
	res := claimN(t, c, 4)
	c.process(ctx, res.items)
	if n := e.card(e.Keys.Dead); n != 0 {
		t.Fatalf("%d of %d orders dead-lettered because the database was read-only", n, len(serials))
	}
}

// Invariants (d) and (e) with a custom schema whose serial column is
// char(n): Verify accepts a BPCHAR result column, but PostgreSQL returns it
// blank-padded, so the closed serials never match the claimed ones. The
// fence (asked about "S   ", which has no lease record) drops them all,
// closeTx reports "fence dropped serials that were not closed", the error is
// taken as bad data, the batch is bisected and every order dead-lettered;
// none is ever closed by the fast path.
//
// Fixed: serials read from a BPCHAR column are trimmed of their padding
// (PostgreSQL ignores it when comparing), in the close, lookup and overdue
// results alike.
func TestAdversaryBlankPaddedSerialsAreAllDeadLettered(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	if _, err := e.DB.Exec(`CREATE TABLE shop_orders (serial_no char(24) PRIMARY KEY,
		status text NOT NULL DEFAULT 'pending', expires_at timestamptz NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	stmts := orders.Statements{
		Close:  `UPDATE shop_orders SET status = 'closed' WHERE serial_no = ANY($1::text[]) AND status = 'pending' RETURNING serial_no`,
		Lookup: `SELECT serial_no, status = 'pending' FROM shop_orders WHERE serial_no = ANY($1::text[])`,
		Overdue: `SELECT serial_no FROM shop_orders WHERE status = 'pending'
			AND expires_at < now() - $1::bigint * interval '1 millisecond' ORDER BY expires_at LIMIT $2::bigint`,
	}
	e.Store = orders.NewStore(e.DB, stmts)
	if err := e.Store.Verify(ctx); err != nil {
		t.Skipf("Verify refuses the char(n) statements (%v): the hole is closed at start", err)
	}
	past := e.RedisNow().Add(-time.Second)
	serials := []string{"pad-1", "pad-2"}
	for _, s := range serials {
		if _, err := e.DB.Exec(`INSERT INTO shop_orders (serial_no, expires_at) VALUES ($1, $2)`, s, past); err != nil {
			t.Fatal(err)
		}
	}
	e.Enqueue(serials, past)
	c := e.consumer(Config{})
	res := claimN(t, c, 2)
	c.process(ctx, res.items)
	var closed int
	if err := e.DB.Get(&closed, `SELECT count(*) FROM shop_orders WHERE status = 'closed'`); err != nil {
		t.Fatal(err)
	}
	if n := e.card(e.Keys.Dead); n != 0 || closed != 2 {
		t.Fatalf("%d closed, %d dead-lettered; want 2 closed, none dead-lettered", closed, n)
	}
	// The reconciler reads padded serials too: a lost order must close.
	if _, err := e.DB.Exec(`INSERT INTO shop_orders (serial_no, expires_at) VALUES ('pad-lost', now() - interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	r := maintain.NewReconciler(maintain.ReconcilerConfig{Keys: e.Keys, Grace: time.Minute}, e.RDB, e.Store, e.m,
		zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel)))
	if n, err := r.RunOnce(ctx); err != nil || n != 1 {
		t.Fatalf("reconciler closed %d (%v) of 1 lost char(n) order", n, err)
	}
}

// Invariant (a)/(contract "scores outside the range are not closed"): a
// producer rewrites a leased order's deadline in seconds instead of
// milliseconds (the contract's own example of a bad score). The next claim
// dead-letters the queue entry as score_out_of_range, which removes it from
// the queue key, so the holder's fence no longer sees any producer entry
// and commits the close: the order is both closed and dead-lettered.
// Fixed: burying a queue entry drops the serial's lease or backoff too.
func TestAdversaryOutOfRangeRewriteDuringLeaseIsClosedAnyway(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	s := e.Orders("seconds", 1, past)[0]
	e.Enqueue([]string{s}, past)
	a := e.consumer(Config{Owner: "A"})
	res, err := a.claimBatch(ctx)
	if err != nil || len(res.items) != 1 {
		t.Fatalf("claim: %v", err)
	}
	// The producer writes an hour ahead, in seconds.
	secs := e.RedisNow().Add(time.Hour).Unix()
	if err := e.RDB.ZAdd(ctx, e.Keys.Queue, redis.Z{Score: float64(secs), Member: s}).Err(); err != nil {
		t.Fatal(err)
	}
	b := e.consumer(Config{Owner: "B"})
	if _, err := b.claimBatch(ctx); err != nil { // dead-letters the seconds entry
		t.Fatal(err)
	}
	a.process(ctx, res.items)
	got, _ := e.cl.Get(ctx, s)
	if st := e.Status(s); st == "closed" && got.State == client.StateDead {
		t.Fatalf("%s closed by the fast path and dead-lettered (%s) at once", s, got.Reason)
	}

	// The same while backing off: the backoff must not come back with the
	// old deadline once the producer's entry is dead-lettered.
	s2 := e.Orders("seconds-b", 1, past)[0]
	e.Enqueue([]string{s2}, past)
	res, err = a.claimBatch(ctx)
	if err != nil || len(res.items) != 1 {
		t.Fatalf("claim: %v", err)
	}
	a.retry(res.items, time.Hour, false, "transient")
	if err := e.RDB.ZAdd(ctx, e.Keys.Queue, redis.Z{Score: float64(secs), Member: s2}).Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := b.claimBatch(ctx); err != nil { // dead-letters the seconds entry
		t.Fatal(err)
	}
	// Expire the backoff if there still is one (XX: never create one).
	if err := e.RDB.ZAddXX(ctx, e.Keys.Inflight, redis.Z{Score: 1, Member: s2}).Err(); err != nil {
		t.Fatal(err)
	}
	res, err = b.claimBatch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	b.process(ctx, res.items)
	if st := e.Status(s2); st == "closed" {
		t.Fatalf("%s closed at its old deadline after its producer's entry was dead-lettered", s2)
	}
}

// ---- Interleavings that held (passing tests) ----

// gate pauses one close at a chosen point: before its fence (the close
// statement ran, rows locked) or after it (before COMMIT).
type gate struct {
	*orders.Store
	afterFence bool
	paused     chan struct{}
	release    chan struct{}
}

func newGate(s *orders.Store, afterFence bool) *gate {
	return &gate{Store: s, afterFence: afterFence, paused: make(chan struct{}), release: make(chan struct{})}
}

func (g *gate) Settle(ctx context.Context, serials []string, fence orders.Fence) (orders.Outcome, error) {
	return g.Store.Settle(ctx, serials, func(ctx context.Context, closed []string) ([]string, error) {
		if !g.afterFence {
			close(g.paused)
			<-g.release
		}
		drop, err := fence(ctx, closed)
		if g.afterFence {
			close(g.paused)
			<-g.release
		}
		return drop, err
	})
}

// waitLockWaiter waits until some session of this test's database waits
// for a row lock.
func (e *env) waitLockWaiter(t *testing.T) {
	eventually(t, "a close waiting for the row lock", 30*time.Second, func() bool {
		var n int
		err := e.DB.Get(&n, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`)
		return err == nil && n > 0
	})
}

func (e *env) assertNoEntries(t *testing.T, s string) {
	t.Helper()
	ctx := context.Background()
	for _, k := range []string{e.Keys.Queue, e.Keys.Inflight, e.Keys.Deadlines, e.Keys.Dead} {
		if _, err := e.RDB.ZScore(ctx, k, s).Result(); err != redis.Nil {
			t.Errorf("%s still in %s (%v)", s, k, err)
		}
	}
	if n, _ := e.RDB.HExists(ctx, e.Keys.Lease, s).Result(); n {
		t.Errorf("%s still has a lease record", s)
	}
}

// A stops after its close statement, before its fence, past its lease; B
// re-claims and its close waits for A's row lock; A resumes: its fence
// drops S (token gone) and rolls back; B closes. Once closed, once counted,
// nothing left in Redis.
func TestAdversaryHoldsStallBeforeFence(t *testing.T) {
	t.Parallel()
	testStall(t, false)
}

// As above, but A stops after its fence said yes, before COMMIT: A commits,
// B's close re-checks the row and finds it closed (settled, not counted).
func TestAdversaryHoldsStallAfterFence(t *testing.T) {
	t.Parallel()
	testStall(t, true)
}

func testStall(t *testing.T, afterFence bool) {
	e := newEnv(t, orderStatements())
	e.Store.SetTimeouts(20*time.Second, 15*time.Second)
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	s := e.Orders("stall", 1, past)[0]
	e.Enqueue([]string{s}, past)
	a := e.consumer(Config{Owner: "A", StatementTimeout: 20 * time.Second, Lease: 60 * time.Second})
	g := newGate(e.Store, afterFence)
	a.store = g
	resA, err := a.claimBatch(ctx)
	if err != nil || len(resA.items) != 1 {
		t.Fatalf("A claim: %v", err)
	}
	doneA := make(chan struct{})
	go func() { defer close(doneA); a.process(ctx, resA.items) }()
	<-g.paused
	e.expire(s)
	b := e.consumer(Config{Owner: "B", StatementTimeout: 20 * time.Second, Lease: 60 * time.Second})
	resB, err := b.claimBatch(ctx)
	if err != nil || len(resB.items) != 1 {
		close(g.release)
		<-doneA
		t.Fatalf("B re-claim: %v, %d items", err, len(resB.items))
	}
	doneB := make(chan struct{})
	go func() { defer close(doneB); b.process(ctx, resB.items) }()
	e.waitLockWaiter(t)
	close(g.release)
	<-doneA
	<-doneB
	if st := e.Status(s); st != "closed" {
		t.Fatalf("status %s, want closed", st)
	}
	if v := testutil.ToFloat64(e.m.Closed); v != 1 {
		t.Errorf("closed_total %v, want 1", v)
	}
	e.assertNoEntries(t, s)
}

// A raw ZADD of the same due deadline while A holds S: B takes it over, A's
// fence drops it, B closes it: closed once, counted once, nothing left.
func TestAdversaryHoldsTakeoverClosesOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	s := e.Orders("takeover-once", 1, past)[0]
	e.Enqueue([]string{s}, past)
	a := e.consumer(Config{Owner: "A"})
	resA, err := a.claimBatch(ctx)
	if err != nil || len(resA.items) != 1 {
		t.Fatalf("A claim: %v", err)
	}
	e.Enqueue([]string{s}, past)
	b := e.consumer(Config{Owner: "B"})
	resB, err := b.claimBatch(ctx)
	if err != nil || len(resB.items) != 1 {
		t.Fatalf("B claim: %v, %d", err, len(resB.items))
	}
	a.process(ctx, resA.items)
	if st := e.Status(s); st != "pending" {
		t.Fatalf("A closed %s after B took it over", s)
	}
	b.process(ctx, resB.items)
	if st := e.Status(s); st != "closed" {
		t.Fatalf("status %s, want closed", st)
	}
	if v := testutil.ToFloat64(e.m.Closed); v != 1 {
		t.Errorf("closed_total %v, want 1", v)
	}
	e.assertNoEntries(t, s)
}

// A raw ZADD an hour ahead during the lease, then shutdown hands the claim
// back: ZADD NX keeps the producer's deadline.
func TestAdversaryHoldsHandBackKeepsRawReschedule(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	s := e.Orders("handback", 1, past)[0]
	e.Enqueue([]string{s}, past)
	a := e.consumer(Config{})
	res, err := a.claimBatch(ctx)
	if err != nil || len(res.items) != 1 {
		t.Fatalf("claim: %v", err)
	}
	later := e.RedisNow().Add(time.Hour)
	e.Enqueue([]string{s}, later)
	a.handBack(res.items)
	got, err := e.cl.Get(ctx, s)
	if err != nil || got.State != client.StateQueued || got.Deadline.UnixMilli() != queue.DeadlineMillis(later) {
		t.Fatalf("after hand-back: %+v (%v), want queued at the producer's deadline", got, err)
	}
	if n := e.held(); n != 0 {
		t.Fatalf("%d companions left", n)
	}
}

// An API cancel during the lease (the order was paid, or the shop called
// it off): the close is fenced out, nothing is left in Redis.
func TestAdversaryHoldsCancelDuringLease(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	s := e.Orders("cancel", 1, past)[0]
	e.Enqueue([]string{s}, past)
	a := e.consumer(Config{})
	res, err := a.claimBatch(ctx)
	if err != nil || len(res.items) != 1 {
		t.Fatalf("claim: %v", err)
	}
	if err := e.cl.Cancel(ctx, s); err != nil {
		t.Fatal(err)
	}
	a.process(ctx, res.items)
	if st := e.Status(s); st != "pending" {
		t.Fatalf("status %s: closed after its timeout was cancelled", st)
	}
	e.assertNoEntries(t, s)
}

// failScript fails every call of one script (by its SHA), as a Redis that
// went away right after the COMMIT would.
type failScript struct{ shas []string }

func (h failScript) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h failScript) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if args := cmd.Args(); len(args) > 1 && slices.Contains(h.shas, fmt.Sprint(args[1])) {
			cmd.SetErr(fmt.Errorf("injected: redis gone"))
			return cmd.Err()
		}
		return next(ctx, cmd)
	}
}
func (h failScript) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// The close commits, then removing the entry fails: it comes back when the
// lease expires, is settled then, and the close is counted once.
func TestAdversaryHoldsFinishFailsAfterCommit(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	s := e.Orders("finish-fails", 1, past)[0]
	e.Enqueue([]string{s}, past)
	a := e.consumer(Config{Owner: "A"})
	broken := redis.NewClient(e.RDB.Options())
	t.Cleanup(func() { broken.Close() })
	broken.AddHook(failScript{shas: []string{queue.FinishScriptHash(), queue.FinishBatchScriptHash()}})
	a.rdb = broken
	a.q = queue.NewStore(broken, a.cfg.Keys)
	res, err := a.claimBatch(ctx)
	if err != nil || len(res.items) != 1 {
		t.Fatalf("claim: %v", err)
	}
	a.process(ctx, res.items)
	if st := e.Status(s); st != "closed" {
		t.Fatalf("status %s, want closed", st)
	}
	if n := e.held(); n != 1 {
		t.Fatalf("%d leased entries after the failed finish, want 1", n)
	}
	e.expire(s)
	b := e.consumer(Config{Owner: "B"})
	res, err = b.claimBatch(ctx)
	if err != nil || len(res.items) != 1 {
		t.Fatalf("re-claim: %v", err)
	}
	b.process(ctx, res.items)
	if v := testutil.ToFloat64(e.m.Closed); v != 1 {
		t.Errorf("closed_total %v, want 1", v)
	}
	e.assertNoEntries(t, s)
}

// Invariant (a), sharded queues: the checkout creates S through the sharded
// Go client (S lives in its shard), and a raw ZADD producer that "keeps
// writing the queue key" (docs/scaling.md: supported) moves S an hour
// later while the shard's consumer holds it. The shard's fence looks only
// at its own queue key, so the close commits an hour early. The mirror
// (created in the queue key, moved in its shard) failed the same way.
// Fixed: a consumer of a Group also asks the serial's other key (the queue
// key, or its shard) for a later deadline before it commits.
func TestAdversaryShardedRawRescheduleInQueueKeyIsIgnored(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	all := e.ShardKeys(2)
	cl, err := client.New(e.RDB, e.Keys.Queue, client.WithShards(2))
	if err != nil {
		t.Fatal(err)
	}
	past := e.RedisNow().Add(-time.Second)
	s := e.Orders("sharded", 1, past)[0]
	if _, _, err := cl.Enqueue(ctx, s, past, client.Create); err != nil {
		t.Fatal(err)
	}
	g, err := NewGroup(Config{}, all, e.RDB, e.Store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	if err != nil {
		t.Fatal(err)
	}
	c := g.Consumers()[1+queue.ShardOf(s, 2)]
	res, err := c.claimBatch(ctx)
	if err != nil || len(res.items) != 1 {
		t.Fatalf("shard claim: %v, %d items", err, len(res.items))
	}
	e.ZAdd(e.Keys.Queue, []string{s}, e.RedisNow().Add(time.Hour)) // raw producer, queue key
	c.process(ctx, res.items)
	if st := e.Status(s); st != "pending" {
		t.Fatalf("%s is %s: closed an hour before the deadline a raw producer wrote to the queue key", s, st)
	}
	// The shard's companions are gone; the producer's entry decides.
	if n := e.heldIn(c.cfg.Keys); n != 0 {
		t.Errorf("%d companions left in the shard", n)
	}

	// The mirror: S2 was created in the queue key (before the switch to
	// shards); a raw producer now writes its shard an hour later while the
	// queue key's consumer holds it.
	s2 := e.Orders("sharded-b", 1, past)[0]
	e.ZAdd(e.Keys.Queue, []string{s2}, past)
	base := g.Consumers()[0]
	res, err = base.claimBatch(ctx)
	if err != nil || len(res.items) != 1 {
		t.Fatalf("queue key claim: %v, %d items", err, len(res.items))
	}
	e.ZAdd(all[1+queue.ShardOf(s2, 2)].Queue, []string{s2}, e.RedisNow().Add(time.Hour))
	base.process(ctx, res.items)
	if st := e.Status(s2); st != "pending" {
		t.Fatalf("%s is %s: closed an hour before the deadline a raw producer wrote to its shard", s2, st)
	}
}

// Invariant (g): lease tokens are Owner + ":" + a counter from 1, and the
// daemon's Owner is host/pid. Two replicas with the same host name and
// PID (containers are PID 1; hostNetwork pods on one node share the node's
// name) mint the same tokens. A stalls past its lease, B re-claims S with
// the very token A holds, and A's fence, finish, retry and bury all take
// B's lease for A's: here A closes S while B's lease holds.
func TestAdversarySameOwnerTwoReplicasShareTokens(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	s := e.Orders("same-owner", 1, past)[0]
	e.Enqueue([]string{s}, past)
	const owner = "orderdelay/node-1/1"
	a := e.consumer(Config{Owner: owner})
	resA, err := a.claimBatch(ctx)
	if err != nil || len(resA.items) != 1 {
		t.Fatalf("A claim: %v", err)
	}
	e.expire(s) // A stalls past its lease
	b := e.consumer(Config{Owner: owner})
	resB, err := b.claimBatch(ctx)
	if err != nil || len(resB.items) != 1 {
		t.Fatalf("B re-claim: %v", err)
	}
	if resA.items[0].token == resB.items[0].token {
		t.Fatalf("two replicas hold %s under one token %q", s, resA.items[0].token)
	}
	a.process(ctx, resA.items) // A resumes
	if st := e.Status(s); st != "pending" {
		t.Fatalf("A closed %s while B's lease holds", s)
	}
}
