package queue_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Adversary tests of step 1b's check for a member of an expired batch
// whose lease record does not carry the batch's token (f5f4bcd): every
// state a shipped script leaves such a member in must be kept for the
// place that holds it (a backoff, a producer's entry, another claim's
// batch), and a record no place reads must not be left behind.

// noHolderBatch leases S0..S3 (deadlines base+i) to batch "b:a" with a
// real claim and returns base.
func noHolderBatch(t *testing.T, rdb *redis.Client, k queue.Keys, st *queue.Store) float64 {
	t.Helper()
	ctx := context.Background()
	base := dueAt(t, st, 0)
	for i := range 4 {
		if err := rdb.ZAdd(ctx, k.Queue, redis.Z{Score: base + float64(i), Member: fmt.Sprintf("S%d", i)}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	if a := claimAll(t, st, queue.ClaimArgs{Limit: 10, Lease: time.Minute, Token: "b:a", Batch: true}); len(a.Items) != 4 {
		t.Fatalf("first claim %+v, want the 4 serials", a.Items)
	}
	return base
}

// expireBatch moves batch tok's expiry into the past (data, not clocks),
// if the batch is still leased.
func expireBatch(t *testing.T, rdb *redis.Client, k queue.Keys, tok string, at float64) {
	t.Helper()
	if err := rdb.ZAddXX(context.Background(), k.Leases, redis.Z{Score: at, Member: tok}).Err(); err != nil {
		t.Fatal(err)
	}
}

// othersLeasedOnce checks that S0, S1 and S3 (noHolderBatch's) were each
// leased once, at their deadlines.
func othersLeasedOnce(t *testing.T, leased map[string][]int64, base float64) {
	t.Helper()
	for i, s := range []string{"S0", "S1", "S3"} {
		want := int64(base) + int64([]int{0, 1, 3}[i])
		if fmt.Sprint(leased[s]) != fmt.Sprint([]int64{want}) {
			t.Errorf("%s leased at %v, want once at %d", s, leased[s], want)
		}
	}
}

// noOrphansConsistentCounts checks that no lease record is left where no
// claim finds it and that every batch is counted as the scripts keep it.
func noOrphansConsistentCounts(t *testing.T, rdb *redis.Client, k queue.Keys) {
	t.Helper()
	for _, o := range orphanRecords(t, rdb, k) {
		t.Error(o)
	}
	if state := leaseKeysState(t, rdb, k); !countsConsistent(state) {
		t.Errorf("batch counts inconsistent:\n  leases %v\n  lists %v\n  records %v", state.leases, state.leasebatch, state.lease)
	}
}

// claimUntilQuiet claims with limit until a claim leases and buries
// nothing, and returns every deadline each serial was leased at.
func claimUntilQuiet(t *testing.T, st *queue.Store, limit int) map[string][]int64 {
	t.Helper()
	leased := map[string][]int64{}
	for i := range 20 {
		res, err := st.Claim(context.Background(), queue.ClaimArgs{Limit: limit, Lease: time.Minute, Token: fmt.Sprintf("b:n%d", i), Batch: true})
		if err != nil {
			t.Fatalf("claim %d: %v", i+1, err)
		}
		if len(res.Items) == 0 && len(res.Dead) == 0 {
			return leased
		}
		for _, it := range res.Items {
			leased[it.Serial] = append(leased[it.Serial], it.Deadline)
		}
	}
	t.Fatal("claims never went quiet")
	return nil
}

// A member's record that a foreign write left naming no holder a claim
// reads: the batch's own token without the closing '|' (parse, owned,
// unbatch and the Go reader take it for the batch's; carries, and so
// step 1b, the fence and finish, do not), a batch that does not exist,
// a per-member lease or a backoff with no {Q}:inflight entry. Once the
// expired batch goes, no claim reads the record and the reconciler skips
// the serial: it must be dead-lettered (or leased at its deadline), not
// left.
func TestAdvClaimExpiredBatchMemberWhoseRecordNamesNoLiveHolder(t *testing.T) {
	for _, tc := range []struct{ name, rec string }{
		{"batch token without the closing bar", "%d|0|b:a"},
		{"a batch that does not exist", "%d|0|b:gone|"},
		{"a per-member lease with no inflight entry", "%d|0|p:dead|"},
		{"a backoff with no inflight entry", "%d|1|-|boom"},
	} {
		for _, limit := range []int{10, 1} {
			t.Run(fmt.Sprintf("%s, limit %d", tc.name, limit), func(t *testing.T) {
				rdb, k := testenv.Redis(t)
				ctx := context.Background()
				st := queue.NewStore(rdb, k)
				base := noHolderBatch(t, rdb, k, st)
				rec := fmt.Sprintf(tc.rec, int64(base)+2)
				if err := rdb.HSet(ctx, k.Lease, "S2", rec).Err(); err != nil {
					t.Fatal(err)
				}
				expireBatch(t, rdb, k, "b:a", base)
				leased := claimUntilQuiet(t, st, limit)
				othersLeasedOnce(t, leased, base)
				dead := deadReasons(t, rdb, k)
				switch {
				case len(leased["S2"]) == 0 && dead["S2"] == queue.ReasonMalformed:
				case fmt.Sprint(leased["S2"]) == fmt.Sprint([]int64{int64(base) + 2}) && dead["S2"] == "":
				default:
					t.Errorf("S2 (record %q) leased at %v, dead-lettered as %q: want dead-lettered as malformed, or leased once at %d",
						rec, leased["S2"], dead["S2"], int64(base)+2)
				}
				// The old holder, late, owns none of them any more (owned()
				// reads the record without the closing bar as its own).
				all := []string{"S0", "S1", "S2", "S3"}
				before := dumpQueueKeys(t, rdb, k)
				if n, err := st.HandBack(ctx, "b:a", all); err != nil || n != 0 {
					t.Errorf("the old holder's hand-back moved %d (%v)", n, err)
				}
				if r, err := st.Retry(ctx, queue.RetryArgs{Token: "b:a", Serials: all}); err != nil || r.Moved != 0 {
					t.Errorf("the old holder's retry moved %d (%v)", r.Moved, err)
				}
				if n, err := st.Bury(ctx, queue.BuryArgs{Token: "b:a", Serials: all, Reason: queue.ReasonNotFound}); err != nil || n != 0 {
					t.Errorf("the old holder's bury moved %d (%v)", n, err)
				}
				if n, err := st.Finish(ctx, "b:a", all, false); err != nil || n != 0 {
					t.Errorf("the old holder's finish removed %d (%v)", n, err)
				}
				if d := queueKeyDiff(before, dumpQueueKeys(t, rdb, k)); len(d) > 0 {
					t.Errorf("the old holder's late calls changed the keys: %v", d)
				}
				noOrphansConsistentCounts(t, rdb, k)
			})
		}
	}
}

// Every way a shipped script or a producer moves a member out of its batch
// while the batch lease runs, then the batch expires and claims (limit 10,
// or 1 so step 1 does not reach a backoff before step 1b reads the batch)
// re-take it: the member that moved is never dead-lettered, never leased
// at a deadline not its latest, never twice, and ends where its mover put
// it.
func TestAdvClaimExpiredBatchKeepsEveryMemberThatMovedLegitimately(t *testing.T) {
	type result struct {
		leasedAt []int64 // what the claims after the expiry lease S2 at
		where    string  // findable(S2) afterwards
	}
	later := func(base float64) float64 { return base + float64(2*time.Hour.Milliseconds()) }
	for _, tc := range []struct {
		name string
		move func(t *testing.T, rdb *redis.Client, k queue.Keys, st *queue.Store, base float64)
		want func(base float64) result
	}{
		{"finished", func(t *testing.T, rdb *redis.Client, k queue.Keys, st *queue.Store, base float64) {
			if n, err := st.Finish(context.Background(), "b:a", []string{"S2"}, false); err != nil || n != 1 {
				t.Fatalf("finish %d, %v", n, err)
			}
		}, func(float64) result { return result{} }},
		{"retried, due now", func(t *testing.T, rdb *redis.Client, k queue.Keys, st *queue.Store, base float64) {
			if r, err := st.Retry(context.Background(), queue.RetryArgs{Token: "b:a", Serials: []string{"S2"}, Spend: true, LastError: "db|down"}); err != nil || r.Moved != 1 {
				t.Fatalf("retry %+v, %v", r, err)
			}
		}, func(base float64) result { return result{[]int64{int64(base) + 2}, "batch"} }},
		{"retried, due in an hour", func(t *testing.T, rdb *redis.Client, k queue.Keys, st *queue.Store, base float64) {
			if r, err := st.Retry(context.Background(), queue.RetryArgs{Token: "b:a", Serials: []string{"S2"}, Delay: time.Hour}); err != nil || r.Moved != 1 {
				t.Fatalf("retry %+v, %v", r, err)
			}
		}, func(float64) result { return result{nil, "inflight"} }},
		{"handed back", func(t *testing.T, rdb *redis.Client, k queue.Keys, st *queue.Store, base float64) {
			if n, err := st.HandBack(context.Background(), "b:a", []string{"S2"}); err != nil || n != 1 {
				t.Fatalf("hand back %d, %v", n, err)
			}
		}, func(base float64) result { return result{[]int64{int64(base) + 2}, "batch"} }},
		{"rescheduled through the API, due", func(t *testing.T, rdb *redis.Client, k queue.Keys, st *queue.Store, base float64) {
			if _, err := st.Enqueue(context.Background(), queue.ModeReschedule, []queue.EnqueueItem{{Serial: "S2", Deadline: int64(base) + 7}}); err != nil {
				t.Fatal(err)
			}
		}, func(base float64) result { return result{[]int64{int64(base) + 7}, "batch"} }},
		{"rescheduled through the API, later", func(t *testing.T, rdb *redis.Client, k queue.Keys, st *queue.Store, base float64) {
			if _, err := st.Enqueue(context.Background(), queue.ModeLater, []queue.EnqueueItem{{Serial: "S2", Deadline: int64(later(base))}}); err != nil {
				t.Fatal(err)
			}
		}, func(float64) result { return result{nil, "queue"} }},
		{"raw ZADD, due", func(t *testing.T, rdb *redis.Client, k queue.Keys, st *queue.Store, base float64) {
			rdb.ZAdd(context.Background(), k.Queue, redis.Z{Score: base + 9, Member: "S2"})
		}, func(base float64) result { return result{[]int64{int64(base) + 9}, "batch"} }},
		{"raw ZADD, later", func(t *testing.T, rdb *redis.Client, k queue.Keys, st *queue.Store, base float64) {
			rdb.ZAdd(context.Background(), k.Queue, redis.Z{Score: later(base), Member: "S2"})
		}, func(float64) result { return result{nil, "queue"} }},
		{"cancelled", func(t *testing.T, rdb *redis.Client, k queue.Keys, st *queue.Store, base float64) {
			if ok, err := st.Cancel(context.Background(), "S2"); err != nil || !ok {
				t.Fatalf("cancel %v, %v", ok, err)
			}
		}, func(float64) result { return result{} }},
		{"taken over by another replica's claim", func(t *testing.T, rdb *redis.Client, k queue.Keys, st *queue.Store, base float64) {
			rdb.ZAdd(context.Background(), k.Queue, redis.Z{Score: base + 11, Member: "S2"})
			res := claimAll(t, st, queue.ClaimArgs{Limit: 10, Lease: time.Hour, Token: "b:other", Batch: true})
			if len(res.Items) != 1 || res.Items[0].Serial != "S2" {
				t.Fatalf("take-over claimed %+v, want S2", res.Items)
			}
		}, func(float64) result { return result{nil, "batch b:other"} }},
		{"taken over, then retried by the other replica", func(t *testing.T, rdb *redis.Client, k queue.Keys, st *queue.Store, base float64) {
			rdb.ZAdd(context.Background(), k.Queue, redis.Z{Score: base + 11, Member: "S2"})
			claimAll(t, st, queue.ClaimArgs{Limit: 10, Lease: time.Hour, Token: "b:other", Batch: true})
			if r, err := st.Retry(context.Background(), queue.RetryArgs{Token: "b:other", Serials: []string{"S2"}, Delay: time.Hour}); err != nil || r.Moved != 1 {
				t.Fatalf("retry %+v, %v", r, err)
			}
		}, func(float64) result { return result{nil, "inflight"} }},
		{"unbatched while its lease runs, then retried", func(t *testing.T, rdb *redis.Client, k queue.Keys, st *queue.Store, base float64) {
			if r, err := st.Retry(context.Background(), queue.RetryArgs{Token: "b:a", Serials: []string{"S2"}, Delay: time.Hour}); err != nil || r.Moved != 1 {
				t.Fatalf("retry %+v, %v", r, err)
			}
			if _, err := st.UnbatchLeases(context.Background(), 0); err != nil {
				t.Fatal(err)
			}
		}, func(float64) result { return result{nil, "inflight"} }},
	} {
		for _, limit := range []int{10, 1} {
			t.Run(fmt.Sprintf("%s, limit %d", tc.name, limit), func(t *testing.T) {
				rdb, k := testenv.Redis(t)
				ctx := context.Background()
				st := queue.NewStore(rdb, k)
				base := noHolderBatch(t, rdb, k, st)
				tc.move(t, rdb, k, st, base)
				expireBatch(t, rdb, k, "b:a", base)
				// An unbatched lease runs out as its batch's did.
				for _, s := range []string{"S0", "S1", "S3"} {
					rdb.ZAddXX(ctx, k.Inflight, redis.Z{Score: base, Member: s})
				}
				leased := claimUntilQuiet(t, st, limit)
				othersLeasedOnce(t, leased, base)
				want := tc.want(base)
				if fmt.Sprint(leased["S2"]) != fmt.Sprint(want.leasedAt) {
					t.Errorf("S2 leased at %v, want %v", leased["S2"], want.leasedAt)
				}
				if got := findable(t, rdb, k, "S2"); !strings.HasPrefix(got, want.where) || (want.where == "") != (got == "") {
					t.Errorf("S2 is in %q, want %q (%s)", got, want.where, leaseState(t, rdb, k, "S2"))
				}
				if dead := deadReasons(t, rdb, k); len(dead) != 0 {
					t.Errorf("dead letters %v, want none", dead)
				}
				if drop, err := st.Fence(ctx, "b:a", 0, []string{"S0", "S1", "S2", "S3"}); err != nil || len(drop) != 4 {
					t.Errorf("the old holder's fence drops %v (%v), want all four", drop, err)
				}
				noOrphansConsistentCounts(t, rdb, k)
			})
		}
	}
}

// The unbatch tool (a rollback to per-member leases) meets a listed member
// whose record names no holder a claim reads. It takes any record not
// carrying the batch's token for a member that had left, and drops the
// batch: the record stays where neither release's claim looks and the
// reconciler skips the serial. It must report the member, and dead-letter
// it or leave it where a claim that leases per batch dead-letters it; a
// member that left legitimately (a backoff, a producer's write) is still
// only departed.
func TestAdvUnbatchReportsAMemberWhoseRecordNamesNoHolder(t *testing.T) {
	for _, rec := range []string{"garbage", "", "%d|0|b:gone|", "%d|0|-|"} {
		t.Run(fmt.Sprintf("record %q", rec), func(t *testing.T) {
			t.Skip("unbatch counts S2 as departed and drops the batch, so its record is left where no claim finds it; " +
				"keeping S2 in its batch is not enough while the members converted beside it still carry the batch's token " +
				"(TestAdvPartialUnbatchThenTheHolderFinishes): the claim's release of S1 drops the kept batch first")
			rdb, k := testenv.Redis(t)
			ctx := context.Background()
			st := queue.NewStore(rdb, k)
			base := noHolderBatch(t, rdb, k, st)
			if strings.Contains(rec, "%d") {
				rec = fmt.Sprintf(rec, int64(base)+2)
			}
			rdb.HSet(ctx, k.Lease, "S2", rec)
			// S0 left legitimately: a backoff, due in an hour; S3 a
			// producer's raw ZADD, later.
			if r, err := st.Retry(ctx, queue.RetryArgs{Token: "b:a", Serials: []string{"S0"}, Delay: time.Hour}); err != nil || r.Moved != 1 {
				t.Fatalf("retry %+v, %v", r, err)
			}
			rdb.ZAdd(ctx, k.Queue, redis.Z{Score: base + float64(2*time.Hour.Milliseconds()), Member: "S3"})
			res, err := st.UnbatchLeases(ctx, 0)
			if err != nil {
				t.Fatal(err)
			}
			if res.Members != 2 || res.Departed != 1 || len(res.Problems) != 1 || res.Problems[0].Serial != "S2" {
				t.Errorf("unbatch %+v, want S1 and S3 converted, S0 departed, S2 reported", res)
			}
			// Reported, and dead-lettered or still in a batch a claim reads.
			if l := rdb.HGet(ctx, k.LeaseBatch, "b:a").Val(); l != "S2" && rdb.ZScore(ctx, k.Dead, "S2").Err() != nil {
				t.Errorf("S2 neither dead-lettered nor listed by b:a (%q) after the unbatch (%s)", l, leaseState(t, rdb, k, "S2"))
			}
			// A daemon that leases per batch dead-letters S2 once the
			// batch expires, and takes back S1 and S3 (unbatched).
			expireBatch(t, rdb, k, "b:a", base)
			rdb.ZAddXX(ctx, k.Inflight, redis.Z{Score: base, Member: "S1"}, redis.Z{Score: base, Member: "S3"})
			leased := claimUntilQuiet(t, st, 10)
			if fmt.Sprint(leased) != fmt.Sprint(map[string][]int64{"S1": {int64(base) + 1}}) {
				t.Errorf("claims after the unbatch leased %v, want S1 at %d (S3 is the producer's, later)", leased, int64(base)+1)
			}
			if dead := deadReasons(t, rdb, k); fmt.Sprint(dead) != fmt.Sprint(map[string]string{"S2": queue.ReasonMalformed}) {
				t.Errorf("dead letters %v, want S2 malformed", dead)
			}
			noOrphansConsistentCounts(t, rdb, k)
		})
	}
}

// A partial unbatch (a member whose record carrying the token has no
// integer deadline stays in its batch, counted alone; the rest are
// converted) leaves the converted members' records carrying the kept
// batch's token. The live holder's finish of one of them then counts it
// out of the kept batch: the batch goes with the damaged member still in
// it, and, the token being a batch's, the finish leaves the member's
// inflight entry, so a later claim leases the finished order again.
func TestAdvPartialUnbatchThenTheHolderFinishes(t *testing.T) {
	t.Skip("a partial unbatch keeps the batch counting only its damaged members while the converted ones still carry " +
		"its token: a finish or a claim's release of one takes the count to 0 and drops the batch (S2 is lost), and the " +
		"finish, seeing a batch token, leaves the member's inflight entry (S0 is leased again); fixing it changes what " +
		"unbatch does with a damaged batch (convert none of it, or dead-letter the damaged member) or finish's hot path")
	rdb, k := testenv.Redis(t)
	ctx := context.Background()
	st := queue.NewStore(rdb, k)
	base := noHolderBatch(t, rdb, k, st)
	rdb.HSet(ctx, k.Lease, "S2", "x|0|b:a|")
	res, err := st.UnbatchLeases(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	if res.Members != 3 || len(res.Problems) != 1 || res.Remaining != 1 {
		t.Fatalf("unbatch %+v, want S0, S1, S3 converted and S2 left in b:a", res)
	}
	// The holder is alive: it closed S0 and finishes it.
	if n, err := st.Finish(ctx, "b:a", []string{"S0"}, false); err != nil || n != 1 {
		t.Fatalf("finish %d, %v", n, err)
	}
	// Every lease runs out.
	expireBatch(t, rdb, k, "b:a", base)
	for _, s := range []string{"S0", "S1", "S3"} {
		rdb.ZAddXX(ctx, k.Inflight, redis.Z{Score: base, Member: s})
	}
	leased := claimUntilQuiet(t, st, 10)
	if _, again := leased["S0"]; again {
		t.Errorf("S0, finished, leased again at %v (%s)", leased["S0"], leaseState(t, rdb, k, "S0"))
	}
	if dead := deadReasons(t, rdb, k); dead["S2"] != queue.ReasonMalformed {
		t.Errorf("dead letters %v, want S2 malformed (%s)", dead, leaseState(t, rdb, k, "S2"))
	}
	for _, o := range orphanRecords(t, rdb, k) {
		t.Error(o)
	}
}
