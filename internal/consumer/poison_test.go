package consumer

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/lib/pq"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Rows whose close always times out (a shop's trigger sleeping past the
// statement timeout for that serial), in one batch with good orders: the
// good orders must close within a bounded number of rounds, and the slow
// rows must never be lost — each ends closed, dead-lettered or still held
// (backing off or leased), and none spends an attempt for its timeouts.

// slowClosesOf makes the close of each of serials sleep five seconds (any
// short statement timeout cuts it), counting the statements that reached
// one of them in the sequence slow_closes.
func (e *env) slowClosesOf(serials []string) {
	e.T.Helper()
	// A later call adds its serials to the first's (roundReaching's
	// batches built anew).
	var made bool
	if err := e.DB.Get(&made, `SELECT to_regclass('slow_serials') IS NOT NULL`); err != nil {
		e.T.Fatal(err)
	}
	if !made {
		if _, err := e.DB.Exec(`CREATE SEQUENCE slow_closes; CREATE TABLE slow_serials (serial_no text PRIMARY KEY)`); err != nil {
			e.T.Fatal(err)
		}
		e.CloseTrigger("slow_close", "NEW.serial_no IN (SELECT serial_no FROM slow_serials)",
			"PERFORM nextval('slow_closes'); PERFORM pg_sleep(5)")
	}
	if _, err := e.DB.Exec(`INSERT INTO slow_serials SELECT unnest($1::text[]) ON CONFLICT DO NOTHING`, pq.Array(serials)); err != nil {
		e.T.Fatal(err)
	}
}

// dueAll makes every backoff and lease of the queue due now, as if the
// test had waited for the last of them, keeping their order: each expiry
// moves back by the same amount. It moves data, not clocks. Everything
// then comes due at once, so the next claim takes the groups a round sent
// back in one batch (a backlog), in the order of their expiries.
func (e *env) dueAll() {
	e.T.Helper()
	ctx := context.Background()
	now := queue.DeadlineMillis(e.RedisNow())
	for _, key := range []string{e.Keys.Inflight, e.Keys.Leases} {
		zs, err := e.RDB.ZRangeWithScores(ctx, key, 0, -1).Result()
		if err != nil {
			e.T.Fatal(err)
		}
		if len(zs) == 0 {
			continue
		}
		shift := int64(zs[len(zs)-1].Score) - (now - 1)
		if shift <= 0 {
			continue
		}
		moved := make([]redis.Z, len(zs))
		for i, z := range zs {
			moved[i] = redis.Z{Score: z.Score - float64(shift), Member: z.Member}
		}
		if err := e.RDB.ZAdd(ctx, key, moved...).Err(); err != nil {
			e.T.Fatal(err)
		}
	}
}

// poisonRounds runs claim-and-process rounds on c until every good order
// is closed or rounds have passed, making what a round sent back due
// between rounds (dueAll), and returns how many rounds it took (rounds+1:
// not within the bound).
func (e *env) poisonRounds(t *testing.T, c *Consumer, good []string, rounds int) int {
	t.Helper()
	ctx := context.Background()
	closedGood := func() int {
		n := 0
		for _, s := range good {
			if e.Status(s) == "closed" {
				n++
			}
		}
		return n
	}
	cut := 0
	for round := 1; round <= rounds; round++ {
		res, err := c.claimBatch(ctx)
		if err != nil {
			t.Fatalf("round %d claim: %v", round, err)
		}
		if len(res.items) == 0 {
			t.Fatalf("round %d: nothing to claim, %d of %d good orders closed", round, closedGood(), len(good))
		}
		order := make([]string, len(res.items))
		for i, it := range res.items {
			order[i] = strings.SplitN(it.serial, "-", 2)[0] + it.serial[len(it.serial)-2:]
		}
		c.process(ctx, res.items)
		k := e.SlowCloses()
		t.Logf("round %d: claimed %v; %d statements cut, %d of %d good orders closed", round,
			order, k-cut, closedGood(), len(good))
		cut = k
		if closedGood() == len(good) {
			return round
		}
		e.dueAll()
	}
	return rounds + 1
}

// assertSlowRowsKept checks the slow rows were not lost: each is closed,
// dead-lettered, or still held (backing off or leased) with no attempt
// spent for its timeouts.
func (e *env) assertSlowRowsKept(t *testing.T, slow []string) {
	t.Helper()
	ctx := context.Background()
	for _, s := range slow {
		if e.Status(s) == "closed" {
			continue
		}
		if _, err := e.RDB.ZScore(ctx, e.Keys.Dead, s).Result(); err == nil {
			continue
		}
		got, err := e.cl.Get(ctx, s)
		if err != nil || (got.State != client.StateBackoff && got.State != client.StateLeased && got.State != client.StateQueued) {
			t.Errorf("slow row %s lost: %+v (%v), want closed, dead-lettered or still queued", s, got, err)
			continue
		}
		if got.Attempts != 0 {
			t.Errorf("slow row %s: %d attempts spent for timeouts, want 0", s, got.Attempts)
		}
	}
	if v := testutil.ToFloat64(e.m.DeadLettered.WithLabelValues(queue.ReasonCloseFailed)); v != 0 {
		t.Errorf("%v orders dead-lettered for timeouts", v)
	}
}

