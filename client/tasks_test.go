package client_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Tests of client/tasks.go on a real Redis, each on a queue of its own
// (testenv.Redis). Helpers shared with the order tests: newClient, ctxT,
// base, zscore, zcard, seedLease (client_test.go) and snapshot
// (durable_test.go).

// payloadOf returns the stored payload of task id and whether there is one.
func payloadOf(t *testing.T, rdb *redis.Client, k queue.Keys, id string) (string, bool) {
	t.Helper()
	p, err := rdb.HGet(ctxT(t), k.Payload, id).Result()
	if errors.Is(err, redis.Nil) {
		return "", false
	}
	if err != nil {
		t.Fatalf("HGET %s %s: %v", k.Payload, id, err)
	}
	return p, true
}

// assertUnchanged fails unless every key of the queue holds what before
// (a snapshot) recorded.
func assertUnchanged(t *testing.T, rdb *redis.Client, k queue.Keys, before map[string]string, what string) {
	t.Helper()
	after := snapshot(t, rdb, k)
	for key, v := range before {
		if after[key] != v {
			t.Errorf("%s changed %s", what, key)
		}
	}
	for key := range after {
		if _, ok := before[key]; !ok {
			t.Errorf("%s created %s", what, key)
		}
	}
}

// seedDead puts id in the dead letters as the daemon does: the dead set,
// the record "reason|attempts|deadline|last error" and the payload.
func seedDead(t *testing.T, rdb *redis.Client, k queue.Keys, id, reason string, attempts int, deadline time.Time, lastErr, payload string) {
	t.Helper()
	ctx := ctxT(t)
	_, err := rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		p.ZAdd(ctx, k.Dead, redis.Z{Score: float64(time.Now().UnixMilli()), Member: id})
		p.HSet(ctx, k.DeadInfo, id, fmt.Sprintf("%s|%d|%d|%s", reason, attempts, deadline.UnixMilli(), lastErr))
		p.HSet(ctx, k.Payload, id, payload)
		return nil
	})
	if err != nil {
		t.Fatalf("seed dead letter: %v", err)
	}
}

// seedLeasedTask is seedLease with the task's payload beside it.
func seedLeasedTask(t *testing.T, rdb *redis.Client, k queue.Keys, id string, deadline time.Time, attempts int, token, lastErr, payload string) {
	t.Helper()
	seedLease(t, rdb, k, id, deadline, deadline.Add(time.Minute), attempts, token, lastErr)
	if err := rdb.HSet(ctxT(t), k.Payload, id, payload).Err(); err != nil {
		t.Fatal(err)
	}
}

func TestPutTaskModes(t *testing.T) {
	d := base()
	const oldP, newP = `{"v":1}`, `{"v":2}`
	tests := []struct {
		name        string
		existing    bool // task "t" exists, due d with payload oldP, before the call
		mode        client.Mode
		due         time.Time // the call's; its payload is newP
		wantResult  client.Result
		wantDue     time.Time
		wantPayload string
	}{
		{"create new", false, client.Create, d, client.Created, d, newP},
		{"create existing changes neither due nor payload", true, client.Create, d.Add(time.Hour), client.Unchanged, d, oldP},
		{"reschedule new creates", false, client.Reschedule, d, client.Created, d, newP},
		{"reschedule later replaces due and payload", true, client.Reschedule, d.Add(time.Hour), client.Moved, d.Add(time.Hour), newP},
		{"reschedule earlier replaces due and payload", true, client.Reschedule, d.Add(-time.Minute), client.Moved, d.Add(-time.Minute), newP},
		// The payload is replaced only when the due time moves (PutTask's doc).
		{"reschedule to the same due keeps the payload", true, client.Reschedule, d, client.Unchanged, d, oldP},
		{"only later new creates", false, client.OnlyLater, d, client.Created, d, newP},
		{"only later later replaces due and payload", true, client.OnlyLater, d.Add(time.Hour), client.Moved, d.Add(time.Hour), newP},
		{"only later earlier keeps both", true, client.OnlyLater, d.Add(-time.Minute), client.Unchanged, d, oldP},
		{"only later same keeps both", true, client.OnlyLater, d, client.Unchanged, d, oldP},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, rdb, k := newClient(t)
			ctx := ctxT(t)
			if tt.existing {
				if res, _, err := c.PutTask(ctx, "t", json.RawMessage(oldP), d, client.Create); err != nil || res != client.Created {
					t.Fatalf("seed: %v, %v", res, err)
				}
			}
			res, at, err := c.PutTask(ctx, "t", json.RawMessage(newP), tt.due, tt.mode)
			if err != nil {
				t.Fatalf("PutTask: %v", err)
			}
			if res != tt.wantResult || !at.Equal(tt.wantDue) {
				t.Errorf("PutTask = %v, %s; want %v, %s", res, at, tt.wantResult, tt.wantDue)
			}
			if got := zscore(t, rdb, k.Queue, "t"); got != tt.wantDue.UnixMilli() {
				t.Errorf("ZSCORE = %d, want %d", got, tt.wantDue.UnixMilli())
			}
			if p, _ := payloadOf(t, rdb, k, "t"); p != tt.wantPayload {
				t.Errorf("payload = %s, want %s", p, tt.wantPayload)
			}
			if n := zcard(t, rdb, k.Queue); n != 1 {
				t.Errorf("ZCARD = %d, want 1", n)
			}
		})
	}
}

