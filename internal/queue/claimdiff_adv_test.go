package queue_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"reflect"
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

// claimState is a queue's keys as a test writes them, field by field in
// order (a listpack keeps the order fields were written in).
type claimState struct {
	queue, inflight, deadlines, leases, dead []redis.Z
	lease, leasebatch, deadinfo, payload     [][2]string
	paused                                   bool
}

func (s claimState) write(t testing.TB, rdb *redis.Client, k queue.Keys) {
	t.Helper()
	ctx := context.Background()
	p := rdb.TxPipeline()
	for _, z := range [][2]any{{k.Queue, s.queue}, {k.Inflight, s.inflight}, {k.Deadlines, s.deadlines}, {k.Leases, s.leases}, {k.Dead, s.dead}} {
		if zs := z[1].([]redis.Z); len(zs) > 0 {
			p.ZAdd(ctx, z[0].(string), zs...)
		}
	}
	for _, h := range [][2]any{{k.Lease, s.lease}, {k.LeaseBatch, s.leasebatch}, {k.DeadInfo, s.deadinfo}, {k.Payload, s.payload}} {
		for _, fv := range h[1].([][2]string) {
			p.HSet(ctx, h[0].(string), fv[0], fv[1])
		}
	}
	if s.paused {
		p.Set(ctx, k.Paused, "1|adv", 0)
	}
	if _, err := p.Exec(ctx); err != nil {
		t.Fatal(err)
	}
}

