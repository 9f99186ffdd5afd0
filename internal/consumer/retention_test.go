package consumer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Dead-letter retention on task queues: a purged dead letter takes its
// payload with it, unless a live task of the same id (queued, leased or
// backing off) owns that payload. Scripts are atomic, so the interleavings
// that matter are the orders in which whole scripts run; each test below
// is one such order.

var errAction = errors.New("action failed")

// failAll fails every task of a batch.
func failAll(_ context.Context, ts []Task) []error {
	errs := make([]error, len(ts))
	for i := range errs {
		errs[i] = errAction
	}
	return errs
}

// runPass claims one batch with cfg and runs its action, as a replica's
// scan and worker would; it returns the claimed ids.
func (e *env) runPass(cfg Config) []string {
	e.T.Helper()
	c := e.consumer(cfg)
	res, err := c.claimBatch(context.Background())
	if err != nil {
		e.T.Fatal(err)
	}
	if len(res.items) > 0 {
		c.m.Inflight.Add(float64(len(res.items)))
		c.process(context.Background(), res.items)
	}
	return serialsOf(res.items)
}

// payloadOf returns id's stored payload, or "" when it has none.
func (e *env) payloadOf(id string) string {
	e.T.Helper()
	v, err := e.RDB.HGet(context.Background(), e.Keys.Payload, id).Result()
	if err != nil {
		return ""
	}
	return v
}

// orphanPayloads lists the ids in {KEY}:payload that no live task (queue
// key, lease record) and no dead letter owns: payloads nothing will ever
// read or remove.
func (e *env) orphanPayloads() []string {
	e.T.Helper()
	ctx := context.Background()
	ids, err := e.RDB.HKeys(ctx, e.Keys.Payload).Result()
	if err != nil {
		e.T.Fatal(err)
	}
	var out []string
	for _, id := range ids {
		_, qErr := e.RDB.ZScore(ctx, e.Keys.Queue, id).Result()
		leased, err := e.RDB.HExists(ctx, e.Keys.Lease, id).Result()
		if err != nil {
			e.T.Fatal(err)
		}
		_, dErr := e.RDB.ZScore(ctx, e.Keys.Dead, id).Result()
		if qErr != nil && !leased && dErr != nil {
			out = append(out, id)
		}
	}
	slices.Sort(out)
	return out
}

func (e *env) assertNoOrphans(when string) {
	e.T.Helper()
	if o := e.orphanPayloads(); len(o) > 0 {
		e.T.Fatalf("%s: payloads with no task and no dead letter: %q", when, o)
	}
}

// purge applies the retention: by age (olderThan > 0) or by count.
func (e *env) purge(olderThan time.Duration, keepMax int) int {
	e.T.Helper()
	n, err := e.st.PurgeDead(context.Background(), olderThan, keepMax)
	if err != nil {
		e.T.Fatal(err)
	}
	return n
}

// deadAgo rewrites when id was dead-lettered to d before Redis's now.
func (e *env) deadAgo(id string, d time.Duration) {
	e.T.Helper()
	at := e.RedisNow().Add(-d).UnixMilli()
	if err := e.RDB.ZAddXX(context.Background(), e.Keys.Dead, zAt(at, id)).Err(); err != nil {
		e.T.Fatal(err)
	}
}

// Retention by age and by count removes each purged dead letter's payload:
// before, both left the payload in {KEY}:payload for ever.
func TestPurgeDeadRemovesTheirPayloads(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	for _, id := range []string{"old", "mid", "new"} {
		e.buryTask(id, `{"big":"payload of `+id+`"}`)
	}
	e.deadAgo("old", 2*time.Hour)
	e.deadAgo("mid", time.Hour)
	if n := e.purge(90*time.Minute, 0); n != 1 {
		t.Fatalf("retention purged %d, want 1 (old)", n)
	}
	e.assertNoOrphans("after the retention purge")
	if n := e.purge(0, 1); n != 1 {
		t.Fatalf("dead-max purged %d, want 1 (mid)", n)
	}
	e.assertNoOrphans("after the dead-max purge")
	if p := e.payloadOf("new"); p != `{"big":"payload of new"}` {
		t.Fatalf("the kept dead letter's payload is %q; a requeue needs it", p)
	}
}

