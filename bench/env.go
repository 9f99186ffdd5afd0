package bench

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/lib/pq"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/orders"
)

// privateRedis is a redis-server of the harness's own, on a free port,
// persisting nothing. Everything Redis-side runs there: asynq's fixed
// "asynq:*" keys cannot collide with anyone, FLUSHALL/CONFIG SET/SLOWLOG RESET
// touch nobody else, and the server's CPU time and INFO commandstats count
// only the harness's traffic.
type privateRedis struct {
	Addr string
	Pid  int
	cmd  *exec.Cmd
	done chan error
	dir  string
}

func startPrivateRedis(bin string) (*privateRedis, error) {
	if bin == "" {
		bin = "redis-server"
	}
	path, err := exec.LookPath(bin)
	if err != nil {
		return nil, fmt.Errorf("redis-server not found (apt-get install redis-server): %w", err)
	}
	var errs []error
	for range 3 { // a free port may be taken before redis binds it
		r, err := tryStartRedis(path)
		if err == nil {
			return r, nil
		}
		errs = append(errs, err)
	}
	return nil, errors.Join(errs...)
}

func tryStartRedis(path string) (*privateRedis, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "odbench-redis-")
	if err != nil {
		return nil, err
	}
	out := &markerWriter{marker: []byte("Ready to accept connections"), ready: make(chan struct{})}
	cmd := exec.Command(path, "--port", strconv.Itoa(port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", dir, "--daemonize", "no",
		"--logfile", "", "--loglevel", "warning",
		// Every command slower than 1 ms is logged, so the report can say
		// how slow the slowest one was (target: none above 10 ms).
		"--slowlog-log-slower-than", "1000", "--slowlog-max-len", strconv.Itoa(slowlogMaxLen))
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	r := &privateRedis{Addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), Pid: cmd.Process.Pid,
		cmd: cmd, done: make(chan error, 1), dir: dir}
	go func() { r.done <- cmd.Wait() }()
	// --loglevel warning hides the ready line; poll with PING instead.
	rdb := redis.NewClient(&redis.Options{Addr: r.Addr})
	defer rdb.Close()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case err := <-r.done:
			os.RemoveAll(dir)
			return nil, fmt.Errorf("redis-server on port %d exited (%v): %s", port, err, out.String())
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		err := rdb.Ping(ctx).Err()
		cancel()
		if err == nil {
			return r, nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	r.Stop()
	return nil, fmt.Errorf("redis-server on port %d not ready after 10s: %s", port, out.String())
}

// Stop kills the server (it persists nothing) and removes its directory.
func (r *privateRedis) Stop() {
	if r == nil || r.cmd == nil {
		return
	}
	r.cmd.Process.Kill() //nolint:errcheck // it may have exited already
	<-r.done
	os.RemoveAll(r.dir)
	r.cmd = nil
}

// URL is the redis:// URL of database db.
func (r *privateRedis) URL(db int) string { return fmt.Sprintf("redis://%s/%d", r.Addr, db) }

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// markerWriter collects a process's output (its start, for error messages)
// and closes ready when marker appears.
type markerWriter struct {
	marker []byte
	ready  chan struct{}
	mu     sync.Mutex
	buf    bytes.Buffer
	done   bool
}

func (w *markerWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.buf.Len() < 64<<10 {
		w.buf.Write(p)
	}
	if !w.done && bytes.Contains(w.buf.Bytes(), w.marker) {
		w.done = true
		close(w.ready)
	}
	return len(p), nil
}

func (w *markerWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}

// pgEnv creates the harness's databases on a shared PostgreSQL: one migrated
// template and, per run, a fresh copy of it, each dropped afterwards. It
// never touches any other database.
type pgEnv struct {
	admin    *sql.DB
	adminURL string
	prefix   string // bench_<random>
	template string
	seq      int
}

func newPGEnv(ctx context.Context, adminURL string) (*pgEnv, error) {
	admin, err := sql.Open("postgres", adminURL)
	if err != nil {
		return nil, err
	}
	admin.SetMaxOpenConns(2)
	if err := admin.PingContext(ctx); err != nil {
		admin.Close()
		return nil, fmt.Errorf("postgresql at %s: %w", adminURL, err)
	}
	b := make([]byte, 4)
	rand.Read(b)
	e := &pgEnv{admin: admin, adminURL: adminURL, prefix: "bench_" + hex.EncodeToString(b)}
	e.template = e.prefix + "_tpl"
	if _, err := admin.ExecContext(ctx, "CREATE DATABASE "+pq.QuoteIdentifier(e.template)); err != nil {
		admin.Close()
		return nil, err
	}
	if _, err := orders.Migrate(e.dbURL(e.template)); err != nil {
		e.Close()
		return nil, err
	}
	return e, nil
}

// dbURL is adminURL pointing at database name.
func (e *pgEnv) dbURL(name string) string {
	u, err := url.Parse(e.adminURL)
	if err != nil || u.Scheme == "" {
		// key=value DSN
		return e.adminURL + " dbname=" + name
	}
	u.Path = "/" + name
	return u.String()
}

// newDB creates a fresh database from the migrated template.
func (e *pgEnv) newDB(ctx context.Context) (string, error) {
	e.seq++
	name := fmt.Sprintf("%s_%d", e.prefix, e.seq)
	_, err := e.admin.ExecContext(ctx, "CREATE DATABASE "+pq.QuoteIdentifier(name)+" TEMPLATE "+pq.QuoteIdentifier(e.template))
	return name, err
}

