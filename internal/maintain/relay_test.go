package maintain

import (
	"context"
	"fmt"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/internal/orders"
)

// TestRelayDeletesOutboxRowsOnlyAfterTheXAdd: while the events stream
// refuses the XADD (the key holds a string: WRONGTYPE), a pass fails and
// every outbox row stays; once it accepts, the pass publishes each row
// once, in id order, and only then deletes it.
func TestRelayDeletesOutboxRowsOnlyAfterTheXAdd(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	for i := range 3 {
		if _, err := e.DB.Exec("INSERT INTO "+orders.OutboxTable+" (serial_no, reason) VALUES ($1, 'timeout')", fmt.Sprint("rl-", i)); err != nil {
			t.Fatal(err)
		}
	}
	outbox := func() int {
		var n int
		if err := e.DB.Get(&n, "SELECT count(*) FROM "+orders.OutboxTable); err != nil {
			t.Fatal(err)
		}
		return n
	}
	r := NewRelay(RelayConfig{Keys: e.Keys, MaxLen: 1000}, e.DB, e.RDB, e.m.EventsRelayed, zaptest.NewLogger(t))
	if err := e.RDB.Set(ctx, e.Keys.Events, "not a stream", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if n, err := r.RunOnce(ctx); err == nil || n != 0 {
		t.Fatalf("pass onto a string key: %d, %v; want an error", n, err)
	}
	if n := outbox(); n != 3 {
		t.Fatalf("%d outbox rows after a failed XADD, want 3", n)
	}
	if err := e.RDB.Del(ctx, e.Keys.Events).Err(); err != nil {
		t.Fatal(err)
	}
	if n, err := r.RunOnce(ctx); err != nil || n != 3 {
		t.Fatalf("pass: %d, %v; want 3", n, err)
	}
	msgs, err := e.RDB.XRange(ctx, e.Keys.Events, "-", "+").Result()
	if err != nil || len(msgs) != 3 {
		t.Fatalf("stream: %d events (%v), want 3", len(msgs), err)
	}
	for i, m := range msgs {
		if m.Values["serial"] != fmt.Sprint("rl-", i) || m.Values["reason"] != "timeout" || m.Values["event_id"] == "" || m.Values["closed_at"] == "" {
			t.Errorf("event %d: %v", i, m.Values)
		}
	}
	if n := outbox(); n != 0 {
		t.Errorf("%d outbox rows after the pass, want 0", n)
	}
	if v := testutil.ToFloat64(e.m.EventsRelayed); v != 3 {
		t.Errorf("events relayed %v, want 3", v)
	}
}
