package queue_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Adversary probe: an ACL tightened while the daemon runs (the start-up
// permission check cannot see it) refuses a command the claim sends after
// its first write. OBJECT is asked with pcall before any write (528f21d);
// this asks whether any other refusal mid-script loses entries from every
// key of the queue: each due entry must still be in the queue key or in
// the lease hash after the claim failed.
// It fails on main for HSET (all 20 due entries gone from Redis: the
// queue key's ZREMRANGEBYRANK ran, the lease records' HSET was refused),
// so it runs only when asked: ORDERDELAY_ADV_REPRO=1.
func TestAdvClaimRefusedMidScriptKeepsEveryEntry(t *testing.T) {
	if os.Getenv("ORDERDELAY_ADV_REPRO") == "" {
		t.Skip("known failure on main (HSET refused mid-script loses the batch); ORDERDELAY_ADV_REPRO=1 runs it")
	}
	for _, cmd := range []string{"hset", "zadd", "hlen"} {
		for _, batch := range []bool{true, false} {
			t.Run(fmt.Sprintf("-%s/batch=%v", cmd, batch), func(t *testing.T) {
				rdb, _ := testenv.PrivateRedis(t) // its ACL is changed below
				ctx := context.Background()
				k := queue.NewKeys("acl:order")
				st := queue.NewStore(rdb, k)
				base := dueAt(t, st, 0)
				const n = 20
				zs := make([]redis.Z, n)
				for i := range zs {
					zs[i] = redis.Z{Score: base + float64(i), Member: fmt.Sprintf("S-%04d", i)}
				}
				if err := rdb.ZAdd(ctx, k.Queue, zs...).Err(); err != nil {
					t.Fatal(err)
				}
				if err := rdb.Do(ctx, "ACL", "SETUSER", "default", "-"+cmd).Err(); err != nil {
					t.Fatal(err)
				}
				_, err := st.Claim(ctx, queue.ClaimArgs{Limit: n, Lease: time.Minute, Token: "acl:1", Batch: batch})
				t.Logf("claim: %v", err)
				if err := rdb.Do(ctx, "ACL", "SETUSER", "default", "+"+cmd).Err(); err != nil {
					t.Fatal(err)
				}
				q := rdb.ZCard(ctx, k.Queue).Val()
				l := rdb.HLen(ctx, k.Lease).Val()
				if err != nil && q+l < n {
					t.Errorf("claim refused %s mid-script: queue key %d + lease hash %d of %d entries: %d lost from Redis", cmd, q, l, n, n-q-l)
				}
			})
		}
	}
}
