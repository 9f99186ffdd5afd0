package queue_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"reflect"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Reproducers of what the adversary found in the twelve reordered
// scripts. A test that fails on the scripts that ship is skipped unless
// ORDERDELAY_ADV_REPRO=1, and says why.

func advRepro(t *testing.T, why string) {
	t.Helper()
	if os.Getenv("ORDERDELAY_ADV_REPRO") != "1" {
		t.Skip("fails on the scripts that ship (" + why + "); ORDERDELAY_ADV_REPRO=1 runs it")
	}
}

// C1. cancelScript removes the serial from the queue key first and drops
// its lease record after (HGET, HDEL). The audit's reorder (7413b95) moved
// the HDEL before the batch count but kept the ZREM first. A producer
// that rescheduled a leased order with a raw ZADD (an hour ahead) has its
// deadline in the queue key, and the holder's fence drops the serial
// because of it. Cancel it with HDEL refused (an ACL tightened at
// runtime): the ZREM stays, the lease record stays, and the fence — which
// now sees a record carrying its token and nothing in the queue key —
// lets the holder close the order an hour before the deadline the
// producer wrote (and GET reports the lease's old deadline). The
// every-call sweeps find the same at call 2 (HGET) and 3 (HDEL), batch or
// per-member lease. Dropping the lease before the ZREM of the queue key
// (HGET, HDEL, unbatch, ZREMs, ZREM of the queue key last) leaves, when
// refused, the producer's entry in the queue key with no lease: the fence
// drops the serial.
func TestAdvCancelRefusedAfterItsQueueZremKeepsAStaleLease(t *testing.T) {
	for _, batch := range []bool{true, false} {
		t.Run(leaseMode(batch), func(t *testing.T) {
			e := newRefusalEnv(t)
			e.due("X-0", "X-1")
			e.claim("c:1", batch, 2)
			now, err := e.st.Now(e.ctx)
			if err != nil {
				t.Fatal(err)
			}
			later := queue.DeadlineMillis(now.Add(time.Hour))
			if err := e.rdb.ZAdd(e.ctx, e.k.Queue, redis.Z{Score: float64(later), Member: "X-0"}).Err(); err != nil {
				t.Fatal(err)
			}
			if drop, err := e.st.Fence(e.ctx, "c:1", 0, []string{"X-0"}); err != nil || !slices.Equal(drop, []string{"X-0"}) {
				t.Fatalf("fence before the cancel: %v, %v; want X-0 dropped (its producer wrote it an hour ahead)", drop, err)
			}
			e.refused("hdel", func() error {
				_, err := e.st.Cancel(e.ctx, "X-0")
				return err
			})
			drop, err := e.st.Fence(e.ctx, "c:1", 0, []string{"X-0"})
			if err != nil {
				t.Fatal(err)
			}
			ent, _, _ := e.st.Get(e.ctx, "X-0")
			if !slices.Contains(drop, "X-0") {
				t.Errorf("after the refused cancel the fence of c:1 accepts X-0: its holder closes it now, an hour before the deadline %d its producer wrote (GET says %+v)", later, ent)
			}
		})
	}
}

// K1. putTaskScript before the reorder dropped a held task's lease only
// when it moved the task (result 2); the reorder's `if leased` after the
// ZADD runs for a created one too (result 1): a task whose lease record
// has no numeric deadline (a foreign write; no script writes one) is
// "created", and the new put also deletes that record and the task's
// {q}:inflight and {q}:deadlines entries — three commands the old put did
// not send, on the put's hot path. Harmless for the contract (the task is
// queued at the put's deadline either way), but not the old script's
// state or cost: the only no-failure difference the differential test
// finds.
func TestAdvPutTaskDropsAGarbageLeaseTheOldPutKept(t *testing.T) {
	advRepro(t, "K1: the reordered put deletes a lease record without a numeric deadline that the old put kept")
	rdb, k0 := testenv.Redis(t)
	ctx := context.Background()
	before, after := scriptsBeforeReorder(t), shippedScripts(t)
	now0, err := queue.NewStore(rdb, k0).Now(ctx)
	if err != nil {
		t.Fatal(err)
	}
	now := queue.DeadlineMillis(now0)
	state := advCmds{
		{"HSET", rLease, "T-0", "garbage"},
		{"ZADD", rInflight, now + 60000, "T-0"},
		{"ZADD", rDeadlines, now - 1000, "T-0"},
	}
	call := advCall{[]string{"queue", "lease", "inflight", "deadlines", "wake", "payload", "meta"}, []any{"set", "T-0", now + 5000, `{"v":1}`, "client"}}
	ka, kb := queue.NewKeys(k0.Queue+":old"), queue.NewKeys(k0.Queue+":new")
	state.write(t, rdb, ka)
	state.write(t, rdb, kb)
	t.Cleanup(func() { testenv.DeleteQueue(rdb, ka); testenv.DeleteQueue(rdb, kb) })
	ra := evalHooked(t, rdb, hookScript(before["putTaskScript"]), ka, call.roles, call.args, now, 0)
	rb := evalHooked(t, rdb, hookScript(after["putTaskScript"]), kb, call.roles, call.args, now, 0)
	if ra.Err != nil || rb.Err != nil {
		t.Fatalf("put: %v before, %v after", ra.Err, rb.Err)
	}
	if d := dumpDiff(dumpAll(t, rdb, ka, nil), dumpAll(t, rdb, kb, nil)); len(d) > 0 {
		t.Errorf("the put ends differently after the reorder:\n  %s", strings.Join(d, "\n  "))
	}
	if len(rb.Calls) > len(ra.Calls) {
		t.Errorf("the put sends %d commands after the reorder, %d before (%v, %v)", len(rb.Calls), len(ra.Calls), rb.counts(), ra.counts())
	}
}

