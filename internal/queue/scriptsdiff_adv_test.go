package queue_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// advWorld is a random state of one queue's keys, with every odd shape
// foreign writes (raw producers, operators, older daemons, a refused
// script) can leave: serials queued and leased at once, lease records of
// every token kind (batch, per member, backoff) and with deadlines that are
// not numbers, batches whose member lists repeat members or name members
// that left, counts that do not match, batches without an expiry or a
// list, dead letters without a record, tasks without a payload, taken
// list items without their records, stream entries trimmed away or
// without an id or payload.
type advWorld struct {
	now       int64
	serials   []string
	tokens    []string
	cur       map[string]int64 // a deadline the state holds for the serial (queue score or record)
	streamIDs []string
	cmds      advCmds
}

var (
	rQueue, rInflight, rDeadlines, rLease      = advKeyRef("queue"), advKeyRef("inflight"), advKeyRef("deadlines"), advKeyRef("lease")
	rLeases, rLeaseBatch, rDead, rDeadInfo     = advKeyRef("leases"), advKeyRef("leasebatch"), advKeyRef("dead"), advKeyRef("deadinfo")
	rPaused, rPayload, rStream, rReady         = advKeyRef("paused"), advKeyRef("payload"), advKeyRef("stream"), advKeyRef("ready")
	rProcessing, rUnacked, rTaken, rDeliveries = advKeyRef("processing"), advKeyRef("unacked"), advKeyRef("taken"), advKeyRef("deliveries")
	rMeta                                      = advKeyRef("meta")
)

func listItem(id string, d int64, payload string) string {
	b, _ := json.Marshal(id)
	return fmt.Sprintf(`{"id":%s,"deadline_ms":%d,"payload":%s}`, b, d, payload)
}

