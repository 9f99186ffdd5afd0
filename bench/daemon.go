package bench

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
)

// buildDaemon builds the real orderdelay binary from the repository the
// bench module replaces github.com/orderdelay/orderdelay with, so the harness
// runs exactly what users deploy.
func buildDaemon(ctx context.Context, repoRoot, dir string) (string, error) {
	if repoRoot == "" {
		out, err := exec.CommandContext(ctx, "go", "list", "-m", "-f", "{{.Dir}}", "github.com/orderdelay/orderdelay").Output()
		if err != nil {
			return "", fmt.Errorf("find the orderdelay module (run from bench/ or pass -repo): %w", err)
		}
		repoRoot = strings.TrimSpace(string(out))
	}
	bin := filepath.Join(dir, "orderdelay")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "./cmd/orderdelay")
	cmd.Dir = repoRoot
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/orderdelay in %s: %w\n%s", repoRoot, err, out)
	}
	return bin, nil
}

// daemonProc is one orderdelay process started by the harness.
type daemonProc struct {
	cmd       *exec.Cmd
	Pid       int
	HTTPAddr  string
	PprofAddr string
	out       *markerWriter
	done      chan error
	keys      queue.Keys
}

// Settings are the daemon settings a run changes; zero keeps the default.
type Settings struct {
	Workers   int `json:"workers,omitempty"`
	BatchSize int `json:"batch_size,omitempty"`
	// Env holds other settings, NAME=value, for an A/B of one setting in
	// the same run (e.g. ORDERDELAY_PREPARED_STATEMENTS=false).
	Env []string `json:"env,omitempty"`
}

func (s Settings) String() string {
	if s.Workers == 0 && s.BatchSize == 0 && len(s.Env) == 0 {
		return "defaults"
	}
	var parts []string
	if s.Workers > 0 {
		parts = append(parts, fmt.Sprintf("workers=%d", s.Workers))
	}
	if s.BatchSize > 0 {
		parts = append(parts, fmt.Sprintf("batch=%d", s.BatchSize))
	}
	parts = append(parts, s.Env...)
	return strings.Join(parts, ",")
}

