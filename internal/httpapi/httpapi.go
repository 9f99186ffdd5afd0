// Package httpapi serves orderdelay's HTTP surface: Prometheus metrics,
// liveness and readiness, the producer API under /v1/timeouts, and, with
// a queues file, the task API under /v1/queues (tasks.go): put, create
// with an id the service makes, batch create, get, delete, and poll (long
// poll with wait) and ack for poll queues.
//
//	PUT    /v1/timeouts/{serial}  {"after":"30m"} or {"at":"<RFC 3339>"}
//	                              [+ "reschedule":true | "only_later":true]
//	GET    /v1/timeouts/{serial}
//	DELETE /v1/timeouts/{serial}
//
// Errors are RFC 9457 problem details (application/problem+json, problem.go):
// 400 for bad input, 401 without a valid bearer token when tokens are
// configured, 404 for an unknown serial, 503 when Redis cannot be reached or
// the daemon is shutting down.
//
// Handler serves all of the above on the producers' listener; the admin API
// (admin.go) is served by AdminHandler, on a listener of its own. Without
// tokens /v1 needs none: the daemon then binds Handler to a loopback
// address only (protected mode, see config.Config.CheckExposure).
//
// openapi.yaml describes every route of both listeners (OpenAPI 3.1); it is
// served at GET /v1/openapi.json without a token (openapi.go), and tests
// hold it to the routes and to every answer (docs/api.md).
package httpapi

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/producer"
	"github.com/orderdelay/orderdelay/internal/tasks"
)

// MaxBodyBytes bounds a request body.
const MaxBodyBytes = 16 << 10

// Config configures a Server.
type Config struct {
	// Tokens are the accepted bearer tokens for /v1; none means no auth.
	// More than one allows rotation without downtime.
	Tokens []string
	// Live reports whether the scan loop is alive (for /healthz).
	Live func() error
	// Ping checks that Redis answers (for /readyz and API 503s).
	Ping func(ctx context.Context) error
}

// Server is the HTTP handler set.
type Server struct {
	cfg      Config
	p        *producer.Producer
	m        *metrics.Metrics
	log      *zap.Logger
	gatherer prometheus.Gatherer
	stopping atomic.Bool
	admin    *AdminConfig   // nil: no admin API
	tasks    *tasks.Manager // nil: no task queues
	newIDs   ids            // ids of tasks created without one
	wakes    wakeHub        // long polls' wake-ups
}

// New returns a Server.
func New(cfg Config, p *producer.Producer, m *metrics.Metrics, g prometheus.Gatherer, log *zap.Logger) *Server {
	return &Server{cfg: cfg, p: p, m: m, log: log, gatherer: g}
}

// SetStopping makes /readyz answer 503 from now on: the first step of
// shutdown, so load balancers stop sending producers here.
func (s *Server) SetStopping() { s.stopping.Store(true) }

// Handler returns the routes of the producers' listener: metrics, health
// checks and /v1. The admin API is not among them (AdminHandler).
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	s.register(mux)
	return s.recoverProblems(refuseCrossOrigin(muxProblems(mux)))
}

// Routes returns the ServeMux pattern of every route Handler (api) and
// AdminHandler (admin) serve, in the order they are registered:
// "GET /v1/timeouts/{serial}", or, for the catch-alls that answer 404 (or
// 403 on an admin listener without a token), a path alone. The OpenAPI
// document describes each of the others (openapi.yaml; a test checks both
// ways).
func (s *Server) Routes() (api, admin []string) {
	var a, b patterns
	s.register(&a)
	s.registerAdmin(&b)
	return a, b
}

// router is what routes are registered with: the ServeMux that serves
// them, or patterns, which lists them.
type router interface {
	Handle(pattern string, handler http.Handler)
	HandleFunc(pattern string, handler func(http.ResponseWriter, *http.Request))
}

// patterns is a router that records the patterns registered with it.
type patterns []string

func (p *patterns) Handle(pattern string, _ http.Handler) { *p = append(*p, pattern) }
func (p *patterns) HandleFunc(pattern string, _ func(http.ResponseWriter, *http.Request)) {
	*p = append(*p, pattern)
}

