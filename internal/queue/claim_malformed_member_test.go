package queue_test

import (
	"context"
	"fmt"
	"sort"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Step 1b of the claim re-takes the members of an expired batch lease from
// their lease records. A record no script writes — a foreign write, a
// damaged restore — gives no deadline to close by: the member is
// dead-lettered as malformed (489861f), the rest of the batch is leased to
// the new claim, and the batches are left counted as the scripts keep
// them. Whatever the record holds, the order ends in a place an operator
// or a claim finds it, never in a record nothing reads.

// leaseKeysState reads the keys countsConsistent judges (the batch
// leases, their lists and counts, the lease records).
func leaseKeysState(t *testing.T, rdb *redis.Client, k queue.Keys) claimState {
	t.Helper()
	ctx := context.Background()
	var st claimState
	var err error
	if st.leases, err = rdb.ZRangeWithScores(ctx, k.Leases, 0, -1).Result(); err != nil {
		t.Fatal(err)
	}
	for _, h := range []struct {
		key string
		to  *[][2]string
	}{{k.Lease, &st.lease}, {k.LeaseBatch, &st.leasebatch}} {
		all, err := rdb.HGetAll(ctx, h.key).Result()
		if err != nil {
			t.Fatal(err)
		}
		for f, v := range all {
			*h.to = append(*h.to, [2]string{f, v})
		}
	}
	return st
}

// claimedSerials lists a claim's items, sorted, with their deadlines.
func claimedSerials(res queue.ClaimResult) (serials []string, deadlines map[string]int64) {
	deadlines = map[string]int64{}
	for _, it := range res.Items {
		serials = append(serials, it.Serial)
		deadlines[it.Serial] = it.Deadline
	}
	sort.Strings(serials)
	return serials, deadlines
}

func TestClaimDeadLettersAnExpiredBatchMemberWithoutANumericDeadline(t *testing.T) {
	cases := []struct {
		name string
		rec  string // S2's record once the batch "b:a" has leased it
	}{
		{"deadline not a number", "x|0|b:a|"},
		{"deadline empty", "|0|b:a|"},
		{"garbage", "garbage"},
		{"empty", ""},
	}
	for _, tc := range cases {
		for _, limit := range []int{10, 2} { // 2: the batch is re-taken in two claims
			t.Run(fmt.Sprintf("%s, limit %d", tc.name, limit), func(t *testing.T) {
				rdb, k := testenv.Redis(t)
				ctx := context.Background()
				st := queue.NewStore(rdb, k)
				base := dueAt(t, st, 0)
				serials := []string{"S0", "S1", "S2", "S3"}
				bad := serials[2]
				for i, s := range serials {
					if err := rdb.ZAdd(ctx, k.Queue, redis.Z{Score: base + float64(i), Member: s}).Err(); err != nil {
						t.Fatal(err)
					}
				}
				if a := claimAll(t, st, queue.ClaimArgs{Limit: 10, Lease: time.Minute, Token: "b:a", Batch: true}); len(a.Items) != 4 {
					t.Fatalf("first claim %+v, want the 4 serials", a.Items)
				}
				// The record is damaged, and the batch's lease runs out (its
				// expiry moved into the past: data, not clocks).
				if err := rdb.HSet(ctx, k.Lease, bad, tc.rec).Err(); err != nil {
					t.Fatal(err)
				}
				if err := rdb.ZAdd(ctx, k.Leases, redis.Z{Score: base, Member: "b:a"}).Err(); err != nil {
					t.Fatal(err)
				}

				leased := map[string]int64{}
				tokens := []string{}
				for i := 0; i < 4; i++ {
					tok := fmt.Sprintf("b:n%d", i)
					res, err := st.Claim(ctx, queue.ClaimArgs{Limit: limit, Lease: time.Minute, Token: tok, Batch: true})
					if err != nil {
						t.Fatalf("claim %d after the damage: %v", i+1, err)
					}
					if len(res.Items) == 0 && len(res.Dead) == 0 {
						break
					}
					got, ds := claimedSerials(res)
					for _, s := range got {
						if _, twice := leased[s]; twice {
							t.Errorf("%s leased twice", s)
						}
						leased[s] = ds[s]
					}
					if len(got) > 0 {
						tokens = append(tokens, tok)
					}
					if res.Reclaimed != len(got) {
						t.Errorf("claim %d: %d of %v counted as re-claimed, want all", i+1, res.Reclaimed, got)
					}
				}
				for i, s := range serials {
					if s == bad {
						if d, ok := leased[s]; ok {
							t.Errorf("%s, whose record %q gives no deadline, leased at %d", s, tc.rec, d)
						}
						continue
					}
					if d, ok := leased[s]; !ok || d != int64(base)+int64(i) {
						t.Errorf("%s leased at %d (%v), want its deadline %d", s, d, ok, int64(base)+int64(i))
					}
				}
				if got := deadReasons(t, rdb, k); len(got) != 1 || got[bad] != queue.ReasonMalformed {
					t.Errorf("dead letters %v, want %s %s", got, bad, queue.ReasonMalformed)
				}
				if rec, err := rdb.HGet(ctx, k.Lease, bad).Result(); err != redis.Nil {
					t.Errorf("%s keeps a lease record %q (%v)", bad, rec, err)
				}
				if drop, err := st.Fence(ctx, "b:a", 0, serials); err != nil || len(drop) != len(serials) {
					t.Errorf("the old holder's fence drops %v (%v), want all of %v", drop, err, serials)
				}
				state := leaseKeysState(t, rdb, k)
				if !countsConsistent(state) {
					t.Errorf("batch counts inconsistent after the claims:\n  leases %v\n  lists %v\n  records %v", state.leases, state.leasebatch, state.lease)
				}
				if got := rdb.ZRange(ctx, k.Leases, 0, -1).Val(); fmt.Sprint(got) != fmt.Sprint(tokens) {
					t.Errorf("batch leases %v, want the new claims' %v (b:a gone)", got, tokens)
				}
				for _, o := range orphanRecords(t, rdb, k) {
					t.Error(o)
				}
			})
		}
	}
}

// The damaged member of the expired batch was written again by a producer
// (a raw ZADD) before the claim: the producer's latest write decides, not
// the damage. It is not dead-lettered; due, it is leased once, at the
// producer's deadline; not due, it stays queued there, and the old
// holder's fence drops it either way.
func TestClaimExpiredBatchMemberWithADamagedRecordRewrittenByAProducer(t *testing.T) {
	for _, rec := range []string{"x|0|b:a|", "garbage"} {
		for _, due := range []bool{true, false} {
			t.Run(fmt.Sprintf("record %q, rewritten due %v", rec, due), func(t *testing.T) {
				rdb, k := testenv.Redis(t)
				ctx := context.Background()
				st := queue.NewStore(rdb, k)
				base := dueAt(t, st, 0)
				serials := []string{"S0", "S1", "S2", "S3"}
				for i, s := range serials {
					if err := rdb.ZAdd(ctx, k.Queue, redis.Z{Score: base + float64(i), Member: s}).Err(); err != nil {
						t.Fatal(err)
					}
				}
				if a := claimAll(t, st, queue.ClaimArgs{Limit: 10, Lease: time.Minute, Token: "b:a", Batch: true}); len(a.Items) != 4 {
					t.Fatalf("first claim %+v, want the 4 serials", a.Items)
				}
				again := base + 10
				if !due {
					again = base + float64(2*time.Hour.Milliseconds())
				}
				if err := rdb.HSet(ctx, k.Lease, "S2", rec).Err(); err != nil {
					t.Fatal(err)
				}
				if err := rdb.ZAdd(ctx, k.Queue, redis.Z{Score: again, Member: "S2"}).Err(); err != nil {
					t.Fatal(err)
				}
				if err := rdb.ZAdd(ctx, k.Leases, redis.Z{Score: base, Member: "b:a"}).Err(); err != nil {
					t.Fatal(err)
				}
				res, err := st.Claim(ctx, queue.ClaimArgs{Limit: 10, Lease: time.Minute, Token: "b:b", Batch: true})
				if err != nil {
					t.Fatalf("claim after the damage: %v", err)
				}
				got, ds := claimedSerials(res)
				want := []string{"S0", "S1", "S3"}
				if due {
					want = serials
				}
				if fmt.Sprint(got) != fmt.Sprint(want) {
					t.Fatalf("claimed %v, want %v", got, want)
				}
				if d, ok := ds["S2"]; ok && float64(d) != again {
					t.Errorf("S2 leased at %d, want the producer's %v", d, again)
				}
				if res.Reclaimed != 3 {
					t.Errorf("%d re-claimed, want 3 (S2 is the producer's new entry)", res.Reclaimed)
				}
				if dead := deadReasons(t, rdb, k); len(dead) != 0 {
					t.Errorf("dead letters %v, want none: the producer's write stands", dead)
				}
				if !due {
					if sc, err := rdb.ZScore(ctx, k.Queue, "S2").Result(); err != nil || sc != again {
						t.Errorf("queue score of S2 = %v (%v), want the producer's %v", sc, err, again)
					}
				}
				if drop, err := st.Fence(ctx, "b:a", 0, []string{"S2"}); err != nil || len(drop) != 1 {
					t.Errorf("the old holder's fence drops %v (%v), want S2", drop, err)
				}
				if state := leaseKeysState(t, rdb, k); !countsConsistent(state) {
					t.Errorf("batch counts inconsistent after the claim:\n  leases %v\n  lists %v\n  records %v", state.leases, state.leasebatch, state.lease)
				}
				if got := rdb.ZRange(ctx, k.Leases, 0, -1).Val(); fmt.Sprint(got) != "[b:b]" {
					t.Errorf("batch leases %v, want [b:b] (b:a gone)", got)
				}
				for _, o := range orphanRecords(t, rdb, k) {
					t.Error(o)
				}
			})
		}
	}
}
