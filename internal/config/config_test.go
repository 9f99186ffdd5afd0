package config_test

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zapcore"

	"github.com/orderdelay/orderdelay/internal/config"
)

// load runs Register with env as the environment and args as the command
// line, as the command does.
func load(t testing.TB, env map[string]string, args ...string) (config.Config, error) {
	t.Helper()
	fs := flag.NewFlagSet("orderdelay", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	l := config.Register(fs, func(k string) (string, bool) { v, ok := env[k]; return v, ok })
	if err := fs.Parse(args); err != nil {
		t.Fatalf("parse %q: %v", args, err)
	}
	return l()
}

func mustLoad(t *testing.T, env map[string]string, args ...string) config.Config {
	t.Helper()
	c, err := load(t, env, args...)
	if err != nil {
		t.Fatalf("Load(env %v, args %q): %v", env, args, err)
	}
	return c
}

// TestDefaults holds the defaults to DESIGN.md's configuration table.
func TestDefaults(t *testing.T) {
	c := mustLoad(t, nil)
	tests := []struct {
		env       string
		got, want any
	}{
		{"ORDERDELAY_REDIS_URL", c.RedisURL, "redis://127.0.0.1:6379/0"},
		{"ORDERDELAY_REDIS_MODE", c.RedisMode, "standalone"},
		{"ORDERDELAY_DATABASE_URL", c.DatabaseURL, "postgres://127.0.0.1:5432/orderdelay?sslmode=disable"},
		{"ORDERDELAY_QUEUE_KEY", c.QueueKey, "delaytask:order"},
		{"ORDERDELAY_QUEUE_SHARDS", c.QueueShards, 1},
		{"ORDERDELAY_SCAN_INTERVAL", c.ScanInterval, 5 * time.Second},
		{"ORDERDELAY_WORKERS", c.Workers, 4},
		{"ORDERDELAY_BATCH_SIZE", c.BatchSize, 500},
		{"ORDERDELAY_LEASE", c.Lease, 60 * time.Second},
		{"ORDERDELAY_STATEMENT_TIMEOUT", c.StatementTimeout, 10 * time.Second},
		{"ORDERDELAY_DRAIN_TIMEOUT", c.DrainTimeout, 20 * time.Second},
		{"ORDERDELAY_MAX_ATTEMPTS", c.MaxAttempts, 10},
		{"ORDERDELAY_BACKOFF_MAX", c.BackoffMax, 5 * time.Minute},
		{"ORDERDELAY_RECONCILE_INTERVAL", c.ReconcileInterval, time.Minute},
		{"ORDERDELAY_RECONCILE_GRACE", c.ReconcileGrace, 5 * time.Minute},
		{"ORDERDELAY_HTTP_ADDR", c.HTTPAddr, "127.0.0.1:8080"},
		{"ORDERDELAY_PPROF_ADDR", c.PprofAddr, ""},
		{"ORDERDELAY_API_TOKEN", len(c.APITokens), 0},
		{"ORDERDELAY_API_AUTH", c.APIAuth, "token"},
		{"ORDERDELAY_LOG_LEVEL", c.LogLevel, zapcore.InfoLevel},
		{"ORDERDELAY_LOG_FORMAT", c.LogFormat, "json"},
		{"ORDERDELAY_CLOSE_SQL", c.CloseSQL, ""},
		{"ORDERDELAY_LOOKUP_SQL", c.LookupSQL, ""},
		{"ORDERDELAY_OVERDUE_SQL", c.OverdueSQL, ""},
		{"ORDERDELAY_CLOSE_DELAY", c.CloseDelay, time.Duration(0)},
		{"ORDERDELAY_MAX_CLOSE_RATE", c.MaxCloseRate, 0.0},
		{"ORDERDELAY_ADMIN_TOKEN", len(c.AdminTokens), 0},
		{"ORDERDELAY_ADMIN_ADDR", c.AdminAddr, "127.0.0.1:8081"},
		{"ORDERDELAY_DRY_RUN", c.DryRun, false},
		{"ORDERDELAY_DEAD_LETTER_RETENTION", c.DeadRetention, 7 * 24 * time.Hour},
		{"ORDERDELAY_DEAD_LETTER_MAX", c.DeadMax, 100000},
		{"ORDERDELAY_QUEUES_FILE", c.QueuesFile, ""},
		{"ORDERDELAY_CLOSE_EVENTS", c.CloseEvents, false},
		{"ORDERDELAY_PREPARED_STATEMENTS", c.PreparedStatements, true},
		{"ORDERDELAY_CLOSE_EVENTS_MAXLEN", c.CloseEventsMaxLen, int64(1000000)},
		{"ORDERDELAY_REMINDER_QUEUE", c.ReminderQueue, ""},
		{"ORDERDELAY_REMINDER_BEFORE", c.ReminderBefore, 10 * time.Minute},
	}
	for _, tt := range tests {
		if tt.got != tt.want {
			t.Errorf("%s default = %v, want %v", tt.env, tt.got, tt.want)
		}
	}
	if got, want := len(tests), len(config.Settings); got != want {
		t.Errorf("checked %d defaults, but there are %d settings: add the new one here", got, want)
	}
	// Statements left empty take the reference schema's.
	if s := c.Statements(); s.Close != "" || s.Lookup != "" || s.Overdue != "" {
		t.Errorf("Statements() = %+v, want all empty (defaults)", s)
	}
}

func TestEnvApplies(t *testing.T) {
	tests := []struct {
		env, value string
		check      func(c config.Config) (got, want any)
	}{
		{"ORDERDELAY_REDIS_URL", "rediss://u:p@cache:6380/2", func(c config.Config) (any, any) { return c.RedisURL, "rediss://u:p@cache:6380/2" }},
		{"ORDERDELAY_REDIS_MODE", "cluster", func(c config.Config) (any, any) { return c.RedisMode, "cluster" }},
		{"ORDERDELAY_DATABASE_URL", "host=db dbname=shop sslmode=require", func(c config.Config) (any, any) { return c.DatabaseURL, "host=db dbname=shop sslmode=require" }},
		{"ORDERDELAY_QUEUE_KEY", "shop:orders", func(c config.Config) (any, any) { return c.QueueKey, "shop:orders" }},
		{"ORDERDELAY_QUEUE_SHARDS", "16", func(c config.Config) (any, any) { return c.QueueShards, 16 }},
		{"ORDERDELAY_SCAN_INTERVAL", "250ms", func(c config.Config) (any, any) { return c.ScanInterval, 250 * time.Millisecond }},
		{"ORDERDELAY_WORKERS", "16", func(c config.Config) (any, any) { return c.Workers, 16 }},
		{"ORDERDELAY_WORKERS", " 8 ", func(c config.Config) (any, any) { return c.Workers, 8 }},
		{"ORDERDELAY_BATCH_SIZE", "5000", func(c config.Config) (any, any) { return c.BatchSize, 5000 }},
		{"ORDERDELAY_LEASE", "2m", func(c config.Config) (any, any) { return c.Lease, 2 * time.Minute }},
		{"ORDERDELAY_STATEMENT_TIMEOUT", "3s", func(c config.Config) (any, any) { return c.StatementTimeout, 3 * time.Second }},
		{"ORDERDELAY_PREPARED_STATEMENTS", "false", func(c config.Config) (any, any) { return c.PreparedStatements, false }},
		{"ORDERDELAY_DRAIN_TIMEOUT", "1s", func(c config.Config) (any, any) { return c.DrainTimeout, time.Second }},
		{"ORDERDELAY_MAX_ATTEMPTS", "3", func(c config.Config) (any, any) { return c.MaxAttempts, 3 }},
		{"ORDERDELAY_BACKOFF_MAX", "30s", func(c config.Config) (any, any) { return c.BackoffMax, 30 * time.Second }},
		{"ORDERDELAY_RECONCILE_INTERVAL", "0", func(c config.Config) (any, any) { return c.ReconcileInterval, time.Duration(0) }},
		{"ORDERDELAY_RECONCILE_GRACE", "1h", func(c config.Config) (any, any) { return c.ReconcileGrace, time.Hour }},
		{"ORDERDELAY_HTTP_ADDR", "127.0.0.1:9000", func(c config.Config) (any, any) { return c.HTTPAddr, "127.0.0.1:9000" }},
		{"ORDERDELAY_HTTP_ADDR", "", func(c config.Config) (any, any) { return c.HTTPAddr, "" }},
		{"ORDERDELAY_PPROF_ADDR", "127.0.0.1:6060", func(c config.Config) (any, any) { return c.PprofAddr, "127.0.0.1:6060" }},
		{"ORDERDELAY_API_TOKEN", "0123456789abcdef, fedcba9876543210", func(c config.Config) (any, any) {
			return strings.Join(c.APITokens, "+"), "0123456789abcdef+fedcba9876543210"
		}},
		{"ORDERDELAY_LOG_LEVEL", "debug", func(c config.Config) (any, any) { return c.LogLevel, zapcore.DebugLevel }},
		{"ORDERDELAY_LOG_LEVEL", "error", func(c config.Config) (any, any) { return c.LogLevel, zapcore.ErrorLevel }},
		{"ORDERDELAY_LOG_FORMAT", "console", func(c config.Config) (any, any) { return c.LogFormat, "console" }},
		{"ORDERDELAY_CLOSE_SQL", "SELECT 1", func(c config.Config) (any, any) { return c.Statements().Close, "SELECT 1" }},
		{"ORDERDELAY_LOOKUP_SQL", "SELECT 2", func(c config.Config) (any, any) { return c.Statements().Lookup, "SELECT 2" }},
		{"ORDERDELAY_OVERDUE_SQL", "SELECT 3", func(c config.Config) (any, any) { return c.Statements().Overdue, "SELECT 3" }},
	}
	for _, tt := range tests {
		t.Run(tt.env+"="+tt.value, func(t *testing.T) {
			c := mustLoad(t, map[string]string{tt.env: tt.value})
			if got, want := tt.check(c); got != want {
				t.Errorf("%s=%q gave %v, want %v", tt.env, tt.value, got, want)
			}
		})
	}
}

func TestFlagWinsOverEnv(t *testing.T) {
	tests := []struct {
		name  string
		env   map[string]string
		args  []string
		check func(c config.Config) (got, want any)
	}{
		{"workers", map[string]string{"ORDERDELAY_WORKERS": "8"}, []string{"--workers", "16"},
			func(c config.Config) (any, any) { return c.Workers, 16 }},
		{"flag without env", nil, []string{"-batch-size=50"},
			func(c config.Config) (any, any) { return c.BatchSize, 50 }},
		{"env without flag", map[string]string{"ORDERDELAY_BATCH_SIZE": "70"}, []string{"--workers=2"},
			func(c config.Config) (any, any) { return c.BatchSize, 70 }},
		{"empty flag beats env", map[string]string{"ORDERDELAY_PPROF_ADDR": "127.0.0.1:6060"}, []string{"--pprof-addr="},
			func(c config.Config) (any, any) { return c.PprofAddr, "" }},
		{"queue key", map[string]string{"ORDERDELAY_QUEUE_KEY": "from:env"}, []string{"--queue-key", "from:flag"},
			func(c config.Config) (any, any) { return c.QueueKey, "from:flag" }},
		{"log level", map[string]string{"ORDERDELAY_LOG_LEVEL": "error"}, []string{"--log-level", "debug"},
			func(c config.Config) (any, any) { return c.LogLevel, zapcore.DebugLevel }},
		{"a good flag rescues a bad env", map[string]string{"ORDERDELAY_WORKERS": "many"}, []string{"--workers", "3"},
			func(c config.Config) (any, any) { return c.Workers, 3 }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := mustLoad(t, tt.env, tt.args...)
			if got, want := tt.check(c); got != want {
				t.Errorf("env %v, args %q: got %v, want %v", tt.env, tt.args, got, want)
			}
		})
	}
}