// Each state a live task of the same id can be in when its older dead
// letter is purged: the live task keeps its payload and runs with it.
func TestPurgeDeadKeepsThePayloadOfALiveTaskOfTheSameID(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		live func(e *env) // brings task "x" back to life after it was buried
	}{
		{"re-put, queued", func(e *env) {
			e.putLater("x", `{"v":2}`)
		}},
		{"re-put, leased", func(e *env) {
			e.putDue("x", `{"v":2}`)
			if _, err := e.consumer(Config{MaxAttempts: 3, Process: failAll}).claimBatch(context.Background()); err != nil {
				t.Fatal(err)
			}
		}},
		{"re-put, backing off after a failed attempt", func(e *env) {
			e.putDue("x", `{"v":2}`)
			e.runPass(Config{MaxAttempts: 3, Process: failAll, Retry: func(int) time.Duration { return time.Hour }})
		}},
		{"requeued", func(e *env) {
			// A requeue removes the dead letter itself: the purge finds
			// nothing, the requeued task keeps the dead letter's payload.
			if _, err := e.st.Requeue(context.Background(), "x"); err != nil {
				t.Fatal(err)
			}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newRedisEnv(t)
			e.buryTask("x", `{"v":1}`)
			tc.live(e)
			e.purge(0, 0)
			e.deadAgo("x", 2*time.Hour) // no-op when the requeue removed it
			e.purge(time.Hour, 0)
			if n := e.card(e.Keys.Dead); n != 0 {
				t.Fatalf("%d dead letters after the purge, want 0", n)
			}
			if e.payloadOf("x") == "" {
				t.Fatal("the purge of x's old dead letter removed the payload of the live task x")
			}
			// The live task runs with its payload and then leaves none.
			var got json.RawMessage
			run := Config{MaxAttempts: 3, Process: func(_ context.Context, ts []Task) []error {
				got = ts[0].Payload
				return make([]error, len(ts))
			}}
			e.makeDue("x")
			if ids := e.runPass(run); len(ids) != 1 {
				t.Fatalf("claimed %q, want x", ids)
			}
			if len(got) == 0 || string(got) == "null" {
				t.Fatalf("x ran with payload %s", got)
			}
			if p := e.payloadOf("x"); p != "" {
				t.Fatalf("payload %q left after x succeeded", p)
			}
			e.assertNoOrphans("after x ran")
		})
	}
}

// Purge first, then a requeue of the purged id: nothing to requeue, and no
// payload is left behind.
func TestPurgeThenRequeueLeavesNothing(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	e.buryTask("x", `{"v":1}`)
	if n := e.purge(0, 0); n != 0 {
		t.Fatalf("a purge with no retention removed %d", n)
	}
	e.deadAgo("x", 2*time.Hour)
	if n := e.purge(time.Hour, 0); n != 1 {
		t.Fatalf("purged %d, want 1", n)
	}
	if _, err := e.st.Requeue(context.Background(), "x"); !errors.Is(err, queue.ErrNotDead) {
		t.Fatalf("requeue of a purged dead letter: %v, want queue.ErrNotDead", err)
	}
	if n := e.card(e.Keys.Queue); n != 0 {
		t.Fatalf("queue holds %d after requeueing a purged id", n)
	}
	e.assertNoOrphans("after purge then requeue")
}

// A list queue: the re-put task was forwarded (its payload travels in the
// list item), then the old dead letter is purged. Nothing is left in
// {KEY}:payload and the list item keeps the new payload.
func TestPurgeAfterTheLiveTaskWasForwarded(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	e.buryTask("x", `{"v":1}`)
	e.putDue("x", `{"v":2}`)
	if res := e.forwardOnce(Config{Forward: &Forward{Kind: "list", Queue: "l"}}); res.forwarded != 1 {
		t.Fatalf("forwarded %d, want 1", res.forwarded)
	}
	e.deadAgo("x", 2*time.Hour)
	if n := e.purge(time.Hour, 0); n != 1 {
		t.Fatalf("purged %d, want 1", n)
	}
	e.assertNoOrphans("after purging a forwarded task's old dead letter")
	item, err := e.RDB.LIndex(context.Background(), e.Keys.Ready, 0).Result()
	if err != nil {
		t.Fatal(err)
	}
	var it client.ListItem
	if err := json.Unmarshal([]byte(item), &it); err != nil || it.ID != "x" || string(it.Payload) != `{"v":2}` {
		t.Fatalf("ready item %q (%v); want x with payload {\"v\":2}", item, err)
	}
}

// putLater puts task id due in an hour (re-put: a reschedule, as a
// producer that reuses an id of a buried task would).
func (e *env) putLater(id, payload string) {
	e.T.Helper()
	if _, _, err := e.cl.PutTask(context.Background(), id, json.RawMessage(payload), time.Now().Add(time.Hour), client.Reschedule); err != nil {
		e.T.Fatal(err)
	}
}