// Several rows whose close always hits the statement timeout, in one batch
// with ten good orders, ahead of them (the claim hands out expired
// backoffs first, and a group retried together in serial order, so slow
// rows that keep coming back lead their batch). Before the fix each round
// went the same way once three or more led: the batch timed out, the
// first two rows alone timed out, and the rest — the other slow rows and
// every good order — went back untried, together, to be claimed in the
// same order again; the good orders never closed.
func TestPoisonRowsAheadOfTheirBatchDoNotHoldItBack(t *testing.T) {
	for _, slowRows := range []int{3, 5} {
		t.Run(fmt.Sprintf("%d slow rows", slowRows), func(t *testing.T) {
			e := newEnv(t, orderStatements())
			const st = 100 * time.Millisecond
			e.Store.SetTimeouts(st, st/2)
			past := e.RedisNow().Add(-time.Second)
			poison := e.Orders("a-poison", slowRows, past)
			good := e.Orders("b-good", 10, past)
			all := append(append([]string{}, poison...), good...)
			e.Enqueue(all, past)
			e.slowClosesOf(poison)
			c := e.consumer(Config{BatchSize: len(all), StatementTimeout: st, Lease: 3 * time.Second})
			c.stopping = make(chan struct{})
			const rounds = 4
			if r := e.poisonRounds(t, c, good, rounds); r > rounds {
				t.Fatalf("good orders still not all closed after %d rounds: slow rows ahead of them hold them back", rounds)
			}
			e.assertSlowRowsKept(t, poison)
		})
	}
}

// A lease under about three statement timeouts (Lease 3 × ST here; an
// operator's 30s lease with the default 10s timeout is the same) leaves a
// batch whose statement the server cut at its timeout (ST) with less than
// the 1.1 × ST that a statement of its own needs: before the fix nothing of
// the batch was tried alone, every order went back untried, together, and
// the next round went the same way — the good orders of a batch holding
// one row that always times out never closed (the reconciler leaves
// backing-off entries alone, so nothing else closed them either).
func TestAdvSlowRowIsFoundWhenTheLeaseLeavesNoTimeToIsolateIt(t *testing.T) {
	e := newEnv(t, orderStatements())
	const st = 100 * time.Millisecond
	e.Store.SetTimeouts(st, st/2)
	past := e.RedisNow().Add(-time.Second)
	poison := e.Orders("a-poison", 1, past)
	good := e.Orders("b-good", 6, past)
	all := append(append([]string{}, poison...), good...)
	e.Enqueue(all, past)
	e.slowClosesOf(poison)
	c := e.consumer(Config{BatchSize: len(all), StatementTimeout: st, Lease: 3 * st, BackoffMax: time.Hour})
	c.stopping = make(chan struct{})
	// Each round halves the group holding the slow row: 2·log2(7) rounds
	// and a few more.
	const rounds = 8
	if r := e.poisonRounds(t, c, good, rounds); r > rounds {
		t.Fatalf("good orders still not all closed after %d rounds: a slow row holds its batch back when the lease leaves no time to isolate it", rounds)
	}
	e.assertSlowRowsKept(t, poison)
}

// What a round sends back comes due in the order it was sent: a claim that
// takes it all again in one batch (everything due at once) returns the
// untried orders in the order the round had them — not in serial order,
// as one retry of them all would — and the orders tried and held after
// them. A group of more runs than maxRetryRuns keeps the order of its
// first runs.
func TestRetryInOrderComesBackInThatOrder(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	serials := e.Orders("o", 20, past)
	e.Enqueue(serials, past)
	c := e.consumer(Config{BatchSize: len(serials), Lease: 30 * time.Second})
	res, err := c.claimBatch(ctx)
	if err != nil || len(res.items) != len(serials) {
		t.Fatalf("claim: %v, %d", err, len(res.items))
	}
	by := map[string]item{}
	for _, it := range res.items {
		by[it.serial] = it
	}
	pick := func(idx ...int) []item {
		out := make([]item, len(idx))
		for i, k := range idx {
			out[i] = by[serials[k]]
		}
		return out
	}
	// Three runs (9 10 11 | 2 3 | 0 4), then two held orders.
	untried := pick(9, 10, 11, 2, 3, 0, 4)
	var held heldRetries
	held.add(c, pick(1), 0, "held")
	held.add(c, pick(5), time.Millisecond, "held")
	after := c.retryInOrder(untried, 0, "untried")
	held.flush(c, after)
	// Eleven orders in descending order are eleven runs: the first
	// maxRetryRuns-1 keep their place, the last run takes the rest in
	// serial order.
	c.retryInOrder(pick(19, 18, 17, 16, 15, 14, 13, 12, 8, 7, 6), time.Hour, "many runs")
	e.dueAll()
	again, err := c.claimBatch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, it := range again.items {
		got = append(got, it.serial[len(it.serial)-2:])
	}
	want := "[09 10 11 02 03 00 04 01 05 19 18 17 16 15 14 13 06 07 08 12]"
	if fmt.Sprint(got) != want {
		t.Fatalf("claimed again in the order %v, want %s", got, want)
	}
	for _, it := range again.items {
		if it.attempts != 0 {
			t.Errorf("%s: %d attempts spent, want 0", it.serial, it.attempts)
		}
	}
}
