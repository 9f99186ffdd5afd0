package queue_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Adversary tests of the claim's write order under a refused command
// (c557894): a script's writes stay when a later command fails, so
// after a failure at ANY call — not only the first of its name — every
// entry must stay where a claim finds it, and no lease from before a
// producer's latest write may survive the removal of that write from the
// queue key (its holder's fence would accept the serial, and a later
// re-claim would close it at the old deadline).
//
// What failed on c557894 (fixed in 489861f):
//
//   - drop(buried) runs after the removals from the queue key
//     (ZREMRANGEBYRANK, the far ZREM), so a refusal between them keeps the
//     lease from before a producer's dead-lettered write
//     (TestAdvClaimRefusedAfterBuryKeepsTheOldLease; the sweeps below find
//     it at every call from the takeovers' release to drop's HDEL);
//   - step 1's release of a batch count runs before the record it
//     accounts for is rewritten, and a claim refused after its records and
//     before its unmember ZREM leaves exactly such an entry, so every
//     refused retry takes the count again until the batch is dropped with
//     members in it (TestAdvClaimRefusedZremRetriedLosesTheFreshEntriesOfItsBatch;
//     the random sweep finds the same with a foreign inflight entry).

// refusalScenario is a queue state built with the store's own scripts,
// with every path of the claim, and what the claim under test must keep.
type refusalScenario struct {
	valid     []string           // entries a claim must find again
	malformed []string           // must stay in the queue key or be dead-lettered
	rewritten map[string]float64 // the producer's latest score of a serial it wrote while it was leased
	buried    map[string]bool    // of rewritten, those whose latest score is dead-lettered
}

// buildRefusalScenario writes, in k:
//
//   - OLD-0..5: a batch (per-member leases when !batch) that expired; OLD-0
//     written again by a producer since (due);
//   - BO-0, BO-1: backoffs (Retry) that are over; BO-1 written again;
//   - L-0..3: leased by a live holder (lease of an hour); a producer wrote
//     L-0 with a score in seconds (dead-lettered), L-1 more than ten years
//     ahead (dead-lettered), L-2 again, due (taken over);
//   - a malformed member, one too far ahead, `news` fresh due entries
//     and one due in an hour.
func buildRefusalScenario(t *testing.T, rdb *redis.Client, k queue.Keys, batch bool, news int) refusalScenario {
	t.Helper()
	ctx := context.Background()
	st := queue.NewStore(rdb, k)
	base := dueAt(t, st, 0)
	sc := refusalScenario{rewritten: map[string]float64{}, buried: map[string]bool{}}
	add := func(zs ...redis.Z) {
		t.Helper()
		if err := rdb.ZAdd(ctx, k.Queue, zs...).Err(); err != nil {
			t.Fatal(err)
		}
	}
	claim := func(tok string, lease time.Duration, want int) {
		t.Helper()
		r, err := st.Claim(ctx, queue.ClaimArgs{Limit: 100, Lease: lease, Token: tok, Batch: batch})
		if err != nil || len(r.Items) != want {
			t.Fatalf("claim %s: %+v, %v; want %d items", tok, r, err, want)
		}
	}
	// Leases are made with the store's scripts and an hour to run, then
	// made to have expired by moving their expiry (not waited for).
	expire := func(key string, members ...string) {
		t.Helper()
		for _, m := range members {
			if err := rdb.ZAddXX(ctx, key, redis.Z{Score: base - 1000, Member: m}).Err(); err != nil {
				t.Fatal(err)
			}
		}
	}
	var olds []string
	for i := range 6 {
		olds = append(olds, fmt.Sprintf("OLD-%d", i))
		add(redis.Z{Score: base + float64(i), Member: olds[i]})
	}
	claim("t:old", time.Hour, 6)
	sc.valid = append(sc.valid, olds...)
	add(redis.Z{Score: base + 10, Member: "BO-0"}, redis.Z{Score: base + 11, Member: "BO-1"})
	claim("t:bo", time.Hour, 2)
	if r, err := st.Retry(ctx, queue.RetryArgs{Token: "t:bo", Serials: []string{"BO-0", "BO-1"}, Delay: time.Hour, LastError: "db down"}); err != nil || r.Moved != 2 {
		t.Fatalf("retry: %+v, %v", r, err)
	}
	sc.valid = append(sc.valid, "BO-0", "BO-1")
	for i := range 4 {
		add(redis.Z{Score: base + 20 + float64(i), Member: fmt.Sprintf("L-%d", i)})
	}
	claim("t:live", time.Hour, 4)
	sc.valid = append(sc.valid, "L-2", "L-3")
	if batch {
		expire(k.Leases, "t:old")
	} else {
		expire(k.Inflight, olds...)
	}
	expire(k.Inflight, "BO-0", "BO-1")

	far := float64(queue.DeadlineMillis(time.Now().AddDate(20, 0, 0)))
	sc.rewritten["OLD-0"] = base + 30
	sc.rewritten["BO-1"] = base + 31
	sc.rewritten["L-2"] = base + 32
	sc.rewritten["L-0"], sc.buried["L-0"] = 1.5e9, true
	sc.rewritten["L-1"], sc.buried["L-1"] = far, true
	for s, x := range sc.rewritten {
		add(redis.Z{Score: x, Member: s})
	}
	add(redis.Z{Score: base + 40, Member: "bad serial\x01"}, redis.Z{Score: far, Member: "FAR-1"},
		redis.Z{Score: base + float64(time.Hour.Milliseconds()) + 60000, Member: "FUT-0"})
	sc.malformed = []string{"bad serial\x01", "FAR-1"}
	sc.valid = append(sc.valid, "FUT-0")
	var fresh []redis.Z
	for i := range news {
		s := fmt.Sprintf("NEW-%03d", i)
		fresh = append(fresh, redis.Z{Score: base + 100 + float64(i), Member: s})
		sc.valid = append(sc.valid, s)
	}
	add(fresh...)
	return sc
}