// D1. retry, bury and hand-back take a batch's count down by #owned,
// and owned() returns a serial once per mention in ARGV: a call that names
// a member twice takes the count down twice and drops the batch while
// another member still carries its token, in no place a claim reads.
// Store.Retry, Bury and HandBack send distinct serials, so no caller of
// the store meets it; a raw caller of the scripts (or a future caller
// that forgets distinct) does. Before the reorder as after: not the
// reorder's, but the scripts' contract does not say "distinct".
func TestAdvLeaseScriptsWithARepeatedSerialDropTheBatchUnderItsOtherMembers(t *testing.T) {
	advRepro(t, "D1: a serial named twice takes the batch count down twice")
	after := shippedScripts(t)
	for _, tc := range []struct {
		v     string
		roles []string
		args  []any
	}{
		{"retryScript", []string{"inflight", "lease", "deadlines", "leases", "leasebatch"}, []any{"d:1", 1000, 1, "x", "Y-0", "Y-0"}},
		{"buryScript", []string{"inflight", "deadlines", "lease", "dead", "deadinfo", "leases", "leasebatch"}, []any{"d:1", "close_failed", "x", 1, "Y-0", "Y-0"}},
		{"handBackScript", []string{"queue", "inflight", "deadlines", "lease", "leases", "leasebatch"}, []any{"d:1", "Y-0", "Y-0"}},
	} {
		t.Run(tc.v, func(t *testing.T) {
			rdb, k := testenv.Redis(t)
			st := queue.NewStore(rdb, k)
			ctx := context.Background()
			base := dueAt(t, st, 0)
			rdb.ZAdd(ctx, k.Queue, redis.Z{Score: base, Member: "Y-0"}, redis.Z{Score: base + 1, Member: "Y-1"})
			if r, err := st.Claim(ctx, queue.ClaimArgs{Limit: 10, Lease: time.Minute, Token: "d:1", Batch: true}); err != nil || len(r.Items) != 2 {
				t.Fatalf("claim: %+v, %v", r, err)
			}
			now, _ := st.Now(ctx)
			if run := evalHooked(t, rdb, hookScript(after[tc.v]), k, tc.roles, tc.args, queue.DeadlineMillis(now), 0); run.Err != nil {
				t.Fatal(run.Err)
			}
			if w := advWhere(t, rdb, k, "Y-1"); len(w) == 0 {
				rec, _ := rdb.HGet(ctx, k.Lease, "Y-1").Result()
				t.Errorf("%s naming Y-0 twice: Y-1, still held by d:1 (record %q), is in no place a claim reads", tc.v, rec)
			}
		})
	}
}

