package httpapi_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/httpapi"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/producer"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// apiEnv is an API server on a queue of the test's own in the real Redis.
type apiEnv struct {
	url  string
	api  *httpapi.Server
	m    *metrics.Metrics
	rdb  *redis.Client
	keys queue.Keys
	now  time.Time // the producer's clock; fixed
}

// newAPI starts a server; cfg.Ping defaults to pinging the test's Redis.
func newAPI(t *testing.T, cfg httpapi.Config) *apiEnv {
	t.Helper()
	rdb, keys := testenv.Redis(t)
	c, err := client.New(rdb, keys.Queue)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Ping == nil {
		cfg.Ping = func(ctx context.Context) error { return rdb.Ping(ctx).Err() }
	}
	e := &apiEnv{rdb: rdb, keys: keys, now: time.Now().Truncate(time.Millisecond)}
	e.url, e.api, e.m = serve(t, cfg, c, func() time.Time { return e.now })
	return e
}

func serve(t *testing.T, cfg httpapi.Config, c *client.Client, now func() time.Time) (string, *httpapi.Server, *metrics.Metrics) {
	t.Helper()
	reg := prometheus.NewRegistry()
	m := metrics.New(reg, "t", "t")
	p := producer.New(c, m, now)
	api := httpapi.New(cfg, p, m, reg, zap.NewNop())
	srv := httptest.NewServer(api.Handler())
	t.Cleanup(srv.Close)
	return srv.URL, api, m
}

// reply is a response, its body decoded loosely.
type reply struct {
	code   int
	header http.Header
	raw    string
	body   struct {
		Serial     string    `json:"serial"`
		Deadline   time.Time `json:"deadline"`
		DeadlineMS int64     `json:"deadline_ms"`
		State      string    `json:"state"`
		Result     string    `json:"result"`
		Status     any       `json:"status"` // "ok", "ready"; a problem's status code
		Type       string    `json:"type"`
		Detail     string    `json:"detail"`
	}
}

func do(t *testing.T, method, url, body string, header ...string) reply {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, url, rd)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	r := reply{code: resp.StatusCode, header: resp.Header, raw: string(b)}
	if len(b) > 0 && !strings.HasPrefix(r.header.Get("Content-Type"), "text/plain") {
		if err := json.Unmarshal(b, &r.body); err != nil {
			t.Fatalf("%s %s: body %q is not JSON: %v", method, url, b, err)
		}
	}
	return r
}

// wantAnyProblem checks an error reply: the status and an RFC 9457
// problem of any type (see wantProblem).
func wantAnyProblem(t *testing.T, r reply, code int) {
	t.Helper()
	if r.body.Type == "" {
		t.Errorf("body = %s, want a problem with a \"type\"", r.raw)
		return
	}
	wantProblem(t, r, code, r.body.Type)
}

func (e *apiEnv) timeout(serial string) string { return e.url + "/v1/timeouts/" + serial }

