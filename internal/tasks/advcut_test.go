package tasks

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Adversarial review (advcut) of 437822a, against what docs/tasks.md said
// of it: a sql task whose statement ends its database session while the
// database answers "spends no attempt ... and is retried after the
// queue's `retry` delay". The code marks it consumer.Later, which
// retryNoAttempt retries after the contended delay (half its lateness,
// from 1 s up to BackoffMax, jittered down to half), whatever the queue's
// retry policy says — the docs were wrong (failed against them), and now
// say so. This checks what they say: no attempt, the contended delay, not
// the policy's hour; the control in the same batch — a task whose
// statement RAISEs — is retried by the queue's policy.
func TestAdvCutSQLTaskEndingItsSessionIsRetriedAfterTheContendedDelay(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	ids := []string{"killer", "poison1"}
	sqlFixture(t, db, ids...)
	killOn(t, db, "killer")
	rdb, keys := testenv.Redis(t)
	cl, err := client.New(rdb, keys.Queue)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, id := range ids {
		if _, _, err := cl.PutTask(ctx, id, []byte(`{}`), time.Now().Add(-time.Second), client.Create); err != nil {
			t.Fatal(err)
		}
	}
	const retryDelay = time.Hour // the queue's `retry:` policy
	action := sqlAction(db, `UPDATE items SET done = true WHERE id = ANY($1) AND check_item(id) AND kill_on(id) RETURNING id`)
	c, err := consumer.New(consumer.Config{
		Keys: keys, Workers: 1, BatchSize: 20, Lease: 2 * time.Second, StatementTimeout: 1500 * time.Millisecond,
		DrainTimeout: time.Second, MaxAttempts: 5, BackoffMax: 10 * time.Minute,
		ScanInterval: 100 * time.Millisecond, Owner: "t",
		Retry:   func(int) time.Duration { return retryDelay },
		Process: action,
	}, rdb, nil, metrics.New(prometheus.NewRegistry(), "t", "t"), zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); c.Run(runCtx) }() //nolint:errcheck // nil once runCtx ends
	t.Cleanup(func() { cancel(); wg.Wait() })

	backingOff := func(id string) (client.Task, bool) {
		tk, err := cl.GetTask(ctx, id)
		return tk, err == nil && tk.State == client.StateBackoff
	}
	waitUntil(t, "both tasks tried once and backing off", 20*time.Second, func() bool {
		_, k := backingOff("killer")
		_, p := backingOff("poison1")
		return k && p
	})
	now := time.Now()
	killer, _ := backingOff("killer")
	poison, _ := backingOff("poison1")
	t.Logf("killer: retried in %s (attempts %d, %q); poison1: retried in %s (attempts %d)",
		killer.Until.Sub(now).Round(time.Millisecond), killer.Attempts, killer.LastError,
		poison.Until.Sub(now).Round(time.Second), poison.Attempts)
	if !strings.Contains(killer.LastError, "ended its database session") {
		t.Fatalf("the killer's last error %q: the test proved nothing about an ended session", killer.LastError)
	}
	if poison.Until.Sub(now) < retryDelay/2 {
		t.Fatalf("control: the RAISE-ing task is retried in %s, not by the queue's retry policy (%s)", poison.Until.Sub(now), retryDelay)
	}
	if killer.Attempts != 0 {
		t.Errorf("the killer spent %d attempts, want none", killer.Attempts)
	}
	// Just tried, a second overdue: the contended delay's floor, 1 s,
	// jittered down to half.
	if d := killer.Until.Sub(now); d > 2*time.Second {
		t.Errorf("the task whose statement ends its session is retried in %s; docs/tasks.md says after the contended delay (about a second here), not the queue's `retry` delay (%s)",
			d.Round(time.Millisecond), retryDelay)
	}
}
