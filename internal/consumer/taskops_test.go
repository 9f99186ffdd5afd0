package consumer

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// buryTask dead-letters task id with payload the way a failed action does:
// put due, claimed (as a poll), and buried.
func (e *env) buryTask(id, payload string) {
	e.t.Helper()
	ctx := context.Background()
	if _, _, err := e.cl.PutTask(ctx, id, json.RawMessage(payload), e.redisNow().Add(-time.Second), client.Create); err != nil {
		e.t.Fatal(err)
	}
	c := e.consumer(Config{BatchSize: 10, Lease: time.Minute, MaxAttempts: 1,
		Process: func(context.Context, []Task) []error { return nil }})
	res, err := c.claimAs(ctx, 10, "poll.test", 0)
	if err != nil || len(res.items) != 1 {
		e.t.Fatalf("claim %s: %v, %d items", id, err, len(res.items))
	}
	c.bury(res.items, ReasonFailed, "boom")
	if ok, err := e.rdb.ZScore(ctx, e.keys.Dead, id).Result(); err != nil || ok == 0 {
		e.t.Fatalf("%s not dead-lettered: %v", id, err)
	}
}

// A requeue of a dead letter whose id is also a live task (a producer put
// the id again after it died) must not touch the live task: not its due
// time, not its payload, and not a lease another consumer holds.
func TestRequeueTasksLeavesALiveTaskOfTheSameIDAlone(t *testing.T) {
	e := newRedisEnv(t)
	ctx := context.Background()

	// 1. dead, then queued again for later with a new payload.
	e.buryTask("T-queued", `{"v":"dead"}`)
	later := e.redisNow().Add(time.Hour)
	if _, _, err := e.cl.PutTask(ctx, "T-queued", json.RawMessage(`{"v":"live"}`), later, client.Create); err != nil {
		t.Fatal(err)
	}
	// 2. dead, then put again and leased by a poll right now.
	e.buryTask("T-leased", `{"v":"dead"}`)
	if _, _, err := e.cl.PutTask(ctx, "T-leased", json.RawMessage(`{"v":"live"}`), e.redisNow().Add(-time.Second), client.Create); err != nil {
		t.Fatal(err)
	}
	claimed, tok, err := ClaimTasks(ctx, e.rdb, e.keys, 10, 0, time.Minute, 5, e.m, zap.NewNop())
	if err != nil || len(claimed) != 1 || claimed[0].ID != "T-leased" {
		t.Fatalf("poll: %v %+v", err, claimed)
	}
	// 3. an ordinary dead letter.
	e.buryTask("T-dead", `{"v":"only"}`)

	outs, err := RequeueTasks(ctx, e.rdb, e.keys, []string{"T-queued", "T-leased", "T-dead", "T-none"})
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{RequeueLive, RequeueLive, RequeueDone, RequeueNotDead}; !slices.Equal(outs, want) {
		t.Errorf("outcomes %v, want %v", outs, want)
	}
	if d, err := e.rdb.ZScore(ctx, e.keys.Queue, "T-queued").Result(); err != nil || int64(d) != queue.DeadlineMillis(later) {
		t.Errorf("live queued task due %v (%v), want its own %d", d, err, queue.DeadlineMillis(later))
	}
	if n, _ := e.rdb.ZScore(ctx, e.keys.Queue, "T-leased").Result(); n != 0 {
		t.Errorf("leased task was put into the queue too (due %v): it would run twice", n)
	}
	for _, id := range []string{"T-queued", "T-leased"} {
		if p, _ := e.rdb.HGet(ctx, e.keys.Payload, id).Result(); p != `{"v":"live"}` {
			t.Errorf("%s payload %q, want the live task's", id, p)
		}
		if _, err := e.rdb.ZScore(ctx, e.keys.Dead, id).Result(); err != nil {
			t.Errorf("%s: dead letter gone (%v); a skipped requeue must leave it", id, err)
		}
	}
	if missed, err := AckTasks(ctx, e.rdb, e.keys, tok, []string{"T-leased"}); err != nil || len(missed) != 0 {
		t.Errorf("the poll's lease no longer acks: missed %v, %v", missed, err)
	}
	// The plain dead letter is due now, with the payload it died with.
	d, err := e.rdb.ZScore(ctx, e.keys.Queue, "T-dead").Result()
	if err != nil || time.UnixMilli(int64(d)).After(e.redisNow()) {
		t.Errorf("requeued task due %v (%v), want now", d, err)
	}
	if p, _ := e.rdb.HGet(ctx, e.keys.Payload, "T-dead").Result(); p != `{"v":"only"}` {
		t.Errorf("requeued payload %q, want the one it died with", p)
	}
	if ok, _ := e.rdb.HExists(ctx, e.keys.DeadInfo, "T-dead").Result(); ok {
		t.Error("requeued task keeps its dead-letter record")
	}
}

