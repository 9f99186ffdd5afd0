package queue_test

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/orderdelay/orderdelay/internal/queue"
)

// The reliable list's take, ack and recovery (forwardScript) against each
// other, against producers writing the same id again, and against
// commands refused mid-script (see refusal_adv_test.go), after the reorder
// of 68672c8..2df58b9: the take counts the delivery last, the ack and the
// recovery drop the taken record before the {q}:unacked entry, and the
// recovery looks for an item it finds in no processing list in the ready
// list too.

// take takes the next item, requiring id.
func (e *refusalEnv) take(id string) queue.ListItem {
	e.t.Helper()
	it, err := e.st.Take(e.ctx)
	if err != nil || it.ID != id {
		e.t.Fatalf("take: %+v, %v; want %s", it, err, id)
	}
	return it
}

// recoverAll runs a forward with ack timeout 0, as once the timeout has
// passed for everything taken.
func (e *refusalEnv) recoverAll(fwd queue.ForwardArgs) queue.ForwardResult {
	e.t.Helper()
	fwd.AckTimeout = 0
	res, err := e.st.Forward(e.ctx, fwd)
	if err != nil {
		e.t.Fatal(err)
	}
	return res
}

// copies counts the items of id in the ready and processing lists, and
// those whose payload contains sub.
func (e *refusalEnv) copies(id, sub string) (all, with int) {
	e.t.Helper()
	for _, l := range []string{e.k.Ready, e.k.Processing} {
		items, err := e.rdb.LRange(e.ctx, l, 0, -1).Result()
		if err != nil {
			e.t.Fatal(err)
		}
		for _, it := range items {
			if strings.Contains(it, `"id":"`+id+`"`) {
				all++
				if strings.Contains(it, sub) {
					with++
				}
			}
		}
	}
	return all, with
}

// putAt puts task id with deadline d (ms) and payload p, requiring it new.
func (e *refusalEnv) putAt(id string, d int64, p string) {
	e.t.Helper()
	r, err := e.st.PutTask(e.ctx, queue.ModeCreate, queue.WriterClient, queue.TaskWrite{ID: id, DeadlineMS: d, Payload: p})
	if err != nil || r.Result != queue.ResultCreated {
		e.t.Fatalf("put %s: %+v, %v", id, r, err)
	}
}

func (e *refusalEnv) isDead(id string) bool {
	return e.rdb.ZScore(e.ctx, e.k.Dead, id).Err() == nil
}

// An ack refused after it dropped the taken record (at its ZREM of
// {q}:unacked: an ACL without ZREM) must not leave the id's delivery
// count behind: the recovery drops the lone entry, and the next task a
// producer writes with the id would start from the old count — reported
// with Attempts 1 on its first delivery, and dead-lettered (max_attempts
// 2) after the one delivery it had. The order before the reorder (ZREM
// before the record's HDEL) kept the record and the count together, and
// the recovery redelivered the item at its own count.
func TestAdvAckRefusedAtItsZremLeavesNoCountForTheNextTaskOfTheID(t *testing.T) {
	for _, cmd := range []string{"zrem", "hdel"} {
		t.Run("-"+cmd, func(t *testing.T) {
			e := newRefusalEnv(t)
			fwd := e.listed("A-0", 2)
			first := e.take("A-0")
			e.refused(cmd, func() error {
				_, err := e.st.AckTaken(e.ctx, "A-0", first.Delivery)
				return err
			})
			e.recoverAll(fwd)
			// What the refused ack left is delivered again (at least once)
			// and acknowledged, or was gone; either way the next task of
			// the id starts on its first delivery.
			if all, _ := e.copies("A-0", ""); all > 0 {
				it := e.take("A-0")
				if it.Attempts != 1 {
					t.Errorf("ack refused %s, a recovery: the redelivery has Attempts %d, want 1", cmd, it.Attempts)
				}
				if ok, err := e.st.AckTaken(e.ctx, "A-0", it.Delivery); err != nil || !ok {
					t.Fatalf("ack: %v, %v", ok, err)
				}
			}
			e.putTasks("A-0")
			if res, err := e.st.Forward(e.ctx, fwd); err != nil || res.Forwarded != 1 {
				t.Fatalf("forward: %+v, %v", res, err)
			}
			if it := e.take("A-0"); it.Attempts != 0 {
				t.Errorf("ack refused %s: the next task of the id has Attempts %d on its first delivery, want 0", cmd, it.Attempts)
			}
			e.recoverAll(fwd)
			if e.isDead("A-0") {
				t.Errorf("ack refused %s: the next task of the id dead-lettered (max_attempts 2) after one delivery", cmd)
			}
			if all, _ := e.copies("A-0", ""); all != 1 {
				t.Errorf("ack refused %s: %d copies of the next task after its recovery, want 1", cmd, all)
			}
		})
	}
}

