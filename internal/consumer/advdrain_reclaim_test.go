package consumer

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
)

// The drain's cut now comes while the scan loop may still be inside a
// claim (Run starts the timer when ctx ends). A's claim is run by Redis,
// its reply held (a stalled link); A is stopped and its drain passes (the
// cut); A's lease expires and replica C re-claims the orders, under a
// long lease of its own. Only then does A hear its claim: processClaim
// sees workCtx cancelled and hands the claim back at once. The hand-back
// is a compare-and-set on A's token, so it must leave C's lease alone —
// no entry back in the queue key while C holds it (another replica would
// close it beside C) — and C then closes every order exactly once.
func TestAdvDrainLateClaimAfterTheCutLeavesAReclaimersLease(t *testing.T) {
	s := newStallEnv(t)
	a := s.replicaA(t)
	past := s.RedisNow().Add(-time.Second)
	serials := s.Orders("whole4cut", 4, past)
	s.Enqueue(serials, past)

	s.px.Stall(time.Minute) // ended below
	ctxA, cancelA := context.WithCancel(context.Background())
	doneA := make(chan struct{})
	go func() { defer close(doneA); a.Run(ctxA) }()
	t.Cleanup(func() { cancelA(); s.px.Stall(0); <-doneA })
	eventually(t, "A's claim run by Redis, its reply held", 10*time.Second, func() bool { return s.leasedTo(t, "A", serials) })
	cancelA()
	eventually(t, "A's drain cut, with its claim's reply still held", 10*time.Second, func() bool { return a.bookEnd.Load() != 0 })

	cfgC := withOwner(s.cfg, "C")
	cfgC.Lease, cfgC.StatementTimeout = time.Minute, 10*time.Second
	c := s.consumer(cfgC)
	var items []item
	eventually(t, "C re-claims the orders once A's lease expired", 30*time.Second, func() bool {
		res, err := c.claimBatch(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		items = append(items, res.items...)
		return len(items) == len(serials)
	})
	if !s.leasedTo(t, "C", serials) {
		t.Fatal("the orders are not leased to C after its claim")
	}
	s.px.Stall(0)
	select {
	case <-doneA:
	case <-time.After(time.Minute):
		t.Fatal("A's Run did not return within a minute of its claim's reply")
	}
	if got := testutil.ToFloat64(s.mA.Claimed); got != float64(len(serials)) {
		t.Fatalf("A heard a claim of %v orders, want %d (the test's interleaving did not happen)", got, len(serials))
	}
	if !s.leasedTo(t, "C", serials) {
		t.Errorf("A's hand-back of its late claim took over orders C holds under a live lease")
	}
	for _, sn := range serials {
		if _, err := s.RDB.ZScore(context.Background(), s.Keys.Queue, sn).Result(); err != redis.Nil {
			t.Errorf("%s is back in the queue key (err %v) while C holds it: A's hand-back requeued another replica's claim", sn, err)
		}
		if st := s.Status(sn); st != "pending" {
			t.Errorf("order %s is %s before C closed it, want pending (A must close nothing after its cut)", sn, st)
		}
	}
	if v := testutil.ToFloat64(s.mA.Closed); v != 0 {
		t.Errorf("A counted %v closes after its cut", v)
	}
	c.process(context.Background(), items)
	for _, sn := range serials {
		if st := s.Status(sn); st != "closed" {
			t.Errorf("order %s is %s after C's batch, want closed", sn, st)
		}
		if n := s.store.closedTimes(sn); n != 0 {
			t.Errorf("A's store committed %d closes of %s", n, sn)
		}
	}
	s.assertNoLeaseKeys(t)
}
