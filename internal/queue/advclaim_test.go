package queue_test

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Adversarial tests of the claim script's shortcuts (aa8ee82): removal of
// the handled entries by rank, one printable-ASCII match over all due
// serials joined together (table.concat with no separator), no HMGET while
// the lease hash is empty, the fresh lease record written inline. Each
// test states the invariant it attacks.

// claimAll runs one claim and fails the test on an error.
func claimAll(t *testing.T, st *queue.Store, a queue.ClaimArgs) queue.ClaimResult {
	t.Helper()
	res, err := st.Claim(context.Background(), a)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// deadReasons reads every dead letter's reason.
func deadReasons(t *testing.T, rdb *redis.Client, k queue.Keys) map[string]string {
	t.Helper()
	ctx := context.Background()
	all, err := rdb.HGetAll(ctx, k.DeadInfo).Result()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for s, rec := range all {
		r, ok := queue.ParseDeadRecord(rec)
		if !ok {
			t.Fatalf("dead record of %q is %q", s, rec)
		}
		out[s] = r.Reason
	}
	if n := rdb.ZCard(ctx, k.Dead).Val(); int(n) != len(out) {
		t.Fatalf("%d dead letters, %d dead records", n, len(out))
	}
	return out
}

// Malformed members are always dead-lettered and never leased, whatever
// printable members are due with them. The joined match concatenates the
// serials with no separator, so the cases are members that are only
// invalid as a whole (length) and members whose bytes would form valid
// UTF-8 across the joint ("ab\xc3" + "\xa9cd" joins to "abécd").
func TestAdvClaimJoinedMatchNeverLeasesAMalformedMember(t *testing.T) {
	ascii := func(n int) string { return strings.Repeat("a", n) }
	cases := map[string][]string{
		"empty among printable":              {"", "A-1", "A-2"},
		"128 and 129 ASCII bytes":            {ascii(128), ascii(129) + "b", "A-1"},
		"128 bytes of é and 130":             {strings.Repeat("é", 64), strings.Repeat("è", 65), "A-1"},
		"129 bytes: ASCII then multi-byte":   {"a" + strings.Repeat("é", 64), "A-1"},
		"a sequence split across the joint":  {"ab\xc3", "\xa9cd", "A-1"},
		"four bytes split across three":      {"x\xf0\x9f", "\x9b", "\x92y"},
		"continuation bytes alone":           {"\x80", "\xbf", "A-1"},
		"bytes ≥ 128 that are not UTF-8":     {"\xff", "\xfe\xfe", "\xc0\x80", "A-1"},
		"DEL and C1 controls":                {"del\x7f", "c1\u0085", "nbsp\u00a0", "A-1"},
		"NUL inside and at the end":          {"a\x00b", "ab\x00", "A-1"},
		"surrogates and beyond U+10FFFF":     {"\xed\xa0\x80", "\xf4\x90\x80\x80", "\U0010FFFF"},
		"tab, newline, unit separator":       {"a\tb", "a\nb", "\x1f", "A-1"},
		"pattern characters are plain bytes": {"%", "[^]", "$^", ".*"},
	}
	for name, members := range cases {
		t.Run(name, func(t *testing.T) {
			rdb, k := testenv.Redis(t)
			ctx := context.Background()
			st := queue.NewStore(rdb, k)
			base := dueAt(t, st, 0)
			// Many printable serials around them, so the joined string is long
			// and the shortcut would be taken if the odd ones did not stop it.
			var zs []redis.Z
			for i := range 200 {
				zs = append(zs, redis.Z{Score: base + float64(i%3), Member: fmt.Sprintf("P-%03d", i)})
			}
			for i, m := range members {
				zs = append(zs, redis.Z{Score: base + float64(i%3), Member: m})
			}
			if err := rdb.ZAdd(ctx, k.Queue, zs...).Err(); err != nil {
				t.Fatal(err)
			}
			res := claimAll(t, st, queue.ClaimArgs{Limit: 5000, Lease: time.Minute, Token: "adv:j.1", Batch: true})
			leased := map[string]bool{}
			for _, it := range res.Items {
				if leased[it.Serial] {
					t.Errorf("%q leased twice in one claim", it.Serial)
				}
				leased[it.Serial] = true
			}
			dead := deadReasons(t, rdb, k)
			for _, z := range zs {
				m := z.Member.(string)
				valid := queue.ValidateSerial(m) == nil
				switch {
				case valid && !leased[m]:
					t.Errorf("valid %q not leased (dead: %q)", m, dead[m])
				case !valid && leased[m]:
					t.Errorf("malformed %q leased", m)
				case !valid && dead[m] != queue.ReasonMalformed:
					t.Errorf("malformed %q dead-lettered as %q, want %q", m, dead[m], queue.ReasonMalformed)
				case valid && dead[m] != "":
					t.Errorf("valid %q dead-lettered as %q", m, dead[m])
				}
			}
			if n := rdb.ZCard(ctx, k.Queue).Val(); n != 0 {
				t.Errorf("%d entries left in the queue key, want 0", n)
			}
		})
	}
}

// advMember is one queue entry of a randomised claim.
type advMember struct {
	m     string
	score float64
	pay   int // payload bytes (a task queue's, for the byte budget)
}

// randomMembers makes n distinct members: valid serials of ASCII and of
// multi-byte UTF-8, malformed ones, and scores due (with ties and
// fractions), before 2000, -inf, in the near future, more than ten years
// ahead and +inf.
func randomMembers(r *rand.Rand, now float64, n int) []advMember {
	seen := map[string]bool{}
	var out []advMember
	for len(out) < n {
		var m string
		switch r.IntN(12) {
		case 0:
			m = ""
		case 1:
			m = strings.Repeat("a", 127+r.IntN(3))
		case 2:
			m = strings.Repeat("é", 63+r.IntN(3))
		case 3:
			m = string([]byte{byte('a' + r.IntN(3)), byte(0x80 + r.IntN(128))})
		case 4:
			m = fmt.Sprintf("c%d%c", r.IntN(5), rune(r.IntN(33)))
		case 5:
			m = "订单-" + fmt.Sprint(r.IntN(50))
		default:
			m = fmt.Sprintf("O-%d", r.IntN(4*n))
		}
		if seen[m] {
			continue
		}
		seen[m] = true
		var sc float64
		switch r.IntN(14) {
		case 0:
			sc = now - 60000 + float64(r.IntN(3)) + 0.5
		case 1:
			sc = 946684799999
		case 2:
			sc = math.Inf(-1)
		case 3:
			sc = math.Inf(1)
		case 4:
			sc = now + 3600000 + float64(r.IntN(3))
		case 5:
			sc = now + float64(queue.MaxAhead.Milliseconds()) + 86400000 + float64(r.IntN(3))
		default:
			sc = now - 60000 + float64(r.IntN(3)) // ties: three scores for all
		}
		out = append(out, advMember{m: m, score: sc, pay: r.IntN(40)})
	}
	return out
}

// claimOracle is claimScript's step 2 and 3 for a queue with no leases,
// written from its contract: the first limit due entries by rank, each
// dead-lettered (malformed serial or score not an integer; before 2000),
// leased, or — with a byte budget — the end of the claim; then up to
// limit entries more than MaxAhead ahead dead-lettered.
func claimOracle(ms []advMember, now, limit, budget, overhead int64) (leased []advMember, dead map[string]string, left []advMember) {
	sorted := append([]advMember(nil), ms...)
	sort.Slice(sorted, func(i, j int) bool {
		if sorted[i].score != sorted[j].score {
			return sorted[i].score < sorted[j].score
		}
		return bytes.Compare([]byte(sorted[i].m), []byte(sorted[j].m)) < 0
	})
	dead = map[string]string{}
	handled := map[string]bool{}
	var spent int64
	seen := int64(0)
	for _, e := range sorted {
		if e.score > float64(now) || seen >= limit {
			break
		}
		seen++
		if queue.ValidateSerial(e.m) != nil || (!math.IsInf(e.score, 0) && e.score != math.Floor(e.score)) {
			dead[e.m] = queue.ReasonMalformed
		} else if e.score < float64(queue.MinDeadline) {
			dead[e.m] = queue.ReasonScoreOutOfRange
		} else {
			if budget > 0 {
				cost := int64(e.pay) + 2*int64(len(e.m)) + overhead
				if len(leased) > 0 && spent+cost > budget {
					break
				}
				spent += cost
			}
			leased = append(leased, e)
		}
		handled[e.m] = true
	}
	far := int64(0)
	for _, e := range sorted {
		if e.score > float64(now)+float64(queue.MaxAhead.Milliseconds()) && !handled[e.m] && far < limit {
			dead[e.m] = queue.ReasonScoreOutOfRange
			handled[e.m] = true
			far++
		}
	}
	for _, e := range sorted {
		if !handled[e.m] {
			left = append(left, e)
		}
	}
	return leased, dead, left
}

// Every entry removed from the queue key is leased or dead-lettered, and
// exactly the first ones by rank are: ties of scores (ordered byte by
// byte), dead letters mixed into the prefix, a byte budget's stop, -inf
// and +inf, fractions, far-future entries buried after the removal by
// rank. Seeded; replay with the seed printed.
func TestAdvClaimRemovalByRankMatchesTheContract(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	r := rand.New(rand.NewPCG(seed, 0))
	for round := range 40 {
		t.Run(fmt.Sprint(round), func(t *testing.T) {
			rdb, k := testenv.Redis(t)
			ctx := context.Background()
			st := queue.NewStore(rdb, k)
			nowT, err := st.Now(ctx)
			if err != nil {
				t.Fatal(err)
			}
			now := float64(nowT.UnixMilli())
			ms := randomMembers(r, now, 5+r.IntN(60))
			var zs []redis.Z
			for _, e := range ms {
				zs = append(zs, redis.Z{Score: e.score, Member: e.m})
				if err := rdb.HSet(ctx, k.Payload, e.m, strings.Repeat("p", e.pay)).Err(); err != nil {
					t.Fatal(err)
				}
			}
			if err := rdb.ZAdd(ctx, k.Queue, zs...).Err(); err != nil {
				t.Fatal(err)
			}
			limit := int64(1 + r.IntN(len(ms)+5))
			var budget, overhead int64
			if r.IntN(2) == 0 {
				budget, overhead = int64(1+r.IntN(400)), int64(r.IntN(20))
			}
			batch := r.IntN(2) == 0
			res := claimAll(t, st, queue.ClaimArgs{Limit: int(limit), Lease: time.Minute, Token: "adv:r.1",
				MaxBytes: int(budget), Overhead: int(overhead), Batch: batch})
			wantLeased, wantDead, wantLeft := claimOracle(ms, res.Now, limit, budget, overhead)
			t.Logf("%d members, limit %d, budget %d+%d, batch %v: %d leased, %d dead", len(ms), limit, budget, overhead, batch, len(res.Items), len(res.Dead))
			if len(res.Items) != len(wantLeased) {
				t.Fatalf("leased %d, want %d: %+v", len(res.Items), len(wantLeased), res.Items)
			}
			for i, it := range res.Items {
				if it.Serial != wantLeased[i].m || float64(it.Deadline) != wantLeased[i].score || it.Attempts != 0 {
					t.Errorf("item %d = %+v, want %q at %v", i, it, wantLeased[i].m, wantLeased[i].score)
				}
			}
			if got := deadReasons(t, rdb, k); fmt.Sprint(got) != fmt.Sprint(wantDead) {
				t.Errorf("dead letters %q, want %q", got, wantDead)
			}
			left, err := rdb.ZRangeWithScores(ctx, k.Queue, 0, -1).Result()
			if err != nil {
				t.Fatal(err)
			}
			if len(left) != len(wantLeft) {
				t.Fatalf("%d left in the queue key, want %d:\n%v\nwant %v", len(left), len(wantLeft), left, wantLeft)
			}
			for i, z := range left {
				if z.Member != wantLeft[i].m || z.Score != wantLeft[i].score {
					t.Errorf("left %d = %v, want %q at %v", i, z, wantLeft[i].m, wantLeft[i].score)
				}
			}
			recs, err := rdb.HGetAll(ctx, k.Lease).Result()
			if err != nil {
				t.Fatal(err)
			}
			for _, e := range wantLeased {
				rec, ok := queue.ParseLeaseRecord(recs[e.m])
				if !ok || rec.Token != "adv:r.1" || float64(rec.Deadline) != e.score || rec.Attempts != 0 {
					t.Errorf("lease record of %q = %q, want deadline %v, token adv:r.1", e.m, recs[e.m], e.score)
				}
			}
			if len(recs) != len(wantLeased) {
				t.Errorf("%d lease records, want %d", len(recs), len(wantLeased))
			}
		})
	}
}

// An expired batch is re-claimed (step 1b) while the same serial is in
// the queue key again (a producer's raw ZADD): the queue key's deadline
// decides — due, it is leased once, at the producer's deadline; not due,
// it is not leased, its stale record goes, and the old holder's fence
// drops it. The lease hash is empty by the time step 2 runs (its only
// record was the stale one), so step 2 takes the HLEN shortcut.
func TestAdvClaimExpiredBatchAndTheQueueKeyDisagree(t *testing.T) {
	for _, due := range []bool{true, false} {
		t.Run(fmt.Sprintf("rewritten due %v", due), func(t *testing.T) {
			rdb, k := testenv.Redis(t)
			ctx := context.Background()
			st := queue.NewStore(rdb, k)
			base := dueAt(t, st, 0)
			if err := rdb.ZAdd(ctx, k.Queue, redis.Z{Score: base, Member: "S"}).Err(); err != nil {
				t.Fatal(err)
			}
			a := claimAll(t, st, queue.ClaimArgs{Limit: 10, Lease: time.Minute, Token: "adv:a.1", Batch: true})
			if len(a.Items) != 1 {
				t.Fatalf("first claim %+v", a.Items)
			}
			// The batch's lease runs out (its expiry moved into the past: data,
			// not clocks) and the producer writes S again.
			if err := rdb.ZAdd(ctx, k.Leases, redis.Z{Score: base, Member: "adv:a.1"}).Err(); err != nil {
				t.Fatal(err)
			}
			again := base + 5
			if !due {
				again = base + float64(2*time.Hour.Milliseconds())
			}
			if err := rdb.ZAdd(ctx, k.Queue, redis.Z{Score: again, Member: "S"}).Err(); err != nil {
				t.Fatal(err)
			}
			b := claimAll(t, st, queue.ClaimArgs{Limit: 10, Lease: time.Minute, Token: "adv:b.1", Batch: true})
			if due {
				if len(b.Items) != 1 || b.Items[0].Serial != "S" || float64(b.Items[0].Deadline) != again || b.Reclaimed != 0 {
					t.Fatalf("second claim %+v (reclaimed %d), want S once at %v, not a re-claim", b.Items, b.Reclaimed, again)
				}
			} else if len(b.Items) != 0 {
				t.Fatalf("second claim %+v, want nothing", b.Items)
			}
			if drop, err := st.Fence(ctx, "adv:a.1", 0, []string{"S"}); err != nil || len(drop) != 1 {
				t.Errorf("old holder's fence dropped %v (%v), want S", drop, err)
			}
			want := "[]"
			if due {
				want = "[adv:b.1]"
			}
			if got := fmt.Sprint(rdb.ZRange(ctx, k.Leases, 0, -1).Val()); got != want {
				t.Errorf("batch leases %s, want %s (the expired batch goes)", got, want)
			}
			if !due {
				if sc, err := rdb.ZScore(ctx, k.Queue, "S").Result(); err != nil || sc != again {
					t.Errorf("queue score of S = %v (%v), want %v", sc, err, again)
				}
				if n := rdb.HLen(ctx, k.Lease).Val(); n != 0 {
					t.Errorf("%d lease records left, want 0", n)
				}
			}
		})
	}
}

// advModel is what producers and consumers did to each serial, as the
// history test records it: whether a producer's latest write still stands
// (live) and the deadline it wrote.
type advModel struct {
	live     map[string]bool
	deadline map[string]float64
	holds    map[string][]string // lease token -> serials its claim leased
}

// advState is a snapshot of every key the lease scripts write.
type advState struct {
	queue, inflight, deadlines map[string]float64
	recs                       map[string]queue.LeaseRecord
	leases                     map[string]float64
	batch                      map[string]string // {Q}:leasebatch
}

func readAdvState(t *testing.T, rdb *redis.Client, k queue.Keys) advState {
	t.Helper()
	ctx := context.Background()
	zmap := func(key string) map[string]float64 {
		zs, err := rdb.ZRangeWithScores(ctx, key, 0, -1).Result()
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]float64{}
		for _, z := range zs {
			out[z.Member.(string)] = z.Score
		}
		return out
	}
	s := advState{queue: zmap(k.Queue), inflight: zmap(k.Inflight), deadlines: zmap(k.Deadlines), leases: zmap(k.Leases),
		recs: map[string]queue.LeaseRecord{}}
	raw, err := rdb.HGetAll(ctx, k.Lease).Result()
	if err != nil {
		t.Fatal(err)
	}
	for m, rec := range raw {
		r, ok := queue.ParseLeaseRecord(rec)
		if !ok {
			t.Fatalf("lease record of %q is %q", m, rec)
		}
		s.recs[m] = r
	}
	if s.batch, err = rdb.HGetAll(ctx, k.LeaseBatch).Result(); err != nil {
		t.Fatal(err)
	}
	return s
}

