package consumer

import (
	"context"
	"strings"
	"testing"

	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/queue"
)

// TestNewRefusesConfigsThatCannotWork: New refuses, with a message
// naming the settings, every combination whose handler would fail at its
// first due entry — a dry run or an order close with no Store (a nil
// dereference in the worker), two handlers at once, a forward of an
// unknown kind, a worker budget with no room — and accepts the four
// handlers as the daemon and the task queues build them.
func TestNewRefusesConfigsThatCannotWork(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	process := func(context.Context, []Task) []error { return nil }
	stream := &Forward{Kind: "stream", Queue: "jobs"}
	var store Store = unusedStore{}
	for _, tc := range []struct {
		name  string
		cfg   Config
		store Store
		says  []string // nil: accepted
	}{
		{"dry run and process", Config{DryRun: true, Process: process}, nil, []string{"DryRun", "Process"}},
		{"dry run and process, with a store", Config{DryRun: true, Process: process}, store, []string{"DryRun", "Process"}},
		{"dry run and forward", Config{DryRun: true, Forward: stream}, nil, []string{"DryRun", "Forward"}},
		{"forward and process", Config{Forward: stream, Process: process}, nil, []string{"Forward", "Process"}},
		{"order queue without a store", Config{}, nil, []string{"Store"}},
		{"dry run without a store", Config{DryRun: true}, nil, []string{"Store"}},
		{"forward of an unknown kind", Config{Forward: &Forward{Kind: "queue", Queue: "jobs"}}, nil, []string{"Forward.Kind", `"queue"`}},
		{"worker budget with no room", Config{Slots: make(chan struct{})}, store, []string{"Slots"}},

		{"order queue", Config{}, store, nil},
		{"dry run", Config{DryRun: true}, store, nil},
		{"task queue", Config{Process: process}, nil, nil},
		{"stream queue", Config{Forward: stream}, nil, nil},
		{"list queue", Config{Forward: &Forward{Kind: "list", Queue: "jobs"}}, nil, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.cfg.Keys = e.Keys
			c, err := New(tc.cfg, e.RDB, tc.store, e.m, zap.NewNop())
			if tc.says == nil {
				if err != nil || c == nil {
					t.Fatalf("New: %v, want a consumer", err)
				}
				return
			}
			if err == nil || c != nil {
				t.Fatalf("New: %v (consumer %v), want an error and no consumer", err, c != nil)
			}
			for _, s := range tc.says {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("New: %q does not name %q", err, s)
				}
			}
		})
	}
	// NewGroup refuses the same, sharded or not.
	if _, err := NewGroup(Config{DryRun: true, Process: process}, e.ShardKeys(3), e.RDB, nil, e.m, zap.NewNop()); err == nil {
		t.Error("NewGroup over shards accepted a dry run with a Process")
	}
	if _, err := NewGroup(Config{}, []queue.Keys{e.Keys}, e.RDB, nil, e.m, zap.NewNop()); err == nil {
		t.Error("NewGroup on one key accepted an order queue without a Store")
	}
}