func randomWorld(r *rand.Rand, now int64, stream bool) *advWorld {
	w := &advWorld{now: now, cur: map[string]int64{}, tokens: []string{"b:0", "b:1", "p:1", "p:2", "-"}}
	add := func(args ...any) { w.cmds = append(w.cmds, args) }
	for i := range 3 + r.IntN(6) {
		w.serials = append(w.serials, fmt.Sprintf("S%d", i))
	}
	if r.IntN(6) == 0 {
		w.serials = append(w.serials, []string{"", "bad\x01x", strings.Repeat("a", 129), "订单-1"}[r.IntN(4)])
	}
	rec := func(s, d, tok string) {
		a := []string{"0", "1", "2", "z"}[r.IntN(4)]
		add("HSET", rLease, s, d+"|"+a+"|"+tok+"|"+[]string{"", "e", "a/b"}[r.IntN(3)])
	}
	for i, s := range w.serials {
		if r.IntN(2) == 0 {
			sc := ""
			switch r.IntN(12) {
			case 0:
				sc = strconv.FormatInt(now+3600000, 10)
			case 1:
				sc = "1500000000" // seconds, not ms
			case 2:
				sc = strconv.FormatInt(now-500, 10) + ".5"
			case 3:
				sc = "-inf"
			case 4:
				sc = strconv.FormatInt(now+queue.MaxAhead.Milliseconds()+86400000, 10)
			default:
				sc = strconv.FormatInt(now-1000-int64(i), 10)
			}
			add("ZADD", rQueue, sc, s)
			if n, err := strconv.ParseInt(sc, 10, 64); err == nil {
				w.cur[s] = n
			}
		}
		if r.IntN(20) < 9 {
			d := now - 10000 - int64(7*i)
			ds := strconv.FormatInt(d, 10)
			switch r.IntN(20) {
			case 0:
				ds = "x"
			case 1:
				ds = ""
			case 2:
				ds = "1.7e12"
			}
			if r.IntN(25) == 0 {
				add("HSET", rLease, s, "garbage")
			} else {
				rec(s, ds, w.tokens[r.IntN(len(w.tokens))])
				if _, ok := w.cur[s]; !ok && ds == strconv.FormatInt(d, 10) {
					w.cur[s] = d
				}
			}
		}
		if r.IntN(10) < 3 {
			exp := now - 50
			if r.IntN(3) == 0 {
				exp = now + 100000
			}
			add("ZADD", rInflight, exp, s)
			if r.IntN(10) < 7 {
				add("ZADD", rDeadlines, now-20000, s)
			}
		}
		if r.IntN(5) == 0 {
			add("ZADD", rDead, now-5000, s)
			if r.IntN(5) > 0 {
				add("HSET", rDeadInfo, s, "failed|2|"+strconv.FormatInt(now-9000, 10)+"|boom")
			}
		}
		if r.IntN(2) == 0 {
			p := fmt.Sprintf(`{"n":%d}`, i)
			if r.IntN(10) == 0 {
				p = "null"
			}
			add("HSET", rPayload, s, p)
		}
		if r.IntN(7) == 0 { // taken from a reliable list
			item := listItem(s, now-1000, fmt.Sprintf(`{"n":%d}`, i))
			if r.IntN(10) < 9 {
				add("HSET", rTaken, s, item)
			}
			if r.IntN(10) < 8 {
				add("ZADD", rUnacked, []int64{now - 120000, now - 10}[r.IntN(2)], s)
			}
			if r.IntN(10) < 8 {
				add("LPUSH", rProcessing, item)
			}
			if r.IntN(10) < 7 {
				add("HSET", rDeliveries, s, 1+r.IntN(3))
			}
		}
	}
	for range r.IntN(5) {
		var item string
		switch r.IntN(6) {
		case 0:
			item = "junk"
		case 1:
			item = listItem("U9", now-1000, "null")
		default:
			s := w.serials[r.IntN(len(w.serials))]
			item = listItem(s, now-1000, `{"r":1}`)
		}
		add("RPUSH", rReady, item)
		if r.IntN(4) == 0 {
			add("RPUSH", rReady, item) // a repeat
		}
	}
	for _, b := range []string{"b:0", "b:1", "b:2"} {
		if r.IntN(10) >= 7 {
			continue
		}
		var list []string
		carrying := map[string]bool{}
		for range r.IntN(7) {
			s := w.serials[r.IntN(len(w.serials))]
			list = append(list, s)
			if r.IntN(10) < 6 {
				d := now - 30000 - int64(r.IntN(1000))
				rec(s, strconv.FormatInt(d, 10), b)
				carrying[s] = true
				if _, ok := w.cur[s]; !ok {
					w.cur[s] = d
				}
			}
		}
		if r.IntN(20) < 17 {
			add("ZADD", rLeases, []int64{now - 10, now + 60000}[r.IntN(2)], b)
		}
		if r.IntN(10) < 9 {
			add("HSET", rLeaseBatch, b, strings.Join(list, "\n"))
		}
		switch n := r.IntN(20); {
		case n < 12:
			add("HSET", rLeaseBatch, "#"+b, len(carrying))
		case n < 17:
			add("HSET", rLeaseBatch, "#"+b, r.IntN(5))
		case n < 18:
			add("HSET", rLeaseBatch, "#"+b, -1)
		}
		if r.IntN(5) > 0 {
			add("HSET", rLeaseBatch, "<"+b, now-30000)
		}
	}
	if stream || r.IntN(2) == 0 {
		var claimed []string
		for j := range 1 + r.IntN(4) {
			id := fmt.Sprintf("1000-%d", j+1)
			w.streamIDs = append(w.streamIDs, id)
			s := w.serials[r.IntN(len(w.serials))]
			switch r.IntN(6) {
			case 0:
				add("XADD", rStream, id, "deadline", now-1000, "queue", "qname")
			case 1:
				add("XADD", rStream, id, "id", s, "deadline", now-1000, "queue", "qname")
			default:
				add("XADD", rStream, id, "id", s, "deadline", now-1000, "queue", "qname", "payload", fmt.Sprintf(`{"x":%d}`, j))
			}
		}
		add("XGROUP", "CREATE", rStream, "g", "0")
		for _, id := range w.streamIDs {
			if r.IntN(10) < 7 {
				add("XCLAIM", rStream, "g", "c1", 0, id, "IDLE", []int{0, 10000000}[r.IntN(2)], "RETRYCOUNT", 1+r.IntN(4), "FORCE", "JUSTID")
				claimed = append(claimed, id)
			}
		}
		if len(claimed) > 0 && r.IntN(5) == 0 {
			add("XDEL", rStream, claimed[r.IntN(len(claimed))]) // trimmed, still pending
		}
	}
	if r.IntN(10) < 3 {
		add("HSET", rMeta, "durable", []string{"0", "0", "1"}[r.IntN(3)])
		if r.IntN(2) == 0 {
			add("HSET", rMeta, "max_pending", 1+r.IntN(15))
		}
	}
	if r.IntN(10) == 0 {
		add("SET", rPaused, "1|adv")
	}
	return w
}

