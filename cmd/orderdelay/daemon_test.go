package main

import (
	"context"
	"net"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/config"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// daemonConfig is the configuration of a daemon on the test's own queue
// key and database: quiet, quick scans, no HTTP unless env sets an
// address; env overrides and adds settings.
func daemonConfig(t *testing.T, keys queue.Keys, dsn string, env map[string]string) config.Config {
	t.Helper()
	all := map[string]string{
		"ORDERDELAY_REDIS_URL":     testenv.RedisURL(),
		"ORDERDELAY_DATABASE_URL":  dsn,
		"ORDERDELAY_QUEUE_KEY":     keys.Queue,
		"ORDERDELAY_HTTP_ADDR":     "",
		"ORDERDELAY_SCAN_INTERVAL": "100ms",
		"ORDERDELAY_LOG_LEVEL":     "error",
	}
	for k, v := range env {
		all[k] = v
	}
	cfg, _, err := parse("run", nil, testWriter{t}, func(k string) (string, bool) { v, ok := all[k]; return v, ok }, nil)
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// daemonRun is a daemon running in the background; done is closed when
// runDaemon has returned err.
type daemonRun struct {
	cancel context.CancelFunc
	done   chan struct{}
	err    error
}

func startDaemon(t *testing.T, cfg config.Config, opts daemonOptions) *daemonRun {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &daemonRun{cancel: cancel, done: make(chan struct{})}
	go func() { defer close(r.done); r.err = runDaemon(ctx, cfg, zap.NewNop(), opts) }()
	t.Cleanup(func() {
		cancel()
		<-r.done
	})
	return r
}

// ended reports whether runDaemon has returned.
func (r *daemonRun) ended() bool {
	select {
	case <-r.done:
		return true
	default:
		return false
	}
}

// recordingListener hands the test the daemon's HTTP listener.
type recordingListener struct {
	mu  sync.Mutex
	lns []net.Listener
}

func (r *recordingListener) listen(network, addr string) (net.Listener, error) {
	ln, err := net.Listen(network, addr)
	if err == nil {
		r.mu.Lock()
		r.lns = append(r.lns, ln)
		r.mu.Unlock()
	}
	return ln, err
}

func (r *recordingListener) first(t *testing.T) net.Listener {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.lns) == 0 {
		t.Fatal("the daemon opened no listener")
	}
	return r.lns[0]
}

// started returns a daemonOptions.started hook that signals on ch.
func signalStarted(ch chan<- struct{}) func(context.Context, *daemon) {
	return func(ctx context.Context, _ *daemon) {
		close(ch)
		<-ctx.Done()
	}
}

// TestDaemonEndsWhenHTTPServeFails: the API listener breaking mid-run
// (here: closed under the server) ends the run with an error that says
// so, instead of leaving a daemon without its API, metrics and health.
func TestDaemonEndsWhenHTTPServeFails(t *testing.T) {
	_, keys := testenv.Redis(t)
	_, dsn := testenv.Postgres(t)
	cfg := daemonConfig(t, keys, dsn, map[string]string{"ORDERDELAY_HTTP_ADDR": "127.0.0.1:0"})
	rec := &recordingListener{}
	up := make(chan struct{})
	d := startDaemon(t, cfg, daemonOptions{listen: rec.listen, started: signalStarted(up)})
	select {
	case <-up:
	case <-d.done:
		t.Fatalf("daemon stopped before it started: %v", d.err)
	case <-time.After(60 * time.Second):
		t.Fatal("the daemon never started")
	}
	rec.first(t).Close() // Serve now fails: accept on a closed listener
	select {
	case <-d.done:
	case <-time.After(60 * time.Second):
		d.cancel()
		<-d.done
		t.Fatalf("the daemon was still running a minute after its HTTP server failed (after cancel it returned %v); want the run to end with the serve error", d.err)
	}
	if err := d.err; err == nil || !strings.Contains(err.Error(), "http") || !strings.Contains(err.Error(), "closed") {
		t.Fatalf("runDaemon: %v, want an error naming the HTTP server and its failure", err)
	}
}

// lockedCloseSQL waits on an advisory lock the test holds, so a batch is
// certainly in flight when shutdown begins.
const lockedCloseSQL = `SELECT s FROM unnest($1::text[]) s
WHERE length(s) + (SELECT 0 FROM pg_advisory_xact_lock(778)) < 0`

// TestDaemonShutdownOrder: on SIGTERM (the process's own, caught by the
// daemon's signal actor) or when the parent context ends, readiness
// answers 503 at once; the API keeps serving (producers can still
// enqueue, metrics are scraped) while the consumer finishes its in-flight
// batch — a second signal meanwhile changes nothing — and only after that
// does HTTP stop accepting, the stages stopping in the reverse of their
// start order, the signal handler last.
func TestDaemonShutdownOrder(t *testing.T) {
	for _, how := range []string{"SIGTERM", "context"} {
		t.Run(how, func(t *testing.T) { testShutdownOrder(t, how == "SIGTERM") })
	}
}

func testShutdownOrder(t *testing.T, bySignal bool) {
	if bySignal {
		// Should the daemon not catch them, the signals land here instead
		// of killing the test binary: the test then fails on its waits.
		guard := make(chan os.Signal, 4)
		signal.Notify(guard, syscall.SIGTERM, syscall.SIGINT)
		defer signal.Stop(guard)
	}
	rdb, keys := testenv.Redis(t)
	db, dsn := testenv.Postgres(t)
	ctx := context.Background()
	lock, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if _, err := lock.ExecContext(ctx, "SELECT pg_advisory_lock(778)"); err != nil {
		t.Fatal(err)
	}
	unlock := func() {
		if _, err := lock.ExecContext(ctx, "SELECT pg_advisory_unlock(778)"); err != nil {
			t.Fatal(err)
		}
	}
	due := time.Now().Add(-time.Second)
	if _, err := db.Exec(`INSERT INTO orders (serial_no, expires_at) VALUES ('shut-1', $1)`, due); err != nil {
		t.Fatal(err)
	}
	if err := rdb.ZAdd(ctx, keys.Queue, redis.Z{Score: float64(queue.DeadlineMillis(due)), Member: "shut-1"}).Err(); err != nil {
		t.Fatal(err)
	}
	cfg := daemonConfig(t, keys, dsn, map[string]string{
		"ORDERDELAY_HTTP_ADDR": "127.0.0.1:0", "ORDERDELAY_CLOSE_SQL": lockedCloseSQL,
		"ORDERDELAY_STATEMENT_TIMEOUT": "50s", "ORDERDELAY_DRAIN_TIMEOUT": "50s",
		"ORDERDELAY_RECONCILE_INTERVAL": "0",
	})
	rec := &recordingListener{}
	var (
		mu      sync.Mutex
		stopped []string
	)
	d := startDaemon(t, cfg, daemonOptions{listen: rec.listen, stopped: func(stage string) {
		mu.Lock()
		defer mu.Unlock()
		stopped = append(stopped, stage)
	}})
	var base string
	get := func(path string) (int, error) {
		resp, err := http.Get(base + path)
		if err != nil {
			return 0, err
		}
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	waitUntil := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(60 * time.Second); !cond(); time.Sleep(20 * time.Millisecond) {
			if d.ended() {
				t.Fatalf("the daemon ended (%v) before %s", d.err, what)
			}
			if time.Now().After(deadline) {
				t.Fatalf("no %s within a minute", what)
			}
		}
	}
	waitUntil("listener", func() bool { rec.mu.Lock(); defer rec.mu.Unlock(); return len(rec.lns) > 0 })
	base = "http://" + rec.first(t).Addr().String()
	// In flight: a worker holds the claim (its batch lease is in
	// {Q}:leases; {Q}:inflight holds only backoffs, which no worker holds).
	waitUntil("batch in flight", func() bool {
		n, _ := rdb.ZCard(ctx, keys.Leases).Result()
		b, _ := rdb.ZCard(ctx, keys.Inflight).Result()
		return n == 1 && b == 0
	})

	if bySignal {
		if err := syscall.Kill(os.Getpid(), syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
	} else {
		d.cancel()
	}
	waitUntil("503 from /readyz", func() bool { code, _ := get("/readyz"); return code == http.StatusServiceUnavailable })
	// The batch is still held by the lock: the daemon is draining, and
	// HTTP still serves.
	for _, path := range []string{"/metrics", "/healthz", "/v1/timeouts/shut-1"} {
		if code, err := get(path); err != nil || code == http.StatusServiceUnavailable {
			t.Errorf("GET %s while the consumer drains: %d %v, want it served", path, code, err)
		}
	}
	if bySignal {
		// A second signal while draining is caught too, and ignored.
		if err := syscall.Kill(os.Getpid(), syscall.SIGINT); err != nil {
			t.Fatal(err)
		}
		if code, err := get("/metrics"); err != nil || code != http.StatusOK {
			t.Errorf("GET /metrics after a second signal: %d %v, want it served: the drain goes on", code, err)
		}
	}
	if d.ended() {
		t.Fatalf("the daemon returned (%v) with a batch still in flight", d.err)
	}
	unlock()
	if <-d.done; d.err != nil {
		t.Fatalf("runDaemon: %v", d.err)
	}
	if _, err := get("/healthz"); err == nil {
		t.Errorf("GET /healthz after the run: %v, want the connection refused", err)
	}
	mu.Lock()
	if want := []string{"work", "checks", "http", "signals"}; !slices.Equal(stopped, want) {
		t.Errorf("stages stopped in the order %q, want %q (the reverse of their start)", stopped, want)
	}
	mu.Unlock()
	var status string
	if err := db.Get(&status, `SELECT status FROM orders WHERE serial_no = 'shut-1'`); err != nil || status != "pending" {
		// lockedCloseSQL closes nothing: the point is only the order.
		t.Errorf("shut-1: %q %v", status, err)
	}
}
