package client_test

import (
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// newSharded returns a client with shards shards on a queue of the test's
// own; every shard's keys are deleted when the test ends.
func newSharded(t *testing.T, shards int) (*client.Client, *redis.Client, queue.Keys) {
	t.Helper()
	rdb, keys := testenv.Redis(t)
	c, err := client.New(rdb, keys.Queue, client.WithShards(shards))
	if err != nil {
		t.Fatalf("client.New(%q, WithShards(%d)): %v", keys.Queue, shards, err)
	}
	t.Cleanup(func() {
		for _, k := range c.AllKeys()[1:] {
			testenv.DeleteQueue(rdb, k)
		}
	})
	return c, rdb, keys
}

func TestWithShardsRange(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	for _, n := range []int{-1, 0, queue.MaxShards + 1} {
		if _, err := client.New(rdb, keys.Queue, client.WithShards(n)); err == nil {
			t.Errorf("New with WithShards(%d) = nil error, want an error", n)
		}
	}
	c, err := client.New(rdb, keys.Queue, client.WithShards(1))
	if err != nil {
		t.Fatal(err)
	}
	if all := c.AllKeys(); len(all) != 1 || all[0] != keys || c.Shards() != 1 {
		t.Errorf("WithShards(1): AllKeys %v, Shards %d; want the queue's keys only", all, c.Shards())
	}
	c, err = client.New(rdb, keys.Queue, client.WithShards(4))
	if err != nil {
		t.Fatal(err)
	}
	all := c.AllKeys()
	if len(all) != 5 || all[0] != keys {
		t.Fatalf("WithShards(4): AllKeys %v, want the queue's keys then 4 shards", all)
	}
	for n, k := range all[1:] {
		if k != queue.NewKeys(queue.ShardKey(keys.Queue, n)) {
			t.Errorf("shard %d keys %v, want those of %q", n, k, queue.ShardKey(keys.Queue, n))
		}
	}
}

func TestShardedEnqueueManyRoutesBySerial(t *testing.T) {
	const shards, n = 4, 2500 // more than two script calls on some shards
	c, rdb, keys := newSharded(t, shards)
	ctx := ctxT(t)
	start := base()
	items := make([]client.Item, n)
	for i := range items {
		items[i] = client.Item{Serial: fmt.Sprintf("sh-%05d", i), Deadline: start.Add(time.Duration(i) * time.Millisecond)}
	}
	res, err := c.EnqueueMany(ctx, items, client.Create)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range res {
		if r.Result != client.Created || !r.Deadline.Equal(items[i].Deadline) {
			t.Fatalf("item %d: %s at %s, want created at %s (results in the items' order)", i, r.Result, r.Deadline, items[i].Deadline)
		}
	}
	if got := zcard(t, rdb, keys.Queue); got != 0 {
		t.Errorf("the queue key holds %d entries, want none (all in shards)", got)
	}
	var total int64
	for sh, k := range c.AllKeys()[1:] {
		got := zcard(t, rdb, k.Queue)
		total += got
		if got < n/shards*8/10 {
			t.Errorf("shard %d holds %d entries, want about %d", sh, got, n/shards)
		}
	}
	if total != n {
		t.Errorf("shards hold %d entries, want %d", total, n)
	}
	for _, it := range items[:50] {
		k := queue.KeyFor(keys.Queue, it.Serial, shards)
		if got := zscore(t, rdb, k, it.Serial); got != it.Deadline.UnixMilli() {
			t.Errorf("%s in %s: score %d, want %d", it.Serial, k, got, it.Deadline.UnixMilli())
		}
	}
	// Idempotent per shard.
	res, err = c.EnqueueMany(ctx, items[:10], client.Create)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range res {
		if r.Result != client.Unchanged {
			t.Errorf("retry of item %d: %s, want unchanged", i, r.Result)
		}
	}
	e, err := c.Get(ctx, items[7].Serial)
	if err != nil || e.State != client.StateQueued || !e.Deadline.Equal(items[7].Deadline) {
		t.Errorf("Get: %+v, %v; want queued at %s", e, err, items[7].Deadline)
	}
	if err := c.Cancel(ctx, items[7].Serial); err != nil {
		t.Errorf("Cancel: %v", err)
	}
	if _, err := c.Get(ctx, items[7].Serial); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("Get after Cancel: %v, want ErrNotFound", err)
	}
	if err := c.Cancel(ctx, items[7].Serial); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("second Cancel: %v, want ErrNotFound", err)
	}
}

