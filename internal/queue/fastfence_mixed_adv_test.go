package queue_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// The fence's and finish's trust in a batch no script has changed
// (FenceBatch, FinishBatch) beside the scripts of an older release: during
// a rolling upgrade an older daemon's scripts (its claims, its HTTP API's
// enqueue and cancel) and an older Go client's run beside a newer
// daemon's batches and change their members' records without marking the
// batch. Since batch leases every one of them takes the member off the
// batch's count, which the holder compares with the entries its claim
// leased: the batch is not trusted, and the records are read. (A client
// from before batch leases does not: see docs/reliability.md, "A batch
// trusted while no script changed it".) The older scripts are in
// testdata/scripts_main_45d123a, verbatim. Written first by the
// adversary of the fast path, which these broke while it trusted a
// batch's count of at least the serials named.

func oldScript(t *testing.T, name string) *redis.Script {
	t.Helper()
	b, err := os.ReadFile("testdata/scripts_main_45d123a/" + name)
	if err != nil {
		t.Fatal(err)
	}
	return redis.NewScript(string(b))
}

// mixedSetup enqueues serials due 10 s ago and claims them as one batch
// under token tok (this release's claim), all of them.
func mixedSetup(t *testing.T, rdb *redis.Client, k queue.Keys, tok string, lease time.Duration, serials ...string) (*queue.Store, int64) {
	t.Helper()
	ctx := context.Background()
	st := queue.NewStore(rdb, k)
	now0, err := st.Now(ctx)
	if err != nil {
		t.Fatal(err)
	}
	now := queue.DeadlineMillis(now0)
	var items []queue.EnqueueItem
	for _, s := range serials {
		items = append(items, queue.EnqueueItem{Serial: s, Deadline: now - 10_000})
	}
	if _, err := queue.Enqueue(ctx, rdb, queue.ModeCreate, []queue.EnqueueBatch{{Keys: k, Items: items}}); err != nil {
		t.Fatal(err)
	}
	res := claimAll(t, st, queue.ClaimArgs{Limit: max(100, len(serials)), Lease: lease, Token: tok, Batch: true})
	if len(res.Items) != len(serials) {
		t.Fatalf("claimed %d, want %d", len(res.Items), len(serials))
	}
	return st, now
}

// oldClaim runs the claim script of 45d123a (an older daemon of a rolling
// upgrade) in batch mode.
func oldClaim(t *testing.T, rdb *redis.Client, k queue.Keys, tok string, limit int, lease time.Duration) {
	t.Helper()
	keys := []string{k.Queue, k.Inflight, k.Deadlines, k.Lease, k.Dead, k.DeadInfo, k.Paused, k.Payload, k.Leases, k.LeaseBatch}
	err := oldScript(t, "claimScript.lua").Run(context.Background(), rdb, keys,
		limit, lease.Milliseconds(), tok, queue.MaxAhead.Milliseconds(), 0, "0", 0, 0, "1").Err()
	if err != nil {
		t.Fatal(err)
	}
}

// fenceOf fences serials as the order handler does, for a claim of
// claimed entries under tok.
func fenceOf(t *testing.T, st *queue.Store, tok string, claimed int, serials ...string) []string {
	t.Helper()
	got, err := st.FenceBatch(context.Background(), tok, claimed, 0, serials)
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(got)
	return got
}

// A cancel by an older release's script (an older daemon's HTTP API during
// a rolling upgrade, an older Go client) drops the member's record without
// marking the batch. The holder's fence must still drop the cancelled
// serial, whether it names the whole batch or only the rows its statement
// closed (a paid one is not named).
func TestAdvFastFenceAcceptsAnOrderAnOlderCancelRemoved(t *testing.T) {
	t.Parallel()
	keys := func(k queue.Keys) []string {
		return []string{k.Queue, k.Lease, k.Inflight, k.Deadlines, k.Leases, k.LeaseBatch}
	}
	for _, tc := range []struct {
		name, script string
		keys         func(k queue.Keys) []string
		fence        []string
	}{
		{"45d123a cancel, fence of the rows closed", "cancelScript.lua", keys, []string{"S1", "S3"}},
		{"45d123a cancel, fence of the whole batch", "cancelScript.lua", keys, []string{"S1", "S2", "S3"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rdb, k := testenv.Redis(t)
			ctx := context.Background()
			st, _ := mixedSetup(t, rdb, k, "new:A.1", time.Minute, "S1", "S2", "S3")
			if err := oldScript(t, tc.script).Run(ctx, rdb, tc.keys(k), "S3").Err(); err != nil {
				t.Fatal(err)
			}
			if got := fenceOf(t, st, "new:A.1", 3, tc.fence...); !slices.Equal(got, []string{"S3"}) {
				t.Errorf("fence of %v after S3 was cancelled dropped %v, want [S3]: the close commits a cancelled order", tc.fence, got)
			}
		})
	}
}