// randomClaimState makes a state with every path of the claim, and the
// odd ones foreign writes can make: serials in the queue key and leased
// (in a batch, per member, both), duplicate members in a batch's list,
// members that left their batch, counts that do not match the lists,
// batches with no list or no expiry, malformed members and scores,
// records of every token kind. big states hold about 128 lease records,
// where the claim changes the lease hash's form.
func randomClaimState(r *rand.Rand, now int64, big, collide bool) (claimState, queue.ClaimArgs) {
	var st claimState
	a := queue.ClaimArgs{
		Limit: 1 + r.IntN(10), Lease: time.Duration(1+r.IntN(60000)) * time.Millisecond,
		Token: "c:new", CountRedeliveries: r.IntN(2) == 0, Batch: r.IntN(10) < 7,
	}
	if r.IntN(5) == 0 {
		a.Limit = 1000
	}
	if r.IntN(3) == 0 {
		a.CloseDelay = time.Duration(r.IntN(2000)) * time.Millisecond
	}
	if r.IntN(4) == 0 {
		a.MaxBytes, a.Overhead = 1+r.IntN(300), r.IntN(20)
	}
	st.paused = r.IntN(40) == 0
	ft := func(ms int64) float64 { return float64(ms) }
	toks := []string{"-", "p:1", "p:2"}
	nb := r.IntN(4)
	for i := range nb {
		toks = append(toks, fmt.Sprintf("b:%d", i))
	}
	if big {
		toks = append(toks, "b:live")
	}
	tok := func() string {
		if collide && r.IntN(60) == 0 {
			return a.Token // the claim's own token: no daemon's state (tokens are unique per claim)
		}
		return toks[r.IntN(len(toks))]
	}
	ns := 1 + r.IntN(14)
	var serials []string
	for i := range ns {
		s := fmt.Sprintf("S%02d", i)
		switch r.IntN(16) {
		case 0:
			s = ""
		case 1:
			s = "bad\x01" + strconv.Itoa(i)
		case 2:
			s = strings.Repeat("a", 129) + strconv.Itoa(i)
		case 3:
			s = "订单-" + strconv.Itoa(i)
		}
		if !slices.Contains(serials, s) {
			serials = append(serials, s)
		}
	}
	recTok := map[string]string{}
	addRec := func(s string, d string, t string) {
		recTok[s] = t
		st.lease = append(st.lease, [2]string{s, d + "|" + strconv.Itoa(r.IntN(3)) + "|" + t + "|" + []string{"", "e", "x/y"}[r.IntN(3)]})
	}
	for _, s := range serials {
		if r.IntN(2) == 0 {
			var sc float64
			switch r.IntN(12) {
			case 0:
				sc = ft(now + 3600000)
			case 1:
				sc = ft(now + queue.MaxAhead.Milliseconds() + 86400000)
			case 2:
				sc = 1.5e9 // seconds, not ms
			case 3:
				sc = ft(now-500) + 0.5
			case 4:
				sc = math.Inf(-1)
			case 5:
				sc = math.Inf(1)
			default:
				sc = ft(now - 1000 - int64(r.IntN(3)))
			}
			st.queue = append(st.queue, redis.Z{Score: sc, Member: s})
		}
		if r.IntN(5) < 2 {
			d := strconv.FormatInt(now-int64(r.IntN(100000)), 10)
			switch r.IntN(25) {
			case 0:
				st.lease = append(st.lease, [2]string{s, "garbage"})
			case 1:
				addRec(s, "x", tok())
			default:
				addRec(s, d, tok())
			}
		}
		if r.IntN(4) == 0 {
			exp := now - int64(r.IntN(1000))
			if r.IntN(3) == 0 {
				exp = now + 100000
			}
			st.inflight = append(st.inflight, redis.Z{Score: ft(exp), Member: s})
			if r.IntN(3) > 0 {
				st.deadlines = append(st.deadlines, redis.Z{Score: ft(now - int64(r.IntN(100000))), Member: s})
			}
		}
		if a.MaxBytes > 0 && r.IntN(2) == 0 {
			st.payload = append(st.payload, [2]string{s, strings.Repeat("p", r.IntN(100))})
		}
		if r.IntN(10) == 0 {
			st.dead = append(st.dead, redis.Z{Score: ft(now - 5000), Member: s})
			st.deadinfo = append(st.deadinfo, [2]string{s, "not_found|3|" + strconv.FormatInt(now-9000, 10) + "|"})
		}
	}
	var batches []string
	for i := range nb {
		batches = append(batches, fmt.Sprintf("b:%d", i))
	}
	if big {
		// About 128 records held by a live batch, and serials of it a
		// producer buried since: the lease hash's form change is decided
		// by how many records the hash holds.
		held := 100 + r.IntN(40)
		var list []string
		for i := range held {
			s := fmt.Sprintf("H%03d", i)
			list = append(list, s)
			st.lease = append(st.lease, [2]string{s, strconv.FormatInt(now-100, 10) + "|0|b:live|"})
			if i < 1+r.IntN(12) {
				st.queue = append(st.queue, redis.Z{Score: 1.5e9, Member: s})
			}
		}
		for i := range r.IntN(40) {
			st.queue = append(st.queue, redis.Z{Score: ft(now - 2000 - int64(i)), Member: fmt.Sprintf("F%03d", i)})
		}
		st.leases = append(st.leases, redis.Z{Score: ft(now + 60000), Member: "b:live"})
		st.leasebatch = append(st.leasebatch, [2]string{"b:live", strings.Join(list, "\n")}, [2]string{"#b:live", strconv.Itoa(held)})
		a.Limit = 1000
	}
	for _, t := range batches {
		var list []string
		carrying := 0
		for range r.IntN(7) {
			s := serials[r.IntN(len(serials))]
			if s == "" {
				continue
			}
			if _, ok := recTok[s]; !ok || r.IntN(3) == 0 {
				addRec(s, strconv.FormatInt(now-int64(r.IntN(100000)), 10), t)
			}
			list = append(list, s)
			if recTok[s] == t {
				carrying++
			}
		}
		if r.IntN(8) > 0 {
			exp := now - 1 - int64(r.IntN(1000))
			if r.IntN(3) == 0 {
				exp = now + 100000
			}
			st.leases = append(st.leases, redis.Z{Score: ft(exp), Member: t})
		}
		if r.IntN(10) > 0 {
			st.leasebatch = append(st.leasebatch, [2]string{t, strings.Join(list, "\n")})
		}
		switch r.IntN(6) {
		case 0: // no count
		case 1:
			st.leasebatch = append(st.leasebatch, [2]string{"#" + t, strconv.Itoa(r.IntN(5))})
		default:
			st.leasebatch = append(st.leasebatch, [2]string{"#" + t, strconv.Itoa(carrying)})
		}
		if r.IntN(5) > 0 {
			st.leasebatch = append(st.leasebatch, [2]string{"<" + t, strconv.FormatInt(now-100000, 10)})
		}
	}
	return st, a
}

