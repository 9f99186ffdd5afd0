package tasks

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// A poll counts what its claims did as the scan loop counts its own: every
// task claimed (those it then buried too), entries dead-lettered by the
// claim by reason, and the burial of tasks over their attempts as
// "failed"; what it hands out is the poller's, not in flight here. A lease
// left out is DefaultLease.
func TestPollCountsItsClaims(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb, keys := testenv.Redis(t)
	st := queue.NewStore(rdb, keys)
	m := metrics.New(prometheus.NewRegistry(), "test", "test")
	log := zaptest.NewLogger(t)
	r := &Runtime{Config: Queue{Name: "q", Key: keys.Queue, Retry: Retry{MaxAttempts: 1}}, Keys: keys, Redis: rdb, Store: st, Metrics: m}
	now, err := st.Now(ctx)
	if err != nil {
		t.Fatal(err)
	}
	put := func(id string, due time.Time) {
		t.Helper()
		if _, err := st.PutTask(ctx, queue.ModeCreate, queue.WriterClient, queue.TaskWrite{ID: id, DeadlineMS: queue.DeadlineMillis(due)}); err != nil {
			t.Fatal(err)
		}
	}
	// A raw producer's seconds for milliseconds: the claim dead-letters it.
	rdb.ZAdd(ctx, keys.Queue, redisZ("secs", float64(now.Unix())))
	// "old" has run once, its lease expired: the next claim is its second
	// run, over MaxAttempts 1.
	put("old", now.Add(-time.Hour))
	if ts, _, err := PollStore(ctx, st, queue.PollArgs{Limit: 10, Lease: time.Minute, MaxAttempts: 5}, m, log); err != nil || len(ts) != 1 {
		t.Fatalf("first poll: %+v, %v", ts, err)
	}
	rdb.ZAdd(ctx, keys.Inflight, redisZ("old", 1)) // its lease ran out long ago
	put("new", now.Add(-time.Second))

	ts, tok, err := r.Poll(ctx, 1, 0, 0, log)
	if err != nil || len(ts) != 1 || ts[0].ID != "new" || tok == "" {
		t.Fatalf("poll: %+v %q, %v; want new under a token", ts, tok, err)
	}
	for name, c := range map[string]struct {
		got  float64
		want float64
	}{
		"claimed":                     {testutil.ToFloat64(m.Claimed), 3}, // old twice, new
		"dead_lettered{failed}":       {testutil.ToFloat64(m.DeadLettered.WithLabelValues(queue.ReasonFailed)), 1},
		"dead_lettered{out of range}": {testutil.ToFloat64(m.DeadLettered.WithLabelValues(queue.ReasonScoreOutOfRange)), 1},
		"errors{remove}":              {testutil.ToFloat64(m.Errors.WithLabelValues(metrics.StageRemove)), 0},
		"inflight":                    {testutil.ToFloat64(m.Inflight), 0},
	} {
		if c.got != c.want {
			t.Errorf("%s = %v, want %v", name, c.got, c.want)
		}
	}
	exp, err := rdb.ZScore(ctx, keys.Inflight, "new").Result()
	if lease := time.UnixMilli(int64(exp)).Sub(now); err != nil || lease < DefaultLease || lease > DefaultLease+time.Minute {
		t.Errorf("new leased until %v after the start (%v), want the default lease %v and a little", lease, err, DefaultLease)
	}
}
