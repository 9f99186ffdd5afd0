package queue_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Second adversary round on the delivery numbers (7af0da3).

// C1 (holds). Every call of A's take, the recovery that returns A's
// delivery, B's take of the id and A's late ack is refused in turn (one
// refusal per chain; the refused step is then retried whole, as a consumer
// retries its take or ack and the daemon its next pass): A's late ack
// never answers true, B's ack of its current delivery answers true, and
// after it no copy and no per-id state of the id is left. A second chain
// refuses every call of A's current ack, then retries it.
func TestAdvAckDeliveryRefusedAtEveryCallOfTakeRecoveryTakeAck(t *testing.T) {
	rdb, k0 := testenv.Redis(t)
	ctx := context.Background()
	all, err := luaScriptSources(".")
	if err != nil {
		t.Fatal(err)
	}
	take, fwd, ack := hookScript(all["takeScript"]), hookScript(all["forwardScript"]), hookScript(all["ackScript"])
	now0, err := queue.NewStore(rdb, k0).Now(ctx)
	if err != nil {
		t.Fatal(err)
	}
	now := queue.DeadlineMillis(now0)
	takeRoles := advTakeRoles
	fwdRoles := advForwardRoles
	ackRoles := advAckRoles
	const ackMS = 60000
	fwdArgs := []any{"list", 10, 0, "q", 1, ackMS, 10}
	kRun := queue.NewKeys(k0.Queue + ":run")
	t.Cleanup(func() { testenv.DeleteQueue(rdb, kRun) })

	type step struct {
		name string
		run  func(failAt int) advRun
	}
	var a, b string // the numbers A and B hold ("" none)
	number := func(r advRun) string {
		if r.Err != nil || r.Reply == nil {
			return ""
		}
		return r.Reply.([]any)[2].(string)
	}
	ackOf := func(d string, at int64) func(int) advRun {
		return func(failAt int) advRun {
			return evalHooked(t, rdb, ack, kRun, ackRoles, []any{"K-0", d}, at, failAt)
		}
	}
	steps := func() []step {
		return []step{
			{"A's take", func(f int) advRun {
				r := evalHooked(t, rdb, take, kRun, takeRoles, []any{100}, now, f)
				if n := number(r); n != "" {
					a = n
				}
				return r
			}},
			{"the recovery", func(f int) advRun { return evalHooked(t, rdb, fwd, kRun, fwdRoles, fwdArgs, now+ackMS, f) }},
			{"B's take", func(f int) advRun {
				r := evalHooked(t, rdb, take, kRun, takeRoles, []any{100}, now+ackMS+1, f)
				if n := number(r); n != "" {
					b = n
				}
				return r
			}},
			{"A's late ack", func(f int) advRun {
				if a == "" {
					return advRun{}
				}
				r := evalHooked(t, rdb, ack, kRun, ackRoles, []any{"K-0", a}, now+ackMS+2, f)
				if f == 0 && r.Err == nil && r.Reply.(int64) != 0 {
					t.Errorf("A's late ack answered %v", r.Reply)
				}
				return r
			}},
		}
	}
	reset := func() {
		testenv.DeleteQueue(rdb, kRun)
		advCmds{{"RPUSH", advKeyRef("ready"), listItem("K-0", now-5000, `{"n":0}`)}}.write(t, rdb, kRun)
		a, b = "", ""
	}
	copies := func() int {
		n := 0
		for _, l := range []string{kRun.Ready, kRun.Processing} {
			items, _ := rdb.LRange(ctx, l, 0, -1).Result()
			n += strings.Count(strings.Join(items, "\n"), `"id":"K-0"`)
		}
		return n
	}
	clean := func(what string) {
		if n := copies(); n != 0 {
			t.Errorf("%s: %d copies of K-0 after B's ack", what, n)
		}
		for _, h := range []string{kRun.DeliveryIDs, kRun.Taken, kRun.Deliveries} {
			if rdb.HExists(ctx, h, "K-0").Val() {
				t.Errorf("%s: K-0 left in %s after B's ack", what, h)
			}
		}
		if rdb.ZScore(ctx, kRun.Unacked, "K-0").Err() == nil {
			t.Errorf("%s: K-0 left in unacked after B's ack", what)
		}
	}
	// Calls per step, from a chain without refusals.
	reset()
	var calls [][][3]string
	for _, s := range steps() {
		calls = append(calls, s.run(0).Calls)
	}
	points := 0
	for si := range calls {
		for at := 1; at <= len(calls[si]); at++ {
			reset()
			c := calls[si][at-1]
			what := fmt.Sprintf("%s refused at call %d (%s %s %s)", steps()[si].name, at, c[0], c[1], c[2])
			ss := steps()
			for j, s := range ss {
				if j == si {
					s.run(at)
				}
				s.run(0)
			}
			points++
			if b == "" {
				// B got nothing (its take was refused after it moved the
				// item): the item must still be recoverable.
				if copies() != 1 {
					t.Errorf("%s: B holds nothing and %d copies of K-0", what, copies())
				}
				continue
			}
			if ok, err := queue.NewStore(rdb, kRun).AckTaken(ctx, "K-0", b); err != nil || !ok {
				t.Errorf("%s: B's ack of its current delivery %q: %v, %v; want true", what, b, ok, err)
				continue
			}
			clean(what)
		}
	}
	// A's current ack refused at each call, then retried.
	reset()
	steps()[0].run(0)
	full := ackOf(a, now+1)(0)
	for at := 1; at <= len(full.Calls); at++ {
		reset()
		steps()[0].run(0)
		c := full.Calls[at-1]
		what := fmt.Sprintf("A's current ack refused at call %d (%s %s %s)", at, c[0], c[1], c[2])
		ackOf(a, now+1)(at)
		r := ackOf(a, now+1)(0)
		points++
		if r.Err != nil {
			t.Fatalf("%s, retried: %v", what, r.Err)
		}
		if r.Reply.(int64) == 1 {
			if copies() != 0 {
				t.Errorf("%s, retried (true): %d copies left", what, copies())
			}
			continue
		}
		// Answered "not found": the item must come back, and its next
		// delivery be acknowledged cleanly; or the refused ack had
		// removed it already (refused at its last ZREM: the entry alone
		// stays, which the recovery drops).
		evalHooked(t, rdb, fwd, kRun, fwdRoles, fwdArgs, now+ackMS, 0)
		bt := evalHooked(t, rdb, take, kRun, takeRoles, []any{100}, now+ackMS+1, 0)
		if b = number(bt); b == "" && c[0] == "zrem" && bt.Err == nil && bt.Reply == nil {
			clean(what)
			continue
		}
		if b == "" {
			t.Errorf("%s, retried (false), recovered: no take of K-0: %v %v", what, bt.Reply, bt.Err)
			continue
		}
		if ok, err := queue.NewStore(rdb, kRun).AckTaken(ctx, "K-0", b); err != nil || !ok {
			t.Errorf("%s: B's ack: %v, %v", what, ok, err)
			continue
		}
		clean(what)
	}
	t.Logf("%d refusal points", points)
}