// Purging a dead letter removes its payload, unless a live task has the
// same id: then the live task keeps its payload.
func TestPurgeTasksKeepsALiveTasksPayload(t *testing.T) {
	e := newRedisEnv(t)
	ctx := context.Background()
	e.buryTask("P-live", `{"v":"dead"}`)
	if _, _, err := e.cl.PutTask(ctx, "P-live", json.RawMessage(`{"v":"live"}`), e.redisNow().Add(time.Hour), client.Create); err != nil {
		t.Fatal(err)
	}
	e.buryTask("P-dead", `{"v":"dead"}`)
	n, err := PurgeTasks(ctx, e.rdb, e.keys, []string{"P-live", "P-dead", "P-none"})
	if err != nil || n != 2 {
		t.Fatalf("purged %d (%v), want 2", n, err)
	}
	if p, _ := e.rdb.HGet(ctx, e.keys.Payload, "P-live").Result(); p != `{"v":"live"}` {
		t.Errorf("live task's payload %q after purging its dead namesake", p)
	}
	if ok, _ := e.rdb.HExists(ctx, e.keys.Payload, "P-dead").Result(); ok {
		t.Error("purged dead letter keeps its payload")
	}
	for _, k := range []string{e.keys.Dead, e.keys.DeadInfo} {
		if n, _ := e.rdb.Exists(ctx, k).Result(); n != 0 {
			t.Errorf("%s still exists after purging every dead letter", k)
		}
	}
}

// PurgeTasksBefore removes only dead letters older than the cutoff, in
// steps, and all of them with a zero cutoff.
func TestPurgeTasksBefore(t *testing.T) {
	e := newRedisEnv(t)
	ctx := context.Background()
	now := e.redisNow()
	for i := range 2500 {
		at := now.Add(-2 * time.Hour)
		if i%2 == 1 {
			at = now
		}
		e.rdb.ZAdd(ctx, e.keys.Dead, redisZ(fmt.Sprintf("d-%d", i), float64(at.UnixMilli())))
		e.rdb.HSet(ctx, e.keys.Payload, fmt.Sprintf("d-%d", i), "{}")
	}
	n, err := PurgeTasksBefore(ctx, e.rdb, e.keys, now.Add(-time.Hour))
	if err != nil || n != 1250 {
		t.Fatalf("purged %d (%v), want the 1250 older than an hour", n, err)
	}
	if left, _ := e.rdb.HLen(ctx, e.keys.Payload).Result(); left != 1250 {
		t.Errorf("%d payloads left, want 1250", left)
	}
	if n, err := PurgeTasksBefore(ctx, e.rdb, e.keys, time.Time{}); err != nil || n != 1250 {
		t.Errorf("purge all: %d (%v), want 1250", n, err)
	}
}