// checkAfterRefusal lists what a refused claim (token tok) broke.
func (sc refusalScenario) checkAfterRefusal(t *testing.T, rdb *redis.Client, k queue.Keys, tok string) []string {
	t.Helper()
	ctx := context.Background()
	var out []string
	ks := readKeyState(t, rdb, k)
	for _, s := range sc.valid {
		if ks.findable(s) == "" {
			out = append(out, fmt.Sprintf("%s: in no place a claim looks (%s)", s, leaseState(t, rdb, k, s)))
		}
	}
	for _, s := range sc.malformed {
		if rdb.ZScore(ctx, k.Queue, s).Err() != nil && rdb.ZScore(ctx, k.Dead, s).Err() != nil {
			out = append(out, fmt.Sprintf("%q: neither in the queue key nor dead-lettered", s))
		}
	}
	for s, x := range sc.rewritten {
		if q, err := rdb.ZScore(ctx, k.Queue, s).Result(); err == nil && q == x {
			continue // the queue key still has the producer's write: the next claim judges it
		}
		rec, err := rdb.HGet(ctx, k.Lease, s).Result()
		if sc.buried[s] {
			if rdb.ZScore(ctx, k.Dead, s).Err() != nil {
				out = append(out, fmt.Sprintf("%s: the producer's write (score %v) is neither queued nor dead-lettered", s, x))
			}
			if err == nil {
				out = append(out, fmt.Sprintf("%s: the producer's write (score %v) left the queue key for the dead-letter set, "+
					"but the lease from before it survives: record %q (its holder's fence accepts the serial; a re-claim closes it at the old deadline)", s, x, rec))
			}
			continue
		}
		if err != nil || !strings.HasPrefix(rec, fmt.Sprintf("%.0f|", x)) || !strings.Contains(rec, "|"+tok+"|") {
			out = append(out, fmt.Sprintf("%s: the producer's write (score %v) left the queue key, the record is %q", s, x, rec))
		}
	}
	return out
}

// claimedItems reads a claim's reply: serial -> deadline.
func claimedItems(t *testing.T, raw any) map[string]int64 {
	t.Helper()
	r, ok := raw.([]any)
	if !ok || len(r) != 7 {
		t.Fatalf("claim reply %v", raw)
	}
	out := map[string]int64{}
	c, _ := r[3].([]any)
	for i := 0; i+3 < len(c); i += 4 {
		out[c[i].(string)] = c[i+1].(int64)
	}
	f, _ := r[6].([]any)
	for i := 0; i+1 < len(f); i += 2 {
		// A fresh entry's deadline is the score as Redis printed it.
		d, err := strconv.ParseInt(f[i+1].(string), 10, 64)
		if err != nil {
			t.Fatalf("fresh deadline %q: %v", f[i+1], err)
		}
		out[f[i].(string)] = d
	}
	return out
}