// C2 (fixed). An item in the ready list whose JSON is not in the
// forward's key order ({"id","payload","deadline_ms"}: a producer other
// than the daemon) is keyed by its whole body in the take (split_item
// finds no '{"id":…,"deadline_ms":' prefix), while Take decoded its ID
// as "x": the consumer's Ack of the delivery it was just handed named
// "x", which has no number, answered ErrNotFound, and the item came back
// after ack_timeout and was dead-lettered as failed though every delivery
// was acknowledged in time (invariant 3: a current Ack succeeds). Take
// now gives the id the script went by: the whole body.
func TestAdvAckOfAForeignKeyOrderItemMatchesItsOwnDelivery(t *testing.T) {
	rdb, k := testenv.Redis(t)
	ctx := context.Background()
	st := queue.NewStore(rdb, k)
	body := `{"id":"x","payload":1,"deadline_ms":1}`
	if err := rdb.RPush(ctx, k.Ready, body).Err(); err != nil {
		t.Fatal(err)
	}
	it, err := st.Take(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("took ID %q delivery %q", it.ID, it.Delivery)
	if it.ID != body || it.DeadlineMS != 1 || string(it.Payload) != "1" {
		t.Errorf("Take = %+v; want the whole body as its ID, deadline 1, payload 1", it)
	}
	ok, err := st.AckTaken(ctx, it.ID, it.Delivery)
	if err != nil {
		t.Fatal(err)
	}
	if !ok {
		n, _ := rdb.LLen(ctx, k.Processing).Result()
		t.Errorf("the current ack of the delivery Take just returned answered false (ErrNotFound); %d items stay in processing, recorded under %q", n,
			rdb.HKeys(ctx, k.Taken).Val())
	}
	for _, key := range []string{k.Processing, k.Unacked, k.Taken, k.Deliveries, k.DeliveryIDs} {
		if n, err := rdb.Exists(ctx, key).Result(); err != nil || n != 0 {
			t.Errorf("%s after the ack: exists %d, %v; want gone", key, n, err)
		}
	}
}

// olderAckByID is the ack of a consumer built before delivery numbers
// (f94c324): by id alone.
const olderAckByID = `
local item = redis.call('HGET', KEYS[3], ARGV[1])
if not item then return 0 end
redis.call('LREM', KEYS[1], 1, item)
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
`

// C3 (holds). A bounded random walk with this daemon, newer consumers and
// consumers built before delivery numbers (the take of the refusal audit's snapshot and an ack by id,
// the documented rolling state "daemon first, then consumers"): a newer
// consumer's ack answers true iff its delivery is current, an older
// consumer's current ack answers true, and a forwarded task is lost only
// where docs/tasks.md says: an older consumer's late ack while another
// delivery of the id was taken.
func TestAdvAckRandomWalkOlderAndNewerConsumersBesideThisDaemon(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("ORDERDELAY_ADV_SEED"); s != "" {
		seed, _ = strconv.ParseUint(s, 10, 64)
	}
	t.Logf("seed %d (ORDERDELAY_ADV_SEED replays it)", seed)
	rng := rand.New(rand.NewPCG(seed, 11))
	e := newRefusalEnv(t)
	old := olderTake(t)
	fwd := queue.ForwardArgs{Kind: "list", Limit: 100, Queue: "refuse:q", Reliable: true, AckTimeout: time.Minute, MaxAttempts: 1000}
	ids := []string{"W-0", "W-1"}
	type held struct {
		it     queue.ListItem
		older  bool
		serial int
	}
	current := map[string]int{} // id -> serial of its taken delivery
	var hs []held
	outstanding := map[string]string{} // token -> id
	allowed := map[string]bool{}       // tokens the documented loss may take
	queued := map[string]bool{}
	n, serial := 0, 0
	var lastMS int64
	later := func() { // each take in a later ms than the last (ack_timeout >= 1ms)
		for {
			now, err := e.st.Now(e.ctx)
			if err != nil {
				t.Fatal(err)
			}
			if now.UnixMilli() > lastMS {
				lastMS = now.UnixMilli()
				return
			}
		}
	}
	for step := range 500 {
		switch rng.IntN(7) {
		case 0:
			id := ids[rng.IntN(len(ids))]
			if queued[id] {
				continue
			}
			now, _ := e.st.Now(e.ctx)
			n++
			tok := fmt.Sprintf(`"n":%d`, n)
			e.putAt(id, queue.DeadlineMillis(now.Add(-time.Second)), "{"+tok+"}")
			queued[id] = true
			outstanding[tok] = id
		case 1:
			if _, err := e.st.Forward(e.ctx, fwd); err != nil {
				t.Fatal(err)
			}
			queued = map[string]bool{}
		case 2, 3: // take, newer or older consumer
			later()
			older := rng.IntN(2) == 0
			var it queue.ListItem
			if older {
				v, err := e.rdb.Eval(e.ctx, old, []string{e.k.Ready, e.k.Processing, e.k.Unacked, e.k.Taken, e.k.Deliveries}, 100).Slice()
				if err != nil {
					continue
				}
				it = mustItem(t, v[0].(string))
			} else {
				var err error
				it, err = e.st.Take(e.ctx)
				if err != nil {
					continue
				}
			}
			if current[it.ID] != 0 {
				t.Fatalf("seed %d step %d: %s taken twice at once", seed, step, it.ID)
			}
			serial++
			current[it.ID] = serial
			hs = append(hs, held{it, older, serial})
		case 4, 5:
			if len(hs) == 0 {
				continue
			}
			h := hs[rng.IntN(len(hs))]
			isCur := current[h.it.ID] == h.serial
			var ok bool
			if h.older {
				r, err := e.rdb.Eval(e.ctx, olderAckByID, []string{e.k.Processing, e.k.Unacked, e.k.Taken, e.k.Deliveries}, h.it.ID).Int()
				if err != nil {
					t.Fatal(err)
				}
				ok = r == 1
				if isCur && !ok {
					t.Fatalf("seed %d step %d: older consumer's current ack of %s answered false", seed, step, h.it.ID)
				}
				if ok && !isCur {
					// The documented loss: whatever delivery was taken is gone.
					for _, o := range hs {
						if o.serial == current[h.it.ID] {
							for tok, id := range outstanding {
								if id == o.it.ID && "{"+tok+"}" == string(o.it.Payload) {
									allowed[tok] = true
								}
							}
						}
					}
				}
			} else {
				var err error
				ok, err = e.st.AckTaken(e.ctx, h.it.ID, h.it.Delivery)
				if err != nil {
					t.Fatal(err)
				}
				if ok != isCur {
					t.Fatalf("seed %d step %d: newer consumer's ack of %s (delivery %s, current %v) answered %v", seed, step, h.it.ID, h.it.Delivery, isCur, ok)
				}
			}
			if ok {
				delete(current, h.it.ID)
				if isCur {
					for tok, id := range outstanding {
						if id == h.it.ID && "{"+tok+"}" == string(h.it.Payload) {
							delete(outstanding, tok)
						}
					}
				}
			}
		case 6:
			e.recoverAll(fwd)
			current = map[string]int{}
		}
		for tok, id := range outstanding {
			_, with := e.copies(id, tok)
			if with == 0 && e.rdb.ZScore(e.ctx, e.k.Queue, id).Err() != nil && !allowed[tok] {
				t.Fatalf("seed %d step %d: task %s {%s} in no list and not queued, and no older late ack took it", seed, step, id, tok)
			}
		}
	}
}
