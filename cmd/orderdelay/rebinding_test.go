package main

import (
	"context"
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
