package consumer

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// The worker's lease operations are compare-and-sets on the poll token:
// another claim's token changes nothing, a token no claim hands out is
// refused, and a hand-back keeps the attempts.
func TestTaskLeaseOperationsCompareAndSet(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	put := func(id string) {
		if _, _, err := e.cl.PutTask(ctx, id, json.RawMessage(`{}`), time.Now().Add(-time.Second), client.Create); err != nil {
			t.Fatal(err)
		}
	}
	claim := func() ([]Task, string) {
		ts, tok, err := pollTasks(ctx, e.RDB, e.Keys, 10, 0, time.Minute, 10)
		if err != nil {
			t.Fatal(err)
		}
		return ts, tok
	}
	put("a")
	ts, tok := claim()
	if len(ts) != 1 {
		t.Fatalf("claimed %d, want 1", len(ts))
	}
	other := queue.NewPollToken()
	for name, f := range map[string]func(string) (int, error){
		"extend": func(tk string) (int, error) {
			lost, err := queue.NewStore(e.RDB, e.Keys).ExtendTasks(ctx, tk, time.Minute, []string{"a"})
			return 1 - len(lost), err
		},
		"retry": func(tk string) (int, error) {
			return queue.NewStore(e.RDB, e.Keys).RetryTasks(ctx, tk, 0, "x", []string{"a"})
		},
		"bury": func(tk string) (int, error) {
			return queue.NewStore(e.RDB, e.Keys).BuryTasks(ctx, tk, ReasonFailed, "x", []string{"a"})
		},
		"hand back": func(tk string) (int, error) {
			return queue.NewStore(e.RDB, e.Keys).ReleaseTasks(ctx, tk, []string{"a"})
		},
	} {
		if n, err := f(other); err != nil || n != 0 {
			t.Errorf("%s under another token: %d, %v; want 0, nil", name, n, err)
		}
		if _, err := f("-"); !errors.Is(err, queue.ErrInvalidPollToken) {
			t.Errorf("%s under the retry marker: %v, want queue.ErrInvalidPollToken", name, err)
		}
	}
	if tk, err := e.cl.GetTask(ctx, "a"); err != nil || tk.State != client.StateLeased || tk.Owner != tok {
		t.Fatalf("after foreign calls: %+v, %v; want still leased under the claim's token", tk, err)
	}
	// Extend under the right token moves the expiry later.
	before, _ := e.RDB.ZScore(ctx, e.Keys.Inflight, "a").Result()
	time.Sleep(5 * time.Millisecond) // so the Redis clock moves
	if lost, err := queue.NewStore(e.RDB, e.Keys).ExtendTasks(ctx, tok, 2*time.Minute, []string{"a", "nope"}); err != nil || len(lost) != 1 || lost[0] != "nope" {
		t.Fatalf("extend: lost %v, %v; want [nope]", lost, err)
	}
	after, _ := e.RDB.ZScore(ctx, e.Keys.Inflight, "a").Result()
	if after < before+59_000 {
		t.Fatalf("expiry %v after extending from %v by 2m, want about a minute later", after, before)
	}
	// Retry spends an attempt; the next claim gets it (delay 0) and a
	// hand-back keeps the attempts.
	if n, err := queue.NewStore(e.RDB, e.Keys).RetryTasks(ctx, tok, 0, "boom", []string{"a"}); err != nil || n != 1 {
		t.Fatalf("retry: %d, %v", n, err)
	}
	ts, tok = claim()
	if len(ts) != 1 || ts[0].Attempts != 1 {
		t.Fatalf("claim after retry: %+v", ts)
	}
	if n, err := queue.NewStore(e.RDB, e.Keys).ReleaseTasks(ctx, tok, []string{"a"}); err != nil || n != 1 {
		t.Fatalf("hand back: %d, %v", n, err)
	}
	if tk, err := e.cl.GetTask(ctx, "a"); err != nil || tk.State != client.StateBackoff || tk.Attempts != 1 {
		t.Fatalf("handed back: %+v, %v; want due again, attempts 1", tk, err)
	}
	ts, _ = claim()
	if len(ts) != 1 || ts[0].Attempts != 1 {
		t.Fatalf("claim after hand-back: %+v, want a with attempts 1 (no attempt spent)", ts)
	}
	// A fresh task handed back is queued again at its deadline.
	put("b")
	ts, tok = claim()
	if n, err := queue.NewStore(e.RDB, e.Keys).ReleaseTasks(ctx, tok, []string{"b"}); err != nil || n != 1 || len(ts) != 1 {
		t.Fatalf("hand back b: %d, %v", n, err)
	}
	if tk, err := e.cl.GetTask(ctx, "b"); err != nil || tk.State != client.StateQueued {
		t.Fatalf("b handed back: %+v, %v; want queued", tk, err)
	}
}

// A lease that ran out but that no claim has taken since is still the
// token's: extending it succeeds, and the task is no longer claimable.
func TestExtendAnExpiredLeaseNoOneTook(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	if _, _, err := e.cl.PutTask(ctx, "e", json.RawMessage(`{}`), time.Now().Add(-time.Second), client.Create); err != nil {
		t.Fatal(err)
	}
	ts, tok, err := pollTasks(ctx, e.RDB, e.Keys, 10, 0, time.Minute, 10)
	if err != nil || len(ts) != 1 {
		t.Fatalf("claim: %d, %v", len(ts), err)
	}
	e.RDB.ZAdd(ctx, e.Keys.Inflight, redis.Z{Score: 1, Member: "e"}) // ran out long ago
	if lost, err := queue.NewStore(e.RDB, e.Keys).ExtendTasks(ctx, tok, time.Minute, []string{"e"}); err != nil || len(lost) != 0 {
		t.Fatalf("extend: lost %v, %v; want none", lost, err)
	}
	if ts, _, err := pollTasks(ctx, e.RDB, e.Keys, 10, 0, time.Minute, 10); err != nil || len(ts) != 0 {
		t.Fatalf("claim after extending: %d tasks, %v; want none", len(ts), err)
	}
}
