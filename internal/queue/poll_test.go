package queue_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// pollEnv is a task queue with its public client, for the poll's tests.
type pollEnv struct {
	t    *testing.T
	rdb  *redis.Client
	keys queue.Keys
	st   *queue.Store
	cl   *client.Client
}

func newPollEnv(t *testing.T) *pollEnv {
	rdb, keys := testenv.Redis(t)
	cl, err := client.New(rdb, keys.Queue)
	if err != nil {
		t.Fatal(err)
	}
	return &pollEnv{t: t, rdb: rdb, keys: keys, st: queue.NewStore(rdb, keys), cl: cl}
}

// poll is one POST /v1/queues/{q}/poll's claim.
func (e *pollEnv) poll(limit, maxBytes int, lease time.Duration, maxAttempts int) ([]queue.Task, string, error) {
	p, err := e.st.PollTasks(context.Background(), queue.PollArgs{Limit: limit, MaxBytes: maxBytes, Lease: lease, MaxAttempts: maxAttempts})
	return p.Tasks, p.Token, err
}

func (e *pollEnv) putDue(id string) {
	e.t.Helper()
	if _, _, err := e.cl.PutTask(context.Background(), id, json.RawMessage(`{}`), time.Now().Add(-time.Second), client.Create); err != nil {
		e.t.Fatal(err)
	}
}

func (e *pollEnv) card(key string) int64 {
	e.t.Helper()
	n, err := e.rdb.ZCard(context.Background(), key).Result()
	if err != nil {
		e.t.Fatal(err)
	}
	return n
}

// A paused poll queue hands out nothing and changes nothing; resumed, the
// same poll gets the task.
func TestPollTasksHonoursPause(t *testing.T) {
	e := newPollEnv(t)
	ctx := context.Background()
	e.putDue("J-1")
	if err := e.rdb.Set(ctx, e.keys.Paused, "1|test", 0).Err(); err != nil {
		t.Fatal(err)
	}
	got, tok, err := e.poll(10, 0, time.Minute, 5)
	if err != nil || len(got) != 0 || tok != "" {
		t.Fatalf("paused poll: %v, %d tasks, token %q; want nothing", err, len(got), tok)
	}
	if n, _ := e.rdb.ZCard(ctx, e.keys.Inflight).Result(); n != 0 {
		t.Errorf("paused poll leased %d tasks", n)
	}
	e.rdb.Del(ctx, e.keys.Paused)
	got, _, err = e.poll(10, 0, time.Minute, 5)
	if err != nil || len(got) != 1 {
		t.Fatalf("resumed poll: %v, %d tasks, want 1", err, len(got))
	}
}

