package queue_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// The claim script's validation and queue.ValidateSerial must agree, or a
// serial the API accepts could be dead-lettered (or the reverse).
func TestLuaAndGoValidationAgree(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	cases := []string{"a", "ORD-2024-000001", strings.Repeat("é", 64), strings.Repeat("é", 65),
		"\u00a0nbsp", "tab\t", "del\x7f", "\xc0\x80", "\xed\xa0\x80", "\xf4\x90\x80\x80", "💳 pay",
		"\xe2\x82", "z\u0080", "z\u009f", "z\u00a0", "\U0010FFFF"}
	checkAgreement(t, rdb, keys, cases)
}

func FuzzLuaAndGoValidationAgree(f *testing.F) {
	for _, s := range []string{"a", "", "\x00", "é", "\xff", strings.Repeat("b", 128), "\u0085"} {
		f.Add(s)
	}
	rdb, keys := testenv.Redis(f)
	f.Fuzz(func(t *testing.T, s string) {
		checkAgreement(t, rdb, keys, []string{s})
	})
}

// checkAgreement puts members in the queue with keys k, due, claims them
// in one call and checks that the claim leased exactly those
// ValidateSerial accepts; it leaves the keys empty.
func checkAgreement(t testing.TB, rdb *redis.Client, k queue.Keys, members []string) {
	t.Helper()
	ctx := context.Background()
	st := queue.NewStore(rdb, k)
	now, err := st.Now(ctx)
	if err != nil {
		t.Fatal(err)
	}
	due := float64(queue.DeadlineMillis(now.Add(-time.Second)))
	for _, m := range members {
		if err := rdb.ZAdd(ctx, k.Queue, redis.Z{Score: due, Member: m}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	res, err := st.Claim(ctx, queue.ClaimArgs{Limit: 5000, Lease: time.Minute, Token: "agree:x.1", Batch: true})
	if err != nil {
		t.Fatal(err)
	}
	claimed := map[string]bool{}
	for _, it := range res.Items {
		claimed[it.Serial] = true
	}
	for _, m := range members {
		goOK := queue.ValidateSerial(m) == nil
		if claimed[m] != goOK {
			t.Errorf("%q: Lua claimed=%v, Go valid=%v", m, claimed[m], goOK)
		}
	}
	rdb.Del(ctx, k.Queue, k.Inflight, k.Deadlines, k.Lease, k.Leases, k.LeaseBatch, k.Dead, k.DeadInfo)
}
