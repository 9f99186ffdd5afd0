package main

import (
	"context"
	"fmt"
	neturl "net/url"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// A replica starts (a rolling deploy, a pod the kubelet restarted) while
// PostgreSQL holds its replies (a stuck primary, a partition without RST)
// and is stopped before its database preflight got an answer. Nothing has
// been claimed, nothing is held: the stop must end as promptly as it does
// once the work runs (TestDaemonStopEndsWhilePostgresHoldsItsReplies: the
// work stage's bound), not wait for PostgreSQL. The work stage's Start
// (prepareDB: a ping, the statements' verification) runs on lib/pq, which
// cannot cut a read, and the stop's bound (lifecycle Stage.StopWithin)
// covers only the stage's Run actors, never a Start still in progress.
func TestAdvStopEndsWhilePostgresHoldsItsRepliesAtStartup(t *testing.T) {
	_, keys := testenv.Redis(t)
	direct, _, dsn, px := testenv.PostgresViaProxy(t)
	t.Cleanup(func() { px.Stall(0) }) // runs first: the database can then be dropped
	px.Stall(time.Hour)               // every answer PostgreSQL sends from now on is held
	cfg := daemonConfig(t, keys, dsn, map[string]string{
		"ORDERDELAY_REDIS_URL": redisURLWithReadTimeout(time.Second), "ORDERDELAY_DRAIN_TIMEOUT": "300ms",
		"ORDERDELAY_RECONCILE_INTERVAL": "0",
	})
	d := startDaemon(t, cfg, daemonOptions{})
	// The preflight's connection has reached PostgreSQL (its answers held).
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) {
		var n int
		if err := direct.Get(&n, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = $1`, replicaName()); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			break
		}
		if d.ended() || time.Now().After(deadline) {
			t.Fatalf("the preflight never reached PostgreSQL (ended %v: %v)", d.ended(), d.err)
		}
	}
	d.cancel()
	bound := workStopBoundOf(t, cfg)
	select {
	case <-d.done:
	case <-time.After(time.Minute): // a guard against a hang, not a budget: the work stage's bound is 7.3 s
		px.Stall(0)
		<-d.done
		t.Fatalf("stopped while its preflight waited on PostgreSQL holding its replies, the daemon ended only once PostgreSQL answered "+
			"(the work stage's bound, %v, does not cover its Start)", bound)
	}
	if d.err != nil && !strings.Contains(d.err.Error(), "context canceled") {
		t.Errorf("runDaemon = %v", d.err)
	}
}

// A batch's close commits just as the stop begins, and Redis then hangs
// (connections open, no answers) before the batch has recorded its
// outcome: the retries of its pending orders and of its rowless ones (one
// call per attempts count: stillPending, notFound) and its paid order's
// finish go out one after the other, each ending at the client's read
// timeout.
// Every dependency answers within its timeouts — PostgreSQL at once, each
// Redis call ending at its timeout — so this is a legitimate stop: it
// must end with the work stage stopped, not abandoned as if a dependency
// never answered. workStopBound counts one call in flight at the drain's
// end and one hand-back: every bookkeeping call after the drain's cut ends
// within the hand-back's deadline of it (failed at 82024e8, where
// each call had a deadline of its own).
func TestAdvStopAfterACommitWhileRedisHangsIsNotAbandoned(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	direct, _, dsn, pgx := testenv.PostgresViaProxy(t)
	ru, err := neturl.Parse(testenv.RedisURL())
	if err != nil {
		t.Fatal(err)
	}
	rpx := testenv.NewProxy(t, ru.Host)
	t.Cleanup(func() { rpx.Stall(0); pgx.Stall(0) }) // let what still runs end
	ru.Host = rpx.Addr()
	q := ru.Query()
	q.Set("read_timeout", "1s")
	ru.RawQuery = q.Encode()
	ctx := context.Background()
	due := time.Now().Add(-time.Second)
	// p<a>: a pending row the close leaves alone (retried, attempts a);
	// n<a>: no row (retried, attempts a); c: a row already paid (finished).
	target := map[string]int{"c": 0}
	for a := range 5 {
		target[fmt.Sprintf("p%d", a)] = a
		if _, err := direct.Exec(`INSERT INTO orders (serial_no, expires_at) VALUES ($1, $2)`, fmt.Sprintf("p%d", a), due); err != nil {
			t.Fatal(err)
		}
	}
	for a := range 4 {
		target[fmt.Sprintf("n%d", a)] = a
	}
	if _, err := direct.Exec(`INSERT INTO orders (serial_no, expires_at, status) VALUES ('c', $1, 'paid')`, due); err != nil {
		t.Fatal(err)
	}
	// Each serial's earlier attempts, spent by claims and retries of a
	// replica gone since (what is due comes back at once).
	st := queue.NewStore(rdb, keys)
	seq := 0
	for s, a := range target {
		if err := rdb.ZAdd(ctx, keys.Queue, redis.Z{Score: float64(queue.DeadlineMillis(due)), Member: s}).Err(); err != nil {
			t.Fatal(err)
		}
		for range a {
			seq++
			tok := fmt.Sprintf("seed.%d", seq)
			res, err := st.Claim(ctx, queue.ClaimArgs{Limit: 100, Lease: time.Minute, Token: tok, Batch: true})
			if err != nil {
				t.Fatal(err)
			}
			var others []string
			for _, it := range res.Items {
				if it.Serial != s {
					others = append(others, it.Serial)
				}
			}
			if _, err := st.Retry(ctx, queue.RetryArgs{Token: tok, Serials: []string{s}, Spend: true, LastError: "seed"}); err != nil {
				t.Fatal(err)
			}
			if len(others) > 0 {
				if _, err := st.Retry(ctx, queue.RetryArgs{Token: tok, Serials: others, LastError: "seed"}); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	lock, err := direct.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if _, err := lock.ExecContext(ctx, "SELECT pg_advisory_lock(778)"); err != nil {
		t.Fatal(err)
	}
	cfg := daemonConfig(t, keys, dsn, map[string]string{
		"ORDERDELAY_REDIS_URL": ru.String(), "ORDERDELAY_CLOSE_SQL": lockedCloseSQL,
		"ORDERDELAY_DRAIN_TIMEOUT": "1s", "ORDERDELAY_RECONCILE_INTERVAL": "0",
	})
	d, stoppedStages := startStageRecording(t, cfg)
	awaitCloseOnTheLock(t, direct, d)
	if n, _ := rdb.ZCard(ctx, keys.Queue).Result(); n != 0 {
		t.Fatalf("%d entries left in the queue key: the batch is to hold them all", n)
	}
	// The close's COMMIT answer is held a moment, long enough for Redis
	// to hang before the batch records its outcome (its fence, before the
	// COMMIT, was answered).
	committing := pgx.StallOnQuery("COMMIT", 300*time.Millisecond)
	d.cancel()
	if _, err := lock.ExecContext(ctx, "SELECT pg_advisory_unlock(778)"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-committing:
	case <-d.done:
		t.Fatal("the daemon stopped before the batch committed")
	}
	rpx.Stall(time.Hour)
	<-d.done // each Redis call ends at its read timeout: no guard needed
	if d.err != nil {
		t.Errorf("runDaemon = %v", d.err)
	}
	got := strings.Join(stoppedStages(), ",")
	if !strings.Contains(got, "work") {
		t.Errorf("stages stopped %q: the work stage was abandoned (its bound %v) though every call it waited on ended at its timeout",
			got, workStopBoundOf(t, cfg))
	}
}