func (e *apiEnv) queueLen(t *testing.T) int64 {
	t.Helper()
	n, err := e.rdb.ZCard(context.Background(), e.keys.Queue).Result()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func (e *apiEnv) score(t *testing.T, serial string) int64 {
	t.Helper()
	s, err := e.rdb.ZScore(context.Background(), e.keys.Queue, serial).Result()
	if err != nil {
		t.Fatalf("ZSCORE %s: %v", serial, err)
	}
	return int64(s)
}

func TestPutLifecycle(t *testing.T) {
	e := newAPI(t, httpapi.Config{})
	first := e.now.Add(30 * time.Minute)

	steps := []struct {
		name       string
		body       string
		wantCode   int
		wantResult string
		want       time.Time
	}{
		{"create", `{"after":"30m"}`, http.StatusCreated, "created", first},
		{"retry keeps the deadline", `{"after":"30m"}`, http.StatusOK, "unchanged", first},
		{"retry with another time keeps it", `{"after":"45m"}`, http.StatusOK, "unchanged", first},
		{"reschedule moves", `{"after":"1h","reschedule":true}`, http.StatusOK, "moved", e.now.Add(time.Hour)},
		{"only later with earlier keeps", `{"after":"10m","only_later":true}`, http.StatusOK, "unchanged", e.now.Add(time.Hour)},
		{"only later with later moves", `{"after":"2h","only_later":true}`, http.StatusOK, "moved", e.now.Add(2 * time.Hour)},
		{"reschedule earlier moves", `{"after":"5m","reschedule":true}`, http.StatusOK, "moved", e.now.Add(5 * time.Minute)},
	}
	for _, s := range steps {
		r := do(t, http.MethodPut, e.timeout("ord-1"), s.body)
		if r.code != s.wantCode || r.body.Result != s.wantResult {
			t.Fatalf("%s: PUT %s = %d %q (%s), want %d %q", s.name, s.body, r.code, r.body.Result, r.raw, s.wantCode, s.wantResult)
		}
		if r.body.DeadlineMS != s.want.UnixMilli() || !r.body.Deadline.Equal(s.want) || r.body.Serial != "ord-1" {
			t.Errorf("%s: reply %s, want serial ord-1, deadline %s (%d ms)", s.name, r.raw, s.want.UTC().Format(time.RFC3339Nano), s.want.UnixMilli())
		}
		if got := e.score(t, "ord-1"); got != s.want.UnixMilli() {
			t.Errorf("%s: ZSCORE = %d, want %d", s.name, got, s.want.UnixMilli())
		}
	}
	if got := testutil.ToFloat64(e.m.Enqueued); got != 1 {
		t.Errorf("orderdelay_enqueued_total = %v, want 1 (only the create counts)", got)
	}
}

func TestPutAt(t *testing.T) {
	e := newAPI(t, httpapi.Config{})
	at := e.now.Add(time.Hour).UTC().Truncate(time.Second)
	tests := []struct {
		name, serial, at string
		wantMS           int64
	}{
		{"UTC", "at-utc", at.Format(time.RFC3339), at.UnixMilli()},
		{"offset zone", "at-zone", at.In(time.FixedZone("CST", 8*3600)).Format(time.RFC3339), at.UnixMilli()},
		{"nanoseconds round up", "at-nano", at.Add(123456789 * time.Nanosecond).Format(time.RFC3339Nano), at.UnixMilli() + 124},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := do(t, http.MethodPut, e.timeout(tt.serial), `{"at":"`+tt.at+`"}`)
			if r.code != http.StatusCreated || r.body.DeadlineMS != tt.wantMS {
				t.Fatalf("PUT at %s = %d %s, want 201 with deadline_ms %d", tt.at, r.code, r.raw, tt.wantMS)
			}
			if got := e.score(t, tt.serial); got != tt.wantMS {
				t.Errorf("ZSCORE = %d, want %d", got, tt.wantMS)
			}
		})
	}
}

