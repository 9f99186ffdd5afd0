package consumer

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/metrics"
)

// Stream and reliable-list queues: the queue's ack_timeout and
// retry.max_attempts decide redelivery and dead-lettering, whatever the
// consumer does. Time passing is simulated by writing the instant an item
// was taken (reliable list) or an entry's idle time (stream, XCLAIM IDLE)
// into the keys production reads, never by sleeping.

// putDue puts a task due a second ago.
func (e *env) putDue(id, payload string) {
	e.T.Helper()
	if _, _, err := e.cl.PutTask(context.Background(), id, json.RawMessage(payload), time.Now().Add(-time.Second), client.Create); err != nil {
		e.T.Fatal(err)
	}
}

// forwardOnce runs one forward pass of a fresh consumer (as a replica's
// scan would) and returns what it did.
func (e *env) forwardOnce(cfg Config) claimResult {
	e.T.Helper()
	res, err := e.consumer(cfg).claim(context.Background(), 100)
	if err != nil {
		e.T.Fatal(err)
	}
	return res
}

// takenAgo rewrites when the taken item id was taken to d before Redis's
// now, as if the consumer had held it that long.
func (e *env) takenAgo(id string, d time.Duration) {
	e.T.Helper()
	at := e.RedisNow().Add(-d).UnixMilli()
	if err := e.RDB.ZAdd(context.Background(), e.Keys.Unacked, redis.Z{Score: float64(at), Member: id}).Err(); err != nil {
		e.T.Fatal(err)
	}
}

func (e *env) llen(key string) int64 {
	e.T.Helper()
	n, err := e.RDB.LLen(context.Background(), key).Result()
	if err != nil {
		e.T.Fatal(err)
	}
	return n
}

func reliableList(ack time.Duration, maxAttempts int) Config {
	return Config{MaxAttempts: maxAttempts, Forward: &Forward{Kind: "list", Queue: "rl", Reliable: true, AckTimeout: ack}}
}

// The queue's ack_timeout governs redelivery: an item taken two minutes
// ago is still the consumer's under a one-hour ack_timeout, and comes back
// once it has been held for longer than that.
func TestReliableListRedeliversAfterTheQueuesAckTimeout(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	cfg := reliableList(time.Hour, 5)
	e.putDue("rl-1", `{"n":1}`)
	if res := e.forwardOnce(cfg); res.forwarded != 1 {
		t.Fatalf("forwarded %d, want 1", res.forwarded)
	}
	it, err := e.cl.Take(ctx)
	if err != nil || it.ID != "rl-1" || it.Attempts != 0 {
		t.Fatalf("Take: %+v, %v; want rl-1 on its first delivery", it, err)
	}
	e.takenAgo("rl-1", 2*time.Minute)
	e.forwardOnce(cfg)
	if n := e.llen(e.Keys.Ready); n != 0 {
		t.Fatalf("ready list holds %d items after 2m of a 1h ack_timeout: the item was redelivered early", n)
	}
	e.takenAgo("rl-1", time.Hour+time.Second)
	res := e.forwardOnce(cfg)
	if n := e.llen(e.Keys.Ready); n != 1 {
		t.Fatalf("ready list holds %d items after the 1h ack_timeout passed, want 1", n)
	}
	if res.nextExpiry != -1 {
		t.Errorf("next recovery %d with nothing taken, want -1", res.nextExpiry)
	}
	if err := e.cl.Ack(ctx, it); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("Ack of a redelivered item: %v, want ErrNotFound", err)
	}
	it, err = e.cl.Take(ctx)
	if err != nil || it.ID != "rl-1" || it.Attempts != 1 {
		t.Fatalf("second Take: %+v, %v; want rl-1 with 1 earlier attempt", it, err)
	}
	// The scanner wakes when the item's ack_timeout ends.
	res = e.forwardOnce(cfg)
	if want := e.RedisNow().Add(time.Hour).UnixMilli(); res.nextExpiry < want-5000 || res.nextExpiry > want {
		t.Errorf("next recovery at %d, want about %d (taken now + 1h)", res.nextExpiry, want)
	}
	if err := e.cl.Ack(ctx, it); err != nil {
		t.Fatal(err)
	}
	if n := e.llen(e.Keys.Processing); n != 0 {
		t.Errorf("processing list holds %d after the ack", n)
	}
	if n, _ := e.RDB.HLen(ctx, e.Keys.Deliveries).Result(); n != 0 {
		t.Errorf("%d delivery counts left after the ack", n)
	}
}