// E1 (holds): a Lua error mid-loop — a record carrying the call's token
// whose deadline is no number (a foreign write), or a key of the wrong
// type — used to come after the batch count was taken and earlier
// entries' leases were dropped (hand-back: record gone, queue ZADD
// failed: lost). The reordered scripts write the new place first, so the
// entry that fails keeps its lease and the batch its count.
func TestAdvReorderedLeaseScriptsFailingMidLoopKeepEveryEntry(t *testing.T) {
	after := shippedScripts(t)
	for _, tc := range []struct {
		v     string
		roles []string
		args  []any
	}{
		{"retryScript", []string{"inflight", "lease", "deadlines", "leases", "leasebatch"}, []any{"e:1", 1000, 1, "x", "Z-0", "Z-1", "Z-2"}},
		{"buryScript", []string{"inflight", "deadlines", "lease", "dead", "deadinfo", "leases", "leasebatch"}, []any{"e:1", "close_failed", "x", 1, "Z-0", "Z-1", "Z-2"}},
		{"handBackScript", []string{"queue", "inflight", "deadlines", "lease", "leases", "leasebatch"}, []any{"e:1", "Z-0", "Z-1", "Z-2"}},
	} {
		t.Run(tc.v, func(t *testing.T) {
			rdb, k := testenv.Redis(t)
			st := queue.NewStore(rdb, k)
			ctx := context.Background()
			base := dueAt(t, st, 0)
			for i, s := range []string{"Z-0", "Z-1", "Z-2"} {
				rdb.ZAdd(ctx, k.Queue, redis.Z{Score: base + float64(i), Member: s})
			}
			if r, err := st.Claim(ctx, queue.ClaimArgs{Limit: 10, Lease: time.Minute, Token: "e:1", Batch: true}); err != nil || len(r.Items) != 3 {
				t.Fatalf("claim: %+v, %v", r, err)
			}
			rdb.HSet(ctx, k.Lease, "Z-1", "x|0|e:1|") // a foreign write: no number
			now, _ := st.Now(ctx)
			run := evalHooked(t, rdb, hookScript(after[tc.v]), k, tc.roles, tc.args, queue.DeadlineMillis(now), 0)
			if run.Err == nil {
				t.Fatalf("%s: no Lua error on a record without a deadline; the test no longer reaches the path", tc.v)
			}
			for _, s := range []string{"Z-0", "Z-1", "Z-2"} {
				if len(advWhere(t, rdb, k, s)) == 0 {
					t.Errorf("%s failing on Z-1 (%v): %s is in no place a claim reads (%s)", tc.v, run.Err, s, leaseState(t, rdb, k, s))
				}
			}
		})
	}
}

