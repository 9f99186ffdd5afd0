// Package examples runs the producer examples under examples/ (Java, Python,
// Node.js) the way a checkout would: against a real daemon built from
// ./cmd/orderdelay, on the real Redis and PostgreSQL, with a database and a
// queue key of the test's own (internal/testenv).
//
// Each example enqueues two orders the test has created. The test pays one
// of them before its deadline, then waits until the daemon has closed the
// other (never before its deadline) and has dropped the paid one's entry as
// settled without closing it.
//
// The runtimes and libraries come from scripts/examples-deps.sh. A missing
// one skips that example with a message saying so; with CI=true it fails.
package examples

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// lead is how far ahead of its creation an order's deadline is: the time an
// example has to start (a JVM on a loaded machine is slow) and enqueue both
// orders, and the test to pay one, before the daemon may close them. Each
// example waits it out, so it is what the test lasts: 15 s is five times
// what the slowest, the Java source launcher, took on two cores under six
// busy loops (2.7 s; 0.7 s idle).
const lead = 15 * time.Second

// example is one producer program.
type example struct {
	name    string
	dir     string                    // under examples/
	args    []string                  // given to the runtime before the orders
	runtime func(t *testing.T) string // the runtime's executable; skips (fails in CI) if missing
	env     func(w *world) []string   // its settings
}

// TestMain removes the daemon binary the tests built (testenv.BuildDaemon).
func TestMain(m *testing.M) {
	code := m.Run()
	testenv.RemoveDaemon()
	os.Exit(code)
}

func TestProducerExamples(t *testing.T) {
	w := newWorld(t)
	api := func(w *world) []string {
		return []string{"ORDERDELAY_API_URL=http://" + w.addr, "ORDERDELAY_API_TOKEN=" + w.token}
	}
	raw := func(w *world) []string {
		return []string{"ORDERDELAY_REDIS_URL=" + testenv.RedisURL(), "ORDERDELAY_QUEUE_KEY=" + w.keys.Queue}
	}
	var wg sync.WaitGroup
	for _, ex := range []example{
		{name: "java-api", dir: "java", args: []string{"Producer.java"}, runtime: javaRuntime, env: api},
		{name: "python-zadd", dir: "python", args: []string{"producer_zadd.py"}, runtime: pythonWith("redis"), env: raw},
		{name: "python-api", dir: "python", args: []string{"producer_api.py"}, runtime: pythonWith(""), env: api},
		{name: "node-zadd", dir: "node", args: []string{"zadd.mjs"}, runtime: nodeWith("redis"), env: raw},
		{name: "node-api", dir: "node", args: []string{"api.mjs"}, runtime: nodeWith(""), env: api},
	} {
		// All at once: each spends most of its time waiting for its
		// deadline, and t.Parallel would run only GOMAXPROCS of them at a
		// time. (t.Run may be called from several goroutines.)
		wg.Add(1)
		go func() {
			defer wg.Done()
			t.Run(ex.name, func(t *testing.T) { w.check(t, ex) })
		}()
	}
	wg.Wait()
}

