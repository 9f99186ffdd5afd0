package orderdelay_test

// End-to-end tests: the real binary, built once, driven as a user would,
// against the real Redis and PostgreSQL (each test with its own database
// and queue key, see internal/testenv).

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "orderdelay-it")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binary = filepath.Join(dir, "orderdelay")
	build := exec.Command("go", "build", "-race", "-o", binary, "./cmd/orderdelay")
	build.Stdout, build.Stderr = os.Stdout, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "build:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// world is one test's servers, database and queue.
type world struct {
	t        *testing.T
	rdb      *redis.Client
	redisURL string // what the daemon is given
	keys     queue.Keys
	db       *sqlx.DB
	dbURL    string // what the daemon is given
}

func newWorld(t *testing.T) *world {
	t.Helper()
	rdb, keys := testenv.Redis(t)
	db, dsn := testenv.Postgres(t)
	return &world{t: t, rdb: rdb, redisURL: testenv.RedisURL(), keys: keys, db: db, dbURL: dsn}
}

// daemon is a running orderdelay process.
type daemon struct {
	t      *testing.T
	cmd    *exec.Cmd
	addr   string
	mu     sync.Mutex
	output bytes.Buffer
	done   chan struct{}
	err    error
}

func (d *daemon) Write(p []byte) (int, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.output.Write(p)
}

func (d *daemon) Output() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.output.String()
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// env is the daemon's environment for this world; extra overrides.
func (w *world) env(extra ...string) []string {
	env := []string{
		"PATH=" + os.Getenv("PATH"),
		"ORDERDELAY_REDIS_URL=" + w.redisURL,
		"ORDERDELAY_DATABASE_URL=" + w.dbURL,
		"ORDERDELAY_QUEUE_KEY=" + w.keys.Queue,
		"ORDERDELAY_LOG_LEVEL=info",
	}
	return append(env, extra...)
}

// start runs `orderdelay run` with the world's settings plus extra.
func (w *world) start(extra ...string) *daemon {
	w.t.Helper()
	d := &daemon{t: w.t, addr: freeAddr(w.t), done: make(chan struct{})}
	d.cmd = exec.Command(binary, "run")
	d.cmd.Env = w.env(append([]string{"ORDERDELAY_HTTP_ADDR=" + d.addr}, extra...)...)
	d.cmd.Stdout, d.cmd.Stderr = d, d
	if err := d.cmd.Start(); err != nil {
		w.t.Fatal(err)
	}
	go func() { d.err = d.cmd.Wait(); close(d.done) }()
	w.t.Cleanup(func() {
		select {
		case <-d.done:
		default:
			d.cmd.Process.Kill()
			<-d.done
		}
		if w.t.Failed() {
			w.t.Logf("daemon output:\n%s", lastLines(d.Output(), 40))
		}
	})
	d.waitReady()
	return d
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func (d *daemon) url(path string) string { return "http://" + d.addr + path }

func (d *daemon) waitReady() {
	d.t.Helper()
	waitFor(d.t, "daemon ready", 60*time.Second, func() bool {
		select {
		case <-d.done:
			d.t.Fatalf("daemon exited early: %v\n%s", d.err, d.Output())
		default:
		}
		resp, err := http.Get(d.url("/readyz"))
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
}

// stop sends SIGTERM and returns the exit code.
func (d *daemon) stop() int {
	d.t.Helper()
	if err := d.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		d.t.Fatal(err)
	}
	select {
	case <-d.done:
	case <-time.After(60 * time.Second):
		d.t.Fatalf("daemon did not exit within 60s of SIGTERM\n%s", lastLines(d.Output(), 30))
	}
	return d.cmd.ProcessState.ExitCode()
}

// metrics scrapes /metrics into family name -> summed value of samples
// without a suffix (and _count/_sum for histograms under their full name).
func (d *daemon) metrics() map[string]float64 {
	d.t.Helper()
	resp, err := http.Get(d.url("/metrics"))
	if err != nil {
		d.t.Fatal(err)
	}
	defer resp.Body.Close()
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "#") || line == "" {
			continue
		}
		name, rest, _ := strings.Cut(line, " ")
		var labels string
		if i := strings.IndexByte(name, '{'); i >= 0 {
			name, labels = name[:i], name[i:]
		}
		var v float64
		fmt.Sscan(rest, &v)
		out[name] += v
		if labels != "" {
			out[name+labels] = v
		}
	}
	return out
}

