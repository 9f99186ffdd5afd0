package queue_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Pause keeps the first pause's time and reason, Resume clears the flag and
// wakes waiting scanners, and a flag set by hand still reads as paused.
func TestStorePauseResume(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	st := queue.NewStore(rdb, keys)
	ctx := context.Background()
	if ps, err := st.PauseState(ctx); err != nil || ps.Paused {
		t.Fatalf("fresh queue: %+v, %v; want not paused", ps, err)
	}
	first := time.UnixMilli(1_700_000_000_000)
	if err := st.Pause(ctx, first, "deploy\nwindow"); err != nil {
		t.Fatal(err)
	}
	if err := st.Pause(ctx, first.Add(time.Hour), "second"); err != nil {
		t.Fatal(err)
	}
	ps, err := st.PauseState(ctx)
	if err != nil || ps != (queue.PauseState{Paused: true, Reason: "deploy window", Since: first}) {
		t.Errorf("paused twice: %+v, %v; want the first pause, its newline a space", ps, err)
	}
	sub := rdb.Subscribe(ctx, keys.Wake)
	defer sub.Close()
	if _, err := sub.Receive(ctx); err != nil {
		t.Fatal(err)
	}
	if err := st.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	msg, err := sub.ReceiveMessage(ctx)
	if err != nil || msg.Payload != "0" {
		t.Errorf("wake-up %v, %v; want 0", msg, err)
	}
	if ps, err := st.PauseState(ctx); err != nil || ps.Paused {
		t.Errorf("resumed: %+v, %v", ps, err)
	}
	if err := st.Pause(ctx, first, ""); err != nil {
		t.Fatal(err)
	}
	if ps, _ := st.PauseState(ctx); ps.Reason != "paused by an operator" {
		t.Errorf("no reason given: reason %q", ps.Reason)
	}
	rdb.Set(ctx, keys.Paused, "by hand", 0)
	if ps, err := st.PauseState(ctx); err != nil || ps != (queue.PauseState{Paused: true, Reason: "by hand"}) {
		t.Errorf("a flag set by hand: %+v, %v", ps, err)
	}
}

// ExtendDeadlines moves every entry due by until (ties across its batches
// of 500 included) exactly once, leaves later ones alone, and stops at an
// error of its callback.
func TestStoreExtendDeadlines(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	st := queue.NewStore(rdb, keys)
	ctx := context.Background()
	base := int64(1_700_000_000_000)
	var zs []redis.Z
	for i := range 1200 {
		zs = append(zs, redis.Z{Member: fmt.Sprintf("o-%04d", i), Score: float64(base + int64(i%3))}) // 400 per deadline
	}
	zs = append(zs, redis.Z{Member: "later", Score: float64(base + 10_000)})
	rdb.ZAdd(ctx, keys.Queue, zs...)
	seen := map[string]int{}
	step, err := st.ExtendDeadlines(ctx, time.UnixMilli(base+2), time.Minute, func(moved []string) error {
		for _, s := range moved {
			seen[s]++
		}
		return nil
	})
	if err != nil || step.Moved != 1200 || step.Calls < 3 {
		t.Fatalf("extend: %+v, %v; want 1200 moved in at least 3 calls", step, err)
	}
	if len(seen) != 1200 {
		t.Errorf("callback told of %d serials, want 1200", len(seen))
	}
	for s, n := range seen {
		if n != 1 {
			t.Fatalf("%s reported %d times", s, n)
		}
		d, _ := rdb.ZScore(ctx, keys.Queue, s).Result()
		if int64(d) < base+60_000 || int64(d) > base+60_002 {
			t.Fatalf("%s due %d, want moved a minute later", s, int64(d))
		}
	}
	if d, _ := rdb.ZScore(ctx, keys.Queue, "later").Result(); int64(d) != base+10_000 {
		t.Errorf("an entry due after the window moved to %d", int64(d))
	}
	boom := errors.New("boom")
	step, err = st.ExtendDeadlines(ctx, time.UnixMilli(base+70_000), time.Minute, func([]string) error { return boom })
	if !errors.Is(err, boom) || step.Calls != 1 {
		t.Errorf("callback error: %+v, %v; want the error after one call", step, err)
	}
}