// check runs one example on two fresh orders and checks what became of them.
func (w *world) check(t *testing.T, ex example) {
	exe := ex.runtime(t)
	ctx := context.Background()
	// Serials a URL must escape (a space, a slash, a non-ASCII letter): the
	// API examples have to encode the path segment.
	suffix := randomHex(t)
	unpaid, paid := "ORD "+ex.name+"/ü-unpaid-"+suffix, "ORD "+ex.name+"/ü-paid-"+suffix
	// A deadline with a sub-millisecond part: a raw producer must round it up.
	deadline := time.Now().Add(lead).Truncate(time.Millisecond).Add(789 * time.Microsecond)
	if _, err := w.db.Exec(`INSERT INTO orders (serial_no, expires_at) VALUES ($1, $3), ($2, $3)`, unpaid, paid, deadline); err != nil {
		t.Fatal(err)
	}
	at := deadline.UTC().Format(time.RFC3339Nano)

	args := append(append([]string{}, ex.args...), unpaid, at, paid, at)
	runCtx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(runCtx, exe, args...)
	cmd.Dir = ex.dir
	cmd.Env = append(os.Environ(), ex.env(w)...)
	start := time.Now()
	out, err := cmd.CombinedOutput()
	took := time.Since(start)
	t.Logf("$ (cd examples/%s && %s %s)\n%s", ex.dir, exe, quoteArgs(args), out)
	if err != nil {
		t.Fatalf("%s: %v", ex.name, err)
	}

	// Both entries are in the queue key, scored by the deadline in whole
	// milliseconds, rounded up.
	want := float64(queue.DeadlineMillis(deadline))
	for _, s := range []string{unpaid, paid} {
		score, err := w.rdb.ZScore(ctx, w.keys.Queue, s).Result()
		if errors.Is(err, redis.Nil) {
			t.Fatalf("%q is not in the queue key after the example ran (it took %s of the %s lead)", s, took, lead)
		}
		if err != nil {
			t.Fatal(err)
		}
		if score != want {
			t.Errorf("%q: score %.0f, want %.0f (deadline %s in ms, rounded up)", s, score, want, at)
		}
	}

	// The customer pays one order before its deadline.
	res, err := w.db.Exec(`UPDATE orders SET status = 'paid', paid_at = now()
		WHERE serial_no = $1 AND status = 'pending' AND expires_at > now()`, paid)
	if err != nil {
		t.Fatal(err)
	}
	if n, _ := res.RowsAffected(); n != 1 {
		t.Fatalf("could not pay %q before its deadline: the example took %s of the %s lead", paid, took, lead)
	}

	// The unpaid order is closed, at or after its deadline.
	var o orderRow
	testenv.WaitFor(t, "unpaid order "+strconv.Quote(unpaid)+" closed", lead+2*time.Minute, func() bool {
		o = w.order(t, unpaid)
		return o.Status != "pending"
	})
	if o.Status != "closed" || !o.ClosedAt.Valid || o.CloseReason.String != "timeout" {
		t.Fatalf("unpaid order: %+v, want closed by timeout", o)
	}
	if o.ClosedAt.Time.Before(o.ExpiresAt) {
		t.Errorf("unpaid order closed at %s, before its deadline %s", o.ClosedAt.Time, o.ExpiresAt)
	}
	t.Logf("%q closed %s after its deadline", unpaid, o.ClosedAt.Time.Sub(o.ExpiresAt))

	// The paid order's entry is dropped as settled once due, and the order
	// stays paid.
	testenv.WaitFor(t, "paid order's entry settled", lead+2*time.Minute, func() bool {
		return w.getTimeout(t, paid) == http.StatusNotFound
	})
	if now := time.Now(); now.Before(deadline) {
		t.Errorf("the paid order's entry went at %s, before its deadline %s", now, deadline)
	}
	if p := w.order(t, paid); p.Status != "paid" || p.ClosedAt.Valid {
		t.Errorf("paid order: %+v, want still paid, never closed", p)
	}
	t.Logf("%q stayed paid; its entry was dropped as settled", paid)
}

// world is the test's database, queue key and daemon, shared by the examples.
type world struct {
	db    *sqlx.DB
	rdb   *redis.Client
	keys  queue.Keys
	addr  string // the daemon's API, on loopback
	token string
}

func newWorld(t *testing.T) *world {
	rdb, keys := testenv.Redis(t)
	db, dsn := testenv.Postgres(t)
	w := &world{db: db, rdb: rdb, keys: keys, addr: testenv.FreeAddr(t), token: "examples-" + randomHex(t) + randomHex(t)}
	d := testenv.StartDaemon(t, []string{"PATH=" + os.Getenv("PATH"),
		"ORDERDELAY_REDIS_URL=" + testenv.RedisURL(), "ORDERDELAY_DATABASE_URL=" + dsn,
		"ORDERDELAY_QUEUE_KEY=" + keys.Queue, "ORDERDELAY_HTTP_ADDR=" + w.addr, "ORDERDELAY_API_TOKEN=" + w.token,
		"ORDERDELAY_LOG_LEVEL=info"})
	d.LogTail = 0 // all of it: five examples share the daemon
	// Runs before StartDaemon's cleanup (which kills what is left): the
	// daemon must stop cleanly on SIGTERM.
	t.Cleanup(func() {
		if code, err := d.Stop(time.Minute); err != nil {
			t.Error(err)
		} else if code != 0 {
			t.Errorf("daemon: %v", d.Err())
		}
	})
	d.WaitReady(t, "http://"+w.addr+"/readyz", 2*time.Minute)
	return w
}

