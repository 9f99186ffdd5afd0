package queue_test

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// NextDue answers the earliest of the queue's head and the first lease to
// end, or -1 when there is neither or the queue is paused.
func TestStoreNextDue(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	st := queue.NewStore(rdb, keys)
	ctx := context.Background()
	check := func(what string, want int64) {
		t.Helper()
		now, next, err := st.NextDue(ctx)
		if err != nil || next != want || now < queue.MinDeadline {
			t.Errorf("%s: now %d, next %d, %v; want next %d", what, now, next, err, want)
		}
	}
	check("empty", -1)
	rdb.ZAdd(ctx, keys.Queue, redis.Z{Member: "q", Score: 5000})
	check("queued", 5000)
	rdb.ZAdd(ctx, keys.Inflight, redis.Z{Member: "l", Score: 3000})
	check("a lease ends first", 3000)
	rdb.ZAdd(ctx, keys.Inflight, redis.Z{Member: "l", Score: 7000})
	check("the head first", 5000)
	rdb.Set(ctx, keys.Paused, "1|test", 0)
	check("paused", -1)
}