func TestPutBadRequests(t *testing.T) {
	now := time.Now()
	tests := []struct {
		name, serial, body string
		code               int
	}{
		{"bad JSON", "ord", `{"after":`, http.StatusBadRequest},
		{"empty body", "ord", ``, http.StatusBadRequest},
		{"not an object", "ord", `"30m"`, http.StatusBadRequest},
		{"null", "ord", `null`, http.StatusBadRequest},
		{"unknown field", "ord", `{"after":"30m","priority":1}`, http.StatusBadRequest},
		{"both after and at", "ord", `{"after":"30m","at":"` + now.Add(time.Hour).Format(time.RFC3339) + `"}`, http.StatusBadRequest},
		{"neither after nor at", "ord", `{}`, http.StatusBadRequest},
		{"only flags", "ord", `{"reschedule":true}`, http.StatusBadRequest},
		{"negative after", "ord", `{"after":"-5m"}`, http.StatusBadRequest},
		{"zero after", "ord", `{"after":"0s"}`, http.StatusBadRequest},
		{"bare zero after", "ord", `{"after":"0"}`, http.StatusBadRequest},
		{"bad duration", "ord", `{"after":"soon"}`, http.StatusBadRequest},
		{"duration without unit", "ord", `{"after":"30"}`, http.StatusBadRequest},
		{"duration as a number", "ord", `{"after":1800}`, http.StatusBadRequest},
		{"bad time", "ord", `{"at":"tomorrow"}`, http.StatusBadRequest},
		{"time without zone", "ord", `{"at":"2030-01-02T15:04:05"}`, http.StatusBadRequest},
		{"time with a space", "ord", `{"at":"2030-01-02 15:04:05Z"}`, http.StatusBadRequest},
		{"before 2000", "ord", `{"at":"1999-12-31T23:59:59Z"}`, http.StatusBadRequest},
		{"eleven years ahead", "ord", `{"at":"` + now.AddDate(11, 0, 0).UTC().Format(time.RFC3339) + `"}`, http.StatusBadRequest},
		{"after beyond ten years", "ord", `{"after":"100000h"}`, http.StatusBadRequest},
		{"reschedule and only_later", "ord", `{"after":"30m","reschedule":true,"only_later":true}`, http.StatusBadRequest},
		{"two JSON values", "ord", `{"after":"30m"}{"after":"1h"}`, http.StatusBadRequest},
		{"trailing garbage", "ord", `{"after":"30m"} x`, http.StatusBadRequest},
		{"trailing brace", "ord", `{"after":"30m"}}`, http.StatusBadRequest},
		{"trailing bracket", "ord", `{"after":"30m"}]`, http.StatusBadRequest},
		{"NUL serial", "%00", `{"after":"30m"}`, http.StatusBadRequest},
		{"newline serial", "ord%0A1", `{"after":"30m"}`, http.StatusBadRequest},
		{"invalid UTF-8 serial", "ord%FF", `{"after":"30m"}`, http.StatusBadRequest},
		{"129-byte serial", strings.Repeat("s", 129), `{"after":"30m"}`, http.StatusBadRequest},
		{"oversized body", "ord", `{"after":"30m","at":"` + strings.Repeat("x", httpapi.MaxBodyBytes) + `"}`, http.StatusRequestEntityTooLarge},
		{"oversized padding", "ord", `{"after":"30m"}` + strings.Repeat(" ", httpapi.MaxBodyBytes), http.StatusRequestEntityTooLarge},
	}
	e := newAPI(t, httpapi.Config{})
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := do(t, http.MethodPut, e.timeout(tt.serial), tt.body)
			wantAnyProblem(t, r, tt.code)
			if n := e.queueLen(t); n != 0 {
				t.Errorf("queue has %d entries after a refused PUT, want 0", n)
			}
		})
	}
	if got := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageAPI)); got != 0 {
		t.Errorf("orderdelay_errors_total{stage=\"api\"} = %v after bad requests, want 0 (they are the caller's errors)", got)
	}
}

func TestPutAccepts(t *testing.T) {
	tests := []struct{ name, body string }{
		{"128-byte serial", `{"after":"30m"}`},
		{"whitespace around", " \n{\"after\": \"30m\"}\n\t "},
		{"explicit false flags", `{"after":"30m","reschedule":false,"only_later":false}`},
		{"compound duration", `{"after":"1h30m15s"}`},
	}
	e := newAPI(t, httpapi.Config{})
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			serial := "ord-" + strconv.Itoa(i)
			if i == 0 {
				serial = strings.Repeat("s", 128)
			}
			r := do(t, http.MethodPut, e.timeout(serial), tt.body)
			if r.code != http.StatusCreated {
				t.Errorf("PUT %q = %d %s, want 201", tt.body, r.code, r.raw)
			}
		})
	}
}