func TestBadFlagNamesSetting(t *testing.T) {
	_, err := load(t, map[string]string{"ORDERDELAY_WORKERS": "8"}, "--workers", "0")
	if err == nil || !strings.Contains(err.Error(), "ORDERDELAY_WORKERS") || !strings.Contains(err.Error(), "--workers") {
		t.Errorf("--workers 0: error = %v, want one naming ORDERDELAY_WORKERS and --workers", err)
	}
}

func TestFlagNames(t *testing.T) {
	seen := map[string]string{}
	for _, s := range config.Settings {
		want := strings.ReplaceAll(strings.ToLower(strings.TrimPrefix(s.Env, "ORDERDELAY_")), "_", "-")
		if got := s.Flag(); got != want {
			t.Errorf("%s.Flag() = %q, want %q", s.Env, got, want)
		}
		if other, dup := seen[s.Flag()]; dup {
			t.Errorf("%s and %s share the flag --%s", s.Env, other, s.Flag())
		}
		seen[s.Flag()] = s.Env
		if !strings.HasPrefix(s.Env, "ORDERDELAY_") || s.Help == "" {
			t.Errorf("setting %q: want an ORDERDELAY_ name and a help text", s.Env)
		}
	}
}

// TestBadValuesNameTheSetting: every refused value yields an error whose
// text names the variable concerned.
func TestBadValuesNameTheSetting(t *testing.T) {
	tests := []struct {
		env, value string
		extra      map[string]string // other settings needed to reach the check
	}{
		{"ORDERDELAY_WORKERS", "four", nil},
		{"ORDERDELAY_PREPARED_STATEMENTS", "maybe", nil},
		{"ORDERDELAY_PREPARED_STATEMENTS", "", nil},
		{"ORDERDELAY_WORKERS", "0", nil},
		{"ORDERDELAY_WORKERS", "-1", nil},
		{"ORDERDELAY_WORKERS", "257", nil},
		{"ORDERDELAY_WORKERS", "4.5", nil},
		{"ORDERDELAY_WORKERS", "", nil},
		{"ORDERDELAY_BATCH_SIZE", "0", nil},
		{"ORDERDELAY_BATCH_SIZE", "5001", nil},
		{"ORDERDELAY_BATCH_SIZE", "1e3", nil},
		{"ORDERDELAY_MAX_ATTEMPTS", "0", nil},
		{"ORDERDELAY_MAX_ATTEMPTS", "ten", nil},
		{"ORDERDELAY_SCAN_INTERVAL", "5", nil},
		{"ORDERDELAY_SCAN_INTERVAL", "five seconds", nil},
		{"ORDERDELAY_SCAN_INTERVAL", "1ms", nil},
		{"ORDERDELAY_SCAN_INTERVAL", "-5s", nil},
		{"ORDERDELAY_SCAN_INTERVAL", "2h", nil},
		{"ORDERDELAY_LEASE", "500ms", nil},
		{"ORDERDELAY_LEASE", "60", nil},
		{"ORDERDELAY_STATEMENT_TIMEOUT", "1ms", nil},
		{"ORDERDELAY_STATEMENT_TIMEOUT", "10x", nil},
		{"ORDERDELAY_DRAIN_TIMEOUT", "-1s", nil},
		{"ORDERDELAY_DRAIN_TIMEOUT", "0", nil}, // was silently 20s
		{"ORDERDELAY_DRAIN_TIMEOUT", "0s", nil},
		{"ORDERDELAY_BACKOFF_MAX", "0s", nil},
		{"ORDERDELAY_BACKOFF_MAX", "48h", nil},
		{"ORDERDELAY_RECONCILE_INTERVAL", "-1m", nil},
		{"ORDERDELAY_RECONCILE_INTERVAL", "1 minute", nil},
		{"ORDERDELAY_RECONCILE_GRACE", "0s", nil},
		{"ORDERDELAY_LOG_LEVEL", "verbose", nil},
		{"ORDERDELAY_LOG_LEVEL", "fatal", nil},
		{"ORDERDELAY_LOG_LEVEL", "panic", nil},
		{"ORDERDELAY_LOG_FORMAT", "text", nil},
		{"ORDERDELAY_LOG_FORMAT", "JSON", nil},
		{"ORDERDELAY_HTTP_ADDR", "8080", nil},
		{"ORDERDELAY_HTTP_ADDR", "localhost", nil},
		{"ORDERDELAY_HTTP_ADDR", "127.0.0.1:", nil},
		{"ORDERDELAY_PPROF_ADDR", "6060", nil},
		{"ORDERDELAY_API_TOKEN", "short", nil},
		{"ORDERDELAY_API_TOKEN", "0123456789abcdef,short", nil},
		{"ORDERDELAY_API_TOKEN", "0123456789abcdef,", nil},
		{"ORDERDELAY_QUEUE_KEY", "{delaytask}:order", nil},
		{"ORDERDELAY_QUEUE_KEY", "delay task", nil},
		{"ORDERDELAY_QUEUE_KEY", "", nil},
		{"ORDERDELAY_QUEUE_SHARDS", "0", nil},
		{"ORDERDELAY_QUEUE_SHARDS", "1025", nil},
		{"ORDERDELAY_QUEUE_SHARDS", "four", nil},
		{"ORDERDELAY_REDIS_MODE", "replicated", nil},
		{"ORDERDELAY_REDIS_MODE", "", nil},
		{"ORDERDELAY_REDIS_URL", "localhost:6379", nil},
		{"ORDERDELAY_REDIS_URL", "http://127.0.0.1:6379", nil},
		{"ORDERDELAY_REDIS_URL", "redis://127.0.0.1:6379/abc", nil},
		{"ORDERDELAY_REDIS_URL", "redis://127.0.0.1:port", nil},
		{"ORDERDELAY_REDIS_URL", "redis://127.0.0.1:26379", map[string]string{"ORDERDELAY_REDIS_MODE": "sentinel"}},
		{"ORDERDELAY_REDIS_URL", "http://127.0.0.1:26379?master_name=m", map[string]string{"ORDERDELAY_REDIS_MODE": "sentinel"}},
		{"ORDERDELAY_REDIS_URL", "http://node1:6379", map[string]string{"ORDERDELAY_REDIS_MODE": "cluster"}},
		{"ORDERDELAY_DATABASE_URL", "mysql://127.0.0.1/orders", nil},
		{"ORDERDELAY_DATABASE_URL", "postgres://127.0.0.1:port/orders", nil},
		{"ORDERDELAY_DATABASE_URL", "postgres://127.0.0.1/orders?sslmode=sometimes", nil},
		{"ORDERDELAY_DATABASE_URL", "host=db port='5432", nil},
	}
	for _, tt := range tests {
		t.Run(tt.env+"="+tt.value, func(t *testing.T) {
			env := map[string]string{tt.env: tt.value}
			for k, v := range tt.extra {
				env[k] = v
			}
			_, err := load(t, env)
			if err == nil {
				t.Fatalf("%s=%q accepted, want an error", tt.env, tt.value)
			}
			if !strings.Contains(err.Error(), tt.env) {
				t.Errorf("%s=%q: error %q does not name %s", tt.env, tt.value, err, tt.env)
			}
			var ce *config.Error
			if !errors.As(err, &ce) || !strings.Contains(ce.Setting, tt.env) {
				t.Errorf("%s=%q: error %v is not a *config.Error for the setting", tt.env, tt.value, err)
			}
			if tt.env == "ORDERDELAY_API_TOKEN" && strings.Contains(err.Error(), "0123456789abcdef") {
				t.Errorf("error %q shows a token", err)
			}
		})
	}
}

