package main

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/orderdelay/orderdelay/internal/config"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// cliEnv is the environment run sees: settings by variable name.
type cliEnv map[string]string

func (e cliEnv) getenv(k string) (string, bool) { v, ok := e[k]; return v, ok }

// cliResult is what one run of the command line gave.
type cliResult struct {
	code           int
	stdout, stderr string
}

func (r cliResult) String() string {
	return fmt.Sprintf("exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
}

// runCLI runs `orderdelay ARGS...` in-process, as main does.
func runCLI(ctx context.Context, env cliEnv, args ...string) cliResult {
	var out, errOut bytes.Buffer
	code := run(ctx, args, &out, &errOut, env.getenv)
	return cliResult{code: code, stdout: out.String(), stderr: errOut.String()}
}

// queuesFile writes a queues file declaring one task queue, "jobs", on key.
func queuesFile(t *testing.T, key string) string {
	t.Helper()
	file := filepath.Join(t.TempDir(), "queues.yaml")
	if err := os.WriteFile(file, []byte("queues:\n  - name: jobs\n    key: '"+key+"'\n    action: {type: poll}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return file
}

// downEnv is a configuration whose Redis and PostgreSQL refuse every
// connection: a command that gets as far as calling them fails (exit 1),
// so a usage case that exits 2 in it was refused before anything
// connected.
func downEnv(t *testing.T) cliEnv {
	t.Helper()
	redisPort, err := testenv.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	pgPort, err := testenv.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	key := "test:" + testenv.Name(t) + ":order"
	return cliEnv{
		"ORDERDELAY_REDIS_URL":    fmt.Sprintf("redis://127.0.0.1:%d/0?max_retries=-1", redisPort),
		"ORDERDELAY_DATABASE_URL": fmt.Sprintf("postgres://127.0.0.1:%d/orderdelay?sslmode=disable", pgPort),
		"ORDERDELAY_QUEUE_KEY":    key,
		"ORDERDELAY_QUEUES_FILE":  queuesFile(t, key+":jobs"),
		"ORDERDELAY_HTTP_ADDR":    "127.0.0.1:0",
	}
}

// upEnv is a configuration on the test's own Redis keys and database.
func upEnv(t *testing.T) cliEnv {
	t.Helper()
	_, keys := testenv.Redis(t)
	_, tasksKeys := testenv.Redis(t)
	_, dsn := testenv.CreateDatabase(t)
	return cliEnv{
		"ORDERDELAY_REDIS_URL":    testenv.RedisURL(),
		"ORDERDELAY_DATABASE_URL": dsn,
		"ORDERDELAY_QUEUE_KEY":    keys.Queue,
		"ORDERDELAY_QUEUES_FILE":  queuesFile(t, tasksKeys.Queue),
		"ORDERDELAY_HTTP_ADDR":    "127.0.0.1:0",
	}
}

// The commands main.go dispatches, each with the arguments of a run that
// gets as far as Redis or PostgreSQL.
var everyCommand = [][]string{
	{"run"},
	{"migrate"},
	{"enqueue", "o-1", "--after", "1h"},
	{"cancel", "o-1"},
	{"inspect"},
	{"inspect", "--dead"},
	{"inspect", "o-1"},
	{"requeue", "--all"},
	{"pause", "--reason", "test"},
	{"resume"},
	{"extend", "--within", "1h", "--by", "1m"},
	{"resync", "--rate", "0"},
	{"purge", "--dead", "--older-than", "1h"},
	{"unbatch"},
	{"task", "put", "jobs", "t-1", "--after", "1h", "--payload", `{"n":1}`},
	{"task", "get", "jobs", "t-1"},
	{"task", "list", "jobs"},
	{"task", "dead", "jobs"},
	{"task", "stats"},
	{"task", "pause", "jobs"},
	{"task", "resume", "jobs"},
	{"task", "requeue", "jobs", "--all"},
	{"task", "purge", "jobs", "--all"},
	{"task", "delete", "jobs", "t-1"},
	{"demo", "--duration", "1s"},
	{"version"},
}

// Exit status 2: a usage or configuration mistake, refused before anything
// connects, with a message naming what was wrong. At least one per
// command.
func TestExitStatusUsage(t *testing.T) {
	env := downEnv(t)
	tests := []struct {
		args []string
		says []string // on stderr
	}{
		{nil, []string{"Usage:"}},
		{[]string{"frobnicate"}, []string{`unknown command "frobnicate"`}},
		{[]string{"run", "--workers=abc"}, []string{"workers", `"abc"`}},
		{[]string{"run", "--workers", "0"}, []string{"--workers", "ORDERDELAY_WORKERS", `"0"`}},
		{[]string{"run", "--scan-interval=5"}, []string{"scan-interval", `"5"`}},
		{[]string{"run", "--max-close-rate=fast"}, []string{"max-close-rate", `"fast"`}},
		{[]string{"run", "--dry-run=maybe"}, []string{"dry-run", `"maybe"`}},
		{[]string{"run", "--lease", "5s"}, []string{"ORDERDELAY_STATEMENT_TIMEOUT", "ORDERDELAY_LEASE"}},
		{[]string{"run", "--no-such-flag"}, []string{"no-such-flag"}},
		{[]string{"run", "extra"}, []string{`"extra"`}},
		{[]string{"run", "--workers"}, []string{"workers"}},
		{[]string{"migrate", "extra"}, []string{`"extra"`}},
		{[]string{"enqueue", "--after", "1m"}, []string{"one serial"}},
		{[]string{"enqueue", "o-1", "--after", "soon"}, []string{"after", `"soon"`}},
		{[]string{"enqueue", "o-1", "--at", "tomorrow"}, []string{"--at"}},
		{[]string{"enqueue", "o-1"}, []string{"give after"}},
		{[]string{"enqueue", "o-1", "--after", "1m", "--at", "2030-01-01T00:00:00Z"}, []string{"not both"}},
		{[]string{"enqueue", "o-1", "--after=-1m"}, []string{"positive"}},
		{[]string{"enqueue", "o-1", "--after", "1m", "--reschedule", "--only-later"}, []string{"exclude each other"}},
		{[]string{"enqueue", "o\x01", "--after", "1m"}, []string{"control character"}},
		{[]string{"cancel"}, []string{"one serial"}},
		{[]string{"cancel", strings.Repeat("o", queue.MaxSerialLen+1)}, []string{"at most"}},
		{[]string{"inspect", "o\x01"}, []string{"control character"}},
		{[]string{"inspect", "a", "b"}, []string{"at most one serial"}},
		{[]string{"inspect", "--dead", "--limit", "0"}, []string{"--limit"}},
		{[]string{"requeue"}, []string{"--all"}},
		{[]string{"pause", "now"}, []string{`"now"`}},
		{[]string{"resume", "now"}, []string{`"now"`}},
		{[]string{"extend", "--within", "1h"}, []string{"--by"}},
		{[]string{"resync", "--page", "0"}, []string{"--page"}},
		{[]string{"purge", "--older-than", "1h"}, []string{"--dead"}},
		{[]string{"unbatch", "extra"}, []string{`"extra"`}},
		{[]string{"unbatch", "--per-call", "0"}, []string{"--per-call", "1..1000"}},
		{[]string{"task"}, []string{"task needs"}},
		{[]string{"task", "frob", "jobs"}, []string{`unknown verb "frob"`}},
		{[]string{"task", "put", "jobs", "--after", "1m"}, []string{"task id"}},
		{[]string{"task", "put", "nope", "t-1", "--after", "1m"}, []string{`no queue "nope"`}},
		{[]string{"task", "get", "jobs"}, []string{"task id"}},
		{[]string{"task", "get", "jobs", "t\x01"}, []string{"control character"}},
		{[]string{"task", "delete", "jobs"}, []string{"task id"}},
		{[]string{"task", "delete", "jobs", "t-1", "t\x01"}, []string{"control character"}},
		{[]string{"task", "list", "jobs", "--state", "zombie"}, []string{"--state"}},
		{[]string{"task", "dead"}, []string{"queue name"}},
		{[]string{"task", "stats", "a", "b"}, []string{"at most one queue"}},
		{[]string{"task", "pause"}, []string{"queue name"}},
		{[]string{"task", "resume"}, []string{"queue name"}},
		{[]string{"task", "requeue", "jobs"}, []string{"--all"}},
		{[]string{"task", "purge", "jobs", "--older-than", "-1h"}, []string{"--older-than"}},
		{[]string{"demo", "--rate", "0"}, []string{"--rate"}},
		{[]string{"demo", "extra"}, []string{`"extra"`}},
		{[]string{"version", "extra"}, []string{`"extra"`}},
		{[]string{"help", "frobnicate"}, []string{`unknown command "frobnicate"`}},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			r := runCLI(context.Background(), env, tt.args...)
			if r.code != 2 {
				t.Fatalf("orderdelay %q: want exit 2; got %s", tt.args, r)
			}
			for _, s := range tt.says {
				if !strings.Contains(r.stderr, s) {
					t.Errorf("orderdelay %q: stderr does not say %q:\n%s", tt.args, s, r.stderr)
				}
			}
			if strings.Contains(r.stderr, "-redis-url") {
				t.Errorf("orderdelay %q: a usage error prints the whole help:\n%s", tt.args, r.stderr)
			}
		})
	}
}

// Exit status 1: the command was right but could not be done — here,
// Redis and PostgreSQL refuse connections. Every command that calls them.
func TestExitStatusFailure(t *testing.T) {
	env := downEnv(t)
	for _, args := range everyCommand {
		if args[0] == "version" || args[0] == "run" { // run: TestExitStatusRun
			continue
		}
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			t.Parallel()
			r := runCLI(context.Background(), env, args...)
			if r.code != 1 || !strings.Contains(r.stderr, "orderdelay: ") {
				t.Fatalf("orderdelay %q with Redis and PostgreSQL down: want exit 1 and a message; got %s", args, r)
			}
			if !strings.Contains(r.stderr, "refused") {
				t.Errorf("orderdelay %q: the message does not say the connection was refused:\n%s", args, r.stderr)
			}
		})
	}
}