// families lists the orderdelay_* metric families the daemon exports.
func (d *daemon) families() []string {
	d.t.Helper()
	resp, err := http.Get(d.url("/metrics"))
	if err != nil {
		d.t.Fatal(err)
	}
	defer resp.Body.Close()
	var out []string
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if f, ok := strings.CutPrefix(sc.Text(), "# TYPE "); ok {
			name, _, _ := strings.Cut(f, " ")
			if strings.HasPrefix(name, "orderdelay_") {
				out = append(out, name)
			}
		}
	}
	sort.Strings(out)
	return out
}

func waitFor(t *testing.T, what string, within time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not true within %s", what, within)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// createOrders inserts pending orders with one deadline.
func (w *world) createOrders(prefix string, n int, deadline time.Time) []string {
	w.t.Helper()
	serials := make([]string, n)
	for i := range serials {
		serials[i] = fmt.Sprintf("%s-%05d", prefix, i)
	}
	if _, err := w.db.Exec(`INSERT INTO orders (serial_no, expires_at) SELECT s, $2 FROM unnest($1::text[]) s`,
		pq.Array(serials), deadline); err != nil {
		w.t.Fatal(err)
	}
	return serials
}

func (w *world) zadd(serials []string, score float64) {
	w.t.Helper()
	z := make([]redis.Z, len(serials))
	for i, s := range serials {
		z[i] = redis.Z{Score: score, Member: s}
	}
	if err := w.rdb.ZAdd(context.Background(), w.keys.Queue, z...).Err(); err != nil {
		w.t.Fatal(err)
	}
}

func (w *world) count(query string, args ...any) int {
	w.t.Helper()
	var n int
	if err := w.db.Get(&n, query, args...); err != nil {
		w.t.Fatal(err)
	}
	return n
}

func (w *world) queueLen() int64 {
	w.t.Helper()
	n, err := w.rdb.ZCard(context.Background(), w.keys.Queue).Result()
	if err != nil {
		w.t.Fatal(err)
	}
	return n + held(w.t, w.rdb, w.keys)
}

// held counts a queue's entries leased or backing off, whichever the lease
// (a claim's batch lease, or an entry's own: see consumer's scripts).
func held(t testing.TB, rdb redis.Scripter, k queue.Keys) int64 {
	t.Helper()
	st, err := consumer.ReadStats(context.Background(), rdb, k)
	if err != nil {
		t.Fatal(err)
	}
	return st.Held
}

// put enqueues through the HTTP API.
func put(t *testing.T, d *daemon, serial string, body string) int {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPut, d.url("/v1/timeouts/"+serial), strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// checkInvariants: every unpaid order past its deadline is closed, no paid
// order is closed, nothing closed before its deadline.
func (w *world) checkInvariants() {
	w.t.Helper()
	if n := w.count("SELECT count(*) FROM orders WHERE status = 'pending' AND expires_at < now()"); n != 0 {
		w.t.Errorf("%d unpaid orders past their deadline are still pending", n)
	}
	if n := w.count("SELECT count(*) FROM orders WHERE paid_at IS NOT NULL AND status <> 'paid'"); n != 0 {
		w.t.Errorf("%d paid orders were closed", n)
	}
	if n := w.count("SELECT count(*) FROM orders WHERE closed_at < expires_at"); n != 0 {
		w.t.Errorf("%d orders closed before their deadline", n)
	}
}

// lateness returns p50 and p99 of closed_at - expires_at.
func (w *world) lateness() (p50, p99 time.Duration) {
	w.t.Helper()
	var a, b float64
	err := w.db.QueryRow(`SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM closed_at - expires_at)),
	        percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM closed_at - expires_at))
	 FROM orders WHERE status = 'closed'`).Scan(&a, &b)
	if err != nil {
		w.t.Fatal(err)
	}
	return time.Duration(a * float64(time.Second)), time.Duration(b * float64(time.Second))
}

// moveDeadlines sets every order's deadline to at: the rows first, then
// each of keys (ZADD XX: only members already there), as a checkout that
// moves deadlines does. Timing tests set up against a far deadline and move
// it near at the end, so a slow machine cannot eat their payment window.
func moveDeadlines(t *testing.T, db *sqlx.DB, rdb redis.Cmdable, keys, serials []string, at time.Time) {
	t.Helper()
	if _, err := db.Exec("UPDATE orders SET expires_at = $1", at); err != nil {
		t.Fatal(err)
	}
	z := make([]redis.Z, len(serials))
	for i, s := range serials {
		z[i] = redis.Z{Score: float64(queue.DeadlineMillis(at)), Member: s}
	}
	for _, k := range keys {
		if err := rdb.ZAddXX(context.Background(), k, z...).Err(); err != nil {
			t.Fatal(err)
		}
	}
}

func TestIntegrationClosesUnpaidOrders(t *testing.T) {
	w := newWorld(t)
	d := w.start()
	// Set up far ahead of any deadline (no race with a loaded machine),
	// then move every deadline to just ahead of now in one step.
	deadline := time.Now().Add(time.Hour)
	serials := w.createOrders("it", 1000, deadline)
	var wg sync.WaitGroup
	for i, s := range serials {
		if i%2 == 1 {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if code := put(t, d, s, `{"at":"`+deadline.UTC().Format(time.RFC3339Nano)+`"}`); code != http.StatusCreated {
				t.Errorf("PUT %s: status %d, want 201", s, code)
			}
		}()
		if i%64 == 0 {
			wg.Wait()
		}
	}
	wg.Wait()
	odd := []string{}
	for i := 1; i < len(serials); i += 2 {
		odd = append(odd, serials[i])
	}
	w.zadd(odd, float64(queue.DeadlineMillis(deadline)))
	// 100 are paid before their deadline (and stay queued: the SQL decides).
	if _, err := w.db.Exec("UPDATE orders SET status = 'paid', paid_at = now() WHERE serial_no = ANY($1)", pq.Array(serials[:100])); err != nil {
		t.Fatal(err)
	}
	moveDeadlines(t, w.db, w.rdb, []string{w.keys.Queue}, serials, time.Now().Add(300*time.Millisecond))
	waitFor(t, "queue drained", 60*time.Second, func() bool { return w.queueLen() == 0 })
	if n := w.count("SELECT count(*) FROM orders WHERE status = 'closed'"); n != 900 {
		t.Errorf("%d orders closed, want 900", n)
	}
	if n := w.count("SELECT count(*) FROM orders WHERE status = 'paid'"); n != 100 {
		t.Errorf("%d orders paid, want the 100 untouched", n)
	}
	w.checkInvariants()
	m := d.metrics()
	if v := m["orderdelay_orders_closed_total"]; v != 900 {
		t.Errorf("orderdelay_orders_closed_total %v, want 900", v)
	}
	if v := m[`orderdelay_orders_skipped_total{reason="settled"}`]; v != 100 {
		t.Errorf("skipped{settled} %v, want 100", v)
	}
	if v := m["orderdelay_enqueued_total"]; v != 500 {
		t.Errorf("orderdelay_enqueued_total %v, want 500 (the API half)", v)
	}
	p50, p99 := w.lateness()
	t.Logf("lateness over 900 closes: p50 %s, p99 %s", p50.Round(time.Millisecond), p99.Round(time.Millisecond))
	checkMetricGolden(t, d.families())
	if code := d.stop(); code != 0 {
		t.Fatalf("exit status %d after SIGTERM, want 0", code)
	}
}

// checkMetricGolden keeps testdata/metrics.txt equal to what the daemon
// exports; deploy/validate reads it to check dashboards and alerts.
// ORDERDELAY_UPDATE_GOLDEN=1 rewrites it.
func checkMetricGolden(t *testing.T, got []string) {
	t.Helper()
	path := filepath.Join("testdata", "metrics.txt")
	if os.Getenv("ORDERDELAY_UPDATE_GOLDEN") == "1" {
		os.WriteFile(path, []byte(strings.Join(got, "\n")+"\n"), 0o644)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	want := strings.Fields(string(b))
	if !slices.Equal(got, want) {
		t.Errorf("exported metric families differ from %s (rerun with ORDERDELAY_UPDATE_GOLDEN=1 if intended):\n got %v\nwant %v", path, got, want)
	}
}

func TestIntegrationSecondsInsteadOfMillisIsDeadLettered(t *testing.T) {
	w := newWorld(t)
	serials := w.createOrders("secs", 1, time.Now().Add(-time.Minute))
	w.zadd(serials, float64(time.Now().Unix())) // seconds: the classic mistake
	d := w.start()
	waitFor(t, "entry dead-lettered", 30*time.Second, func() bool {
		return d.metrics()[`orderdelay_dead_lettered_total{reason="score_out_of_range"}`] == 1
	})
	if st := w.count("SELECT count(*) FROM orders WHERE status = 'pending'"); st != 1 {
		t.Errorf("the order was touched: %d pending, want 1", st)
	}
	out, err := exec.Command(binary, "inspect", "--json", "--queue-key", w.keys.Queue,
		"--redis-url", testenv.RedisURL()).CombinedOutput()
	if err != nil {
		t.Fatalf("inspect: %v\n%s", err, out)
	}
	var got struct {
		Depth       int64 `json:"depth"`
		DeadLetters int64 `json:"dead_letters"`
	}
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("inspect --json: %v\n%s", err, out)
	}
	if got.Depth != 0 || got.DeadLetters != 1 {
		t.Errorf("inspect: depth %d, dead letters %d; want 0 and 1", got.Depth, got.DeadLetters)
	}
	info, err := w.rdb.HGet(context.Background(), w.keys.DeadInfo, serials[0]).Result()
	if err != nil || !strings.HasPrefix(info, "score_out_of_range|") {
		t.Errorf("dead-letter record %q (%v), want reason score_out_of_range", info, err)
	}
	if code := d.stop(); code != 0 {
		t.Fatalf("exit status %d, want 0", code)
	}
}

// auditClose closes like the reference statement and records every close
// with the closing replica's application_name, so a double close shows.
const auditClose = `WITH due AS (
    SELECT serial_no FROM orders WHERE serial_no = ANY($1) AND status = 'pending'
    ORDER BY serial_no FOR UPDATE),
closed AS (
    UPDATE orders o SET status = 'closed', closed_at = now(), closed_by = current_setting('application_name')
    FROM due WHERE o.serial_no = due.serial_no AND o.status = 'pending'
    RETURNING o.serial_no),
audit AS (
    INSERT INTO close_audit (serial_no, replica) SELECT serial_no, current_setting('application_name') FROM closed)
SELECT serial_no FROM closed`

func TestIntegrationTwoReplicas(t *testing.T) {
	w := newWorld(t)
	if _, err := w.db.Exec("CREATE TABLE close_audit (serial_no text NOT NULL, replica text NOT NULL, at timestamptz DEFAULT now())"); err != nil {
		t.Fatal(err)
	}
	a := w.start("ORDERDELAY_CLOSE_SQL="+auditClose, "ORDERDELAY_BATCH_SIZE=50")
	b := w.start("ORDERDELAY_CLOSE_SQL="+auditClose, "ORDERDELAY_BATCH_SIZE=50")
	deadline := time.Now().Add(time.Second)
	serials := w.createOrders("two", 3000, deadline)
	w.zadd(serials, float64(queue.DeadlineMillis(deadline)))
	if _, err := w.db.Exec("UPDATE orders SET status = 'paid', paid_at = now() WHERE serial_no = ANY($1)", pq.Array(serials[:300])); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "queue drained", 60*time.Second, func() bool { return w.queueLen() == 0 })
	w.checkInvariants()
	if n := w.count("SELECT count(*) FROM (SELECT serial_no FROM close_audit GROUP BY serial_no HAVING count(*) > 1) d"); n != 0 {
		t.Errorf("%d orders closed twice", n)
	}
	if n := w.count("SELECT count(*) FROM close_audit"); n != 2700 {
		t.Errorf("%d closes audited, want 2700", n)
	}
	ma, mb := a.metrics(), b.metrics()
	claimed := ma["orderdelay_claimed_total"] + mb["orderdelay_claimed_total"]
	if claimed != 3000 {
		t.Errorf("claims summed over replicas %v, want 3000 (each serial claimed once)", claimed)
	}
	t.Logf("replica a closed %v, b closed %v", ma["orderdelay_orders_closed_total"], mb["orderdelay_orders_closed_total"])
	for _, d := range []*daemon{a, b} {
		if code := d.stop(); code != 0 {
			t.Errorf("exit status %d, want 0", code)
		}
	}
}

func TestIntegrationInvalidSettingsExit2(t *testing.T) {
	w := newWorld(t)
	noQueues := filepath.Join(t.TempDir(), "queues.yaml")
	if err := os.WriteFile(noQueues, []byte("queues: []\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name    string
		args    []string
		env     []string
		mention string
	}{
		{"bad number", nil, []string{"ORDERDELAY_WORKERS=many"}, "ORDERDELAY_WORKERS"},
		{"bad duration", nil, []string{"ORDERDELAY_LEASE=forever"}, "ORDERDELAY_LEASE"},
		{"flag beats env and is checked", []string{"--batch-size", "0"}, []string{"ORDERDELAY_BATCH_SIZE=10"}, "--batch-size"},
		{"statement timeout not below lease", nil, []string{"ORDERDELAY_STATEMENT_TIMEOUT=60s", "ORDERDELAY_LEASE=60s"}, "ORDERDELAY_STATEMENT_TIMEOUT"},
		{"drain not below lease", nil, []string{"ORDERDELAY_DRAIN_TIMEOUT=2m"}, "ORDERDELAY_DRAIN_TIMEOUT"},
		{"reminder queue with an empty queues file", nil,
			[]string{"ORDERDELAY_QUEUES_FILE=" + noQueues, "ORDERDELAY_REMINDER_QUEUE=remind"}, "ORDERDELAY_REMINDER_QUEUE"},
		{"bad redis url", nil, []string{"ORDERDELAY_REDIS_URL=http://u:hunter2hunter2@x"}, "ORDERDELAY_REDIS_URL"},
		{"close statement with the wrong parameter type", nil,
			[]string{"ORDERDELAY_CLOSE_SQL=SELECT serial_no FROM orders WHERE serial_no = ANY($1::int[]::text[]) AND $1::int[] IS NOT NULL"},
			"ORDERDELAY_CLOSE_SQL"},
		{"close statement returning two columns", nil,
			[]string{"ORDERDELAY_CLOSE_SQL=SELECT serial_no, status FROM orders WHERE serial_no = ANY($1)"}, "ORDERDELAY_CLOSE_SQL"},
		// The overdue statement's contract before keyset paging (no cursor,
		// serial only): refused, saying what it must take and return.
		{"overdue statement without a cursor", nil,
			[]string{"ORDERDELAY_OVERDUE_SQL=SELECT serial_no FROM orders WHERE status = 'pending' AND expires_at < now() - $1::bigint * interval '1 millisecond' ORDER BY expires_at LIMIT $2::bigint FOR UPDATE SKIP LOCKED"},
			"ORDERDELAY_OVERDUE_SQL"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cmd := exec.Command(binary, append([]string{"run"}, c.args...)...)
			cmd.Env = w.env(append([]string{"ORDERDELAY_HTTP_ADDR=" + freeAddr(t)}, c.env...)...)
			var out bytes.Buffer
			cmd.Stdout, cmd.Stderr = &out, &out
			done := make(chan error, 1)
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			go func() { done <- cmd.Wait() }()
			select {
			case <-done:
			case <-time.After(60 * time.Second):
				cmd.Process.Kill()
				t.Fatalf("still running after 60s; output:\n%s", out.String())
			}
			if code := cmd.ProcessState.ExitCode(); code != 2 {
				t.Fatalf("exit status %d, want 2; output:\n%s", code, out.String())
			}
			if !strings.Contains(out.String(), c.mention) {
				t.Fatalf("output does not name %s:\n%s", c.mention, out.String())
			}
			if strings.Contains(out.String(), "hunter2") {
				t.Fatalf("output leaks a password:\n%s", out.String())
			}
		})
	}
}

// lockedClose waits on an advisory lock the test holds, so a batch is
// certainly in flight when SIGTERM arrives.
const lockedClose = `SELECT s FROM unnest($1::text[]) s
WHERE length(s) + (SELECT 0 FROM pg_advisory_xact_lock(777)) < 0`

func TestIntegrationSIGTERMHandsBackUnfinishedClaims(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	deadline := time.Now().Add(-time.Second)
	serials := w.createOrders("term", 200, deadline)
	w.zadd(serials, float64(queue.DeadlineMillis(deadline)))
	lock, err := w.db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if _, err := lock.ExecContext(ctx, "SELECT pg_advisory_lock(777)"); err != nil {
		t.Fatal(err)
	}
	d := w.start("ORDERDELAY_CLOSE_SQL="+lockedClose, "ORDERDELAY_DRAIN_TIMEOUT=1s", "ORDERDELAY_BATCH_SIZE=100", "ORDERDELAY_WORKERS=2")
	waitFor(t, "both batches in flight", 30*time.Second, func() bool {
		return d.metrics()["orderdelay_inflight_orders"] == 200
	})
	if code := d.stop(); code != 0 {
		t.Fatalf("exit status %d, want 0", code)
	}
	if n := held(t, w.rdb, w.keys); n != 0 {
		t.Fatalf("%d entries still leased after shutdown, want all handed back", n)
	}
	for _, s := range serials {
		score, err := w.rdb.ZScore(ctx, w.keys.Queue, s).Result()
		if err != nil || int64(score) != queue.DeadlineMillis(deadline) {
			t.Fatalf("%s: score %d (%v), want its true deadline %d", s, int64(score), err, queue.DeadlineMillis(deadline))
		}
	}
	if _, err := lock.ExecContext(ctx, "SELECT pg_advisory_unlock(777)"); err != nil {
		t.Fatal(err)
	}
	second := w.start()
	waitFor(t, "second run closes them", 60*time.Second, func() bool { return w.queueLen() == 0 })
	if n := w.count("SELECT count(*) FROM orders WHERE status = 'closed'"); n != len(serials) {
		t.Errorf("%d closed by the second run, want %d", n, len(serials))
	}
	w.checkInvariants()
	if code := second.stop(); code != 0 {
		t.Fatalf("exit status %d, want 0", code)
	}
}