// A take refused at its LMOVE (the item stays in the ready list, recorded
// as taken) while a producer wrote the id again — once with the same
// bytes (a retried put: same deadline, same payload), once with a new
// payload — and forwarded it: the recovery's LREM of the ready list takes
// one copy out and puts it back, so both stay, each delivered once, the
// first on its first delivery.
func TestAdvRecoveryOfARefusedTakeKeepsEveryCopyAProducerWrote(t *testing.T) {
	for _, same := range []bool{true, false} {
		name := map[bool]string{true: "same-bytes", false: "new-payload"}[same]
		t.Run(name, func(t *testing.T) {
			e := newRefusalEnv(t)
			fwd := e.listed("R-0", 1)
			items, err := e.rdb.LRange(e.ctx, e.k.Ready, 0, -1).Result()
			if err != nil || len(items) != 1 {
				t.Fatalf("ready: %q, %v", items, err)
			}
			first := mustItem(t, items[0])
			e.refused("lmove", func() error {
				_, err := e.st.Take(e.ctx)
				return err
			})
			p := `{"n":0}`
			if !same {
				p = `{"v":2}`
			}
			e.putAt("R-0", first.DeadlineMS, p)
			if res, err := e.st.Forward(e.ctx, fwd); err != nil || res.Forwarded != 1 {
				t.Fatalf("forward of the second task: %+v, %v", res, err)
			}
			e.recoverAll(fwd)
			if all, _ := e.copies("R-0", ""); all != 2 {
				t.Fatalf("after the recovery: %d copies of R-0, want 2", all)
			}
			if e.isDead("R-0") {
				t.Fatalf("R-0 dead-lettered (max_attempts 1) with no delivery")
			}
			a := e.take("R-0")
			if _, err := e.st.Take(e.ctx); !errors.Is(err, queue.ErrNothingToTake) {
				t.Fatalf("second take while R-0 is taken: %v, want nothing to take", err)
			}
			if ok, err := e.st.AckTaken(e.ctx, "R-0", a.Delivery); err != nil || !ok {
				t.Fatalf("ack: %v, %v", ok, err)
			}
			b := e.take("R-0")
			if a.Attempts != 0 || b.Attempts != 0 {
				t.Errorf("attempts %d and %d, want 0 and 0", a.Attempts, b.Attempts)
			}
			if !same && string(a.Payload)+string(b.Payload) != `{"n":0}{"v":2}` {
				t.Errorf("payloads %s then %s, want the first task's then the second's", a.Payload, b.Payload)
			}
		})
	}
}

// The ack and the recovery in either order: ack first, the recovery finds
// nothing; recovery first, the late ack answers false and the item is in
// the ready list once; each a delivery counted.
func TestAdvAckAndRecoveryInEitherOrderKeepOneCopy(t *testing.T) {
	t.Run("ack-first", func(t *testing.T) {
		e := newRefusalEnv(t)
		fwd := e.listed("O-0", 3)
		it := e.take("O-0")
		if ok, err := e.st.AckTaken(e.ctx, "O-0", it.Delivery); err != nil || !ok {
			t.Fatalf("ack: %v, %v", ok, err)
		}
		if res := e.recoverAll(fwd); res.Recovered != 0 {
			t.Errorf("recovery after the ack recovered %d", res.Recovered)
		}
		if all, _ := e.copies("O-0", ""); all != 0 || e.isDead("O-0") {
			t.Errorf("after ack and recovery: %d copies, dead %v; want none", all, e.isDead("O-0"))
		}
	})
	t.Run("recovery-first", func(t *testing.T) {
		e := newRefusalEnv(t)
		fwd := e.listed("O-0", 3)
		it := e.take("O-0")
		if res := e.recoverAll(fwd); res.Recovered != 1 {
			t.Errorf("recovery recovered %d, want 1", res.Recovered)
		}
		if ok, err := e.st.AckTaken(e.ctx, "O-0", it.Delivery); err != nil || ok {
			t.Errorf("late ack: %v, %v; want false", ok, err)
		}
		if all, _ := e.copies("O-0", ""); all != 1 {
			t.Errorf("after recovery and a late ack: %d copies, want 1", all)
		}
		if it := e.take("O-0"); it.Attempts != 1 {
			t.Errorf("redelivery Attempts %d, want 1", it.Attempts)
		}
	})
}

