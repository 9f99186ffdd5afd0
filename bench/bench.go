// Package bench is orderdelay's side-by-side benchmark harness (issue 4).
//
// In one invocation it runs the same workloads through several contenders,
// interleaved over rounds, against a local PostgreSQL (a fresh database per
// run, cloned from a migrated template, dropped afterwards) and a private
// redis-server it starts on a free port (so asynq's fixed key names, FLUSHALL,
// SLOWLOG and INFO commandstats touch nobody else):
//
//   - the PostgreSQL batched-UPDATE ceiling (lib/pq, 1,000 serials per
//     statement, 4 connections);
//   - the naive design of the articles (ZRANGEBYSCORE 0..now every 5 s, per
//     order SELECT + UPDATE + ZREM) with 1 and 16 goroutines;
//   - asynq v0.26 scheduled tasks, concurrency 16, handler doing the
//     single-row conditional UPDATE;
//   - orderdelay: the real binary built from this repository, with default
//     settings and with tuned ones.
//
// Every run is checked: every unpaid order closed once, no paid order
// closed, none closed before its deadline. A violation fails the run.
//
// cmd/odbench is the command; bench_test.go runs the quick mode as a test.
package bench

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// Options configure a run. Defaults returns them for a mode.
type Options struct {
	Mode           string        // "quick", "default" or "full" (informational)
	N              int           // backlog size of a drain
	Rounds         int           // drain and enqueue rounds, contenders interleaved
	SlowCap        int           // most orders given to the naive and asynq contenders
	TimeBox        time.Duration // how long a slow contender may drain before its rate is taken
	SteadyRate     int           // orders per second in steady arrival
	SteadyFor      time.Duration // how long orders arrive
	ShortTimeout   time.Duration // the constant timeout, and the short one of the mix
	LongTimeout    time.Duration // the long one of the mix (60 s scaled down)
	SteadyBaseline bool          // also run naive and asynq in steady arrival
	EnqueueN       int           // entries per enqueue method and round
	HTTPCap        int           // most entries enqueued through the HTTP API per round
	IdleFor        time.Duration // how long idle Redis traffic is counted
	IdleOrders     int           // future orders waiting in the "idle with many" case
	BigN           int           // the big drain (RSS, SLOWLOG, API, profile); 0 skips it
	Sweep          []Settings    // drain throughput vs batch size and workers
	Tuned          Settings      // orderdelay's tuned setting
	Profile        bool          // CPU and allocation profiles of the big drain (pprof files + top lists)
	OutDir         string        // results: report.md, results.json, PNGs, profiles
	AdminURL       string        // PostgreSQL role that may CREATE DATABASE
	RedisServer    string        // redis-server binary
	Binary         string        // prebuilt orderdelay binary (empty: go build it)
	RepoRoot       string        // where to build it (empty: go list -m)
	Log            io.Writer     // progress
	Only           []string      // run only these steps (drain, sweep, big, steady, enqueue, idle); empty: all
}