// laterClaims runs claims (the shipped script) from time at on, each one
// minute after the last with a lease of a day, until one leases nothing,
// and returns what they leased: serial -> deadlines.
func laterClaims(t *testing.T, rdb *redis.Client, k queue.Keys, shipped string, batch bool, at int64) (map[string][]int64, error) {
	t.Helper()
	got := map[string][]int64{}
	for round := range 6 {
		at += 60000
		raw, err := evalHookedClaim(context.Background(), rdb, shipped, k, "", queue.ClaimArgs{Limit: 1000, Lease: 24 * time.Hour,
			Token: fmt.Sprintf("t:after.%d", round), Batch: batch}, at, 0)
		if err != nil {
			return got, err
		}
		items := claimedItems(t, raw)
		if len(items) == 0 {
			break
		}
		for s, d := range items {
			got[s] = append(got[s], d)
		}
	}
	return got, nil
}

// orphanRecords lists the lease records no claim finds: the reconciler
// leaves a serial with a record alone, so nothing ever closes it.
func orphanRecords(t *testing.T, rdb *redis.Client, k queue.Keys) []string {
	t.Helper()
	if err := rdb.HLen(context.Background(), k.Lease).Err(); err != nil {
		t.Fatal(err)
	}
	ks := readKeyState(t, rdb, k)
	recs := make([]string, 0, len(ks.lease))
	for s := range ks.lease {
		recs = append(recs, s)
	}
	sort.Strings(recs)
	var out []string
	for _, s := range recs {
		if s != "\x00" && ks.findable(s) == "" {
			out = append(out, fmt.Sprintf("%q: a lease record no claim finds (%s): the reconciler skips it, nothing closes it", s, leaseState(t, rdb, k, s)))
		}
	}
	return out
}

// recover runs laterClaims from at and lists what they broke: valid
// entries never leased again, a rewritten serial leased at a deadline not
// the producer's, a dead-lettered write leased, orphan records.
func (sc refusalScenario) recover(t *testing.T, rdb *redis.Client, k queue.Keys, shipped string, batch bool, at int64) []string {
	t.Helper()
	got, err := laterClaims(t, rdb, k, shipped, batch, at)
	if err != nil {
		return []string{fmt.Sprintf("claim after the refusal: %v", err)}
	}
	var out []string
	var lost []string
	for _, s := range sc.valid {
		if len(got[s]) == 0 {
			lost = append(lost, s)
		}
	}
	if len(lost) > 0 {
		out = append(out, fmt.Sprintf("never leased again: %v (%s)", lost, leaseState(t, rdb, k, lost[0])))
	}
	for s, x := range sc.rewritten {
		for _, d := range got[s] {
			if sc.buried[s] {
				out = append(out, fmt.Sprintf("%s leased at %d after the producer's write (score %v) was dead-lettered", s, d, x))
			} else if float64(d) != x {
				out = append(out, fmt.Sprintf("%s leased at %d, the producer wrote %v", s, d, x))
			}
		}
	}
	return append(out, orphanRecords(t, rdb, k)...)
}

// reachable says which real refusal fails the claim at call i of log
// (calls before it succeed): an ACL without the command (its first call),
// an ACL selector without the command on that key (its first call on the
// key), or a foreign value of another type at the key (the first call on
// the key that checks the type); otherwise only an injected fault.
func reachable(k queue.Keys, log [][2]string, i int) string {
	cmd, key := log[i][0], log[i][1]
	typed := func(c string) bool { return c != "time" && c != "exists" && c != "object" }
	first, firstOnKey, firstTyped := true, true, typed(cmd)
	for _, c := range log[:i] {
		if c[0] == cmd {
			first = false
			if c[1] == key {
				firstOnKey = false
			}
		}
		if c[1] == key && typed(c[0]) {
			firstTyped = false
		}
	}
	var by []string
	if first {
		by = append(by, "ACL -"+cmd)
	}
	if firstOnKey && !first {
		by = append(by, fmt.Sprintf("ACL selector without %s on %s", cmd, roleOf(k, key)))
	}
	if firstTyped {
		by = append(by, "WRONGTYPE at "+roleOf(k, key))
	}
	if len(by) == 0 {
		return "injected only"
	}
	return strings.Join(by, ", ")
}

