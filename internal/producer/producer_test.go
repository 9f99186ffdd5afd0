package producer

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// failScripts makes the next n script calls of a client fail, as a Redis
// outage between the order write and the reminder write would.
type failScripts struct{ n atomic.Int64 }

func (h *failScripts) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *failScripts) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if name := strings.ToLower(cmd.Name()); (name == "evalsha" || name == "eval") && h.n.Add(-1) >= 0 {
			err := errors.New("injected: connection reset")
			cmd.SetErr(err)
			return err
		}
		return next(ctx, cmd)
	}
}
func (h *failScripts) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// A caller whose create failed on the reminder write retries the same
// idempotent request: the order entry is already there (Unchanged), and
// the reminder it is still missing must be written by the retry.
func TestRetryAfterFailedReminderWriteCreatesTheReminder(t *testing.T) {
	ctx := context.Background()
	rdb, keys := testenv.Redis(t)
	remRdb, remKeys := testenv.Redis(t)
	fail := &failScripts{}
	remRdb.AddHook(fail)
	orders, err := client.New(rdb, keys.Queue)
	if err != nil {
		t.Fatal(err)
	}
	reminders, err := client.New(remRdb, remKeys.Queue)
	if err != nil {
		t.Fatal(err)
	}
	p := New(orders, nil, nil)
	p.WithReminders(reminders, 10*time.Minute)
	req := Request{Serial: "R-1", After: time.Hour}

	fail.n.Store(1)
	if _, _, err := p.Put(ctx, req); err == nil {
		t.Fatal("Put succeeded although the reminder write failed")
	}
	res, at, err := p.Put(ctx, req) // the caller's retry
	if err != nil {
		t.Fatalf("retry: %v", err)
	}
	if res != client.Unchanged {
		t.Fatalf("retry reported %v, want unchanged (the order entry was written the first time)", res)
	}
	task, err := reminders.GetTask(ctx, "R-1")
	if err != nil {
		t.Fatalf("reminder after the retry: %v", err)
	}
	if want := at.Add(-10 * time.Minute); !task.Deadline.Equal(want) {
		t.Errorf("reminder due %s, want %s (10m before the deadline)", task.Deadline, want)
	}
}