// A polled task whose lease expires max_attempts times is dead-lettered
// with max_attempts attempts: each expired lease is one failed run, counted
// once.
func TestPollExpiredLeasesDeadLetterWithTheirCount(t *testing.T) {
	e := newPollEnv(t)
	ctx := context.Background()
	e.putDue("z")
	const maxAttempts = 2
	runs := 0
	deadline := time.Now().Add(30 * time.Second)
	for {
		ts, _, err := e.poll(10, 0, 50*time.Millisecond, maxAttempts)
		if err != nil {
			t.Fatal(err)
		}
		runs += len(ts)
		if tk, err := e.cl.GetTask(ctx, "z"); err == nil && tk.State == client.StateDead {
			if tk.Attempts != runs || runs != maxAttempts {
				t.Fatalf("dead letter after %d runs records %d attempts; want %d and %d", runs, tk.Attempts, maxAttempts, maxAttempts)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("not dead-lettered after %d runs", runs)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A poll's claim — with or without a byte budget — leases per member, as
// workers and polls extend, ack and check single tasks.
func TestPollTasksLeasePerMember(t *testing.T) {
	e := newPollEnv(t)
	ctx := context.Background()
	now, err := e.st.Now(ctx)
	if err != nil {
		t.Fatal(err)
	}
	past := float64(queue.DeadlineMillis(now.Add(-time.Minute)))
	for _, maxBytes := range []int{0, 1 << 20} {
		e.rdb.ZAdd(ctx, e.keys.Queue, redis.Z{Score: past, Member: "m-1"}, redis.Z{Score: past, Member: "m-2"}, redis.Z{Score: past, Member: "m-3"})
		ts, _, err := e.poll(10, maxBytes, time.Minute, 10)
		if err != nil {
			t.Fatal(err)
		}
		if n := len(ts); n != 3 {
			t.Fatalf("a poll (budget %d) claimed %d, want 3", maxBytes, n)
		}
		if n := e.card(e.keys.Inflight); n != 3 {
			t.Errorf("a poll (budget %d): %d per-member lease entries, want 3", maxBytes, n)
		}
		if n := e.card(e.keys.Leases); n != 0 {
			t.Errorf("a poll (budget %d): %d batch leases, want 0", maxBytes, n)
		}
		e.rdb.Del(ctx, e.keys.Inflight, e.keys.Deadlines, e.keys.Lease, e.keys.Leases, e.keys.LeaseBatch)
	}
}

// A claim that takes only tasks over their attempts buries them and claims
// again, so the poll hands out what is due behind them; the poll reports
// each claim, the burial with it. The token acknowledges what it handed
// out, and is "" when it handed out nothing.
func TestPollTasksBuriesOverAttemptsAndClaimsAgain(t *testing.T) {
	e := newPollEnv(t)
	ctx := context.Background()
	now, err := e.st.Now(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// "old" is due first and was leased before, its lease long expired:
	// this claim is its second run.
	if _, err := e.st.PutTask(ctx, queue.ModeCreate, queue.WriterClient,
		queue.TaskWrite{ID: "old", DeadlineMS: queue.DeadlineMillis(now.Add(-time.Hour)), Payload: `{"n":1}`}); err != nil {
		t.Fatal(err)
	}
	if p, err := e.st.PollTasks(ctx, queue.PollArgs{Limit: 1, Lease: time.Minute, MaxAttempts: 5}); err != nil || len(p.Tasks) != 1 {
		t.Fatalf("first poll of old: %+v, %v", p, err)
	}
	e.rdb.ZAdd(ctx, e.keys.Inflight, redis.Z{Score: 1, Member: "old"}) // its lease ran out long ago
	if _, err := e.st.PutTask(ctx, queue.ModeCreate, queue.WriterClient,
		queue.TaskWrite{ID: "new", DeadlineMS: queue.DeadlineMillis(now.Add(-time.Second)), Payload: `{"n":2}`}); err != nil {
		t.Fatal(err)
	}
	p, err := e.st.PollTasks(ctx, queue.PollArgs{Limit: 1, Lease: time.Minute, MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Tasks) != 1 || p.Tasks[0].ID != "new" || string(p.Tasks[0].Payload) != `{"n":2}` || p.Token == "" {
		t.Fatalf("poll: %+v, want new with its payload under a token", p)
	}
	if len(p.Claims) != 2 || p.Claims[0].Over != 1 || p.Claims[0].Buried != 1 || p.Claims[0].BuryErr != nil ||
		p.Claims[1].Over != 0 || len(p.Claims[1].Items) != 1 {
		t.Fatalf("claims %+v, want old buried by the first and new taken by the second", p.Claims)
	}
	if tk, err := e.cl.GetTask(ctx, "old"); err != nil || tk.State != client.StateDead || tk.Attempts != 1 {
		t.Fatalf("old: %+v, %v; want dead-lettered with 1 attempt", tk, err)
	}
	if missed, _, err := e.st.AckTasks(ctx, p.Token, []string{"new"}); err != nil || len(missed) != 0 {
		t.Fatalf("ack under the poll's token: missed %v, %v", missed, err)
	}
	if p, err := e.st.PollTasks(ctx, queue.PollArgs{Limit: 1, Lease: time.Minute, MaxAttempts: 1}); err != nil ||
		len(p.Tasks) != 0 || p.Token != "" || len(p.Claims) != 1 {
		t.Fatalf("poll of an empty queue: %+v, %v; want no tasks, no token, one claim", p, err)
	}
	if _, err := e.st.PollTasks(ctx, queue.PollArgs{Limit: 1, MaxAttempts: 1}); err != queue.ErrPollLease {
		t.Errorf("poll without a lease: %v, want ErrPollLease", err)
	}
}