// check holds the state to the invariants the lease scripts promise.
func (s advState) check(m *advModel) []string {
	var bad []string
	badf := func(f string, a ...any) { bad = append(bad, fmt.Sprintf(f, a...)) }
	// Every per-member entry has its lease record and its true deadline:
	// the claim's HLEN shortcut relies on the first.
	for x := range s.inflight {
		if _, ok := s.recs[x]; !ok {
			badf("%q is in inflight with no lease record", x)
		}
		if _, ok := s.deadlines[x]; !ok {
			badf("%q is in inflight with no deadlines entry", x)
		}
	}
	for x := range s.deadlines {
		if _, ok := s.inflight[x]; !ok {
			badf("%q is in deadlines but not in inflight", x)
		}
	}
	// Batches: a list, a count and an oldest for each lease entry, no
	// member twice, and the count is the members still carrying the token.
	// A batch no script has marked as changed (its oldest deadline,
	// "<"+token, negated: touch) still has every member it lists carrying
	// its token: what its holder's fence and finish trust without reading
	// the records.
	lists := map[string]map[string]bool{}
	for tok := range s.leases {
		list, ok := s.batch[tok]
		if !ok {
			badf("batch %q has no member list", tok)
			continue
		}
		lists[tok] = map[string]bool{}
		carrying := 0
		for _, x := range strings.Split(list, "\n") {
			if lists[tok][x] {
				badf("batch %q lists %q twice", tok, x)
			}
			lists[tok][x] = true
			if r, ok := s.recs[x]; ok && r.Token == tok {
				carrying++
			}
		}
		if c := s.batch["#"+tok]; c != fmt.Sprint(carrying) {
			badf("batch %q counts %s members, %d carry its token", tok, c, carrying)
		}
		if marked := strings.HasPrefix(s.batch["<"+tok], "-"); !marked && carrying != len(lists[tok]) {
			badf("batch %q is not marked as changed, but only %d of the %d members it lists carry its token", tok, carrying, len(lists[tok]))
		}
	}
	for f := range s.batch {
		tok := strings.TrimLeft(f, "#<")
		if _, ok := s.leases[tok]; !ok {
			badf("leasebatch field %q of no batch lease", f)
		}
	}
	// A lease record of a serial that is not queued is found again when it
	// expires: through inflight, or its batch.
	for x, r := range s.recs {
		if _, queued := s.queue[x]; queued {
			continue
		}
		_, per := s.inflight[x]
		if !per && !(r.Token != queue.BackoffToken && lists[r.Token][x]) {
			badf("lease record %q of %q is in no inflight entry and no batch: never re-claimed", r.String(), x)
		}
	}
	// Nothing lost, nothing resurrected: a serial is queued or leased
	// exactly while a producer's write of it stands.
	for x, live := range m.live {
		_, q := s.queue[x]
		_, l := s.recs[x]
		if live != (q || l) {
			badf("%q: live %v, queued %v, lease record %v", x, live, q, l)
		}
	}
	return bad
}