func TestSerialEncodingInPath(t *testing.T) {
	e := newAPI(t, httpapi.Config{})
	tests := []struct{ path, serial string }{
		{"%E8%AE%A2%E5%8D%95-1", "订单-1"},
		{"a%2Fb", "a/b"},
		{"a%20b", "a b"},
		{"1%27%3B%20DROP%20TABLE%20orders", "1'; DROP TABLE orders"},
	}
	for _, tt := range tests {
		t.Run(tt.serial, func(t *testing.T) {
			r := do(t, http.MethodPut, e.timeout(tt.path), `{"after":"30m"}`)
			if r.code != http.StatusCreated || r.body.Serial != tt.serial {
				t.Fatalf("PUT /v1/timeouts/%s = %d %s, want 201 for serial %q", tt.path, r.code, r.raw, tt.serial)
			}
			e.score(t, tt.serial) // stored under the decoded serial
		})
	}
}

func TestGetAndDelete(t *testing.T) {
	e := newAPI(t, httpapi.Config{})
	want := e.now.Add(30 * time.Minute)

	wantAnyProblem(t, do(t, http.MethodGet, e.timeout("ord"), ""), http.StatusNotFound)
	if r := do(t, http.MethodPut, e.timeout("ord"), `{"after":"30m"}`); r.code != http.StatusCreated {
		t.Fatalf("PUT = %d %s", r.code, r.raw)
	}
	r := do(t, http.MethodGet, e.timeout("ord"), "")
	if r.code != http.StatusOK || r.body.Serial != "ord" || r.body.State != "queued" || r.body.DeadlineMS != want.UnixMilli() || !r.body.Deadline.Equal(want) {
		t.Errorf("GET = %d %s, want 200 serial ord, state queued, deadline %d ms", r.code, r.raw, want.UnixMilli())
	}
	r = do(t, http.MethodDelete, e.timeout("ord"), "")
	if r.code != http.StatusNoContent || r.raw != "" {
		t.Errorf("DELETE = %d %q, want 204 with no body", r.code, r.raw)
	}
	if n := e.queueLen(t); n != 0 {
		t.Errorf("queue has %d entries after DELETE, want 0", n)
	}
	wantAnyProblem(t, do(t, http.MethodDelete, e.timeout("ord"), ""), http.StatusNotFound)
	wantAnyProblem(t, do(t, http.MethodGet, e.timeout("ord"), ""), http.StatusNotFound)

	// Invalid serials are the caller's mistake, not "not found".
	for _, m := range []string{http.MethodGet, http.MethodDelete} {
		wantAnyProblem(t, do(t, m, e.timeout("%00"), ""), http.StatusBadRequest)
		wantAnyProblem(t, do(t, m, e.timeout(strings.Repeat("s", 129)), ""), http.StatusBadRequest)
	}
	// A method the path does not take (TestWrongMethodOnARouteIs405), and
	// no such endpoint.
	wantAnyProblem(t, do(t, http.MethodPost, e.timeout("ord"), `{"after":"30m"}`), http.StatusMethodNotAllowed)
	wantAnyProblem(t, do(t, http.MethodGet, e.url+"/v1/other", ""), http.StatusNotFound)
}

