package queue_test

import (
	"context"
	"fmt"
	"reflect"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// The claim's common case — due entries with no lease record, all of
// printable ASCII — takes shortcuts (claimScript, step 2). These tests hold
// each shortcut to what the full path does.

// dueAt is a deadline a minute before Redis's clock, plus i ms.
func dueAt(t *testing.T, st *queue.Store, i int) float64 {
	t.Helper()
	now, err := st.Now(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return float64(queue.DeadlineMillis(now.Add(-time.Minute)) + int64(i))
}

// A lease hash holding a single record, of a serial that is due in the
// queue key again (a producer's raw ZADD during a batch lease of one):
// the claim among hundreds of fresh entries must still take it over, so
// the first claim's fence drops it and its finish leaves it alone.
func TestClaimTakesOverTheOnlyLeasedSerialAmongManyFresh(t *testing.T) {
	rdb, k := testenv.Redis(t)
	ctx := context.Background()
	st := queue.NewStore(rdb, k)
	base := dueAt(t, st, 0)
	held := "ORD-held"
	if err := rdb.ZAdd(ctx, k.Queue, redis.Z{Score: base, Member: held}).Err(); err != nil {
		t.Fatal(err)
	}
	a, err := st.Claim(ctx, queue.ClaimArgs{Limit: 1, Lease: time.Minute, Token: "test:a.1", Batch: true})
	if err != nil || len(a.Items) != 1 || a.Items[0].Serial != held {
		t.Fatalf("first claim: %+v, %v", a, err)
	}
	if n := rdb.HLen(ctx, k.Lease).Val(); n != 1 {
		t.Fatalf("lease hash holds %d records, want 1", n)
	}
	// The producer writes the held serial again, due, among 499 fresh ones.
	zs := []redis.Z{{Score: base + 250, Member: held}}
	for i := range 499 {
		zs = append(zs, redis.Z{Score: base + float64(i), Member: fmt.Sprintf("ORD-%04d", i)})
	}
	if err := rdb.ZAdd(ctx, k.Queue, zs...).Err(); err != nil {
		t.Fatal(err)
	}
	b, err := st.Claim(ctx, queue.ClaimArgs{Limit: 500, Lease: time.Minute, Token: "test:b.1", Batch: true})
	if err != nil || len(b.Items) != 500 {
		t.Fatalf("second claim: %d items, %v", len(b.Items), err)
	}
	recs, ok, err := st.LeaseRecords(ctx, []string{held})
	if err != nil || !ok[0] || recs[0].Token != "test:b.1" || recs[0].Deadline != int64(base+250) {
		t.Fatalf("record of %s after the takeover: %+v (found %v, %v), want token test:b.1, deadline %d", held, recs, ok, err, int64(base+250))
	}
	drop, err := st.Fence(ctx, "test:a.1", 0, []string{held})
	if err != nil || !reflect.DeepEqual(drop, []string{held}) {
		t.Fatalf("first claim's fence dropped %v (%v), want [%s]", drop, err, held)
	}
	if n, err := st.Finish(ctx, "test:a.1", []string{held}, false); err != nil || n != 0 {
		t.Fatalf("first claim's finish removed %d (%v), want 0", n, err)
	}
	if err := rdb.ZScore(ctx, k.Leases, "test:a.1").Err(); err != redis.Nil {
		t.Fatalf("the first claim's batch is still in %s (%v): the takeover did not release it", k.Leases, err)
	}
	drop, err = st.Fence(ctx, "test:b.1", 0, []string{held})
	if err != nil || len(drop) != 0 {
		t.Fatalf("second claim's fence dropped %v (%v), want none", drop, err)
	}
}

// When every due serial is printable ASCII, one match over all of them
// stands in for the per-serial check: length must still be checked per
// serial, and a score that is not an integer still dead-letters.
func TestClaimOfPrintableSerialsStillChecksEachLength(t *testing.T) {
	rdb, k := testenv.Redis(t)
	ctx := context.Background()
	st := queue.NewStore(rdb, k)
	base := dueAt(t, st, 0)
	members := map[string]float64{
		"":                       base,
		strings.Repeat("a", 128): base + 1,
		strings.Repeat("b", 129): base + 2,
		"ORD-1":                  base + 3,
		"ORD-frac":               base + 4.5,
		"~ !":                    base + 5,
	}
	for m, sc := range members {
		if err := rdb.ZAdd(ctx, k.Queue, redis.Z{Score: sc, Member: m}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	res, err := st.Claim(ctx, queue.ClaimArgs{Limit: 100, Lease: time.Minute, Token: "test:c.1", Batch: true})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, it := range res.Items {
		got = append(got, it.Serial)
	}
	sort.Strings(got)
	want := []string{"ORD-1", strings.Repeat("a", 128), "~ !"}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("leased %q, want %q", got, want)
	}
	dead, err := rdb.ZRange(ctx, k.Dead, 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(dead)
	wantDead := []string{"", "ORD-frac", strings.Repeat("b", 129)}
	if !reflect.DeepEqual(dead, wantDead) {
		t.Errorf("dead-lettered %q, want %q", dead, wantDead)
	}
	if res.Dead["malformed"] != 3 {
		t.Errorf("dead by reason %v, want 3 malformed", res.Dead)
	}
}

// The claim removes the entries it handled (leased or dead-lettered) by
// rank: exactly the first ones, whatever the ties, and nothing after a
// byte budget stops it.
func TestClaimRemovesExactlyTheEntriesItHandled(t *testing.T) {
	rdb, k := testenv.Redis(t)
	ctx := context.Background()
	st := queue.NewStore(rdb, k)
	base := dueAt(t, st, 0)
	var zs []redis.Z
	for i := range 20 {
		m := fmt.Sprintf("ORD-%02d", i)
		sc := base + float64(i/3) // ties: three to a score, ordered by member
		switch i {
		case 0:
			m = "bad\x01serial"
		case 5:
			sc = 946684799999 // before 2000-01-01
		}
		zs = append(zs, redis.Z{Score: sc, Member: m})
	}
	for i := range 5 {
		zs = append(zs, redis.Z{Score: base + float64(time.Hour.Milliseconds()+int64(i)), Member: fmt.Sprintf("ORD-later-%d", i)})
	}
	if err := rdb.ZAdd(ctx, k.Queue, zs...).Err(); err != nil {
		t.Fatal(err)
	}
	before, err := rdb.ZRangeWithScores(ctx, k.Queue, 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	res, err := st.Claim(ctx, queue.ClaimArgs{Limit: 8, Lease: time.Minute, Token: "test:r.1", Batch: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Items) != 6 || res.Dead["malformed"] != 1 || res.Dead["score_out_of_range"] != 1 {
		t.Fatalf("claimed %d, dead %v; want 6 and one of each reason", len(res.Items), res.Dead)
	}
	after, err := rdb.ZRangeWithScores(ctx, k.Queue, 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(after, before[8:]) {
		t.Fatalf("queue after the claim:\n%v\nwant all but the first 8 by rank:\n%v", after, before[8:])
	}
	var leased []redis.Z
	for _, z := range before[:8] {
		if z.Member != "bad\x01serial" && z.Score != 946684799999 {
			leased = append(leased, z)
		}
	}
	for i, it := range res.Items {
		if it.Serial != leased[i].Member || float64(it.Deadline) != leased[i].Score {
			t.Errorf("item %d = %+v, want %v", i, it, leased[i])
		}
	}

	// A byte budget that admits one task stops the claim after it: the
	// entries behind it stay, scores unchanged.
	poll, err := st.Claim(ctx, queue.ClaimArgs{Limit: 8, Lease: time.Minute, Token: "test:r.2", MaxBytes: 1, Overhead: 1})
	if err != nil || len(poll.Items) != 1 || poll.Items[0].Serial != before[8].Member {
		t.Fatalf("budgeted claim: %+v, %v; want only %v", poll.Items, err, before[8].Member)
	}
	after, err = rdb.ZRangeWithScores(ctx, k.Queue, 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(after, before[9:]) {
		t.Fatalf("queue after the budgeted claim:\n%v\nwant:\n%v", after, before[9:])
	}
}
