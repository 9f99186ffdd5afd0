package consumer

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/internal/maintain"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Adversarial review of the order contract's invariant map (branch
// advmap): interleavings no test tried.

// Invariant "nothing lost", across the fast path and the reconciler, for
// the claim's dead-lettering of an expired batch member whose lease record
// names no holder a claim reads (3c41c56, f5f4bcd). The queue tests stop
// at the dead letter; docs/operations.md promises the rest: "the
// reconciler closes the order (from its row's deadline)". A replica
// claims five orders and stalls past its lease; a foreign write damages
// two members' records (they name a batch that does not exist). The
// other replica's claim re-takes the batch and closes the three intact
// orders, and dead-letters the two damaged ones instead of leaving their
// records where the reconciler skips them. The reconciler then closes the
// one past its row's deadline by more than the grace, and not the one
// within it: never before its row's deadline, and nothing lost.
func TestAdvDamagedBatchMemberIsDeadLetteredThenClosedByTheReconciler(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	longAgo := time.Now().Add(-time.Hour)
	recentAt := time.Now().Add(-time.Minute) // within the reconciler's grace
	serials := e.Orders("dmg", 4, longAgo)
	recent := e.Orders("dmg-recent", 1, recentAt)[0]
	e.Enqueue(serials, longAgo)
	e.Enqueue([]string{recent}, recentAt)

	// The stalled replica's claim.
	res, err := e.st.Claim(ctx, queue.ClaimArgs{Limit: 10, Lease: time.Minute, Token: "stalled:1", Batch: true})
	if err != nil || len(res.Items) != 5 {
		t.Fatalf("stalled replica's claim: %+v, %v; want the 5 orders", res.Items, err)
	}
	deadline := map[string]int64{}
	for _, it := range res.Items {
		deadline[it.Serial] = it.Deadline
	}
	damaged := []string{serials[2], recent}
	for _, s := range damaged {
		if err := e.RDB.HSet(ctx, e.Keys.Lease, s, fmt.Sprintf("%d|0|stalled:gone|", deadline[s])).Err(); err != nil {
			t.Fatal(err)
		}
	}
	// Its lease expires (data, not clocks).
	if err := e.RDB.ZAddXX(ctx, e.Keys.Leases, redis.Z{Score: float64(res.Now - 1), Member: "stalled:1"}).Err(); err != nil {
		t.Fatal(err)
	}

	c := e.consumer(Config{BatchSize: 10, Lease: 5 * time.Second, StatementTimeout: 2 * time.Second})
	stop := runConsumer(t, c)
	intact := []string{serials[0], serials[1], serials[3]}
	eventually(t, "the intact orders closed and the damaged ones dead-lettered", 30*time.Second, func() bool {
		for _, s := range intact {
			if e.Status(s) != "closed" {
				return false
			}
		}
		for _, s := range damaged {
			if e.RDB.ZScore(ctx, e.Keys.Dead, s).Err() != nil {
				return false
			}
		}
		return true
	})
	stop()
	for _, s := range damaged {
		if st := e.Status(s); st != "pending" {
			t.Fatalf("%s is %s: the fast path closed an order whose lease record gives no holder", s, st)
		}
		if e.RDB.HExists(ctx, e.Keys.Lease, s).Val() {
			t.Errorf("%s's damaged lease record is still there: the reconciler skips it", s)
		}
	}

	r := maintain.NewReconciler(maintain.ReconcilerConfig{Keys: e.Keys, Grace: 5 * time.Minute, PageSize: 100},
		e.RDB, e.Store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	n, err := r.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st := e.Status(recent); st != "pending" {
		t.Fatalf("%s is %s: closed by the reconciler within the grace after its row's deadline", recent, st)
	}
	if st := e.Status(serials[2]); st != "closed" {
		t.Fatalf("the dead-lettered order an hour past its row's deadline is %s after a reconciler pass, want closed: lost", st)
	}
	if n != 1 {
		t.Errorf("the reconciler reports %d closes, want 1", n)
	}
}