// countsConsistent reports whether every batch of st is as the scripts
// keep it: a list without repeats, an expiry, and a count equal to the
// members of its list whose records carry its token, with every record
// that carries it in its list. Only there must the claim before the
// reorder and the one that ships agree exactly: where a foreign write
// left a count too low, the old claim's early release dropped a batch
// that still held members (lost), and the new one, which takes counts
// down only after the records are written, leases them instead.
func countsConsistent(st claimState) bool {
	rec := map[string]string{}
	for _, fv := range st.lease {
		rec[fv[0]] = fv[1]
	}
	tokOf := func(r string) string {
		parts := strings.SplitN(r, "|", 4)
		if len(parts) < 3 {
			return ""
		}
		return parts[2]
	}
	fields := map[string]string{}
	for _, fv := range st.leasebatch {
		fields[fv[0]] = fv[1]
	}
	expiry := map[string]bool{}
	for _, z := range st.leases {
		expiry[z.Member.(string)] = true
	}
	toks := map[string]bool{}
	for t := range expiry {
		toks[t] = true
	}
	for f := range fields {
		toks[strings.TrimLeft(f, "#<")] = true
	}
	for _, r := range rec {
		if t := tokOf(r); strings.HasPrefix(t, "b:") {
			toks[t] = true
		}
	}
	for t := range toks {
		list, ok := fields[t]
		if !ok || !expiry[t] {
			return false
		}
		seen := map[string]bool{}
		carrying := 0
		for _, m := range strings.Split(list, "\n") {
			if m == "" {
				continue
			}
			if seen[m] {
				return false
			}
			seen[m] = true
			if tokOf(rec[m]) == t {
				carrying++
			}
		}
		if fields["#"+t] != strconv.Itoa(carrying) {
			return false
		}
		for s, r := range rec {
			if tokOf(r) == t && !seen[s] {
				return false
			}
		}
	}
	return true
}

// queueKeyDiff lists how two dumps of the queue keys differ (keyDiff).
func queueKeyDiff(a, b map[string]keyDump) []string {
	return keyDiff(queueKeyNames(queue.Keys{}), a, b)
}

func pairsMap(h []string) map[string]string {
	m := map[string]string{}
	for i := 0; i+1 < len(h); i += 2 {
		m[h[i]] = h[i+1]
	}
	return m
}

func sortedPairs(m map[string]string) []string {
	var out []string
	for f, v := range m {
		out = append(out, f+"="+v)
	}
	sort.Strings(out)
	return out
}