// An older daemon's claim takes over a member a producer re-added with a
// due score (a raw ZADD), or re-claims an expired batch in part (its limit
// left room for some members only), rewriting the records with its own
// token and taking them off the batch's count, with no mark. The newer
// holder's fence must drop them (their records carry another token) and
// its finish must leave the other claim's records alone; and a cancel of
// the taken-over member by this release (which marks the other claim's
// batch, not the holder's) must not let the holder close it.
func TestAdvFastFenceAcceptsMembersAnOlderDaemonTookOver(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	t.Run("take-over of a raw re-add", func(t *testing.T) {
		rdb, k := testenv.Redis(t)
		st, now := mixedSetup(t, rdb, k, "new:A.1", time.Minute, "S1", "S2", "S3")
		rdb.ZAdd(ctx, k.Queue, redis.Z{Score: float64(now - 5_000), Member: "S3"})
		oldClaim(t, rdb, k, "old:B.1", 100, time.Minute)
		if rec := rdb.HGet(ctx, k.Lease, "S3").Val(); !strings.Contains(rec, "|old:B.1|") {
			t.Fatalf("S3's record %q: the older claim did not take it over", rec)
		}
		if got := fenceOf(t, st, "new:A.1", 3, "S1", "S3"); !slices.Equal(got, []string{"S3"}) {
			t.Errorf("fence dropped %v, want [S3]: S3 is the older daemon's claim's now, both close it", got)
		}
		if _, err := st.FinishBatch(ctx, "new:A.1", 3, []string{"S1", "S3"}); err != nil {
			t.Fatal(err)
		}
		if rec, err := rdb.HGet(ctx, k.Lease, "S3").Result(); err != nil || !strings.Contains(rec, "|old:B.1|") {
			t.Errorf("after the holder's finish S3's record is %q (%v): the finish removed another claim's lease record", rec, err)
		}
		// S2 is still the holder's (its record carries the token): if the
		// holder dies now, its batch's expiry is the only way back.
		if rdb.ZScore(ctx, k.Leases, "new:A.1").Err() != nil || rdb.HGet(ctx, k.LeaseBatch, "#new:A.1").Val() != "1" {
			t.Errorf("after the finish of S1 and S3 the batch is gone (count %q) while S2 still carries its token (%q): no claim finds S2 again, lost",
				rdb.HGet(ctx, k.LeaseBatch, "#new:A.1").Val(), rdb.HGet(ctx, k.Lease, "S2").Val())
		}
	})
	t.Run("take-over, then a cancel", func(t *testing.T) {
		rdb, k := testenv.Redis(t)
		st, now := mixedSetup(t, rdb, k, "new:A.1", time.Minute, "S1", "S2", "S3")
		rdb.ZAdd(ctx, k.Queue, redis.Z{Score: float64(now - 5_000), Member: "S3"})
		oldClaim(t, rdb, k, "old:B.1", 100, time.Minute)
		if _, err := st.Cancel(ctx, "S3"); err != nil {
			t.Fatal(err)
		}
		if got := fenceOf(t, st, "new:A.1", 3, "S1", "S3"); !slices.Equal(got, []string{"S3"}) {
			t.Errorf("fence dropped %v, want [S3]: the close commits a cancelled order", got)
		}
	})
	t.Run("partial re-claim of an expired batch", func(t *testing.T) {
		rdb, k := testenv.Redis(t)
		st, _ := mixedSetup(t, rdb, k, "new:A.1", time.Minute, "S1", "S2", "S3", "S4")
		// The holder is slow (a long close): its lease runs out.
		if err := rdb.ZAdd(ctx, k.Leases, redis.Z{Score: 1, Member: "new:A.1"}).Err(); err != nil {
			t.Fatal(err)
		}
		oldClaim(t, rdb, k, "old:C.1", 2, time.Minute)
		var taken []string
		for _, s := range []string{"S1", "S2", "S3", "S4"} {
			if strings.Contains(rdb.HGet(ctx, k.Lease, s).Val(), "|old:C.1|") {
				taken = append(taken, s)
			}
		}
		if len(taken) != 2 {
			t.Fatalf("the older claim re-took %v, want two members", taken)
		}
		if got := fenceOf(t, st, "new:A.1", 4, taken...); !slices.Equal(got, taken) {
			t.Errorf("fence of %v (re-claimed by another replica) dropped %v: both replicas close them", taken, got)
		}
	})
}

// A batch marked as changed keeps its oldest deadline for the gauges: the
// mark negates the field the overdue gauge reads once the batches hold
// more than 2,000 members (below, it reads their records).
func TestStatsReadTheOldestDeadlineOfAMarkedBatch(t *testing.T) {
	t.Parallel()
	rdb, k := testenv.Redis(t)
	ctx := context.Background()
	serials := make([]string, 2100)
	for i := range serials {
		serials[i] = fmt.Sprintf("S%04d", i)
	}
	st, _ := mixedSetup(t, rdb, k, "new:A.1", time.Minute, serials...)
	if n, err := st.FinishBatch(ctx, "new:A.1", len(serials), serials[:1]); err != nil || n != 1 {
		t.Fatalf("finish of %s: %d, %v", serials[0], n, err)
	}
	if o := rdb.HGet(ctx, k.LeaseBatch, "<new:A.1").Val(); !strings.HasPrefix(o, "-") {
		t.Fatalf("after a partial finish the batch's oldest deadline is %q: not marked", o)
	}
	s, err := st.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if want := int64(len(serials) - 1); s.Held != want || s.Overdue != want || s.OldestDue < 10*time.Second {
		t.Errorf("stats %+v: want %d held and overdue, the oldest 10 s or more overdue", s, want)
	}
}
