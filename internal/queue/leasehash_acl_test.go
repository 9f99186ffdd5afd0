package queue_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// A Redis user that may run every command the scripts write with but not
// OBJECT (an ACL that lists commands, or rename-command OBJECT ""): the
// claim reads the lease hash's encoding only to make a big batch's hash a
// table, so it must lease as it did before that, never fail — and above
// all never fail after it took entries out of the queue key (a script's
// writes are not undone by its error: they would be lost from Redis).
// Both lease modes, with no lease hash yet and with a compact one.
func TestClaimWithoutObjectLeasesAll(t *testing.T) {
	for _, batch := range []bool{true, false} {
		for _, held := range []int{0, 10} {
			t.Run(fmt.Sprintf("batch=%v/held=%d", batch, held), func(t *testing.T) {
				claimWithoutObject(t, batch, held)
			})
		}
	}
}

func claimWithoutObject(t *testing.T, batch bool, held int) {
	rdb, _ := testenv.PrivateRedis(t) // its ACL is changed below
	ctx := context.Background()
	k := queue.NewKeys("acl:order")
	st := queue.NewStore(rdb, k)
	base := dueAt(t, st, 0)
	const n = 200
	zs := make([]redis.Z, held+n)
	for i := range zs {
		zs[i] = redis.Z{Score: base + float64(i), Member: fmt.Sprintf("S-%04d", i)}
	}
	if err := rdb.ZAdd(ctx, k.Queue, zs...).Err(); err != nil {
		t.Fatal(err)
	}
	if held > 0 { // a compact lease hash of another batch
		if res, err := st.Claim(ctx, queue.ClaimArgs{Limit: held, Lease: time.Minute, Token: "acl:0", Batch: batch}); err != nil || len(res.Items) != held {
			t.Fatalf("first claim: %d items, %v; want %d", len(res.Items), err, held)
		}
	}
	if err := rdb.Do(ctx, "ACL", "SETUSER", "default", "-object").Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.Do(ctx, "OBJECT", "ENCODING", k.Queue).Err(); err == nil {
		t.Fatal("OBJECT still runs: the ACL did not take")
	}
	res, err := st.Claim(ctx, queue.ClaimArgs{Limit: n, Lease: time.Minute, Token: "acl:1", Batch: batch})
	if err != nil || len(res.Items) != n {
		t.Errorf("claim without OBJECT: %d items, %v; want all %d leased", len(res.Items), err, n)
	}
	if q := rdb.ZCard(ctx, k.Queue).Val(); q != 0 {
		t.Errorf("queue key holds %d entries after the claim, want 0", q)
	}
	if l := rdb.HLen(ctx, k.Lease).Val(); l != int64(held+n) {
		t.Errorf("lease hash holds %d records, want %d: entries lost from Redis", l, held+n)
	}
	if rdb.HExists(ctx, k.Lease, "\x00").Val() {
		t.Error(`the lease hash kept the field "\0"`)
	}
}