// (2) Refusal safety at every call: for each call of the claim in turn,
// the claim fails there (calls before it succeed and their writes stay);
// the state must then keep every entry findable, every malformed one
// queued or dead, every producer's latest write either queued, leased at
// its deadline by this claim, or dead-lettered with no lease left from
// before it; and claims after it must lease every valid entry again,
// rewritten ones only at the producer's deadline.
func TestAdvClaimRefusedAtEveryCallKeepsEveryEntry(t *testing.T) {
	t.Parallel()
	rdb, k0 := testenv.Redis(t)
	ctx := context.Background()
	shipped := hookedClaim(shippedClaimBody(t))
	for _, v := range []struct {
		name   string
		batch  bool
		news   int
		budget int
	}{
		{"batch", true, 20, 0},
		{"batch/300 fresh", true, 300, 0},
		{"per member", false, 20, 0},
		{"per member/byte budget", false, 20, 1 << 20},
	} {
		t.Run(v.name, func(t *testing.T) {
			args := queue.ClaimArgs{Limit: 1000, Lease: time.Millisecond, Token: "t:refused", Batch: v.batch, MaxBytes: v.budget}
			prefix := k0.Queue + ":" + strings.ReplaceAll(v.name, " ", "_")
			logKey := prefix + ":calls"
			// The calls of a claim that is not refused, on the same scenario.
			dry := queue.NewKeys(prefix + ":dry")
			t.Cleanup(func() { testenv.DeleteQueue(rdb, dry); rdb.Del(ctx, logKey) })
			sc := buildRefusalScenario(t, rdb, dry, v.batch, v.news)
			now := queue.DeadlineMillis(time.UnixMilli(int64(dueAt(t, queue.NewStore(rdb, dry), 0))).Add(time.Minute))
			if _, err := evalHookedClaim(ctx, rdb, shipped, dry, logKey, args, now, 0); err != nil {
				t.Fatal(err)
			}
			if bad := sc.checkAfterRefusal(t, rdb, dry, args.Token); len(bad) > 0 {
				t.Fatalf("the claim that is not refused: %v", bad)
			}
			if bad := sc.recover(t, rdb, dry, shipped, v.batch, now+2*time.Hour.Milliseconds()); len(bad) > 0 {
				t.Fatalf("after the claim that is not refused: %v", bad)
			}
			calls := callLog(t, rdb, logKey)
			rdb.Del(ctx, logKey)
			t.Logf("%d calls", len(calls))
			failed := 0
			for i := range calls {
				k := queue.NewKeys(fmt.Sprintf("%s:at%d", prefix, i+1))
				t.Cleanup(func() { testenv.DeleteQueue(rdb, k) })
				sc := buildRefusalScenario(t, rdb, k, v.batch, v.news)
				now := queue.DeadlineMillis(time.UnixMilli(int64(dueAt(t, queue.NewStore(rdb, k), 0))).Add(time.Minute))
				_, err := evalHookedClaim(ctx, rdb, shipped, k, logKey, args, now, i+1)
				log := callLog(t, rdb, logKey)
				rdb.Del(ctx, logKey)
				// A refused pcall (OBJECT) does not end the script.
				if calls[i][0] == "object" {
					if err != nil || len(log) < i+1 {
						t.Fatalf("call %d: refused OBJECT: %d calls, %v", i+1, len(log), err)
					}
					log = log[:i+1]
					err = fmt.Errorf("pcall refused")
				}
				if err == nil || len(log) != i+1 || log[i][0] != calls[i][0] || roleOf(k, log[i][1]) != roleOf(dry, calls[i][1]) {
					t.Fatalf("call %d: refused run made %d calls (last %v), error %v; want it to fail at %v", i+1, len(log), log[len(log)-1], err, calls[i])
				}
				bad := sc.checkAfterRefusal(t, rdb, k, args.Token)
				bad = append(bad, sc.recover(t, rdb, k, shipped, v.batch, now+2*time.Hour.Milliseconds())...)
				if len(bad) > 0 {
					failed++
					t.Errorf("refused at call %d, %s %s (%s):\n    %s", i+1, calls[i][0], roleOf(dry, calls[i][1]), reachable(dry, calls, i), strings.Join(bad, "\n    "))
				}
			}
			t.Logf("%d of %d refusal points broke an invariant", failed, len(calls))
		})
	}
}

// serialsOf lists every serial a state names.
func (s claimState) serialsOf() []string {
	seen := map[string]bool{}
	var out []string
	add := func(m string) {
		if !seen[m] {
			seen[m] = true
			out = append(out, m)
		}
	}
	for _, zs := range [][]redis.Z{s.queue, s.inflight, s.deadlines} {
		for _, z := range zs {
			add(z.Member.(string))
		}
	}
	for _, fv := range s.lease {
		add(fv[0])
	}
	for _, fv := range s.leasebatch {
		if !strings.HasPrefix(fv[0], "#") && !strings.HasPrefix(fv[0], "<") {
			for _, m := range strings.Split(fv[1], "\n") {
				if m != "" {
					add(m)
				}
			}
		}
	}
	sort.Strings(out)
	return out
}