// makeDue makes task id due now wherever it waits: in the queue key, or
// leased or backing off (its lease or backoff is ended).
func (e *env) makeDue(id string) {
	e.T.Helper()
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second).UnixMilli()
	if _, err := e.RDB.ZScore(ctx, e.Keys.Queue, id).Result(); err == nil {
		if err := e.RDB.ZAdd(ctx, e.Keys.Queue, zAt(past, id)).Err(); err != nil {
			e.T.Fatal(err)
		}
		return
	}
	if err := e.RDB.ZAddXX(ctx, e.Keys.Inflight, zAt(past, id)).Err(); err != nil {
		e.T.Fatal(err)
	}
}

func zAt(score int64, member string) redis.Z {
	return redis.Z{Score: float64(score), Member: member}
}

// A random workload of puts, re-puts, passes that succeed or fail (to
// backoff and to the dead letters), requeues, deletes and purges by age
// and by count, on a small pool of ids so that every interleaving of a
// dead letter with a live task of the same id occurs. After every step no
// payload may be left that neither a live task nor a dead letter owns.
func TestRetentionWorkloadLeavesNoOrphanPayloads(t *testing.T) {
	t.Parallel()
	seed := time.Now().UnixNano()
	t.Logf("seed %d (rerun with ORPHAN_SEED)", seed)
	if s := os.Getenv("ORPHAN_SEED"); s != "" {
		var err error
		if seed, err = strconv.ParseInt(s, 10, 64); err != nil {
			t.Fatal(err)
		}
	}
	rnd := rand.New(rand.NewPCG(uint64(seed), 0))
	e := newRedisEnv(t)
	ctx := context.Background()
	ids := []string{"a", "b", "c", "d", "e", "f"}
	pick := func() string { return ids[rnd.IntN(len(ids))] }
	outcome := func(_ context.Context, ts []Task) []error {
		errs := make([]error, len(ts))
		for i := range errs {
			if rnd.IntN(3) > 0 {
				errs[i] = errAction
			}
		}
		return errs
	}
	cfg := Config{MaxAttempts: 2, Process: outcome, Retry: func(int) time.Duration { return time.Hour }}
	for step := range 400 {
		var what string
		switch op := rnd.IntN(8); op {
		case 0, 1:
			id := pick()
			what = "put " + id
			mode := []client.Mode{client.Create, client.Reschedule}[rnd.IntN(2)]
			if _, _, err := e.cl.PutTask(ctx, id, json.RawMessage(`{"step":`+strconv.Itoa(step)+`}`), time.Now().Add(-time.Second), mode); err != nil {
				t.Fatal(err)
			}
		case 2, 3:
			what = "pass"
			e.runPass(cfg)
		case 4:
			// End every backoff, so failed tasks are claimed again.
			what = "backoffs end"
			held, err := e.RDB.ZRange(ctx, e.Keys.Inflight, 0, -1).Result()
			if err != nil {
				t.Fatal(err)
			}
			for _, id := range held {
				e.makeDue(id)
			}
		case 5:
			id := pick()
			what = "requeue " + id
			if _, err := e.st.Requeue(ctx, id); err != nil && !errors.Is(err, queue.ErrNotDead) {
				t.Fatal(err)
			}
		case 6:
			id := pick()
			what = "delete " + id
			if _, err := e.cl.DeleteTasks(ctx, id); err != nil {
				t.Fatal(err)
			}
		case 7:
			if rnd.IntN(2) == 0 {
				keep := rnd.IntN(3)
				what = "purge beyond " + strconv.Itoa(keep)
				e.purge(0, keep)
			} else {
				id := pick()
				what = "purge by age " + id
				e.deadAgo(id, 2*time.Hour)
				e.purge(time.Hour, 0)
			}
		}
		e.assertNoOrphans(fmt.Sprintf("step %d (%s)", step, what))
	}
}

