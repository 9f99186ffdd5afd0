package queue_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// AddCloseEvents appends each event to {Q}:events, in order, with the
// fields the relay has always written (closed_at in UTC, RFC 3339 with
// nanoseconds); no events send nothing.
func TestStoreAddCloseEvents(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	st := queue.NewStore(rdb, keys)
	ctx := context.Background()
	if err := st.AddCloseEvents(ctx, 0, nil); err != nil {
		t.Fatal(err)
	}
	if n, err := rdb.Exists(ctx, keys.Events).Result(); err != nil || n != 0 {
		t.Fatalf("no events: the stream exists (%d, %v)", n, err)
	}
	at := time.Date(2024, 3, 1, 12, 30, 0, 123456789, time.FixedZone("CET", 3600))
	events := []queue.CloseEvent{
		{ID: 7, Serial: "ev-1", Reason: "timeout", ClosedAt: at},
		{ID: 9, Serial: "ev-2", Reason: "reconciled", ClosedAt: at.Add(time.Second)},
	}
	if err := st.AddCloseEvents(ctx, 0, events); err != nil {
		t.Fatal(err)
	}
	msgs, err := rdb.XRange(ctx, keys.Events, "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	want := []map[string]any{
		{"serial": "ev-1", "reason": "timeout", "closed_at": "2024-03-01T11:30:00.123456789Z", "event_id": "7"},
		{"serial": "ev-2", "reason": "reconciled", "closed_at": "2024-03-01T11:30:01.123456789Z", "event_id": "9"},
	}
	if len(msgs) != 2 || fmt.Sprint(msgs[0].Values) != fmt.Sprint(want[0]) || fmt.Sprint(msgs[1].Values) != fmt.Sprint(want[1]) {
		t.Errorf("stream %+v, want %v", msgs, want)
	}
}

// AddCloseEvents with a cap trims the stream approximately (MAXLEN ~):
// never below the cap, and far below what was added.
func TestStoreAddCloseEventsCapsTheStream(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	st := queue.NewStore(rdb, keys)
	ctx := context.Background()
	const added, maxLen = 2000, 10
	for i := range added / 100 {
		page := make([]queue.CloseEvent, 100)
		for j := range page {
			page[j] = queue.CloseEvent{ID: int64(i*100 + j), Serial: fmt.Sprint("cap-", i*100+j), Reason: "timeout", ClosedAt: time.Now()}
		}
		if err := st.AddCloseEvents(ctx, maxLen, page); err != nil {
			t.Fatal(err)
		}
	}
	n, err := rdb.XLen(ctx, keys.Events).Result()
	if err != nil {
		t.Fatal(err)
	}
	if n < maxLen || n >= added/2 {
		t.Errorf("%d events left of %d added with MAXLEN ~ %d", n, added, maxLen)
	}
	last, err := rdb.XRevRangeN(ctx, keys.Events, "+", "-", 1).Result()
	if err != nil || len(last) != 1 || last[0].Values["event_id"] != fmt.Sprint(added-1) {
		t.Errorf("newest event %+v (%v), want event_id %d", last, err, added-1)
	}
}
