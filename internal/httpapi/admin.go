package httpapi

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/admin"
	"github.com/orderdelay/orderdelay/internal/producer"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Admin API, under /admin/v1, on a listener of its own (AdminHandler;
// ORDERDELAY_ADMIN_ADDR), never on the producers' one (Handler), and only
// with an admin token (never a producer token). Bodies are decoded as
// strictly as the public API's: one JSON value, no unknown fields, nothing
// after it, at most MaxBodyBytes.
//
//	GET  /admin/v1/pause                 {"paused":..., "reason":..., "since":...}
//	POST /admin/v1/pause                 {"reason":"payment provider down"}
//	POST /admin/v1/resume
//	POST /admin/v1/extend                {"within":"1h","by":"15m","move_rows":true}
//	                                     (within + by at most admin.MaxExtend)
//	POST /admin/v1/resync                {"page":1000,"per_second":5000}
//	GET  /admin/v1/orders/{serial}       the order in Redis and in PostgreSQL
//	GET  /admin/v1/dead?limit=100        dead letters, oldest first
//	POST /admin/v1/dead/requeue          {"serials":["..."]} or {"all":true}
//	POST /admin/v1/dead/purge            {"older_than":"168h","keep_max":0}
//
// and the task queues' operations (tasks_ops.go) under
// /admin/v1/queues/{queue}/.

// AdminConfig enables the admin API.
type AdminConfig struct {
	Tokens []string
	Tools  *admin.Tools
	// ReferenceSchema: the orders table is orderdelay's own, so extend moves
	// expires_at in step unless the request says otherwise.
	ReferenceSchema bool
}

// EnableAdmin serves the admin API with cfg.
func (s *Server) EnableAdmin(cfg AdminConfig) { s.admin = &cfg }

// AdminHandler returns the admin API's routes, for the admin listener. It
// serves nothing else: no /v1, no metrics, no health checks. Without an
// admin token every request is refused (403); the daemon does not listen
// then.
func (s *Server) AdminHandler() http.Handler {
	mux := http.NewServeMux()
	s.registerAdmin(mux)
	return s.recoverProblems(refuseCrossOrigin(muxProblems(mux)))
}

// registerAdmin registers the admin listener's routes with mux.
func (s *Server) registerAdmin(mux router) {
	if s.admin == nil || len(s.admin.Tokens) == 0 {
		mux.HandleFunc("/", func(w http.ResponseWriter, _ *http.Request) {
			writeError(w, http.StatusForbidden, "the admin API is off: ORDERDELAY_ADMIN_TOKEN is not set")
		})
		return
	}
	a := func(h http.HandlerFunc) http.HandlerFunc { return s.bearer(s.admin.Tokens, h) }
	mux.HandleFunc("GET /admin/v1/pause", a(s.pauseState))
	mux.HandleFunc("POST /admin/v1/pause", a(s.pause))
	mux.HandleFunc("POST /admin/v1/resume", a(s.resume))
	mux.HandleFunc("POST /admin/v1/extend", a(s.extend))
	mux.HandleFunc("POST /admin/v1/resync", a(s.resync))
	mux.HandleFunc("GET /admin/v1/orders/{serial}", a(s.order))
	mux.HandleFunc("GET /admin/v1/dead", a(s.dead))
	mux.HandleFunc("POST /admin/v1/dead/requeue", a(s.requeue))
	mux.HandleFunc("POST /admin/v1/dead/purge", a(s.purge))
	s.taskAdminRoutes(mux, a)
	mux.HandleFunc("/admin/", a(func(w http.ResponseWriter, r *http.Request) {
		notFound(w, r, mux, "/admin/", "no such endpoint: "+r.Method+" "+r.URL.Path)
	}))
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "the admin listener serves /admin/v1 only; no "+r.Method+" "+r.URL.Path)
	})
}

// decodeBody decodes an optional body into v with the public API's strict
// decoder (decodeStrict): unknown fields, a second value or anything but
// white space after the value are 400 (field "body"), a body past MaxBodyBytes is 413. An
// empty body leaves v as it is.
func decodeBody(w http.ResponseWriter, r *http.Request, v any) bool {
	tooBig, err := decodeStrict(http.MaxBytesReader(w, r.Body, MaxBodyBytes), v)
	switch {
	case err == nil || errors.Is(err, io.EOF):
		return true
	case tooBig:
		writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("body larger than %d bytes", MaxBodyBytes))
	default:
		writeInvalid(w, "body", "body: "+err.Error())
	}
	return false
}

func (s *Server) adminFail(w http.ResponseWriter, err error) {
	s.fail(w, err)
}

func (s *Server) pauseState(w http.ResponseWriter, r *http.Request) {
	st, err := s.admin.Tools.PauseState(r.Context())
	if err != nil {
		s.adminFail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, st)
}