// The same at every call, on random states (randomClaimState: foreign
// writes included), judged against the history without the refusal:
// after a refusal at call i, every valid serial a claim found before is
// still found (or dead-lettered); a serial that left the queue key does
// not keep the lease record it had before; the claims that follow lease
// every serial the history without the refusal leases, and no other;
// and leave no lease record no claim finds that that history does not
// leave. Seed: ORDERDELAY_ADV_SEED; rounds: ORDERDELAY_ADV_ROUNDS
// (default 20).
func TestAdvClaimRefusedAtEveryCallOnRandomStates(t *testing.T) {
	t.Parallel()
	rdb, k0 := testenv.Redis(t)
	ctx := context.Background()
	seed, rounds := advSeedRounds(t, 20, "rounds")
	shipped := hookedClaim(shippedClaimBody(t))
	now := queue.DeadlineMillis(time.UnixMilli(int64(dueAt(t, queue.NewStore(rdb, k0), 0))).Add(time.Minute))
	logKey := k0.Queue + ":calls"
	t.Cleanup(func() { rdb.Del(ctx, logKey) })
	points, broken := 0, 0
	for round := range rounds {
		r := rand.New(rand.NewPCG(seed, uint64(round)))
		state, a := randomClaimState(r, now, r.IntN(10) == 0, false)
		if state.paused {
			continue
		}
		a.Lease = time.Millisecond
		ka := queue.NewKeys(fmt.Sprintf("%s:r%d", k0.Queue, round))
		t.Cleanup(func() { testenv.DeleteQueue(rdb, ka) })
		state.write(t, rdb, ka)
		serials := state.serialsOf()
		before := map[string]bool{}
		recBefore := map[string]string{}
		ksBefore := readKeyState(t, rdb, ka)
		trustBefore := batchesOf(t, rdb, ka)
		for _, s := range serials {
			if queue.ValidateSerial(s) == nil && ksBefore.findable(s) != "" {
				before[s] = true
			}
			if rdb.ZScore(ctx, ka.Queue, s).Err() == nil {
				if rec, err := rdb.HGet(ctx, ka.Lease, s).Result(); err == nil {
					recBefore[s] = rec
				}
			}
		}
		rdb.Del(ctx, logKey)
		raw, err := evalHookedClaim(ctx, rdb, shipped, ka, logKey, a, now, 0)
		if err != nil {
			continue // a Lua error on a foreign record: no history to judge by
		}
		calls := callLog(t, rdb, logKey)
		// keptA: what the claim left findable (or dead-lettered) when
		// nothing was refused. A state a foreign write made (a batch's
		// count below its carrying members) can make even that claim drop
		// a batch that still holds a member; a refusal must lose nothing
		// more.
		keptA := map[string]bool{}
		ksA := readKeyState(t, rdb, ka)
		for s := range before {
			_, dead := ksA.dead[s]
			keptA[s] = ksA.findable(s) != "" || dead
		}
		leasedA, err := laterClaims(t, rdb, ka, shipped, a.Batch, now+2*time.Hour.Milliseconds())
		if err != nil {
			continue
		}
		for s, d := range claimedItems(t, raw) {
			leasedA[s] = append(leasedA[s], d)
		}
		orphansA := map[string]bool{}
		for _, o := range orphanRecords(t, rdb, ka) {
			orphansA[strings.SplitN(o, ":", 2)[0]] = true
		}
		for i := range calls {
			if calls[i][0] == "object" || calls[i][0] == "time" {
				continue
			}
			points++
			kb := queue.NewKeys(fmt.Sprintf("%s:r%d:at%d", k0.Queue, round, i+1))
			state.write(t, rdb, kb)
			if _, err := evalHookedClaim(ctx, rdb, shipped, kb, "", a, now, i+1); err == nil {
				t.Fatalf("round %d: the run refused at call %d (%v) did not fail", round, i+1, calls[i])
			}
			var bad []string
			bad = append(bad, trustBroken(trustBefore, batchesOf(t, rdb, kb))...)
			ksB := readKeyState(t, rdb, kb)
			for s := range before {
				if _, dead := ksB.dead[s]; keptA[s] && ksB.findable(s) == "" && !dead {
					bad = append(bad, fmt.Sprintf("%q: found before the claim, in no place a claim looks after (%s)", s, leaseState(t, rdb, kb, s)))
				}
			}
			for s, rec := range recBefore {
				if rdb.ZScore(ctx, kb.Queue, s).Err() != nil {
					if now, err := rdb.HGet(ctx, kb.Lease, s).Result(); err == nil && now == rec {
						bad = append(bad, fmt.Sprintf("%q left the queue key (dead: %v) and keeps the lease record from before the producer's write: %q",
							s, rdb.ZScore(ctx, kb.Dead, s).Err() == nil, rec))
					}
				}
			}
			// The histories after it are compared only from states the
			// scripts leave: from a foreign one (a batch's count below its
			// members), the claims after drop batches that hold members,
			// refused or not, and which ones depends on where they start.
			consistent := countsConsistent(state)
			leasedB, err := laterClaims(t, rdb, kb, shipped, a.Batch, now+2*time.Hour.Milliseconds())
			if err != nil {
				bad = append(bad, fmt.Sprintf("claims after the refusal: %v", err))
			}
			if !consistent {
				leasedA, leasedB = nil, nil
			}
			for s := range leasedA {
				if queue.ValidateSerial(s) == nil && len(leasedB[s]) == 0 {
					bad = append(bad, fmt.Sprintf("%q: leased without the refusal, never after it (%s)", s, leaseState(t, rdb, kb, s)))
				}
			}
			for s, ds := range leasedB {
				if queue.ValidateSerial(s) == nil && len(leasedA[s]) == 0 {
					bad = append(bad, fmt.Sprintf("%q: leased at %v after the refusal, never without it", s, ds))
				}
			}
			for _, o := range orphanRecords(t, rdb, kb) {
				if consistent && !orphansA[strings.SplitN(o, ":", 2)[0]] {
					bad = append(bad, o)
				}
			}
			if len(bad) > 0 {
				broken++
				t.Errorf("round %d (%+v), refused at call %d, %s %s (%s):\n    %s", round, a, i+1, calls[i][0], roleOf(ka, calls[i][1]),
					reachable(ka, calls, i), strings.Join(bad, "\n    "))
			}
			testenv.DeleteQueue(rdb, kb)
		}
		testenv.DeleteQueue(rdb, ka)
	}
	t.Logf("%d refusal points, %d broke an invariant", points, broken)
}

