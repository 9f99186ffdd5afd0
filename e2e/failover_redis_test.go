package e2e

import (
	"context"
	"math/rand/v2"
	"net"
	"testing"
	"time"

	"github.com/lib/pq"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/testenv"
)

// TestFaultRedisFailsOverToAStaleReplica: Redis replicates asynchronously,
// so a failover can promote a replica that missed the primary's last
// writes. Here the replica stops following the primary at a moment of the
// drain (it is promoted), the daemons go on against the old primary for a
// while — claiming, closing, finishing, while a checkout enqueues more
// orders and customers pay — and then the Service turns to the promoted
// replica: Redis jumps back in time. Entries the daemons had finished come
// back, leases name tokens long settled, and the enqueues of the window
// are gone. The contract still holds: every unpaid order closes (the
// reconciler closes those whose enqueue was lost), exactly once, none paid
// and none early.
func TestFaultRedisFailsOverToAStaleReplica(t *testing.T) {
	t.Parallel()
	w, px := privateWorld(t)
	w.withAudit()
	ctx := context.Background()
	_, primaryPort, err := net.SplitHostPort(w.rdb.Options().Addr)
	if err != nil {
		t.Fatal(err)
	}
	replica, _ := testenv.PrivateRedisWith(t, nil, "--replicaof", "127.0.0.1", primaryPort)
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, seed))

	// 300 orders a second come due over 10 s.
	first := w.spread("before", 3000, time.Now().Add(time.Second), 10*time.Second)
	settings := []string{"ORDERDELAY_CLOSE_SQL=" + auditClose, "ORDERDELAY_LEASE=1s",
		"ORDERDELAY_STATEMENT_TIMEOUT=500ms", "ORDERDELAY_DRAIN_TIMEOUT=500ms",
		"ORDERDELAY_RECONCILE_INTERVAL=500ms", "ORDERDELAY_RECONCILE_GRACE=2s"}
	ds := []*daemon{w.start(settings...), w.start(settings...)}

	// The moment of the promotion: a third of the first orders closed, and
	// the replica has every write up to it (WAIT), then stops following.
	waitFor(t, "a third closed", 60*time.Second, func() bool { return w.closed() >= len(first)/3 })
	if n, err := w.rdb.Wait(ctx, 1, 10*time.Second).Result(); err != nil || n != 1 {
		t.Fatalf("WAIT for the replica: %d, %v", n, err)
	}
	if err := replica.Do(ctx, "REPLICAOF", "NO", "ONE").Err(); err != nil {
		t.Fatal(err)
	}
	promotedAt := w.closed()

	// The window the promoted replica never sees: more closes, payments of
	// orders not due yet (the last third), and a checkout's enqueues.
	var toPay []string
	for _, s := range first[2*len(first)/3:] {
		if rng.IntN(10) == 0 {
			toPay = append(toPay, s)
		}
	}
	// Only those still pending are paid: on a loaded machine the daemons
	// may have closed some of the last third already (a backlog), and a
	// payment of a closed order does not happen.
	var paid []string
	if err := w.db.Select(&paid, `UPDATE orders SET status = 'paid', paid_at = now()
		WHERE serial_no = ANY($1) AND status = 'pending' RETURNING serial_no`, pq.Array(toPay)); err != nil {
		t.Fatal(err)
	}
	lost := w.spread("lost-enqueue", 500, time.Now().Add(2*time.Second), time.Second)
	waitFor(t, "the window's closes on the old primary", 60*time.Second, func() bool {
		return w.closed() >= promotedAt+len(first)/6
	})

	// The failover: new connections go to the promoted replica, which
	// never saw the window's enqueues.
	if n, err := replica.Exists(ctx, w.keys.Queue).Result(); err != nil || n != 1 {
		t.Fatalf("the promoted replica has no queue key: %d, %v", n, err)
	}
	for _, s := range lost {
		if replica.ZScore(ctx, w.keys.Queue, s).Err() != redis.Nil {
			t.Fatalf("the promoted replica has %s, enqueued after it stopped following", s)
		}
	}
	px.SetTarget(replica.Options().Addr)
	lostPending := w.count("SELECT count(*) FROM orders WHERE serial_no = ANY($1) AND status = 'pending'", pq.Array(lost))
	after := w.spread("after", 500, time.Now().Add(500*time.Millisecond), time.Second)
	// w.spread enqueued those on the old primary: put them where the
	// daemons now are, as the checkout would after the failover.
	zs := make([]redis.Z, 0, len(after))
	for _, s := range after {
		score, err := w.rdb.ZScore(ctx, w.keys.Queue, s).Result()
		if err != nil {
			t.Fatal(err)
		}
		zs = append(zs, redis.Z{Score: score, Member: s})
	}
	if err := replica.ZAdd(ctx, w.keys.Queue, zs...).Err(); err != nil {
		t.Fatal(err)
	}

	waitFor(t, "every unpaid order closed", 120*time.Second, func() bool {
		return w.count("SELECT count(*) FROM orders WHERE status = 'pending'") == 0
	})
	w.checkInvariants()
	if dc := w.doubleCloses(); dc != 0 {
		t.Errorf("%d orders closed twice after Redis went back in time", dc)
	}
	if n := w.count("SELECT count(*) FROM orders WHERE serial_no = ANY($1) AND status <> 'paid'", pq.Array(paid)); n != 0 {
		t.Errorf("%d of the %d orders paid in the lost window were closed", n, len(paid))
	}
	if n := w.count("SELECT count(*) FROM orders WHERE serial_no = ANY($1) AND status = 'closed'", pq.Array(lost)); n != len(lost) {
		t.Errorf("%d of the %d orders whose enqueue the failover lost were closed, want all (the rest by the reconciler)", n, len(lost))
	}
	var reconciled float64
	for _, d := range ds {
		reconciled += d.metrics()["orderdelay_orders_reconciled_total"]
	}
	t.Logf("promoted at %d closed; %d paid in the window; %d enqueues lost (%d of them still pending at the failover); %v reconciled",
		promotedAt, len(paid), len(lost), lostPending, reconciled)
	for _, d := range ds {
		d.stopCleanly()
	}
}
