package consumer

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// recordingStore closes through Store and records, per Settle call, the
// serial prefix of its batch ("k3" for key 3) and the most calls at once.
type recordingStore struct {
	Store
	mu       sync.Mutex
	batches  []string
	inFlight int
	most     int
}

func (r *recordingStore) Settle(ctx context.Context, serials []string, fence orders.Fence) (orders.Outcome, error) {
	r.mu.Lock()
	prefix, _, _ := strings.Cut(serials[0], "-")
	r.batches = append(r.batches, prefix)
	r.inFlight++
	r.most = max(r.most, r.inFlight)
	r.mu.Unlock()
	time.Sleep(5 * time.Millisecond) // a database that takes its time
	defer func() {
		r.mu.Lock()
		r.inFlight--
		r.mu.Unlock()
	}()
	return r.Store.Settle(ctx, serials, fence)
}

func TestGroupServesEveryKeyFairlyWithinTheWorkerBudget(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	all := e.ShardKeys(4)
	const perKey, batch, workers = 400, 20, 2
	due := time.Now().Add(-time.Minute)
	for i, k := range all {
		e.ZAdd(k.Queue, e.Orders(fmt.Sprintf("k%d", i), perKey, due), due)
	}
	rec := &recordingStore{Store: e.Store}
	g, err := NewGroup(Config{Workers: workers, BatchSize: batch, HeadCheck: 20 * time.Millisecond}, all,
		e.RDB, rec, e.m, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	if err != nil {
		t.Fatal(err)
	}
	if n := len(g.Consumers()); n != len(all) {
		t.Fatalf("%d consumers, want one per key (%d)", n, len(all))
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); g.Run(ctx) }()
	defer func() { cancel(); <-done }()
	eventually(t, "every order closed", 60*time.Second, func() bool {
		return e.StatusCounts()["closed"] == perKey*len(all)
	})
	cancel()
	<-done
	for i, k := range all {
		if n := e.card(k.Queue) + e.heldIn(k); n != 0 {
			t.Errorf("key %d (%s) still holds %d entries", i, k.Queue, n)
		}
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if rec.most > workers {
		t.Errorf("%d batches closed at once, want at most the shared budget of %d", rec.most, workers)
	}
	// Fair: once every key's consumer is claiming, and while every key
	// still has a backlog (half of the batches from there), each key gets
	// its share, give or take two batches. On a loaded machine one
	// consumer may start claiming a few batches before the others run at
	// all (seen: k3 k3 k3 k0 k1 k2 k4 …); the window starts one round
	// before the last key's first batch, so that head start is not counted.
	seen, start := map[string]bool{}, 0
	for i, b := range rec.batches {
		if seen[b] {
			continue
		}
		seen[b] = true
		if len(seen) == len(all) {
			start = max(0, i-(len(all)-1))
			break
		}
	}
	if len(seen) != len(all) {
		t.Fatalf("only %d of %d keys closed a batch: %v", len(seen), len(all), rec.batches)
	}
	rest := rec.batches[start:]
	half := rest[:len(rest)/2]
	count := map[string]int{}
	for _, b := range half {
		count[b]++
	}
	for i := range all {
		got, want := count[fmt.Sprintf("k%d", i)], len(half)/len(all)
		if got < want-2 || got > want+2 {
			t.Errorf("key %d closed %d of the first %d batches, want about %d: %v", i, got, len(half), want, half)
		}
	}
	if v := testutil.ToFloat64(e.m.Claimed); v != perKey*float64(len(all)) {
		t.Errorf("claimed_total %v, want %d", v, perKey*len(all))
	}
}

func TestGroupOfOneIsAPlainConsumer(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	cfg := Config{Workers: 3, MaxCloseRate: 10, HeadCheck: time.Second}
	g, err := NewGroup(cfg, []queue.Keys{e.Keys}, e.RDB, unusedStore{}, e.m, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	if len(g.Consumers()) != 1 {
		t.Fatalf("%d consumers, want 1", len(g.Consumers()))
	}
	got := g.Consumers()[0].Config()
	plain, err := New(Config{Keys: e.Keys, Workers: 3, MaxCloseRate: 10, HeadCheck: time.Second, Owner: got.Owner}, e.RDB, unusedStore{}, e.m, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	want := plain.Config()
	if got.Slots != nil || got.Limiter != nil || got.HeadCheck != want.HeadCheck || got.Keys != want.Keys || got.Workers != want.Workers {
		t.Errorf("group of one: config %+v, want that of New: %+v", got, want)
	}
	sharded, err := NewGroup(cfg, e.ShardKeys(4), e.RDB, unusedStore{}, e.m, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	cs := sharded.Consumers()
	for i, c := range cs {
		cc := c.Config()
		if cc.Slots == nil || cc.Slots != cs[0].Config().Slots || cap(cc.Slots) != 3 {
			t.Errorf("consumer %d: slots %v (cap %d), want the group's shared 3", i, cc.Slots, cap(cc.Slots))
		}
		if cc.Limiter == nil || cc.Limiter != cs[0].Config().Limiter {
			t.Errorf("consumer %d: limiter not shared", i)
		}
		if cc.HeadCheck != 5*time.Second {
			t.Errorf("consumer %d: head check every %s, want 5s (1s × 5 keys)", i, cc.HeadCheck)
		}
		if i > 0 && cc.Owner != cs[0].Config().Owner+fmt.Sprintf("#%d", i-1) {
			t.Errorf("consumer %d: owner %q, want the replica's with #%d", i, cc.Owner, i-1)
		}
	}
}

func TestReadStatsAllSumsTheKeys(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	all := e.ShardKeys(3)
	now := e.RedisNow()
	e.ZAdd(all[0].Queue, []string{"a1", "a2"}, now.Add(-10*time.Second))
	e.ZAdd(all[1].Queue, []string{"b1"}, now.Add(-30*time.Second))
	e.ZAdd(all[2].Queue, []string{"c1", "c2", "c3"}, now.Add(time.Hour))
	e.ZAdd(all[3].Queue, []string{"d1"}, now.Add(time.Minute))
	if err := e.RDB.ZAdd(context.Background(), all[3].Dead, redis.Z{Score: 1, Member: "x"}).Err(); err != nil {
		t.Fatal(err)
	}
	sum, each, err := ReadStatsAll(context.Background(), e.RDB, all)
	if err != nil {
		t.Fatal(err)
	}
	if len(each) != 4 || each[2].Depth != 3 {
		t.Fatalf("per-key stats %+v, want 4 with key 2 at depth 3", each)
	}
	if sum.Depth != 7 || sum.Overdue != 3 || sum.DeadLetters != 1 {
		t.Errorf("depth %d, overdue %d, dead %d; want 7, 3, 1", sum.Depth, sum.Overdue, sum.DeadLetters)
	}
	if sum.OldestDue < 29*time.Second || sum.OldestDue > 40*time.Second {
		t.Errorf("oldest overdue %s, want about 30s (the oldest over all keys)", sum.OldestDue)
	}
	if d := sum.NextDeadline.Sub(now); d < 50*time.Second || d > 70*time.Second {
		t.Errorf("next deadline in %s, want about 1m (the earliest over all keys)", d)
	}
}
