package consumer

import (
	"context"
	"encoding/json"
	"slices"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// buryTask dead-letters task id with payload the way a failed action does:
// put due, claimed (as a poll), and buried.
func (e *env) buryTask(id, payload string) {
	e.T.Helper()
	ctx := context.Background()
	if _, _, err := e.cl.PutTask(ctx, id, json.RawMessage(payload), e.RedisNow().Add(-time.Second), client.Create); err != nil {
		e.T.Fatal(err)
	}
	c := e.consumer(Config{BatchSize: 10, Lease: time.Minute, MaxAttempts: 1,
		Process: func(context.Context, []Task) []error { return nil }})
	res, err := c.claimAs(ctx, 10, "poll.test", false)
	if err != nil || len(res.items) != 1 {
		e.T.Fatalf("claim %s: %v, %d items", id, err, len(res.items))
	}
	c.bury(res.items, ReasonFailed, "boom")
	if ok, err := e.RDB.ZScore(ctx, e.Keys.Dead, id).Result(); err != nil || ok == 0 {
		e.T.Fatalf("%s not dead-lettered: %v", id, err)
	}
}

// A requeue of a dead letter whose id is also a live task (a producer put
// the id again after it died) must not touch the live task: not its due
// time, not its payload, and not a lease another consumer holds.
func TestRequeueTasksLeavesALiveTaskOfTheSameIDAlone(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()

	// 1. dead, then queued again for later with a new payload.
	e.buryTask("T-queued", `{"v":"dead"}`)
	later := e.RedisNow().Add(time.Hour)
	if _, _, err := e.cl.PutTask(ctx, "T-queued", json.RawMessage(`{"v":"live"}`), later, client.Create); err != nil {
		t.Fatal(err)
	}
	// 2. dead, then put again and leased by a poll right now.
	e.buryTask("T-leased", `{"v":"dead"}`)
	if _, _, err := e.cl.PutTask(ctx, "T-leased", json.RawMessage(`{"v":"live"}`), e.RedisNow().Add(-time.Second), client.Create); err != nil {
		t.Fatal(err)
	}
	claimed, tok, err := pollTasks(ctx, e.RDB, e.Keys, 10, 0, time.Minute, 5)
	if err != nil || len(claimed) != 1 || claimed[0].ID != "T-leased" {
		t.Fatalf("poll: %v %+v", err, claimed)
	}
	// 3. an ordinary dead letter.
	e.buryTask("T-dead", `{"v":"only"}`)

	outs, err := e.st.RequeueTasks(ctx, []string{"T-queued", "T-leased", "T-dead", "T-none"})
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{queue.RequeueLive, queue.RequeueLive, queue.RequeueDone, queue.RequeueNotDead}; !slices.Equal(outs, want) {
		t.Errorf("outcomes %v, want %v", outs, want)
	}
	if d, err := e.RDB.ZScore(ctx, e.Keys.Queue, "T-queued").Result(); err != nil || int64(d) != queue.DeadlineMillis(later) {
		t.Errorf("live queued task due %v (%v), want its own %d", d, err, queue.DeadlineMillis(later))
	}
	if n, _ := e.RDB.ZScore(ctx, e.Keys.Queue, "T-leased").Result(); n != 0 {
		t.Errorf("leased task was put into the queue too (due %v): it would run twice", n)
	}
	for _, id := range []string{"T-queued", "T-leased"} {
		if p, _ := e.RDB.HGet(ctx, e.Keys.Payload, id).Result(); p != `{"v":"live"}` {
			t.Errorf("%s payload %q, want the live task's", id, p)
		}
		if _, err := e.RDB.ZScore(ctx, e.Keys.Dead, id).Result(); err != nil {
			t.Errorf("%s: dead letter gone (%v); a skipped requeue must leave it", id, err)
		}
	}
	if missed, _, err := queue.NewStore(e.RDB, e.Keys).AckTasks(ctx, tok, []string{"T-leased"}); err != nil || len(missed) != 0 {
		t.Errorf("the poll's lease no longer acks: missed %v, %v", missed, err)
	}
	// The plain dead letter is due now, with the payload it died with.
	d, err := e.RDB.ZScore(ctx, e.Keys.Queue, "T-dead").Result()
	if err != nil || time.UnixMilli(int64(d)).After(e.RedisNow()) {
		t.Errorf("requeued task due %v (%v), want now", d, err)
	}
	if p, _ := e.RDB.HGet(ctx, e.Keys.Payload, "T-dead").Result(); p != `{"v":"only"}` {
		t.Errorf("requeued payload %q, want the one it died with", p)
	}
	if ok, _ := e.RDB.HExists(ctx, e.Keys.DeadInfo, "T-dead").Result(); ok {
		t.Error("requeued task keeps its dead-letter record")
	}
}

// Purging a dead letter removes its payload, unless a live task has the
// same id: then the live task keeps its payload.
func TestPurgeTasksKeepsALiveTasksPayload(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	e.buryTask("P-live", `{"v":"dead"}`)
	if _, _, err := e.cl.PutTask(ctx, "P-live", json.RawMessage(`{"v":"live"}`), e.RedisNow().Add(time.Hour), client.Create); err != nil {
		t.Fatal(err)
	}
	e.buryTask("P-dead", `{"v":"dead"}`)
	n, err := e.st.PurgeTasks(ctx, []string{"P-live", "P-dead", "P-none"})
	if err != nil || n != 2 {
		t.Fatalf("purged %d (%v), want 2", n, err)
	}
	if p, _ := e.RDB.HGet(ctx, e.Keys.Payload, "P-live").Result(); p != `{"v":"live"}` {
		t.Errorf("live task's payload %q after purging its dead namesake", p)
	}
	if ok, _ := e.RDB.HExists(ctx, e.Keys.Payload, "P-dead").Result(); ok {
		t.Error("purged dead letter keeps its payload")
	}
	for _, k := range []string{e.Keys.Dead, e.Keys.DeadInfo} {
		if n, _ := e.RDB.Exists(ctx, k).Result(); n != 0 {
			t.Errorf("%s still exists after purging every dead letter", k)
		}
	}
}
