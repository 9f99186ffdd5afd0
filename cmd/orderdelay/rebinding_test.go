package main

import (
	"context"
	"errors"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// serveListener serves l until the test ends and returns its port.
func serveListener(t *testing.T, l listener) string {
	t.Helper()
	srv := &http.Server{Handler: l.h, ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(l.ln) //nolint:errcheck // ends with ErrServerClosed at cleanup
	t.Cleanup(func() { srv.Close() })
	_, port, _ := net.SplitHostPort(l.ln.Addr().String())
	return port
}

// hostStatus sends GET path to port on 127.0.0.1 with the Host header
// host, and returns the status and Content-Type.
func hostStatus(t *testing.T, port, host, path string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://127.0.0.1:"+port+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Host = host
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode, resp.Header.Get("Content-Type")
}

// TestProtectedModeRefusesOtherHostNames: in protected mode /v1 takes no
// token because only this machine reaches the loopback listener, but a web
// page can: DNS rebinding points the page's own name at 127.0.0.1, and the
// browser then reads and writes /v1 as the page's same origin. Such a
// request names the page's host in Host, so in protected mode the listener
// answers only requests addressed to localhost or a loopback IP (421
// otherwise). With a token, or auth switched off, any name is served.
func TestProtectedModeRefusesOtherHostNames(t *testing.T) {
	ls, _, err := listenersFor(t, map[string]string{"ORDERDELAY_HTTP_ADDR": "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	port := serveListener(t, ls[0])
	for _, host := range []string{"rebind.example:" + port, "rebind.example", "127.0.0.1.nip.io:" + port,
		"localhost.rebind.example:" + port, "0.0.0.0:" + port, "[::ffff:7f00:1]x:" + port} {
		for _, path := range []string{"/v1/no-such", "/v1/openapi.json", "/metrics"} {
			code, ct := hostStatus(t, port, host, path)
			if code != http.StatusMisdirectedRequest || !strings.HasPrefix(ct, "application/problem+json") {
				t.Errorf("Host %s, GET %s: %d %s, want 421 problem", host, path, code, ct)
			}
		}
	}
	for _, host := range []string{"127.0.0.1:" + port, "localhost:" + port, "LocalHost", "[::1]:" + port, "127.0.0.2"} {
		if code, _ := hostStatus(t, port, host, "/v1/openapi.json"); code != http.StatusOK {
			t.Errorf("Host %s: %d, want 200", host, code)
		}
	}

	for _, env := range []map[string]string{
		{"ORDERDELAY_HTTP_ADDR": "127.0.0.1:0", "ORDERDELAY_API_TOKEN": listenAPIToken},
		{"ORDERDELAY_HTTP_ADDR": "127.0.0.1:0", "ORDERDELAY_API_AUTH": "none"},
	} {
		ls, _, err := listenersFor(t, env)
		if err != nil {
			t.Fatal(err)
		}
		port := serveListener(t, ls[0])
		if code, _ := hostStatus(t, port, "orderdelay.internal:"+port, "/v1/openapi.json"); code != http.StatusOK {
			t.Errorf("%v, Host orderdelay.internal: %d, want 200", env, code)
		}
	}
}

// TestPprofStaysOnLoopback: the pprof listener has no auth, and
// /debug/pprof/cmdline answers the command line, where a setting given as a
// flag (--database-url with its password, --api-token, --admin-token) is
// in clear. So it may listen on loopback only, whatever the API's auth
// (exit 2 otherwise, nothing bound), and answers only requests addressed to
// localhost or a loopback IP (no DNS-rebinding page reads it).
func TestPprofStaysOnLoopback(t *testing.T) {
	for _, env := range []map[string]string{
		{"ORDERDELAY_HTTP_ADDR": "127.0.0.1:0", "ORDERDELAY_PPROF_ADDR": ":0"},
		{"ORDERDELAY_HTTP_ADDR": ":0", "ORDERDELAY_API_TOKEN": listenAPIToken, "ORDERDELAY_PPROF_ADDR": "0.0.0.0:0"},
		{"ORDERDELAY_HTTP_ADDR": ":0", "ORDERDELAY_API_AUTH": "none", "ORDERDELAY_PPROF_ADDR": "[::]:0"},
	} {
		ls, _, err := listenersFor(t, env)
		var ue usageError
		if !errors.As(err, &ue) || !strings.Contains(err.Error(), "ORDERDELAY_PPROF_ADDR") {
			t.Errorf("%v: err %v, want a usage error naming ORDERDELAY_PPROF_ADDR", env, err)
		}
		if len(ls) != 0 {
			t.Errorf("%v: listeners %s left bound", env, names(ls))
		}
	}

	ls, _, err := listenersFor(t, map[string]string{"ORDERDELAY_HTTP_ADDR": "127.0.0.1:0",
		"ORDERDELAY_API_TOKEN": listenAPIToken, "ORDERDELAY_PPROF_ADDR": "localhost:0"})
	if err != nil {
		t.Fatal(err)
	}
	if names(ls) != "http,pprof" {
		t.Fatalf("listeners %s, want http,pprof", names(ls))
	}
	port := serveListener(t, ls[1])
	if code, _ := hostStatus(t, port, "rebind.example:"+port, "/debug/pprof/cmdline"); code != http.StatusMisdirectedRequest {
		t.Errorf("Host rebind.example, GET /debug/pprof/cmdline: %d, want 421", code)
	}
	if code, _ := hostStatus(t, port, "localhost:"+port, "/debug/pprof/cmdline"); code != http.StatusOK {
		t.Errorf("Host localhost, GET /debug/pprof/cmdline: %d, want 200", code)
	}
}