// T1 (fixed). takeScript recorded the item as taken and counted the
// delivery before it moved the item out of the ready list: refused at
// the HINCRBY or the LMOVE, the item stayed in the ready list recorded as
// taken, and recovery returned a second copy — or, with max_attempts 1
// and the count written, dead-lettered a task no one had received. Now
// the take counts last, and recovery tells an item still in the ready
// list by a second LREM, sent only when the first found nothing
// (TestRefusedTakeNeitherCopiesNorDeadLettersTheItem).
//
// T2 (fixed). The recovery dropped an item's {q}:unacked entry before its
// {q}:taken record: refused at that HDEL, the record stayed with no entry
// to recover it by, and every take passed the item (and any later item of
// its id) over for good. Now the record goes first; an entry left alone
// is dropped by the next recovery.
//
// Here the take is refused at each of its calls, and the recovery that
// follows at each of its own, then runs whole: one copy of the item, in
// the ready or the processing list, never dead-lettered, no record
// without its entry, and the takes that follow hand it out on its first
// delivery.
func TestAdvTakeRefusedThenItsRecoveryRefusedKeepsOneCopy(t *testing.T) {
	rdb, k0 := testenv.Redis(t)
	ctx := context.Background()
	after := shippedScripts(t)
	take, fwd := hookScript(after["takeScript"]), hookScript(after["forwardScript"])
	now0, err := queue.NewStore(rdb, k0).Now(ctx)
	if err != nil {
		t.Fatal(err)
	}
	now := queue.DeadlineMillis(now0)
	takeRoles := advTakeRoles
	fwdRoles := advForwardRoles
	const ack = 60000
	fwdArgs := []any{"list", 10, 0, "q", 1, ack, 1} // max_attempts 1
	item := listItem("K-0", now-5000, `{"n":0}`)
	kw, kRun := queue.NewKeys(k0.Queue+":world"), queue.NewKeys(k0.Queue+":run")
	t.Cleanup(func() { testenv.DeleteQueue(rdb, kw); testenv.DeleteQueue(rdb, kRun) })
	advCmds{{"RPUSH", rReady, listItem("K-1", now-4000, `{"n":1}`), item}}.write(t, rdb, kw)
	start := takeSnapshot(t, rdb, kw)
	full := evalHooked(t, rdb, take, kw, takeRoles, []any{100}, now, 0)
	if full.Err != nil || full.Reply == nil {
		t.Fatalf("take: %v, %v", full.Reply, full.Err)
	}
	copies := func(k queue.Keys) int {
		n := 0
		for _, l := range []string{k.Ready, k.Processing} {
			items, err := rdb.LRange(ctx, l, 0, -1).Result()
			if err != nil {
				t.Fatal(err)
			}
			n += strings.Count(strings.Join(items, "\n"), `"id":"K-0"`)
		}
		return n
	}
	for at := 1; at <= len(full.Calls); at++ {
		start.restore(t, rdb, kRun)
		if run := evalHooked(t, rdb, take, kRun, takeRoles, []any{100}, now, at); run.Err == nil {
			t.Fatalf("take refused at call %d: no error", at)
		}
		refused := takeSnapshot(t, rdb, kRun)
		c := full.Calls[at-1]
		rec := evalHooked(t, rdb, fwd, kRun, fwdRoles, fwdArgs, now+ack, 0)
		for fat := 0; fat <= len(rec.Calls); fat++ {
			refused.restore(t, rdb, kRun)
			what := fmt.Sprintf("take refused at call %d (%s %s), its recovery at call %d", at, c[0], c[1], fat)
			if fat > 0 {
				r := rec.Calls[fat-1]
				what += fmt.Sprintf(" (%s %s %s)", r[0], r[1], r[2])
				evalHooked(t, rdb, fwd, kRun, fwdRoles, fwdArgs, now+ack, fat)
			}
			if run := evalHooked(t, rdb, fwd, kRun, fwdRoles, fwdArgs, now+ack, 0); run.Err != nil {
				t.Fatalf("%s, then a recovery: %v", what, run.Err)
			}
			if n := copies(kRun); n != 1 {
				t.Errorf("%s, then a recovery: %d copies of K-0 in the ready and processing lists, want 1", what, n)
			}
			if rdb.ZScore(ctx, kRun.Dead, "K-0").Err() == nil {
				t.Errorf("%s, then a recovery: K-0 dead-lettered (max_attempts 1), though no take delivered it", what)
			}
			if rdb.HExists(ctx, kRun.Taken, "K-0").Val() && rdb.ZScore(ctx, kRun.Unacked, "K-0").Err() != nil {
				t.Errorf("%s, then a recovery: K-0 recorded as taken with no {q}:unacked entry: no recovery reaches it", what)
			}
			st := queue.NewStore(rdb, kRun)
			var got []queue.ListItem
			for {
				it, err := st.Take(ctx)
				if errors.Is(err, queue.ErrNothingToTake) {
					break
				}
				if err != nil {
					t.Fatal(err)
				}
				got = append(got, it)
			}
			if i := slices.IndexFunc(got, func(it queue.ListItem) bool { return it.ID == "K-0" }); i < 0 || got[i].Attempts != 0 {
				t.Errorf("%s, then a recovery: the takes that follow hand out %+v; want K-0 on its first delivery", what, got)
			}
		}
	}
}

