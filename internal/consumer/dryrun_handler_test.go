package consumer

import (
	"context"
	"errors"
	"reflect"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// snapshot is the serialised value (DUMP) of every key of the queue k, by
// key name; an absent key is "".
func (e *env) snapshot(k queue.Keys) map[string]string {
	e.T.Helper()
	out := map[string]string{}
	v := reflect.ValueOf(k)
	for i := range v.NumField() {
		name := v.Field(i).String()
		if name == "" {
			continue
		}
		d, err := e.RDB.Dump(context.Background(), name).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			e.T.Fatal(err)
		}
		out[name] = d
	}
	return out
}

// A dry run's handler (dryRunHandler) reads instead of claiming and leaves
// every key of the queue exactly as it was, whatever path the batch takes:
// orders the close would close (finish), paid orders (settled: finish),
// serials with no row (a retry, or with MaxAttempts 1 a dead letter),
// malformed members and scores (would be dead-lettered), and a member a
// replica holds under a lease. No order is closed, none is dead-lettered,
// and the would-close count is the pending due orders.
func TestDryRunHandlerChangesNothingOnAnyPath(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	now := e.RedisNow()
	past := now.Add(-time.Second)
	// A replica holds one due order under a lease.
	held := e.Orders("held", 1, past)
	e.Enqueue(held, past)
	replica := e.consumer(Config{BatchSize: 1})
	if res, err := replica.claimBatch(ctx); err != nil || len(res.items) != 1 {
		t.Fatalf("replica claim: %d items, %v", len(res.items), err)
	}
	due := e.Orders("due", 3, past)
	e.Enqueue(due, past)
	paid := e.Orders("paid", 1, past)
	if _, err := e.DB.Exec(`UPDATE orders SET status = 'paid', paid_at = now() WHERE serial_no = $1`, paid[0]); err != nil {
		t.Fatal(err)
	}
	e.Enqueue(paid, past)
	e.Enqueue([]string{"norow-00000", "norow-00001"}, past)
	if err := e.RDB.ZAdd(ctx, e.Keys.Queue, redis.Z{Score: float64(queue.DeadlineMillis(past)), Member: "bad\x01serial"},
		redis.Z{Score: 5, Member: "seconds-not-ms"}).Err(); err != nil {
		t.Fatal(err)
	}
	e.Enqueue(e.Orders("later", 1, now.Add(time.Hour)), now.Add(time.Hour))

	before := e.snapshot(e.Keys)
	statuses := e.StatusCounts()
	dead := testutil.CollectAndCount(e.m.DeadLettered)
	for _, maxAttempts := range []int{1, 10} { // no row: dead letter, then retry
		c, err := New(Config{Keys: e.Keys, DryRun: true, BatchSize: 100, MaxAttempts: maxAttempts}, e.RDB,
			orders.DryRun{Store: e.Store}, e.m, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := c.h.(dryRunHandler); !ok {
			t.Fatalf("handler %T for a dry run, want dryRunHandler", c.h)
		}
		res, err := c.claimBatch(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(res.items) != 6 { // 3 due, 1 paid, 2 without a row; the held one is not in the queue key
			t.Fatalf("dry run read %d entries, want 6: %+v", len(res.items), res.items)
		}
		c.process(ctx, res.items)
		c.handBack(res.items) // the shutdown hand-back of what a dry run read
		if got := e.snapshot(e.Keys); !reflect.DeepEqual(got, before) {
			for k, v := range before {
				if got[k] != v {
					t.Errorf("MaxAttempts %d: a dry run changed %s", maxAttempts, k)
				}
			}
		}
	}
	if got := e.StatusCounts(); !reflect.DeepEqual(got, statuses) {
		t.Errorf("order statuses %v after a dry run, want %v", got, statuses)
	}
	if got := testutil.ToFloat64(e.m.DryRunWouldClose); got != 6 {
		t.Errorf("would close %v, want 6 (3 due orders, twice)", got)
	}
	if got := testutil.ToFloat64(e.m.Closed); got != 0 {
		t.Errorf("closed %v in a dry run, want 0", got)
	}
	if got := testutil.CollectAndCount(e.m.DeadLettered); got != dead {
		t.Errorf("dead-letter series %d after a dry run, want %d", got, dead)
	}
	for _, r := range []string{queue.ReasonNotFound, queue.ReasonMalformed} {
		if got := testutil.ToFloat64(e.m.DeadLettered.WithLabelValues(r)); got != 0 {
			t.Errorf("dead-lettered %v as %s in a dry run, want 0", got, r)
		}
	}
}