func TestAllBadSettingsReported(t *testing.T) {
	_, err := load(t, map[string]string{"ORDERDELAY_WORKERS": "0", "ORDERDELAY_BATCH_SIZE": "0", "ORDERDELAY_LOG_FORMAT": "xml"})
	for _, env := range []string{"ORDERDELAY_WORKERS", "ORDERDELAY_BATCH_SIZE", "ORDERDELAY_LOG_FORMAT"} {
		if err == nil || !strings.Contains(err.Error(), env) {
			t.Errorf("error %v does not name %s", err, env)
		}
	}
}

func TestCombinations(t *testing.T) {
	tests := []struct {
		name string
		env  map[string]string
		want string // the setting named; empty: accepted
	}{
		{"statement timeout equal to lease", map[string]string{"ORDERDELAY_STATEMENT_TIMEOUT": "60s"}, "ORDERDELAY_STATEMENT_TIMEOUT"},
		{"statement timeout above lease", map[string]string{"ORDERDELAY_LEASE": "5s", "ORDERDELAY_STATEMENT_TIMEOUT": "10s", "ORDERDELAY_DRAIN_TIMEOUT": "1s"}, "ORDERDELAY_STATEMENT_TIMEOUT"},
		{"statement timeout just below lease", map[string]string{"ORDERDELAY_STATEMENT_TIMEOUT": "59s"}, ""},
		{"drain equal to lease", map[string]string{"ORDERDELAY_DRAIN_TIMEOUT": "60s"}, "ORDERDELAY_DRAIN_TIMEOUT"},
		{"drain above lease", map[string]string{"ORDERDELAY_DRAIN_TIMEOUT": "2m"}, "ORDERDELAY_DRAIN_TIMEOUT"},
		{"grace equal to lease", map[string]string{"ORDERDELAY_RECONCILE_GRACE": "60s"}, "ORDERDELAY_RECONCILE_GRACE"},
		{"grace below lease", map[string]string{"ORDERDELAY_RECONCILE_GRACE": "30s"}, "ORDERDELAY_RECONCILE_GRACE"},
		{"lease raised above grace", map[string]string{"ORDERDELAY_LEASE": "10m"}, "ORDERDELAY_RECONCILE_GRACE"},
		{"short grace with the reconciler off", map[string]string{"ORDERDELAY_RECONCILE_GRACE": "30s", "ORDERDELAY_RECONCILE_INTERVAL": "0"}, ""},
		{"pprof on the http port", map[string]string{"ORDERDELAY_PPROF_ADDR": ":8080"}, "ORDERDELAY_PPROF_ADDR"},
		{"pprof on the http address", map[string]string{"ORDERDELAY_PPROF_ADDR": "127.0.0.1:8080"}, "ORDERDELAY_PPROF_ADDR"},
		{"pprof on another loopback address, same port", map[string]string{"ORDERDELAY_PPROF_ADDR": "127.0.0.2:8080"}, ""},
		{"pprof elsewhere", map[string]string{"ORDERDELAY_PPROF_ADDR": "127.0.0.1:6060"}, ""},
		{"both off", map[string]string{"ORDERDELAY_HTTP_ADDR": "", "ORDERDELAY_PPROF_ADDR": ""}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := load(t, tt.env)
			if tt.want == "" {
				if err != nil {
					t.Fatalf("env %v: %v, want accepted", tt.env, err)
				}
				return
			}
			if err == nil {
				t.Fatalf("env %v accepted, want an error naming %s", tt.env, tt.want)
			}
			var ce *config.Error
			if !errors.As(err, &ce) || ce.Setting != tt.want {
				t.Errorf("env %v: error %v, want a *config.Error for %s", tt.env, err, tt.want)
			}
		})
	}
}

