package config_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/orderdelay/orderdelay/internal/config"
)

const apiToken = "0123456789abcdef0123"

// TestProtectedMode is the matrix of protected mode (issue 14): without an
// API token, /v1 may only listen on a loopback address, unless auth is
// switched off explicitly with ORDERDELAY_API_AUTH=none.
func TestProtectedMode(t *testing.T) {
	tests := []struct {
		name      string
		env       map[string]string
		refused   bool
		protected bool // /v1 served without a token, on loopback only
	}{
		{"defaults: loopback, no token", nil, false, true},
		{"127.0.0.1 no token", map[string]string{"ORDERDELAY_HTTP_ADDR": "127.0.0.1:9000"}, false, true},
		{"127.0.0.2 no token", map[string]string{"ORDERDELAY_HTTP_ADDR": "127.0.0.2:9000"}, false, true},
		{"localhost no token", map[string]string{"ORDERDELAY_HTTP_ADDR": "localhost:9000"}, false, true},
		{"::1 no token", map[string]string{"ORDERDELAY_HTTP_ADDR": "[::1]:9000"}, false, true},
		{"wildcard :8080 no token", map[string]string{"ORDERDELAY_HTTP_ADDR": ":8080"}, true, false},
		{"0.0.0.0 no token", map[string]string{"ORDERDELAY_HTTP_ADDR": "0.0.0.0:8080"}, true, false},
		{":: no token", map[string]string{"ORDERDELAY_HTTP_ADDR": "[::]:8080"}, true, false},
		{"pod IP no token", map[string]string{"ORDERDELAY_HTTP_ADDR": "10.1.2.3:8080"}, true, false},
		{"host name no token", map[string]string{"ORDERDELAY_HTTP_ADDR": "orderdelay.internal:8080"}, true, false},
		{"wildcard with token", map[string]string{"ORDERDELAY_HTTP_ADDR": ":8080", "ORDERDELAY_API_TOKEN": apiToken}, false, false},
		{"pod IP with token", map[string]string{"ORDERDELAY_HTTP_ADDR": "10.1.2.3:8080", "ORDERDELAY_API_TOKEN": apiToken}, false, false},
		{"wildcard, auth none", map[string]string{"ORDERDELAY_HTTP_ADDR": ":8080", "ORDERDELAY_API_AUTH": "none"}, false, false},
		{"loopback, auth none", map[string]string{"ORDERDELAY_API_AUTH": "none"}, false, false},
		{"http off, no token", map[string]string{"ORDERDELAY_HTTP_ADDR": ""}, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := mustLoad(t, tt.env) // every setting is valid on its own
			err := c.CheckExposure()
			if !tt.refused {
				if err != nil {
					t.Fatalf("env %v: refused: %v", tt.env, err)
				}
				if got := c.Protected(); got != tt.protected {
					t.Errorf("env %v: Protected() = %v, want %v", tt.env, got, tt.protected)
				}
				return
			}
			if err == nil {
				t.Fatalf("env %v: accepted, want a refusal (protected mode)", tt.env)
			}
			var ce *config.Error
			if !errors.As(err, &ce) || ce.Setting != "ORDERDELAY_HTTP_ADDR" {
				t.Errorf("error %v is not a *config.Error for ORDERDELAY_HTTP_ADDR", err)
			}
			for _, want := range []string{"ORDERDELAY_API_TOKEN", "ORDERDELAY_HTTP_ADDR", "ORDERDELAY_API_AUTH=none", "protected mode", tt.env["ORDERDELAY_HTTP_ADDR"]} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("refusal %q does not say %q", err, want)
				}
			}
		})
	}
}