// Entries written to the queue key before the switch to shards (or by a
// producer that ignores sharding) stay reachable through a sharded client.
func TestShardedClientFindsTheQueueKey(t *testing.T) {
	c, rdb, keys := newSharded(t, 4)
	ctx := ctxT(t)
	old := base()
	later := old.Add(time.Hour)
	serials := []string{"pre-queued", "pre-resched", "pre-later", "pre-earlier", "pre-leased", "pre-cancel"}
	for _, s := range serials[:5] {
		if err := rdb.ZAdd(ctx, keys.Queue, redis.Z{Score: float64(old.UnixMilli()), Member: s}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	if err := rdb.ZRem(ctx, keys.Queue, "pre-leased").Err(); err != nil {
		t.Fatal(err)
	}
	seedLease(t, rdb, keys, "pre-leased", old, old.Add(time.Minute), 1, "replica-1:1", "")
	if err := rdb.ZAdd(ctx, keys.Queue, redis.Z{Score: float64(old.UnixMilli()), Member: "pre-cancel"}).Err(); err != nil {
		t.Fatal(err)
	}
	shardOf := func(s string) string { return queue.KeyFor(keys.Queue, s, 4) }

	// Get falls back to the queue key.
	e, err := c.Get(ctx, "pre-queued")
	if err != nil || e.State != client.StateQueued || !e.Deadline.Equal(old) {
		t.Errorf("Get of a queue-key entry: %+v, %v; want queued at %s", e, err, old)
	}
	// Reschedule moves it into its shard at the new deadline.
	res, at, err := c.Enqueue(ctx, "pre-resched", later, client.Reschedule)
	if err != nil || res != client.Moved || !at.Equal(later) {
		t.Errorf("Reschedule: %s at %s (%v), want moved to %s", res, at, err, later)
	}
	// OnlyLater with a later deadline moves it; with an earlier one it
	// keeps its deadline, in its shard.
	res, at, err = c.Enqueue(ctx, "pre-later", later, client.OnlyLater)
	if err != nil || res != client.Moved || !at.Equal(later) {
		t.Errorf("OnlyLater, later: %s at %s (%v), want moved to %s", res, at, err, later)
	}
	res, at, err = c.Enqueue(ctx, "pre-earlier", old.Add(-time.Minute), client.OnlyLater)
	if err != nil || res != client.Unchanged || !at.Equal(old) {
		t.Errorf("OnlyLater, earlier: %s at %s (%v), want unchanged at %s", res, at, err, old)
	}
	// A leased entry is moved too: its lease record goes, so the replica
	// holding it cannot remove the new entry.
	res, at, err = c.Enqueue(ctx, "pre-leased", later, client.Reschedule)
	if err != nil || res != client.Moved || !at.Equal(later) {
		t.Errorf("Reschedule of a leased entry: %s at %s (%v), want moved to %s", res, at, err, later)
	}
	for s, want := range map[string]time.Time{"pre-resched": later, "pre-later": later, "pre-earlier": old, "pre-leased": later} {
		if got := zscore(t, rdb, shardOf(s), s); got != want.UnixMilli() {
			t.Errorf("%s in its shard: %d, want %d", s, got, want.UnixMilli())
		}
		if err := rdb.ZScore(ctx, keys.Queue, s).Err(); !errors.Is(err, redis.Nil) {
			t.Errorf("%s still in the queue key (%v)", s, err)
		}
	}
	if n, _ := rdb.HLen(ctx, keys.Lease).Result(); n != 0 {
		t.Errorf("%d lease records left in the queue key, want 0", n)
	}
	// Cancel removes a queue-key entry.
	if err := c.Cancel(ctx, "pre-cancel"); err != nil {
		t.Errorf("Cancel of a queue-key entry: %v", err)
	}
	if err := rdb.ZScore(ctx, keys.Queue, "pre-cancel").Err(); !errors.Is(err, redis.Nil) {
		t.Errorf("pre-cancel still in the queue key (%v)", err)
	}
	// A Create does not look in the queue key: the documented duplicate.
	res, _, err = c.Enqueue(ctx, "pre-queued", later, client.Create)
	if err != nil || res != client.Created {
		t.Errorf("Create of a serial in the queue key: %s (%v), want created in its shard", res, err)
	}
	if got := zscore(t, rdb, keys.Queue, "pre-queued"); got != old.UnixMilli() {
		t.Errorf("the queue key's entry moved to %d, want it kept at %d", got, old.UnixMilli())
	}
	if err := c.Cancel(ctx, "pre-queued"); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{keys.Queue, shardOf("pre-queued")} {
		if err := rdb.ZScore(ctx, k, "pre-queued").Err(); !errors.Is(err, redis.Nil) {
			t.Errorf("Cancel left pre-queued in %s (%v), want it gone from both", k, err)
		}
	}
}

// Moving a queue-key entry into its shard for a Reschedule must not wake
// the shard's scanner for the old deadline: until the reschedule has
// landed the daemon would take that wake-up (and a claim) for a deadline
// that no longer holds. Only the written deadline is published, and only
// when it is earlier than the shard's head, as for any enqueue.
func TestShardedRescheduleWakesOnlyForTheNewDeadline(t *testing.T) {
	c, rdb, keys := newSharded(t, 4)
	ctx := ctxT(t)
	old := time.Now().Add(time.Minute).Truncate(time.Millisecond)
	// wakeUps reschedules serial (queued in the queue key at old) to
	// deadline and returns what its shard's wake channel carried.
	wakeUps := func(serial string, deadline time.Time) []string {
		t.Helper()
		if err := rdb.ZAdd(ctx, keys.Queue, redis.Z{Score: float64(old.UnixMilli()), Member: serial}).Err(); err != nil {
			t.Fatal(err)
		}
		wake := queue.NewKeys(queue.KeyFor(keys.Queue, serial, 4)).Wake
		ps := rdb.Subscribe(ctx, wake)
		defer ps.Close()
		if _, err := ps.Receive(ctx); err != nil { // the subscription is in place
			t.Fatal(err)
		}
		if res, at, err := c.Enqueue(ctx, serial, deadline, client.Reschedule); err != nil || res != client.Moved || !at.Equal(deadline) {
			t.Fatalf("Reschedule %s: %s at %s (%v), want moved to %s", serial, res, at, err, deadline)
		}
		// A marker published after the call: every wake-up the call sent
		// arrives before it.
		if err := rdb.Publish(ctx, wake, "marker").Err(); err != nil {
			t.Fatal(err)
		}
		var got []string
		for ch := ps.Channel(); ; {
			msg := <-ch
			if msg.Payload == "marker" {
				return got
			}
			got = append(got, msg.Payload)
		}
	}
	ms := func(d time.Time) string { return fmt.Sprint(d.UnixMilli()) }

	earlier := old.Add(-30 * time.Second)
	if got := wakeUps("adopt-earlier", earlier); !slices.Equal(got, []string{ms(earlier)}) {
		t.Errorf("rescheduled earlier: wake-ups %v, want only the new deadline %s (old %s)", got, ms(earlier), ms(old))
	}
	later := old.Add(time.Hour)
	if got := wakeUps("adopt-later", later); slices.Contains(got, ms(old)) {
		t.Errorf("rescheduled later: wake-ups %v include the old deadline %s", got, ms(old))
	}
}
