package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/admin"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// unbatch on a sharded queue: batch leases in the queue key and in a
// shard are converted (exit 0, per-key lines); a damaged batch is listed
// and left, and the command exits 1 saying how many are left and why.
func TestUnbatchCommand(t *testing.T) {
	env := upEnv(t)
	env["ORDERDELAY_QUEUE_SHARDS"] = "2"
	rdb, _ := testenv.Redis(t)
	ctx := context.Background()
	base := env["ORDERDELAY_QUEUE_KEY"]
	shard := queue.ShardKeys(base, 2)[1]
	t.Cleanup(func() {
		for _, k := range queue.ShardKeys(base, 2) {
			testenv.DeleteQueue(rdb, k)
		}
	})
	seed := func(k queue.Keys, tok, member string) {
		t.Helper()
		_, err := rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
			p.ZAdd(ctx, k.Leases, redis.Z{Score: 1_700_000_060_000, Member: tok})
			p.HSet(ctx, k.LeaseBatch, tok, member, "#"+tok, 1, "<"+tok, 1_700_000_000_000)
			p.HSet(ctx, k.Lease, member, "1700000000000|0|"+tok+"|")
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	seed(queue.NewKeys(base), "pod-a:1.1", "o-1")
	seed(shard, "pod-b:1.1", "o-2")
	r := runCLI(ctx, env, "unbatch")
	if r.code != 0 || !strings.Contains(r.stdout, base+": batch leases converted: 1; orders given a per-member lease: 1") ||
		!strings.Contains(r.stdout, shard.Queue+": batch leases converted: 1") {
		t.Fatalf("unbatch of a batch in the queue key and one in a shard: want exit 0 and a line per key; got %s", r)
	}
	for _, k := range []queue.Keys{queue.NewKeys(base), shard} {
		if n := rdb.ZCard(ctx, k.Inflight).Val(); n != 1 {
			t.Errorf("%s: %d per-member leases, want 1", k.Queue, n)
		}
	}
	seed(shard, "pod-c:1.1", "o-3")
	rdb.HDel(ctx, shard.LeaseBatch, "pod-c:1.1")
	r = runCLI(ctx, env, "unbatch", "--json")
	var got []admin.UnbatchKey
	if err := json.Unmarshal([]byte(r.stdout), &got); err != nil {
		t.Fatalf("unbatch --json: %v in %s", err, r)
	}
	if r.code != 1 || len(got) != 3 || got[2].Remaining != 1 || len(got[2].Problems) != 1 ||
		!strings.Contains(r.stderr, "batch leases left: 1; damaged: 1") {
		t.Fatalf("unbatch with a batch that has no member list: want exit 1, the batch reported and left; got %+v\n%s", got, r)
	}
	if n := rdb.ZCard(ctx, shard.Leases).Val(); n != 1 {
		t.Errorf("%d batch leases in the shard, want the damaged one left", n)
	}
}