// A history of producers (raw ZADD of any score, enqueue in every mode,
// cancel) and consumers (claims by batch and per member — a daemon of the
// release before batch leases, or a task poll, whose leases are extended,
// released and acknowledged — fence then finish, retry, dead-letter, hand
// back, leases that run out, unbatch) in random order on a few
// serials. After every step the keys are held to the invariants (check);
// every claim is held to: no serial twice, none malformed, each at the
// latest deadline a producer wrote and due; every fence that lets a close
// commit, to that latest deadline being due. Seeded; replay with the seed
// printed.
func TestAdvClaimHistoryKeepsTheLeaseInvariants(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	r := rand.New(rand.NewPCG(seed, 1))
	for round := range 6 {
		t.Run(fmt.Sprint(round), func(t *testing.T) { advHistory(t, r, 400) })
	}
}

func advHistory(t *testing.T, r *rand.Rand, steps int) {
	rdb, k := testenv.Redis(t)
	ctx := context.Background()
	st := queue.NewStore(rdb, k)
	nowT, err := st.Now(ctx)
	if err != nil {
		t.Fatal(err)
	}
	now0 := float64(nowT.UnixMilli())
	serials := []string{"S0", "S1", "S2", "S3", "S4", "S5", "订单-6", "订单-7", "é", strings.Repeat("z", 128)}
	malformed := []string{"", "bad\x01", strings.Repeat("z", 129), "\xc3"}
	m := &advModel{live: map[string]bool{}, deadline: map[string]float64{}, holds: map[string][]string{}}
	var tokens []string
	ntok := 0
	newToken := func() string { ntok++; return fmt.Sprintf("adv:h%d.%d", ntok, r.IntN(3)) }
	pick := func(xs []string) string { return xs[r.IntN(len(xs))] }
	subset := func(xs []string) []string {
		var out []string
		for _, x := range xs {
			if r.IntN(2) == 0 {
				out = append(out, x)
			}
		}
		return out
	}
	dueScore := func() float64 { return now0 - 60000 + float64(r.IntN(3)) }
	futureScore := func() float64 { return now0 + 3600000 + float64(r.IntN(2)) }
	// buried reads and clears the dead letters a step made: no lease script
	// reads them.
	buried := func() map[string]string {
		d := deadReasons(t, rdb, k)
		rdb.Del(ctx, k.Dead, k.DeadInfo)
		return d
	}
	var log []string
	var nClaimed, nReclaimed, nClosed, nUnbatched, nDead int
	defer func() {
		t.Logf("%d steps: %d leased (%d re-claimed), %d closed, %d dead-lettered by claims, %d members unbatched",
			steps, nClaimed, nReclaimed, nClosed, nDead, nUnbatched)
	}()
	fail := func(f string, a ...any) {
		t.Helper()
		t.Fatalf("%s\nhistory:\n%s", fmt.Sprintf(f, a...), strings.Join(log, "\n"))
	}
	for step := range steps {
		var op string
		switch x := r.IntN(100); {
		case x < 16: // a raw producer writes any score
			s := pick(serials)
			if r.IntN(8) == 0 {
				s = pick(malformed)
			}
			var sc float64
			switch r.IntN(10) {
			case 0:
				sc = dueScore() + 0.5
			case 1:
				sc = 946684799999
			case 2:
				sc = math.Inf(-1)
			case 3:
				sc = math.Inf(1)
			case 4:
				sc = now0 + float64(queue.MaxAhead.Milliseconds()) + 86400000
			case 5, 6:
				sc = futureScore()
			default:
				sc = dueScore()
			}
			if err := rdb.ZAdd(ctx, k.Queue, redis.Z{Score: sc, Member: s}).Err(); err != nil {
				t.Fatal(err)
			}
			m.live[s], m.deadline[s] = true, sc
			op = fmt.Sprintf("ZADD %q %v", s, sc)
		case x < 28: // enqueue through the store (API, client)
			s := pick(serials)
			mode := pick([]string{queue.ModeCreate, queue.ModeReschedule, queue.ModeLater})
			d := dueScore()
			if r.IntN(3) == 0 {
				d = futureScore()
			}
			got, err := st.Enqueue(ctx, mode, []queue.EnqueueItem{{Serial: s, Deadline: int64(d)}})
			if err != nil {
				t.Fatal(err)
			}
			op = fmt.Sprintf("enqueue %s %q %v -> %+v", mode, s, d, got[0])
			if got[0].Result == 0 {
				if !m.live[s] {
					fail("step %d: %s: unchanged, but no write of %q stands", step, op, s)
				}
				// The reply is an integer: a raw producer's fraction or
				// infinity is truncated there (and dead-lettered by the
				// next claim), so only integers compare.
				if w := m.deadline[s]; w == math.Trunc(w) && !math.IsInf(w, 0) && float64(got[0].Deadline) != w {
					fail("step %d: %s: unchanged at %d, but the latest write was %v", step, op, got[0].Deadline, w)
				}
			} else {
				m.live[s], m.deadline[s] = true, float64(got[0].Deadline)
			}
		case x < 31: // cancel
			s := pick(serials)
			ok, err := st.Cancel(ctx, s)
			if err != nil {
				t.Fatal(err)
			}
			op = fmt.Sprintf("cancel %q -> %v", s, ok)
			if ok != m.live[s] {
				fail("step %d: %s, live %v", step, op, m.live[s])
			}
			m.live[s] = false
		case x < 50: // a claim, by batch or (an old release's) per member
			tok := newToken()
			batch := r.IntN(4) != 0
			if !batch && r.IntN(2) == 0 {
				tok = queue.NewPollToken() // a task poll's claim: extend, release, ack below
			}
			res, err := st.Claim(ctx, queue.ClaimArgs{Limit: 1 + r.IntN(6), Lease: time.Minute, Token: tok, Batch: batch})
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			seen := map[string]bool{}
			for _, it := range res.Items {
				if seen[it.Serial] {
					fail("step %d: claim %s leased %q twice: %+v", step, tok, it.Serial, res.Items)
				}
				seen[it.Serial] = true
				if queue.ValidateSerial(it.Serial) != nil {
					fail("step %d: claim %s leased malformed %q", step, tok, it.Serial)
				}
				if !m.live[it.Serial] || float64(it.Deadline) != m.deadline[it.Serial] || it.Deadline > res.Now {
					fail("step %d: claim %s leased %+v at %d; latest write %v (live %v)", step, tok, it, res.Now, m.deadline[it.Serial], m.live[it.Serial])
				}
				got = append(got, fmt.Sprintf("%q@%d/%d", it.Serial, it.Deadline, it.Attempts))
				m.holds[tok] = append(m.holds[tok], it.Serial)
			}
			if len(res.Items) > 0 {
				tokens = append(tokens, tok)
			}
			nClaimed += len(res.Items)
			nReclaimed += res.Reclaimed
			dead := buried()
			nDead += len(dead)
			for s := range dead {
				m.live[s] = false
			}
			op = fmt.Sprintf("claim %s batch=%v -> %v, dead %v", tok, batch, got, dead)
		case x < 62 && len(tokens) > 0: // fence, close, finish (mostly the latest claim's)
			tok := tokens[len(tokens)-1]
			if r.IntN(2) == 0 {
				tok = pick(tokens)
			}
			held := m.holds[tok]
			nowF, err := st.Now(ctx)
			if err != nil {
				t.Fatal(err)
			}
			// As the order handler does: the claim's size, so a batch no
			// script changed is trusted (FenceBatch, FinishBatch); or, at
			// random, none (the full compare-and-set).
			claimed := len(held)
			if r.IntN(4) == 0 {
				claimed = 0
			}
			pre := readAdvState(t, rdb, k)
			drop, err := st.FenceBatch(ctx, tok, claimed, 0, held)
			if err != nil {
				t.Fatal(err)
			}
			nowG, err := st.Now(ctx)
			if err != nil {
				t.Fatal(err)
			}
			dropped := map[string]bool{}
			for _, s := range drop {
				dropped[s] = true
			}
			// The answer the records give, whether the fence read them
			// or trusted an unmarked batch: a serial whose record no
			// longer carries the token is dropped, and one the queue key
			// holds with a deadline not yet due; a serial still carrying
			// it and not queued later stays (between the two clock
			// reads, either answer is right).
			for _, s := range held {
				carries := pre.recs[s].Token == tok
				q, queued := pre.queue[s]
				switch {
				case (!carries || queued && q > float64(nowG.UnixMilli())) && !dropped[s]:
					fail("step %d: fence %s keeps %q: record %+v, queued %v at %v", step, tok, s, pre.recs[s], queued, q)
				case carries && (!queued || q <= float64(nowF.UnixMilli())) && dropped[s]:
					fail("step %d: fence %s drops %q, which still carries its token (queued %v at %v)", step, tok, s, queued, q)
				}
			}
			var closed []string
			for _, s := range held {
				if dropped[s] {
					continue
				}
				if !(m.deadline[s] <= float64(nowF.UnixMilli())) {
					fail("step %d: fence %s lets %q close; latest write %v is not due", step, tok, s, m.deadline[s])
				}
				closed = append(closed, s)
			}
			before := readAdvState(t, rdb, k)
			n, err := st.FinishBatch(ctx, tok, claimed, closed)
			if err != nil {
				t.Fatal(err)
			}
			nClosed += n
			carrying := 0
			for _, s := range closed {
				if before.recs[s].Token == tok {
					carrying++
				}
			}
			if n != carrying {
				fail("step %d: finish %s removed %d of %q, %d of which carried its token", step, tok, n, closed, carrying)
			}
			for _, s := range closed {
				if r, ok := before.recs[s]; ok && r.Token == tok {
					if _, q := before.queue[s]; !q {
						m.live[s] = false
					}
				}
			}
			op = fmt.Sprintf("fence+finish %s %q: dropped %q, finished %d", tok, held, drop, n)
		case x < 70 && len(tokens) > 0: // retry now or later
			tok := pick(tokens)
			some := subset(m.holds[tok])
			delay := time.Duration(0)
			if r.IntN(2) == 0 {
				delay = time.Hour
			}
			res, err := st.Retry(ctx, queue.RetryArgs{Token: tok, Serials: some, Delay: delay, Spend: true, LastError: "x|y"})
			if err != nil {
				t.Fatal(err)
			}
			op = fmt.Sprintf("retry %s %q in %s -> %d", tok, some, delay, res.Moved)
		case x < 74 && len(tokens) > 0: // dead-letter
			tok := pick(tokens)
			some := subset(m.holds[tok])
			before := readAdvState(t, rdb, k)
			n, err := st.Bury(ctx, queue.BuryArgs{Token: tok, Serials: some, Reason: queue.ReasonCloseFailed, CountRun: true})
			if err != nil {
				t.Fatal(err)
			}
			for _, s := range some {
				if r, ok := before.recs[s]; ok && r.Token == tok {
					if _, q := before.queue[s]; !q {
						m.live[s] = false
					}
				}
			}
			buried()
			op = fmt.Sprintf("bury %s %q -> %d", tok, some, n)
		case x < 80 && len(tokens) > 0: // hand back
			tok := pick(tokens)
			some := subset(m.holds[tok])
			n, err := st.HandBack(ctx, tok, some)
			if err != nil {
				t.Fatal(err)
			}
			op = fmt.Sprintf("hand back %s %q -> %d", tok, some, n)
		case x < 84 && len(tokens) > 0: // a poll's lease: extended, released or acknowledged
			tok := pick(tokens)
			if !queue.ValidPollToken(tok) {
				continue
			}
			some := subset(m.holds[tok])
			before := readAdvState(t, rdb, k)
			switch r.IntN(3) {
			case 0:
				lost, err := st.ExtendTasks(ctx, tok, time.Minute, some)
				if err != nil {
					t.Fatal(err)
				}
				op = fmt.Sprintf("extend %s %q -> lost %q", tok, some, lost)
			case 1:
				n, err := st.ReleaseTasks(ctx, tok, some)
				if err != nil {
					t.Fatal(err)
				}
				op = fmt.Sprintf("release %s %q -> %d", tok, some, n)
			default:
				missed, _, err := st.AckTasks(ctx, tok, some)
				if err != nil {
					t.Fatal(err)
				}
				for _, s := range some {
					if r, ok := before.recs[s]; ok && r.Token == tok {
						if _, q := before.queue[s]; !q {
							m.live[s] = false
						}
					}
				}
				op = fmt.Sprintf("ack %s %q -> missed %q", tok, some, missed)
			}
		case x < 93: // leases and backoffs run out: their expiries move into the past
			past := now0 - 1000
			for _, key := range []string{k.Inflight, k.Leases} {
				ms, err := rdb.ZRange(ctx, key, 0, -1).Result()
				if err != nil {
					t.Fatal(err)
				}
				for _, x := range subset(ms) {
					rdb.ZAddXX(ctx, key, redis.Z{Score: past, Member: x})
				}
			}
			op = "expire some leases and backoffs"
		default: // an operator rolls back to per-member leases
			res, err := st.UnbatchLeases(ctx, 1+r.IntN(3))
			if err != nil {
				t.Fatal(err)
			}
			if len(res.Problems) > 0 {
				fail("step %d: unbatch problems %+v", step, res.Problems)
			}
			nUnbatched += res.Members
			op = fmt.Sprintf("unbatch -> %d batches, %d members", res.Batches, res.Members)
		}
		if op == "" {
			continue
		}
		log = append(log, fmt.Sprintf("%3d %s", step, op))
		if bad := readAdvState(t, rdb, k).check(m); len(bad) > 0 {
			fail("step %d: after %s:\n%s", step, op, strings.Join(bad, "\n"))
		}
	}
}