func (s *Server) pause(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Reason string `json:"reason"`
	}
	if !decodeBody(w, r, &body) {
		return
	}
	st, err := s.admin.Tools.Pause(r.Context(), body.Reason)
	if err != nil {
		s.adminFail(w, err)
		return
	}
	s.log.Warn("closing paused by an operator", zap.String("reason", st.Reason))
	writeJSON(w, http.StatusOK, st)
}

func (s *Server) resume(w http.ResponseWriter, r *http.Request) {
	if !decodeBody(w, r, &struct{}{}) { // none, or {}
		return
	}
	if err := s.admin.Tools.Resume(r.Context()); err != nil {
		s.adminFail(w, err)
		return
	}
	s.log.Warn("closing resumed by an operator")
	writeJSON(w, http.StatusOK, admin.PauseState{})
}

// parseDurationField parses a JSON duration field such as "15m".
func parseDurationField(name, v string) (time.Duration, error) {
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		return 0, fmt.Errorf("%w: %s: want a positive duration such as 15m, got %q", producer.ErrBadRequest, name, v)
	}
	return d, nil
}

func (s *Server) extend(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Within   string `json:"within"`
		By       string `json:"by"`
		MoveRows *bool  `json:"move_rows"`
	}
	if !decodeBody(w, r, &body) {
		return
	}
	within, err1 := parseDurationField("within", body.Within)
	by, err2 := parseDurationField("by", body.By)
	if err := errors.Join(err1, err2); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if err := admin.CheckExtend(within, by); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	moveRows := s.admin.ReferenceSchema
	if body.MoveRows != nil {
		moveRows = *body.MoveRows
	}
	res, err := s.admin.Tools.Extend(r.Context(), within, by, moveRows)
	if err != nil {
		s.adminFail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, res)
}

func (s *Server) resync(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Page      int     `json:"page"`
		PerSecond float64 `json:"per_second"`
	}
	if !decodeBody(w, r, &body) {
		return
	}
	if body.Page < 0 || body.Page > 10000 || body.PerSecond < 0 {
		writeError(w, http.StatusBadRequest, "page must be 0..10000 and per_second >= 0")
		return
	}
	res, err := s.admin.Tools.Resync(r.Context(), body.Page, body.PerSecond)
	if err != nil {
		s.adminFail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, res)
}

func (s *Server) order(w http.ResponseWriter, r *http.Request) {
	serial := r.PathValue("serial")
	if err := queue.ValidateSerial(serial); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	rep, err := s.admin.Tools.Order(r.Context(), serial)
	if err != nil {
		s.adminFail(w, err)
		return
	}
	if rep.Queue == nil && rep.Row == nil && rep.RowError == "" {
		writeError(w, http.StatusNotFound, "no such order in the queue or the orders table")
		return
	}
	writeJSON(w, http.StatusOK, rep)
}

func (s *Server) dead(w http.ResponseWriter, r *http.Request) {
	limit := int64(100)
	if v := r.URL.Query().Get("limit"); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 1 || n > 10000 {
			writeError(w, http.StatusBadRequest, "limit: want 1..10000")
			return
		}
		limit = n
	}
	entries, err := s.admin.Tools.Dead(r.Context(), limit)
	if err != nil {
		s.adminFail(w, err)
		return
	}
	if entries == nil {
		entries = []queue.DeadEntry{}
	}
	writeJSON(w, http.StatusOK, entries)
}

func (s *Server) requeue(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Serials []string `json:"serials"`
		All     bool     `json:"all"`
	}
	if !decodeBody(w, r, &body) {
		return
	}
	if body.All == (len(body.Serials) > 0) || len(body.Serials) > 1000 {
		writeError(w, http.StatusBadRequest, `give "serials" (at most 1000) or "all": true, not both`)
		return
	}
	var n int
	var err error
	if body.All {
		n, err = s.admin.Tools.RequeueAll(r.Context())
	} else {
		n, err = s.admin.Tools.Requeue(r.Context(), body.Serials...)
		if errors.Is(err, queue.ErrNotDead) {
			writeError(w, http.StatusNotFound, err.Error())
			return
		}
	}
	if err != nil {
		s.adminFail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]int{"requeued": n})
}

func (s *Server) purge(w http.ResponseWriter, r *http.Request) {
	var body struct {
		OlderThan string `json:"older_than"`
		KeepMax   int    `json:"keep_max"`
	}
	if !decodeBody(w, r, &body) {
		return
	}
	var older time.Duration
	if body.OlderThan != "" {
		var err error
		if older, err = parseDurationField("older_than", body.OlderThan); err != nil {
			writeError(w, http.StatusBadRequest, err.Error())
			return
		}
	}
	if body.KeepMax < 0 || (older == 0 && body.KeepMax == 0) {
		writeError(w, http.StatusBadRequest, `give "older_than" (e.g. "168h") and/or "keep_max" > 0`)
		return
	}
	n, err := s.admin.Tools.PurgeDead(r.Context(), older, body.KeepMax)
	if err != nil {
		s.adminFail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]int{"purged": n})
}