// (1) No-failure equivalence: the claim before the reorder and the one
// that ships, run on identical random states (two key prefixes, one clock
// answered to both), must end in identical keys — content, encoding and,
// for listpacks, field order — and identical replies. A state where
// either copy fails (a Lua error a foreign record provokes) must fail in
// both, but for the one the new claim fixed (489861f): an expired batch's
// member whose record has no numeric deadline, which the new claim
// dead-letters as malformed. Seed: ORDERDELAY_ADV_SEED (decimal) to replay; rounds:
// ORDERDELAY_ADV_ROUNDS (default 400).
func TestAdvClaimReorderMatchesTheOldScriptWithoutFailures(t *testing.T) {
	t.Parallel()
	rdb, k0 := testenv.Redis(t)
	ctx := context.Background()
	seed, rounds := advSeedRounds(t, 400, "rounds")
	collide := os.Getenv("ORDERDELAY_ADV_COLLIDE") == "1"
	before, after := hookedClaim(claimBodyBeforeReorder(t)), hookedClaim(shippedClaimBody(t))
	st := queue.NewStore(rdb, k0)
	now0, err := st.Now(ctx)
	if err != nil {
		t.Fatal(err)
	}
	now := queue.DeadlineMillis(now0)
	kinds := map[string]int{}
	var errs, diffs, benign, converted, callsBefore, callsAfter, inconsistent int
	// covered counts the rounds that sent each command: hget is step
	// 1b (expired batches), hincrby a release of a batch's count, hstrlen
	// a byte budget, zremrangebyrank step 2, zscore step 1 without a
	// record.
	covered := map[string]int{}
	for round := range rounds {
		r := rand.New(rand.NewPCG(seed, uint64(round)))
		state, a := randomClaimState(r, now, r.IntN(8) == 0, collide)
		ka, kb := queue.NewKeys(k0.Queue+":before"), queue.NewKeys(k0.Queue+":after")
		testenv.DeleteQueue(rdb, ka)
		testenv.DeleteQueue(rdb, kb)
		state.write(t, rdb, ka)
		state.write(t, rdb, kb)
		la, lb := ka.Queue+":calls", kb.Queue+":calls"
		rdb.Del(ctx, la, lb)
		ra, ea := evalHookedClaim(ctx, rdb, before, ka, la, a, now, 0)
		rb, eb := evalHookedClaim(ctx, rdb, after, kb, lb, a, now, 0)
		ra, rb = freshDeadlinesAsInts(t, ra), freshDeadlinesAsInts(t, rb)
		if !countsConsistent(state) {
			// A state only a foreign write makes: the new claim must keep
			// findable (or dead-lettered) every serial the old one did.
			rdb.Del(ctx, la, lb)
			inconsistent++
			if eb != nil {
				if ea == nil {
					t.Errorf("round %d (%+v): fails after the reorder (%v), not before", round, a, eb)
				}
				testenv.DeleteQueue(rdb, ka)
				testenv.DeleteQueue(rdb, kb)
				continue
			}
			for _, m := range state.serialsOf() {
				kept := func(k queue.Keys) bool {
					return findable(t, rdb, k, m) != "" || rdb.ZScore(ctx, k.Dead, m).Err() == nil
				}
				if ea == nil && kept(ka) && !kept(kb) {
					if countTooLow(state, m) {
						// Its batch counted fewer members than carry its
						// token: a release of another member drops it, in
						// either copy; which one the bounded reads reach
						// first decides which copy loses which member.
						kinds["lost after, kept before: a member of a batch whose count is too low"]++
						continue
					}
					t.Errorf("round %d (%+v): %q kept before the reorder, lost after", round, a, m)
				}
			}
			testenv.DeleteQueue(rdb, ka)
			testenv.DeleteQueue(rdb, kb)
			continue
		}
		// (3) Cost: no more writes than before (but for the lease hash's
		// change of form: HSET "\0", HDEL "\0", decided on its length
		// before the buried serials' records are deleted), and at most one
		// expired batch read more (HGET, HMGET, ZMSCORE: a batch step 1's
		// re-leases empty, which the old claim dropped before step 1b
		// looked and the new one drops in step 1b; a release fewer).
		// ZSCOREs are bounded apart: step 1b asks where a listed member
		// whose record does not carry the batch's token is held, at most
		// twice per name.
		ca, cb := commandCounts(t, rdb, la, ka), commandCounts(t, rdb, lb, kb)
		rdb.Del(ctx, la, lb)
		// Members of expired batches whose records name no holder a claim
		// reads (a per-member token or a backoff with no inflight entry:
		// only a foreign write leaves one): the old claim left their
		// records where no claim finds them, the new one dead-letters them
		// as malformed. Their records were read with up to two ZSCOREs
		// each, and their burial costs up to five writes; once ka is given
		// the same dead letters, the rest must agree exactly.
		var noHolder []string
		if ea == nil && eb == nil {
			noHolder = buriedNoHolder(t, rdb, ka, kb, state, now)
		}
		if ea == nil && eb == nil {
			if extra := cb["zscore"] - ca["zscore"]; extra > 2*listedNames(state) {
				t.Errorf("round %d (%+v): %d ZSCOREs more than before the reorder, for %d listed names", round, a, extra, listedNames(state))
			}
			slack := 0
			if len(noHolder) > 0 {
				slack = 5
				kinds["new dead-letters a listed member whose record names no holder a claim reads"]++
			}
			writes := func(c map[string]int) int {
				return c["hset"] + c["hdel"] + c["zadd"] + c["zrem"] + c["zremrangebyrank"] + c["hincrby"]
			}
			total := func(c map[string]int) int {
				n := 0
				for _, v := range c {
					n += v
				}
				return n
			}
			if writes(cb) > writes(ca)+2+slack || total(cb)-cb["zscore"] > total(ca)-ca["zscore"]+3+slack {
				t.Errorf("round %d (%+v): commands %v before, %v after the reorder", round, a, ca, cb)
			}
			if writes(cb) > writes(ca)+slack {
				converted++
			}
		}
		for c, n := range ca {
			callsBefore += n
			covered[c]++
		}
		for _, n := range cb {
			callsAfter += n
		}
		if ea != nil && eb == nil && strings.Contains(ea.Error(), "attempt to concatenate local 'd' (a nil value)") {
			// 489861f: a member of an expired batch whose record has no
			// numeric deadline made every old claim fail; the new one
			// dead-letters it as malformed instead.
			if !deadAs(rb, queue.ReasonMalformed) {
				t.Errorf("round %d (%+v): the old claim failed on a record with no deadline (%v), the new one dead-lettered nothing as malformed: %v", round, a, ea, rb)
			}
			kinds["old failed on a record with no deadline, new dead-letters it"]++
			testenv.DeleteQueue(rdb, ka)
			testenv.DeleteQueue(rdb, kb)
			continue
		}
		if (ea == nil) != (eb == nil) {
			t.Errorf("round %d (%+v): error before %v, after %v", round, a, ea, eb)
			continue
		}
		if ea != nil {
			t.Logf("round %d: both copies fail: %v", round, eb)
			errs++
			kinds["both failed (Lua error on a foreign state)"]++
			continue
		}
		rb = withoutDead(rb, noHolder)
		if !reflect.DeepEqual(ra, rb) {
			t.Errorf("round %d (%+v): reply before %v, after %v", round, a, ra, rb)
		}
		unmark(t, rdb, kb)
		if d := queueKeyDiff(dumpQueueKeys(t, rdb, ka), dumpQueueKeys(t, rdb, kb)); len(d) > 0 {
			real := false
			for _, line := range d {
				kind := strings.Fields(strings.SplitN(line, ":", 2)[1])[0]
				kinds[strings.SplitN(line, ":", 2)[0]+": "+kind]++
				real = real || (kind != "encoding" && kind != "same")
			}
			if !real {
				// The same keys and content, in another encoding (a hash
				// the old order emptied, and so deleted, before the new
				// fields were written, or the lease hash's conversion
				// decided before the buried records are deleted) or with
				// a listpack's fields in another order: no reader sees it.
				benign++
				testenv.DeleteQueue(rdb, ka)
				testenv.DeleteQueue(rdb, kb)
				continue
			}
			diffs++
			for i := range d {
				if len(d[i]) > 600 {
					d[i] = d[i][:600] + "…"
				}
			}
			t.Errorf("round %d (%+v): state differs:\n  %s", round, a, strings.Join(d, "\n  "))
		}
		testenv.DeleteQueue(rdb, ka)
		testenv.DeleteQueue(rdb, kb)
	}
	t.Logf("%d rounds (%d of states with counts no script leaves, compared on what they keep): %d with both copies failing, %d with a difference in content, %d in encoding or field order only (%v), %d converting the lease hash where the old order did not (2 commands more); %d commands before the reorder, %d after",
		rounds, inconsistent, errs, diffs, benign, kinds, converted, callsBefore, callsAfter)
	t.Logf("rounds that sent each command: %v", covered)
}