// FuzzAdvClaimJoinedMatch splits the input at every byte sep into members,
// due in one claim beside printable ones (the joined match sees them all
// concatenated): each is leased exactly when ValidateSerial accepts it,
// and dead-lettered as malformed otherwise.
func FuzzAdvClaimJoinedMatch(f *testing.F) {
	for _, s := range []string{"ab\xc3,\xa9cd", "\x00,a", ",,", strings.Repeat("é", 64) + ",x", "\xf0\x9f,\x9b\x92", "a\x7f,~"} {
		f.Add([]byte(s), byte(','))
	}
	rdb, k := testenv.Redis(f)
	f.Fuzz(func(t *testing.T, data []byte, sep byte) {
		ctx := context.Background()
		defer rdb.Del(ctx, k.Queue, k.Inflight, k.Deadlines, k.Lease, k.Leases, k.LeaseBatch, k.Dead, k.DeadInfo)
		st := queue.NewStore(rdb, k)
		base := dueAt(t, st, 0)
		members := map[string]bool{"P-1": true, "P-2": true}
		for _, part := range bytes.Split(data, []byte{sep}) {
			members[string(part)] = true
		}
		var zs []redis.Z
		for m := range members {
			zs = append(zs, redis.Z{Score: base, Member: m})
		}
		if err := rdb.ZAdd(ctx, k.Queue, zs...).Err(); err != nil {
			t.Fatal(err)
		}
		res, err := st.Claim(ctx, queue.ClaimArgs{Limit: 5000, Lease: time.Minute, Token: "adv:f.1", Batch: true})
		if err != nil {
			t.Fatal(err)
		}
		leased := map[string]bool{}
		for _, it := range res.Items {
			leased[it.Serial] = true
		}
		dead := deadReasons(t, rdb, k)
		for m := range members {
			valid := queue.ValidateSerial(m) == nil
			if leased[m] != valid || (dead[m] == queue.ReasonMalformed) == valid {
				t.Errorf("%q: valid %v, leased %v, dead %q", m, valid, leased[m], dead[m])
			}
		}
		if n := rdb.ZCard(ctx, k.Queue).Val(); n != 0 {
			t.Errorf("%d entries left in the queue key", n)
		}
	})
}

