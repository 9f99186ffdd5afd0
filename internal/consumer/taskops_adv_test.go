package consumer

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/client"
)

// Adversarial interleavings of task-queue operations (requeue, purge)
// with producers and a reliable list's consumers.

// A reliable list tracks a taken item by its id ({KEY}:taken, :unacked).
// A requeue does not see an item waiting in the ready list as live (only
// taken ones), so a dead letter requeued while a newer task of the same
// id waits there puts a second item of that id in the ready list. Two
// consumers then hold the same id at once: the first one's Ack removed the
// second one's delivery from {KEY}:processing and from the records the
// daemon recovers unacknowledged items from, so when the second consumer
// crashed its delivery was gone for good, and the first one's item stayed
// in the processing list forever. Every item taken and not acknowledged
// must stay recoverable.
func TestReliableListRequeueBesideAWaitingItemLosesNothing(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	cfg := reliableList(time.Minute, 5)

	e.buryTask("RL-X", `{"v":"dead"}`) // an earlier task of the id died
	e.putDue("RL-X", `{"v":"live"}`)   // a producer wrote the id again
	if res := e.forwardOnce(cfg); res.forwarded != 1 {
		t.Fatalf("forwarded %d, want 1", res.forwarded)
	}
	if _, err := e.st.RequeueTasks(ctx, []string{"RL-X"}); err != nil {
		t.Fatal(err)
	}
	e.forwardOnce(cfg)

	a, err := e.cl.Take(ctx) // consumer A
	if err != nil || a.ID != "RL-X" {
		t.Fatalf("Take A: %+v, %v", a, err)
	}
	b, errB := e.cl.Take(ctx) // consumer B: takes the other item, if it may
	if errB != nil && !errors.Is(errB, client.ErrNotFound) {
		t.Fatal(errB)
	}
	if err := e.cl.Ack(ctx, a); err != nil { // A is done
		t.Fatalf("Ack A: %v", err)
	}
	// B (if it holds an item) crashes now and never acks.
	taken, _ := e.RDB.HLen(ctx, e.Keys.Taken).Result()
	unacked, _ := e.RDB.ZCard(ctx, e.Keys.Unacked).Result()
	processing := e.llen(e.Keys.Processing)
	ready := e.llen(e.Keys.Ready)
	t.Logf("B took %q (%v); after A's ack: taken %d, unacked %d, processing %d, ready %d",
		b.ID, errB, taken, unacked, processing, ready)
	if processing != taken || unacked != taken {
		t.Errorf("processing list holds %d items but %d are tracked as taken (%d unacked): an item no one can ack or recover",
			processing, taken, unacked)
	}
	if taken+ready != 1 {
		t.Fatalf("after A's ack %d items are taken or ready, want 1 (the other delivery): a delivery was lost", taken+ready)
	}
	// The other delivery comes back after B's ack timeout (or was never
	// taken), and is delivered.
	if taken == 1 {
		e.takenAgo("RL-X", 2*time.Minute)
		e.forwardOnce(cfg)
	}
	it, err := e.cl.Take(ctx)
	if err != nil || it.ID != "RL-X" {
		t.Fatalf("Take of the other delivery: %+v, %v", it, err)
	}
	if err := e.cl.Ack(ctx, it); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{e.Keys.Processing, e.Keys.Ready} {
		if n := e.llen(k); n != 0 {
			t.Errorf("%s holds %d items after both deliveries were acked", k, n)
		}
	}
}

// A requeue must not touch a live task of the same id. A reliable list's
// delivery count ({KEY}:deliveries) is kept per id and cleared when an
// item is dead-lettered, so the only count a requeue can find is that of
// a newer item of the id waiting in the ready list after unacknowledged
// deliveries: the requeue cleared it, and that item was delivered
// max_attempts times more than its queue allows.
func TestRequeueLeavesAWaitingItemsDeliveryCount(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	cfg := reliableList(time.Minute, 3)

	e.buryTask("RL-C", `{"v":"dead"}`)
	e.putDue("RL-C", `{"v":"live"}`)
	e.forwardOnce(cfg)
	for range 2 { // delivered twice, never acknowledged
		if _, err := e.cl.Take(ctx); err != nil {
			t.Fatal(err)
		}
		e.takenAgo("RL-C", 2*time.Minute)
		e.forwardOnce(cfg)
	}
	if outs, err := e.st.RequeueTasks(ctx, []string{"RL-C"}); err != nil {
		t.Fatal(err)
	} else {
		t.Logf("requeue: %v", outs)
	}
	it, err := e.cl.Take(ctx)
	if err != nil || it.ID != "RL-C" {
		t.Fatalf("Take: %+v %v", it, err)
	}
	if it.Attempts != 2 {
		t.Errorf("the waiting item's third delivery shows %d earlier attempts, want 2: the requeue reset its delivery count", it.Attempts)
	}
}