// A take refused at the HINCRBY of its delivery count (an ACL without it
// but on {q}:deliveryseq, whose HINCRBY numbered the delivery first) has
// moved the item to the processing list with its records: the poller got
// an error, not the item, and the recovery returns it after the ack
// timeout without an attempt spent, even at max_attempts 1.
func TestAdvTakeRefusedAtItsHincrbyIsReturnedUncounted(t *testing.T) {
	e := newRefusalEnv(t)
	fwd := e.listed("H-0", 1)
	var it queue.ListItem
	e.refusedExcept("hincrby", []string{e.k.DeliverySeq}, func() error {
		var err error
		it, err = e.st.Take(e.ctx)
		return err
	})
	if it.ID != "" {
		t.Errorf("refused take handed out %+v", it)
	}
	if res := e.recoverAll(fwd); res.Recovered != 1 || len(res.Dead) != 0 {
		t.Errorf("recovery: %+v; want H-0 returned, none dead", res)
	}
	if got := e.take("H-0"); got.Attempts != 0 {
		t.Errorf("after the recovery: Attempts %d, want 0", got.Attempts)
	}
}

func mustItem(t *testing.T, s string) queue.ListItem {
	t.Helper()
	var it queue.ListItem
	if err := json.Unmarshal([]byte(s), &it); err != nil {
		t.Fatal(err)
	}
	return it
}

// A consumer whose delivery the recovery returned (it was slower than the
// ack timeout) acknowledges late, after the item was delivered again and
// acknowledged, and the producer wrote the id again with a new payload.
// When acks named only the id, the late ack found the newer task's taken
// record and removed it — the newer task, taken by another consumer (or
// by a take refused at its delivery count, which has moved it into the
// processing list and delivered it to no one), was then in no list and no
// recovery reached it. An ack names its delivery's number now (see
// takeScript): the late one acknowledges nothing.
func TestAdvLateAckOfARecoveredDeliveryLeavesANewerTask(t *testing.T) {
	for _, refused := range []bool{false, true} {
		name := map[bool]string{false: "taken", true: "take-refused-at-hincrby"}[refused]
		t.Run(name, func(t *testing.T) {
			e := newRefusalEnv(t)
			fwd := e.listed("L-0", 10)
			first := e.take("L-0") // consumer 1, slower than the ack timeout
			e.recoverAll(fwd)
			second := e.take("L-0") // consumer 2
			if ok, err := e.st.AckTaken(e.ctx, "L-0", second.Delivery); err != nil || !ok {
				t.Fatalf("consumer 2's ack: %v, %v", ok, err)
			}
			e.putAt("L-0", first.DeadlineMS+1, `{"v":2}`)
			if res, err := e.st.Forward(e.ctx, fwd); err != nil || res.Forwarded != 1 {
				t.Fatalf("forward of the newer task: %+v, %v", res, err)
			}
			if refused {
				e.refusedExcept("hincrby", []string{e.k.DeliverySeq}, func() error {
					_, err := e.st.Take(e.ctx)
					return err
				})
			} else {
				e.take("L-0") // consumer 3, which then crashes
			}
			ok, err := e.st.AckTaken(e.ctx, "L-0", first.Delivery) // consumer 1, late
			if err != nil {
				t.Fatal(err)
			}
			if ok {
				t.Errorf("consumer 1's late ack answered true: it acknowledged a later delivery")
			}
			e.recoverAll(fwd)
			if _, with := e.copies("L-0", `"v":2`); with != 1 {
				t.Errorf("consumer 1's late ack (answered %v) and a recovery: %d copies of the newer task, want 1", ok, with)
			}
		})
	}
}