const secret = "s3cret"

// TestPasswordsNeverShown: no error, Mask or Redact output contains a
// password, whatever form the connection string takes.
func TestPasswordsNeverShown(t *testing.T) {
	tests := []struct {
		env, value string
		mode       string
	}{
		{"ORDERDELAY_REDIS_URL", "redis://u:" + secret + "@h:port", ""},
		{"ORDERDELAY_REDIS_URL", "redis://u:" + secret + "@h:6379/abc", ""},
		{"ORDERDELAY_REDIS_URL", "http://u:" + secret + "@h:6379", ""},
		{"ORDERDELAY_REDIS_URL", "redis://u:" + secret + "%zz@h:6379", ""},
		{"ORDERDELAY_REDIS_URL", "redis://u:" + secret + "@[::1/0", ""},
		{"ORDERDELAY_REDIS_URL", "redis://:" + secret + "@h:6379/x", ""},
		{"ORDERDELAY_REDIS_URL", "redis://u:" + secret + "@h:26379", "sentinel"},
		{"ORDERDELAY_REDIS_URL", "redis://u:" + secret + "@h:port?master_name=m", "sentinel"},
		{"ORDERDELAY_REDIS_URL", "http://u:" + secret + "@h:6379", "cluster"},
		{"ORDERDELAY_DATABASE_URL", "postgres://u:" + secret + "@h:bad/db", ""},
		{"ORDERDELAY_DATABASE_URL", "postgres://u:" + secret + "%zz@h/db", ""},
		{"ORDERDELAY_DATABASE_URL", "postgres://u:" + secret + "@h/db?sslmode=bogus", ""},
		{"ORDERDELAY_DATABASE_URL", "postgres://h/db?password=" + secret + "&sslmode=bogus", ""},
		{"ORDERDELAY_DATABASE_URL", "mysql://u:" + secret + "@h/db", ""},
		{"ORDERDELAY_DATABASE_URL", "host=h password=" + secret + " sslmode=bogus", ""},
		{"ORDERDELAY_DATABASE_URL", "host=h password='" + secret + " x' port='", ""},
		{"ORDERDELAY_DATABASE_URL", "host=h PASSWORD = " + secret + " sslmode=bogus", ""},
	}
	for _, tt := range tests {
		t.Run(tt.env+"="+tt.value, func(t *testing.T) {
			env := map[string]string{tt.env: tt.value}
			if tt.mode != "" {
				env["ORDERDELAY_REDIS_MODE"] = tt.mode
			}
			_, err := load(t, env)
			if err == nil {
				t.Fatalf("%s=%q accepted, want an error", tt.env, tt.value)
			}
			if strings.Contains(err.Error(), secret) {
				t.Errorf("error %q contains the password", err)
			}
			if !strings.Contains(err.Error(), tt.env) {
				t.Errorf("error %q does not name %s", err, tt.env)
			}
			if got := config.Mask(tt.value); strings.Contains(got, secret) {
				t.Errorf("Mask(%q) = %q, which contains the password", tt.value, got)
			}
			msg := "dial " + tt.value + ": connection refused"
			if got := config.Redact(msg, tt.value); strings.Contains(got, secret) {
				t.Errorf("Redact(%q) = %q, which contains the password", msg, got)
			}
		})
	}
}