// pick is 0..max serials of w, with repeats and an unknown one now and
// then.
func (w *advWorld) pick(r *rand.Rand, min, max int) []any {
	var out []any
	for range min + r.IntN(max-min+1) {
		switch {
		case len(out) > 0 && r.IntN(4) == 0:
			out = append(out, out[r.IntN(len(out))])
		case r.IntN(10) == 0:
			out = append(out, "U9")
		default:
			out = append(out, w.serials[r.IntN(len(w.serials))])
		}
	}
	return out
}

func (w *advWorld) token(r *rand.Rand) string {
	if r.IntN(10) == 0 {
		return "c:none"
	}
	return w.tokens[r.IntN(len(w.tokens))]
}

// deadline is a deadline to write for s: the one it has, one more, due,
// or an hour ahead.
func (w *advWorld) deadline(r *rand.Rand, s string) int64 {
	cur, ok := w.cur[s]
	switch n := r.IntN(10); {
	case ok && n < 3:
		return cur
	case ok && n < 5:
		return cur + 1
	case n < 8:
		return w.now - 5000 + int64(r.IntN(100))
	}
	return w.now + 3600000
}

// advCall is one script call: its keys by role and its arguments, as the
// store sends them (but for duplicates, which raw callers may send).
type advCall struct {
	roles []string
	args  []any
}

var advCallGens = map[string]func(r *rand.Rand, w *advWorld) advCall{
	"retryScript": func(r *rand.Rand, w *advWorld) advCall {
		return advCall{[]string{"inflight", "lease", "deadlines", "leases", "leasebatch"},
			append([]any{w.token(r), r.IntN(60000), r.IntN(2), []string{"", "boom|x"}[r.IntN(2)]}, w.pick(r, 0, 6)...)}
	},
	"buryScript": func(r *rand.Rand, w *advWorld) advCall {
		return advCall{[]string{"inflight", "deadlines", "lease", "dead", "deadinfo", "leases", "leasebatch"},
			append([]any{w.token(r), []string{"close_failed", "not_found", "failed"}[r.IntN(3)], "x|y", r.IntN(2)}, w.pick(r, 0, 6)...)}
	},
	"handBackScript": func(r *rand.Rand, w *advWorld) advCall {
		return advCall{[]string{"queue", "inflight", "deadlines", "lease", "leases", "leasebatch"},
			append([]any{w.token(r)}, w.pick(r, 0, 6)...)}
	},
	"enqueueScript": func(r *rand.Rand, w *advWorld) advCall {
		args := []any{[]string{"nx", "set", "later", "adopt"}[r.IntN(4)]}
		for _, s := range w.pick(r, 1, 6) {
			args = append(args, s, w.deadline(r, s.(string)))
		}
		return advCall{[]string{"queue", "lease", "inflight", "deadlines", "wake", "leases", "leasebatch"}, args}
	},
	"cancelScript": func(r *rand.Rand, w *advWorld) advCall {
		return advCall{[]string{"queue", "lease", "inflight", "deadlines", "leases", "leasebatch"}, w.pick(r, 1, 1)}
	},
	"requeueScript": func(r *rand.Rand, w *advWorld) advCall {
		return advCall{[]string{"queue", "dead", "deadinfo"}, w.pick(r, 1, 5)}
	},
	"requeueTasksScript": func(r *rand.Rand, w *advWorld) advCall {
		return advCall{[]string{"queue", "lease", "dead", "deadinfo", "taken", "wake"}, w.pick(r, 1, 5)}
	},
	"forwardScript": func(r *rand.Rand, w *advWorld) advCall {
		// Recovery is a reliable list's (the daemon's config allows
		// nothing else).
		kind, target, maxLen, reliable := "stream", "stream", 1000, 0
		if r.IntN(2) == 0 {
			kind, target, maxLen, reliable = "list", "ready", []int{0, 0, 1, 3, 6}[r.IntN(5)], r.IntN(2)
		}
		return advCall{[]string{"queue", "payload", "paused", target, "dead", "deadinfo", "unacked", "taken", "processing", "deliveries", "deliveryids"},
			[]any{kind, 1 + r.IntN(10), maxLen, "qname", reliable, 60000, 1 + r.IntN(4)}}
	},
	"streamBuryScript": func(r *rand.Rand, w *advWorld) advCall {
		group := "g"
		if r.IntN(20) == 0 {
			group = "nog"
		}
		args := []any{group, 60000, 1 + r.IntN(4)}
		for range 1 + r.IntN(4) {
			switch {
			case len(args) > 3 && r.IntN(4) == 0:
				args = append(args, args[3+r.IntN(len(args)-3)])
			case len(w.streamIDs) == 0 || r.IntN(8) == 0:
				args = append(args, "9999-0")
			default:
				args = append(args, w.streamIDs[r.IntN(len(w.streamIDs))])
			}
		}
		return advCall{[]string{"stream", "dead", "deadinfo", "payload"}, args}
	},
	"putTaskScript": func(r *rand.Rand, w *advWorld) advCall {
		s := w.pick(r, 1, 1)[0].(string)
		p := []string{`{"v":1}`, "null"}[r.IntN(2)]
		return advCall{[]string{"queue", "lease", "inflight", "deadlines", "wake", "payload", "meta"},
			[]any{[]string{"nx", "set", "later"}[r.IntN(3)], s, w.deadline(r, s), p, []string{"client", "durable"}[r.IntN(2)]}}
	},
	"releaseScript": func(r *rand.Rand, w *advWorld) advCall {
		return advCall{[]string{"queue", "inflight", "deadlines", "lease"}, append([]any{w.token(r)}, w.pick(r, 0, 6)...)}
	},
	"takeScript": func(r *rand.Rand, w *advWorld) advCall {
		return advCall{advTakeRoles, []any{1 + r.IntN(5)}}
	},
}