func TestTokens(t *testing.T) {
	const tokA, tokB = "token-aaaaaaaaaaaaaaaa", "token-bbbbbbbbbbbbbbbb"
	e := newAPI(t, httpapi.Config{Tokens: []string{tokA, tokB}})
	tests := []struct {
		name   string
		header []string
		ok     bool
	}{
		{"first token", []string{"Authorization", "Bearer " + tokA}, true},
		{"second token", []string{"Authorization", "Bearer " + tokB}, true},
		{"no header", nil, false},
		{"wrong token", []string{"Authorization", "Bearer token-cccccccccccccccc"}, false},
		{"prefix of a token", []string{"Authorization", "Bearer " + tokA[:len(tokA)-1]}, false},
		{"token with extra", []string{"Authorization", "Bearer " + tokA + "x"}, false},
		{"both tokens", []string{"Authorization", "Bearer " + tokA + tokB}, false},
		{"no scheme", []string{"Authorization", tokA}, false},
		{"basic scheme", []string{"Authorization", "Basic " + tokA}, false},
		{"empty bearer", []string{"Authorization", "Bearer "}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// An unknown serial: 404 once past auth, 401 before it.
			for _, m := range []string{http.MethodGet, http.MethodDelete} {
				r := do(t, m, e.timeout("unknown"), "", tt.header...)
				if tt.ok {
					wantAnyProblem(t, r, http.StatusNotFound)
					continue
				}
				wantAnyProblem(t, r, http.StatusUnauthorized)
				if got := r.header.Get("WWW-Authenticate"); !strings.HasPrefix(got, "Bearer") {
					t.Errorf("%s: WWW-Authenticate = %q, want a Bearer challenge", m, got)
				}
			}
			r := do(t, http.MethodPut, e.timeout("ord-"+strings.ReplaceAll(tt.name, " ", "-")), `{"after":"30m"}`, tt.header...)
			if tt.ok && r.code != http.StatusCreated {
				t.Errorf("PUT = %d %s, want 201", r.code, r.raw)
			}
			if !tt.ok {
				wantAnyProblem(t, r, http.StatusUnauthorized)
			}
			// Unknown /v1 endpoints are behind auth too.
			if r := do(t, http.MethodGet, e.url+"/v1/other", "", tt.header...); !tt.ok && r.code != http.StatusUnauthorized {
				t.Errorf("GET /v1/other = %d, want 401", r.code)
			}
		})
	}
	if n := e.queueLen(t); n != 2 {
		t.Errorf("queue has %d entries, want 2 (one per valid token)", n)
	}
	// Metrics and health stay open.
	for _, path := range []string{"/metrics", "/healthz", "/readyz"} {
		if r := do(t, http.MethodGet, e.url+path, ""); r.code != http.StatusOK {
			t.Errorf("GET %s without a token = %d, want 200", path, r.code)
		}
	}
}

func TestReadyz(t *testing.T) {
	t.Run("ready", func(t *testing.T) {
		e := newAPI(t, httpapi.Config{})
		if r := do(t, http.MethodGet, e.url+"/readyz", ""); r.code != http.StatusOK || r.body.Status != "ready" {
			t.Errorf("/readyz = %d %s, want 200 ready", r.code, r.raw)
		}
	})
	t.Run("stopping", func(t *testing.T) {
		e := newAPI(t, httpapi.Config{})
		e.api.SetStopping()
		wantAnyProblem(t, do(t, http.MethodGet, e.url+"/readyz", ""), http.StatusServiceUnavailable)
		// Liveness is not readiness: a draining daemon is alive.
		if r := do(t, http.MethodGet, e.url+"/healthz", ""); r.code != http.StatusOK {
			t.Errorf("/healthz while stopping = %d, want 200", r.code)
		}
	})
	t.Run("ping fails", func(t *testing.T) {
		e := newAPI(t, httpapi.Config{Ping: func(context.Context) error { return errors.New("dial tcp: connection refused") }})
		r := do(t, http.MethodGet, e.url+"/readyz", "")
		wantAnyProblem(t, r, http.StatusServiceUnavailable)
	})
	t.Run("ping gets a deadline", func(t *testing.T) {
		var hasDeadline bool
		e := newAPI(t, httpapi.Config{Ping: func(ctx context.Context) error { _, hasDeadline = ctx.Deadline(); return nil }})
		do(t, http.MethodGet, e.url+"/readyz", "")
		if !hasDeadline {
			t.Errorf("Ping's context has no deadline; a hung Redis would hang /readyz")
		}
	})
}

func TestHealthz(t *testing.T) {
	tests := []struct {
		name string
		live func() error
		code int
	}{
		{"no check configured", nil, http.StatusOK},
		{"live", func() error { return nil }, http.StatusOK},
		{"scan loop stuck", func() error { return errors.New("no scan for 2m") }, http.StatusServiceUnavailable},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// Liveness never depends on Redis.
			e := newAPI(t, httpapi.Config{Live: tt.live, Ping: func(context.Context) error { return errors.New("down") }})
			r := do(t, http.MethodGet, e.url+"/healthz", "")
			if tt.code == http.StatusOK {
				if r.code != http.StatusOK || r.body.Status != "ok" {
					t.Errorf("/healthz = %d %s, want 200 ok", r.code, r.raw)
				}
				return
			}
			wantAnyProblem(t, r, tt.code)
		})
	}
}

