package worker

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/orderdelay/orderdelay/client"
)

// logCount is a slog handler that sends on hits each time a record whose
// message contains want is logged, and keeps every message.
type logCount struct {
	want string
	hits chan struct{}
	mu   *sync.Mutex
	msgs *[]string
}

func newLogCount(want string) *logCount {
	return &logCount{want: want, hits: make(chan struct{}, 1000), mu: &sync.Mutex{}, msgs: &[]string{}}
}

func (l *logCount) Enabled(context.Context, slog.Level) bool { return true }
func (l *logCount) Handle(_ context.Context, r slog.Record) error {
	m := r.Level.String() + " " + r.Message
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "error" {
			m += " (" + a.Value.String() + ")"
		}
		return true
	})
	l.mu.Lock()
	*l.msgs = append(*l.msgs, m)
	l.mu.Unlock()
	if strings.Contains(r.Message, l.want) {
		select {
		case l.hits <- struct{}{}:
		default: // more hits than anyone waits for
		}
	}
	return nil
}
func (l *logCount) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logCount) WithGroup(string) slog.Handler      { return l }
func (l *logCount) messages() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), *l.msgs...)
}

// waitHits waits for the n-th hit.
func (l *logCount) waitHits(t *testing.T, n int) {
	t.Helper()
	for i := range n {
		select {
		case <-l.hits:
		case <-time.After(30 * time.Second):
			t.Fatalf("only %d of %d %q logged; logs: %v", i, n, l.want, l.messages())
		}
	}
}

// The package doc's Shutdown section: Run waits up to ShutdownTimeout for
// running handlers, then ShutdownGrace; "a handler still running after
// that is abandoned: its result is dropped", and (helpers_test.go's
// TestMain) no goroutine of a Worker outlives Run. The settle's retry
// loop runs inside the handler's goroutine on a 10 s budget of its own
// and never looks at the shutdown: with Redis down at shutdown and a
// ShutdownTimeout under 10 s, Run gives up on a handler that had already
// returned (ErrShutdownTimeout, "handlers still running abandoned"), stops
// the heartbeats and returns, while the goroutine keeps calling Redis —
// and records the outcome after Run returned, on a client the program
// may have closed by then. Before 9bee459 the one failed ack ended at once.
func TestAdvSettleRetryOutlivesRun(t *testing.T) {
	e := newEnv(t)
	rdb, proxy := proxied(t)
	q := e.queue(5 * time.Second)
	q.Concurrency = 1
	e.put("j", `{}`)

	sig := newLogCount("settling a task failed; trying again")
	w := newWorker(t, rdb, Config{Logger: slog.New(sig), ShutdownTimeout: 100 * time.Millisecond})
	if err := w.Handle(q, func(ctx context.Context, t *Task) error {
		proxy.Down() // Redis goes away just as the handler succeeds
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	before := goleak.IgnoreCurrent()
	stop, wait := start(t, w)
	sig.waitHits(t, 1) // the ack failed; the handler has returned
	stop()
	runErr := wait()
	leak := goleak.Find(before,
		goleak.IgnoreTopFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).reaper"),
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
		goleak.IgnoreTopFunction("database/sql.(*DB).connectionOpener"))
	if leak == nil {
		return
	}
	// Redis comes back after Run returned: does the worker still write?
	proxy.Up()
	acked := false
	for range 300 {
		if _, err := e.get("j"); errors.Is(err, client.ErrNotFound) {
			acked = true
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	msg := leak.Error()
	if i := strings.Index(msg, "worker.(*runner).run"); i >= 0 {
		msg = msg[max(0, i-300):min(len(msg), i+200)]
	}
	t.Fatalf("Run returned (%v) with the settle still retrying in a worker goroutine; acked after Run returned: %v\n%s", runErr, acked, msg)
}