// buriedNoHolder lists the serials the claim after the reorder (on kb)
// dead-lettered as malformed that the one before (on ka) left with a
// record no claim finds, and gives them the same dead letters on ka.
func buriedNoHolder(t *testing.T, rdb *redis.Client, ka, kb queue.Keys, st claimState, now int64) []string {
	t.Helper()
	ctx := context.Background()
	var out []string
	for _, m := range st.serialsOf() {
		info, err := rdb.HGet(ctx, kb.DeadInfo, m).Result()
		if err != nil || !strings.HasPrefix(info, queue.ReasonMalformed+"|") || rdb.HExists(ctx, kb.Lease, m).Val() {
			continue
		}
		rec, err := rdb.HGet(ctx, ka.Lease, m).Result()
		if err != nil || findable(t, rdb, ka, m) != "" || rdb.HGet(ctx, ka.DeadInfo, m).Val() == info {
			continue
		}
		if want := queue.ReasonMalformed + "|0|" + strings.SplitN(rec, "|", 2)[0] + "|"; info != want {
			t.Errorf("%q dead-lettered with %q, want %q (its record was %q)", m, info, want, rec)
		}
		rdb.ZAdd(ctx, ka.Dead, redis.Z{Score: float64(now), Member: m})
		rdb.HSet(ctx, ka.DeadInfo, m, info)
		rdb.HDel(ctx, ka.Lease, m)
		out = append(out, m)
	}
	return out
}