// advHotPaths are the scripts that run for every order or task: they
// must send no more commands than before the reorder.
var advHotPaths = map[string]bool{"enqueueScript": true, "putTaskScript": true, "takeScript": true, "retryScript": true}

// advRead is one read of every key advWhere and readFacts look at: the
// checks after each refusal point ask about every serial of a world, and
// a round trip per key and serial made these tests minutes long. A key
// of a foreign type reads as empty, as the per-serial commands on it
// fail (advWhereEach, which TestAdvReadAgreesWithPerSerialReads keeps it
// equal to).
type advRead struct {
	queue, inflight, dead, leases, unacked map[string]float64
	lease, leaseBatch, taken, payload      map[string]string
	ready, processing                      []string
	stream                                 []redis.XMessage
}

func readAdv(t testing.TB, rdb *redis.Client, k queue.Keys) advRead {
	t.Helper()
	ctx := context.Background()
	pipe := rdb.Pipeline()
	zs := []*redis.ZSliceCmd{pipe.ZRangeWithScores(ctx, k.Queue, 0, -1), pipe.ZRangeWithScores(ctx, k.Inflight, 0, -1),
		pipe.ZRangeWithScores(ctx, k.Dead, 0, -1), pipe.ZRangeWithScores(ctx, k.Leases, 0, -1), pipe.ZRangeWithScores(ctx, k.Unacked, 0, -1)}
	hs := []*redis.MapStringStringCmd{pipe.HGetAll(ctx, k.Lease), pipe.HGetAll(ctx, k.LeaseBatch), pipe.HGetAll(ctx, k.Taken), pipe.HGetAll(ctx, k.Payload)}
	ready, processing := pipe.LRange(ctx, k.Ready, 0, -1), pipe.LRange(ctx, k.Processing, 0, -1)
	stream := pipe.XRange(ctx, k.Stream, "-", "+")
	pipe.Exec(ctx) //nolint:errcheck // each command's own error: a foreign key reads as empty
	zm := make([]map[string]float64, len(zs))
	for i, c := range zs {
		zm[i] = map[string]float64{}
		for _, z := range c.Val() {
			zm[i][z.Member.(string)] = z.Score
		}
	}
	hm := make([]map[string]string, len(hs))
	for i, c := range hs {
		if hm[i] = c.Val(); hm[i] == nil {
			hm[i] = map[string]string{}
		}
	}
	return advRead{queue: zm[0], inflight: zm[1], dead: zm[2], leases: zm[3], unacked: zm[4],
		lease: hm[0], leaseBatch: hm[1], taken: hm[2], payload: hm[3],
		ready: ready.Val(), processing: processing.Val(), stream: stream.Val()}
}