// Defaults returns the options of a mode: "quick" (CI-sized, seconds),
// "default" (100,000 orders, 3 rounds, 30 s of steady arrival) or "full"
// (1,000,000 orders).
func Defaults(mode string) Options {
	o := Options{
		Mode: mode, N: 100_000, Rounds: 3, SlowCap: 30_000, TimeBox: 10 * time.Second,
		SteadyRate: 1000, SteadyFor: 30 * time.Second, ShortTimeout: 2 * time.Second, LongTimeout: 6 * time.Second,
		SteadyBaseline: true, EnqueueN: 100_000, HTTPCap: 20_000, IdleFor: 10 * time.Second,
		IdleOrders: 1_000_000, BigN: 1_000_000, Profile: true,
		Sweep: []Settings{
			{Workers: 4, BatchSize: 100}, {Workers: 4, BatchSize: 250}, {Workers: 4, BatchSize: 500},
			{Workers: 4, BatchSize: 1000}, {Workers: 4, BatchSize: 2000},
			{Workers: 1, BatchSize: 500}, {Workers: 2, BatchSize: 500}, {Workers: 8, BatchSize: 500},
			{Workers: 16, BatchSize: 500},
		},
		Tuned:       Settings{Workers: 8, BatchSize: 500},
		OutDir:      "results",
		AdminURL:    envOr("ORDERDELAY_TEST_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"),
		RedisServer: "redis-server",
		Log:         os.Stderr,
	}
	switch mode {
	case "quick":
		o.N, o.Rounds, o.SlowCap, o.TimeBox = 2000, 1, 2000, 5*time.Second
		o.SteadyFor, o.ShortTimeout, o.LongTimeout, o.SteadyBaseline = 1500*time.Millisecond, 500*time.Millisecond, time.Second, false
		o.EnqueueN, o.HTTPCap, o.IdleFor, o.IdleOrders = 2000, 500, time.Second, 2000
		o.BigN, o.Profile = 2000, false
		o.Sweep = []Settings{{Workers: 4, BatchSize: 500}, {Workers: 2, BatchSize: 500}}
	case "full":
		o.N, o.EnqueueN = 1_000_000, 1_000_000
		o.TimeBox = 20 * time.Second
	}
	return o
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

// env is one invocation's servers and tools.
type env struct {
	opt        Options
	redis      *privateRedis
	rdb        *redis.Client
	pg         *pgEnv
	bin        string
	tmp        string
	expectRate float64 // orders/s the profile window is sized for
}

func (e *env) logf(format string, args ...any) {
	if e.opt.Log != nil {
		fmt.Fprintf(e.opt.Log, "%s  "+format+"\n", append([]any{time.Now().Format("15:04:05")}, args...)...)
	}
}

// Run runs every workload and writes the results to opt.OutDir. The report
// is returned even when a correctness check failed; err is then non-nil.
func Run(ctx context.Context, opt Options) (*Report, error) {
	e := &env{opt: opt}
	var err error
	if e.tmp, err = os.MkdirTemp("", "odbench-"); err != nil {
		return nil, err
	}
	defer os.RemoveAll(e.tmp)
	if err := os.MkdirAll(opt.OutDir, 0o755); err != nil {
		return nil, err
	}
	e.bin = opt.Binary
	if e.bin == "" {
		e.logf("building orderdelay")
		if e.bin, err = buildDaemon(ctx, opt.RepoRoot, e.tmp); err != nil {
			return nil, err
		}
	}
	if e.redis, err = startPrivateRedis(opt.RedisServer); err != nil {
		return nil, err
	}
	defer e.redis.Stop()
	e.rdb = redis.NewClient(&redis.Options{Addr: e.redis.Addr, PoolSize: 32})
	defer e.rdb.Close()
	if e.pg, err = newPGEnv(ctx, opt.AdminURL); err != nil {
		return nil, err
	}
	defer e.pg.Close()

	r := &Report{Options: opt, Machine: machine(ctx, e), Started: time.Now()}
	e.logf("private redis-server at %s (pid %d); databases %s_*", e.redis.Addr, e.redis.Pid, e.pg.prefix)
	steps := []struct {
		name string
		run  func(context.Context, *env, *Report) error
	}{
		{"drain", runDrains},
		{"sweep", runSweep},
		{"big", runBig},
		{"steady", runSteady},
		{"enqueue", runEnqueue},
		{"idle", runIdle},
	}
	var failed []string
	for _, s := range steps {
		if ctx.Err() != nil {
			break
		}
		if len(opt.Only) > 0 && !slices.Contains(opt.Only, s.name) {
			continue
		}
		e.logf("== %s", s.name)
		if err := s.run(ctx, e, r); err != nil {
			r.Errors = append(r.Errors, fmt.Sprintf("%s: %v", s.name, err))
			failed = append(failed, s.name)
			e.logf("%s failed: %v", s.name, err)
		}
	}
	r.Finished = time.Now()
	r.evaluate()
	if err := r.write(opt.OutDir); err != nil {
		return r, err
	}
	if err := plots(r, opt.OutDir); err != nil {
		r.Errors = append(r.Errors, "plots: "+err.Error())
	}
	if len(r.Violations) > 0 || len(r.Errors) > 0 {
		return r, fmt.Errorf("%w: %s", errViolation, strings.Join(append(r.Violations, r.Errors...), "; "))
	}
	return r, nil
}

// withDB creates a fresh database, runs f with it and drops it.
func (e *env) withDB(ctx context.Context, f func(name, dsn string, db *sql.DB) error) error {
	name, err := e.pg.newDB(ctx)
	if err != nil {
		return err
	}
	defer e.pg.dropDB(name)
	dsn := e.pg.dbURL(name)
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		return err
	}
	db.SetMaxOpenConns(2)
	defer db.Close()
	return f(name, dsn, db)
}

// Machine describes where the run happened.
type Machine struct {
	CPUs       int    `json:"cpus"`
	CPUModel   string `json:"cpu_model"`
	MemoryMB   int64  `json:"memory_mb"`
	Kernel     string `json:"kernel"`
	GoVersion  string `json:"go_version"`
	PostgreSQL string `json:"postgresql"`
	Redis      string `json:"redis"`
	LoadAvg    string `json:"loadavg_at_start"`
	Revision   string `json:"revision"` // the orderdelay commit measured
}

func machine(ctx context.Context, e *env) Machine {
	m := Machine{CPUs: runtime.NumCPU(), GoVersion: runtime.Version(), PostgreSQL: e.pg.version(ctx)}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "model name"); ok {
				m.CPUModel = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(v), ":"))
				break
			}
		}
	}
	m.MemoryMB = procStatusKBFile("/proc/meminfo", "MemTotal") / 1024
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m.Kernel = strings.TrimSpace(string(b))
	}
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		m.LoadAvg = strings.Join(strings.Fields(string(b))[:3], " ")
	}
	m.Revision = revision(ctx, e.opt.RepoRoot)
	if info, err := e.rdb.Info(ctx, "server").Result(); err == nil {
		for _, l := range strings.Split(info, "\n") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(l), "redis_version:"); ok {
				m.Redis = v
			}
		}
	}
	return m
}

func procStatusKBFile(path, name string) int64 {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, name+":"); ok {
			var n int64
			fmt.Sscan(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), &n)
			return n
		}
	}
	return 0
}

func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o644)
}

func outPath(dir, name string) string { return filepath.Join(dir, name) }

// revision names the commit the daemon was built from, and says so when
// files outside bench/ differ from it (the harness builds the work tree).
func revision(ctx context.Context, root string) string {
	if root == "" {
		out, err := exec.CommandContext(ctx, "go", "list", "-m", "-f", "{{.Dir}}", "github.com/orderdelay/orderdelay").Output()
		if err != nil {
			return "unknown"
		}
		root = strings.TrimSpace(string(out))
	}
	head, err := exec.CommandContext(ctx, "git", "-C", root, "rev-parse", "--short", "HEAD").Output()
	if err != nil {
		return "unknown"
	}
	rev := strings.TrimSpace(string(head))
	st, _ := exec.CommandContext(ctx, "git", "-C", root, "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench").Output()
	if n := len(strings.Fields(string(st))) / 2; n > 0 {
		rev += fmt.Sprintf(" + %d uncommitted file(s)", n)
	}
	return rev
}
