package queue_test

import (
	"context"
	"fmt"
	"reflect"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Claim reads the claim's reply as Redis sends it: in RESP2 and RESP3
// alike, fresh entries, re-claimed ones and dead letters (the reply's three
// lists) read as they were written.
func TestClaimReadsTheReplyInBothProtocols(t *testing.T) {
	for _, proto := range []int{2, 3} {
		t.Run(fmt.Sprintf("RESP%d", proto), func(t *testing.T) {
			base, k := testenv.Redis(t)
			o := *base.Options()
			o.Protocol = proto
			rdb := redis.NewClient(&o)
			defer rdb.Close()
			ctx := context.Background()
			st := queue.NewStore(rdb, k)
			now, err := st.Now(ctx)
			if err != nil {
				t.Fatal(err)
			}
			due := queue.DeadlineMillis(now.Add(-time.Minute))
			rdb.ZAdd(ctx, k.Queue, redis.Z{Score: float64(due), Member: "ORD-a"}, redis.Z{Score: float64(due + 1), Member: "订单-b"},
				redis.Z{Score: float64(due + 2), Member: "bad\x01serial"})
			// A lease that expired at once: the next claim re-claims it.
			first, err := st.Claim(ctx, queue.ClaimArgs{Limit: 1, Lease: time.Millisecond, Token: "h:n.1", Batch: true})
			if err != nil {
				t.Fatal(err)
			}
			if len(first.Items) != 1 || first.Items[0] != (queue.Leased{Serial: "ORD-a", Deadline: due}) {
				t.Fatalf("first claim %+v", first)
			}
			time.Sleep(5 * time.Millisecond) // the lease's expiry is the point of this step, on Redis's clock
			res, err := st.Claim(ctx, queue.ClaimArgs{Limit: 10, Lease: time.Minute, Token: "h:n.2", Batch: true})
			if err != nil {
				t.Fatal(err)
			}
			want := []queue.Leased{{Serial: "ORD-a", Deadline: due}, {Serial: "订单-b", Deadline: due + 1}}
			if !reflect.DeepEqual(res.Items, want) || res.Reclaimed != 1 || !reflect.DeepEqual(res.Dead, map[string]int{"malformed": 1}) ||
				res.Paused || res.Now < due || res.NextQueue != -1 || res.NextExpiry <= res.Now {
				t.Fatalf("claim %+v, want items %+v, 1 re-claimed, 1 malformed", res, want)
			}
		})
	}
}
