package consumer

import (
	"context"
	"fmt"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// A loaded machine: every close statement takes 0.6 s (a statement-level
// trigger stands in for the load), well inside the 1 s statement timeout,
// but a 6-order batch's budget (1.5 s under a 2 s lease) holds only two of
// them and a half of a third. The batch holds a poisonous order, the oldest,
// so it comes first in every claim and in every first half of a split. The
// database answers every statement: nothing here is an outage.
//
// Before the fix the third statement of each round (the poisonous order's
// quarter) was cut by the batch's client deadline, the cut was taken for
// the database being away (PostgreSQL marked down, the worker backing
// off), every order went back untried with no attempt spent, and the same
// six came back together to do it again: the five good orders were never
// closed and the poisonous one never isolated (invariant 6).
func TestAdvSplitCutByTheBatchBudgetStillIsolatesThePoison(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	now := e.RedisNow()
	poison := e.Orders("poison", 1, now.Add(-time.Minute))
	good := e.Orders("good", 5, now.Add(-30*time.Second))
	e.PoisonOrder(poison[0])
	if _, err := e.DB.Exec(`CREATE FUNCTION slow_statement() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep(0.6); RETURN NULL; END $$;
CREATE TRIGGER slow_statement BEFORE UPDATE ON orders FOR EACH STATEMENT EXECUTE FUNCTION slow_statement();`); err != nil {
		t.Fatal(err)
	}
	e.Enqueue(poison, now.Add(-time.Minute))
	for i, s := range good {
		e.Enqueue([]string{s}, now.Add(-30*time.Second+time.Duration(i)*time.Millisecond))
	}

	core, logs := observer.New(zap.WarnLevel)
	cfg := Config{Keys: e.Keys, Workers: 1, BatchSize: 6, Lease: 2 * time.Second, StatementTimeout: time.Second,
		BackoffMax: 2 * time.Second, MaxAttempts: 20, ScanInterval: 100 * time.Millisecond, HeadCheck: 20 * time.Millisecond}
	c, err := New(cfg, e.RDB, e.Store, e.m, zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	runConsumer(t, c)

	// Each round is at most a lease plus a retry (about 3 s); the fix
	// needs four. Fifteen rounds' worth is a generous bound for a busy
	// machine.
	deadline := time.Now().Add(45 * time.Second)
	for {
		closed := 0
		for _, s := range good {
			if e.Status(s) == "closed" {
				closed++
			}
		}
		dead, err := e.RDB.ZScore(context.Background(), e.Keys.Dead, poison[0]).Result()
		if closed == len(good) && err == nil && dead > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d good orders closed, poisonous order dead-lettered: %v, after %d close attempts on it; %d 'unavailable' warnings: %s",
				closed, len(good), err == nil, e.CloseFailures(),
				logs.FilterMessageSnippet("unavailable").Len(), lastMessages(logs, 4))
		}
		time.Sleep(50 * time.Millisecond)
	}
	if n := logs.FilterMessageSnippet("database or queue unavailable").Len(); n > 0 {
		t.Errorf("the database answered every statement, yet it was taken for unavailable %d times: %s", n, lastMessages(logs, 4))
	}
}

func lastMessages(logs *observer.ObservedLogs, n int) string {
	all := logs.All()
	all = all[max(0, len(all)-n):]
	out := ""
	for _, l := range all {
		out += fmt.Sprintf("[%s %v] ", l.Message, l.ContextMap()["error"])
	}
	return out
}