// Page walks a sorted set in its own order (score, then member bytes) with
// keyset cursors: no entry twice, none skipped, ties across page borders
// included, and a cursor whose entry has gone meanwhile still continues
// where it was.
func TestPageWalksTiesAndSurvivesARemovedCursor(t *testing.T) {
	e := newRedisEnv(t)
	ctx := context.Background()
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	var want []string
	for i := range 300 {
		id := fmt.Sprintf("%c-%03d", 'a'+rng.IntN(26), i)
		if i%7 == 0 {
			id = "é" + id // multi-byte: byte order, not the locale's
		}
		score := float64(1_700_000_000_000 + rng.IntN(5)) // many ties
		e.rdb.ZAdd(ctx, e.keys.Queue, redisZ(id, score))
	}
	all, err := e.rdb.ZRange(ctx, e.keys.Queue, 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	want = all
	for _, limit := range []int{1, 7, 1000} {
		var got []string
		var after *Cursor
		for range 400 {
			zs, err := Page(ctx, e.rdb, e.keys.Queue, after, limit)
			if err != nil {
				t.Fatal(err)
			}
			for _, z := range zs {
				got = append(got, z.Member.(string))
			}
			if len(zs) < limit {
				break
			}
			last := zs[len(zs)-1]
			c, err := ParseCursor(Cursor{Score: last.Score, ID: last.Member.(string)}.String())
			if err != nil {
				t.Fatal(err)
			}
			after = &c
		}
		if !slices.Equal(got, want) {
			t.Fatalf("limit %d: paged %d entries, want %d in set order", limit, len(got), len(want))
		}
	}
	// Remove the cursor's own entry between pages.
	zs, err := Page(ctx, e.rdb, e.keys.Queue, nil, 50)
	if err != nil {
		t.Fatal(err)
	}
	last := zs[49]
	e.rdb.ZRem(ctx, e.keys.Queue, last.Member)
	next, err := Page(ctx, e.rdb, e.keys.Queue, &Cursor{Score: last.Score, ID: last.Member.(string)}, 10)
	if err != nil || len(next) == 0 || next[0].Member != want[50] {
		t.Errorf("after a removed cursor: %v %v, want to start at %q", err, next, want[50])
	}
}

func redisZ(member string, score float64) redis.Z { return redis.Z{Member: member, Score: score} }

func TestParseCursorRefusesGarbage(t *testing.T) {
	for _, s := range []string{"!!", "", "bm9wZQ", Cursor{Score: 1, ID: ""}.String(), "TmFOfGE"} {
		if _, err := ParseCursor(s); err == nil || !strings.Contains(err.Error(), "cursor") {
			t.Errorf("ParseCursor(%q) = %v, want a bad cursor error", s, err)
		}
	}
}

// A paused poll queue hands out nothing and changes nothing; resumed, the
// same poll gets the task.
func TestClaimTasksHonoursPause(t *testing.T) {
	e := newRedisEnv(t)
	ctx := context.Background()
	if _, _, err := e.cl.PutTask(ctx, "J-1", json.RawMessage(`{}`), e.redisNow().Add(-time.Second), client.Create); err != nil {
		t.Fatal(err)
	}
	if err := e.rdb.Set(ctx, e.keys.Paused, "1|test", 0).Err(); err != nil {
		t.Fatal(err)
	}
	got, tok, err := ClaimTasks(ctx, e.rdb, e.keys, 10, 0, time.Minute, 5, e.m, zap.NewNop())
	if err != nil || len(got) != 0 || tok != "" {
		t.Fatalf("paused poll: %v, %d tasks, token %q; want nothing", err, len(got), tok)
	}
	if n, _ := e.rdb.ZCard(ctx, e.keys.Inflight).Result(); n != 0 {
		t.Errorf("paused poll leased %d tasks", n)
	}
	e.rdb.Del(ctx, e.keys.Paused)
	got, _, err = ClaimTasks(ctx, e.rdb, e.keys, 10, 0, time.Minute, 5, e.m, zap.NewNop())
	if err != nil || len(got) != 1 {
		t.Fatalf("resumed poll: %v, %d tasks, want 1", err, len(got))
	}
}