// Exit status 0: every command against reachable servers, in an order in
// which each has something to do; and 1 for a right command whose target
// is missing.
func TestExitStatusSuccess(t *testing.T) {
	env := upEnv(t)
	for _, args := range everyCommand {
		if args[0] == "run" || args[0] == "demo" { // run: TestExitStatusRun; demo: its own database
			continue
		}
		r := runCLI(context.Background(), env, args...)
		if r.code != 0 || r.stdout == "" {
			t.Errorf("orderdelay %q: want exit 0 and output; got %s", args, r)
		}
	}
	if r := runCLI(context.Background(), env, "cancel", "o-1"); r.code != 1 || !strings.Contains(r.stderr, "no timeout queued") {
		t.Errorf("cancel of an order no longer queued: want exit 1 saying so; got %s", r)
	}
}

// run: 0 when stopped (here before it was ready), 1 when it cannot do its
// job (the HTTP port is taken), 2 for a bad setting; --dry-run is a
// boolean flag (it was "flag needs an argument").
func TestExitStatusRun(t *testing.T) {
	env := upEnv(t)
	stopped, cancel := context.WithCancel(context.Background())
	cancel()
	for _, args := range [][]string{{"run"}, {"run", "--dry-run"}, {"run", "--dry-run=false", "--close-events"}, {"run", "--migrate"}} {
		if r := runCLI(stopped, env, args...); r.code != 0 {
			t.Errorf("orderdelay %q stopped at once: want exit 0; got %s", args, r)
		}
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	if r := runCLI(context.Background(), env, "run", "--http-addr", ln.Addr().String()); r.code != 1 || !strings.Contains(r.stderr, "address already in use") {
		t.Errorf("run on a port already taken: want exit 1 saying so; got %s", r)
	}
}

// -h prints the command's synopsis, its own flags with their types, the
// settings grouped under headings with their types, where the full table
// is, and the exit statuses — on stdout, exit 0.
func TestHelpGroupsSettings(t *testing.T) {
	env := downEnv(t)
	r := runCLI(context.Background(), env, "run", "-h")
	if r.code != 0 || r.stderr != "" {
		t.Fatalf("run -h: want exit 0 and nothing on stderr; got %s", r)
	}
	help := r.stdout
	for _, want := range []string{
		"orderdelay run [--migrate]",
		"--workers int", "--lease duration", "--max-close-rate float", "--redis-url string", "--migrate\n",
		"--dry-run  ", "--flag=false", "ORDERDELAY_WORKERS", "README.md#configuration",
		"Exit status", "0  done", "1  failed", "2  usage or configuration",
	} {
		if !strings.Contains(help, want) {
			t.Errorf("run -h does not show %q:\n%s", want, help)
		}
	}
	if strings.Contains(help, "--dry-run string") || strings.Contains(help, "--workers string") {
		t.Errorf("run -h shows typed settings as strings:\n%s", help)
	}
	for _, s := range config.Settings {
		if n := strings.Count(help, "--"+s.Flag()+" "); n != 1 {
			t.Errorf("run -h shows --%s %d times, want once", s.Flag(), n)
		}
	}
	// The groups come in order, each once.
	last := -1
	for _, g := range []string{"Connection", "Closing", "Reconciler", "HTTP", "Operator", "Task queues"} {
		i := strings.Index(help, "\n"+g+": ")
		if i < 0 || i < last || strings.Count(help, "\n"+g+": ") != 1 {
			t.Errorf("run -h: heading %q at %d (previous at %d), want each once, in order", g, i, last)
		}
		last = i
	}
	// Every command answers -h the same way; `help COMMAND` too.
	for _, args := range everyCommand {
		name := strings.Join(args[:1], " ")
		if args[0] == "task" {
			name = strings.Join(args[:2], " ")
		}
		for _, h := range [][]string{append(strings.Fields(name), "-h"), append([]string{"help"}, strings.Fields(name)...)} {
			r := runCLI(context.Background(), env, h...)
			if r.code != 0 || !strings.Contains(r.stdout, "orderdelay "+name) || !strings.Contains(r.stdout, "Exit status") ||
				name != "version" && !strings.Contains(r.stdout, "\nConnection: ") {
				t.Errorf("orderdelay %q: want exit 0 and help naming the command and exit statuses; got %s", h, r)
			}
		}
	}
}

// inspect SERIAL with Redis up and PostgreSQL down: it still prints the
// order's queue entry, but it could not show the row, so it exits 1
// naming PostgreSQL (it exited 0, the failure only in its output). inspect
// without a serial reads only Redis and is unaffected.
func TestInspectOrderPostgresDown(t *testing.T) {
	env := upEnv(t)
	pgPort, err := testenv.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	env["ORDERDELAY_DATABASE_URL"] = fmt.Sprintf("postgres://127.0.0.1:%d/orderdelay?sslmode=disable", pgPort)
	if r := runCLI(context.Background(), env, "enqueue", "o-1", "--after", "1h"); r.code != 0 {
		t.Fatalf("enqueue: %s", r)
	}
	for _, args := range [][]string{{"inspect", "o-1"}, {"inspect", "--json", "o-1"}} {
		r := runCLI(context.Background(), env, args...)
		if r.code != 1 || !strings.Contains(r.stderr, "orderdelay: PostgreSQL") || !strings.Contains(r.stderr, "refused") {
			t.Errorf("orderdelay %q with PostgreSQL down: want exit 1 and a message naming PostgreSQL and the refusal; got %s", args, r)
		}
		if !strings.Contains(r.stdout, "o-1") || !strings.Contains(r.stdout, "queued") {
			t.Errorf("orderdelay %q with PostgreSQL down: want the queue entry still shown; got %s", args, r)
		}
	}
	if r := runCLI(context.Background(), env, "inspect"); r.code != 0 {
		t.Errorf("inspect (Redis only) with PostgreSQL down: want exit 0; got %s", r)
	}
}
