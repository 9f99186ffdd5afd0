package queue_test

import (
	"context"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// BuryStreamEntries dead-letters a group's entries that used up their
// deliveries, with the payload they carried, and leaves the others (and
// the other groups) alone; an exhausted entry with no task is only
// acknowledged.
func TestStoreBuryStreamEntries(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	st := queue.NewStore(rdb, keys)
	ctx := context.Background()
	if gs, err := st.StreamGroups(ctx); err != nil || gs != nil {
		t.Fatalf("no stream yet: %v, %v; want no groups", gs, err)
	}
	add := func(vals ...any) string {
		id, err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: keys.Stream, Values: vals}).Result()
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	tired := add("id", "T-1", "deadline", "1700000000000", "payload", `{"n":1}`)
	fresh := add("id", "T-2", "deadline", "1700000000000", "payload", `{"n":2}`)
	junk := add("other", "x")
	for _, g := range []string{"g", "h"} {
		if err := rdb.XGroupCreate(ctx, keys.Stream, g, "0").Err(); err != nil {
			t.Fatal(err)
		}
		if err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: g, Consumer: "c", Streams: []string{keys.Stream, ">"}}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	// Two more deliveries of tired and junk in group g: three in all.
	for range 2 {
		if err := rdb.XClaim(ctx, &redis.XClaimArgs{Stream: keys.Stream, Group: "g", Consumer: "c", Messages: []string{tired, junk}}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	gs, err := st.StreamGroups(ctx)
	if err != nil || len(gs) != 2 || gs[0] != (queue.StreamGroup{Name: "g", Pending: 3}) {
		t.Fatalf("groups %+v, %v; want g and h with 3 pending each", gs, err)
	}
	pend, err := st.StreamPending(ctx, "g", 0, "-", 10)
	if err != nil || len(pend) != 3 || pend[0].RetryCount != 3 || pend[1].RetryCount != 1 {
		t.Fatalf("pending %+v, %v", pend, err)
	}
	res, err := st.BuryStreamEntries(ctx, "g", 0, 3, []string{tired, fresh, junk})
	if err != nil || res != (queue.StreamBury{DeadLettered: 1, Gone: 1}) {
		t.Fatalf("bury: %+v, %v; want T-1 dead-lettered and the junk entry acknowledged", res, err)
	}
	rec, err := rdb.HGet(ctx, keys.DeadInfo, "T-1").Result()
	if err != nil || !strings.HasPrefix(rec, "failed|3|1700000000000|consumer group g: delivered 3 times") {
		t.Errorf("dead record %q (%v)", rec, err)
	}
	if p, _ := rdb.HGet(ctx, keys.Payload, "T-1").Result(); p != `{"n":1}` {
		t.Errorf("payload %q, want the entry's", p)
	}
	if n, _ := rdb.ZCard(ctx, keys.Dead).Result(); n != 1 {
		t.Errorf("%d dead letters, want 1 (T-2 was delivered once)", n)
	}
	if pend, _ := st.StreamPending(ctx, "g", 0, "-", 10); len(pend) != 1 || pend[0].ID != fresh {
		t.Errorf("pending in g after the bury: %+v, want only T-2's entry", pend)
	}
	if pend, _ := st.StreamPending(ctx, "h", 0, "-", 10); len(pend) != 3 {
		t.Errorf("group h lost pending entries: %+v", pend)
	}
}