// After max_attempts deliveries without an ack the item is dead-lettered
// as failed, with its payload, instead of redelivered; a requeue runs it
// again with that payload.
func TestReliableListDeadLettersAfterMaxAttempts(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	cfg := reliableList(time.Minute, 2)
	e.putDue("rl-1", `{"big":12345678901234567890,"s":"a|b"}`)
	e.forwardOnce(cfg)
	var deliveries []int
	for range 4 {
		it, err := e.cl.Take(ctx)
		if errors.Is(err, client.ErrNotFound) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		deliveries = append(deliveries, it.Attempts)
		e.takenAgo(it.ID, 2*time.Minute) // the consumer died holding it
		e.forwardOnce(cfg)
	}
	if got := len(deliveries); got != 2 || deliveries[0] != 0 || deliveries[1] != 1 {
		t.Fatalf("attempts seen by the consumer %v, want [0 1]: delivered exactly max_attempts times", deliveries)
	}
	dead, err := e.st.Dead(ctx, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(dead) != 1 || dead[0].Serial != "rl-1" || dead[0].Reason != ReasonFailed || dead[0].Attempts != 2 ||
		!strings.Contains(dead[0].LastError, "ack_timeout") || dead[0].Deadline == "" {
		t.Fatalf("dead letters %+v, want rl-1 failed after 2 attempts", dead)
	}
	for _, key := range []string{e.Keys.Ready, e.Keys.Processing} {
		if n := e.llen(key); n != 0 {
			t.Errorf("%s holds %d items after the dead letter", key, n)
		}
	}
	if v := testutil.ToFloat64(e.m.DeadLettered.WithLabelValues(ReasonFailed)); v != 1 {
		t.Errorf("dead_lettered{failed} = %v, want 1", v)
	}
	task, err := e.cl.GetTask(ctx, "rl-1")
	if err != nil || task.State != "dead" || string(task.Payload) != `{"big":12345678901234567890,"s":"a|b"}` {
		t.Fatalf("GetTask: %+v, %v; want dead with its payload byte for byte", task, err)
	}
	if _, err := e.st.Requeue(ctx, "rl-1"); err != nil {
		t.Fatal(err)
	}
	e.forwardOnce(cfg)
	it, err := e.cl.Take(ctx)
	if err != nil || it.ID != "rl-1" || string(it.Payload) != `{"big":12345678901234567890,"s":"a|b"}` || it.Attempts != 0 {
		t.Fatalf("Take after requeue: %+v, %v; want rl-1 with its payload, attempts from 0", it, err)
	}
}

// nested returns JSON nested depth levels deep.
func nested(depth int) string {
	return strings.Repeat("[", depth) + strings.Repeat("]", depth)
}

// An item whose payload is deeper than Redis's JSON decoder allows (left by
// a producer before payload depth was bounded) can still be taken and
// acknowledged: the scripts never decode the payload.
func TestReliableListItemNestedBeyondRedisCJSONCanBeAcked(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	cfg := reliableList(time.Minute, 5)
	deep := nested(1001)
	due := float64(e.RedisNow().Add(-time.Second).UnixMilli())
	if err := e.RDB.HSet(ctx, e.Keys.Payload, "deep-1", deep).Err(); err != nil {
		t.Fatal(err)
	}
	if err := e.RDB.ZAdd(ctx, e.Keys.Queue, redis.Z{Score: due, Member: "deep-1"}).Err(); err != nil {
		t.Fatal(err)
	}
	e.forwardOnce(cfg)
	it, err := e.cl.Take(ctx)
	if err != nil || it.ID != "deep-1" || len(it.Payload) != len(deep) {
		t.Fatalf("Take: id %q, %d payload bytes, %v", it.ID, len(it.Payload), err)
	}
	if err := e.cl.Ack(ctx, it); err != nil {
		t.Fatalf("Ack of a deeply nested item: %v", err)
	}
	if n := e.llen(e.Keys.Processing); n != 0 {
		t.Errorf("processing list holds %d after the ack", n)
	}
}

// streamEnv is a stream queue with a consumer group "g".
func streamEnv(t *testing.T) (*env, Config) {
	e := newRedisEnv(t)
	if err := e.RDB.XGroupCreateMkStream(context.Background(), e.Keys.Stream, "g", "0").Err(); err != nil {
		t.Fatal(err)
	}
	return e, Config{MaxAttempts: 2, Forward: &Forward{Kind: "stream", Queue: "ev", MaxLen: 1000, AckTimeout: time.Minute}}
}

// A stream queue that has forwarded nothing yet has no stream: its sweep
// finds no groups, and neither logs nor counts an error.
func TestStreamSweepBeforeTheFirstForwardIsNoError(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	cfg := Config{MaxAttempts: 2, Forward: &Forward{Kind: "stream", Queue: "ev", MaxLen: 1000, AckTimeout: time.Minute}}
	e.forwardOnce(cfg)
	if n := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageClaim)); n != 0 {
		t.Errorf("%v claim-stage errors after a sweep of a queue with no stream yet, want 0", n)
	}
}

