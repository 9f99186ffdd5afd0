package consumer

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/orderdelay/orderdelay/client"
)

// A list action's max_len caps the ready list: once it holds that many
// items the forward moves nothing more; the rest stay due in the queue
// (not lost, not dead-lettered, no attempt spent) and move when consumers
// drain the list.

func (e *env) putDueN(prefix string, n int) []string {
	e.T.Helper()
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("%s-%d", prefix, i)
		e.putDue(ids[i], `{"n":`+fmt.Sprint(i)+`}`)
	}
	return ids
}

// popIDs pops up to n items from the ready list as a BRPOP consumer would
// and returns their ids.
func (e *env) popIDs(n int) []string {
	e.T.Helper()
	var out []string
	for range n {
		s, err := e.RDB.RPop(context.Background(), e.Keys.Ready).Result()
		if err != nil {
			break
		}
		var it client.ListItem
		if err := json.Unmarshal([]byte(s), &it); err != nil {
			e.T.Fatalf("ready item %q: %v", s, err)
		}
		out = append(out, it.ID)
	}
	return out
}

func TestPlainListStopsAtMaxLenAndResumesWhenDrained(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ids := e.putDueN("t", 5)
	c := e.consumer(Config{Forward: &Forward{Kind: "list", Queue: "l", MaxLen: 3}})
	ctx := context.Background()
	res, err := c.claim(ctx, 100)
	if err != nil {
		t.Fatal(err)
	}
	if res.forwarded != 3 || e.llen(e.Keys.Ready) != 3 || e.card(e.Keys.Queue) != 2 {
		t.Fatalf("forwarded %d, ready %d, queued %d; want 3, 3, 2 under max_len 3",
			res.forwarded, e.llen(e.Keys.Ready), e.card(e.Keys.Queue))
	}
	res, err = c.claim(ctx, 100)
	if err != nil {
		t.Fatal(err)
	}
	if res.forwarded != 0 || e.card(e.Keys.Queue) != 2 {
		t.Fatalf("a pass on a full list forwarded %d, left %d queued; want 0 and 2", res.forwarded, e.card(e.Keys.Queue))
	}
	// The scanner must not spin on the overdue head while the list is full.
	if res.nextQueue <= res.now {
		t.Fatalf("next look at %d, now %d: the scanner would loop without pause on a full list", res.nextQueue, res.now)
	}
	if !c.listFull || testutil.ToFloat64(e.m.ReadyFull) != 1 {
		t.Errorf("the full list was not noted: %v, gauge %v", c.listFull, testutil.ToFloat64(e.m.ReadyFull))
	}
	if n := e.card(e.Keys.Dead); n != 0 {
		t.Fatalf("%d dead letters: waiting for room is not a failure", n)
	}
	// The waiting tasks keep their payloads and deadlines.
	for _, id := range []string{"t-3", "t-4"} {
		tk, err := e.cl.GetTask(ctx, id)
		if err != nil || tk.Attempts != 0 || len(tk.Payload) == 0 {
			t.Fatalf("waiting task %s: %+v, %v", id, tk, err)
		}
	}
	got := e.popIDs(2) // consumers drain two
	res, err = c.claim(ctx, 100)
	if err != nil {
		t.Fatal(err)
	}
	if res.forwarded != 2 || e.card(e.Keys.Queue) != 0 || c.listFull || testutil.ToFloat64(e.m.ReadyFull) != 0 {
		t.Fatalf("after draining two: forwarded %d, %d queued, full %v; want 2, 0, false", res.forwarded, e.card(e.Keys.Queue), c.listFull)
	}
	got = append(got, e.popIDs(10)...)
	slices.Sort(got)
	if !slices.Equal(got, ids) {
		t.Fatalf("delivered %q, want each of %q once", got, ids)
	}
}

// A reliable list: taken items leave the ready list, making room; items
// whose ack_timeout passed come back even when the list is full (they are
// not held back: the cap bounds new items only).
func TestReliableListStopsAtMaxLen(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	e.putDueN("r", 4)
	cfg := reliableList(time.Minute, 5)
	cfg.Forward.MaxLen = 2
	if res := e.forwardOnce(cfg); res.forwarded != 2 || e.card(e.Keys.Queue) != 2 {
		t.Fatalf("forwarded %d, %d queued; want 2 and 2", res.forwarded, e.card(e.Keys.Queue))
	}
	it, err := e.cl.Take(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if res := e.forwardOnce(cfg); res.forwarded != 1 || e.llen(e.Keys.Ready) != 2 || e.card(e.Keys.Queue) != 1 {
		t.Fatalf("after one Take: forwarded %d, ready %d, queued %d; want 1, 2, 1",
			res.forwarded, e.llen(e.Keys.Ready), e.card(e.Keys.Queue))
	}
	e.takenAgo(it.ID, 2*time.Minute)
	res := e.forwardOnce(cfg)
	if res.forwarded != 0 || e.llen(e.Keys.Ready) != 3 || e.card(e.Keys.Queue) != 1 || e.llen(e.Keys.Processing) != 0 {
		t.Fatalf("recovery on a full list: forwarded %d, ready %d, queued %d, processing %d; want 0, 3, 1, 0",
			res.forwarded, e.llen(e.Keys.Ready), e.card(e.Keys.Queue), e.llen(e.Keys.Processing))
	}
	if n := e.card(e.Keys.Dead); n != 0 {
		t.Fatalf("%d dead letters", n)
	}
	for range 3 {
		it, err := e.cl.Take(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := e.cl.Ack(ctx, it); err != nil {
			t.Fatal(err)
		}
	}
	if res := e.forwardOnce(cfg); res.forwarded != 1 || e.card(e.Keys.Queue) != 0 {
		t.Fatalf("drained: forwarded %d, %d queued; want the last one moved", res.forwarded, e.card(e.Keys.Queue))
	}
}

// The daemon's own loop: a full list holds the rest back, a consumer that
// drains it gets every task, once.
func TestListCapUnderARunningConsumer(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ids := e.putDueN("u", 7)
	stop := runConsumer(t, e.consumer(Config{Forward: &Forward{Kind: "list", Queue: "l", MaxLen: 2}}))
	defer stop()
	var got []string
	eventually(t, "every task delivered through a list of at most 2", 30*time.Second, func() bool {
		if n := e.llen(e.Keys.Ready); n > 2 {
			t.Fatalf("ready list holds %d, max_len 2", n)
		}
		got = append(got, e.popIDs(1)...)
		return len(got) == len(ids)
	})
	slices.Sort(got)
	if !slices.Equal(got, ids) {
		t.Fatalf("delivered %q, want each of %q once", got, ids)
	}
}
