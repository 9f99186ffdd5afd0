package queue_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Adversary tests of 14027e5 ("a claim of plain scores turns none of them
// into a number"): step 2 of the claim skips the per-entry tonumber when
// every due score Redis printed is decimal digits and the first (lowest)
// is not before 2000-01-01, takes the batch's oldest deadline from the
// first fresh entry, and answers fresh deadlines as the printed strings.
//
// The reference is the claim exactly as it was before that commit
// (testdata/claim_before_plain.lua, claimScript's body at 14027e5^; its
// helpers are the ones that ship, unchanged by the commit). Both run,
// hooked, on one clock (ARGV[10]) on identical states under two key
// prefixes; they must end in identical keys (content, encoding, field
// order) and identical replies, once the new reply's fresh deadlines
// (strings) are read as the integers the old one answered.

func claimBodyBeforePlain(t testing.TB) string {
	t.Helper()
	b, err := os.ReadFile("testdata/claim_before_plain.lua")
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// plainCompare runs the claim before 14027e5 and the one that ships on
// state st with args a at now and reports how they differ. It also checks
// that the new reply's fresh deadlines are strings of decimal digits.
func plainCompare(t *testing.T, rdb *redis.Client, k0 queue.Keys, before, after string, st claimState, a queue.ClaimArgs, now int64) (diffs []string, ra, rb any) {
	t.Helper()
	ctx := context.Background()
	ka, kb := queue.NewKeys(k0.Queue+":prev"), queue.NewKeys(k0.Queue+":plain")
	testenv.DeleteQueue(rdb, ka)
	testenv.DeleteQueue(rdb, kb)
	defer testenv.DeleteQueue(rdb, ka)
	defer testenv.DeleteQueue(rdb, kb)
	st.write(t, rdb, ka)
	st.write(t, rdb, kb)
	ra, ea := evalHookedClaim(ctx, rdb, before, ka, "", a, now, 0)
	rb, eb := evalHookedClaim(ctx, rdb, after, kb, "", a, now, 0)
	if (ea == nil) != (eb == nil) || (ea != nil && ea.Error() != eb.Error()) {
		return []string{fmt.Sprintf("error before %v, after %v", ea, eb)}, ra, rb
	}
	if ea != nil {
		return nil, ea, eb
	}
	if r, ok := rb.([]any); ok && len(r) == 7 {
		f, _ := r[6].([]any)
		for i := 1; i < len(f); i += 2 {
			s, ok := f[i].(string)
			if !ok {
				diffs = append(diffs, fmt.Sprintf("fresh deadline %d is %T %v, not the printed score", i/2, f[i], f[i]))
				continue
			}
			if _, err := strconv.ParseInt(s, 10, 64); err != nil || strings.TrimLeft(s, "0123456789") != "" {
				diffs = append(diffs, fmt.Sprintf("fresh deadline %d is %q: not decimal digits", i/2, s))
			}
		}
	}
	na, nb := freshDeadlinesAsInts(t, ra), freshDeadlinesAsInts(t, rb)
	if !reflect.DeepEqual(na, nb) {
		diffs = append(diffs, fmt.Sprintf("reply before %v, after %v", na, nb))
	}
	diffs = append(diffs, queueKeyDiff(dumpQueueKeys(t, rdb, ka), dumpQueueKeys(t, rdb, kb))...)
	return diffs, ra, rb
}

// claimPlainCase is a hand-made state for the plain-score fast path.
type claimPlainCase struct {
	name  string
	args  queue.ClaimArgs
	state func(now int64) claimState
	// check, when set, looks at the shipped claim's reply and keys.
	check func(t *testing.T, now int64, reply []any, batch map[string]string)
}

func zs(pairs ...any) []redis.Z {
	var out []redis.Z
	for i := 0; i+1 < len(pairs); i += 2 {
		out = append(out, redis.Z{Score: pairs[i].(float64), Member: pairs[i+1].(string)})
	}
	return out
}

// The odd scores a raw ZADD producer can write, each first (lowest) in
// the due range or among plain due ones, in batch and per-member mode:
// the new claim must bury, lease and answer exactly as the old one.
func TestAdvClaimPlainScoresMatchThePreviousScript(t *testing.T) {
	t.Parallel()
	rdb, k0 := testenv.Redis(t)
	ctx := context.Background()
	before, after := hookedClaim(claimBodyBeforePlain(t)), hookedClaim(shippedClaimBody(t))
	st := queue.NewStore(rdb, k0)
	now0, err := st.Now(ctx)
	if err != nil {
		t.Fatal(err)
	}
	now := queue.DeadlineMillis(now0)
	f := func(ms int64) float64 { return float64(ms) }
	batch := queue.ClaimArgs{Limit: 100, Lease: time.Minute, Token: "c:new", Batch: true}
	member := queue.ClaimArgs{Limit: 100, Lease: time.Minute, Token: "c:new"}
	oldestIs := func(want int64) func(t *testing.T, now int64, reply []any, b map[string]string) {
		return func(t *testing.T, now int64, reply []any, b map[string]string) {
			t.Helper()
			if got := b["<c:new"]; got != strconv.FormatInt(want, 10) {
				t.Errorf("oldest deadline of the new batch %q, want %d (batch %v)", got, want, b)
			}
		}
	}
	odd := map[string]float64{
		"2000-01-01 exactly":         946684800000,
		"1 ms before 2000":           946684799999,
		"negative zero":              math.Copysign(0, -1),
		"zero":                       0,
		"1.5":                        1.5,
		"seconds, not ms":            1.5e9,
		"-inf":                       math.Inf(-1),
		"2000 and a half ms":         946684800000.5,
		"due and fractional":         f(now-2000) + 0.25,
		"due, 1/8 ms":                f(now-2000) + 0.125,
		"negative":                   -1700000000000,
		"a digit-like huge negative": -1e15,
	}
	var cases []claimPlainCase
	for name, sc := range odd {
		for _, mode := range []queue.ClaimArgs{batch, member} {
			cases = append(cases,
				claimPlainCase{name: name + " first, plain after", args: mode, state: func(now int64) claimState {
					return claimState{queue: zs(sc, "ODD", f(now-1500), "A", f(now-1200), "B", f(now-1000), "C")}
				}},
				claimPlainCase{name: name + " last", args: mode, state: func(now int64) claimState {
					s := claimState{queue: zs(f(now-3000), "A", f(now-2500), "B", sc, "ODD")}
					return s
				}},
				claimPlainCase{name: name + " alone", args: mode, state: func(now int64) claimState {
					return claimState{queue: zs(sc, "ODD")}
				}})
		}
	}
	cases = append(cases,
		claimPlainCase{name: "2000-01-01 exactly is leased fresh", args: batch, state: func(now int64) claimState {
			return claimState{queue: zs(946684800000.0, "Y2K", f(now-1000), "A")}
		}, check: func(t *testing.T, now int64, reply []any, b map[string]string) {
			fr := reply[6].([]any)
			if len(fr) != 4 || fr[0] != "Y2K" || fr[1] != "946684800000" {
				t.Errorf("fresh %v, want Y2K leased at 946684800000 first", fr)
			}
			oldestIs(946684800000)(t, now, reply, b)
		}},
		claimPlainCase{name: "far scores (1e15, 1e17, inf) beside plain due ones", args: batch, state: func(now int64) claimState {
			return claimState{queue: zs(f(now-1000), "A", 1e15, "FAR15", 1e17, "FAR17", math.Inf(1), "INF", f(now+3600000), "LATER")}
		}},
		claimPlainCase{name: "ties at the lowest score", args: batch, state: func(now int64) claimState {
			return claimState{queue: zs(f(now-5000), "T3", f(now-5000), "T1", f(now-5000), "T2", f(now-4000), "U")}
		}, check: func(t *testing.T, now int64, reply []any, b map[string]string) { oldestIs(now-5000)(t, now, reply, b) }},
		claimPlainCase{name: "the lowest is a malformed serial: the oldest is the first leased", args: batch, state: func(now int64) claimState {
			return claimState{queue: zs(f(now-9000), "bad\x01", f(now-8000), "", f(now-7000), strings.Repeat("x", 129), f(now-6000), "OK1", f(now-5000), "OK2")}
		}, check: func(t *testing.T, now int64, reply []any, b map[string]string) { oldestIs(now-6000)(t, now, reply, b) }},
		claimPlainCase{name: "the lowest is taken over (another batch's record): it, not the first fresh, is the oldest", args: batch, state: func(now int64) claimState {
			return claimState{
				queue:      zs(f(now-9000), "OVER", f(now-5000), "F1", f(now-4000), "F2"),
				lease:      [][2]string{{"OVER", strconv.FormatInt(now-20000, 10) + "|1|b:0|"}},
				leases:     zs(f(now+60000), "b:0"),
				leasebatch: [][2]string{{"b:0", "OVER"}, {"#b:0", "1"}, {"<b:0", strconv.FormatInt(now-20000, 10)}},
			}
		}, check: func(t *testing.T, now int64, reply []any, b map[string]string) { oldestIs(now-9000)(t, now, reply, b) }},
		claimPlainCase{name: "a take-over after the first fresh entry", args: batch, state: func(now int64) claimState {
			return claimState{
				queue:      zs(f(now-9000), "F1", f(now-5000), "OVER", f(now-4000), "F2"),
				lease:      [][2]string{{"OVER", strconv.FormatInt(now-20000, 10) + "|2|b:0|"}},
				leases:     zs(f(now+60000), "b:0"),
				leasebatch: [][2]string{{"b:0", "OVER"}, {"#b:0", "1"}, {"<b:0", strconv.FormatInt(now-20000, 10)}},
			}
		}, check: func(t *testing.T, now int64, reply []any, b map[string]string) { oldestIs(now-9000)(t, now, reply, b) }},
		claimPlainCase{name: "step 1 re-leases an older per-member lease in the same claim", args: batch, state: func(now int64) claimState {
			return claimState{
				queue:     zs(f(now-5000), "F1", f(now-4000), "F2"),
				inflight:  zs(f(now-10), "P1"),
				deadlines: zs(f(now-30000), "P1"),
				lease:     [][2]string{{"P1", strconv.FormatInt(now-30000, 10) + "|1|p:1|"}},
			}
		}, check: func(t *testing.T, now int64, reply []any, b map[string]string) { oldestIs(now-30000)(t, now, reply, b) }},
		claimPlainCase{name: "step 1 re-leases a younger per-member lease in the same claim", args: batch, state: func(now int64) claimState {
			return claimState{
				queue:     zs(f(now-5000), "F1", f(now-4000), "F2"),
				inflight:  zs(f(now-10), "P1"),
				deadlines: zs(f(now-100), "P1"),
				lease:     [][2]string{{"P1", strconv.FormatInt(now-100, 10) + "|1|p:1|"}},
			}
		}, check: func(t *testing.T, now int64, reply []any, b map[string]string) { oldestIs(now-5000)(t, now, reply, b) }},
		claimPlainCase{name: "step 1b re-leases an expired batch's members in the same claim", args: batch, state: func(now int64) claimState {
			return claimState{
				queue:      zs(f(now-5000), "F1", f(now-4000), "F2"),
				lease:      [][2]string{{"E1", strconv.FormatInt(now-7000, 10) + "|0|b:1|"}, {"E2", strconv.FormatInt(now-200, 10) + "|0|b:1|"}},
				leases:     zs(f(now-10), "b:1"),
				leasebatch: [][2]string{{"b:1", "E1\nE2"}, {"#b:1", "2"}, {"<b:1", strconv.FormatInt(now-7000, 10)}},
			}
		}, check: func(t *testing.T, now int64, reply []any, b map[string]string) { oldestIs(now-7000)(t, now, reply, b) }},
		claimPlainCase{name: "step 1b's members are younger than the first fresh one", args: batch, state: func(now int64) claimState {
			return claimState{
				queue:      zs(f(now-5000), "F1", f(now-4000), "F2"),
				lease:      [][2]string{{"E1", strconv.FormatInt(now-300, 10) + "|0|b:1|"}},
				leases:     zs(f(now-10), "b:1"),
				leasebatch: [][2]string{{"b:1", "E1"}, {"#b:1", "1"}, {"<b:1", strconv.FormatInt(now-300, 10)}},
			}
		}, check: func(t *testing.T, now int64, reply []any, b map[string]string) { oldestIs(now-5000)(t, now, reply, b) }},
		claimPlainCase{name: "per member: deadlines and inflight from the printed score", args: member, state: func(now int64) claimState {
			return claimState{queue: zs(f(now-5000), "F1", f(now-5000), "F0", f(now-4000), "F2", 946684800000.0, "Y2K")}
		}},
		claimPlainCase{name: "byte budget cuts after the first fresh entry", args: queue.ClaimArgs{Limit: 100, Lease: time.Minute, Token: "c:new", Batch: true, MaxBytes: 60, Overhead: 5}, state: func(now int64) claimState {
			return claimState{
				queue:   zs(f(now-5000), "F1", f(now-4000), "F2", f(now-3000), "F3"),
				payload: [][2]string{{"F1", strings.Repeat("p", 40)}, {"F2", strings.Repeat("p", 40)}},
			}
		}, check: func(t *testing.T, now int64, reply []any, b map[string]string) {
			if fr := reply[6].([]any); len(fr) != 2 {
				t.Errorf("fresh %v: want only F1 within the budget", fr)
			}
			oldestIs(now-5000)(t, now, reply, b)
		}},
		claimPlainCase{name: "byte budget, per member, a take-over first", args: queue.ClaimArgs{Limit: 100, Lease: time.Minute, Token: "c:new", MaxBytes: 30, Overhead: 1}, state: func(now int64) claimState {
			return claimState{
				queue:     zs(f(now-6000), "OVER", f(now-5000), "F1", f(now-4000), "F2"),
				lease:     [][2]string{{"OVER", strconv.FormatInt(now-9000, 10) + "|1|p:9|"}},
				inflight:  zs(f(now+50000), "OVER"),
				deadlines: zs(f(now-9000), "OVER"),
				payload:   [][2]string{{"F1", strings.Repeat("p", 10)}, {"F2", strings.Repeat("p", 10)}},
			}
		}},
		claimPlainCase{name: "limit cuts the due range", args: queue.ClaimArgs{Limit: 2, Lease: time.Minute, Token: "c:new", Batch: true}, state: func(now int64) claimState {
			return claimState{queue: zs(f(now-5000), "F1", f(now-4000), "F2", f(now-3000), "F3", 1.5, "LOWLATER")}
		}},
		claimPlainCase{name: "close delay makes the newest entries not yet due", args: queue.ClaimArgs{Limit: 100, Lease: time.Minute, Token: "c:new", Batch: true, CloseDelay: 2 * time.Second}, state: func(now int64) claimState {
			return claimState{queue: zs(f(now-5000), "F1", f(now-2000), "EDGE", f(now-1999), "NOTYET", f(now-1999)+0.5, "FRAC")}
		}},
	)
	for _, c := range cases {
		s := c.state(now)
		diffs, _, rb := plainCompare(t, rdb, k0, before, after, s, c.args, now)
		if len(diffs) > 0 {
			t.Errorf("%s (batch %v, budget %d): the claim after 14027e5 differs from the one before:\n  %s", c.name, c.args.Batch, c.args.MaxBytes, strings.Join(diffs, "\n  "))
			continue
		}
		if c.check != nil {
			// Run the shipped claim again to read its keys.
			kb := queue.NewKeys(k0.Queue + ":plaincheck")
			testenv.DeleteQueue(rdb, kb)
			s.write(t, rdb, kb)
			raw, err := evalHookedClaim(ctx, rdb, after, kb, "", c.args, now, 0)
			if err != nil {
				t.Errorf("%s: %v", c.name, err)
				continue
			}
			b, err := rdb.HGetAll(ctx, kb.LeaseBatch).Result()
			if err != nil {
				t.Fatal(err)
			}
			c.check(t, now, raw.([]any), b)
			testenv.DeleteQueue(rdb, kb)
			_ = rb
		}
	}
	t.Logf("%d hand-made states compared", len(cases))
}

// Random states (the claim harness's, with the odd scores of a raw ZADD
// producer and ties at the lowest due score added) must end the same
// before and after 14027e5. Seed: ORDERDELAY_ADV_SEED; rounds:
// ORDERDELAY_ADV_ROUNDS (default 300).
func TestAdvClaimPlainRandomStatesMatchThePreviousScript(t *testing.T) {
	t.Parallel()
	rdb, k0 := testenv.Redis(t)
	ctx := context.Background()
	seed, rounds := advSeedRounds(t, 300, "rounds")
	before, after := hookedClaim(claimBodyBeforePlain(t)), hookedClaim(shippedClaimBody(t))
	st := queue.NewStore(rdb, k0)
	now0, err := st.Now(ctx)
	if err != nil {
		t.Fatal(err)
	}
	now := queue.DeadlineMillis(now0)
	oddScores := []float64{946684800000, 946684799999, math.Copysign(0, -1), 0, 1.5, 1e15, 1e17, math.Inf(1), math.Inf(-1),
		946684800000.5, float64(now-700) + 0.5, float64(now - 4000)}
	var fails, plainRounds int
	for round := range rounds {
		r := rand.New(rand.NewPCG(seed, uint64(round)))
		state, a := randomClaimState(r, now, r.IntN(8) == 0, false)
		// Half the rounds: only plain due scores (the fast path), with
		// ties; the others: an odd score or two among them.
		tie := float64(now - 3000 - int64(r.IntN(3)))
		for i := range 1 + r.IntN(4) {
			state.queue = append(state.queue, redis.Z{Score: tie, Member: fmt.Sprintf("TIE%d", i)})
		}
		if r.IntN(2) == 0 {
			for i := range 1 + r.IntN(2) {
				state.queue = append(state.queue, redis.Z{Score: oddScores[r.IntN(len(oddScores))], Member: fmt.Sprintf("ODD%d", i)})
			}
		} else {
			var q []redis.Z
			for _, z := range state.queue {
				if z.Score >= 946684800000 && z.Score == math.Floor(z.Score) && !math.IsInf(z.Score, 0) {
					q = append(q, z)
				}
			}
			state.queue = q
			plainRounds++
		}
		diffs, _, _ := plainCompare(t, rdb, k0, before, after, state, a, now)
		if len(diffs) > 0 {
			fails++
			for i := range diffs {
				if len(diffs[i]) > 600 {
					diffs[i] = diffs[i][:600] + "…"
				}
			}
			t.Errorf("round %d (%+v): differs:\n  %s", round, a, strings.Join(diffs, "\n  "))
			if fails > 5 {
				t.FailNow()
			}
		}
	}
	t.Logf("%d rounds (%d with only whole scores from 2000 on), %d differing", rounds, plainRounds, fails)
}

// The fast path rests on how this Redis prints a score to a script
// (ZRANGE WITHSCORES, RESP2 inside Lua): a printed score of decimal
// digits only must be a whole number equal to those digits, and every
// whole score of a due deadline (2000-01-01 up to now + MaxAhead) must
// print so. The scores are checked as the script reads them, whatever
// the protocol of the connection that runs it (RESP2 and RESP3). (-0
// prints as "0", digits: only the lowest score's check against 2000
// dead-letters it, as the per-entry check did.)
func TestAdvClaimScoresPrintAsTheFastPathAssumes(t *testing.T) {
	t.Parallel()
	_, k0 := testenv.Redis(t)
	ctx := context.Background()
	ver := ""
	for _, proto := range []int{2, 3} {
		o, err := redis.ParseURL(testenv.RedisURL())
		if err != nil {
			t.Fatal(err)
		}
		o.Protocol = proto
		rdb := redis.NewClient(o)
		defer rdb.Close()
		if ver == "" {
			info, _ := rdb.Info(ctx, "server").Result()
			for _, l := range strings.Split(info, "\n") {
				if strings.HasPrefix(l, "redis_version:") {
					ver = strings.TrimSpace(l)
				}
			}
			t.Logf("%s", ver)
		}
		key := k0.Queue + ":print" + strconv.Itoa(proto)
		defer rdb.Del(ctx, key)
		r := rand.New(rand.NewPCG(7, uint64(proto)))
		vals := []float64{946684800000, 946684799999, 946684800000.5, 1e15, 1e15 + 0.125, 1e15 + 0.875, 4503599627370495.5,
			9007199254740991, 9007199254740992, 99999999999999984, 1e17, 1e18, 4.6e18, 1.5, 0, math.Copysign(0, -1),
			-946684800000, 1700000000000, 1700000000000.001, 1799999999999.9998}
		now := float64(time.Now().UnixMilli())
		for range 2000 {
			switch r.IntN(3) {
			case 0:
				vals = append(vals, math.Floor(946684800000+r.Float64()*(now+float64(queue.MaxAhead.Milliseconds())-946684800000)))
			case 1:
				vals = append(vals, 946684800000+r.Float64()*(now-946684800000))
			default:
				vals = append(vals, math.Float64frombits(r.Uint64()))
			}
		}
		for i := 0; i < len(vals); i += 200 {
			rdb.Del(ctx, key)
			var z []redis.Z
			for j, v := range vals[i:min(i+200, len(vals))] {
				if math.IsNaN(v) {
					continue
				}
				z = append(z, redis.Z{Score: v, Member: strconv.Itoa(i + j)})
			}
			if err := rdb.ZAdd(ctx, key, z...).Err(); err != nil {
				t.Fatal(err)
			}
			raw, err := rdb.Eval(ctx, `return redis.call('ZRANGE', KEYS[1], '-inf', '+inf', 'BYSCORE', 'WITHSCORES')`, []string{key}).Slice()
			if err != nil {
				t.Fatal(err)
			}
			for j := 0; j+1 < len(raw); j += 2 {
				idx, _ := strconv.Atoi(raw[j].(string))
				v, p := vals[idx], raw[j+1].(string)
				digits := p != "" && strings.Trim(p, "0123456789") == ""
				if digits {
					n, err := strconv.ParseFloat(p, 64)
					if err != nil || n != v || v != math.Trunc(v) {
						t.Errorf("RESP%d, %s: score %v prints as %q: digits, but not that whole number", proto, ver, v, p)
					}
				}
				due := v >= 946684800000 && v <= now+float64(queue.MaxAhead.Milliseconds())
				if due && v == math.Trunc(v) && !digits {
					t.Errorf("RESP%d, %s: whole deadline %v prints as %q, not in digits (the fast path is not taken: a cost, no fault)", proto, ver, v, p)
				}
				if due && v == math.Trunc(v) && p != strconv.FormatInt(int64(v), 10) {
					t.Errorf("RESP%d, %s: whole deadline %v prints as %q, want %q (the lease record and the reply carry it)", proto, ver, v, p, strconv.FormatInt(int64(v), 10))
				}
			}
		}
	}
}

// Store.Claim on RESP2 and RESP3 connections answers fresh deadlines
// equal to the queued scores (the raw reply reader, with the deadlines as
// printed strings), and the lease records and the batch's oldest deadline
// carry them.
func TestAdvClaimPlainDeadlinesReachTheCallerOnBothProtocols(t *testing.T) {
	t.Parallel()
	_, k0 := testenv.Redis(t)
	ctx := context.Background()
	for _, proto := range []int{2, 3} {
		o, err := redis.ParseURL(testenv.RedisURL())
		if err != nil {
			t.Fatal(err)
		}
		o.Protocol = proto
		rdb := redis.NewClient(o)
		defer rdb.Close()
		k := queue.NewKeys(fmt.Sprintf("%s:p%d", k0.Queue, proto))
		testenv.DeleteQueue(rdb, k)
		defer testenv.DeleteQueue(rdb, k)
		st := queue.NewStore(rdb, k)
		now0, err := st.Now(ctx)
		if err != nil {
			t.Fatal(err)
		}
		now := queue.DeadlineMillis(now0)
		want := map[string]int64{"A": now - 9000, "B": now - 9000, "C": now - 5000, "Y2K": 946684800000}
		for s, d := range want {
			rdb.ZAdd(ctx, k.Queue, redis.Z{Score: float64(d), Member: s})
		}
		res, err := st.Claim(ctx, queue.ClaimArgs{Limit: 10, Lease: time.Minute, Token: "c:t", Batch: true})
		if err != nil {
			t.Fatalf("RESP%d: %v", proto, err)
		}
		got := map[string]int64{}
		for _, it := range res.Items {
			got[it.Serial] = it.Deadline
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("RESP%d: claimed %v, want %v", proto, got, want)
		}
		if o, _ := rdb.HGet(ctx, k.LeaseBatch, "<c:t").Result(); o != "946684800000" {
			t.Errorf("RESP%d: oldest deadline %q, want 946684800000", proto, o)
		}
		for s, d := range want {
			rec, _ := rdb.HGet(ctx, k.Lease, s).Result()
			if !strings.HasPrefix(rec, strconv.FormatInt(d, 10)+"|0|c:t|") {
				t.Errorf("RESP%d: record of %s %q, want deadline %d", proto, s, rec, d)
			}
		}
	}
}
