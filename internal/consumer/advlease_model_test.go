package consumer

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// A seeded random workload over the order queue's scripts with batch
// leases: three replicas of different batch sizes claim, finish, retry,
// bury, hand back and fence parts of their batches; producers write
// through the client (create, reschedule, only-later, cancel) and raw
// ZADD, due and later; batch leases and backoffs expire. A model of who
// holds what is checked after every step:
//
//   - a claim takes only the producer's latest deadline, never early, and
//     never a serial another claim holds unexpired (unless a producer
//     wrote it since);
//   - a holder's fence, finish, retry, bury and hand-back act on exactly
//     what it still holds, and leave everything else as it was;
//   - every serial a producer wrote and nobody settled is somewhere the
//     claim finds it again: in the queue key, or under a lease record that
//     a live batch (listing it, counting it) or a backoff reaches;
//   - the depth gauge counts each such serial once;
//   - an operator's unbatch (queue.Store.UnbatchLeases) at any step
//     changes none of this, and after the last step leaves every held
//     serial in {Q}:inflight, where a per-member-only claim finds it;
//   - once everything is settled, no lease key holds anything.
func TestAdvLeaseModelRandomWorkload(t *testing.T) {
	t.Parallel()
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	for round := range 8 {
		t.Run(fmt.Sprint(round), func(t *testing.T) { leaseModelRun(t, seed+uint64(round), 300) })
	}
}

type modelHold struct {
	tok     string
	expired bool
}