// startDaemon runs `orderdelay run` on database dbName and queue key with
// default settings except s, and waits until its scanner has subscribed to
// the wake channel (PUBSUB NUMSUB), i.e. the consumer is running.
func (e *env) startDaemon(ctx context.Context, dbName, key string, s Settings, pprof bool) (*daemonProc, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	d := &daemonProc{HTTPAddr: fmt.Sprintf("127.0.0.1:%d", port), keys: queue.NewKeys(key), done: make(chan error, 1),
		out: &markerWriter{marker: []byte("\x00never"), ready: make(chan struct{})}}
	envv := append(os.Environ(),
		"ORDERDELAY_REDIS_URL="+e.redis.URL(0),
		"ORDERDELAY_DATABASE_URL="+e.pg.dbURL(dbName),
		"ORDERDELAY_QUEUE_KEY="+key,
		"ORDERDELAY_HTTP_ADDR="+d.HTTPAddr,
	)
	if s.Workers > 0 {
		envv = append(envv, "ORDERDELAY_WORKERS="+strconv.Itoa(s.Workers))
	}
	if s.BatchSize > 0 {
		envv = append(envv, "ORDERDELAY_BATCH_SIZE="+strconv.Itoa(s.BatchSize))
	}
	envv = append(envv, s.Env...)
	if pprof {
		pp, err := freePort()
		if err != nil {
			return nil, err
		}
		d.PprofAddr = fmt.Sprintf("127.0.0.1:%d", pp)
		envv = append(envv, "ORDERDELAY_PPROF_ADDR="+d.PprofAddr)
	}
	d.cmd = exec.Command(e.bin, "run")
	d.cmd.Env = envv
	d.cmd.Stdout, d.cmd.Stderr = d.out, d.out
	if err := d.cmd.Start(); err != nil {
		return nil, err
	}
	d.Pid = d.cmd.Process.Pid
	go func() { d.done <- d.cmd.Wait() }()
	deadline := time.Now().Add(60 * time.Second)
	for {
		select {
		case err := <-d.done:
			return nil, fmt.Errorf("orderdelay exited at start (%v): %s", err, d.out.String())
		default:
		}
		n, err := e.rdb.PubSubNumSub(ctx, d.keys.Wake).Result()
		if err == nil && n[d.keys.Wake] > 0 {
			return d, nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			d.kill()
			return nil, fmt.Errorf("orderdelay did not start its consumer within 60s: %s", d.out.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// stop sends SIGTERM and waits for a clean exit (status 0).
func (d *daemonProc) stop() error {
	if d == nil || d.cmd == nil {
		return nil
	}
	d.cmd.Process.Signal(syscall.SIGTERM) //nolint:errcheck // it may have exited
	select {
	case err := <-d.done:
		d.cmd = nil
		if err != nil {
			return fmt.Errorf("orderdelay exit: %v: %s", err, tail(d.out.String(), 2000))
		}
		return nil
	case <-time.After(40 * time.Second):
		d.kill()
		return fmt.Errorf("orderdelay did not stop within 40s of SIGTERM")
	}
}

func (d *daemonProc) kill() {
	if d == nil || d.cmd == nil {
		return
	}
	d.cmd.Process.Kill() //nolint:errcheck // it may have exited
	<-d.done
	d.cmd = nil
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// metrics scrapes /metrics and returns the samples whose name (with labels)
// starts with one of prefixes, summed per prefix.
func (d *daemonProc) metrics(ctx context.Context, prefixes ...string) (map[string]float64, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+d.HTTPAddr+"/metrics", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "#") {
			continue
		}
		for _, p := range prefixes {
			if strings.HasPrefix(line, p) {
				name := line[:strings.LastIndexByte(line, ' ')]
				if name != p && !strings.HasPrefix(name, p+"{") {
					continue
				}
				v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
				if err == nil {
					out[p] += v
				}
			}
		}
	}
	return out, sc.Err()
}

// fetch saves GET url to path.
func fetch(ctx context.Context, url, path string) error {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// apiProbe asks the daemon's API for an entry every interval while a run
// goes on, recording the slowest answer and the failures: the API must keep
// answering while a huge backlog drains.
type apiProbe struct {
	stopc   chan struct{}
	done    chan struct{}
	MaxMs   float64
	Calls   int
	Failure int
}

func startProbe(addr string, every time.Duration) *apiProbe {
	p := &apiProbe{stopc: make(chan struct{}), done: make(chan struct{})}
	cl := &http.Client{Timeout: 2 * time.Second}
	go func() {
		defer close(p.done)
		t := time.NewTicker(every)
		defer t.Stop()
		for first := true; ; first = false {
			if !first {
				select {
				case <-p.stopc:
					return
				case <-t.C:
				}
			}
			start := time.Now()
			resp, err := cl.Get("http://" + addr + "/v1/timeouts/PROBE-1")
			ms := float64(time.Since(start).Microseconds()) / 1000
			p.Calls++
			if err != nil {
				p.Failure++
				continue
			}
			io.Copy(io.Discard, resp.Body) //nolint:errcheck // drain for keep-alive
			resp.Body.Close()
			if resp.StatusCode != http.StatusNotFound {
				p.Failure++
			}
			p.MaxMs = max(p.MaxMs, ms)
		}
	}()
	return p
}

func (p *apiProbe) stop() { close(p.stopc); <-p.done }

// scriptName tells the daemon's scripts apart in SLOWLOG by their number
// of keys and, where two share a count, by a key's suffix (the sha is not
// exported). keys are the script's KEYS as SLOWLOG logged them.
func scriptName(keys []string) (string, bool) {
	suffix := func(i int) string {
		if i >= len(keys) {
			return ""
		}
		_, s, _ := strings.Cut(keys[i], "}:")
		return s
	}
	switch len(keys) {
	case 10:
		return "claim script", true
	case 5:
		if suffix(1) == "lease" {
			return "retry script", true
		}
		return "finish script", true
	case 2:
		return "fence script", true
	case 7:
		switch {
		case suffix(0) == "inflight":
			return "bury script", true
		case suffix(1) == "lease":
			return "client enqueue script", true
		}
		return "stats script", true
	case 6:
		return "hand-back script", true
	}
	return "", false
}

// slowStats summarizes SLOWLOG: while an orderdelay drain runs the private
// server logs every command slower than 50 µs — every batch script, none of
// the single-key commands (the harness's ZCARD polls, the commands a script
// calls, which SLOWLOG would otherwise list beside the script that ran
// them) — so the log holds each script's execution time inside Redis.
type slowStats struct {
	MaxMicros int64
	Over10ms  int
	Slowest   string
	Entries   int
	Truncated bool
	Micros    map[string]int64 // total execution time per command or script
	Calls     map[string]int
}

func commandName(args []string) string {
	if len(args) == 0 {
		return "?"
	}
	name := strings.ToLower(args[0])
	if (name == "evalsha" || name == "eval") && len(args) > 2 {
		if n, err := strconv.Atoi(args[2]); err == nil && len(args) >= 3+n {
			if name, ok := scriptName(args[3 : 3+n]); ok {
				return name
			}
		}
		return name + "/" + args[2] + " keys"
	}
	return name
}

func slowlog(ctx context.Context, rdb *redis.Client) slowStats {
	st := slowStats{Micros: map[string]int64{}, Calls: map[string]int{}}
	logs, err := rdb.SlowLogGet(ctx, -1).Result()
	if err != nil {
		st.MaxMicros, st.Over10ms, st.Slowest = -1, -1, err.Error()
		return st
	}
	st.Entries = len(logs)
	st.Truncated = len(logs) >= slowlogMaxLen
	for _, l := range logs {
		us := l.Duration.Microseconds()
		name := commandName(l.Args)
		st.Micros[name] += us
		st.Calls[name]++
		if us > st.MaxMicros {
			st.MaxMicros, st.Slowest = us, name
		}
		if us > 10_000 {
			st.Over10ms++
		}
	}
	return st
}

const slowlogMaxLen = 200_000

// traceCommands makes the private server log every command slower than
// 50 µs (on) or 1 ms (off), and empties the log.
func traceCommands(ctx context.Context, rdb *redis.Client, on bool) error {
	v := "1000"
	if on {
		v = "50"
	}
	if err := rdb.ConfigSet(ctx, "slowlog-log-slower-than", v).Err(); err != nil {
		return err
	}
	return rdb.SlowLogReset(ctx).Err()
}