// B1 (holds). A release refused at the batch's HDEL (retry, bury or
// hand-back of a batch's last members, unlease) has already taken the
// batch out of {q}:leases: its three {q}:leasebatch fields (list, "#"
// count, "<" oldest) stay, with no expiry. Nothing reads them: the claim,
// the gauges and unbatch find batches by {q}:leases, a fence reads lease
// records, and a release by the same token finds no record carrying it
// (tokens are unique per claim, and the script had moved every member it
// counted). Here each script is refused there, and a state with the
// stray fields and one without them answer the same gauges, the same
// claim and the same fences, and count each held entry once.
func TestAdvStrayBatchFieldsOfARefusedReleaseMisleadNothing(t *testing.T) {
	after := shippedScripts(t)
	ss := []any{"S-0", "S-1", "S-2"}
	for _, tc := range []struct {
		v     string
		roles []string
		args  []any
		want  int // entries the next claim takes: the three moved (unless dead) and N-0
	}{
		{"retryScript", []string{"inflight", "lease", "deadlines", "leases", "leasebatch"}, append([]any{"d:1", 0, 1, "db down"}, ss...), 4},
		{"buryScript", []string{"inflight", "deadlines", "lease", "dead", "deadinfo", "leases", "leasebatch"}, append([]any{"d:1", "close_failed", "x", 1}, ss...), 1},
		{"handBackScript", []string{"queue", "inflight", "deadlines", "lease", "leases", "leasebatch"}, append([]any{"d:1"}, ss...), 4},
	} {
		t.Run(tc.v, func(t *testing.T) {
			rdb, k0 := testenv.Redis(t)
			ctx := context.Background()
			ka, kb := queue.NewKeys(k0.Queue+":strays"), queue.NewKeys(k0.Queue+":clean")
			t.Cleanup(func() { testenv.DeleteQueue(rdb, ka); testenv.DeleteQueue(rdb, kb) })
			sa, sb := queue.NewStore(rdb, ka), queue.NewStore(rdb, kb)
			base := dueAt(t, sa, 0)
			for i, s := range ss {
				rdb.ZAdd(ctx, ka.Queue, redis.Z{Score: base + float64(i), Member: s})
			}
			if r, err := sa.Claim(ctx, queue.ClaimArgs{Limit: 10, Lease: time.Minute, Token: "d:1", Batch: true}); err != nil || len(r.Items) != 3 {
				t.Fatalf("claim: %+v, %v", r, err)
			}
			now0, err := sa.Now(ctx)
			if err != nil {
				t.Fatal(err)
			}
			now := queue.DeadlineMillis(now0)
			src := hookScript(after[tc.v])
			snap := takeSnapshot(t, rdb, ka)
			snap.restore(t, rdb, kb)
			full := evalHooked(t, rdb, src, kb, tc.roles, tc.args, now, 0)
			at := slices.IndexFunc(full.Calls, func(c [3]string) bool { return c[0] == "hdel" && c[1] == "leasebatch" })
			if full.Err != nil || at < 0 {
				t.Fatalf("%s: %v, calls %v; want the batch's HDEL", tc.v, full.Err, full.Calls)
			}
			if run := evalHooked(t, rdb, src, ka, tc.roles, tc.args, now, at+1); run.Err == nil {
				t.Fatalf("%s refused at call %d: no error", tc.v, at+1)
			}
			if !rdb.HExists(ctx, ka.LeaseBatch, "#d:1").Val() || rdb.ZScore(ctx, ka.Leases, "d:1").Err() != redis.Nil {
				t.Fatalf("%s refused at its batch's HDEL: no stray fields; the test no longer reaches the path", tc.v)
			}
			takeSnapshot(t, rdb, ka).restore(t, rdb, kb)
			rdb.HDel(ctx, kb.LeaseBatch, "d:1", "#d:1", "<d:1")
			same := func(when string) {
				t.Helper()
				a, err := sa.Stats(ctx)
				if err != nil {
					t.Fatal(err)
				}
				b, err := sb.Stats(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if a.Depth != b.Depth || a.Overdue != b.Overdue || a.Held != b.Held || a.DeadLetters != b.DeadLetters || !a.NextDeadline.Equal(b.NextDeadline) {
					t.Errorf("%s, %s: gauges %+v with the stray fields, %+v without", tc.v, when, a, b)
				}
			}
			same("refused at the batch's HDEL")
			for _, k := range []queue.Keys{ka, kb} {
				rdb.ZAdd(ctx, k.Queue, redis.Z{Score: base + 10, Member: "N-0"})
			}
			var items [2][]queue.Leased
			for i, st := range []*queue.Store{sa, sb} {
				r, err := st.Claim(ctx, queue.ClaimArgs{Limit: 10, Lease: time.Minute, Token: "d:2", Batch: true})
				if err != nil {
					t.Fatal(err)
				}
				items[i] = r.Items
				sort.Slice(items[i], func(x, y int) bool { return items[i][x].Serial < items[i][y].Serial })
			}
			if len(items[0]) != tc.want {
				t.Errorf("%s: the next claim takes %v; want %d entries", tc.v, items[0], tc.want)
			}
			if !reflect.DeepEqual(items[0], items[1]) {
				t.Errorf("%s: the next claim takes %v with the stray fields, %v without", tc.v, items[0], items[1])
			}
			same("after the next claim")
			if st, err := sa.Stats(ctx); err != nil || st.Held != int64(len(items[0])) {
				t.Errorf("%s: the gauges count %d held (%v), the claim holds %d", tc.v, st.Held, err, len(items[0]))
			}
			var held []string
			for _, it := range items[0] {
				held = append(held, it.Serial)
			}
			if drop, err := sa.Fence(ctx, "d:1", 0, held); err != nil || len(drop) != len(held) {
				t.Errorf("%s: the fence of the stray token d:1 drops %v of %v (%v); want all", tc.v, drop, held, err)
			}
			if drop, err := sa.Fence(ctx, "d:2", 0, held); err != nil || len(drop) != 0 {
				t.Errorf("%s: the fence of d:2 drops %v (%v); want none", tc.v, drop, err)
			}
			for _, st := range []*queue.Store{sa, sb} {
				if n, err := st.Finish(ctx, "d:2", held, false); err != nil || n != len(held) {
					t.Fatalf("finish: %d, %v", n, err)
				}
			}
			same("after the claim's finish")
		})
	}
}
