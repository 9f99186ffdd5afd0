package tasks

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// A durable queue's task fails its first run, and its second is cut by a
// stop: the hand-back (queue.Store.Release) keeps the Redis attempt the
// first run spent, and the executor records no attempt for the cut run,
// so the row and Redis agree (1), and max_attempts 3 still ends the task
// after three counted runs: the next daemon's two failing runs dead-letter
// it with attempts 3 and settle its row FAILED. Four runs in all, one of
// them cut.
func TestAdvReleaseDurableCutRunKeepsRowAndRedisAttemptsInStep(t *testing.T) {
	srvURL, runs, second := secondRunCutWebhook(t)
	db, _ := testenv.Postgres(t)
	s := newShutdownEnv(t, `durable: true, lease: 1m, batch_size: 1, workers: 1, retry: {backoff: [10ms], max_attempts: 3}, `+
		`action: {type: webhook, url: '`+srvURL+`', timeout: 20s, secret_env: OD_SHUT_SECRET}`, db)
	ctx := context.Background()
	if _, _, err := s.r.Durable.Put(ctx, "a", json.RawMessage(`{}`), time.Now().Add(-time.Second), client.Create); err != nil {
		t.Fatal(err)
	}
	stop := s.run(300 * time.Millisecond)
	awaitSecondRun(t, second, runs)
	stop()
	tk, err := s.r.Client.GetTask(ctx, "a")
	if err != nil {
		t.Fatalf("a after the stop: %v (lost)", err)
	}
	row, err := s.r.Durable.Get(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	if tk.Attempts != 1 || row.Attempts != 1 || row.State != StateScheduled {
		t.Fatalf("after the cut: Redis attempts %d, row %s attempts %d; want 1 and SCHEDULED 1", tk.Attempts, row.State, row.Attempts)
	}
	stop = s.run(300 * time.Millisecond)
	deadline := time.Now().Add(30 * time.Second)
	for {
		if row, err = s.r.Durable.Get(ctx, "a"); err == nil && row.State == StateFailed {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("row %+v, %v after %d runs: not FAILED within 30s", row, err, runs.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
	stop()
	if n := runs.Load(); n != 4 {
		t.Errorf("%d runs, want 4 (three counted, one cut)", n)
	}
	dead, err := s.r.Client.GetTask(ctx, "a")
	if err != nil || dead.State != client.StateDead || dead.Attempts != 3 {
		t.Errorf("a at the end: %+v, %v; want dead-lettered with attempts 3", dead.Entry, err)
	}
}
