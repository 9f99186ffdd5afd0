package queue_test

import (
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/internal/queue"
)

// Adversarial review of the delivery numbers of a reliable list (an Ack
// names its delivery): a Redis that goes back in time, an item whose id
// is "", older daemons and consumers, and refusals at the number's HDEL.
// The first cut of the numbers (a counter in field "" of
// {Q}:deliveryids, dropped last) failed the first four.

// olderTake and olderForward are a consumer's take and a daemon's forward
// from before delivery numbers (the snapshots of the refusal audit:
// neither writes nor drops a number).
func olderTake(t *testing.T) string    { return scriptsBeforeReorder(t)["takeScript"] }
func olderForward(t *testing.T) string { return scriptsBeforeReorder(t)["forwardScript"] }

// oldTake takes with an older consumer's script (no delivery number),
// requiring id.
func (e *refusalEnv) oldTake(src, id string) {
	e.t.Helper()
	v, err := e.rdb.Eval(e.ctx, src, []string{e.k.Ready, e.k.Processing, e.k.Unacked, e.k.Taken, e.k.Deliveries}, 100).Slice()
	if err != nil || len(v) != 2 || mustItem(e.t, v[0].(string)).ID != id {
		e.t.Fatalf("older consumer's take: %v, %v; want %s", v, err, id)
	}
}

// oldRecoverAll runs an older daemon's forward (no number dropped) with
// ack timeout 0.
func (e *refusalEnv) oldRecoverAll(src string, fwd queue.ForwardArgs) {
	e.t.Helper()
	keys := []string{e.k.Queue, e.k.Payload, e.k.Paused, e.k.Ready, e.k.Dead, e.k.DeadInfo, e.k.Unacked, e.k.Taken, e.k.Processing, e.k.Deliveries}
	if err := e.rdb.Eval(e.ctx, src, keys, fwd.Kind, fwd.Limit, fwd.MaxLen, fwd.Queue, "1", 0, fwd.MaxAttempts).Err(); err != nil {
		e.t.Fatalf("older daemon's forward: %v", err)
	}
}

// laterThan waits until Redis's clock has passed the millisecond it was
// taken in (the number's time, "<seq>-<Unix µs>"): a recovery returns an
// item only ack_timeout after its take, which these tests compress to
// nothing, so a take that follows one is in a later millisecond.
func (e *refusalEnv) laterThan(it queue.ListItem) {
	e.t.Helper()
	_, us, _ := strings.Cut(it.Delivery, "-")
	taken, err := strconv.ParseInt(us, 10, 64)
	if err != nil {
		e.t.Fatalf("delivery %q: %v", it.Delivery, err)
	}
	for {
		now, err := e.st.Now(e.ctx)
		if err != nil {
			e.t.Fatal(err)
		}
		if now.UnixMilli() > taken/1000 {
			return
		}
	}
}

// snapshot DUMPs every key of the (private) server; rollback puts the
// server back to exactly that: what a failover to a replica that missed
// the primary's writes since does.
func (e *refusalEnv) snapshot() map[string]string {
	e.t.Helper()
	keys, err := e.rdb.Keys(e.ctx, "*").Result()
	if err != nil {
		e.t.Fatal(err)
	}
	out := map[string]string{}
	for _, k := range keys {
		d, err := e.rdb.Dump(e.ctx, k).Result()
		if err != nil {
			e.t.Fatal(err)
		}
		out[k] = d
	}
	return out
}

func (e *refusalEnv) rollback(snap map[string]string) {
	e.t.Helper()
	keys, err := e.rdb.Keys(e.ctx, "*").Result()
	if err != nil {
		e.t.Fatal(err)
	}
	if len(keys) > 0 {
		if err := e.rdb.Del(e.ctx, keys...).Err(); err != nil {
			e.t.Fatal(err)
		}
	}
	for k, d := range snap {
		if err := e.rdb.Restore(e.ctx, k, 0, d).Err(); err != nil {
			e.t.Fatal(err)
		}
	}
}

