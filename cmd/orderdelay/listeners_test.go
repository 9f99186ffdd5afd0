package main

import (
	"bytes"
	"context"
	"errors"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/orderdelay/orderdelay/internal/config"
	"github.com/orderdelay/orderdelay/internal/httpapi"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

const (
	listenAPIToken   = "api-token-0123456789abcdef"
	listenAdminToken = "admin-token-0123456789abcdef"
)

// unreachable points the daemon at servers that do not answer: a start
// refused in protected mode must not need them.
var unreachable = map[string]string{
	"ORDERDELAY_REDIS_URL":    "redis://127.0.0.1:1/0",
	"ORDERDELAY_DATABASE_URL": "postgres://127.0.0.1:1/orderdelay?sslmode=disable",
}

func envOf(m ...map[string]string) func(string) (string, bool) {
	all := map[string]string{}
	for _, e := range m {
		for k, v := range e {
			all[k] = v
		}
	}
	return func(k string) (string, bool) { v, ok := all[k]; return v, ok }
}

// TestRunRefusedInProtectedMode: `orderdelay run` exits 2 when /v1 would
// listen beyond loopback without a token, or on a malformed setting of the
// listeners, naming what to set, before it binds or connects anything.
func TestRunRefusedInProtectedMode(t *testing.T) {
	tests := []struct {
		name string
		env  map[string]string
		says []string
	}{
		{"wildcard, no token", map[string]string{"ORDERDELAY_HTTP_ADDR": ":8080"},
			[]string{"ORDERDELAY_API_TOKEN", "ORDERDELAY_HTTP_ADDR", "ORDERDELAY_API_AUTH=none", "protected mode"}},
		{"all interfaces, no token", map[string]string{"ORDERDELAY_HTTP_ADDR": "0.0.0.0:8080"},
			[]string{"ORDERDELAY_API_TOKEN", "ORDERDELAY_HTTP_ADDR", "ORDERDELAY_API_AUTH=none"}},
		{"invalid auth value", map[string]string{"ORDERDELAY_API_AUTH": "off"},
			[]string{"ORDERDELAY_API_AUTH", "want token or none"}},
		{"auth none with a token", map[string]string{"ORDERDELAY_API_AUTH": "none", "ORDERDELAY_API_TOKEN": listenAPIToken},
			[]string{"ORDERDELAY_API_AUTH", "ORDERDELAY_API_TOKEN"}},
		{"admin address malformed", map[string]string{"ORDERDELAY_ADMIN_TOKEN": listenAdminToken, "ORDERDELAY_ADMIN_ADDR": "8081"},
			[]string{"ORDERDELAY_ADMIN_ADDR", "host:port"}},
		{"admin on the API port", map[string]string{"ORDERDELAY_ADMIN_TOKEN": listenAdminToken, "ORDERDELAY_ADMIN_ADDR": "127.0.0.1:8080"},
			[]string{"ORDERDELAY_ADMIN_ADDR", "ORDERDELAY_HTTP_ADDR"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			code := run(t.Context(), []string{"run"}, &stdout, &stderr, envOf(unreachable, tt.env))
			if code != 2 {
				t.Fatalf("exit %d, want 2; stderr:\n%s", code, stderr.String())
			}
			for _, s := range tt.says {
				if !strings.Contains(stderr.String(), s) {
					t.Errorf("stderr does not say %q:\n%s", s, stderr.String())
				}
			}
			// Refused before anything is started, so nothing says it starts.
			if out := stdout.String() + stderr.String(); strings.Contains(out, "starting orderdelay") {
				t.Errorf("a refused start logged \"starting orderdelay\" first:\n%s", out)
			}
			if strings.Contains(stderr.String(), listenAPIToken) || strings.Contains(stderr.String(), listenAdminToken) {
				t.Errorf("stderr shows a token:\n%s", stderr.String())
			}
		})
	}
}

// listenersFor binds openListeners for env, closing them at the end.
func listenersFor(t *testing.T, env map[string]string) ([]listener, *observer.ObservedLogs, error) {
	t.Helper()
	cfg, _, err := parse("run", nil, testWriter{t}, envOf(unreachable, env), nil)
	if err != nil {
		t.Fatalf("config: %v", err)
	}
	core, logs := observer.New(zapcore.InfoLevel)
	reg := prometheus.NewRegistry()
	api := httpapi.New(httpapi.Config{Tokens: cfg.APITokens}, nil, metrics.New(reg, "t", "t"), reg, zap.NewNop())
	if len(cfg.AdminTokens) > 0 {
		api.EnableAdmin(httpapi.AdminConfig{Tokens: cfg.AdminTokens})
	}
	ls, err := openListeners(cfg, api, zap.New(core), nil)
	t.Cleanup(func() {
		for _, l := range ls {
			l.ln.Close()
		}
	})
	return ls, logs, err
}

// TestListenersMatrix: which listeners the daemon binds, and what each
// serves, for each auth mode.
func TestListenersMatrix(t *testing.T) {
	t.Run("loopback without a token: protected mode", func(t *testing.T) {
		ls, logs, err := listenersFor(t, map[string]string{"ORDERDELAY_HTTP_ADDR": "127.0.0.1:0"})
		if err != nil {
			t.Fatal(err)
		}
		if len(ls) != 1 || ls[0].what != "http" {
			t.Fatalf("listeners %v, want http only (no admin token: no admin listener)", names(ls))
		}
		if logs.FilterMessageSnippet("protected mode").Len() != 1 {
			t.Errorf("no info line about protected mode: %v", logs.All())
		}
		if logs.FilterLevelExact(zapcore.WarnLevel).Len() != 0 {
			t.Errorf("warnings in protected mode: %v", logs.All())
		}
	})
	t.Run("localhost without a token", func(t *testing.T) {
		ls, _, err := listenersFor(t, map[string]string{"ORDERDELAY_HTTP_ADDR": "localhost:0"})
		if err != nil {
			t.Fatal(err)
		}
		if a := ls[0].ln.Addr().(*net.TCPAddr); !a.IP.IsLoopback() {
			t.Errorf("bound %s", a)
		}
	})
	t.Run("all interfaces with a token, admin apart", func(t *testing.T) {
		ls, logs, err := listenersFor(t, map[string]string{"ORDERDELAY_HTTP_ADDR": ":0", "ORDERDELAY_API_TOKEN": listenAPIToken,
			"ORDERDELAY_ADMIN_TOKEN": listenAdminToken, "ORDERDELAY_ADMIN_ADDR": "127.0.0.1:0"})
		if err != nil {
			t.Fatal(err)
		}
		if got := names(ls); got != "http,admin" {
			t.Fatalf("listeners %s, want http,admin", got)
		}
		if a := ls[1].ln.Addr().(*net.TCPAddr); !a.IP.IsLoopback() {
			t.Errorf("admin listener on %s, want loopback", a)
		}
		if logs.FilterLevelExact(zapcore.WarnLevel).Len() != 0 || logs.FilterMessageSnippet("protected mode").Len() != 0 {
			t.Errorf("a token is configured, yet: %v", logs.All())
		}
	})
	t.Run("all interfaces, auth none: starts and warns", func(t *testing.T) {
		ls, logs, err := listenersFor(t, map[string]string{"ORDERDELAY_HTTP_ADDR": ":0", "ORDERDELAY_API_AUTH": "none"})
		if err != nil {
			t.Fatal(err)
		}
		if got := names(ls); got != "http" {
			t.Fatalf("listeners %s, want http", got)
		}
		w := logs.FilterLevelExact(zapcore.WarnLevel).FilterMessageSnippet("ORDERDELAY_API_AUTH=none").All()
		if len(w) != 1 {
			t.Errorf("want one warning naming ORDERDELAY_API_AUTH=none, got %v", logs.All())
		}
	})
	t.Run("all interfaces without a token: refused, nothing bound", func(t *testing.T) {
		ls, _, err := listenersFor(t, map[string]string{"ORDERDELAY_HTTP_ADDR": ":0", "ORDERDELAY_PPROF_ADDR": "127.0.0.1:0"})
		var ue usageError
		var ce *config.Error
		if !errors.As(err, &ue) || !errors.As(err, &ce) || ce.Setting != "ORDERDELAY_HTTP_ADDR" {
			t.Fatalf("err %v, want a usage error for ORDERDELAY_HTTP_ADDR", err)
		}
		if len(ls) != 0 {
			t.Errorf("listeners %s left bound", names(ls))
		}
	})
	t.Run("admin port taken: nothing left bound", func(t *testing.T) {
		taken, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer taken.Close()
		ls, _, err := listenersFor(t, map[string]string{"ORDERDELAY_HTTP_ADDR": "127.0.0.1:0",
			"ORDERDELAY_ADMIN_TOKEN": listenAdminToken, "ORDERDELAY_ADMIN_ADDR": taken.Addr().String()})
		if err == nil || !strings.Contains(err.Error(), "admin listener") {
			t.Fatalf("err %v, want the admin listener's bind error", err)
		}
		var ue usageError
		if errors.As(err, &ue) {
			t.Errorf("a taken port is not a usage error (exit 1, not 2): %v", err)
		}
		if len(ls) != 0 {
			t.Errorf("listeners %s left bound", names(ls))
		}
	})
}

func names(ls []listener) string {
	var n []string
	for _, l := range ls {
		n = append(n, l.what)
	}
	return strings.Join(n, ",")
}

// TestDaemonServesAdminApart starts the daemon (real Redis and PostgreSQL)
// with a token on all interfaces and the admin API on its own listener:
// /metrics and the probes answer without a token, /v1 wants one, the admin
// API is on the admin listener and not on the API's.
func TestDaemonServesAdminApart(t *testing.T) {
	_, keys := testenv.Redis(t)
	_, dsn := testenv.Postgres(t)
	env := map[string]string{
		"ORDERDELAY_REDIS_URL": testenv.RedisURL(), "ORDERDELAY_DATABASE_URL": dsn, "ORDERDELAY_QUEUE_KEY": keys.Queue,
		"ORDERDELAY_HTTP_ADDR": ":0", "ORDERDELAY_API_TOKEN": listenAPIToken,
		"ORDERDELAY_ADMIN_TOKEN": listenAdminToken, "ORDERDELAY_ADMIN_ADDR": "127.0.0.1:0",
	}
	cfg, _, err := parse("run", nil, testWriter{t}, envOf(env), nil)
	if err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zapcore.InfoLevel)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	started := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		done <- runDaemon(ctx, cfg, zap.New(core), daemonOptions{started: func(ctx context.Context, _ *daemon) {
			close(started)
			<-ctx.Done()
		}})
	}()
	select {
	case <-started:
	case err := <-done:
		t.Fatalf("daemon stopped: %v", err)
	case <-time.After(60 * time.Second):
		t.Fatal("the daemon never started")
	}
	addr := map[string]string{}
	for _, e := range logs.FilterMessage("listening").All() {
		_, port, _ := net.SplitHostPort(e.ContextMap()["addr"].(string))
		addr[e.ContextMap()["what"].(string)] = "http://127.0.0.1:" + port
	}
	if addr["http"] == "" || addr["admin"] == "" {
		t.Fatalf("listening on %v, want http and admin", addr)
	}
	get := func(url, token string) int {
		t.Helper()
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, c := range []struct {
		url, token string
		want       int
	}{
		{addr["http"] + "/metrics", "", 200},
		{addr["http"] + "/healthz", "", 200},
		{addr["http"] + "/readyz", "", 200},
		{addr["http"] + "/v1/timeouts/ORD-1", "", 401},
		{addr["http"] + "/v1/timeouts/ORD-1", listenAPIToken, 404},
		{addr["http"] + "/admin/v1/pause", listenAdminToken, 404},
		{addr["admin"] + "/admin/v1/pause", listenAdminToken, 200},
		{addr["admin"] + "/admin/v1/pause", listenAPIToken, 401},
		{addr["admin"] + "/metrics", "", 404},
	} {
		if got := get(c.url, c.token); got != c.want {
			t.Errorf("GET %s (token %t): %d, want %d", c.url, c.token != "", got, c.want)
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("runDaemon: %v", err)
	}
}

// TestExtendBoundedBeforeConnecting: `orderdelay extend` refuses a window
// plus extension past the queue's furthest deadline (exit 2, naming the
// bound) before it connects to anything; it used to move orders out of
// range, to be dead-lettered.
func TestExtendBoundedBeforeConnecting(t *testing.T) {
	for _, args := range [][]string{
		{"extend", "--within", "1h", "--by", "100000h"},
		{"extend", "--within", "87600h", "--by", "1m"},
	} {
		var stdout, stderr bytes.Buffer
		if code := run(t.Context(), args, &stdout, &stderr, envOf(unreachable)); code != 2 {
			t.Errorf("%q: exit %d, want 2; stderr:\n%s", args, code, stderr.String())
		}
		if !strings.Contains(stderr.String(), "87600h") {
			t.Errorf("%q: stderr does not name the bound (87600h):\n%s", args, stderr.String())
		}
	}
}

func TestMetricsURL(t *testing.T) {
	for addr, want := range map[string]string{
		"127.0.0.1:8080": "http://127.0.0.1:8080/metrics",
		":8080":          "http://localhost:8080/metrics",
		"0.0.0.0:9000":   "http://localhost:9000/metrics",
		"[::1]:8080":     "http://[::1]:8080/metrics",
		"":               "",
	} {
		if got := metricsURL(addr); got != want {
			t.Errorf("metricsURL(%q) = %q, want %q", addr, got, want)
		}
	}
}

// TestAPIAuthMode: what the start line says about /v1's auth (it said only
// true or false, so protected mode and an explicit none looked alike).
func TestAPIAuthMode(t *testing.T) {
	for _, c := range []struct {
		env  map[string]string
		want string
	}{
		{map[string]string{}, "protected"},
		{map[string]string{"ORDERDELAY_API_TOKEN": listenAPIToken, "ORDERDELAY_HTTP_ADDR": ":8080"}, "token"},
		{map[string]string{"ORDERDELAY_API_AUTH": "none", "ORDERDELAY_HTTP_ADDR": ":8080"}, "none"},
		{map[string]string{"ORDERDELAY_HTTP_ADDR": ""}, "off"},
	} {
		cfg, _, err := parse("run", nil, testWriter{t}, envOf(unreachable, c.env), nil)
		if err != nil {
			t.Fatal(err)
		}
		if got := apiAuthMode(cfg); got != c.want {
			t.Errorf("env %v: apiAuthMode = %q, want %q", c.env, got, c.want)
		}
	}
}
