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
)

// Reliable-list queues: the queue's ack_timeout and retry.max_attempts
// decide redelivery and dead-lettering, whatever the consumer does. Time
// passing is simulated by writing the instant an item was taken into the
// key production reads, never by sleeping.

// putDue puts a task due a second ago.
func (e *env) putDue(id, payload string) {
	e.t.Helper()
	if _, _, err := e.cl.PutTask(context.Background(), id, json.RawMessage(payload), time.Now().Add(-time.Second), client.Create); err != nil {
		e.t.Fatal(err)
	}
}

// forwardOnce runs one forward pass of a fresh consumer (as a replica's
// scan would) and returns what it did.
func (e *env) forwardOnce(cfg Config) claimResult {
	e.t.Helper()
	res, err := e.consumer(cfg).claim(context.Background(), 100)
	if err != nil {
		e.t.Fatal(err)
	}
	return res
}

// takenAgo rewrites when the taken item id was taken to d before Redis's
// now, as if the consumer had held it that long.
func (e *env) takenAgo(id string, d time.Duration) {
	e.t.Helper()
	at := e.redisNow().Add(-d).UnixMilli()
	if err := e.rdb.ZAdd(context.Background(), e.keys.Unacked, redis.Z{Score: float64(at), Member: id}).Err(); err != nil {
		e.t.Fatal(err)
	}
}

func (e *env) llen(key string) int64 {
	e.t.Helper()
	n, err := e.rdb.LLen(context.Background(), key).Result()
	if err != nil {
		e.t.Fatal(err)
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
	if n := e.llen(e.keys.Ready); n != 0 {
		t.Fatalf("ready list holds %d items after 2m of a 1h ack_timeout: the item was redelivered early", n)
	}
	e.takenAgo("rl-1", time.Hour+time.Second)
	res := e.forwardOnce(cfg)
	if n := e.llen(e.keys.Ready); n != 1 {
		t.Fatalf("ready list holds %d items after the 1h ack_timeout passed, want 1", n)
	}
	if res.nextExpiry != -1 {
		t.Errorf("next recovery %d with nothing taken, want -1", res.nextExpiry)
	}
	if err := e.cl.Ack(ctx, "rl-1"); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("Ack of a redelivered item: %v, want ErrNotFound", err)
	}
	it, err = e.cl.Take(ctx)
	if err != nil || it.ID != "rl-1" || it.Attempts != 1 {
		t.Fatalf("second Take: %+v, %v; want rl-1 with 1 earlier attempt", it, err)
	}
	// The scanner wakes when the item's ack_timeout ends.
	res = e.forwardOnce(cfg)
	if want := e.redisNow().Add(time.Hour).UnixMilli(); res.nextExpiry < want-5000 || res.nextExpiry > want {
		t.Errorf("next recovery at %d, want about %d (taken now + 1h)", res.nextExpiry, want)
	}
	if err := e.cl.Ack(ctx, "rl-1"); err != nil {
		t.Fatal(err)
	}
	if n := e.llen(e.keys.Processing); n != 0 {
		t.Errorf("processing list holds %d after the ack", n)
	}
	if n, _ := e.rdb.HLen(ctx, e.keys.Deliveries).Result(); n != 0 {
		t.Errorf("%d delivery counts left after the ack", n)
	}
}

// After max_attempts deliveries without an ack the item is dead-lettered
// as failed, with its payload, instead of redelivered; a requeue runs it
// again with that payload.
func TestReliableListDeadLettersAfterMaxAttempts(t *testing.T) {
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
	dead, err := ListDead(ctx, e.rdb, e.keys, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(dead) != 1 || dead[0].Serial != "rl-1" || dead[0].Reason != ReasonFailed || dead[0].Attempts != 2 ||
		!strings.Contains(dead[0].LastError, "ack_timeout") || dead[0].Deadline == "" {
		t.Fatalf("dead letters %+v, want rl-1 failed after 2 attempts", dead)
	}
	for _, key := range []string{e.keys.Ready, e.keys.Processing} {
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
	if _, err := Requeue(ctx, e.rdb, e.keys, "rl-1"); err != nil {
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
	e := newRedisEnv(t)
	ctx := context.Background()
	cfg := reliableList(time.Minute, 5)
	deep := nested(1001)
	due := float64(e.redisNow().Add(-time.Second).UnixMilli())
	if err := e.rdb.HSet(ctx, e.keys.Payload, "deep-1", deep).Err(); err != nil {
		t.Fatal(err)
	}
	if err := e.rdb.ZAdd(ctx, e.keys.Queue, redis.Z{Score: due, Member: "deep-1"}).Err(); err != nil {
		t.Fatal(err)
	}
	e.forwardOnce(cfg)
	it, err := e.cl.Take(ctx)
	if err != nil || it.ID != "deep-1" || len(it.Payload) != len(deep) {
		t.Fatalf("Take: id %q, %d payload bytes, %v", it.ID, len(it.Payload), err)
	}
	if err := e.cl.Ack(ctx, "deep-1"); err != nil {
		t.Fatalf("Ack of a deeply nested item: %v", err)
	}
	if n := e.llen(e.keys.Processing); n != 0 {
		t.Errorf("processing list holds %d after the ack", n)
	}
}
