package consumer

import (
	"context"
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
// records those it does not, the lease tokens the serials were begun
// under, and how many times each serial was closed.
type leaseCheckStore struct {
	*orders.Store
	e     *env
	owner string

	mu     sync.Mutex
	stale  []string
	began  map[string][]string // lease token -> serials a close began under it
	closes map[string]int      // serial -> closes that committed
}

func (s *leaseCheckStore) Settle(ctx context.Context, serials []string, fence orders.Fence) (orders.Outcome, error) {
	s.check(serials)
	out, err := s.Store.Settle(ctx, serials, fence)
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, sn := range out.Closed {
		if s.closes == nil {
			s.closes = map[string]int{}
		}
		s.closes[sn]++
	}
	return out, err
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
		if ok[i] {
			if s.began == nil {
				s.began = map[string][]string{}
			}
			s.began[recs[i].Token] = append(s.began[recs[i].Token], sn)
		}
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

// begunUnder is the serials a close began while their lease record
// carried token.
func (s *leaseCheckStore) begunUnder(token string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.began[token])
}

// closedTimes is how many closes of serial committed.
func (s *leaseCheckStore) closedTimes(serial string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closes[serial]
}

// stallEnv is an env with replica A behind a proxy (Redis's replies to it
// can be held) and B on the test's own connection, both with a 1 s lease.
type stallEnv struct {
	*env
	px    *testenv.Proxy
	cfg   Config
	b     *Consumer
	mA    *metrics.Metrics
	store *leaseCheckStore // A's
}

func newStallEnv(t *testing.T) *stallEnv {
	t.Helper()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	cfg := Config{Lease: time.Second, StatementTimeout: 200 * time.Millisecond, DrainTimeout: 200 * time.Millisecond}
	b := e.consumer(withOwner(cfg, "B"))
	// The claim script is loaded (nothing is queued yet), so A's claim
	// runs at its first EVALSHA.
	if _, err := b.claimBatch(ctx); err != nil {
		t.Fatal(err)
	}
	return &stallEnv{env: e, px: testenv.NewProxy(t, e.RDB.Options().Addr), cfg: cfg, b: b,
		mA: metrics.New(prometheus.NewRegistry(), "test", "test"), store: &leaseCheckStore{Store: e.Store, e: e, owner: "A"}}
}

// replicaA is A: it reaches Redis through the proxy and waits up to a
// minute for a reply. Its connection is made at once, before any stall,
// so its first claim goes out on it.
func (s *stallEnv) replicaA(t *testing.T) *Consumer {
	t.Helper()
	o, err := redis.ParseURL(testenv.RedisURL())
	if err != nil {
		t.Fatal(err)
	}
	o.Addr, o.ReadTimeout = s.px.Addr(), time.Minute
	rdbA := redis.NewClient(o)
	t.Cleanup(func() { rdbA.Close() })
	if err := rdbA.Ping(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	cfg := withOwner(s.cfg, "A")
	cfg.Keys, cfg.HeadCheck, cfg.SharedWake = s.Keys, 20*time.Millisecond, true // no subscription: its reply would be held too
	a, err := New(cfg, rdbA, s.store, s.mA, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// leasedTo reports whether every serial's lease record carries a token of
// owner's.
func (s *stallEnv) leasedTo(t *testing.T, owner string, serials []string) bool {
	t.Helper()
	recs, ok, err := s.st.LeaseRecords(context.Background(), serials)
	if err != nil {
		t.Fatal(err)
	}
	for i := range recs {
		if !ok[i] || !strings.HasPrefix(recs[i].Token, owner+":") {
			return false
		}
	}
	return true
}

func TestAdvStallClaimHeardAfterItsLeaseIsNotActedOn(t *testing.T) {
	s := newStallEnv(t)
	a := s.replicaA(t)
	past := s.RedisNow().Add(-time.Second)
	serials := s.Orders("heardlate", 5, past)
	s.Enqueue(serials, past)

	s.px.Stall(time.Minute) // ended below
	stopA := runConsumer(t, a)
	eventually(t, "A's claim run by Redis, its reply held", 10*time.Second, func() bool { return s.leasedTo(t, "A", serials) })
	// A's lease expires; B re-claims and closes the orders.
	stopB := runConsumer(t, s.b)
	eventually(t, "B closes the orders once A's lease expired", 30*time.Second, func() bool {
		return testutil.ToFloat64(s.m.Closed) == float64(len(serials))
	})
	stopB()
	s.px.Stall(0)
	eventually(t, "A hears its claim and is done with it", 30*time.Second, func() bool {
		return testutil.ToFloat64(s.mA.Claimed) == float64(len(serials)) && testutil.ToFloat64(s.mA.Inflight) == 0
	})
	stopA()
	if stale := s.store.staleSerials(); len(stale) > 0 {
		t.Errorf("A began closing %v, which it held under no live lease: it acted on a claim it heard of only after the "+
			"claim's lease expired (and B had re-claimed and closed them)", stale)
	}
	for _, sn := range serials {
		if st := s.Status(sn); st != "closed" {
			t.Errorf("%s is %s, want closed (by B)", sn, st)
		}
	}
	if v := testutil.ToFloat64(s.mA.Closed); v != 0 {
		t.Errorf("A counted %v closes of orders B closed", v)
	}
	s.assertNoLeaseKeys(t)
}

// A reply held for less than the batch's time is acted on, in what is left
// of it: A closes the orders, under its live lease.
func TestAdvStallClaimHeardLateWithinItsBatchTimeIsClosed(t *testing.T) {
	s := newStallEnv(t)
	a := s.replicaA(t)
	past := s.RedisNow().Add(-time.Second)
	serials := s.Orders("heardsoon", 5, past)
	s.Enqueue(serials, past)
	batch, _ := a.batchBudget()
	s.px.Stall(batch / 3) // the proxy ends it
	runConsumer(t, a)
	eventually(t, "A closes the orders", 30*time.Second, func() bool {
		return testutil.ToFloat64(s.mA.Closed) == float64(len(serials))
	})
	if stale := s.store.staleSerials(); len(stale) > 0 {
		t.Errorf("A began closing %v under no live lease", stale)
	}
	for _, sn := range serials {
		if st := s.Status(sn); st != "closed" {
			t.Errorf("%s is %s, want closed", sn, st)
		}
	}
}

func withOwner(c Config, owner string) Config {
	c.Owner = owner
	return c
}