func leaseModelRun(t *testing.T, seed uint64, steps int) {
	e := newRedisEnv(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(seed, 13))
	k := e.Keys
	serials := make([]string, 10)
	for i := range serials {
		serials[i] = fmt.Sprintf("m%02d", i)
	}
	cons := []*Consumer{
		e.consumer(Config{Owner: "A", BatchSize: 2}),
		e.consumer(Config{Owner: "B", BatchSize: 3}),
		e.consumer(Config{Owner: "C", BatchSize: 10}),
	}
	holds := make([][]item, len(cons)) // what each replica believes it holds
	latest := map[string]int64{}       // serial -> the producer's latest deadline; absent: none live
	holder := map[string]modelHold{}   // serial -> the claim that holds it
	rewritten := map[string]bool{}     // serial -> a raw ZADD wrote it since its claim
	var log []string
	fail := func(step int, format string, args ...any) {
		t.Helper()
		t.Fatalf("seed %d step %d: %s\nhistory:\n  %s", seed, step, fmt.Sprintf(format, args...), strings.Join(log, "\n  "))
	}
	state := func(s string) string {
		q, qerr := e.RDB.ZScore(ctx, k.Queue, s).Result()
		rec, _ := e.RDB.HGet(ctx, k.Lease, s).Result()
		inf, ierr := e.RDB.ZScore(ctx, k.Inflight, s).Result()
		return fmt.Sprintf("q=%v/%v rec=%q inf=%v/%v", q, qerr == nil, rec, inf, ierr == nil)
	}
	due := func() int64 { return queue.DeadlineMillis(e.RedisNow().Add(-time.Second)) }
	later := func() int64 { return queue.DeadlineMillis(e.RedisNow().Add(time.Hour)) }

	check := func(step int) {
		t.Helper()
		queued, _ := e.RDB.ZRange(ctx, k.Queue, 0, -1).Result()
		recs, _ := e.RDB.HGetAll(ctx, k.Lease).Result()
		inflight, _ := e.RDB.ZRange(ctx, k.Inflight, 0, -1).Result()
		info, _ := e.RDB.HGetAll(ctx, k.LeaseBatch).Result()
		leases, _ := e.RDB.ZRange(ctx, k.Leases, 0, -1).Result()
		carrying := map[string]int{}
		for s, rec := range recs {
			f := strings.SplitN(rec, "|", 4)
			if len(f) < 3 {
				fail(step, "%s: malformed record %q", s, rec)
			}
			tok := f[2]
			switch {
			case slices.Contains(inflight, s):
			case tok == "-":
				fail(step, "%s backs off with no expiry in %s: %q", s, k.Inflight, rec)
			default:
				if _, ok := info["#"+tok]; !ok || !slices.Contains(leases, tok) {
					fail(step, "%s is orphaned: its record %q names batch %s, which is gone", s, rec, tok)
				}
				if !slices.Contains(strings.Split(info[tok], "\n"), s) {
					fail(step, "%s is not in the list of its batch %s", s, tok)
				}
				carrying[tok]++
			}
		}
		for tok, n := range carrying {
			var c int
			fmt.Sscan(info["#"+tok], &c)
			if c < n {
				fail(step, "batch %s counts %d members, but %d records carry it", tok, c, n)
			}
		}
		for s := range latest {
			if _, ok := recs[s]; !ok && !slices.Contains(queued, s) {
				fail(step, "%s (deadline %d) is lost: %s", s, latest[s], state(s))
			}
		}
		where := map[string]bool{}
		for _, s := range queued {
			where[s] = true
		}
		for s := range recs {
			where[s] = true
		}
		st, err := queue.ReadStats(ctx, e.RDB, k)
		if err != nil {
			fail(step, "stats: %v", err)
		}
		if st.Depth != int64(len(where)) {
			fail(step, "depth gauge %d, want %d serials in the queue or held", st.Depth, len(where))
		}
	}

	for step := range steps {
		s := serials[rng.IntN(len(serials))]
		switch op := rng.IntN(11); op {
		case 0, 1: // raw ZADD
			d := due()
			if rng.IntN(2) == 0 {
				d = later()
			}
			if err := e.RDB.ZAdd(ctx, k.Queue, redis.Z{Score: float64(d), Member: s}).Err(); err != nil {
				t.Fatal(err)
			}
			latest[s] = d
			rewritten[s] = true // the holder keeps its record; its fence decides
			log = append(log, fmt.Sprintf("%d zadd %s %d", step, s, d))
		case 2: // client
			d := due()
			if rng.IntN(2) == 0 {
				d = later()
			}
			mode := []client.Mode{client.Create, client.Reschedule, client.OnlyLater}[rng.IntN(3)]
			if rng.IntN(4) == 0 {
				if err := e.cl.Cancel(ctx, s); err != nil && err != client.ErrNotFound {
					t.Fatal(err)
				}
				delete(latest, s)
				delete(holder, s)
				log = append(log, fmt.Sprintf("%d cancel %s", step, s))
				break
			}
			_, qerr := e.RDB.ZScore(ctx, k.Queue, s).Result()
			r, got, err := e.cl.Enqueue(ctx, s, time.UnixMilli(d), mode)
			if err != nil {
				fail(step, "enqueue %s: %v", s, err)
			}
			latest[s] = got.UnixMilli()
			switch {
			case r == client.Unchanged:
			case qerr == nil:
				// In the queue key already (a raw ZADD during the
				// lease): the client moves that entry; the holder's
				// record stays, for its fence to decide.
				rewritten[s] = true
			default:
				delete(holder, s) // the client drops the lease record
			}
			log = append(log, fmt.Sprintf("%d enqueue %s %d mode %d -> %v %d", step, s, d, mode, r, got.UnixMilli()))
		case 3, 4: // claim
			i := rng.IntN(len(cons))
			res, err := cons[i].claimBatch(ctx)
			if err != nil {
				fail(step, "claim: %v", err)
			}
			now := res.now
			var names []string
			for _, it := range res.items {
				names = append(names, it.serial)
				d, ok := latest[it.serial]
				switch {
				case !ok:
					fail(step, "%s claimed %s, which no producer holds live", cons[i].cfg.Owner, it.serial)
				case it.deadline != d:
					fail(step, "%s claimed %s at %d, the producer's latest is %d", cons[i].cfg.Owner, it.serial, it.deadline, d)
				case d > now:
					fail(step, "%s claimed %s %d ms before its deadline", cons[i].cfg.Owner, it.serial, d-now)
				}
				if h, ok := holder[it.serial]; ok && !h.expired && !rewritten[it.serial] {
					fail(step, "%s claimed %s, which %s holds unexpired", cons[i].cfg.Owner, it.serial, h.tok)
				}
				holder[it.serial] = modelHold{tok: it.token}
				delete(rewritten, it.serial)
			}
			holds[i] = append(holds[i], res.items...)
			log = append(log, fmt.Sprintf("%d claim %s %v", step, cons[i].cfg.Owner, names))
		case 5, 6, 7: // a holder acts on part of what it believes it holds
			i := rng.IntN(len(cons))
			if len(holds[i]) == 0 {
				break
			}
			rng.Shuffle(len(holds[i]), func(a, b int) { holds[i][a], holds[i][b] = holds[i][b], holds[i][a] })
			// A part names each serial once (a replica closes a serial
			// once per batch: dedupe); the rest stays held.
			n := 1 + rng.IntN(len(holds[i]))
			var part, rest []item
			seen := map[string]bool{}
			for j, it := range holds[i] {
				if j < n && !seen[it.serial] {
					seen[it.serial] = true
					part = append(part, it)
				} else {
					rest = append(rest, it)
				}
			}
			// What it holds is what its record says; the model says
			// when it must still hold it (its lease has not expired and
			// no producer moved it through the client).
			before := map[string]string{}
			mine := map[string]bool{}
			laterQueued := map[string]bool{}
			now := e.RedisNow().UnixMilli()
			for _, it := range part {
				before[it.serial] = state(it.serial)
				rec, _ := e.RDB.HGet(ctx, k.Lease, it.serial).Result()
				f := strings.SplitN(rec, "|", 4)
				mine[it.serial] = len(f) >= 3 && f[2] == it.token
				h, held := holder[it.serial]
				switch {
				case held && h.tok == it.token && !h.expired && !mine[it.serial]:
					fail(step, "%s lost %s before its lease expired: %s", cons[i].cfg.Owner, it.serial, before[it.serial])
				case mine[it.serial] && (!held || h.tok != it.token):
					fail(step, "%s's token is on %s, which the model gives to %+v", cons[i].cfg.Owner, it.serial, h)
				case !mine[it.serial] && held && h.tok == it.token:
					delete(holder, it.serial) // an expired lease a re-claim dropped
				}
				if q, err := e.RDB.ZScore(ctx, k.Queue, it.serial).Result(); err == nil && int64(q) > now {
					laterQueued[it.serial] = true
				}
			}
			act := rng.IntN(5)
			var what string
			switch act {
			case 0:
				what = "fence"
				fence, _ := cons[i].fence(part)
				drop, err := fence(ctx, serialsOf(part))
				if err != nil {
					fail(step, "fence: %v", err)
				}
				for _, it := range part {
					want := !mine[it.serial] || laterQueued[it.serial]
					if slices.Contains(drop, it.serial) != want {
						fail(step, "%s's fence of %s: dropped %v, want %v (%s)",
							cons[i].cfg.Owner, it.serial, !want, want, state(it.serial))
					}
				}
				log = append(log, fmt.Sprintf("%d %s fence %v -> drop %v", step, cons[i].cfg.Owner, serialsOf(part), drop))
				continue
			case 1:
				what = "finish"
				cons[i].finish(part)
			case 2:
				what = "retry"
				cons[i].retry(part, time.Hour, true, "boom")
			case 3:
				what = "bury"
				cons[i].bury(part, queue.ReasonCloseFailed, "boom")
			case 4:
				what = "handback"
				cons[i].handBack(part)
			}
			log = append(log, fmt.Sprintf("%d %s %s %v", step, cons[i].cfg.Owner, what, serialsOf(part)))
			for _, it := range part {
				s := it.serial
				if !mine[s] {
					if after := state(s); after != before[s] {
						fail(step, "%s's %s of %s, which it no longer holds, changed it: %s -> %s", cons[i].cfg.Owner, what, s, before[s], after)
					}
					continue
				}
				delete(holder, s)
				q, err := e.RDB.ZScore(ctx, k.Queue, s).Result()
				switch {
				case err == nil && int64(q) != latest[s]:
					fail(step, "after %s's %s, %s is queued at %d, the producer's latest is %d", cons[i].cfg.Owner, what, s, int64(q), latest[s])
				case err != nil && (what == "finish" || what == "bury"):
					delete(latest, s)
				}
			}
			holds[i] = rest
		case 8: // a batch lease expires
			toks, _ := e.RDB.ZRange(ctx, k.Leases, 0, -1).Result()
			if len(toks) == 0 {
				break
			}
			tok := toks[rng.IntN(len(toks))]
			e.RDB.ZAdd(ctx, k.Leases, redis.Z{Score: 1, Member: tok})
			for s, h := range holder {
				if h.tok == tok {
					holder[s] = modelHold{tok: tok, expired: true}
				}
			}
			log = append(log, fmt.Sprintf("%d expire batch %s", step, tok))
		case 9: // a backoff ends
			ms, _ := e.RDB.ZRange(ctx, k.Inflight, 0, -1).Result()
			if len(ms) == 0 {
				break
			}
			m := ms[rng.IntN(len(ms))]
			e.RDB.ZAdd(ctx, k.Inflight, redis.Z{Score: 1, Member: m})
			if h, ok := holder[m]; ok { // a lease unbatch made per member
				holder[m] = modelHold{tok: h.tok, expired: true}
			}
			log = append(log, fmt.Sprintf("%d backoff or per-member lease of %s ends", step, m))
		case 10: // an operator turns the batch leases into per-member ones
			res := e.unbatch()
			log = append(log, fmt.Sprintf("%d unbatch: %d batches, %d members", step, res.Batches, res.Members))
		}
		check(step)
	}

	// A rollback: with no batch-leasing claim after it, unbatch leaves
	// every held serial where a per-member-only claim finds it.
	e.unbatch()
	recs, _ := e.RDB.HGetAll(ctx, k.Lease).Result()
	for s, rec := range recs {
		if _, err := e.RDB.ZScore(ctx, k.Inflight, s).Result(); err != nil {
			t.Fatalf("seed %d: after unbatch %s (record %q) is not in %s: %v\nhistory:\n  %s", seed, s, rec, k.Inflight, err, strings.Join(log, "\n  "))
		}
	}
	if n := e.card(k.Leases); n != 0 {
		t.Fatalf("seed %d: %d batch leases left after unbatch", seed, n)
	}

	// Settle everything: hand back, end every lease and backoff, and
	// finish what comes due.
	for i := range cons {
		cons[i].handBack(holds[i])
	}
	for range 20 {
		toks, _ := e.RDB.ZRange(ctx, k.Leases, 0, -1).Result()
		for _, tok := range toks {
			e.RDB.ZAdd(ctx, k.Leases, redis.Z{Score: 1, Member: tok})
		}
		ms, _ := e.RDB.ZRange(ctx, k.Inflight, 0, -1).Result()
		for _, m := range ms {
			e.RDB.ZAdd(ctx, k.Inflight, redis.Z{Score: 1, Member: m})
		}
		res, err := cons[2].claimBatch(ctx)
		if err != nil {
			t.Fatal(err)
		}
		cons[2].finish(res.items)
	}
	for _, key := range []string{k.Inflight, k.Deadlines, k.Lease, k.Leases, k.LeaseBatch} {
		if n, _ := e.RDB.Exists(ctx, key).Result(); n != 0 {
			t.Errorf("seed %d: %s left behind once everything settled", seed, key)
		}
	}
}