// A put without a payload stores JSON null, so GetTask and the actions
// always find one.
func TestPutTaskWithoutPayloadStoresNull(t *testing.T) {
	c, rdb, k := newClient(t)
	if _, _, err := c.PutTask(ctxT(t), "t", nil, base(), client.Create); err != nil {
		t.Fatal(err)
	}
	if p, ok := payloadOf(t, rdb, k, "t"); !ok || p != "null" {
		t.Errorf("payload = %q (present %v), want null", p, ok)
	}
}

// A task a replica holds under a lease (or in backoff) exists: Create and
// an earlier OnlyLater leave the lease and the payload alone; a move takes
// the task back from the lease into the queue with the new payload.
func TestPutTaskOnALeasedTask(t *testing.T) {
	tests := []struct {
		name        string
		mode        client.Mode
		offset      time.Duration
		wantResult  client.Result
		wantMoved   bool
		wantPayload string
	}{
		{"create keeps the lease and payload", client.Create, time.Hour, client.Unchanged, false, `"old"`},
		{"only later earlier keeps the lease", client.OnlyLater, -time.Minute, client.Unchanged, false, `"old"`},
		{"only later later takes it back", client.OnlyLater, time.Hour, client.Moved, true, `"new"`},
		{"reschedule takes it back", client.Reschedule, -time.Minute, client.Moved, true, `"new"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, rdb, k := newClient(t)
			ctx := ctxT(t)
			d := base()
			seedLeasedTask(t, rdb, k, "t", d, 1, "tok", "", `"old"`)
			res, at, err := c.PutTask(ctx, "t", json.RawMessage(`"new"`), d.Add(tt.offset), tt.mode)
			if err != nil {
				t.Fatalf("PutTask: %v", err)
			}
			wantDue := d
			if tt.wantMoved {
				wantDue = d.Add(tt.offset)
			}
			if res != tt.wantResult || !at.Equal(wantDue) {
				t.Errorf("PutTask = %v, %s; want %v, %s", res, at, tt.wantResult, wantDue)
			}
			leased, err := rdb.HExists(ctx, k.Lease, "t").Result()
			if err != nil {
				t.Fatal(err)
			}
			inflight, deadlines, queued := zcard(t, rdb, k.Inflight), zcard(t, rdb, k.Deadlines), zcard(t, rdb, k.Queue)
			if tt.wantMoved {
				if leased || inflight != 0 || deadlines != 0 || queued != 1 {
					t.Errorf("after a move: lease record %v, inflight %d, deadlines %d, queued %d; want only queued", leased, inflight, deadlines, queued)
				}
				if got := zscore(t, rdb, k.Queue, "t"); got != wantDue.UnixMilli() {
					t.Errorf("ZSCORE = %d, want %d", got, wantDue.UnixMilli())
				}
			} else if !leased || inflight != 1 || deadlines != 1 || queued != 0 {
				t.Errorf("after an unchanged put: lease record %v, inflight %d, deadlines %d, queued %d; want the lease untouched", leased, inflight, deadlines, queued)
			}
			if p, _ := payloadOf(t, rdb, k, "t"); p != tt.wantPayload {
				t.Errorf("payload = %s, want %s", p, tt.wantPayload)
			}
		})
	}
}

func TestGetTaskStates(t *testing.T) {
	c, rdb, k := newClient(t)
	ctx := ctxT(t)
	d := base()
	if _, _, err := c.PutTask(ctx, "queued", json.RawMessage(`{"q":1}`), d, client.Create); err != nil {
		t.Fatal(err)
	}
	seedLeasedTask(t, rdb, k, "leased", d, 2, "tok123", "", `{"l":1}`)
	seedLeasedTask(t, rdb, k, "backoff", d, 3, "-", "webhook: 503 from partner.example", `{"b":1}`)
	seedDead(t, rdb, k, "dead", "failed", 4, d, "webhook: 500 from partner.example", `{"d":1}`)

	tests := []struct {
		id          string
		want        client.Entry
		wantPayload string
	}{
		{"queued", client.Entry{Serial: "queued", Deadline: d, State: client.StateQueued}, `{"q":1}`},
		{"leased", client.Entry{Serial: "leased", Deadline: d, State: client.StateLeased, Attempts: 2, Owner: "tok123", Until: d.Add(time.Minute)}, `{"l":1}`},
		{"backoff", client.Entry{Serial: "backoff", Deadline: d, State: client.StateBackoff, Attempts: 3, Until: d.Add(time.Minute),
			LastError: "webhook: 503 from partner.example"}, `{"b":1}`},
		{"dead", client.Entry{Serial: "dead", Deadline: d, State: client.StateDead, Attempts: 4, Reason: "failed",
			LastError: "webhook: 500 from partner.example"}, `{"d":1}`},
	}
	for _, tt := range tests {
		t.Run(tt.id, func(t *testing.T) {
			got, err := c.GetTask(ctx, tt.id)
			if err != nil {
				t.Fatalf("GetTask: %v", err)
			}
			e := got.Entry
			if e.Serial != tt.want.Serial || e.State != tt.want.State || !e.Deadline.Equal(tt.want.Deadline) ||
				e.Attempts != tt.want.Attempts || e.Owner != tt.want.Owner || !e.Until.Equal(tt.want.Until) ||
				e.Reason != tt.want.Reason || e.LastError != tt.want.LastError {
				t.Errorf("GetTask = %+v,\nwant %+v", e, tt.want)
			}
			if string(got.Payload) != tt.wantPayload {
				t.Errorf("payload = %s, want %s", got.Payload, tt.wantPayload)
			}
		})
	}
	t.Run("not found", func(t *testing.T) {
		if got, err := c.GetTask(ctx, "missing"); !errors.Is(err, client.ErrNotFound) {
			t.Errorf("GetTask of a missing task = %+v, %v; want ErrNotFound", got, err)
		}
	})
	t.Run("invalid ids", func(t *testing.T) {
		for _, id := range []string{"", strings.Repeat("x", 129), "a\nb", "a\xffb"} {
			if _, err := c.GetTask(ctx, id); !errors.Is(err, client.ErrInvalidSerial) {
				t.Errorf("GetTask(%q): %v, want ErrInvalidSerial", id, err)
			}
		}
	})
}

// DeleteTasks removes tasks wherever they are, queued, leased, backing off
// or dead, with their payloads and records, and counts those that existed;
// ids that do not exist are counted out, not an error. Other tasks stay.
func TestDeleteTasks(t *testing.T) {
	c, rdb, k := newClient(t)
	ctx := ctxT(t)
	d := base()
	for _, id := range []string{"queued", "keep"} {
		if _, _, err := c.PutTask(ctx, id, json.RawMessage(`"`+id+`"`), d, client.Create); err != nil {
			t.Fatal(err)
		}
	}
	seedLeasedTask(t, rdb, k, "leased", d, 1, "tok", "", `"leased"`)
	seedLeasedTask(t, rdb, k, "backoff", d, 2, "-", "boom", `"backoff"`)
	seedDead(t, rdb, k, "dead", "failed", 3, d, "boom", `"dead"`)

	// "queued" twice: it existed once, so it counts once.
	n, err := c.DeleteTasks(ctx, "missing-1", "queued", "leased", "backoff", "dead", "queued", "missing-2")
	if err != nil {
		t.Fatalf("DeleteTasks: %v", err)
	}
	if n != 4 {
		t.Errorf("DeleteTasks = %d, want 4 (queued, leased, backoff, dead)", n)
	}
	for _, id := range []string{"queued", "leased", "backoff", "dead"} {
		if _, err := c.GetTask(ctx, id); !errors.Is(err, client.ErrNotFound) {
			t.Errorf("GetTask(%s) after delete: %v, want ErrNotFound", id, err)
		}
		if p, ok := payloadOf(t, rdb, k, id); ok {
			t.Errorf("payload of %s left behind: %s", id, p)
		}
	}
	for _, key := range []string{k.Inflight, k.Deadlines, k.Dead} {
		if got := zcard(t, rdb, key); got != 0 {
			t.Errorf("ZCARD %s = %d, want 0", key, got)
		}
	}
	for _, key := range []string{k.Lease, k.DeadInfo} {
		if got, err := rdb.HLen(ctx, key).Result(); err != nil || got != 0 {
			t.Errorf("HLEN %s = %d, %v; want 0", key, got, err)
		}
	}
	if got, err := c.GetTask(ctx, "keep"); err != nil || got.State != client.StateQueued || string(got.Payload) != `"keep"` {
		t.Errorf("the task not named: %+v, %v; want it queued with its payload", got, err)
	}
	// Deleting again finds nothing; no ids is no call.
	if n, err := c.DeleteTasks(ctx, "queued", "dead"); err != nil || n != 0 {
		t.Errorf("second DeleteTasks = %d, %v; want 0, nil", n, err)
	}
	if n, err := c.DeleteTasks(ctx); err != nil || n != 0 {
		t.Errorf("DeleteTasks() = %d, %v; want 0, nil", n, err)
	}
}

// More ids than one script call takes (1,000) are deleted in chunks, and
// the counts add up.
func TestDeleteTasksAcrossChunks(t *testing.T) {
	c, rdb, k := newClient(t)
	ctx := ctxT(t)
	const n = 2100
	items := make([]client.TaskItem, n)
	ids := make([]string, 0, n+1)
	for i := range items {
		items[i] = client.TaskItem{ID: fmt.Sprintf("t-%04d", i), Payload: json.RawMessage(`{}`), Deadline: base()}
		ids = append(ids, items[i].ID)
	}
	if _, err := c.PutTasks(ctx, items, client.Create); err != nil {
		t.Fatal(err)
	}
	ids = append(ids, "absent")
	if got, err := c.DeleteTasks(ctx, ids...); err != nil || got != n {
		t.Errorf("DeleteTasks of %d tasks and one absent = %d, %v; want %d", n, got, err, n)
	}
	if got := zcard(t, rdb, k.Queue); got != 0 {
		t.Errorf("ZCARD = %d, want 0", got)
	}
	if got, err := rdb.HLen(ctx, k.Payload).Result(); err != nil || got != 0 {
		t.Errorf("HLEN payload = %d, %v; want 0", got, err)
	}
}

// PutTasks answers one result per item, in the items' order, each item put
// on its own and in order: a repeated id sees the earlier item's write.
// An item without a payload (stored as null) has its deadline checked like
// any other: a deadline in seconds or the zero time refuses the batch.
func TestPutTasksValidatesTheDeadlineOfAnItemWithoutPayload(t *testing.T) {
	c, rdb, k := newClient(t)
	ctx := ctxT(t)
	d := base()
	for _, bad := range []time.Time{{}, time.UnixMilli(d.Unix())} {
		items := []client.TaskItem{{ID: "ok", Payload: json.RawMessage(`1`), Deadline: d}, {ID: "no-payload", Deadline: bad}}
		if res, err := c.PutTasks(ctx, items, client.Create); !errors.Is(err, client.ErrInvalidDeadline) || res != nil {
			t.Errorf("deadline %v: PutTasks = %v, %v; want ErrInvalidDeadline and nothing written", bad, res, err)
		}
	}
	if n := zcard(t, rdb, k.Queue); n != 0 {
		t.Errorf("ZCARD after refused batches = %d, want 0", n)
	}
}

func TestPutTasksResultsInOrder(t *testing.T) {
	c, rdb, k := newClient(t)
	ctx := ctxT(t)
	d := base()
	for _, id := range []string{"old-1", "old-2"} {
		if _, _, err := c.PutTask(ctx, id, json.RawMessage(`"old"`), d, client.Create); err != nil {
			t.Fatal(err)
		}
	}
	items := []client.TaskItem{
		{ID: "new-1", Payload: json.RawMessage(`1`), Deadline: d.Add(time.Second)},
		{ID: "old-1", Payload: json.RawMessage(`"new"`), Deadline: d.Add(time.Hour)},  // later: moved
		{ID: "old-2", Payload: json.RawMessage(`"new"`), Deadline: d.Add(-time.Hour)}, // earlier: kept
		{ID: "new-2", Deadline: d.Add(2 * time.Second)},                               // no payload: null
		{ID: "new-1", Payload: json.RawMessage(`2`), Deadline: d.Add(time.Minute)},    // repeated: moved again
	}
	res, err := c.PutTasks(ctx, items, client.OnlyLater)
	if err != nil {
		t.Fatalf("PutTasks: %v", err)
	}
	if items[3].Payload != nil {
		t.Errorf("PutTasks changed the caller's item: payload %q, want it left nil", items[3].Payload)
	}
	want := []client.Result{client.Created, client.Moved, client.Unchanged, client.Created, client.Moved}
	if !reflect.DeepEqual(res, want) {
		t.Errorf("results %v, want %v", res, want)
	}
	wantState := map[string]struct {
		due     time.Time
		payload string
	}{
		"new-1": {d.Add(time.Minute), `2`},
		"old-1": {d.Add(time.Hour), `"new"`},
		"old-2": {d, `"old"`},
		"new-2": {d.Add(2 * time.Second), `null`},
	}
	for id, w := range wantState {
		if got := zscore(t, rdb, k.Queue, id); got != w.due.UnixMilli() {
			t.Errorf("%s: ZSCORE %d, want %d", id, got, w.due.UnixMilli())
		}
		if p, _ := payloadOf(t, rdb, k, id); p != w.payload {
			t.Errorf("%s: payload %s, want %s", id, p, w.payload)
		}
	}
	if n := zcard(t, rdb, k.Queue); n != int64(len(wantState)) {
		t.Errorf("ZCARD = %d, want %d", n, len(wantState))
	}
	// The same batch with Create: everything exists, nothing changes.
	before := snapshot(t, rdb, k)
	res, err = c.PutTasks(ctx, items, client.Create)
	if err != nil {
		t.Fatalf("PutTasks retried: %v", err)
	}
	for i, r := range res {
		if r != client.Unchanged {
			t.Errorf("retried item %d: %v, want unchanged", i, r)
		}
	}
	assertUnchanged(t, rdb, k, before, "an idempotent retry")
	if res, err := c.PutTasks(ctx, nil, client.Create); err != nil || len(res) != 0 {
		t.Errorf("PutTasks(nil) = %v, %v; want no results, nil", res, err)
	}
}

// listItem is a reliable list item as the daemon's forward script writes it.
func listItem(id string, deadline time.Time, payload string) string {
	b, _ := json.Marshal(id)
	return fmt.Sprintf(`{"id":%s,"deadline_ms":%d,"payload":%s}`, b, deadline.UnixMilli(), payload)
}

// returnUnacked does what the daemon does to a taken item once its
// ack_timeout has passed (internal/consumer): back to the ready list, no
// longer taken, its delivery count kept.
func returnUnacked(t *testing.T, rdb *redis.Client, k queue.Keys, id string) {
	t.Helper()
	ctx := ctxT(t)
	body, err := rdb.HGet(ctx, k.Taken, id).Result()
	if err != nil {
		t.Fatalf("HGET taken %s: %v", id, err)
	}
	_, err = rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		p.LRem(ctx, k.Processing, 1, body)
		p.RPush(ctx, k.Ready, body)
		p.ZRem(ctx, k.Unacked, id)
		p.HDel(ctx, k.Taken, id)
		return nil
	})
	if err != nil {
		t.Fatalf("return %s: %v", id, err)
	}
}

func TestTakeAndAck(t *testing.T) {
	c, rdb, k := newClient(t)
	ctx := ctxT(t)
	d := base()

	if it, err := c.Take(ctx); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("Take of an empty list = %+v, %v; want ErrNotFound", it, err)
	}
	// The forward script LPUSHes, Take takes from the right: oldest first.
	if err := rdb.LPush(ctx, k.Ready, listItem("a", d, `{"n":1}`), listItem("b", d.Add(time.Second), `[1,2]`)).Err(); err != nil {
		t.Fatal(err)
	}
	it, err := c.Take(ctx)
	if err != nil {
		t.Fatalf("Take: %v", err)
	}
	if it.ID != "a" || it.DeadlineMS != d.UnixMilli() || string(it.Payload) != `{"n":1}` || it.Attempts != 0 {
		t.Errorf("Take = %+v; want a, %d, {\"n\":1}, 0 attempts", it, d.UnixMilli())
	}
	if got, _ := rdb.LRange(ctx, k.Processing, 0, -1).Result(); len(got) != 1 || got[0] != listItem("a", d, `{"n":1}`) {
		t.Errorf("processing list = %q, want the taken item", got)
	}
	if _, err := rdb.ZScore(ctx, k.Unacked, "a").Result(); err != nil {
		t.Errorf("taken item has no take time: %v", err)
	}
	if n, _ := rdb.HGet(ctx, k.Deliveries, "a").Int(); n != 1 {
		t.Errorf("deliveries of a = %d, want 1", n)
	}

	// An id that was never taken, or is not taken now, is not acked.
	before := snapshot(t, rdb, k)
	for _, id := range []string{"b", "zzz", ""} {
		if err := c.Ack(ctx, client.ListItem{ID: id, Delivery: it.Delivery}); !errors.Is(err, client.ErrNotFound) {
			t.Errorf("Ack(%q) of an item not taken: %v, want ErrNotFound", id, err)
		}
	}
	// A delivery number that is not the item's (another item's, a stale
	// or a malformed one), or none, acknowledges nothing.
	seq, at, _ := strings.Cut(it.Delivery, "-")
	for _, d := range []string{"0", "2", "-1", "x", seq, at, "2-" + at, seq + "-0", seq + "-" + at + "0", it.Delivery + "0", " " + it.Delivery, it.Delivery + "\n"} {
		if err := c.Ack(ctx, client.ListItem{ID: "a", Delivery: d}); !errors.Is(err, client.ErrNotFound) {
			t.Errorf("Ack(a) with delivery %q (Take gave %q): %v, want ErrNotFound", d, it.Delivery, err)
		}
	}
	if err := c.Ack(ctx, client.ListItem{ID: "a"}); !errors.Is(err, client.ErrNoDelivery) {
		t.Errorf("Ack(a) without a delivery: %v, want ErrNoDelivery", err)
	}
	assertUnchanged(t, rdb, k, before, "Ack of items not taken")

	if err := c.Ack(ctx, it); err != nil {
		t.Fatalf("Ack(a): %v", err)
	}
	for _, key := range []string{k.Processing, k.Unacked, k.Taken, k.Deliveries} {
		if n, err := rdb.Exists(ctx, key).Result(); err != nil || n != 0 {
			t.Errorf("%s after the only ack: exists %d, %v; want gone", key, n, err)
		}
	}
	if err := c.Ack(ctx, it); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("second Ack(a): %v, want ErrNotFound", err)
	}

	// b is taken, not acked in time, returned by the daemon and taken again:
	// the second delivery says one attempt went before it.
	b, err := c.Take(ctx)
	if err != nil || b.ID != "b" || b.Attempts != 0 {
		t.Fatalf("Take = %+v, %v; want b, 0 attempts", b, err)
	}
	if it, err := c.Take(ctx); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("Take with the only item taken = %+v, %v; want ErrNotFound", it, err)
	}
	returnUnacked(t, rdb, k, "b")
	if err := c.Ack(ctx, b); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("Ack of an item returned to the ready list: %v, want ErrNotFound", err)
	}
	again, err := c.Take(ctx)
	if err != nil || again.ID != "b" || again.Attempts != 1 || string(again.Payload) != `[1,2]` {
		t.Fatalf("Take of the redelivered item = %+v, %v; want b, [1,2], 1 attempt", again, err)
	}
	if again.Delivery == b.Delivery {
		t.Fatalf("the redelivery has the first delivery's number %q", b.Delivery)
	}
	// The first delivery's consumer, slower than ack_timeout, acks late:
	// the redelivery stays taken.
	if err := c.Ack(ctx, b); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("late Ack of the first delivery while the second is taken: %v, want ErrNotFound", err)
	}
	if err := c.Ack(ctx, again); err != nil {
		t.Fatalf("Ack of the redelivery: %v", err)
	}
	for _, key := range []string{k.Ready, k.Processing, k.Unacked, k.Taken, k.Deliveries} {
		if n, err := rdb.Exists(ctx, key).Result(); err != nil || n != 0 {
			t.Errorf("%s after every item was acked: exists %d, %v; want gone", key, n, err)
		}
	}
	if n, err := rdb.Exists(ctx, k.DeliveryIDs).Result(); err != nil || n != 0 {
		t.Errorf("%s after every item was acked: exists %d, %v; want gone", k.DeliveryIDs, n, err)
	}
	if it, err := c.Take(ctx); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("Take after all acked = %+v, %v; want ErrNotFound", it, err)
	}
}

// An id is delivered to one consumer at a time: a second item of a taken
// id is passed over until the first is acked.
func TestTakePassesOverAnIDTakenAlready(t *testing.T) {
	c, rdb, k := newClient(t)
	ctx := ctxT(t)
	d := base()
	if err := rdb.LPush(ctx, k.Ready, listItem("x", d, `1`), listItem("x", d, `2`), listItem("y", d, `3`)).Err(); err != nil {
		t.Fatal(err)
	}
	first, err := c.Take(ctx)
	if err != nil || first.ID != "x" || string(first.Payload) != `1` {
		t.Fatalf("first Take = %+v, %v; want x with 1", first, err)
	}
	if it, err := c.Take(ctx); err != nil || it.ID != "y" {
		t.Fatalf("second Take = %+v, %v; want y (the second x waits)", it, err)
	}
	if it, err := c.Take(ctx); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("third Take = %+v, %v; want ErrNotFound while x is taken", it, err)
	}
	if err := c.Ack(ctx, first); err != nil {
		t.Fatal(err)
	}
	it, err := c.Take(ctx)
	if err != nil || it.ID != "x" || string(it.Payload) != `2` {
		t.Fatalf("Take after the ack = %+v, %v; want the second x with 2", it, err)
	}
}

// Bad input to every write of tasks.go is refused with an error wrapping
// the package's sentinel, and nothing in Redis changes: not the task it
// names (which exists, so a valid call would have moved or deleted it),
// not any other key of the queue.
func TestTaskWritesRefuseMalformedInputAndWriteNothing(t *testing.T) {
	now := time.Date(2026, 6, 1, 12, 0, 0, 0, time.UTC)
	rdb, k := testenv.Redis(t)
	c, err := client.New(rdb, k.Queue, client.WithClock(func() time.Time { return now }))
	if err != nil {
		t.Fatal(err)
	}
	ctx := ctxT(t)
	due := now.Add(time.Hour)
	if _, _, err := c.PutTask(ctx, "keep", json.RawMessage(`{"v":1}`), due, client.Create); err != nil {
		t.Fatal(err)
	}
	seedLeasedTask(t, rdb, k, "leased", due, 1, "tok", "", `"l"`)
	seedDead(t, rdb, k, "dead", "failed", 2, due, "boom", `"d"`)

	good := json.RawMessage(`{"v":2}`)
	cases := []struct {
		name    string
		id      string
		payload json.RawMessage
		due     time.Time
		want    error
	}{
		{"empty id", "", good, due, client.ErrInvalidSerial},
		{"129-byte id", strings.Repeat("k", 129), good, due, client.ErrInvalidSerial},
		{"id with a newline", "keep\n", good, due, client.ErrInvalidSerial},
		{"id with NUL", "ke\x00ep", good, due, client.ErrInvalidSerial},
		{"id not UTF-8", "keep\xc3", good, due, client.ErrInvalidSerial},
		{"payload not JSON", "keep", json.RawMessage(`{"v":`), due, client.ErrInvalidPayload},
		{"payload two values", "keep", json.RawMessage(`{} {}`), due, client.ErrInvalidPayload},
		{"payload too large", "keep", json.RawMessage(`"` + strings.Repeat("x", client.MaxPayloadBytes-1) + `"`), due, client.ErrInvalidPayload},
		{"payload too deep", "keep", nestedArrays(client.MaxPayloadDepth + 1), due, client.ErrInvalidPayload},
		{"zero due time", "keep", good, time.Time{}, client.ErrInvalidDeadline},
		{"due before 2000", "keep", good, time.Date(1999, 12, 31, 23, 59, 59, 0, time.UTC), client.ErrInvalidDeadline},
		{"due in seconds", "keep", good, time.UnixMilli(due.Unix()), client.ErrInvalidDeadline},
		{"due beyond MaxAhead", "keep", good, now.Add(queue.MaxAhead).Add(time.Millisecond), client.ErrInvalidDeadline},
	}
	before := snapshot(t, rdb, k)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for _, mode := range []client.Mode{client.Create, client.Reschedule, client.OnlyLater} {
				res, at, err := c.PutTask(ctx, tc.id, tc.payload, tc.due, mode)
				if !errors.Is(err, tc.want) {
					t.Errorf("PutTask (mode %d) = %v, %s, %v; want %v", mode, res, at, err, tc.want)
				}
			}
			// The bad item last, after good ones: nothing of the batch is
			// written, and the error names the bad item's index.
			items := []client.TaskItem{
				{ID: "fresh", Payload: good, Deadline: due},
				{ID: "keep", Payload: good, Deadline: due.Add(time.Hour)},
				{ID: tc.id, Payload: tc.payload, Deadline: tc.due},
			}
			res, err := c.PutTasks(ctx, items, client.Reschedule)
			if !errors.Is(err, tc.want) || res != nil {
				t.Errorf("PutTasks = %v, %v; want no results, %v", res, err, tc.want)
			} else if !strings.Contains(err.Error(), "task 2") {
				t.Errorf("PutTasks error %q does not name item 2", err)
			}
			assertUnchanged(t, rdb, k, before, "a refused put")
		})
	}
	// DeleteTasks validates every id before it deletes any.
	for _, bad := range []string{"", strings.Repeat("k", 129), "a\tb", "\xff"} {
		n, err := c.DeleteTasks(ctx, "keep", "leased", "dead", bad)
		if !errors.Is(err, client.ErrInvalidSerial) || n != 0 {
			t.Errorf("DeleteTasks with %q = %d, %v; want 0, ErrInvalidSerial", bad, n, err)
		}
	}
	assertUnchanged(t, rdb, k, before, "a refused delete")

	// The limits themselves are accepted.
	edge := []client.TaskItem{
		{ID: strings.Repeat("k", 128), Payload: json.RawMessage(`"` + strings.Repeat("x", client.MaxPayloadBytes-2) + `"`), Deadline: now.Add(queue.MaxAhead)},
		{ID: "日本語-ü", Payload: nestedArrays(client.MaxPayloadDepth), Deadline: time.UnixMilli(queue.MinDeadline)},
	}
	if res, err := c.PutTasks(ctx, edge, client.Create); err != nil || !reflect.DeepEqual(res, []client.Result{client.Created, client.Created}) {
		t.Errorf("PutTasks at the limits = %v, %v; want both created", res, err)
	}
}

func TestValidatePayloadLimits(t *testing.T) {
	cases := []struct {
		name      string
		payload   string
		ok        bool
		errDetail string // in the error text: the limit broken
	}{
		{"exactly MaxPayloadBytes", `"` + strings.Repeat("x", client.MaxPayloadBytes-2) + `"`, true, ""},
		{"one byte more", `"` + strings.Repeat("x", client.MaxPayloadBytes-1) + `"`, false, fmt.Sprint(client.MaxPayloadBytes)},
		{"null", `null`, true, ""},
		{"surrounding whitespace", " \n{\"a\":[1,2]}\t", true, ""},
		{"empty", ``, false, "not valid JSON"},
		{"only whitespace", `   `, false, "not valid JSON"},
		{"trailing garbage", `{}x`, false, "not valid JSON"},
		{"single quotes", `{'a':1}`, false, "not valid JSON"},
		{"unterminated string", `"abc`, false, "not valid JSON"},
		{"escaped quote then brackets", `["\"[[[[",{"k":"\\"}]`, true, ""},
		{"depth limit in mixed nesting", strings.Repeat(`[{"a":`, client.MaxPayloadDepth/2) + `0` + strings.Repeat(`}]`, client.MaxPayloadDepth/2), true, ""},
		{"one deeper in mixed nesting", `[` + strings.Repeat(`[{"a":`, client.MaxPayloadDepth/2) + `0` + strings.Repeat(`}]`, client.MaxPayloadDepth/2) + `]`, false, fmt.Sprint(client.MaxPayloadDepth)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := client.ValidatePayload([]byte(tc.payload))
			if tc.ok {
				if err != nil {
					t.Errorf("ValidatePayload = %v, want nil", err)
				}
				return
			}
			if !errors.Is(err, client.ErrInvalidPayload) || !strings.Contains(err.Error(), tc.errDetail) {
				t.Errorf("ValidatePayload = %v; want ErrInvalidPayload naming %q", err, tc.errDetail)
			}
		})
	}
}

// PutTask and PutTasks publish a due time earlier than the queue's head on
// the wake channel, so a sleeping daemon wakes for it, and publish nothing
// for a later one: pub/sub keeps order, so after a silent write the next
// message must be the following write's.
func TestPutTaskWakesForAnEarlierHead(t *testing.T) {
	c, rdb, k := newClient(t)
	ch := subscribe(t, rdb, k)
	ctx := ctxT(t)
	d := base()
	ms := func(t time.Time) string { return fmt.Sprint(t.UnixMilli()) }
	if _, _, err := c.PutTask(ctx, "a", nil, d, client.Create); err != nil {
		t.Fatal(err)
	}
	if got := nextWake(t, ch); got != ms(d) {
		t.Fatalf("first task published %s, want %s", got, ms(d))
	}
	if _, _, err := c.PutTask(ctx, "later", nil, d.Add(time.Hour), client.Create); err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.PutTask(ctx, "a", json.RawMessage(`1`), d.Add(-time.Hour), client.Create); err != nil { // unchanged
		t.Fatal(err)
	}
	items := []client.TaskItem{
		{ID: "b", Deadline: d.Add(time.Minute)},  // after the head: silent
		{ID: "c", Deadline: d.Add(-time.Minute)}, // before it: published
		{ID: "e", Deadline: d.Add(-2 * time.Minute)},
	}
	if _, err := c.PutTasks(ctx, items, client.Create); err != nil {
		t.Fatal(err)
	}
	for _, want := range []time.Time{d.Add(-time.Minute), d.Add(-2 * time.Minute)} {
		if got := nextWake(t, ch); got != ms(want) {
			t.Fatalf("published %s, want %s (the later and unchanged puts publish nothing)", got, ms(want))
		}
	}
	if _, _, err := c.PutTask(ctx, "a", nil, d.Add(-time.Hour), client.Reschedule); err != nil {
		t.Fatal(err)
	}
	if got := nextWake(t, ch); got != ms(d.Add(-time.Hour)) {
		t.Fatalf("a reschedule to before the head published %s, want %s", got, ms(d.Add(-time.Hour)))
	}
}

// A due time is rounded up to the millisecond, never down: a task is never
// run before the time it was given.
func TestPutTaskRoundsTheDueTimeUp(t *testing.T) {
	c, rdb, k := newClient(t)
	whole := base()
	_, at, err := c.PutTask(ctxT(t), "t", nil, whole.Add(time.Nanosecond), client.Create)
	if err != nil {
		t.Fatal(err)
	}
	want := whole.UnixMilli() + 1
	if at.UnixMilli() != want || zscore(t, rdb, k.Queue, "t") != want {
		t.Errorf("stored %d, returned %d; want %d", zscore(t, rdb, k.Queue, "t"), at.UnixMilli(), want)
	}
}

// With Redis unreachable every call fails with an error, never
// ErrNotFound: a consumer must not read an outage as an empty list, nor a
// producer as a missing task.
func TestTaskCallsWithRedisDown(t *testing.T) {
	port, err := testenv.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", port), MaxRetries: -1, DialTimeout: time.Second})
	t.Cleanup(func() { rdb.Close() })
	c, err := client.New(rdb, "down:tasks")
	if err != nil {
		t.Fatal(err)
	}
	ctx := ctxT(t)
	check := func(what string, err error) {
		t.Helper()
		if err == nil || errors.Is(err, client.ErrNotFound) {
			t.Errorf("%s with Redis down: %v; want a connection error (not ErrNotFound)", what, err)
		}
	}
	_, _, err = c.PutTask(ctx, "t", nil, base(), client.Create)
	check("PutTask", err)
	_, err = c.PutTasks(ctx, []client.TaskItem{{ID: "t", Deadline: base()}}, client.Create)
	check("PutTasks", err)
	_, err = c.GetTask(ctx, "t")
	check("GetTask", err)
	_, err = c.DeleteTasks(ctx, "t")
	check("DeleteTasks", err)
	_, err = c.Take(ctx)
	check("Take", err)
	check("Ack", c.Ack(ctx, client.ListItem{ID: "t", Delivery: "1"}))
}
