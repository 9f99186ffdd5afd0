package queue_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// A serial named twice in one call to Finish, Retry, Bury or HandBack is one
// member of its batch lease: the batch's count ("#"+token in
// {Q}:leasebatch) loses one, not two. Over-counting dropped the batch from
// {Q}:leases while it still held members, and a holder that died then left
// those members leased for ever (only the reconciler found them, a grace
// later): here the batch of three loses s1 (named twice) and s2, and s3
// must still come back when the batch's lease expires.
func TestRepeatedSerialTakesOneMemberOffItsBatch(t *testing.T) {
	ops := []struct {
		name string
		do   func(st *queue.Store, tok string, serials []string) (int, error)
	}{
		{"finish", func(st *queue.Store, tok string, s []string) (int, error) {
			return st.Finish(context.Background(), tok, s, false)
		}},
		{"retry", func(st *queue.Store, tok string, s []string) (int, error) {
			r, err := st.Retry(context.Background(), queue.RetryArgs{Token: tok, Serials: s, Delay: time.Hour, LastError: "x"})
			return r.Moved, err
		}},
		{"bury", func(st *queue.Store, tok string, s []string) (int, error) {
			return st.Bury(context.Background(), queue.BuryArgs{Token: tok, Serials: s, Reason: queue.ReasonCloseFailed, LastError: "x", CountRun: true})
		}},
		{"hand back", func(st *queue.Store, tok string, s []string) (int, error) {
			return st.HandBack(context.Background(), tok, s)
		}},
	}
	for _, op := range ops {
		t.Run(op.name, func(t *testing.T) {
			rdb, k := testenv.Redis(t)
			ctx := context.Background()
			st := queue.NewStore(rdb, k)
			now, err := st.Now(ctx)
			if err != nil {
				t.Fatal(err)
			}
			past := float64(queue.DeadlineMillis(now.Add(-time.Second)))
			for _, s := range []string{"s1", "s2", "s3"} {
				if err := rdb.ZAdd(ctx, k.Queue, redis.Z{Score: past, Member: s}).Err(); err != nil {
					t.Fatal(err)
				}
			}
			const tok = "holder:n.1"
			res, err := st.Claim(ctx, queue.ClaimArgs{Limit: 10, Lease: time.Minute, Token: tok, Batch: true})
			if err != nil || len(res.Items) != 3 {
				t.Fatalf("claim: %v, %d items", err, len(res.Items))
			}
			n, err := op.do(st, tok, []string{"s1", "s1"})
			if err != nil {
				t.Fatal(err)
			}
			if n != 1 {
				t.Errorf("%s of s1 named twice: %d, %v; want 1 entry", op.name, n, err)
			}
			if got, _ := rdb.HGet(ctx, k.LeaseBatch, "#"+tok).Int(); got != 2 {
				t.Errorf("the batch counts %d members after s1 left it, want 2", got)
			}
			if n, err := st.Finish(ctx, tok, []string{"s2"}, false); err != nil || n != 1 {
				t.Fatalf("finish s2: %d, %v", n, err)
			}
			if _, err := rdb.ZScore(ctx, k.Leases, tok).Result(); err != nil {
				t.Fatalf("the batch left {Q}:leases while it still holds s3 (%v): s3 can never be re-claimed", err)
			}
			// The holder dies; its lease expires (moved, not waited for).
			if err := rdb.ZAdd(ctx, k.Leases, redis.Z{Score: 1, Member: tok}).Err(); err != nil {
				t.Fatal(err)
			}
			res, err = st.Claim(ctx, queue.ClaimArgs{Limit: 10, Lease: time.Minute, Token: "other:n.1", Batch: true})
			if err != nil {
				t.Fatal(err)
			}
			if !slices.ContainsFunc(res.Items, func(l queue.Leased) bool { return l.Serial == "s3" }) || res.Reclaimed < 1 {
				t.Fatalf("re-claim after the holder died: %+v (re-claimed %d), want s3 back", res.Items, res.Reclaimed)
			}
		})
	}
}