// An ack refused at the HDEL of its count (after its LREM took the item
// out of the processing list), or a recovery refused at its RPUSH (after its
// LREM did), leaves the delivered item in no list, recorded as taken at
// its count: the next recovery delivers it again, or dead-letters it at
// max_attempts. A producer's retried put of the id (same deadline, same
// payload: the same bytes) forwarded meanwhile puts an identical item in
// the ready list, and the recovery's second LREM takes it for an item a
// refused take never moved: it drops the records and keeps the old
// delivery's count for the newer task, whose first delivery is then
// counted as the old one's second and dead-letters it (max_attempts 2)
// after its one delivery. Before the reorder the recovery pushed the old
// item back beside it (the refused recovery; the refused ack left a
// record no recovery reached, since fixed) and the newer task kept a
// count of its own.
func TestAdvRecoveryOfARefusedAckKeepsTheCountOfAnIdenticalRePut(t *testing.T) {
	advRepro(t, "the recovery cannot tell an item a refused take never moved from an identical item a producer wrote while a refused ack or recovery had taken the delivered one out of the processing list: telling them apart needs a mark in the taken record that the take clears once the item has moved")
	for _, refused := range []string{"ack-hdel", "recovery-rpush"} {
		t.Run(refused, func(t *testing.T) {
			e := newRefusalEnv(t)
			fwd := e.listed("I-0", 2)
			first := e.take("I-0")
			if refused == "ack-hdel" {
				// Refused at the count's HDEL, after the LREM: the number's
				// HDEL, which comes first, is let through.
				e.refusedExcept("hdel", []string{e.k.DeliveryIDs}, func() error {
					_, err := e.st.AckTaken(e.ctx, "I-0", first.Delivery)
					return err
				})
			} else {
				e.refused("rpush", func() error {
					fwd := fwd
					fwd.AckTimeout = 0
					_, err := e.st.Forward(e.ctx, fwd)
					return err
				})
			}
			e.putAt("I-0", first.DeadlineMS, `{"n":0}`)
			if res, err := e.st.Forward(e.ctx, fwd); err != nil || res.Forwarded != 1 {
				t.Fatalf("forward of the re-put: %+v, %v", res, err)
			}
			e.recoverAll(fwd)
			for range 2 {
				if all, _ := e.copies("I-0", ""); all == 0 {
					break
				}
				e.take("I-0") // and not acknowledged
				e.recoverAll(fwd)
			}
			if all, _ := e.copies("I-0", ""); e.isDead("I-0") && all == 0 {
				t.Errorf("%s refused: the re-put task is dead-lettered (max_attempts 2) and in no list after one delivery of its own", refused)
			}
		})
	}
}

// A consumer older than delivery numbers takes with a script that writes
// none. After a newer consumer's delivery was returned (slower than the
// ack timeout) and an older consumer took the item again, the newer
// consumer's late ack must not match that delivery: the recovery drops a
// returned delivery's number, so the late ack finds none.
func TestLateAckDoesNotMatchADeliveryAnOlderConsumerTook(t *testing.T) {
	e := newRefusalEnv(t)
	fwd := e.listed("M-0", 10)
	first := e.take("M-0") // a current consumer, slower than the ack timeout
	if res := e.recoverAll(fwd); res.Recovered != 1 {
		t.Fatalf("recovery recovered %d, want 1", res.Recovered)
	}
	if n, err := e.rdb.HExists(e.ctx, e.k.DeliveryIDs, "M-0").Result(); err != nil || n {
		t.Fatalf("after the recovery M-0 still has a delivery number (%v, %v)", n, err)
	}
	old := scriptsBeforeReorder(t)["takeScript"] // an older consumer's take
	v, err := e.rdb.Eval(e.ctx, old, []string{e.k.Ready, e.k.Processing, e.k.Unacked, e.k.Taken, e.k.Deliveries}, 100).Slice()
	if err != nil || len(v) != 2 || mustItem(t, v[0].(string)).ID != "M-0" {
		t.Fatalf("the older consumer's take: %v, %v", v, err)
	}
	if ok, err := e.st.AckTaken(e.ctx, "M-0", first.Delivery); err != nil || ok {
		t.Errorf("late ack of the returned delivery: %v, %v; want false (the older consumer holds M-0)", ok, err)
	}
	if all, _ := e.copies("M-0", ""); all != 1 || !e.rdb.HExists(e.ctx, e.k.Taken, "M-0").Val() {
		t.Errorf("after the late ack: %d copies, taken %v; want the older consumer's delivery, taken", all, e.rdb.HExists(e.ctx, e.k.Taken, "M-0").Val())
	}
}

// A delivery dead-lettered by the recovery (max_attempts reached) loses
// its number with its records: the late ack of it acknowledges nothing,
// and no number is left behind for an id no one holds.
func TestRecoveryDeadLetteringADeliveryDropsItsNumber(t *testing.T) {
	e := newRefusalEnv(t)
	fwd := e.listed("N-0", 1)
	it := e.take("N-0")
	if res := e.recoverAll(fwd); res.Recovered != 1 || !e.isDead("N-0") {
		t.Fatalf("recovery: %+v, dead %v; want N-0 dead-lettered", res, e.isDead("N-0"))
	}
	if f, err := e.rdb.HKeys(e.ctx, e.k.DeliveryIDs).Result(); err != nil || len(f) != 0 {
		t.Errorf("delivery numbers after the dead letter: %q, %v; want none", f, err)
	}
	if ok, err := e.st.AckTaken(e.ctx, "N-0", it.Delivery); err != nil || ok {
		t.Errorf("late ack of the dead-lettered delivery: %v, %v; want false", ok, err)
	}
}
