package queue_test

import (
	"context"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// The scripts of 45d123a (after the refusal reorder, before marks) change
// a member's record first and take it off its batch's count last. Refused
// in between (an ACL tightened at runtime that drops HINCRBY: the new
// holder's trusted fence needs no HINCRBY, so it still runs), they leave
// the holder's batch unmarked with its count whole while a member's record
// no longer carries its token. The trusted fence and finish then answer
// differently from the compare-and-set (Fence, Finish) on the same state.
// This test holds FenceBatch to Fence's answer on that state and
// FinishBatch to leaving another claim's record alone.
//
// Left as it is, by choice (docs/reliability.md, "A batch trusted while
// no script changed it"): it takes a rolling upgrade from those releases
// and a command refused mid-script at once, and this release's scripts
// cannot see it (the cancel of step 4 marks the batch the record names,
// not the one that still lists the serial). Written by the second
// adversary of the trusted fence; it fails, so it runs with
// ORDERDELAY_ADV_REPRO=1 only.
func TestAdvFastFenceOlderScriptRefusedBeforeItsCount(t *testing.T) {
	if os.Getenv("ORDERDELAY_ADV_REPRO") != "1" {
		t.Skip("a known, documented limitation (a rolling upgrade from 45d123a and a refused command at once); ORDERDELAY_ADV_REPRO=1 runs it")
	}
	ctx := context.Background()
	refuse := func(t *testing.T, rdb *redis.Client, cmd string, f func() error) {
		t.Helper()
		if err := rdb.Do(ctx, "ACL", "SETUSER", "default", "-"+cmd).Err(); err != nil {
			t.Fatal(err)
		}
		err := f()
		if err2 := rdb.Do(ctx, "ACL", "SETUSER", "default", "+"+cmd).Err(); err2 != nil {
			t.Fatal(err2)
		}
		if !queue.IsRefused(err) {
			t.Fatalf("want the older script refused at %s, got %v", cmd, err)
		}
	}
	oldClaimKeys := func(k queue.Keys) []string {
		return []string{k.Queue, k.Inflight, k.Deadlines, k.Lease, k.Dead, k.DeadInfo, k.Paused, k.Payload, k.Leases, k.LeaseBatch}
	}

	t.Run("45d123a take-over of a raw re-add, refused at its HINCRBY", func(t *testing.T) {
		rdb, _ := testenv.PrivateRedis(t)
		k := queue.NewKeys("ffref:q")
		st, now := mixedSetup(t, rdb, k, "new:A.1", time.Minute, "S1", "S2", "S3")
		rdb.ZAdd(ctx, k.Queue, redis.Z{Score: float64(now - 5_000), Member: "S3"})
		refuse(t, rdb, "hincrby", func() error {
			return oldScript(t, "claimScript.lua").Run(ctx, rdb, oldClaimKeys(k),
				100, time.Minute.Milliseconds(), "old:B.1", queue.MaxAhead.Milliseconds(), 0, "0", 0, 0, "1").Err()
		})
		if rec := rdb.HGet(ctx, k.Lease, "S3").Val(); !strings.Contains(rec, "|old:B.1|") {
			t.Fatalf("S3's record %q: the older claim did not take it over", rec)
		}
		full, err := st.Fence(ctx, "new:A.1", 0, []string{"S1", "S3"})
		if err != nil {
			t.Fatal(err)
		}
		slices.Sort(full)
		got := fenceOf(t, st, "new:A.1", 3, "S1", "S3")
		if !slices.Equal(got, full) {
			t.Errorf("trusted fence dropped %v, the compare-and-set %v (batch count %q, mark %q)", got, full,
				rdb.HGet(ctx, k.LeaseBatch, "#new:A.1").Val(), rdb.HGet(ctx, k.LeaseBatch, "<new:A.1").Val())
		}
		if _, err := st.FinishBatch(ctx, "new:A.1", 3, []string{"S1", "S3"}); err != nil {
			t.Fatal(err)
		}
		if rec, err := rdb.HGet(ctx, k.Lease, "S3").Result(); err != nil || !strings.Contains(rec, "|old:B.1|") {
			t.Errorf("after the holder's finish S3's record is %q (%v): the finish removed another claim's lease record", rec, err)
		}
	})

	// The take-over refused at its count, then a cancel that succeeds (this
	// release's, acknowledged to the producer): it marks the batch the
	// record names (the older claim's), not the holder's, which is still
	// trusted; its fence accepts the cancelled order.
	t.Run("45d123a take-over refused at its HINCRBY, then an acknowledged cancel", func(t *testing.T) {
		rdb, _ := testenv.PrivateRedis(t)
		k := queue.NewKeys("ffref:q")
		st, now := mixedSetup(t, rdb, k, "new:A.1", time.Minute, "S1", "S2", "S3")
		rdb.ZAdd(ctx, k.Queue, redis.Z{Score: float64(now - 5_000), Member: "S3"})
		refuse(t, rdb, "hincrby", func() error {
			return oldScript(t, "claimScript.lua").Run(ctx, rdb, oldClaimKeys(k),
				100, time.Minute.Milliseconds(), "old:B.1", queue.MaxAhead.Milliseconds(), 0, "0", 0, 0, "1").Err()
		})
		if ok, err := st.Cancel(ctx, "S3"); err != nil || !ok {
			t.Fatalf("cancel of S3: %v %v", ok, err)
		}
		if got := fenceOf(t, st, "new:A.1", 3, "S1", "S3"); !slices.Equal(got, []string{"S3"}) {
			t.Errorf("fence dropped %v, want [S3]: the close commits an order whose cancel was acknowledged", got)
		}
	})

	t.Run("45d123a cancel, refused at its HINCRBY", func(t *testing.T) {
		rdb, _ := testenv.PrivateRedis(t)
		k := queue.NewKeys("ffref:q")
		st, _ := mixedSetup(t, rdb, k, "new:A.1", time.Minute, "S1", "S2", "S3")
		refuse(t, rdb, "hincrby", func() error {
			return oldScript(t, "cancelScript.lua").Run(ctx, rdb,
				[]string{k.Queue, k.Lease, k.Inflight, k.Deadlines, k.Leases, k.LeaseBatch}, "S3").Err()
		})
		full, err := st.Fence(ctx, "new:A.1", 0, []string{"S1", "S3"})
		if err != nil {
			t.Fatal(err)
		}
		slices.Sort(full)
		if got := fenceOf(t, st, "new:A.1", 3, "S1", "S3"); !slices.Equal(got, full) {
			t.Errorf("trusted fence dropped %v, the compare-and-set %v: S3's record is gone", got, full)
		}
	})
}
