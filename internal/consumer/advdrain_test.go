package consumer

import (
	"context"
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

// The drain's time counts from the stop, not from the scan loop's end.
// ORDERDELAY_DRAIN_TIMEOUT is "how long in-flight batches may finish on
// SIGTERM": a scanner that is in a Redis call when the stop comes (a claim
// or a head check whose reply Redis holds: a stuck primary) returns only
// when that call does, up to a whole read timeout later, and the batches
// in flight must not be given that time on top. End to end:
// e2e TestFaultRedisHangsAtShutdown, whose batches ran out their own time
// (and took the retry path) while the drain waited for the scanner.

// heldStore is a Store whose Settle blocks until its context ends: a
// batch that never finishes by itself. It reports when the first Settle
// began and when its context ended.
type heldStore struct {
	*orders.Store
	once    sync.Once
	began   chan struct{}
	cut     chan struct{} // closed when the first Settle's context ended
	cutOnce sync.Once
}

func (s *heldStore) Settle(ctx context.Context, serials []string, fence orders.Fence) (orders.Outcome, error) {
	s.once.Do(func() { close(s.began) })
	<-ctx.Done()
	s.cutOnce.Do(func() { close(s.cut) })
	return orders.Outcome{}, ctx.Err()
}

func TestAdvDrainTimeoutCountsFromTheStopNotTheScannersLastCall(t *testing.T) {
	e := newEnv(t, orderStatements())
	px := testenv.NewProxy(t, e.RDB.Options().Addr)
	o, err := redis.ParseURL(testenv.RedisURL())
	if err != nil {
		t.Fatal(err)
	}
	// The scanner's Redis calls wait up to a minute for a reply: a stalled
	// call holds the scan loop that long.
	o.Addr, o.ReadTimeout = px.Addr(), time.Minute
	rdb := redis.NewClient(o)
	t.Cleanup(func() { rdb.Close() })
	hook := testenv.NewSentAfter()
	rdb.AddHook(hook)
	store := &heldStore{Store: e.Store, began: make(chan struct{}), cut: make(chan struct{})}
	const drain = 300 * time.Millisecond
	cfg := Config{Keys: e.Keys, HeadCheck: 20 * time.Millisecond, SharedWake: true, Workers: 2, BatchSize: 10,
		Lease: 3 * time.Minute, StatementTimeout: 2 * time.Minute, DrainTimeout: drain}
	m := metrics.New(prometheus.NewRegistry(), "test", "test")
	c, err := New(cfg, rdb, store, m, zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel)))
	if err != nil {
		t.Fatal(err)
	}
	past := e.RedisNow().Add(-time.Second)
	serials := e.Orders("drainfromstop", 3, past)
	e.Enqueue(serials, past)

	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan struct{})
	go func() { defer close(ran); c.Run(ctx) }()
	t.Cleanup(func() {
		px.Stall(0)
		cancel()
		<-ran
	})
	<-store.began
	// One worker is closing the batch (and stays in it); the scanner, with
	// the other worker free, keeps checking the queue's head. Redis holds
	// every reply from now on, and the scanner's next call waits.
	px.Stall(5 * time.Minute) // ended at cleanup
	hook.Arm()
	select {
	case <-hook.Sent():
	case <-time.After(30 * time.Second):
		t.Fatal("the scanner sent nothing to Redis within 30 s of the stall")
	}
	stopped := time.Now()
	cancel()
	// Generous against a busy machine, far below the scanner's read
	// timeout (1 min) and the stall.
	const bound = 20 * time.Second
	select {
	case <-store.cut:
		t.Logf("the batch in flight was cut %s after the stop (drain timeout %s)", time.Since(stopped).Round(time.Millisecond), drain)
	case <-time.After(bound):
		t.Fatalf("the batch in flight was not cut within %s of the stop (drain timeout %s): the drain's time began only "+
			"once the scanner's Redis call returned", bound, drain)
	}
	px.Stall(0)
	select {
	case <-ran:
	case <-time.After(2 * time.Minute):
		t.Fatal("Run did not return within 2 min of the stall's end")
	}
	// The cut batch was handed back (the stall over): due again, not leased.
	if got := testutil.ToFloat64(m.Inflight); got != 0 {
		t.Errorf("%v orders still counted in flight after Run returned", got)
	}
	if n, err := e.RDB.ZCard(context.Background(), e.Keys.Queue).Result(); err != nil || n != int64(len(serials)) {
		t.Errorf("the queue holds %d entries (%v) after the cut batch was handed back, want %d", n, err, len(serials))
	}
}
