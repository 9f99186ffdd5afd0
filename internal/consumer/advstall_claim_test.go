package consumer

import (
	"context"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// A claim whose reply comes after its lease expired: Redis ran the claim,
// then held every reply to replica A (a stuck primary, a partition without
// RST) for longer than the lease, while replica B re-claimed and closed
// the orders. The design's rule is that a lease outlives the work done
// under it ("Leases outlive work, not the reverse"; replicas never work on
// a serial while another's lease holds it): A must not close under a
// claim it heard of only after its lease. End to end:
// e2e TestFaultRedisStallLongerThanTheLease.

// leaseCheckStore asks, each time the consumer begins a close, whether
// owner still holds every serial under a live lease (a lease record with
// owner's token whose batch lease has not expired on Redis's clock), and
// records those it does not.
type leaseCheckStore struct {
	*orders.Store
	e     *env
	owner string

	mu    sync.Mutex
	stale []string
}

func (s *leaseCheckStore) Settle(ctx context.Context, serials []string, fence orders.Fence) (orders.Outcome, error) {
	s.check(serials)
	return s.Store.Settle(ctx, serials, fence)
}

func (s *leaseCheckStore) check(serials []string) {
	ctx := context.Background()
	now := s.e.RedisNow().UnixMilli()
	recs, ok, err := s.e.st.LeaseRecords(ctx, serials)
	if err != nil {
		s.e.T.Error(err)
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, sn := range serials {
		live := false
		if ok[i] && strings.HasPrefix(recs[i].Token, s.owner+":") {
			exp, err := s.e.RDB.ZScore(ctx, s.e.Keys.Leases, recs[i].Token).Result()
			live = err == nil && int64(exp) > now
		}
		if !live {
			s.stale = append(s.stale, sn)
		}
	}
}

func (s *leaseCheckStore) staleSerials() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.stale)
}

func TestAdvStallClaimHeardAfterItsLeaseIsNotActedOn(t *testing.T) {
	if os.Getenv("ORDERDELAY_ADV_REPRO") != "1" {
		t.Skip("reproducer of an open defect (branch redis-stall): a claim whose reply comes after its lease expired is still " +
			"processed — the batch's deadline counts from the reply's arrival, not from the claim — so replica A runs its close " +
			"over orders replica B has re-claimed (the fence and the SQL keep it from closing twice). ORDERDELAY_ADV_REPRO=1 runs it")
	}
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	const lease = time.Second
	cfg := Config{Lease: lease, StatementTimeout: 200 * time.Millisecond, DrainTimeout: 200 * time.Millisecond}
	b := e.consumer(withOwner(cfg, "B"))
	// The claim script is loaded (nothing is queued yet), so A's claim
	// runs at its first EVALSHA.
	if _, err := b.claimBatch(ctx); err != nil {
		t.Fatal(err)
	}
	// A reaches Redis through a proxy and waits up to a minute for a
	// reply; its connection is made before the stall.
	px := testenv.NewProxy(t, e.RDB.Options().Addr)
	o, err := redis.ParseURL(testenv.RedisURL())
	if err != nil {
		t.Fatal(err)
	}
	o.Addr, o.ReadTimeout = px.Addr(), time.Minute
	rdbA := redis.NewClient(o)
	t.Cleanup(func() { rdbA.Close() })
	if err := rdbA.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	past := e.RedisNow().Add(-time.Second)
	serials := e.Orders("heardlate", 5, past)
	e.Enqueue(serials, past)

	px.Stall(time.Minute) // ended below
	mA := metrics.New(prometheus.NewRegistry(), "test", "test")
	store := &leaseCheckStore{Store: e.Store, e: e, owner: "A"}
	cfgA := withOwner(cfg, "A")
	cfgA.Keys, cfgA.HeadCheck, cfgA.SharedWake = e.Keys, 20*time.Millisecond, true // no subscription: its reply is held too
	a, err := New(cfgA, rdbA, store, mA, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	if err != nil {
		t.Fatal(err)
	}
	stopA := runConsumer(t, a)
	eventually(t, "A's claim run by Redis, its reply held", 10*time.Second, func() bool {
		recs, ok, err := e.st.LeaseRecords(ctx, serials)
		if err != nil {
			t.Fatal(err)
		}
		for i := range recs {
			if !ok[i] || !strings.HasPrefix(recs[i].Token, "A:") {
				return false
			}
		}
		return true
	})
	// A's lease expires; B re-claims and closes the orders.
	stopB := runConsumer(t, b)
	eventually(t, "B closes the orders once A's lease expired", 30*time.Second, func() bool {
		return testutil.ToFloat64(e.m.Closed) == float64(len(serials))
	})
	stopB()
	px.Stall(0)
	eventually(t, "A hears its claim and is done with it", 30*time.Second, func() bool {
		return testutil.ToFloat64(mA.Claimed) == float64(len(serials)) && testutil.ToFloat64(mA.Inflight) == 0
	})
	stopA()
	if stale := store.staleSerials(); len(stale) > 0 {
		t.Errorf("A began closing %v, which it held under no live lease: it acted on a claim it heard of only after the "+
			"claim's lease expired (and B had re-claimed and closed them)", stale)
	}
	for _, s := range serials {
		if st := e.Status(s); st != "closed" {
			t.Errorf("%s is %s, want closed (by B)", s, st)
		}
	}
	if v := testutil.ToFloat64(mA.Closed); v != 0 {
		t.Errorf("A counted %v closes of orders B closed", v)
	}
}

func withOwner(c Config, owner string) Config {
	c.Owner = owner
	return c
}