func (e *pgEnv) dropDB(name string) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// FORCE: a daemon killed mid-run may leave a connection behind.
	e.admin.ExecContext(ctx, "DROP DATABASE IF EXISTS "+pq.QuoteIdentifier(name)+" WITH (FORCE)") //nolint:errcheck // best effort cleanup
}

// Close drops every database this run created (including leftovers of a
// crashed run with the same prefix) and closes the admin connection.
func (e *pgEnv) Close() {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rows, err := e.admin.QueryContext(ctx, "SELECT datname FROM pg_database WHERE datname LIKE $1", e.prefix+"\\_%")
	if err == nil {
		var names []string
		for rows.Next() {
			var n string
			if rows.Scan(&n) == nil {
				names = append(names, n)
			}
		}
		rows.Close()
		for _, n := range names {
			e.dropDB(n)
		}
	}
	e.admin.Close()
}

// version returns server_version.
func (e *pgEnv) version(ctx context.Context) string {
	var v string
	e.admin.QueryRowContext(ctx, "SHOW server_version").Scan(&v) //nolint:errcheck // informational
	return v
}

// cpuTicks is a snapshot of processes' user+system CPU time, in clock ticks
// (USER_HZ, 100 per second on Linux), read from /proc/<pid>/stat. It counts
// exited threads of a live process, but a process that exits between two
// snapshots loses its share: hence pools are held open until the end
// snapshot.
type cpuTicks map[int]int64

const userHZ = 100 // sysconf(_SC_CLK_TCK) on every Linux the harness targets

func procTicks(pid int) (int64, string, bool) {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return 0, "", false
	}
	s := string(b)
	open, closeP := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
	if open < 0 || closeP < 0 {
		return 0, "", false
	}
	comm := s[open+1 : closeP]
	f := strings.Fields(s[closeP+1:])
	// fields after ")": state(0) ppid(1) ... utime(11) stime(12)
	if len(f) < 13 {
		return 0, "", false
	}
	u, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return u + st, comm, true
}

// postgresPids lists every process named postgres on the machine.
func postgresPids() []int {
	ents, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if _, comm, ok := procTicks(pid); ok && comm == "postgres" {
			out = append(out, pid)
		}
	}
	return out
}

func snapshot(pids []int) cpuTicks {
	s := cpuTicks{}
	for _, p := range pids {
		if t, _, ok := procTicks(p); ok {
			s[p] = t
		}
	}
	return s
}

// delta is the CPU time the processes in end used since start, in
// microseconds; a process absent from start started during the interval.
func delta(start, end cpuTicks, only map[int]bool) float64 {
	var sum int64
	for p, t := range end {
		if only != nil && !only[p] {
			continue
		}
		sum += t - start[p]
	}
	return float64(sum) * 1e6 / userHZ
}

// pgPidsOf returns the server pids that work for database name: its
// backends plus the cluster's background processes (WAL writer,
// checkpointer, background writer, autovacuum), which also serve other
// databases — an approximation that over-counts when others are busy.
func (e *pgEnv) pgPidsOf(ctx context.Context, name string) map[int]bool {
	rows, err := e.admin.QueryContext(ctx,
		`SELECT pid FROM pg_stat_activity WHERE datname = $1 OR backend_type <> 'client backend'`, name)
	out := map[int]bool{}
	if err != nil {
		return out
	}
	defer rows.Close()
	for rows.Next() {
		var p int
		if rows.Scan(&p) == nil {
			out[p] = true
		}
	}
	return out
}

// selfCPU is this process's user+system CPU time in microseconds.
func selfCPU() float64 {
	t, _, _ := procTicks(os.Getpid())
	return float64(t) * 1e6 / userHZ
}

// procStatusKB reads a "Name:   123 kB" line of /proc/<pid>/status.
func procStatusKB(pid int, name string) int64 {
	f, err := os.Open(filepath.Join("/proc", strconv.Itoa(pid), "status"))
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+":"); ok {
			n, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return n
		}
	}
	return 0
}

// cpuMeter measures one run's CPU split: PostgreSQL (the run database's
// backends and the background processes), Redis (the private server) and
// the application (this process plus, for the daemon, its process).
type cpuMeter struct {
	pgStart, redisStart, appStart cpuTicks
	selfStart                     float64
	redisPid                      int
	appPid                        int
}

func startCPU(redisPid, appPid int) *cpuMeter {
	m := &cpuMeter{redisPid: redisPid, appPid: appPid}
	m.pgStart = snapshot(postgresPids())
	m.redisStart = snapshot([]int{redisPid})
	if appPid > 0 {
		m.appStart = snapshot([]int{appPid})
	}
	m.selfStart = selfCPU()
	return m
}

// CPU is CPU time in microseconds. Daemon is the orderdelay process alone
// (App includes it, with the harness).
type CPU struct{ PG, Redis, App, Daemon float64 }

func (c CPU) Total() float64 { return c.PG + c.Redis + c.App }

func (m *cpuMeter) stop(pgOnly map[int]bool) CPU {
	var c CPU
	c.PG = delta(m.pgStart, snapshot(postgresPids()), pgOnly)
	c.Redis = delta(m.redisStart, snapshot([]int{m.redisPid}), nil)
	c.App = selfCPU() - m.selfStart
	if m.appPid > 0 {
		c.Daemon = delta(m.appStart, snapshot([]int{m.appPid}), nil)
		c.App += c.Daemon
	}
	return c
}