// aclClaimer is a private Redis with a user "claimer" whose ACL the test
// changes, and a store of queue key name for the admin and the claimer.
func aclClaimer(t *testing.T, name string) (admin *redis.Client, k queue.Keys, st, claimer *queue.Store, acl func(rules ...string)) {
	t.Helper()
	admin, addr := testenv.PrivateRedis(t) // its ACL is changed below
	c := redis.NewClient(&redis.Options{Addr: addr, Username: "claimer", Password: "pw"})
	t.Cleanup(func() { c.Close() })
	acl = func(rules ...string) {
		t.Helper()
		args := []any{"ACL", "SETUSER", "claimer", "reset", "on", ">pw", "~*", "&*", "+@all"}
		for _, r := range rules {
			args = append(args, r)
		}
		if err := admin.Do(context.Background(), args...).Err(); err != nil {
			t.Fatal(err)
		}
	}
	acl()
	k = queue.NewKeys(name)
	return admin, k, queue.NewStore(admin, k), queue.NewStore(c, k), acl
}

// A claim refused after its lease records and before its last removal
// (ZREM refused: step 1's members stay in {Q}:inflight, expired, their
// records carrying the refused claim's token, beside its batch) leaves an
// entry whose batch count is taken again by every later claim that
// re-takes it and fails before writing its own records. While the ACL
// stays tightened the daemon keeps claiming (refused, backing off); a
// producer reschedules one backing-off order, so each retry fails in
// step 1 (dropping that order's stale backoff needs ZREM) after taking
// one from the refused claim's count for each of its step-1 members. The
// count reaches 0 while the batch still holds the fresh entries the
// refused claim removed from the queue key; the first claim once the ACL
// is mended drops the batch: those entries are in no place a claim
// looks, and their lease records make the reconciler leave them alone.
//
//  1. BO-0..BO-3, BO-R: backoffs that are over (Retry); N-0..N-2 due.
//  2. ACL -zrem. Claim t:2 leases all 8 as one batch, writes its records,
//     removes N-* from the queue key (ZREMRANGEBYRANK), and is refused at
//     the ZREM of BO-* from {Q}:inflight. Every entry is still findable.
//  3. The producer reschedules BO-R (ZADD, due).
//  4. Two more claims, refused: each takes 5 from #t:2 (4 re-leased BO-*
//     and the stale BO-R), then ZREM is refused: #t:2 = 8-5-5 < 0, and
//     the second's ZREM of t:2 from {Q}:leases is refused too.
//  5. ACL mended. The next claim's step 1 takes 1 more: ≤ 0, so t:2's
//     entry in {Q}:leases and its list go. N-0..N-2 are lost.
func TestAdvClaimRefusedZremRetriedLosesTheFreshEntriesOfItsBatch(t *testing.T) {
	admin, k, st, claimer, acl := aclClaimer(t, "adv:f1")
	ctx := context.Background()
	base := dueAt(t, st, 0)
	bo := []string{"BO-0", "BO-1", "BO-2", "BO-3", "BO-R"}
	for i, s := range bo {
		admin.ZAdd(ctx, k.Queue, redis.Z{Score: base + float64(i), Member: s})
	}
	if r, err := st.Claim(ctx, queue.ClaimArgs{Limit: 10, Lease: time.Hour, Token: "t:1", Batch: true}); err != nil || len(r.Items) != 5 {
		t.Fatalf("claim t:1: %+v, %v", r, err)
	}
	r, err := st.Retry(ctx, queue.RetryArgs{Token: "t:1", Serials: bo, Delay: time.Millisecond, LastError: "db down"})
	if err != nil || r.Moved != 5 {
		t.Fatalf("retry: %+v, %v", r, err)
	}
	waitRedisPast(t, st, r.At)
	fresh := []string{"N-0", "N-1", "N-2"}
	for i, s := range fresh {
		admin.ZAdd(ctx, k.Queue, redis.Z{Score: base + 10 + float64(i), Member: s})
	}
	all := append(append([]string{}, bo...), fresh...)

	acl("-zrem")
	_, err = claimer.Claim(ctx, queue.ClaimArgs{Limit: 100, Lease: time.Hour, Token: "t:2", Batch: true})
	t.Logf("claim t:2, ZREM refused: %v", err)
	if err == nil {
		t.Fatal("claim t:2 was not refused")
	}
	for _, s := range all {
		if findable(t, admin, k, s) == "" {
			t.Fatalf("%s lost at once (%s): not the case this test is about", s, leaseState(t, admin, k, s))
		}
	}
	admin.ZAdd(ctx, k.Queue, redis.Z{Score: base + 20, Member: "BO-R"}) // the producer reschedules it
	for i := range 2 {
		_, err := claimer.Claim(ctx, queue.ClaimArgs{Limit: 100, Lease: time.Hour, Token: fmt.Sprintf("t:3.%d", i), Batch: true})
		n, _ := admin.HGet(ctx, k.LeaseBatch, "#t:2").Result()
		t.Logf("retry %d, still refused: %v; #t:2 = %s", i, err, n)
	}
	acl()
	res, err := st.Claim(ctx, queue.ClaimArgs{Limit: 100, Lease: time.Millisecond, Token: "t:4", Batch: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("claim t:4, ACL mended: %d items", len(res.Items))
	got := map[string]bool{}
	for _, it := range res.Items {
		got[it.Serial] = true
	}
	for _, s := range all {
		if got[s] {
			continue
		}
		if where := findable(t, admin, k, s); where == "" {
			held, _ := st.InQueue(ctx, []string{s})
			t.Errorf("%s: in no place a claim looks (%s); InQueue %v: the reconciler leaves it alone", s, leaseState(t, admin, k, s), held)
		}
	}
}

// A buried queue entry is the producer's latest write: the claim drops
// the lease from before it (the holder's fence sees its token gone). The
// reorder removes the buried entry from the queue key (ZREMRANGEBYRANK,
// or the ZREM of far scores) before it drops that lease, so a claim
// refused in between keeps the old lease of a serial whose latest write
// is dead-lettered and no longer in the queue key: the holder's fence
// accepts it and closes the order at the old deadline; if the holder
// dies, the next claim re-takes it from the expired batch at the old
// deadline. With the far score the fence even dropped it before the
// refused claim ran (the queue key held a deadline not yet due).
//
// Each refusal is the first command of its name in the claim (an ACL
// without it), or a foreign string at {Q}:deadlines (WRONGTYPE).
func TestAdvClaimRefusedAfterBuryKeepsTheOldLease(t *testing.T) {
	far := float64(queue.DeadlineMillis(time.Now().AddDate(20, 0, 0)))
	for _, tc := range []struct {
		refuse string // an ACL rule, or "wrongtype"
		score  float64
	}{
		{"-hexists", 1.5e9}, {"-hincrby", 1.5e9}, {"-zrem", 1.5e9}, {"-hdel", 1.5e9}, {"wrongtype", 1.5e9},
		{"-hexists", far}, {"-hdel", far}, {"wrongtype", far},
	} {
		t.Run(fmt.Sprintf("%s/score=%.0f", tc.refuse, tc.score), func(t *testing.T) {
			admin, k, st, claimer, acl := aclClaimer(t, "adv:f2")
			ctx := context.Background()
			base := dueAt(t, st, 0)
			admin.ZAdd(ctx, k.Queue, redis.Z{Score: base, Member: "L-0"}, redis.Z{Score: base + 1, Member: "L-1"})
			held, err := st.Claim(ctx, queue.ClaimArgs{Limit: 10, Lease: time.Hour, Token: "t:1", Batch: true})
			if err != nil || len(held.Items) != 2 {
				t.Fatalf("claim t:1: %+v, %v", held, err)
			}
			// The producer writes L-0 again with a score the claim
			// dead-letters; fresh entries are due beside it.
			admin.ZAdd(ctx, k.Queue, redis.Z{Score: tc.score, Member: "L-0"},
				redis.Z{Score: base + 2, Member: "F-0"}, redis.Z{Score: base + 3, Member: "F-1"})
			drop, err := st.Fence(ctx, "t:1", 0, []string{"L-0"})
			t.Logf("t:1's fence before the refused claim drops %v (%v)", drop, err)
			if tc.refuse == "wrongtype" {
				admin.Set(ctx, k.Deadlines, "a foreign value", 0)
			} else {
				acl(tc.refuse)
			}
			_, err = claimer.Claim(ctx, queue.ClaimArgs{Limit: 100, Lease: time.Millisecond, Token: "t:2", Batch: true})
			t.Logf("refused claim: %v", err)
			if err == nil {
				t.Fatal("the claim was not refused")
			}
			acl()
			admin.Del(ctx, k.Deadlines)
			inQueue := admin.ZScore(ctx, k.Queue, "L-0").Err() == nil
			rec, _ := admin.HGet(ctx, k.Lease, "L-0").Result()
			t.Logf("L-0: in the queue key %v, dead-lettered %v, record %q", inQueue, admin.ZScore(ctx, k.Dead, "L-0").Err() == nil, rec)
			if !inQueue {
				drop, err := st.Fence(ctx, "t:1", 0, []string{"L-0"})
				if err != nil {
					t.Fatal(err)
				}
				if !slices.Contains(drop, "L-0") {
					t.Errorf("t:1's fence accepts L-0 after its latest write (score %.0f) was dead-lettered: the order is closed at its old deadline", tc.score)
				}
				// The holder dies: its batch expires (moved, not waited for).
				admin.ZAdd(ctx, k.Leases, redis.Z{Score: 1, Member: "t:1"})
				res, err := st.Claim(ctx, queue.ClaimArgs{Limit: 100, Lease: time.Minute, Token: "t:3", Batch: true})
				if err != nil {
					t.Fatal(err)
				}
				for _, it := range res.Items {
					if it.Serial == "L-0" {
						t.Errorf("L-0 re-claimed at its old deadline %d after its latest write was dead-lettered", it.Deadline)
					}
				}
			}
		})
	}
}

// keyState.findable (one read of the keys) answers as findable (a round
// trip per key) for every serial of random states, foreign writes
// included, before and after a claim: the refusal checks above read the
// keys once per point through it.
func TestKeyStateFindableAgreesWithFindable(t *testing.T) {
	t.Parallel()
	rdb, k0 := testenv.Redis(t)
	ctx := context.Background()
	seed, rounds := advSeedRounds(t, 20, "rounds")
	shipped := hookedClaim(shippedClaimBody(t))
	now := queue.DeadlineMillis(time.UnixMilli(int64(dueAt(t, queue.NewStore(rdb, k0), 0))).Add(time.Minute))
	compared, found := 0, 0
	for round := range rounds {
		r := rand.New(rand.NewPCG(seed, uint64(round)))
		state, a := randomClaimState(r, now, r.IntN(10) == 0, false)
		k := queue.NewKeys(fmt.Sprintf("%s:r%d", k0.Queue, round))
		t.Cleanup(func() { testenv.DeleteQueue(rdb, k) })
		state.write(t, rdb, k)
		for pass := range 2 {
			ks := readKeyState(t, rdb, k)
			for _, s := range state.serialsOf() {
				want := findable(t, rdb, k, s)
				if got := ks.findable(s); got != want {
					t.Fatalf("round %d, pass %d: %q: keyState says %q, findable %q", round, pass, s, got, want)
				}
				_, dead := ks.dead[s]
				if wantDead := rdb.ZScore(ctx, k.Dead, s).Err() == nil; dead != wantDead {
					t.Fatalf("round %d, pass %d: %q: keyState dead %v, ZSCORE %v", round, pass, s, dead, wantDead)
				}
				compared++
				if want != "" {
					found++
				}
			}
			if pass == 0 {
				evalHookedClaim(ctx, rdb, shipped, k, "", a, now, 0) //nolint:errcheck // a foreign record may fail it: the state is compared either way
			}
		}
	}
	if found == 0 || found == compared {
		t.Fatalf("%d of %d serials findable: the states do not tell the two apart", found, compared)
	}
	t.Logf("%d serials compared, %d findable", compared, found)
}
