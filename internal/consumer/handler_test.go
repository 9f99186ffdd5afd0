package consumer

import (
	"context"
	"fmt"
	"testing"
	"time"
)

// New picks the handler from the configuration, a dry run first; only the
// order handler leases a claim as one batch. A task queue's claim by the
// daemon (Config.Process) leases per member, as workers and polls extend,
// ack and check single tasks (a poll's claim: queue's
// TestPollTasksLeasePerMember).
func TestOnlyTheOrderHandlerLeasesBatches(t *testing.T) {
	t.Parallel()
	noop := func(context.Context, []Task) []error { return nil }
	fwd := &Forward{Kind: "list", Queue: "q"}
	e := newRedisEnv(t)
	for _, tc := range []struct {
		cfg  Config
		want handler
	}{
		{Config{}, orderHandler{}},
		{Config{Process: noop}, taskHandler{}},
		{Config{Forward: fwd}, forwardHandler{}},
		{Config{DryRun: true}, dryRunHandler{}},
	} {
		if got := e.consumer(tc.cfg).h; fmt.Sprintf("%T", got) != fmt.Sprintf("%T", tc.want) {
			t.Errorf("handler %T for %+v, want %T", got, tc.cfg, tc.want)
		}
	}

	ctx := context.Background()
	past := e.RedisNow().Add(-time.Minute)
	perMember := func(what string, claim func() int) {
		t.Helper()
		e.Enqueue([]string{"m-1", "m-2", "m-3"}, past)
		if n := claim(); n != 3 {
			t.Fatalf("%s claimed %d, want 3", what, n)
		}
		if n := e.card(e.Keys.Inflight); n != 3 {
			t.Errorf("%s: %d per-member lease entries, want 3", what, n)
		}
		if n := e.card(e.Keys.Leases); n != 0 {
			t.Errorf("%s: %d batch leases, want 0", what, n)
		}
		e.RDB.Del(ctx, e.Keys.Inflight, e.Keys.Deadlines, e.Keys.Lease, e.Keys.Leases, e.Keys.LeaseBatch)
	}
	tasks := e.consumer(Config{Process: noop})
	perMember("the daemon's task claim", func() int {
		res, err := tasks.claimBatch(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return len(res.items)
	})
	e.Enqueue([]string{"o-1", "o-2"}, past)
	if res, err := e.consumer(Config{}).claimBatch(ctx); err != nil || len(res.items) != 2 {
		t.Fatalf("order claim: %d, %v", len(res.items), err)
	}
	if n, m := e.card(e.Keys.Leases), e.card(e.Keys.Inflight); n != 1 || m != 0 {
		t.Errorf("order claim: %d batch leases and %d per-member entries, want 1 and 0", n, m)
	}
}