// where lists every place of s a claim, a recovery or an operator finds
// it in: the queue key, {q}:inflight, a batch (its record carries the
// token, the batch has an expiry and lists s), the dead-letter set, the
// ready list, a reliable list's taken item recovery returns ({q}:unacked
// and {q}:taken), a stream entry.
func (a advRead) where(s string) []string {
	var out []string
	for _, z := range []struct {
		name string
		set  map[string]float64
	}{{"queue", a.queue}, {"inflight", a.inflight}, {"dead", a.dead}} {
		if _, ok := z.set[s]; ok {
			out = append(out, z.name)
		}
	}
	if rec, ok := a.lease[s]; ok {
		if lr, ok := queue.ParseLeaseRecord(rec); ok {
			if _, live := a.leases[lr.Token]; live && slices.Contains(strings.Split(a.leaseBatch[lr.Token], "\n"), s) {
				out = append(out, "batch "+lr.Token)
			}
		}
	}
	if _, ok := a.unacked[s]; ok {
		if _, ok := a.taken[s]; ok {
			out = append(out, "taken")
		}
	}
	b, _ := json.Marshal(s)
	for _, it := range a.ready {
		if strings.HasPrefix(it, `{"id":`+string(b)+`,"deadline_ms":`) {
			out = append(out, "ready")
			break
		}
	}
	for _, x := range a.stream {
		if x.Values["id"] == s {
			out = append(out, "stream")
			break
		}
	}
	return out
}

// advWhere is where s is found in queue k now (one read of every key).
func advWhere(t testing.TB, rdb *redis.Client, k queue.Keys, s string) []string {
	t.Helper()
	return readAdv(t, rdb, k).where(s)
}

// advSerialsOf is every serial a world names, and the unknown one.
func (w *advWorld) all() []string { return append(slices.Clone(w.serials), "U9") }

