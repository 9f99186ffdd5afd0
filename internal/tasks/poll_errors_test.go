package tasks

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// The poll's behaviour on its error paths: Redis failing after the claim
// (payload read, burial), the caller's context ending after or between
// claims, a missing payload, the byte budget. They run the poll through
// advPoll (poll_probe_test.go).

// failHook fails the commands fail picks and calls after (if set) once a
// command succeeded.
type failHook struct {
	fail  func(redis.Cmder) bool
	after func(redis.Cmder)
}

var errInjected = errors.New("injected redis failure")

func (h failHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h failHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if h.fail != nil && h.fail(cmd) {
			cmd.SetErr(errInjected)
			return errInjected
		}
		err := next(ctx, cmd)
		if err == nil && h.after != nil {
			h.after(cmd)
		}
		return err
	}
}
func (h failHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func isScript(cmd redis.Cmder) bool {
	n := cmd.Name()
	return n == "evalsha" || n == "eval"
}

func hasArg(cmd redis.Cmder, s string) bool {
	for _, a := range cmd.Args() {
		if v, ok := a.(string); ok && v == s {
			return true
		}
	}
	return false
}

const overReason = "not acknowledged within its lease, max attempts reached"

type pollProbe struct {
	t   *testing.T
	rdb *redis.Client
	k   queue.Keys
	st  *queue.Store
	m   *metrics.Metrics
}

func newPollProbe(t *testing.T) *pollProbe {
	rdb, k := testenv.Redis(t)
	return &pollProbe{t: t, rdb: rdb, k: k, st: queue.NewStore(rdb, k), m: metrics.New(prometheus.NewRegistry(), "test", "test")}
}

func (p *pollProbe) put(id string, ago time.Duration, payload string) {
	p.t.Helper()
	now, err := p.st.Now(context.Background())
	if err != nil {
		p.t.Fatal(err)
	}
	if _, err := p.st.PutTask(context.Background(), queue.ModeCreate, queue.WriterClient,
		queue.TaskWrite{ID: id, DeadlineMS: queue.DeadlineMillis(now.Add(-ago)), Payload: payload}); err != nil {
		p.t.Fatal(err)
	}
}

func (p *pollProbe) poll(ctx context.Context, limit, maxAttempts int) ([]probeTask, string, error) {
	return advPoll(ctx, p.rdb, p.k, limit, 0, time.Minute, maxAttempts, p.m, zaptest.NewLogger(p.t))
}

// expire makes id's lease run out, as existing tests do.
func (p *pollProbe) expire(id string) {
	p.rdb.ZAdd(context.Background(), p.k.Inflight, redis.Z{Score: 1, Member: id})
}

func (p *pollProbe) inflight(id string) bool {
	_, err := p.rdb.ZScore(context.Background(), p.k.Inflight, id).Result()
	return err == nil
}

func (p *pollProbe) counters() [4]float64 {
	return [4]float64{testutil.ToFloat64(p.m.Claimed), testutil.ToFloat64(p.m.Reclaimed),
		testutil.ToFloat64(p.m.DeadLettered.WithLabelValues(queue.ReasonFailed)),
		testutil.ToFloat64(p.m.Errors.WithLabelValues(metrics.StageRemove))}
}

func (p *pollProbe) state(id string) client.Task {
	p.t.Helper()
	cl, err := client.New(p.rdb, p.k.Queue)
	if err != nil {
		p.t.Fatal(err)
	}
	tk, err := cl.GetTask(context.Background(), id)
	if err != nil {
		p.t.Fatal(err)
	}
	return tk
}

// Redis fails between the claim and the payload read: the poll returns
// the error and its token, no tasks; the task stays leased (not lost) and
// the next poll after the lease gets it with that run counted.
func TestAdvPollPayloadReadFailsAfterClaim(t *testing.T) {
	t.Parallel()
	p := newPollProbe(t)
	p.put("a", time.Second, `{"n":1}`)
	fail := true
	p.rdb.AddHook(failHook{fail: func(c redis.Cmder) bool { return fail && c.Name() == "hmget" }})
	ts, tok, err := p.poll(context.Background(), 10, 5)
	if !errors.Is(err, errInjected) || len(ts) != 0 || tok == "" {
		t.Fatalf("poll: %+v %q %v; want the error, no tasks, the token", ts, tok, err)
	}
	if !p.inflight("a") {
		t.Fatal("a is no longer leased after the failed read")
	}
	if got := p.counters(); got != [4]float64{1, 0, 0, 0} {
		t.Errorf("claimed, reclaimed, dead{failed}, errors{remove} = %v", got)
	}
	fail = false
	p.expire("a")
	ts, tok, err = p.poll(context.Background(), 10, 5)
	if err != nil || len(ts) != 1 || ts[0].ID != "a" || ts[0].Attempts != 1 || ts[0].Payload != `{"n":1}` || tok == "" {
		t.Fatalf("poll after the lease: %+v %q %v; want a, 1 attempt", ts, tok, err)
	}
}

// The burial of a task over its attempts fails: counted as a remove
// error, nothing handed out, and the task is neither lost nor handed out:
// still leased; the next poll after its lease buries it.
func TestAdvPollBuryFails(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := newPollProbe(t)
	p.put("old", time.Hour, `{"n":1}`)
	if ts, _, err := p.poll(ctx, 10, 5); err != nil || len(ts) != 1 {
		t.Fatalf("first poll: %+v %v", ts, err)
	}
	p.expire("old")
	fail := true
	p.rdb.AddHook(failHook{fail: func(c redis.Cmder) bool { return fail && isScript(c) && hasArg(c, overReason) }})
	ts, tok, err := p.poll(ctx, 10, 1)
	if err != nil || len(ts) != 0 || tok != "" {
		t.Fatalf("poll: %+v %q %v; want nothing", ts, tok, err)
	}
	if got := p.counters(); got != [4]float64{2, 1, 0, 1} {
		t.Errorf("claimed, reclaimed, dead{failed}, errors{remove} = %v, want [2 1 0 1]", got)
	}
	if !p.inflight("old") {
		t.Fatal("old is not leased after the failed burial")
	}
	fail = false
	p.expire("old")
	if ts, tok, err := p.poll(ctx, 10, 1); err != nil || len(ts) != 0 || tok != "" {
		t.Fatalf("poll after the lease: %+v %q %v", ts, tok, err)
	}
	if tk := p.state("old"); tk.State != client.StateDead || tk.Attempts != 2 {
		t.Fatalf("old: %+v, want dead with 2 attempts", tk)
	}
}

// The HTTP client goes away just after the claim ran in Redis: what the
// claim leased is still read and answered under the token (the burial of
// what was over its attempts still runs), never left without a token.
func TestAdvPollCtxCancelledAfterClaim(t *testing.T) {
	t.Parallel()
	p := newPollProbe(t)
	p.put("old", time.Hour, `{"n":1}`)
	p.put("b", time.Minute, `{"n":2}`)
	if ts, _, err := p.poll(context.Background(), 1, 5); err != nil || len(ts) != 1 || ts[0].ID != "old" {
		t.Fatalf("first poll: %+v %v", ts, err)
	}
	p.expire("old")

	// A claim taking both: old over its attempts is buried, b handed out,
	// although ctx ends once the claim ran.
	ctx, cancel := context.WithCancel(context.Background())
	p.rdb.AddHook(failHook{after: func(c redis.Cmder) {
		if isScript(c) && !hasArg(c, overReason) {
			cancel()
		}
	}})
	ts, tok, err := p.poll(ctx, 10, 1)
	if err != nil || len(ts) != 1 || ts[0].ID != "b" || ts[0].Payload != `{"n":2}` || tok == "" {
		t.Fatalf("poll: %+v %q %v; want b under a token", ts, tok, err)
	}
	if ctx.Err() == nil {
		t.Fatal("the probe did not cancel ctx after the claim")
	}
	if tk := p.state("old"); tk.State != client.StateDead {
		t.Fatalf("old: %+v, want dead", tk)
	}
	if got := p.counters(); got != [4]float64{3, 1, 1, 0} {
		t.Errorf("claimed, reclaimed, dead{failed}, errors{remove} = %v, want [3 1 1 0]", got)
	}
}

// ctx ends after a claim that took only tasks over their attempts: the
// burial runs, the next claim fails on the ended ctx, and nothing due is
// leased by it (a task leased with no token returned would wait out a
// lease).
func TestAdvPollCtxCancelledBetweenClaims(t *testing.T) {
	t.Parallel()
	p := newPollProbe(t)
	p.put("old", time.Hour, `{"n":1}`)
	if ts, _, err := p.poll(context.Background(), 1, 5); err != nil || len(ts) != 1 {
		t.Fatalf("first poll: %+v %v", ts, err)
	}
	p.expire("old")
	p.put("b", time.Minute, `{"n":2}`)
	ctx, cancel := context.WithCancel(context.Background())
	p.rdb.AddHook(failHook{after: func(c redis.Cmder) {
		if isScript(c) && hasArg(c, overReason) {
			cancel()
		}
	}})
	ts, tok, err := p.poll(ctx, 1, 1)
	if !errors.Is(err, context.Canceled) || len(ts) != 0 || tok != "" {
		t.Fatalf("poll: %+v %q %v; want context.Canceled, nothing", ts, tok, err)
	}
	if p.inflight("b") {
		t.Fatal("b leased by a poll that returned no token")
	}
	if tk := p.state("old"); tk.State != client.StateDead {
		t.Fatalf("old: %+v, want dead", tk)
	}
	if got := p.counters(); got != [4]float64{2, 1, 1, 0} {
		t.Errorf("claimed, reclaimed, dead{failed}, errors{remove} = %v, want [2 1 1 0]", got)
	}
}

// A task whose payload is missing is handed out with payload null; the
// first task is taken whatever the byte budget; a budget leaves the rest
// due, untouched.
func TestAdvPollPayloadMissingAndBudget(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := newPollProbe(t)
	big := `"` + strings.Repeat("x", 2000) + `"`
	p.put("a-big", time.Minute, big)
	p.put("b-gone", time.Second*30, `{"n":2}`)
	p.put("c", time.Second, `{"n":3}`)
	p.rdb.HDel(ctx, p.k.Payload, "b-gone")
	ts, tok, err := advPoll(ctx, p.rdb, p.k, 10, 100, time.Minute, 5, p.m, zaptest.NewLogger(t))
	if err != nil || tok == "" || len(ts) != 1 || ts[0].ID != "a-big" || ts[0].Payload != big {
		t.Fatalf("budget poll: %d tasks %q %v", len(ts), tok, err)
	}
	if p.inflight("b-gone") || p.inflight("c") {
		t.Fatal("a task past the budget was leased")
	}
	ts, _, err = p.poll(ctx, 10, 5)
	ids := []string{}
	for _, x := range ts {
		ids = append(ids, x.ID+"="+x.Payload)
	}
	if err != nil || !slices.Equal(ids, []string{"b-gone=null", "c={\"n\":3}"}) {
		t.Fatalf("poll: %v %v", ids, err)
	}
}