// TestListenerSettingsRefused: malformed values of the new settings and
// contradictory combinations are refused, naming the setting.
func TestListenerSettingsRefused(t *testing.T) {
	const adminToken = "fedcba9876543210fedcba"
	tests := []struct {
		name string
		env  map[string]string
		want string // setting named
		says string // in the message
	}{
		{"auth off", map[string]string{"ORDERDELAY_API_AUTH": "off"}, "ORDERDELAY_API_AUTH", "token or none"},
		{"auth None", map[string]string{"ORDERDELAY_API_AUTH": "None"}, "ORDERDELAY_API_AUTH", "token or none"},
		{"auth empty", map[string]string{"ORDERDELAY_API_AUTH": ""}, "ORDERDELAY_API_AUTH", "token or none"},
		{"auth none with a token", map[string]string{"ORDERDELAY_API_AUTH": "none", "ORDERDELAY_API_TOKEN": apiToken}, "ORDERDELAY_API_AUTH", "ORDERDELAY_API_TOKEN"},
		{"admin addr without port", map[string]string{"ORDERDELAY_ADMIN_ADDR": "8081"}, "ORDERDELAY_ADMIN_ADDR", "host:port"},
		{"admin addr bad port", map[string]string{"ORDERDELAY_ADMIN_ADDR": "127.0.0.1:http-admin"}, "ORDERDELAY_ADMIN_ADDR", "port"},
		{"admin addr port too big", map[string]string{"ORDERDELAY_ADMIN_ADDR": "127.0.0.1:70000"}, "ORDERDELAY_ADMIN_ADDR", "0 to 65535"},
		{"http addr named port", map[string]string{"ORDERDELAY_HTTP_ADDR": "127.0.0.1:http"}, "ORDERDELAY_HTTP_ADDR", "port number"},
		{"http addr negative port", map[string]string{"ORDERDELAY_HTTP_ADDR": "127.0.0.1:-1"}, "ORDERDELAY_HTTP_ADDR", "port number"},
		{"admin token, admin addr empty", map[string]string{"ORDERDELAY_ADMIN_TOKEN": adminToken, "ORDERDELAY_ADMIN_ADDR": ""}, "ORDERDELAY_ADMIN_ADDR", "ORDERDELAY_ADMIN_TOKEN"},
		{"admin on the http address", map[string]string{"ORDERDELAY_ADMIN_TOKEN": adminToken, "ORDERDELAY_ADMIN_ADDR": "127.0.0.1:8080"}, "ORDERDELAY_ADMIN_ADDR", "ORDERDELAY_HTTP_ADDR"},
		{"admin on the http port, wildcard", map[string]string{"ORDERDELAY_ADMIN_TOKEN": adminToken, "ORDERDELAY_ADMIN_ADDR": ":8080"}, "ORDERDELAY_ADMIN_ADDR", "ORDERDELAY_HTTP_ADDR"},
		{"admin on the pprof address", map[string]string{"ORDERDELAY_ADMIN_TOKEN": adminToken, "ORDERDELAY_PPROF_ADDR": "127.0.0.1:6060", "ORDERDELAY_ADMIN_ADDR": "127.0.0.1:6060"}, "ORDERDELAY_ADMIN_ADDR", "ORDERDELAY_PPROF_ADDR"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := load(t, tt.env)
			if err == nil {
				t.Fatalf("env %v accepted", tt.env)
			}
			var ce *config.Error
			if !errors.As(err, &ce) || !strings.Contains(ce.Setting, tt.want) {
				t.Errorf("env %v: error %v is not a *config.Error for %s", tt.env, err, tt.want)
			}
			if !strings.Contains(err.Error(), tt.says) {
				t.Errorf("env %v: error %q does not say %q", tt.env, err, tt.says)
			}
			if strings.Contains(err.Error(), apiToken) || strings.Contains(err.Error(), adminToken) {
				t.Errorf("error %q shows a token", err)
			}
		})
	}
	// Accepted: the admin listener on another port, wildcard or not, and
	// an empty admin address while the admin API is off.
	for _, env := range []map[string]string{
		{"ORDERDELAY_ADMIN_TOKEN": adminToken},
		{"ORDERDELAY_ADMIN_TOKEN": adminToken, "ORDERDELAY_ADMIN_ADDR": ":9091"},
		{"ORDERDELAY_ADMIN_TOKEN": adminToken, "ORDERDELAY_ADMIN_ADDR": "127.0.0.1:8080", "ORDERDELAY_HTTP_ADDR": "127.0.0.2:8080"},
		{"ORDERDELAY_ADMIN_ADDR": ""},
		{"ORDERDELAY_ADMIN_ADDR": "127.0.0.1:8080"}, // admin API off: nothing binds it
	} {
		if _, err := load(t, env); err != nil {
			t.Errorf("env %v: %v, want accepted", env, err)
		}
	}
}

// TestLoopback: what counts as a loopback listen address.
func TestLoopback(t *testing.T) {
	for addr, want := range map[string]bool{
		"127.0.0.1:8080": true, "127.1.2.3:1": true, "[::1]:8080": true, "localhost:8080": true, "LOCALHOST:80": true,
		":8080": false, "0.0.0.0:8080": false, "[::]:8080": false, "10.0.0.1:8080": false, "[fe80::1%eth0]:8080": false,
		"localhost.example.com:8080": false, "garbage": false, "": false,
	} {
		if got := config.Loopback(addr); got != want {
			t.Errorf("Loopback(%q) = %v, want %v", addr, got, want)
		}
	}
}

// TestPprofLoopbackOnly: pprof takes no token and shows the command line,
// so CheckExposure refuses it beyond loopback, whatever the API's auth.
func TestPprofLoopbackOnly(t *testing.T) {
	for addr, refused := range map[string]bool{
		"127.0.0.1:6060": false, "localhost:6060": false, "[::1]:6060": false,
		":6060": true, "0.0.0.0:6060": true, "[::]:6060": true, "10.1.2.3:6060": true, "pprof.internal:6060": true,
	} {
		c := mustLoad(t, map[string]string{"ORDERDELAY_PPROF_ADDR": addr, "ORDERDELAY_API_TOKEN": apiToken})
		err := c.CheckExposure()
		var ce *config.Error
		if refused != (err != nil) || refused && (!errors.As(err, &ce) || ce.Setting != "ORDERDELAY_PPROF_ADDR") {
			t.Errorf("ORDERDELAY_PPROF_ADDR=%s: CheckExposure() = %v, want refused %v (naming ORDERDELAY_PPROF_ADDR)", addr, err, refused)
		}
	}
}

// TestExposureFailsClosed: a Config not made by the loader (APIAuth empty,
// as in a test or a program embedding the daemon's pieces) is not a way
// around protected mode: only an explicit AuthNone switches auth off.
func TestExposureFailsClosed(t *testing.T) {
	c := config.Config{HTTPAddr: ":8080"}
	if !c.Protected() {
		t.Error("Config{HTTPAddr: \":8080\"}.Protected() = false: no tokens and auth not switched off is protected mode")
	}
	if err := c.CheckExposure(); err == nil {
		t.Error("Config{HTTPAddr: \":8080\"}.CheckExposure() = nil: /v1 would serve anyone without a token")
	}
}