func TestMask(t *testing.T) {
	tests := []struct{ in, want string }{
		{"redis://u:" + secret + "@h:6379", "redis://u:xxxxx@h:6379"},
		{"rediss://:" + secret + "@h:6380/1", "rediss://:xxxxx@h:6380/1"},
		{"postgres://u:" + secret + "@h/db", "postgres://u:xxxxx@h/db"},
		{"postgres://u:" + secret + "@h/db?sslmode=disable", "postgres://u:xxxxx@h/db?sslmode=disable"},
		{"redis://:x@h:6379?password=" + secret, "redis://:xxxxx@h:6379?password=xxxxx"},
		{"host=h password=" + secret + " dbname=shop", "host=h password=xxxxx dbname=shop"},
		{"host=h password='" + secret + " with spaces' dbname=shop", "host=h password=xxxxx dbname=shop"},
		// Nothing to hide: unchanged.
		{"redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"},
		{"redis://u@h:6379", "redis://u@h:6379"},
		{"postgres://127.0.0.1:5432/orderdelay?sslmode=disable", "postgres://127.0.0.1:5432/orderdelay?sslmode=disable"},
		{"host=h dbname=shop", "host=h dbname=shop"},
		{"", ""},
	}
	for _, tt := range tests {
		if got := config.Mask(tt.in); got != tt.want {
			t.Errorf("Mask(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func TestRedact(t *testing.T) {
	tests := []struct {
		msg   string
		conns []string
		want  string
	}{
		{"auth " + secret + " failed", []string{"redis://u:" + secret + "@h"}, "auth xxxxx failed"},
		{"auth " + secret + " failed", []string{"redis://u:" + secret + "@h:port"}, "auth xxxxx failed"},
		{"bad: password=" + secret, nil, "bad: password=xxxxx"},
		{"p=a%2Fb", []string{"redis://u:a%2Fb@h"}, "p=xxxxx"},
		{"nothing secret here", []string{"redis://h:6379", "host=h"}, "nothing secret here"},
	}
	for _, tt := range tests {
		if got := config.Redact(tt.msg, tt.conns...); got != tt.want {
			t.Errorf("Redact(%q, %q) = %q, want %q", tt.msg, tt.conns, got, tt.want)
		}
	}
}

func repoFile(name string) string { return filepath.Join("..", "..", name) }

// TestSettingsGolden keeps testdata/settings.txt (read by the deploy checks
// and docs) equal to the settings the code knows.
func TestSettingsGolden(t *testing.T) {
	b, err := os.ReadFile(repoFile("testdata/settings.txt"))
	if err != nil {
		t.Fatal(err)
	}
	got := strings.Fields(string(b))
	var want []string
	for _, s := range config.Settings {
		want = append(want, s.Env)
	}
	slices.Sort(want)
	if os.Getenv("ORDERDELAY_UPDATE_GOLDEN") == "1" && !slices.Equal(got, want) {
		if err := os.WriteFile(repoFile("testdata/settings.txt"), []byte(strings.Join(want, "\n")+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		got = want
	}
	if !slices.Equal(got, want) {
		var diff strings.Builder
		for _, w := range want {
			if !slices.Contains(got, w) {
				fmt.Fprintf(&diff, "+ %s\n", w)
			}
		}
		for _, g := range got {
			if !slices.Contains(want, g) {
				fmt.Fprintf(&diff, "- %s\n", g)
			}
		}
		if diff.Len() == 0 {
			diff.WriteString("(same names, different order or duplicates: the file must be sorted)\n")
		}
		t.Errorf("testdata/settings.txt differs from config.Settings (- in the file only, + in the code only):\n%s"+
			"regenerate it with the sorted env names of config.Settings", diff.String())
	}
}

const (
	readmeMarker    = "<!-- config-table -->"
	readmeEndMarker = "<!-- end config-table -->"
)

// TestReadmeTable: the README's configuration tables are config.Markdown(),
// between the marker lines. ORDERDELAY_UPDATE_GOLDEN=1 rewrites them.
func TestReadmeTable(t *testing.T) {
	b, err := os.ReadFile(repoFile("README.md"))
	if errors.Is(err, os.ErrNotExist) {
		t.Skip("README.md does not exist yet; when it does, put " + readmeMarker + " and " + readmeEndMarker + " around the configuration table")
	}
	if err != nil {
		t.Fatal(err)
	}
	readme := strings.ReplaceAll(string(b), "\r\n", "\n")
	before, rest, found := strings.Cut(readme, readmeMarker+"\n")
	if !found {
		t.Skip("README.md has no line " + readmeMarker + "; add it before the configuration table to have this test check it")
	}
	got, after, found := strings.Cut(rest, readmeEndMarker)
	if !found {
		t.Fatalf("README.md has %s but no %s after it", readmeMarker, readmeEndMarker)
	}
	want := config.Markdown()
	if os.Getenv("ORDERDELAY_UPDATE_GOLDEN") == "1" && got != want+"\n" {
		updated := before + readmeMarker + "\n" + want + "\n" + readmeEndMarker + after
		if err := os.WriteFile(repoFile("README.md"), []byte(updated), 0o644); err != nil {
			t.Fatal(err)
		}
		got = want + "\n"
	}
	if got != want+"\n" { // a blank line before the end marker ends the last table
		t.Errorf("README.md's tables between %s and %s are\n%s\nwant config.Markdown() and a blank line:\n%s\n"+
			"(ORDERDELAY_UPDATE_GOLDEN=1 go test -run TestReadmeTable ./internal/config rewrites them)", readmeMarker, readmeEndMarker, got, want)
	}
}

// TestMarkdown: one table per group, in order, with a row per setting of
// the group in table order, each with the five columns.
func TestMarkdown(t *testing.T) {
	md := config.Markdown()
	var rows []string
	for _, line := range strings.Split(md, "\n") {
		if strings.HasPrefix(line, "| `") {
			rows = append(rows, line)
		}
	}
	var want []config.Setting
	for _, g := range config.Groups {
		if !strings.Contains(md, "**"+string(g)+"**: "+g.About()+"\n\n| variable | flag | type | default | meaning |\n") {
			t.Errorf("Markdown has no table headed %q", g)
		}
		for _, s := range config.Settings {
			if s.Group == g {
				want = append(want, s)
			}
		}
	}
	if len(rows) != len(config.Settings) || len(want) != len(config.Settings) {
		t.Fatalf("Markdown has %d rows, %d settings are in a group, want %d (every setting once)", len(rows), len(want), len(config.Settings))
	}
	for i, s := range want {
		line := rows[i]
		if prefix := "| `" + s.Env + "` | `--" + s.Flag() + "` | " + s.Kind.String() + " | "; !strings.HasPrefix(line, prefix) {
			t.Errorf("row %d = %q, want it to start with %q", i, line, prefix)
		}
		// Every row has exactly the table's five columns: pipes in help
		// texts are escaped.
		if got := strings.Count(strings.ReplaceAll(line, `\|`, ""), "|"); got != 6 {
			t.Errorf("row %d has %d unescaped pipes, want 6: %q", i, got, line)
		}
	}
}

// FuzzConfig feeds arbitrary strings into each setting's variable. Load must
// not panic, and every error it returns must be a *config.Error naming a
// setting.
func FuzzConfig(f *testing.F) {
	for _, s := range []string{"", "0", "-1", "5s", "1e9", "redis://u:p@h:1", "host=h password=x", ":8080", "{x}", "\x00", "9223372036854775807ns", "%zz", "redis://[::1"} {
		f.Add(s)
	}
	names := map[string]bool{}
	for _, s := range config.Settings {
		names[s.Env] = true
	}
	f.Fuzz(func(t *testing.T, v string) {
		for _, s := range config.Settings {
			_, err := load(t, map[string]string{s.Env: v})
			if err == nil {
				continue
			}
			var errs []error
			if j, ok := err.(interface{ Unwrap() []error }); ok {
				errs = j.Unwrap()
			} else {
				errs = []error{err}
			}
			for _, e := range errs {
				var ce *config.Error
				if !errors.As(e, &ce) {
					t.Fatalf("%s=%q: error %v (%T) is not a *config.Error", s.Env, v, e, e)
				}
				env, _, _ := strings.Cut(ce.Setting, " ")
				if !names[env] || !strings.Contains(e.Error(), env) {
					t.Fatalf("%s=%q: error %q names no setting", s.Env, v, e)
				}
			}
		}
		config.Mask(v)
		config.Redact(v, v)
	})
}

// FuzzMask: a password of letters and digits never survives Mask in any of
// the usual connection-string forms.
func FuzzMask(f *testing.F) {
	f.Add("s3cret")
	f.Add("postgres")
	forms := []string{"redis://u:%s@h:6379", "redis://:%s@h:6379/0", "postgres://u:%s@h/db", "postgres://u:%s@h:bad/db",
		"redis://u:%s@h:port", "host=h password=%s dbname=x", "host=h password='%s' dbname=x", "postgres://h/db?password=%s"}
	f.Fuzz(func(t *testing.T, pass string) {
		if len(pass) < 6 || strings.ContainsFunc(pass, func(r rune) bool {
			return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9')
		}) {
			t.Skip()
		}
		for _, form := range forms {
			in := fmt.Sprintf(form, pass)
			got := config.Mask(in)
			// The password may coincide with other text ("postgres"); then
			// the output must be the form with the password masked.
			if strings.Contains(got, pass) && got != fmt.Sprintf(form, "xxxxx") &&
				strings.Count(got, pass) >= strings.Count(in, pass) {
				t.Fatalf("Mask(%q) = %q, which still contains the password", in, got)
			}
		}
	})
}

// A password in a URL's query is hidden without dropping the other
// parameters (a Sentinel URL's addr= list must stay readable in logs).
func TestMaskKeepsOtherQueryParameters(t *testing.T) {
	got := config.Mask("redis://sentinel:26379?master_name=m&password=s3cret&addr=s2:26379")
	if strings.Contains(got, "s3cret") || !strings.Contains(got, "addr=s2%3A26379") || !strings.Contains(got, "master_name=m") {
		t.Fatalf("Mask = %q", got)
	}
}

// TestDefaultsGolden keeps testdata/defaults.txt — NAME=default per
// setting, read by the deploy checks (a module of their own, which cannot
// import this one) — equal to the defaults the code has, so those checks
// never write a default again. ORDERDELAY_UPDATE_GOLDEN=1 rewrites it.
func TestDefaultsGolden(t *testing.T) {
	const path = "testdata/defaults.txt"
	var want strings.Builder
	want.WriteString("# Generated from internal/config.Settings (TestDefaultsGolden): NAME=default.\n")
	for _, s := range config.Settings {
		fmt.Fprintf(&want, "%s=%s\n", s.Env, s.Default)
	}
	b, err := os.ReadFile(repoFile(path))
	if os.Getenv("ORDERDELAY_UPDATE_GOLDEN") == "1" && string(b) != want.String() {
		if err := os.WriteFile(repoFile(path), []byte(want.String()), 0o644); err != nil {
			t.Fatal(err)
		}
		b, err = []byte(want.String()), nil
	}
	if err != nil {
		t.Fatal(err)
	}
	if string(b) != want.String() {
		t.Errorf("%s is\n%s\nwant\n%s(regenerate with ORDERDELAY_UPDATE_GOLDEN=1 go test -run TestDefaultsGolden ./internal/config)", path, b, want.String())
	}
}