func TestMetricsEndpoint(t *testing.T) {
	e := newAPI(t, httpapi.Config{})
	do(t, http.MethodPut, e.timeout("ord"), `{"after":"30m"}`)
	r := do(t, http.MethodGet, e.url+"/metrics", "")
	if r.code != http.StatusOK {
		t.Fatalf("/metrics = %d", r.code)
	}
	for _, want := range []string{"orderdelay_enqueued_total 1", `orderdelay_errors_total{stage="api"} 0`} {
		if !strings.Contains(r.raw, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
}

func TestRedisDown(t *testing.T) {
	port, err := testenv.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:" + strconv.Itoa(port), MaxRetries: -1, DialTimeout: time.Second})
	t.Cleanup(func() { rdb.Close() })
	c, err := client.New(rdb, "down:order")
	if err != nil {
		t.Fatal(err)
	}
	url, _, m := serve(t, httpapi.Config{Ping: func(ctx context.Context) error { return rdb.Ping(ctx).Err() }}, c, nil)

	calls := []struct{ method, body string }{
		{http.MethodPut, `{"after":"30m"}`},
		{http.MethodGet, ""},
		{http.MethodDelete, ""},
	}
	for i, call := range calls {
		r := do(t, call.method, url+"/v1/timeouts/ord", call.body)
		wantAnyProblem(t, r, http.StatusServiceUnavailable)
		if got := testutil.ToFloat64(m.Errors.WithLabelValues(metrics.StageAPI)); got != float64(i+1) {
			t.Errorf("after %s: orderdelay_errors_total{stage=\"api\"} = %v, want %d", call.method, got, i+1)
		}
	}
	wantAnyProblem(t, do(t, http.MethodGet, url+"/readyz", ""), http.StatusServiceUnavailable)
	// Bad input is still 400, not 503: it never reaches Redis.
	wantAnyProblem(t, do(t, http.MethodPut, url+"/v1/timeouts/ord", `{}`), http.StatusBadRequest)
}

func FuzzDecodePut(f *testing.F) {
	for _, b := range []string{`{"after":"30m"}`, `{"at":"2030-01-02T15:04:05Z"}`, `{"after":"30m","at":"2030-01-02T15:04:05Z"}`,
		`{}`, `null`, `{"after":"-1s"}`, `{"after":"0"}`, `{"at":"0001-01-01T00:00:00Z"}`, `{"after":"30m"}}`, `{"reschedule":true,"only_later":true,"after":"1ns"}`} {
		f.Add("ord-1", []byte(b))
	}
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	f.Fuzz(func(t *testing.T, serial string, body []byte) {
		req, err := httpapi.DecodePut(serial, bytes.NewReader(body))
		if err != nil {
			return
		}
		if req.Serial != serial {
			t.Fatalf("DecodePut(%q, %q).Serial = %q", serial, body, req.Serial)
		}
		if req.After < 0 {
			t.Fatalf("DecodePut(%q) accepted a negative after: %s", body, req.After)
		}
		deadline, derr := req.Deadline(now)
		exactlyOne := (req.After > 0) != !req.At.IsZero()
		if !exactlyOne && derr == nil {
			t.Fatalf("DecodePut(%q) = %+v: neither or both of after/at, yet Deadline accepts it (%s)", body, req, deadline)
		}
		if derr != nil && !errors.Is(derr, producer.ErrBadRequest) {
			t.Fatalf("Deadline error %v does not wrap ErrBadRequest", derr)
		}
		if derr == nil && req.After > 0 && !deadline.Equal(now.Add(req.After)) {
			t.Fatalf("Deadline = %s, want now + %s", deadline, req.After)
		}
	})
}
