package consumer

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/internal/queue"
)

// A dead letter keeps its payload so that a requeue runs the task with it.
// A live task of the same id (the producer reused the id) shares the one
// payload field; when that live task completes — its action succeeded, a
// poll acknowledged it, or it was forwarded into a list — the payload must
// stay for the dead letter (the latest one written for the id), not leave
// the dead letter with none.
func TestALiveTaskCompletingLeavesTheDeadLetterItsPayload(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name     string
		complete func(e *env) // runs the re-put task "x" to completion
	}{
		{"action succeeded", func(e *env) {
			ids := e.runPass(Config{MaxAttempts: 3, Process: func(_ context.Context, ts []Task) []error { return make([]error, len(ts)) }})
			if len(ids) != 1 {
				e.T.Fatalf("claimed %q, want x", ids)
			}
		}},
		{"poll acknowledged", func(e *env) {
			ctx := context.Background()
			ts, tok, err := pollTasks(ctx, e.RDB, e.Keys, 10, 0, time.Minute, 3)
			if err != nil || len(ts) != 1 {
				e.T.Fatalf("poll: %v, %v", ts, err)
			}
			if missed, _, err := queue.NewStore(e.RDB, e.Keys).AckTasks(ctx, tok, []string{"x"}); err != nil || len(missed) != 0 {
				e.T.Fatalf("ack: missed %q, %v", missed, err)
			}
		}},
		{"forwarded into a list", func(e *env) {
			if res := e.forwardOnce(Config{Forward: &Forward{Kind: "list", Queue: "l"}}); res.forwarded != 1 {
				e.T.Fatalf("forwarded %d, want 1", res.forwarded)
			}
		}},
		{"forwarded into a stream", func(e *env) {
			if res := e.forwardOnce(Config{Forward: &Forward{Kind: "stream", Queue: "s", MaxLen: 100}}); res.forwarded != 1 {
				e.T.Fatalf("forwarded %d, want 1", res.forwarded)
			}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newRedisEnv(t)
			e.buryTask("x", `{"v":1}`)
			e.putDue("x", `{"v":2}`) // Create: x is not live, so this writes
			tc.complete(e)
			if p := e.payloadOf("x"); p != `{"v":2}` {
				t.Fatalf("after the live x completed, the dead letter's payload is %q, want the latest {\"v\":2}", p)
			}
			// A requeue runs x with it.
			if _, err := e.st.Requeue(context.Background(), "x"); err != nil {
				t.Fatal(err)
			}
			var got json.RawMessage
			e.runPass(Config{MaxAttempts: 3, Process: func(_ context.Context, ts []Task) []error {
				got = ts[0].Payload
				return make([]error, len(ts))
			}})
			if string(got) != `{"v":2}` {
				t.Fatalf("the requeued x ran with payload %s", got)
			}
			e.assertNoOrphans("after the requeued x ran")
			if p := e.payloadOf("x"); p != "" {
				t.Fatalf("payload %q left after the requeued x ran", p)
			}
		})
	}
}

// The operators' purge (PurgeTasks, PurgeTasksBefore) of a dead letter
// whose id a reliable-list consumer has taken again: the taken item
// carries its own payload (and a recovery dead-letters it with that), so
// the payload field is the dead letter's alone and goes with it; after the
// ack nothing is left.
func TestOperatorPurgeWhileTheIDIsTakenLeavesNoOrphan(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"ids", "before"} {
		t.Run(how, func(t *testing.T) {
			e := newRedisEnv(t)
			ctx := context.Background()
			e.buryTask("x", `{"v":1}`)
			e.putDue("x", `{"v":2}`)
			if res := e.forwardOnce(reliableList(time.Minute, 3)); res.forwarded != 1 {
				t.Fatalf("forwarded %d, want 1", res.forwarded)
			}
			it, err := e.cl.Take(ctx)
			if err != nil || it.ID != "x" || string(it.Payload) != `{"v":2}` {
				t.Fatalf("Take: %+v, %v", it, err)
			}
			var n int
			if how == "ids" {
				n, err = e.st.PurgeTasks(ctx, []string{"x"})
			} else {
				n, err = e.st.PurgeTasksBefore(ctx, time.Time{})
			}
			if err != nil || n != 1 {
				t.Fatalf("purge: %d, %v", n, err)
			}
			if err := e.cl.Ack(ctx, it); err != nil {
				t.Fatal(err)
			}
			e.assertNoOrphans("after the purge and the ack")
		})
	}
}
