package queue_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// The claim bypasses go-redis's Script.Run (it must not be resent: see
// runOnce), so what Script.Run did for it is checked here: a Redis that
// lost its scripts (restarted, SCRIPT FLUSH) is given the script again,
// and on Redis Cluster the claim works whichever node holds the queue's
// slot (the queues here lie on at least two).
func TestClaimRunsOnAFlushedRedisAndOnACluster(t *testing.T) {
	claimAll := func(t *testing.T, rdb redis.UniversalClient, k queue.Keys) {
		t.Helper()
		ctx := context.Background()
		st := queue.NewStore(rdb, k)
		now, err := st.Now(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := rdb.ZAdd(ctx, k.Queue, redis.Z{Score: float64(queue.DeadlineMillis(now.Add(-time.Second))), Member: "a"}).Err(); err != nil {
			t.Fatal(err)
		}
		res, err := st.Claim(ctx, queue.ClaimArgs{Limit: 10, Lease: time.Minute, Token: "once:n.1", Batch: true})
		if err != nil || len(res.Items) != 1 {
			t.Fatalf("claim on %s: %v, %+v", k.Queue, err, res.Items)
		}
	}
	t.Run("flushed", func(t *testing.T) {
		rdb, _ := testenv.PrivateRedis(t)
		if err := rdb.ScriptFlush(context.Background()).Err(); err != nil {
			t.Fatal(err)
		}
		claimAll(t, rdb, queue.NewKeys("once:order"))
	})
	t.Run("cluster", func(t *testing.T) {
		c := testenv.PrivateCluster(t)
		rdb := c.Client(t)
		nodes := map[string]bool{}
		for _, q := range []string{"once:a", "once:b", "once:c", "once:d", "once:e", "once:f"} {
			node, err := c.NodeFor(context.Background(), q)
			if err != nil {
				t.Fatal(err)
			}
			nodes[node] = true
			claimAll(t, rdb, queue.NewKeys(q))
		}
		if len(nodes) < 2 {
			t.Fatalf("the queues all lie on one node (%v): the test proves nothing about routing", nodes)
		}
	})
}