// The same invariant on the paths of a polled queue (claims, acks, leases
// that expire, tasks over their attempts dead-lettered by a poll) and of a
// reliable list (forwards, takes, acks, unacknowledged items returned or
// dead-lettered with their payload), mixed with re-puts, requeues, deletes
// and purges.
func TestRetentionWorkloadOnPollAndReliableListQueues(t *testing.T) {
	t.Parallel()
	seed := time.Now().UnixNano()
	t.Logf("seed %d (rerun with ORPHAN_SEED)", seed)
	if s := os.Getenv("ORPHAN_SEED"); s != "" {
		var err error
		if seed, err = strconv.ParseInt(s, 10, 64); err != nil {
			t.Fatal(err)
		}
	}
	for _, kind := range []string{"poll", "reliable list"} {
		t.Run(kind, func(t *testing.T) {
			rnd := rand.New(rand.NewPCG(uint64(seed), 1))
			e := newRedisEnv(t)
			ctx := context.Background()
			ids := []string{"a", "b", "c", "d", "e"}
			pick := func() string { return ids[rnd.IntN(len(ids))] }
			var tokens []string
			list := reliableList(time.Minute, 2)
			for step := range 400 {
				var what string
				switch op := rnd.IntN(9); op {
				case 0, 1:
					id := pick()
					what = "put " + id
					mode := []client.Mode{client.Create, client.Reschedule}[rnd.IntN(2)]
					if _, _, err := e.cl.PutTask(ctx, id, json.RawMessage(`{"step":`+strconv.Itoa(step)+`}`), time.Now().Add(-time.Second), mode); err != nil {
						t.Fatal(err)
					}
				case 2:
					if kind == "poll" {
						what = "poll"
						_, tok, err := pollTasks(ctx, e.RDB, e.Keys, 1+rnd.IntN(3), 0, time.Minute, 2)
						if err != nil {
							t.Fatal(err)
						}
						if tok != "" {
							tokens = append(tokens, tok)
						}
					} else {
						what = "forward"
						e.forwardOnce(list)
					}
				case 3:
					if kind == "poll" {
						if len(tokens) == 0 {
							continue
						}
						what = "ack"
						tok := tokens[rnd.IntN(len(tokens))]
						if _, _, err := queue.NewStore(e.RDB, e.Keys).AckTasks(ctx, tok, []string{pick(), pick()}[:1+rnd.IntN(2)]); err != nil {
							t.Fatal(err)
						}
					} else {
						what = "take"
						if it, err := e.cl.Take(ctx); err == nil && rnd.IntN(2) == 0 {
							what = "take and ack " + it.ID
							if err := e.cl.Ack(ctx, it); err != nil && !errors.Is(err, client.ErrNotFound) {
								t.Fatal(err)
							}
						}
					}
				case 4:
					what = "leases expire"
					if kind == "poll" {
						held, err := e.RDB.ZRange(ctx, e.Keys.Inflight, 0, -1).Result()
						if err != nil {
							t.Fatal(err)
						}
						for _, id := range held {
							e.makeDue(id)
						}
					} else {
						taken, err := e.RDB.ZRange(ctx, e.Keys.Unacked, 0, -1).Result()
						if err != nil {
							t.Fatal(err)
						}
						for _, id := range taken {
							e.takenAgo(id, 2*time.Minute)
						}
					}
				case 5:
					id := pick()
					what = "requeue " + id
					if _, err := e.st.Requeue(ctx, id); err != nil && !errors.Is(err, queue.ErrNotDead) {
						t.Fatal(err)
					}
				case 6:
					id := pick()
					what = "delete " + id
					if _, err := e.cl.DeleteTasks(ctx, id); err != nil {
						t.Fatal(err)
					}
				case 7, 8:
					if rnd.IntN(2) == 0 {
						keep := rnd.IntN(3)
						what = "purge beyond " + strconv.Itoa(keep)
						e.purge(0, keep)
					} else {
						id := pick()
						what = "purge by age " + id
						e.deadAgo(id, 2*time.Hour)
						e.purge(time.Hour, 0)
					}
				}
				e.assertNoOrphans(fmt.Sprintf("step %d (%s)", step, what))
			}
		})
	}
}

// A stream entry dead-lettered by the sweep gets its payload back from the
// entry (for a requeue); its purge takes that payload too.
func TestPurgeOfAStreamDeadLetter(t *testing.T) {
	t.Parallel()
	e, cfg := streamEnv(t)
	ctx := context.Background()
	e.putDue("s-1", `{"n":1}`)
	e.forwardOnce(cfg)
	res, err := e.RDB.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "c1", Streams: []string{e.Keys.Stream, ">"}, Count: 10, Block: -1}).Result()
	if err != nil || len(res) != 1 || len(res[0].Messages) != 1 {
		t.Fatalf("XREADGROUP: %v, %v", res, err)
	}
	entry := res[0].Messages[0].ID
	e.idleFor("g", "c1", entry, 2*time.Minute)
	e.forwardOnce(cfg) // one delivery of two
	if err := e.RDB.Do(ctx, "XCLAIM", e.Keys.Stream, "g", "c2", 0, entry).Err(); err != nil {
		t.Fatal(err)
	}
	e.idleFor("g", "c2", entry, 2*time.Minute)
	e.forwardOnce(cfg)
	if p := e.payloadOf("s-1"); p != `{"n":1}` {
		t.Fatalf("stream dead letter's payload %q, want it back for a requeue", p)
	}
	e.deadAgo("s-1", 2*time.Hour)
	if n := e.purge(time.Hour, 0); n != 1 {
		t.Fatalf("purged %d, want 1", n)
	}
	e.assertNoOrphans("after purging a stream dead letter")
	if p := e.payloadOf("s-1"); p != "" {
		t.Fatalf("payload %q left after its dead letter was purged", p)
	}
}