// register registers every route with mux.
func (s *Server) register(mux router) {
	mux.Handle("GET /metrics", promhttp.HandlerFor(s.gatherer, promhttp.HandlerOpts{ErrorLog: zap.NewStdLog(s.log)}))
	mux.HandleFunc("GET /healthz", s.healthz)
	mux.HandleFunc("GET /readyz", s.readyz)
	mux.HandleFunc("GET /v1/openapi.json", serveOpenAPI) // no token: the document holds nothing secret
	mux.HandleFunc("PUT /v1/timeouts/{serial}", s.auth(s.put))
	mux.HandleFunc("GET /v1/timeouts/{serial}", s.auth(s.get))
	mux.HandleFunc("DELETE /v1/timeouts/{serial}", s.auth(s.del))
	mux.HandleFunc("/v1/", s.auth(func(w http.ResponseWriter, r *http.Request) {
		msg := "no such endpoint: " + r.Method + " " + r.URL.Path
		if movedToAdmin(r.URL.Path) {
			msg += "; a task queue's requeue, purge, pause and resume are on the admin listener " +
				"(ORDERDELAY_ADMIN_ADDR), under /admin" + r.URL.Path
		}
		notFound(w, r, mux, "/v1/", msg)
	}))
	s.taskRoutes(mux) // the admin API is on AdminHandler's listener, not here
}

// notFound answers a request that only the catch-all pattern catchAll of
// mux matched: 405 with an Allow header when another route serves its path
// with other methods, else 404 with msg.
func notFound(w http.ResponseWriter, r *http.Request, mux router, catchAll, msg string) {
	if m, ok := mux.(*http.ServeMux); ok {
		var allow []string
		for _, method := range []string{http.MethodDelete, http.MethodGet, http.MethodHead, http.MethodPatch, http.MethodPost, http.MethodPut} {
			other := r.WithContext(r.Context()) // a shallow copy
			other.Method = method
			if _, p := m.Handler(other); p != "" && p != catchAll {
				allow = append(allow, method)
			}
		}
		if len(allow) > 0 {
			a := strings.Join(allow, ", ")
			w.Header().Set("Allow", a)
			writeError(w, http.StatusMethodNotAllowed, r.Method+" is not allowed on "+r.URL.Path+"; allowed: "+a)
			return
		}
	}
	writeError(w, http.StatusNotFound, msg)
}

// movedToAdmin reports a path of a task queue operation the API listener
// served before the admin API got a listener of its own.
func movedToAdmin(path string) bool {
	rest, ok := strings.CutPrefix(path, "/v1/queues/")
	if !ok {
		return false
	}
	_, op, _ := strings.Cut(rest, "/")
	return op == "dead/requeue" || op == "dead/purge" || op == "pause" || op == "resume"
}

