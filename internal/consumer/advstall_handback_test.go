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
	reschedule := func(write func(*testing.T, *stallEnv, string, time.Time)) lateWrite {
		var later time.Time
		return lateWrite{
			write: func(t *testing.T, s *stallEnv, serial string) {
				later = s.RedisNow().Add(4 * time.Second)
				write(t, s, serial, later)
			},
			afterHandBack: func(t *testing.T, s *stallEnv, serial string) {
				got, err := s.cl.Get(context.Background(), serial)
				if err != nil {
					t.Fatal(err)
				}
				if got.Deadline.UnixMilli() != queue.DeadlineMillis(later) {
					t.Errorf("after the hand-back %s is due at %v (%s), want the producer's %v", serial, got.Deadline, got.State, later)
				}
			},
			status:    "closed",
			notBefore: func() time.Time { return later },
		}
	}
	cases := map[string]lateWrite{
		"raw ZADD": reschedule(func(t *testing.T, s *stallEnv, serial string, at time.Time) {
			s.Enqueue([]string{serial}, at)
		}),
		"client reschedule": reschedule(func(t *testing.T, s *stallEnv, serial string, at time.Time) {
			if _, _, err := s.cl.Enqueue(context.Background(), serial, at, client.Reschedule); err != nil {
				t.Fatal(err)
			}
		}),
	}
	for name, w := range cases {
		t.Run(name, func(t *testing.T) { testStallHandBack(t, w) })
	}
}

// The same stall, with the serial's timeout cancelled (the order was
// paid, or called off) or its order paid during it: the hand-back puts no
// cancelled entry back, and neither order is closed.
func TestAdvStallClaimHandedBackLateLeavesACancelOrAPaymentAlone(t *testing.T) {
	cases := map[string]lateWrite{
		"cancel": {
			write: func(t *testing.T, s *stallEnv, serial string) {
				if err := s.cl.Cancel(context.Background(), serial); err != nil {
					t.Fatal(err)
				}
			},
			afterHandBack: func(t *testing.T, s *stallEnv, serial string) {
				if got, err := s.cl.Get(context.Background(), serial); !errors.Is(err, client.ErrNotFound) {
					t.Errorf("after the hand-back the cancelled %s has an entry %+v (%v)", serial, got, err)
				}
			},
			status: "pending",
		},
		"payment": {
			write: func(t *testing.T, s *stallEnv, serial string) {
				if _, err := s.DB.Exec(`UPDATE orders SET status = 'paid', paid_at = now() WHERE serial_no = $1`, serial); err != nil {
					t.Fatal(err)
				}
			},
			status: "paid",
		},
	}
	for name, w := range cases {
		t.Run(name, func(t *testing.T) { testStallHandBack(t, w) })
	}
}

// lateWrite is what a producer (or a payer) does to one claimed serial
// while replica A's claim reply is held.
type lateWrite struct {
	write         func(t *testing.T, s *stallEnv, serial string)
	afterHandBack func(t *testing.T, s *stallEnv, serial string) // checks the serial once A handed back (nil: nothing)
	status        string                                         // the serial's final status
	notBefore     func() time.Time                               // a closed serial's latest deadline (nil: its first)
}

// testStallHandBack holds A's claim reply past the batch's time while w is
// done to one of its four serials, then lets it through: A must hand the
// claim back and close only through later claims — the three others once
// each, at or after their deadline; the written one as w says.
func testStallHandBack(t *testing.T, w lateWrite) {
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
	written := serials[0]
	s.Enqueue(serials, past)

	s.px.Stall(time.Minute) // ended below
	runConsumer(t, a)
	t.Cleanup(func() { s.px.Stall(0) }) // before A is stopped, if the test ends early
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

	w.write(t, s, written)

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
	if w.afterHandBack != nil {
		w.afterHandBack(t, s, written)
	}

	eventually(t, "every order settled, nothing left in Redis", 30*time.Second, func() bool {
		for _, sn := range serials[1:] {
			if s.Status(sn) != "closed" {
				return false
			}
		}
		return s.Status(written) == w.status && s.held() == 0 && s.card(s.Keys.Queue) == 0
	})
	closed := 0
	for _, sn := range serials {
		want := 1
		if sn == written && w.status != "closed" {
			want = 0
		}
		if n := s.store.closedTimes(sn); n != want {
			t.Errorf("%s closed %d times, want %d", sn, n, want)
		}
		closed += want
	}
	// The rows keep the first deadline (expires_at); the written one's
	// latest may be a producer's.
	latest := past
	if w.notBefore != nil {
		latest = w.notBefore()
	}
	var early []string
	if err := s.DB.Select(&early, `SELECT serial_no FROM orders WHERE serial_no = ANY($1)
		AND closed_at < CASE WHEN serial_no = $2 THEN $3 ELSE expires_at END`, pq.Array(serials), written, latest); err != nil {
		t.Fatal(err)
	}
	if len(early) > 0 {
		t.Errorf("%v closed before its latest deadline", early)
	}
	if v := testutil.ToFloat64(s.mA.Closed); v != float64(closed) {
		t.Errorf("A counted %v closes, want %d", v, closed)
	}
	s.assertNoLeaseKeys(t)
	if n := s.card(s.Keys.Dead); n != 0 {
		t.Errorf("%d dead letters", n)
	}
}
