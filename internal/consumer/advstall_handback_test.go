package consumer

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/lib/pq"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// A claim heard after its batch's time is handed back (c4699a1), while a
// producer moved one of its serials later during the stall: the hand-back
// is a compare-and-set, so the producer's deadline stays, whichever way it
// was written — a raw ZADD of the queue key (the checkout's way: the entry
// is then in the queue key and in A's lease at once) or the client's
// reschedule (which drops A's lease record). A acts on nothing of the late
// claim; the serials nobody moved return at their own deadline and are
// closed once, by A's next claim; the moved one is closed once, at its new
// deadline, never before.
func TestAdvStallClaimHandedBackLateKeepsAProducersReschedule(t *testing.T) {
	producers := []struct {
		name       string
		reschedule func(t *testing.T, s *stallEnv, serial string, at time.Time)
	}{
		{"raw ZADD", func(t *testing.T, s *stallEnv, serial string, at time.Time) {
			s.Enqueue([]string{serial}, at)
		}},
		{"client reschedule", func(t *testing.T, s *stallEnv, serial string, at time.Time) {
			if _, _, err := s.cl.Enqueue(context.Background(), serial, at, client.Reschedule); err != nil {
				t.Fatal(err)
			}
		}},
	}
	for _, p := range producers {
		t.Run(p.name, func(t *testing.T) { testStallHandBackKeepsReschedule(t, p.reschedule) })
	}
}

func testStallHandBackKeepsReschedule(t *testing.T, reschedule func(*testing.T, *stallEnv, string, time.Time)) {
	ctx := context.Background()
	s := newStallEnv(t)
	// A lease long enough that a reply released just after the batch's
	// time is heard well before the lease ends (the hand-back does not
	// depend on it: nobody else claims here).
	s.cfg.Lease = 3 * time.Second
	a := s.replicaA(t)
	batch, _ := a.batchBudget()
	past := s.RedisNow().Add(-time.Second)
	serials := s.Orders("latehb", 4, past)
	moved := serials[0]
	s.Enqueue(serials, past)

	s.px.Stall(time.Minute) // ended below
	runConsumer(t, a)
	eventually(t, "A's claim run by Redis, its reply held", 10*time.Second, func() bool { return s.leasedTo(t, "A", serials) })
	recs, _, err := s.st.LeaseRecords(ctx, serials[:1])
	if err != nil {
		t.Fatal(err)
	}
	token := recs[0].Token
	expiry, err := s.RDB.ZScore(ctx, s.Keys.Leases, token).Result()
	if err != nil {
		t.Fatalf("A's batch lease %s: %v", token, err)
	}

	later := s.RedisNow().Add(4 * time.Second)
	reschedule(t, s, moved, later)

	// Redis ran the claim at expiry - lease, after A sent it: once Redis's
	// clock is a batch's time past that (and a little: the two clocks are
	// the machine's), the reply comes after the batch's whole time.
	handBackAt := time.UnixMilli(int64(expiry)).Add(-s.cfg.Lease + batch + 100*time.Millisecond)
	eventually(t, "Redis's clock past A's batch time", 30*time.Second, func() bool { return !s.RedisNow().Before(handBackAt) })
	s.px.Stall(0)
	eventually(t, "A is done with its late claim (its batch lease gone)", 30*time.Second, func() bool {
		_, err := s.RDB.ZScore(ctx, s.Keys.Leases, token).Result()
		return errors.Is(err, redis.Nil)
	})
	if got := s.store.begunUnder(token); len(got) > 0 {
		t.Errorf("A began closing %v under the claim it heard of after the batch's time", got)
	}
	got, err := s.cl.Get(ctx, moved)
	if err != nil {
		t.Fatal(err)
	}
	if got.Deadline.UnixMilli() != queue.DeadlineMillis(later) {
		t.Errorf("after the hand-back %s is due at %v (%s), want the producer's %v", moved, got.Deadline, got.State, later)
	}

	eventually(t, "every order closed", 30*time.Second, func() bool {
		for _, sn := range serials {
			if s.Status(sn) != "closed" {
				return false
			}
		}
		return true
	})
	for _, sn := range serials {
		if n := s.store.closedTimes(sn); n != 1 {
			t.Errorf("%s closed %d times, want 1", sn, n)
		}
	}
	// The rows keep the first deadline (expires_at); the moved one's latest
	// is the producer's.
	var early []string
	if err := s.DB.Select(&early, `SELECT serial_no FROM orders WHERE serial_no = ANY($1)
		AND closed_at < CASE WHEN serial_no = $2 THEN $3 ELSE expires_at END`, pq.Array(serials), moved, later); err != nil {
		t.Fatal(err)
	}
	if len(early) > 0 {
		t.Errorf("%v closed before its latest deadline", early)
	}
	if v := testutil.ToFloat64(s.mA.Closed); v != float64(len(serials)) {
		t.Errorf("A counted %v closes, want %d", v, len(serials))
	}
	eventually(t, "A's leases finished", 10*time.Second, func() bool { return s.held() == 0 })
	if n := s.card(s.Keys.Queue); n != 0 {
		t.Errorf("%d entries left in the queue key", n)
	}
	s.assertNoLeaseKeys(t)
}