func (s *Server) healthz(w http.ResponseWriter, _ *http.Request) {
	if s.cfg.Live != nil {
		if err := s.cfg.Live(); err != nil {
			writeError(w, http.StatusServiceUnavailable, err.Error())
			return
		}
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

func (s *Server) readyz(w http.ResponseWriter, r *http.Request) {
	if s.stopping.Load() {
		writeError(w, http.StatusServiceUnavailable, "shutting down")
		return
	}
	if s.cfg.Ping != nil {
		ctx, cancel := context.WithTimeout(r.Context(), time.Second)
		defer cancel()
		if err := s.cfg.Ping(ctx); err != nil {
			writeError(w, http.StatusServiceUnavailable, "redis unreachable")
			return
		}
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ready"})
}

func (s *Server) auth(next http.HandlerFunc) http.HandlerFunc {
	if len(s.cfg.Tokens) == 0 {
		return next
	}
	return s.bearer(s.cfg.Tokens, next)
}

// bearer lets through requests carrying one of tokens.
func (s *Server) bearer(tokens []string, next http.HandlerFunc) http.HandlerFunc {
	// Tokens are compared by their SHA-256 digests: ConstantTimeCompare
	// returns at once on a length mismatch, which would time a token's
	// length; digests all have one length.
	sums := make([][sha256.Size]byte, len(tokens))
	for i, t := range tokens {
		sums[i] = sha256.Sum256([]byte(t))
	}
	return func(w http.ResponseWriter, r *http.Request) {
		// The scheme is case-insensitive (RFC 9110 §11.1); the token is not.
		scheme, got, ok := strings.Cut(r.Header.Get("Authorization"), " ")
		ok = ok && strings.EqualFold(scheme, "Bearer")
		sum := sha256.Sum256([]byte(got))
		valid := 0
		for i := range sums {
			// Compare against every token, so timing says nothing about
			// which one (if any) matched.
			valid |= subtle.ConstantTimeCompare(sum[:], sums[i][:])
		}
		if !ok || valid != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="orderdelay"`)
			writeError(w, http.StatusUnauthorized, "missing or invalid bearer token")
			return
		}
		next(w, r)
	}
}

// putBody is the PUT request body.
type putBody struct {
	After      string `json:"after"`
	At         string `json:"at"`
	Reschedule bool   `json:"reschedule"`
	OnlyLater  bool   `json:"only_later"`
}

// DecodePut turns a PUT body into a request for serial. It is strict
// (decodeStrict): unknown, repeated or miscased fields, trailing data, bad
// durations and bad times are errors.
func DecodePut(serial string, body io.Reader) (producer.Request, error) {
	var b putBody
	if _, err := decodeStrict(body, &b); err != nil {
		return producer.Request{}, &fieldError{"body", err}
	}
	req := producer.Request{Serial: serial, Reschedule: b.Reschedule, OnlyLater: b.OnlyLater}
	if b.After != "" {
		d, err := time.ParseDuration(b.After)
		if err != nil {
			return req, &fieldError{"after", err}
		}
		if d <= 0 {
			return req, &fieldError{"after", fmt.Errorf("must be positive, got %s", b.After)}
		}
		req.After = d
	}
	if b.At != "" {
		t, err := parseAt(b.At)
		if err != nil {
			return req, &fieldError{"at", err}
		}
		req.At = t
	}
	return req, nil
}

// parseAt parses a body's "at": an RFC 3339 time, and not the zero time
// (0001-01-01T00:00:00Z, an unset time.Time marshalled), which the
// producer would take for no "at" at all.
func parseAt(v string) (time.Time, error) {
	t, err := time.Parse(time.RFC3339Nano, v)
	if err != nil {
		return t, fmt.Errorf("want an RFC 3339 time such as 2026-01-02T15:04:05Z: %w", err)
	}
	if t.IsZero() {
		return t, errors.New("0001-01-01T00:00:00Z is the zero time (an unset time value?), not a deadline")
	}
	return t, nil
}

// entryJSON is the API's view of a queue entry.
type entryJSON struct {
	Serial     string    `json:"serial"`
	Deadline   time.Time `json:"deadline"`
	DeadlineMS int64     `json:"deadline_ms"`
	State      string    `json:"state,omitempty"`
	Result     string    `json:"result,omitempty"`
	Attempts   int       `json:"attempts,omitempty"`
	Reason     string    `json:"reason,omitempty"`
	LastError  string    `json:"last_error,omitempty"`
}

func (s *Server) put(w http.ResponseWriter, r *http.Request) {
	serial := r.PathValue("serial")
	req, err := DecodePut(serial, http.MaxBytesReader(w, r.Body, MaxBodyBytes))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("body larger than %d bytes", MaxBodyBytes))
			return
		}
		var fe *fieldError
		if errors.As(err, &fe) {
			writeInvalid(w, fe.field, err.Error())
			return
		}
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	res, at, err := s.p.Put(r.Context(), req)
	if err != nil {
		s.fail(w, err)
		return
	}
	code := http.StatusOK
	if res == client.Created {
		code = http.StatusCreated
	}
	writeJSON(w, code, entryJSON{Serial: serial, Deadline: at.UTC(), DeadlineMS: at.UnixMilli(), Result: res.String()})
}

func (s *Server) get(w http.ResponseWriter, r *http.Request) {
	serial := r.PathValue("serial")
	e, err := s.p.Get(r.Context(), serial)
	if err != nil {
		s.fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, entryJSON{Serial: serial, Deadline: e.Deadline.UTC(), DeadlineMS: e.Deadline.UnixMilli(),
		State: string(e.State), Attempts: e.Attempts, Reason: e.Reason, LastError: e.LastError})
}

func (s *Server) del(w http.ResponseWriter, r *http.Request) {
	if err := s.p.Cancel(r.Context(), r.PathValue("serial")); err != nil {
		s.fail(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// fail maps an error to a status. Redis errors are 503 and are logged
// without request data.
func (s *Server) fail(w http.ResponseWriter, err error) {
	switch {
	case errors.Is(err, producer.ErrBadRequest):
		writeError(w, http.StatusBadRequest, err.Error())
	case errors.Is(err, client.ErrNotFound):
		writeError(w, http.StatusNotFound, "no timeout for that serial")
	default:
		s.m.Errors.WithLabelValues(metrics.StageAPI).Inc()
		s.log.Warn("api: redis call failed", zap.Error(err))
		writeError(w, http.StatusServiceUnavailable, "queue unavailable; retry later")
	}
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v) // the client went away; nothing to do
}
