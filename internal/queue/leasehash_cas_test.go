package queue_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// The claim turns a compact lease hash into a hash table by writing a
// field "\0" with a 1 KB value and deleting it again in the same script
// (claimScript, near its end). What it wrote around that pair must be what
// every compare-and-set after it reads: a producer that reschedules a
// leased serial — by a raw ZADD of a later deadline into the queue key, or
// through the store's producer path, which drops the lease record — takes
// it from the claim, so the claim's fence names exactly those serials, its
// finish removes exactly the others and leaves the rescheduled entries with
// their new deadlines, and a re-claim of the expired batch takes back
// exactly the members that still carry its token. No "\0" field is ever
// left for a fence, a finish, a re-claim or the gauges to read.
//
// Two shapes of the conversion: a big batch claimed into a compact hash
// that already holds another claim's records, and a re-claim of an
// expired batch of 100 (compact: 100 records) that itself takes the hash
// past 128 (it counts the records it rewrites as new).
func TestLeaseHashConversionKeepsFenceRescheduleAndFinish(t *testing.T) {
	rdb, k := testenv.Redis(t)
	ctx := context.Background()
	st := queue.NewStore(rdb, k)
	if v, err := rdb.ConfigGet(ctx, "hash-max-ziplist-*").Result(); err == nil {
		if n, _ := strconv.Atoi(v["hash-max-ziplist-entries"]); n <= 20 {
			t.Skipf("this server keeps hashes of only %d fields compact: there is no compact hash to convert", n)
		}
		if n, _ := strconv.Atoi(v["hash-max-ziplist-value"]); n >= 1024 {
			t.Skipf("this server keeps values of up to %d bytes compact: the claim cannot make its lease hash a table", n)
		}
	}
	t.Run("a big batch into a compact hash", func(t *testing.T) {
		encoding, noNul, add, claim, reschedule, fence, finish, checkQueue, expire := casFixture(t, rdb, k, st)
		a := add("A", 10)
		if n := len(claim("test:a.1", 10).Items); n != 10 {
			t.Fatalf("claim A: %d items, want 10", n)
		}
		if enc := encoding(); !compact(enc) {
			t.Fatalf("a lease hash of 10 records is a %s: the test needs a compact one to convert", enc)
		}
		b := add("B", 200)
		res := claim("test:b.1", 200)
		if got := items(res); len(got) != 200 {
			t.Fatalf("claim B: %d items, want 200", len(got))
		}
		if enc := encoding(); enc != "hashtable" {
			t.Fatalf("the claim of 200 into a compact hash of 10 left a %s, want a hashtable: the conversion did not happen", enc)
		}
		noNul("after the converting claim")

		r := reschedule(b, 0, 1, 2, 63, 64, 127, 128, 129, 198, 199)
		kept := without(b, r)
		if got := fence("test:b.1", b); !slices.Equal(got, r) {
			t.Errorf("fence of B drops %v, want exactly the rescheduled %v", got, r)
		}
		if got := fence("test:a.1", a); len(got) != 0 {
			t.Errorf("fence of A (untouched) drops %v, want none", got)
		}
		if got := fence("test:a.1", b); len(got) != len(b) {
			t.Errorf("fence of B under A's token drops %d, want all %d", len(got), len(b))
		}
		if n := finish("test:b.1", kept); n != len(kept) {
			t.Errorf("finish of the %d kept under B's token removed %d", len(kept), n)
		}
		if n := finish("test:b.1", kept); n != 0 {
			t.Errorf("finish of the kept again removed %d, want 0", n)
		}
		for _, s := range kept {
			if e, ok, err := st.Get(ctx, s); err != nil || ok {
				t.Errorf("GET %s after its finish = %+v, %v, %v; want gone", s, e, ok, err)
			}
		}
		checkQueue("after the finish")
		noNul("after the finish")
		// A's records are untouched; B's raw-ZADD members keep a stale
		// record under B's token until a claim drops it.
		if got := fence("test:a.1", a); len(got) != 0 {
			t.Errorf("after B's finish, fence of A drops %v, want none", got)
		}

		// The batch's lease expires: the re-claim takes nothing of B (its
		// kept members are finished, its rescheduled ones the producer's),
		// and drops the stale records of the raw-ZADD ones.
		expire("test:b.1")
		re := claim("test:b.2", 500)
		if len(re.Items) != 0 {
			t.Errorf("re-claim of B's expired batch took %v, want nothing", items(re))
		}
		checkQueue("after the re-claim of B")
		if err := rdb.ZScore(ctx, k.Leases, "test:b.1").Err(); err != redis.Nil {
			t.Errorf("B's batch is still in %s (%v) after a re-claim found nothing of it", k.Leases, err)
		}
		if keys := rdb.HKeys(ctx, k.Lease).Val(); fmt.Sprint(sortedCopy(keys)) != fmt.Sprint(a) {
			t.Errorf("lease hash holds %d fields %v, want A's %d records only", len(keys), keys, len(a))
		}

		// A second big batch into the hash table, rescheduled, expired and
		// re-claimed: the re-claim takes exactly the members still carrying
		// its token, at their claimed deadlines, and the old token then
		// fences and finishes nothing.
		c := add("C", 150)
		cres := claim("test:c.1", 150)
		claimed := items(cres)
		if len(claimed) != 150 {
			t.Fatalf("claim C: %d items, want 150", len(claimed))
		}
		rc := reschedule(c, 5, 6, 7, 8, 70, 149)
		expire("test:c.1")
		rec := claim("test:c.2", 500)
		keptC := without(c, rc)
		got := items(rec)
		want := map[string]int64{}
		for _, s := range keptC {
			want[s] = claimed[s]
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("re-claim of C took %d items %v, want the %d not rescheduled at their claimed deadlines", len(got), got, len(want))
		}
		if rec.Reclaimed != len(keptC) {
			t.Errorf("re-claim of C counted %d re-claimed, want %d", rec.Reclaimed, len(keptC))
		}
		noNul("after the re-claim of C")
		if got := fence("test:c.1", c); len(got) != len(c) {
			t.Errorf("fence of C under its expired token drops %d, want all %d", len(got), len(c))
		}
		if got := fence("test:c.2", c); !slices.Equal(got, rc) {
			t.Errorf("fence of C under the re-claim's token drops %v, want exactly the rescheduled %v", got, rc)
		}
		if n := finish("test:c.1", c); n != 0 {
			t.Errorf("finish under C's expired token removed %d, want 0", n)
		}
		if n := finish("test:c.2", keptC); n != len(keptC) {
			t.Errorf("finish under the re-claim's token removed %d, want %d", n, len(keptC))
		}
		checkQueue("after C's finish")
		noNul("after C's finish")
		if enc := encoding(); enc != "hashtable" {
			t.Errorf("lease hash is a %s after C, want it left a hashtable", enc)
		}
	})

	t.Run("a re-claim that converts", func(t *testing.T) {
		encoding, noNul, add, claim, reschedule, fence, finish, checkQueue, expire := casFixture(t, rdb, k, st)
		d := add("D", 100)
		claimed := items(claim("test:d.1", 100))
		if len(claimed) != 100 {
			t.Fatalf("claim D: %d items, want 100", len(claimed))
		}
		if enc := encoding(); !compact(enc) {
			t.Skipf("a lease hash of 100 records is a %s: the test needs a compact one for the re-claim to convert", enc)
		}
		rd := reschedule(d, 0, 1, 2, 50, 98, 99)
		keptD := without(d, rd)
		expire("test:d.1")
		res := claim("test:d.2", 500)
		got := items(res)
		want := map[string]int64{}
		for _, s := range keptD {
			want[s] = claimed[s]
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("re-claim of D took %d items %v, want the %d not rescheduled at their claimed deadlines", len(got), got, len(want))
		}
		if enc := encoding(); enc != "hashtable" {
			t.Fatalf("the re-claim of %d into a compact hash left a %s, want a hashtable: the conversion did not happen", len(keptD), enc)
		}
		noNul("after the converting re-claim")
		if got := fence("test:d.2", d); !slices.Equal(got, rd) {
			t.Errorf("fence of D under the re-claim's token drops %v, want exactly the rescheduled %v", got, rd)
		}
		if got := fence("test:d.1", keptD); len(got) != len(keptD) {
			t.Errorf("fence under D's expired token drops %d, want all %d", len(got), len(keptD))
		}
		if n := finish("test:d.1", d); n != 0 {
			t.Errorf("finish under D's expired token removed %d, want 0", n)
		}
		if n := finish("test:d.2", keptD); n != len(keptD) {
			t.Errorf("finish under the re-claim's token removed %d, want %d", n, len(keptD))
		}
		checkQueue("after D's finish")
		noNul("after D's finish")
		if n := rdb.HLen(ctx, k.Lease).Val(); n != 0 {
			t.Errorf("lease hash holds %d fields after every member settled or moved, want 0: %v", n, rdb.HKeys(ctx, k.Lease).Val())
		}
	})
}