// idleFor makes a pending stream entry look idle for d (XCLAIM ... IDLE
// JUSTID changes neither its owner's count of deliveries nor anything else).
func (e *env) idleFor(group, consumer, id string, d time.Duration) {
	e.T.Helper()
	err := e.RDB.Do(context.Background(), "XCLAIM", e.Keys.Stream, group, consumer, 0, id, "IDLE", d.Milliseconds(), "JUSTID").Err()
	if err != nil {
		e.T.Fatal(err)
	}
}

// A stream entry delivered max_attempts times and then left unacknowledged
// for ack_timeout is acknowledged and its task dead-lettered; entries
// carry no made-up attempt count (Redis's delivery count is the real one).
func TestStreamEntriesDeadLetteredAfterMaxDeliveries(t *testing.T) {
	t.Parallel()
	e, cfg := streamEnv(t)
	ctx := context.Background()
	e.putDue("ev-1", `{"n":1}`)
	e.putDue("ev-2", `{"n":2}`)
	e.forwardOnce(cfg)
	res, err := e.RDB.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "c1", Streams: []string{e.Keys.Stream, ">"}, Count: 10, Block: -1}).Result()
	if err != nil || len(res) != 1 || len(res[0].Messages) != 2 {
		t.Fatalf("XREADGROUP: %v, %v", res, err)
	}
	byTask := map[string]string{}
	for _, m := range res[0].Messages {
		if a, ok := m.Values["attempts"]; ok {
			t.Errorf("entry %s carries attempts %v, which no redelivery updates", m.ID, a)
		}
		byTask[m.Values["id"].(string)] = m.ID
	}
	if err := e.RDB.XAck(ctx, e.Keys.Stream, "g", byTask["ev-2"]).Err(); err != nil {
		t.Fatal(err)
	}
	// c1 died holding ev-1. One delivery of two: not dead yet.
	e.idleFor("g", "c1", byTask["ev-1"], 2*time.Minute)
	e.forwardOnce(cfg)
	if n := e.card(e.Keys.Dead); n != 0 {
		t.Fatalf("%d dead letters after one delivery of max_attempts 2", n)
	}
	// c2 reclaims it (second delivery) and dies too.
	claimed, _, err := e.RDB.XAutoClaim(ctx, &redis.XAutoClaimArgs{Stream: e.Keys.Stream, Group: "g", Consumer: "c2", MinIdle: time.Minute, Start: "0"}).Result()
	if err != nil || len(claimed) != 1 {
		t.Fatalf("XAUTOCLAIM: %d entries, %v", len(claimed), err)
	}
	// Not yet idle for ack_timeout: c2 may still be working on it.
	e.forwardOnce(cfg)
	if n := e.card(e.Keys.Dead); n != 0 {
		t.Fatalf("%d dead letters while the last delivery is within its ack_timeout", n)
	}
	e.idleFor("g", "c2", byTask["ev-1"], 2*time.Minute)
	e.forwardOnce(cfg)
	dead, err := e.st.Dead(ctx, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(dead) != 1 || dead[0].Serial != "ev-1" || dead[0].Reason != ReasonFailed || dead[0].Attempts != 2 ||
		!strings.Contains(dead[0].LastError, "consumer group g") {
		t.Fatalf("dead letters %+v, want ev-1 failed after 2 deliveries in group g", dead)
	}
	pending, err := e.RDB.XPending(ctx, e.Keys.Stream, "g").Result()
	if err != nil || pending.Count != 0 {
		t.Fatalf("pending after the dead letter: %+v, %v; want none (nobody reclaims it again)", pending, err)
	}
	if p, _ := e.RDB.HGet(ctx, e.Keys.Payload, "ev-1").Result(); p != `{"n":1}` {
		t.Errorf("dead task's payload %q, want it kept for a requeue", p)
	}
	if v := testutil.ToFloat64(e.m.DeadLettered.WithLabelValues(ReasonFailed)); v != 1 {
		t.Errorf("dead_lettered{failed} = %v, want 1", v)
	}
}