// (1) No-failure equivalence of the twelve reordered scripts: the copy
// before the reorder and the one that ships, run on identical random
// states (two key prefixes, one clock answered to both, nothing refused),
// must end in identical keys — content, encoding and, for listpacks,
// field order — with identical replies and identical PUBLISH calls.
// Where both fail (a Lua error a foreign record provokes: a record with a
// deadline that is no number carrying the call's token), the copy that
// ships must keep findable every serial the old one kept.
//
// Known differences, each logged and counted, failing only with
// ORDERDELAY_ADV_REPRO=1 (TestAdvPutTaskDropsAGarbageLeaseTheOldPutKept
// pins it): putTaskScript now drops a lease record whose deadline is no
// number when it creates the task (the old one kept it: its drop was in
// the "moved" branch only, the new `if leased` runs for "created" too).
// And where both copies fail, the states differ (the old one had dropped
// the batch count or the record before the failing command, the new one
// has written the new place first): counted, and checked for loss only.
//
// (4) Cost: enqueue, put, take and retry send no more commands than
// before, on every state. Seed: ORDERDELAY_ADV_SEED; rounds per script:
// ORDERDELAY_ADV_ROUNDS (default 60).
func TestAdvReorderedScriptsMatchTheOldOnesWithoutFailures(t *testing.T) {
	t.Parallel()
	rdb, k0 := testenv.Redis(t)
	ctx := context.Background()
	seed, rounds := advSeedRounds(t, 60, "rounds per script")
	repro := os.Getenv("ORDERDELAY_ADV_REPRO") == "1"
	before, after := scriptsBeforeReorder(t), shippedScripts(t)
	now0, err := queue.NewStore(rdb, k0).Now(ctx)
	if err != nil {
		t.Fatal(err)
	}
	now := queue.DeadlineMillis(now0)
	type tally struct {
		rounds, bothFail, errDiff, known, callsOld, callsNew, writes int
		cmds                                                         map[string]int
	}
	tallies := map[string]*tally{}
	for i, v := range advScriptVars {
		tallies[v] = &tally{cmds: map[string]int{}}
		hb, ha := hookScript(before[v]), hookScript(after[v])
		for round := range rounds {
			r := rand.New(rand.NewPCG(seed, uint64(i*1000000+round)))
			w := randomWorld(r, now, v == "streamBuryScript")
			call := advCallGens[v](r, w)
			ka, kb := queue.NewKeys(k0.Queue+":old"), queue.NewKeys(k0.Queue+":new")
			testenv.DeleteQueue(rdb, ka)
			testenv.DeleteQueue(rdb, kb)
			w.cmds.write(t, rdb, ka)
			w.cmds.write(t, rdb, kb)
			known := map[string]bool{}
			for _, id := range w.streamIDs {
				known[id] = true
			}
			// K1: a put that creates a task whose lease record has no
			// numeric deadline.
			k1 := false
			if v == "putTaskScript" {
				id := call.args[1].(string)
				if rec, err := rdb.HGet(ctx, ka.Lease, id).Result(); err == nil && rdb.ZScore(ctx, ka.Queue, id).Err() != nil {
					_, perr := strconv.ParseFloat(strings.SplitN(rec, "|", 2)[0], 64)
					k1 = perr != nil
				}
			}
			ra := evalHooked(t, rdb, hb, ka, call.roles, call.args, now, 0)
			rb := evalHooked(t, rdb, ha, kb, call.roles, call.args, now, 0)
			tl := tallies[v]
			tl.rounds++
			tl.callsOld += len(ra.Calls)
			tl.callsNew += len(rb.Calls)
			for c, n := range rb.counts() {
				tl.cmds[c] += n
			}
			where := fmt.Sprintf("%s round %d (args %v)", v, round, call.args)
			if (ra.Err == nil) != (rb.Err == nil) {
				t.Errorf("%s: error before %v, after %v", where, ra.Err, rb.Err)
				continue
			}
			// Since the reorder a take also numbers its delivery (an
			// HINCRBY of {q}:deliveryseq and an HSET of {q}:deliveryids,
			// the number the reply's third field; the fourth is the id
			// it went by), which the old take did not: the two
			// commands, those fields and those keys are set aside.
			numbered := 0
			if v == "takeScript" {
				if r, ok := rb.Reply.([]any); ok && len(r) == 4 {
					rb.Reply, numbered = r[:2], 2
				}
			}
			marks := 0
			for _, c := range rb.Calls {
				if marking(c[0], c[1], c[2], "leasebatch") {
					marks++
				}
			}
			if ra.Err == nil && advHotPaths[v] && len(rb.Calls)-numbered-marks > len(ra.Calls) && !k1 {
				t.Errorf("%s: %d commands after the reorder, %d before (%v, %v)", where, len(rb.Calls), len(ra.Calls), rb.counts(), ra.counts())
			}
			if !reflect.DeepEqual(ra.Reply, rb.Reply) {
				t.Errorf("%s: reply %v before, %v after", where, ra.Reply, rb.Reply)
			}
			if !slices.Equal(ra.publishes(), rb.publishes()) {
				t.Errorf("%s: published %q before, %q after", where, ra.publishes(), rb.publishes())
			}
			unmark(t, rdb, kb)
			da, db := dumpAll(t, rdb, ka, known), dumpAll(t, rdb, kb, known)
			for _, r := range []string{"deliveryids", "deliveryseq"} {
				delete(da, r)
				delete(db, r)
			}
			d := dumpDiff(da, db)
			switch {
			case ra.Err != nil:
				tl.bothFail++
				if len(d) > 0 {
					tl.errDiff++
					t.Logf("%s: both fail (%v); states differ:\n  %s", where, rb.Err, strings.Join(d, "\n  "))
					if repro {
						t.Errorf("%s: both fail, states differ (ORDERDELAY_ADV_REPRO=1)", where)
					}
				}
				for _, s := range w.all() {
					if len(advWhere(t, rdb, ka, s)) > 0 && len(advWhere(t, rdb, kb, s)) == 0 {
						t.Errorf("%s: both fail (%v); %q is kept before the reorder, lost after", where, rb.Err, s)
					}
				}
			case len(d) > 0 && k1:
				tl.known++
				t.Logf("%s: K1, a put creating a task drops its lease record with no numeric deadline:\n  %s", where, strings.Join(d, "\n  "))
				if repro {
					t.Errorf("%s: state differs (K1; ORDERDELAY_ADV_REPRO=1):\n  %s", where, strings.Join(d, "\n  "))
				}
			case len(d) > 0:
				t.Errorf("%s: state differs:\n  %s", where, strings.Join(d, "\n  "))
			}
			for _, c := range rb.Calls {
				switch c[0] {
				case "zadd", "zrem", "hset", "hdel", "hincrby", "hsetnx", "xadd", "xack", "lpush", "rpush", "lmove", "lrem", "publish":
					tl.writes++
				}
			}
			testenv.DeleteQueue(rdb, ka)
			testenv.DeleteQueue(rdb, kb)
		}
	}
	for _, v := range advScriptVars {
		tl := tallies[v]
		t.Logf("%-19s %d rounds, %d failing in both (%d of them ending differently), %d known (K1); commands %d before, %d after (%d writes after); sent %v",
			v, tl.rounds, tl.bothFail, tl.errDiff, tl.known, tl.callsOld, tl.callsNew, tl.writes, tl.cmds)
	}
}