// A per-member entry with no lease record (no script leaves one: the
// history test holds inflight to the records after every step; an
// operator's or a foreign client's write can) beside a due queue entry of
// the same serial, while the lease hash is empty. The claim leases the
// serial once, at the producer's deadline; when the orphan and that batch
// both run out, the next claim meets the serial twice — in inflight (step
// 1) and in the expired batch (step 1b) — and must still lease it once.
func TestAdvClaimOrphanInflightEntryNeverLeasesTwice(t *testing.T) {
	rdb, k := testenv.Redis(t)
	ctx := context.Background()
	st := queue.NewStore(rdb, k)
	base := dueAt(t, st, 0)
	orphanUntil := base + float64(time.Hour.Milliseconds())
	if err := rdb.ZAdd(ctx, k.Inflight, redis.Z{Score: orphanUntil, Member: "S"}).Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.ZAdd(ctx, k.Deadlines, redis.Z{Score: base - 7, Member: "S"}).Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.ZAdd(ctx, k.Queue, redis.Z{Score: base, Member: "S"}, redis.Z{Score: base, Member: "T"}).Err(); err != nil {
		t.Fatal(err)
	}
	a := claimAll(t, st, queue.ClaimArgs{Limit: 10, Lease: time.Minute, Token: "adv:o.1", Batch: true})
	if len(a.Items) != 2 || a.Items[0].Serial != "S" || float64(a.Items[0].Deadline) != base {
		t.Fatalf("first claim %+v, want S at the queue's %v, and T", a.Items, base)
	}
	// Both the orphan and the batch run out.
	past := base
	rdb.ZAddXX(ctx, k.Inflight, redis.Z{Score: past, Member: "S"})
	rdb.ZAddXX(ctx, k.Leases, redis.Z{Score: past, Member: "adv:o.1"})
	b := claimAll(t, st, queue.ClaimArgs{Limit: 10, Lease: time.Minute, Token: "adv:o.2", Batch: true})
	n := map[string]int{}
	for _, it := range b.Items {
		n[it.Serial]++
		if float64(it.Deadline) != base {
			t.Errorf("re-claimed %+v, want the deadline %v", it, base)
		}
	}
	if n["S"] != 1 || n["T"] != 1 {
		t.Errorf("second claim leased %+v, want S and T once each", b.Items)
	}
	if list := rdb.HGet(ctx, k.LeaseBatch, "adv:o.2").Val(); strings.Count(list, "S") != 1 {
		t.Errorf("batch adv:o.2 lists %q", list)
	}
	if c := rdb.HGet(ctx, k.LeaseBatch, "#adv:o.2").Val(); c != "2" {
		t.Errorf("batch adv:o.2 counts %s members, want 2", c)
	}
}
