package queue_test

import (
	"context"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// The conversion with the real claim, finish and producers is tested in
// internal/consumer (unbatch_test.go); these tests seed the batch layout
// by hand to reach what the scripts never write.

// seedBatch writes a batch lease as the order queue's claim does: token
// scored by expiry in {Q}:leases, the member list, count and oldest
// deadline in {Q}:leasebatch, and a record per member carrying the token.
func seedBatch(t *testing.T, rdb redis.Cmdable, k queue.Keys, tok string, expiry float64, deadline int64, members ...string) {
	t.Helper()
	ctx := context.Background()
	_, err := rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		p.ZAdd(ctx, k.Leases, redis.Z{Score: expiry, Member: tok})
		p.HSet(ctx, k.LeaseBatch, tok, strings.Join(members, "\n"), "#"+tok, len(members), "<"+tok, deadline)
		for _, m := range members {
			p.HSet(ctx, k.Lease, m, fmt.Sprintf("%d|0|%s|", deadline, tok))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// Many batches, a few per call: all converted in bounded calls; a second
// run changes nothing and reports nothing.
func TestUnbatchLeasesBoundedAndIdempotent(t *testing.T) {
	rdb, k := testenv.Redis(t)
	st := queue.NewStore(rdb, k)
	ctx := context.Background()
	const deadline = int64(1_700_000_000_000)
	for i := range 7 {
		seedBatch(t, rdb, k, fmt.Sprintf("r:1.%d", i), float64(deadline+60_000+int64(i)), deadline+int64(i),
			fmt.Sprintf("b%d-a", i), fmt.Sprintf("b%d-b", i))
	}
	// One listed member left its batch (settled): its record is gone.
	rdb.HDel(ctx, k.Lease, "b3-b")
	res, err := st.UnbatchLeases(ctx, 2)
	if err != nil {
		t.Fatal(err)
	}
	if res.Batches != 7 || res.Members != 13 || res.Departed != 1 || res.Remaining != 0 || len(res.Problems) != 0 || res.Calls < 4 {
		t.Fatalf("unbatch %+v, want 7 batches, 13 members, 1 departed, in at least 4 calls of 2", res)
	}
	for i := range 7 {
		m := fmt.Sprintf("b%d-a", i)
		if s, err := rdb.ZScore(ctx, k.Inflight, m).Result(); err != nil || int64(s) != deadline+60_000+int64(i) {
			t.Errorf("%s in {Q}:inflight at %v (%v), want its batch's expiry", m, s, err)
		}
		if s, err := rdb.ZScore(ctx, k.Deadlines, m).Result(); err != nil || int64(s) != deadline+int64(i) {
			t.Errorf("%s in {Q}:deadlines at %v (%v), want its deadline", m, s, err)
		}
		if rec, _ := rdb.HGet(ctx, k.Lease, m).Result(); rec != fmt.Sprintf("%d|0|r:1.%d|", deadline+int64(i), i) {
			t.Errorf("%s: record %q, want it kept with its token", m, rec)
		}
	}
	if n, _ := rdb.Exists(ctx, k.LeaseBatch).Result(); n != 0 {
		t.Error("{Q}:leasebatch left behind")
	}
	before := dumpQueueKeys(t, rdb, k)
	again, err := st.UnbatchLeases(ctx, 2)
	if err != nil || !reflect.DeepEqual(again, queue.UnbatchResult{}) {
		t.Fatalf("second run: %+v, %v; want nothing done", again, err)
	}
	if d := queueKeyDiff(before, dumpQueueKeys(t, rdb, k)); len(d) > 0 {
		t.Errorf("second run changed the keys: %v", d)
	}
}

// Damaged batch records are reported and left exactly as they were; the
// good batches and members around them are converted; a second run
// reports the same and changes nothing.
func TestUnbatchLeasesMalformed(t *testing.T) {
	rdb, k := testenv.Redis(t)
	st := queue.NewStore(rdb, k)
	ctx := context.Background()
	const deadline = int64(1_700_000_000_000)
	seedBatch(t, rdb, k, "good:1.1", float64(deadline+1), deadline, "g-1")
	// No member list.
	seedBatch(t, rdb, k, "nolist:1.1", float64(deadline+2), deadline, "n-1")
	rdb.HDel(ctx, k.LeaseBatch, "nolist:1.1")
	// A token no record can carry.
	rdb.ZAdd(ctx, k.Leases, redis.Z{Score: float64(deadline + 3), Member: "bad|tok"})
	// An expiry that is not an integer.
	seedBatch(t, rdb, k, "frac:1.1", float64(deadline)+0.5, deadline, "f-1")
	// One member's record has no integer deadline; its neighbour is fine.
	seedBatch(t, rdb, k, "mixed:1.1", float64(deadline+4), deadline, "m-good", "m-bad")
	rdb.HSet(ctx, k.Lease, "m-bad", "soon|0|mixed:1.1|")
	// Garbage in the list: an empty line and a name with no record.
	seedBatch(t, rdb, k, "junk:1.1", float64(deadline+5), deadline, "j-1")
	rdb.HSet(ctx, k.LeaseBatch, "junk:1.1", "j-1\n\nno-such-member")

	untouched := func() map[string]any {
		out := map[string]any{}
		for _, f := range []string{"nolist:1.1", "#nolist:1.1", "frac:1.1", "#frac:1.1", "<frac:1.1"} {
			out[f] = rdb.HGet(ctx, k.LeaseBatch, f).Val()
		}
		for _, m := range []string{"n-1", "f-1", "m-bad"} {
			out[m] = rdb.HGet(ctx, k.Lease, m).Val()
		}
		return out
	}
	before := untouched()
	res, err := st.UnbatchLeases(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	if res.Batches != 2 || res.Members != 3 || res.Departed != 1 || res.Remaining != 4 {
		t.Errorf("unbatch %+v, want good and junk converted (g-1, m-good, j-1), 4 batches left", res)
	}
	want := map[string]string{ // token/serial -> words of the reason
		"nolist:1.1/":     "no member list",
		"bad|tok/":        `"|"`,
		"frac:1.1/":       "not an integer",
		"mixed:1.1/m-bad": `"soon|0|mixed:1.1|" has no integer deadline`,
	}
	if len(res.Problems) != len(want) {
		t.Errorf("problems %+v, want %d", res.Problems, len(want))
	}
	for _, p := range res.Problems {
		if w, ok := want[p.Token+"/"+p.Serial]; !ok || !strings.Contains(p.Reason, w) {
			t.Errorf("problem %+v, want one of %v", p, want)
		}
	}
	if after := untouched(); !reflect.DeepEqual(before, after) {
		t.Errorf("malformed batches changed:\nbefore %v\nafter  %v", before, after)
	}
	if l, n := rdb.HGet(ctx, k.LeaseBatch, "mixed:1.1").Val(), rdb.HGet(ctx, k.LeaseBatch, "#mixed:1.1").Val(); l != "m-bad" || n != "1" {
		t.Errorf("mixed batch lists %q, counts %q; want m-bad alone", l, n)
	}
	for _, m := range []string{"g-1", "m-good", "j-1"} {
		if _, err := rdb.ZScore(ctx, k.Inflight, m).Result(); err != nil {
			t.Errorf("%s not converted: %v", m, err)
		}
	}
	for _, m := range []string{"n-1", "f-1", "m-bad", "no-such-member", ""} {
		if _, err := rdb.ZScore(ctx, k.Inflight, m).Result(); err != redis.Nil {
			t.Errorf("%q given a per-member lease (%v)", m, err)
		}
	}
	keys := dumpQueueKeys(t, rdb, k)
	again, err := st.UnbatchLeases(ctx, 1)
	if err != nil || again.Batches != 0 || again.Members != 0 || again.Remaining != 4 || len(again.Problems) != len(want) {
		t.Errorf("second run %+v, %v; want the same problems, nothing converted", again, err)
	}
	if d := queueKeyDiff(keys, dumpQueueKeys(t, rdb, k)); len(d) > 0 {
		t.Errorf("second run changed the keys: %v", d)
	}
}