func without(ss, drop []string) []string {
	return slices.DeleteFunc(slices.Clone(ss), func(s string) bool { return slices.Contains(drop, s) })
}

func sortedCopy(ss []string) []string { return slices.Sorted(slices.Values(ss)) }

// casFixture builds the helpers of TestLeaseHashConversionKeepsFenceRescheduleAndFinish
// for one subtest (t), on a queue emptied first.
func casFixture(t *testing.T, rdb *redis.Client, k queue.Keys, st *queue.Store) (
	encoding func() string,
	noNul func(when string),
	add func(prefix string, n int) []string,
	claim func(tok string, limit int) queue.ClaimResult,
	reschedule func(ss []string, idx ...int) []string,
	fence func(tok string, ss []string) []string,
	finish func(tok string, ss []string) int,
	checkQueue func(when string),
	expire func(tok string),
) {
	ctx := context.Background()
	testenv.DeleteQueue(rdb, k)
	encoding = func() string {
		t.Helper()
		enc, err := rdb.ObjectEncoding(ctx, k.Lease).Result()
		if err != nil {
			t.Fatal(err)
		}
		return enc
	}
	noNul = func(when string) {
		t.Helper()
		if ok, err := rdb.HExists(ctx, k.Lease, "\x00").Result(); err != nil || ok {
			t.Fatalf("%s: the lease hash holds the claim's \"\\0\" field (%v)", when, err)
		}
	}
	add = func(prefix string, n int) []string {
		t.Helper()
		base := dueAt(t, st, 0)
		ss := make([]string, n)
		zs := make([]redis.Z, n)
		for i := range zs {
			ss[i] = fmt.Sprintf("%s-%04d", prefix, i)
			zs[i] = redis.Z{Score: base + float64(i), Member: ss[i]}
		}
		if err := rdb.ZAdd(ctx, k.Queue, zs...).Err(); err != nil {
			t.Fatal(err)
		}
		return ss
	}
	claim = func(tok string, limit int) queue.ClaimResult {
		t.Helper()
		res, err := st.Claim(ctx, queue.ClaimArgs{Limit: limit, Lease: time.Minute, Token: tok, Batch: true})
		if err != nil {
			t.Fatalf("claim %s: %v", tok, err)
		}
		return res
	}
	later, err := st.Now(ctx)
	if err != nil {
		t.Fatal(err)
	}
	laterMs := queue.DeadlineMillis(later.Add(time.Hour))
	// moved holds the new deadline of every serial a producer rescheduled.
	moved := map[string]int64{}
	// reschedule moves the leased serials at idx of ss later: every third
	// by a raw ZADD, the others through the producer path (reschedule and
	// later modes, which drop the lease record). It returns them.
	reschedule = func(ss []string, idx ...int) []string {
		t.Helper()
		var out []string
		var items []queue.EnqueueItem
		for n, i := range idx {
			s := ss[i]
			d := laterMs + int64(len(moved))
			moved[s] = d
			out = append(out, s)
			if n%3 == 0 {
				if err := rdb.ZAdd(ctx, k.Queue, redis.Z{Score: float64(d), Member: s}).Err(); err != nil {
					t.Fatal(err)
				}
				continue
			}
			items = append(items, queue.EnqueueItem{Serial: s, Deadline: d})
		}
		half := len(items) / 2
		for _, part := range []struct {
			mode  string
			items []queue.EnqueueItem
		}{{queue.ModeReschedule, items[:half]}, {queue.ModeLater, items[half:]}} {
			res, err := st.Enqueue(ctx, part.mode, part.items)
			if err != nil {
				t.Fatal(err)
			}
			for i, r := range res {
				if r.Result != queue.ResultMoved || r.Deadline != part.items[i].Deadline {
					t.Fatalf("%s %s: %+v, want moved to %d", part.mode, part.items[i].Serial, r, part.items[i].Deadline)
				}
			}
		}
		return slices.Sorted(slices.Values(out))
	}
	fence = func(tok string, ss []string) []string {
		t.Helper()
		got, err := st.Fence(ctx, tok, 0, ss)
		if err != nil {
			t.Fatal(err)
		}
		slices.Sort(got)
		return got
	}
	finish = func(tok string, ss []string) int {
		t.Helper()
		n, err := st.Finish(ctx, tok, ss, false)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	// checkQueue holds the queue key to exactly the rescheduled entries,
	// at their new deadlines, and GET to the same.
	checkQueue = func(when string) {
		t.Helper()
		zs, err := rdb.ZRangeWithScores(ctx, k.Queue, 0, -1).Result()
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]int64{}
		for _, z := range zs {
			got[z.Member.(string)] = int64(z.Score)
		}
		if fmt.Sprint(got) != fmt.Sprint(moved) {
			t.Errorf("%s: queue key holds %v, want exactly the rescheduled entries at their new deadlines %v", when, got, moved)
		}
		for s, d := range moved {
			e, ok, err := st.Get(ctx, s)
			if err != nil || !ok || e.State != queue.StateQueued || e.Deadline.UnixMilli() != d {
				t.Errorf("%s: GET %s = %+v, %v, %v; want queued at %d", when, s, e, ok, err, d)
			}
		}
	}
	expire = func(tok string) {
		t.Helper()
		if n, err := rdb.ZAddXX(ctx, k.Leases, redis.Z{Score: 1, Member: tok}).Result(); err != nil || n != 0 {
			t.Fatalf("expire batch %s: %d, %v", tok, n, err)
		}
		if s, err := rdb.ZScore(ctx, k.Leases, tok).Result(); err != nil || s != 1 {
			t.Fatalf("batch %s is not held (%v, %v)", tok, s, err)
		}
	}

	return
}

func compact(enc string) bool { return enc == "listpack" || enc == "ziplist" }

// items are a claim's leased serials and their deadlines.
func items(res queue.ClaimResult) map[string]int64 {
	out := map[string]int64{}
	for _, it := range res.Items {
		out[it.Serial] = it.Deadline
	}
	return out
}
