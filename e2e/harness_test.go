package e2e

// The harness: the binary, built once; a world (the servers, database and
// queue keys one test owns); a running daemon with its env, its URL and its
// AdminURL; the one HTTP helper every test speaks to a daemon through; and
// waiting. The orders table's helpers are in orders_test.go.

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/tasks"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// binary is the orderdelay binary every test runs, built once by TestMain
// (testenv.BuildDaemon: race-instrumented under -race, so the daemon's own
// data races fail the tests too).
var binary string

// adminAddrSetting names the admin API's own listener. While the daemon
// does not know it (testdata/settings.txt, the list of settings it reads),
// the admin API shares the main listener and a daemon's AdminURL is its
// URL; once it does, every daemon gets an admin listener on a free port.
const adminAddrSetting = "ORDERDELAY_ADMIN_ADDR"

var adminListener bool

// defaultParallel is how many tests run at once unless -parallel says
// otherwise. The tests mostly wait — on deadlines, leases, backoffs,
// failovers — so more fit than go test's default of GOMAXPROCS; what bounds
// it is the machine's two cores under the busy ones and PostgreSQL's
// max_connections (100 by default): a test runs up to three daemons of
// seven connections each, and the campaign's checkout up to 40 more.
const defaultParallel = 4

func TestMain(m *testing.M) {
	flag.Parse()
	given := false
	flag.Visit(func(f *flag.Flag) { given = given || f.Name == "test.parallel" })
	if !given {
		flag.Set("test.parallel", strconv.Itoa(defaultParallel)) //nolint:errcheck // a registered flag
	}
	os.Exit(runMain(m))
}

