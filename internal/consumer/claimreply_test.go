package consumer

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// The connection drops after the claim script ran and before its reply
// reached the daemon (a private redis-server behind a proxy that loses
// the reply). The daemon never learns what it leased: those entries must
// come back when the lease expires, and every order must close, once.
//
// With go-redis's default MaxRetries (what the daemon runs with), the
// client re-sent the same EVALSHA on a new connection, so the claim ran
// twice under one lease token: the second run leased the next due
// entries and wrote the batch's member list over the first's. The
// daemon closed the second set; the first still carried the token, but
// no batch named them any more, so no claim ever took them back (lost
// until the reconciler's grace). The claim now runs without the client's
// retry.
func TestClaimWhoseReplyIsLostComesBackWhenItsLeaseExpires(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		retries int
	}{
		{"client retries (the daemon's default)", 0},
		{"no client retries", -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			direct, addr := testenv.PrivateRedis(t)
			proxy := testenv.NewProxy(t, addr)
			keys := queue.NewKeys("claimreply:order")
			db, _ := testenv.Postgres(t)
			cl, err := client.New(direct, keys.Queue)
			if err != nil {
				t.Fatal(err)
			}
			e := &env{Env: testenv.Env{T: t, RDB: direct, Keys: keys, DB: db, Store: orders.NewStore(db, orderStatements())},
				m: metrics.New(prometheus.NewRegistry(), "test", "test"), cl: cl, st: queue.NewStore(direct, keys)}
			via := redis.NewClient(&redis.Options{Addr: proxy.Addr(), MaxRetries: tc.retries})
			t.Cleanup(func() { via.Close() })
			c := e.consumer(Config{BatchSize: 5, Lease: time.Minute})
			c.rdb = via
			c.q = queue.NewStore(via, keys)
			c.stopping = make(chan struct{})
			ctx := context.Background()
			// Load the script first: a lost NOSCRIPT reply would say nothing.
			if res, err := c.claimBatch(ctx); err != nil || len(res.items) != 0 {
				t.Fatalf("warm-up claim: %v, %d", err, len(res.items))
			}
			past := e.RedisNow().Add(-time.Second)
			serials := e.Orders("lostreply", 10, past)
			e.Enqueue(serials, past)

			proxy.DropReplies(1)
			res, err := c.claimBatch(ctx)
			t.Logf("claim with its reply lost: %v, %d items; %d entries held", err, len(res.items), e.held())
			if err == nil {
				c.process(ctx, res.items)
			}
			closed := func() int {
				n := 0
				for _, s := range serials {
					if e.Status(s) == "closed" {
						n++
					}
				}
				return n
			}
			for round := 0; closed() < len(serials) && round < 4; round++ {
				// Every lease ends now (the data moves, not the clock).
				toks, err := direct.ZRange(ctx, keys.Leases, 0, -1).Result()
				if err != nil {
					t.Fatal(err)
				}
				for _, tok := range toks {
					direct.ZAdd(ctx, keys.Leases, redis.Z{Score: 1, Member: tok})
				}
				res, err := c.claimBatch(ctx)
				if err != nil {
					t.Fatalf("round %d claim: %v", round, err)
				}
				c.process(ctx, res.items)
			}
			if n := closed(); n != len(serials) {
				t.Fatalf("%d of %d orders closed: the entries of the claim whose reply was lost never came back (%d still held)",
					n, len(serials), e.held())
			}
			if v := testutil.ToFloat64(e.m.Closed); v != float64(len(serials)) {
				t.Errorf("closed_total %v, want %d", v, len(serials))
			}
			if v := testutil.ToFloat64(e.m.Reclaimed); v < 5 {
				t.Errorf("reclaimed_total %v, want the lost claim's 5 back after their lease", v)
			}
			for _, s := range serials {
				e.assertNoEntries(t, s)
			}
			if n := e.held(); n != 0 {
				t.Errorf("%d entries still held", n)
			}
			if n := e.card(keys.Leases); n != 0 {
				t.Errorf("%d batch leases left", n)
			}
		})
	}
}