// A1. Redis going back in time (a failover to a replica that missed the
// primary's last writes) takes the sequence back with everything else,
// while the consumer that took under the lost write still holds its
// number. The primary forwarded F-0 and consumer A took it; the promoted
// replica had neither. The producer rewrote F-0 with a new payload, the
// daemon forwarded it, consumer B took it — with the same sequence
// number. A's ack (it handled the old payload) must not acknowledge B's
// delivery: the number's time part differs.
func TestAdvAckDeliveryNumberRepeatsAfterRedisGoesBackInTime(t *testing.T) {
	e := newRefusalEnv(t)
	now, err := e.st.Now(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	d := queue.DeadlineMillis(now.Add(-time.Minute))
	e.putAt("F-0", d, `{"v":1}`)
	fwd := queue.ForwardArgs{Kind: "list", Limit: 10, Queue: "refuse:q", Reliable: true, AckTimeout: time.Minute, MaxAttempts: 10}
	snap := e.snapshot() // what the replica has

	if res, err := e.st.Forward(e.ctx, fwd); err != nil || res.Forwarded != 1 {
		t.Fatalf("forward: %+v, %v", res, err)
	}
	a := e.take("F-0") // consumer A, on the old primary
	e.rollback(snap)   // failover: the forward and A's take are lost

	r, err := e.st.PutTask(e.ctx, queue.ModeReschedule, queue.WriterClient, queue.TaskWrite{ID: "F-0", DeadlineMS: d + 1, Payload: `{"v":2}`})
	if err != nil || r.Result != queue.ResultMoved {
		t.Fatalf("producer's reschedule: %+v, %v", r, err)
	}
	if res, err := e.st.Forward(e.ctx, fwd); err != nil || res.Forwarded != 1 {
		t.Fatalf("forward on the new primary: %+v, %v", res, err)
	}
	b := e.take("F-0") // consumer B, which then crashes
	if string(b.Payload) != `{"v":2}` {
		t.Fatalf("B took %s, want the rewritten task", b.Payload)
	}
	t.Logf("A's delivery %q, B's %q", a.Delivery, b.Delivery)
	ok, err := e.st.AckTaken(e.ctx, "F-0", a.Delivery) // A, done with {"v":1}
	if err != nil {
		t.Fatal(err)
	}
	if ok {
		t.Errorf("A's ack of a delivery the failover lost answered true: it acknowledged B's delivery %q of the newer task", b.Delivery)
	}
	e.recoverAll(fwd)
	if _, with := e.copies("F-0", `"v":2`); with != 1 {
		t.Errorf("after A's ack and a recovery: %d copies of the newer task (B crashed), want 1", with)
	}
}

// A2. An item whose id is "" (of the forward's shape with an empty id,
// which no daemon writes but a foreign LPUSH can; split_item keys it by
// "") is taken, numbered and acknowledged like any other, and touches no
// other id's number or the sequence: a late ack of an earlier delivery
// of another id still matches nothing.
func TestAdvAckEmptyIDItemResetsTheDeliveryCounter(t *testing.T) {
	e := newRefusalEnv(t)
	fwd := e.listed("E-0", 10)
	first := e.take("E-0") // slower than the ack timeout
	e.recoverAll(fwd)
	// A foreign item with an empty id, taken next (the right end).
	if err := e.rdb.RPush(e.ctx, e.k.Ready, `{"id":"","deadline_ms":1,"payload":1}`).Err(); err != nil {
		t.Fatal(err)
	}
	empty := e.take("")
	if ok, err := e.st.AckTaken(e.ctx, "", empty.Delivery); err != nil || !ok {
		t.Fatalf("ack of the empty-id item: %v, %v", ok, err)
	}
	second := e.take("E-0") // another consumer, which then crashes
	t.Logf("deliveries: first %q, empty id %q, second %q", first.Delivery, empty.Delivery, second.Delivery)
	if second.Delivery == first.Delivery {
		t.Errorf("the second delivery of E-0 got number %q again: the empty id's ack dropped the sequence", second.Delivery)
	}
	ok, err := e.st.AckTaken(e.ctx, "E-0", first.Delivery)
	if err != nil {
		t.Fatal(err)
	}
	if ok {
		t.Errorf("the late ack of E-0's first delivery answered true: it acknowledged the second")
	}
	e.recoverAll(fwd)
	if all, _ := e.copies("E-0", ""); all != 1 {
		t.Errorf("after the late ack and a recovery: %d copies of E-0 (its consumer crashed), want 1", all)
	}
}

// A3. A newer consumer beside an older daemon and an older consumer (a
// rolling update that broke the documented order: the daemon first):
// the older daemon's recovery leaves a returned delivery's number under
// its id, and the older consumer's take writes none. The newer consumer's
// late ack must still not match the older consumer's delivery: the
// number's time is not the id's take time ({Q}:unacked) any more.
func TestAdvAckLateNewAckMatchesAnOlderConsumersDeliveryBesideAnOlderDaemon(t *testing.T) {
	e := newRefusalEnv(t)
	fwd := e.listed("G-0", 10)
	first := e.take("G-0") // a newer consumer, slower than the ack timeout
	e.laterThan(first)
	e.oldRecoverAll(olderForward(t), fwd)
	if !e.rdb.HExists(e.ctx, e.k.DeliveryIDs, "G-0").Val() {
		t.Fatal("the older daemon's recovery dropped the number: the test proves nothing")
	}
	e.oldTake(olderTake(t), "G-0") // an older consumer, which then crashes
	ok, err := e.st.AckTaken(e.ctx, "G-0", first.Delivery)
	if err != nil {
		t.Fatal(err)
	}
	if ok {
		t.Errorf("the newer consumer's late ack answered true: it acknowledged the older consumer's delivery")
	}
	e.oldRecoverAll(olderForward(t), fwd)
	if all, _ := e.copies("G-0", ""); all != 1 {
		t.Errorf("after the late ack and a recovery: %d copies of G-0, want 1", all)
	}
}

// A5. The ack and the recovery drop the delivery's number first: refused
// at that HDEL (HDEL refused on {Q}:deliveryids alone, an ACL selector),
// they change nothing else, so the delivery stays taken whole; the
// consumer's retry of its ack (it saw an error) then succeeds, and the
// next recovery returns the item, whose late ack matches nothing. Dropped
// last (the first cut), the number outlived the records, and an older
// consumer's take of the id was then matched by it.
func TestAdvAckNumberLeftByARefusedHdelMatchesAnOlderConsumersDelivery(t *testing.T) {
	for _, where := range []string{"ack", "recovery"} {
		t.Run(where, func(t *testing.T) {
			e := newRefusalEnv(t)
			fwd := e.listed("H-0", 10)
			first := e.take("H-0")
			others := []string{e.k.Processing, e.k.Unacked, e.k.Taken, e.k.Deliveries, e.k.Ready, e.k.Queue, e.k.Payload, e.k.Dead, e.k.DeadInfo}
			before := e.snapshot()
			e.refusedExcept("hdel", others, func() error {
				if where == "ack" {
					_, err := e.st.AckTaken(e.ctx, "H-0", first.Delivery)
					return err
				}
				f := fwd
				f.AckTimeout = 0
				_, err := e.st.Forward(e.ctx, f)
				return err
			})
			after := e.snapshot()
			for k, v := range before {
				if after[k] != v {
					t.Errorf("%s refused at the number's HDEL changed %s", where, k)
				}
			}
			if len(after) != len(before) {
				t.Errorf("%s refused at the number's HDEL: %d keys, %d before", where, len(after), len(before))
			}
			if where == "ack" {
				if ok, err := e.st.AckTaken(e.ctx, "H-0", first.Delivery); err != nil || !ok {
					t.Fatalf("the retried ack: %v, %v; want it to acknowledge the delivery", ok, err)
				}
				if all, _ := e.copies("H-0", ""); all != 0 {
					t.Errorf("after the retried ack: %d copies of H-0, want 0", all)
				}
				return
			}
			e.laterThan(first)
			e.recoverAll(fwd)
			e.oldTake(olderTake(t), "H-0") // an older consumer, which then crashes
			if ok, err := e.st.AckTaken(e.ctx, "H-0", first.Delivery); err != nil || ok {
				t.Errorf("late ack after the recovery: %v, %v; want false", ok, err)
			}
			e.recoverAll(fwd)
			if all, _ := e.copies("H-0", ""); all != 1 {
				t.Errorf("after that ack and a recovery: %d copies of H-0, want 1", all)
			}
		})
	}
}

// A bounded random walk over takes, current and late acks, recoveries
// and producers' writes of a few ids, with this daemon and this client
// only: an ack succeeds iff its delivery is its id's current one, every
// forwarded task not acknowledged is in a list or queued, and no number
// is kept for an id nobody has taken.
func TestAdvAckRandomWalkNewVersionsOnly(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("ORDERDELAY_ADV_SEED"); s != "" {
		seed, _ = strconv.ParseUint(s, 10, 64)
	}
	t.Logf("seed %d (ORDERDELAY_ADV_SEED replays it)", seed)
	rng := rand.New(rand.NewPCG(seed, 7))
	e := newRefusalEnv(t)
	fwd := queue.ForwardArgs{Kind: "list", Limit: 100, Queue: "refuse:q", Reliable: true, AckTimeout: time.Minute, MaxAttempts: 1000}
	ids := []string{"W-0", "W-1", "W-2"}
	current := map[string]string{}     // id -> its taken delivery's number
	held := []queue.ListItem{}         // every item a consumer got, acked or not
	outstanding := map[string]string{} // payload token -> id: forwarded or queued, not acknowledged
	queued := map[string]bool{}
	n := 0
	for step := range 400 {
		switch rng.IntN(6) {
		case 0: // put
			id := ids[rng.IntN(len(ids))]
			if queued[id] {
				continue
			}
			now, err := e.st.Now(e.ctx)
			if err != nil {
				t.Fatal(err)
			}
			n++
			tok := fmt.Sprintf(`"n":%d`, n)
			e.putAt(id, queue.DeadlineMillis(now.Add(-time.Second)), "{"+tok+"}")
			queued[id] = true
			outstanding[tok] = id
		case 1: // forward
			if _, err := e.st.Forward(e.ctx, fwd); err != nil {
				t.Fatal(err)
			}
			queued = map[string]bool{}
		case 2, 3: // take
			it, err := e.st.Take(e.ctx)
			if err != nil {
				continue
			}
			if current[it.ID] != "" {
				t.Fatalf("seed %d step %d: %s taken twice at once", seed, step, it.ID)
			}
			current[it.ID] = it.Delivery
			held = append(held, it)
		case 4: // ack, current or late
			if len(held) == 0 {
				continue
			}
			it := held[rng.IntN(len(held))]
			ok, err := e.st.AckTaken(e.ctx, it.ID, it.Delivery)
			if err != nil {
				t.Fatal(err)
			}
			if want := current[it.ID] == it.Delivery; ok != want {
				t.Fatalf("seed %d step %d: ack of %s delivery %s answered %v, want %v", seed, step, it.ID, it.Delivery, ok, want)
			}
			if ok {
				delete(current, it.ID)
				for tok, id := range outstanding {
					if id == it.ID && "{"+tok+"}" == string(it.Payload) {
						delete(outstanding, tok)
					}
				}
			}
		case 5: // recovery: every taken item is past its ack timeout
			e.recoverAll(fwd)
			current = map[string]string{}
		}
		for tok, id := range outstanding {
			_, with := e.copies(id, tok)
			if with == 0 && e.rdb.ZScore(e.ctx, e.k.Queue, id).Err() != nil {
				t.Fatalf("seed %d step %d: task %s {%s} in no list and not queued", seed, step, id, tok)
			}
		}
		fields, err := e.rdb.HKeys(e.ctx, e.k.DeliveryIDs).Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range fields {
			if !e.rdb.HExists(e.ctx, e.k.Taken, f).Val() {
				t.Fatalf("seed %d step %d: number left for %s, not taken", seed, step, f)
			}
		}
	}
}