func runMain(m *testing.M) int {
	defer testenv.RemoveDaemon()
	var err error
	if binary, err = testenv.BuildDaemon(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	settings, err := os.ReadFile(repoFile("testdata", "settings.txt"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	adminListener = slices.Contains(strings.Fields(string(settings)), adminAddrSetting)
	// The webhook secrets a taskWorld's queues file names, for the tests'
	// own parse of the file (its cleanup): set once for the process, so
	// task tests may run in parallel (t.Setenv forbids that).
	os.Setenv("OD_TEST_SECRET", webhookSecret)
	os.Setenv("OD_TEST_PREVIOUS_SECRET", previousWebhookSecret)
	return m.Run()
}

// repoFile is a path in the repository (the tests run in e2e/).
func repoFile(elem ...string) string { return filepath.Join(append([]string{".."}, elem...)...) }

// world is one test's servers, database and queue.
type world struct {
	t        *testing.T
	rdb      *redis.Client // reaches every key of the queue
	redisURL string        // what the daemon is given
	keys     queue.Keys
	db       *sqlx.DB
	dbURL    string // what the daemon is given
}

// newWorld is a world on the shared servers: a queue key and a database of
// the test's own.
func newWorld(t *testing.T) *world {
	t.Helper()
	rdb, keys := testenv.Redis(t)
	return withDatabase(t, rdb, testenv.RedisURL(), keys)
}

// withDatabase is a world on a Redis the caller chose (rdb for the test,
// redisURL for the daemon) with a database of the test's own.
func withDatabase(t *testing.T, rdb *redis.Client, redisURL string, keys queue.Keys) *world {
	t.Helper()
	db, dsn := testenv.Postgres(t)
	return &world{t: t, rdb: rdb, redisURL: redisURL, keys: keys, db: db, dbURL: dsn}
}

// privateWorld is a world whose Redis is a private server (the test may
// flush or reconfigure it) behind a proxy (the test may cut it).
func privateWorld(t *testing.T) (*world, *testenv.Proxy) {
	t.Helper()
	rdb, addr := testenv.PrivateRedis(t)
	px := testenv.NewProxy(t, addr)
	return withDatabase(t, rdb, "redis://"+px.Addr()+"/0", queue.NewKeys(queue.DefaultKey)), px
}

// viaProxy points a PostgreSQL URL at addr.
func viaProxy(t *testing.T, dsn, addr string) string {
	t.Helper()
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	u.Host = addr
	return u.String()
}

// env is the daemon's (and the CLI's) environment for this world; extra
// overrides.
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

// cli runs an orderdelay command against the world and returns its output;
// a non-zero exit fails the test.
func (w *world) cli(args ...string) string {
	w.t.Helper()
	cmd := exec.Command(binary, args...)
	cmd.Env = w.env()
	out, err := cmd.CombinedOutput()
	if err != nil {
		w.t.Fatalf("orderdelay %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// daemon is a running `orderdelay run`.
type daemon struct {
	*testenv.Daemon
	t        *testing.T
	addr     string // host:port of the API listener
	URL      string // the API: /v1, /metrics, /healthz, /readyz
	AdminURL string // the admin API (/admin/v1): every admin call goes here
}

// start runs `orderdelay run` with the world's settings plus extra, and
// waits until it is ready.
func (w *world) start(extra ...string) *daemon {
	w.t.Helper()
	d := w.launch(w.t, nil, extra...)
	d.waitReady()
	return d
}

// launch runs `orderdelay run args...` for test t with the world's
// settings plus extra, on listeners of its own, and waits for nothing. The
// process is killed when t ends, its output logged if t failed.
func (w *world) launch(t *testing.T, args []string, extra ...string) *daemon {
	t.Helper()
	d := &daemon{t: t, addr: testenv.FreeAddr(t)}
	d.URL = "http://" + d.addr
	d.AdminURL = d.URL
	env := []string{"ORDERDELAY_HTTP_ADDR=" + d.addr}
	if adminListener {
		admin := testenv.FreeAddr(t)
		d.AdminURL = "http://" + admin
		env = append(env, adminAddrSetting+"="+admin)
	}
	d.Daemon = testenv.StartDaemon(t, w.env(append(env, extra...)...), args...)
	return d
}

// Output is everything the daemon printed so far.
func (d *daemon) Output() string { return d.Log() }

func (d *daemon) waitReady() {
	d.t.Helper()
	d.WaitReady(d.t, d.URL+"/readyz", 60*time.Second)
}

// exit waits (at most within) for the daemon to exit and returns its exit
// status.
func (d *daemon) exit(within time.Duration) int {
	d.t.Helper()
	code, err := d.Wait(within)
	if err != nil {
		d.t.Fatalf("%v\n%s", err, testenv.LastLines(d.Output(), 30))
	}
	return code
}

// stop sends SIGTERM and returns the exit status.
func (d *daemon) stop() int {
	d.t.Helper()
	code, err := d.Stop(60 * time.Second)
	if err != nil {
		d.t.Fatalf("%v\n%s", err, testenv.LastLines(d.Output(), 30))
	}
	return code
}

// stopCleanly stops the daemon (SIGTERM) and fails its test unless it
// exits with status 0.
func (d *daemon) stopCleanly() {
	d.t.Helper()
	if code := d.stop(); code != 0 {
		d.t.Errorf("exit status %d after SIGTERM, want 0", code)
	}
}

// kill sends SIGKILL and waits for the process to go.
func (d *daemon) kill() { d.Kill() }

// Tokens daemons are given: ORDERDELAY_API_TOKEN=tokenA,tokenB,
// ORDERDELAY_ADMIN_TOKEN=adminToken.
const (
	tokenA     = "tok-aaaaaaaaaaaaaaaa-1"
	tokenB     = "tok-bbbbbbbbbbbbbbbb-2"
	adminToken = "adm-cccccccccccccccc-3"
)

// bearer is the Authorization header for a token.
func bearer(token string) string { return "Bearer " + token }

// call is the one way tests speak HTTP to a daemon: method on path — under
// /admin/ to the daemon's AdminURL, anything else to its URL — with auth as
// the Authorization header (none if empty; bearer(token) for a token) and
// body (JSON, if any). It returns the status, and decodes an answer below
// 300 into out when out is not nil. A transport error fails the test.
func (d *daemon) call(method, path, auth, body string, out any) int {
	d.t.Helper()
	code, b, err := d.try(context.Background(), method, path, auth, body)
	if err != nil {
		d.t.Fatalf("%s %s: %v", method, path, err)
	}
	if out != nil && code < 300 {
		if err := json.Unmarshal(b, out); err != nil {
			d.t.Fatalf("%s %s: %v: %s", method, path, err, b)
		}
	}
	return code
}

// try is call for callers that record a failed request rather than fail
// on it (and bound it with ctx): it returns the status, the raw body and
// the transport error.
func (d *daemon) try(ctx context.Context, method, path, auth, body string) (int, []byte, error) {
	base := d.URL
	if strings.HasPrefix(path, "/admin/") {
		base = d.AdminURL
	}
	req, err := http.NewRequestWithContext(ctx, method, base+path, strings.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

// scrape is the daemon's /metrics page.
func (d *daemon) scrape() string {
	d.t.Helper()
	code, b, err := d.try(context.Background(), http.MethodGet, "/metrics", "", "")
	if err != nil || code != http.StatusOK {
		d.t.Fatalf("GET /metrics: %d %v", code, err)
	}
	return string(b)
}

// metrics scrapes /metrics (see parseMetrics).
func (d *daemon) metrics() map[string]float64 {
	d.t.Helper()
	return parseMetrics(d.scrape())
}

// parseMetrics reads a /metrics page into family name -> summed value of
// its samples (histograms' _count and _sum under their full name), and
// series name{labels} -> value.
func parseMetrics(page string) map[string]float64 {
	out := map[string]float64{}
	sc := bufio.NewScanner(strings.NewReader(page))
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

// families lists the orderdelay_* metric families the daemon exports,
// sorted.
func (d *daemon) families() []string {
	d.t.Helper()
	var out []string
	for line := range strings.SplitSeq(d.scrape(), "\n") {
		if f, ok := strings.CutPrefix(line, "# TYPE "); ok {
			name, _, _ := strings.Cut(f, " ")
			if strings.HasPrefix(name, "orderdelay_") {
				out = append(out, name)
			}
		}
	}
	sort.Strings(out)
	return out
}

// sum adds one metric over several daemons.
func sum(name string, ds ...*daemon) float64 {
	var v float64
	for _, d := range ds {
		v += d.metrics()[name]
	}
	return v
}

// checkGolden keeps the file at path (one metric family a line) equal to
// got; deploy/validate checks dashboards and alerts against these files.
// ORDERDELAY_UPDATE_GOLDEN=1 rewrites it.
func checkGolden(t *testing.T, path string, got []string) {
	t.Helper()
	if os.Getenv("ORDERDELAY_UPDATE_GOLDEN") == "1" {
		if err := os.WriteFile(path, []byte(strings.Join(got, "\n")+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if want := strings.Fields(string(b)); !slices.Equal(got, want) {
		t.Errorf("exported metric families differ from %s (rerun with ORDERDELAY_UPDATE_GOLDEN=1 if intended):\n got %v\nwant %v", path, got, want)
	}
}

// subtest is one subtest for together.
type subtest struct {
	name string
	run  func(t *testing.T)
}

// together runs subtests, each with servers of its own, at the same time
// within t's own -parallel slot (or one after another under -parallel 1).
// As t.Parallel subtests they would wait for slots behind every test
// queued when t began, and all end the package's run as one long tail.
func together(t *testing.T, subtests ...subtest) {
	t.Helper()
	if f := flag.Lookup("test.parallel"); f != nil && f.Value.String() == "1" {
		for _, s := range subtests {
			t.Run(s.name, s.run)
		}
		return
	}
	var wg sync.WaitGroup
	for _, s := range subtests {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t.Run(s.name, s.run) // t.Run may be called from several goroutines at once
		}()
	}
	wg.Wait()
}

// waitFor polls cond until it holds, failing the test if it does not
// within the given time (testenv.WaitFor).
var waitFor = testenv.WaitFor

// The secrets of the webhook queues a taskWorld's file names (secret_env:
// OD_TEST_SECRET, previous_secret_env: OD_TEST_PREVIOUS_SECRET); every
// daemon a taskWorld starts has both.
const (
	webhookSecret         = "whsec-0123456789abcdef0123456789abcdef"
	previousWebhookSecret = "the-old-secret" // short: rotating a short secret out is allowed
)

// taskWorld is a world with a queues file whose keys (PREFIX:… in the
// YAML) belong to the test; its daemons run with the file.
type taskWorld struct {
	*world
	prefix string
	file   string
}

func newTaskWorld(t *testing.T, yaml string) *taskWorld {
	t.Helper()
	w := newWorld(t)
	prefix := "test:" + testenv.Name(t)
	yaml = strings.ReplaceAll(yaml, "PREFIX", prefix)
	file := filepath.Join(t.TempDir(), "queues.yaml")
	if err := os.WriteFile(file, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	tw := &taskWorld{world: w, prefix: prefix, file: file}
	// Parsing a webhook queue needs its secret (set by TestMain): without
	// it the cleanup below found no queues and left their keys behind.
	testenv.CheckNoKeysLeft(t, w.rdb, "*"+prefix+"*")
	t.Cleanup(func() {
		f, err := tasks.Parse([]byte(yaml))
		if err != nil {
			t.Errorf("cleanup: the queues file: %v", err)
		}
		for _, q := range f.Queues {
			testenv.DeleteQueue(w.rdb, queue.NewKeys(q.Key))
		}
	})
	return tw
}

func (tw *taskWorld) start(extra ...string) *daemon {
	return tw.world.start(append([]string{"ORDERDELAY_QUEUES_FILE=" + tw.file,
		"OD_TEST_SECRET=" + webhookSecret, "OD_TEST_PREVIOUS_SECRET=" + previousWebhookSecret}, extra...)...)
}

// keys are the keys of the named task queue.
func (tw *taskWorld) keys(name string) queue.Keys { return queue.NewKeys(tw.prefix + ":" + name) }