// withoutDead is a claim's raw reply without the dead letters of serials.
func withoutDead(raw any, serials []string) any {
	r, ok := raw.([]any)
	if len(serials) == 0 || !ok || len(r) < 5 {
		return raw
	}
	dead, _ := r[4].([]any)
	kept := []any{}
	for i := 0; i+1 < len(dead); i += 2 {
		if !slices.Contains(serials, fmt.Sprint(dead[i])) || dead[i+1] != queue.ReasonMalformed {
			kept = append(kept, dead[i], dead[i+1])
		}
	}
	out := slices.Clone(r)
	out[4] = kept
	return out
}

// countTooLow reports whether serial's record in st carries the token of
// a batch whose count is below the records that carry it.
func countTooLow(st claimState, serial string) bool {
	rec := map[string]string{}
	for _, fv := range st.lease {
		rec[fv[0]] = fv[1]
	}
	tokOf := func(r string) string {
		if f := strings.SplitN(r, "|", 4); len(f) >= 3 {
			return f[2]
		}
		return ""
	}
	tok := tokOf(rec[serial])
	if tok == "" {
		return false
	}
	carrying := 0
	for _, r := range rec {
		if tokOf(r) == tok {
			carrying++
		}
	}
	count := -1
	for _, fv := range st.leasebatch {
		if fv[0] == "#"+tok {
			count, _ = strconv.Atoi(fv[1])
		}
	}
	return count >= 0 && count < carrying
}

// listedNames counts the names the batch lists of st hold.
func listedNames(st claimState) int {
	n := 0
	for _, fv := range st.leasebatch {
		if !strings.HasPrefix(fv[0], "#") && !strings.HasPrefix(fv[0], "<") {
			n += strings.Count(fv[1], "\n") + 1
		}
	}
	return n
}

// deadAs reports whether a claim's raw reply dead-letters something for
// reason.
func deadAs(raw any, reason string) bool {
	r, ok := raw.([]any)
	if !ok || len(r) < 5 {
		return false
	}
	dead, _ := r[4].([]any)
	for i := 1; i < len(dead); i += 2 {
		if dead[i] == reason {
			return true
		}
	}
	return false
}

// commandCounts counts a hooked run's calls by command.
func commandCounts(t *testing.T, rdb *redis.Client, logKey string, k queue.Keys) map[string]int {
	t.Helper()
	l, err := rdb.LRange(context.Background(), logKey, 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	for _, c := range l {
		f := strings.SplitN(c, " ", 3)
		if len(f) == 3 && marking(f[0], f[1], f[2], k.LeaseBatch) {
			continue
		}
		out[f[0]]++
	}
	return out
}

// freshDeadlinesAsInts is a claim's raw reply with its fresh entries'
// deadlines read as integers: older claims answered them so, the claim of
// today as Redis printed the score (decimal digits). Any other reply is
// returned as it is.
func freshDeadlinesAsInts(t *testing.T, reply any) any {
	t.Helper()
	r, ok := reply.([]any)
	if !ok || len(r) != 7 {
		return reply
	}
	fresh, ok := r[6].([]any)
	if !ok {
		return reply
	}
	out := append([]any(nil), r...)
	f := append([]any(nil), fresh...)
	for i := 1; i < len(f); i += 2 {
		if s, ok := f[i].(string); ok {
			d, err := strconv.ParseInt(s, 10, 64)
			if err != nil {
				t.Fatalf("fresh deadline %q is not a decimal integer: %v", s, err)
			}
			f[i] = d
		}
	}
	out[6] = f
	return out
}
