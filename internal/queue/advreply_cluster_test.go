package queue_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// The claim's raw reply carries a cluster redirection as bytes, where
// go-redis would have followed it: a cluster client whose slot map is
// stale (the queue's slot moved to another master since it loaded it)
// sends the claim to the old master, reads "MOVED" as a reply, and must
// send it again through runOnce, which the client routes and redirects.
// The claim runs once, on the new master, and leases the entry once;
// the old master is left untouched.
func TestAdvClaimFollowsAMovedSlotOnce(t *testing.T) {
	c := testenv.PrivateCluster(t)
	ctx := context.Background()
	rdb := c.Client(t)
	k := queue.NewKeys("advmoved:order")
	st := queue.NewStore(rdb, k)
	// Load the client's slot map (and the script on the old master).
	if _, err := st.Claim(ctx, queue.ClaimArgs{Limit: 10, Lease: time.Minute, Token: "adv:n.1", Batch: true}); err != nil {
		t.Fatal(err)
	}
	from, err := c.NodeFor(ctx, k.Queue)
	if err != nil {
		t.Fatal(err)
	}
	var to string
	for _, a := range c.Addrs {
		if a != from {
			to = a
			break
		}
	}
	node := func(addr string) *redis.Client {
		n := redis.NewClient(&redis.Options{Addr: addr})
		t.Cleanup(func() { n.Close() })
		return n
	}
	old, dst := node(from), node(to)
	slot, err := old.ClusterKeySlot(ctx, k.Queue).Result()
	if err != nil {
		t.Fatal(err)
	}
	if n, err := old.ClusterCountKeysInSlot(ctx, int(slot)).Result(); err != nil || n != 0 {
		t.Fatalf("slot %d holds %d keys (%v): it cannot move empty", slot, n, err)
	}
	dstID, err := dst.Do(ctx, "cluster", "myid").Text()
	if err != nil {
		t.Fatal(err)
	}
	// Move the empty slot: the new owner first, then the others.
	for _, a := range append([]string{to}, c.Addrs...) {
		if err := node(a).Do(ctx, "cluster", "setslot", slot, "node", dstID).Err(); err != nil {
			t.Fatalf("setslot on %s: %v", a, err)
		}
	}
	// The entry is written on the new owner (straight to it: the test's
	// client must keep its stale map).
	now, err := queue.NewStore(dst, k).Now(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := dst.ZAdd(ctx, k.Queue, redis.Z{Score: float64(queue.DeadlineMillis(now.Add(-time.Second))), Member: "moved"}).Err(); err != nil {
		t.Fatal(err)
	}
	if err := old.Do(ctx, "get", k.Queue).Err(); !redis.HasErrorPrefix(err, "MOVED") {
		t.Fatalf("the old master answers %v, want MOVED: the slot did not move", err)
	}
	res, err := st.Claim(ctx, queue.ClaimArgs{Limit: 10, Lease: time.Minute, Token: "adv:n.2", Batch: true})
	if err != nil || len(res.Items) != 1 || res.Items[0].Serial != "moved" {
		t.Fatalf("claim with a stale slot map = %+v, %v; want the entry, once", res.Items, err)
	}
	// Leased once, on the new owner; a second claim finds nothing.
	if n := dst.ZCard(ctx, k.Queue).Val(); n != 0 {
		t.Errorf("the queue still holds %d entries", n)
	}
	again, err := st.Claim(ctx, queue.ClaimArgs{Limit: 10, Lease: time.Minute, Token: "adv:n.3", Batch: true})
	if err != nil || len(again.Items) != 0 {
		t.Errorf("a second claim = %+v, %v; want nothing", again.Items, err)
	}
}