// orderRow is what the test reads of an order.
type orderRow struct {
	Status      string         `db:"status"`
	ExpiresAt   time.Time      `db:"expires_at"`
	ClosedAt    sql.NullTime   `db:"closed_at"`
	CloseReason sql.NullString `db:"close_reason"`
}

func (w *world) order(t *testing.T, serial string) orderRow {
	t.Helper()
	var o orderRow
	if err := w.db.Get(&o, `SELECT status, expires_at, closed_at, close_reason FROM orders WHERE serial_no = $1`, serial); err != nil {
		t.Fatal(err)
	}
	return o
}

// getTimeout is the status of GET /v1/timeouts/{serial}: 200 while the
// daemon holds an entry for the serial (queued, leased, backing off or
// dead), 404 once it holds none.
func (w *world) getTimeout(t *testing.T, serial string) int {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, "http://"+w.addr+"/v1/timeouts/"+url.PathEscape(serial), nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+w.token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// javaRuntime is java from a JDK (single-file source launch compiles the
// example, so a JRE alone will not do).
func javaRuntime(t *testing.T) string {
	t.Helper()
	if _, err := exec.LookPath("javac"); err != nil {
		missing(t, "no JDK: javac is not on PATH")
	}
	return lookPath(t, "java")
}

// pythonWith returns a finder of a Python 3 that can import module (none:
// any Python 3). It tries $ORDERDELAY_EXAMPLES_PYTHON alone if set, else
// the venv scripts/examples-deps.sh makes, python3 on PATH and
// /usr/bin/python3 (where Debian's python3-redis installs).
func pythonWith(module string) func(t *testing.T) string {
	return func(t *testing.T) string {
		t.Helper()
		candidates := []string{os.Getenv("ORDERDELAY_EXAMPLES_PYTHON")}
		if candidates[0] == "" {
			venv, _ := filepath.Abs("python/.venv/bin/python")
			candidates = []string{venv, "python3", "/usr/bin/python3"}
		}
		code := "import sys; assert sys.version_info >= (3, 9)"
		if module != "" {
			code += "; import " + module
		}
		var tried []string
		for _, c := range candidates {
			exe, err := exec.LookPath(c)
			if err != nil {
				tried = append(tried, c+" (not found)")
				continue
			}
			if out, err := exec.Command(exe, "-c", code).CombinedOutput(); err != nil {
				tried = append(tried, fmt.Sprintf("%s (%s)", exe, lastLine(out, err)))
				continue
			}
			return exe
		}
		what := "Python 3.9+"
		if module != "" {
			what += " with " + module
		}
		missing(t, fmt.Sprintf("no %s; tried %s", what, strings.Join(tried, ", ")))
		return ""
	}
}

// nodeWith returns a finder of node, with package installed in
// examples/node (npm ci) unless it is empty.
func nodeWith(pkg string) func(t *testing.T) string {
	return func(t *testing.T) string {
		t.Helper()
		exe := lookPath(t, "node")
		if pkg != "" {
			if _, err := os.Stat(filepath.Join("node", "node_modules", pkg, "package.json")); err != nil {
				missing(t, "npm package "+pkg+" is not installed in examples/node (npm ci)")
			}
		}
		return exe
	}
}

func lookPath(t *testing.T, name string) string {
	t.Helper()
	exe, err := exec.LookPath(name)
	if err != nil {
		missing(t, name+" is not on PATH")
	}
	return exe
}

// missing stops an example whose runtime or library is not installed: a
// skip that says so on a developer's machine, a failure with CI=true.
func missing(t *testing.T, what string) {
	t.Helper()
	if ci, _ := strconv.ParseBool(os.Getenv("CI")); ci {
		t.Fatalf("%s; with CI=true every example must run (scripts/examples-deps.sh installs what they need)", what)
	}
	t.Skipf("EXAMPLE NOT RUN: %s; scripts/examples-deps.sh installs it (with CI=true this fails)", what)
}

func randomHex(t *testing.T) string {
	t.Helper()
	b := make([]byte, 6)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// lastLine is the last line of a failed command's output (a Python
// traceback's ends with the error), or the error if it printed nothing.
func lastLine(out []byte, err error) string {
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if l := lines[len(lines)-1]; l != "" {
		return l
	}
	return err.Error()
}

func quoteArgs(args []string) string {
	q := make([]string, len(args))
	for i, a := range args {
		q[i] = a
		if strings.ContainsAny(a, " /") {
			q[i] = "'" + a + "'"
		}
	}
	return strings.Join(q, " ")
}
