package consumer

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/internal/orders"
)

// commandCounter counts the script calls and queue-head reads a client
// sends.
type commandCounter struct{ scripts, heads atomic.Int64 }

func (h *commandCounter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *commandCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		switch strings.ToLower(cmd.Name()) {
		case "evalsha", "eval", "evalsha_ro", "eval_ro":
			h.scripts.Add(1)
		case "zrange", "zrangebyscore":
			h.heads.Add(1)
		}
		return next(ctx, cmd)
	}
}
func (h *commandCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// A dry run leaves due entries in the queue, so the head of the queue is an
// entry it has already read. The idle head check must not take that for a
// new deadline and peek again on every check: idle, a dry run costs what a
// normal run costs (one head read per check, no script), and it still
// notices a raw producer's new deadline.
func TestDryRunHeadCheckDoesNotPeekAgain(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	now := e.RedisNow()
	due := e.Orders("dry", 1, now.Add(-time.Second))
	e.Enqueue(due, now.Add(-time.Second))
	later := e.Orders("later", 1, now.Add(time.Hour))
	e.Enqueue(later, now.Add(time.Hour))

	counter := &commandCounter{}
	e.RDB.AddHook(counter)
	cfg := Config{Keys: e.Keys, DryRun: true, ScanInterval: time.Hour, HeadCheck: 20 * time.Millisecond}
	c, err := New(cfg, e.RDB, orders.DryRun{Store: e.Store}, e.m, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	if err != nil {
		t.Fatal(err)
	}
	stop := runConsumer(t, c)

	eventually(t, "due order reported", 20*time.Second, func() bool { return testutil.ToFloat64(e.m.DryRunWouldClose) == 1 })
	scripts, heads := counter.scripts.Load(), counter.heads.Load()
	eventually(t, "20 head checks", 30*time.Second, func() bool { return counter.heads.Load() >= heads+20 })
	if n := counter.scripts.Load() - scripts; n != 0 {
		t.Errorf("%d script calls during 20 idle head checks, want 0 (a normal run makes none)", n)
	}

	// A raw producer's earlier deadline is still noticed between scans.
	soon := e.Orders("soon", 1, now.Add(-time.Second))
	e.Enqueue(soon, e.RedisNow().Add(100*time.Millisecond))
	eventually(t, "raw-ZADD order reported without waiting for the scan interval", 20*time.Second,
		func() bool { return testutil.ToFloat64(e.m.DryRunWouldClose) == 2 })
	stop()
	if got := e.StatusCounts(); got["pending"] != 3 {
		t.Errorf("statuses %v after a dry run, want all 3 pending", got)
	}
	if n := e.card(e.Keys.Queue); n != 3 {
		t.Errorf("queue holds %d entries after a dry run, want 3", n)
	}
}
