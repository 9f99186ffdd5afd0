package httpapi

import (
	"errors"
	"net/http"
	"strconv"
	"time"

	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/admin"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/tasks"
)

// Operating task queues. Reading takes a producer token, like GET of a
// task; changing what runs (requeue, purge, pause, resume) is part of the
// admin API: served on the admin listener only (AdminHandler), under
// /admin/v1, with the admin token:
//
//	GET  /v1/queues                          every queue with its action and stats
//	GET  /v1/queues/{queue}/stats            pending, due, inflight, dead, oldest overdue, paused
//	GET  /v1/queues/{queue}/tasks?state=pending|inflight|dead&limit=N&after=CURSOR&payload=true
//	POST /admin/v1/queues/{queue}/dead/requeue {"ids":[...]} or {"all":true}            (admin)
//	POST /admin/v1/queues/{queue}/dead/purge {"ids":[...]}, {"all":true} or {"older_than":"168h"} (admin)
//	POST /admin/v1/queues/{queue}/pause      {"reason":"..."} (optional)              (admin)
//	POST /admin/v1/queues/{queue}/resume                                              (admin)

// defaultList is a listing's page size when the request names none.
const defaultList = 100

func (s *Server) taskOpsRoutes(mux router) {
	mux.HandleFunc("GET /v1/queues", s.auth(s.listQueues))
	mux.HandleFunc("GET /v1/queues/{queue}/stats", s.auth(s.withQueue(s.queueStats)))
	mux.HandleFunc("GET /v1/queues/{queue}/tasks", s.auth(s.withQueue(s.listTasks)))
}

// taskAdminRoutes are the operations that change what runs; they are served
// on the admin listener only (AdminHandler), a is its token check.
func (s *Server) taskAdminRoutes(mux router, a func(http.HandlerFunc) http.HandlerFunc) {
	if s.tasks == nil {
		return
	}
	mux.HandleFunc("POST /admin/v1/queues/{queue}/dead/requeue", a(s.withQueue(s.requeueTasks)))
	mux.HandleFunc("POST /admin/v1/queues/{queue}/dead/purge", a(s.withQueue(s.purgeTasks)))
	mux.HandleFunc("POST /admin/v1/queues/{queue}/pause", a(s.withQueue(s.pauseQueue)))
	mux.HandleFunc("POST /admin/v1/queues/{queue}/resume", a(s.withQueue(s.resumeQueue)))
}

func (s *Server) listQueues(w http.ResponseWriter, r *http.Request) {
	out := make([]tasks.Stats, 0, len(s.tasks.Names()))
	for _, name := range s.tasks.Names() {
		q, _ := s.tasks.Queue(name)
		st, err := q.Stats(r.Context())
		if err != nil {
			s.taskFail(w, err, q)
			return
		}
		out = append(out, st)
	}
	writeJSON(w, http.StatusOK, map[string]any{"queues": out})
}

func (s *Server) queueStats(w http.ResponseWriter, r *http.Request, q *tasks.Runtime) {
	st, err := q.Stats(r.Context())
	if err != nil {
		s.taskFail(w, err, q)
		return
	}
	writeJSON(w, http.StatusOK, st)
}

func (s *Server) listTasks(w http.ResponseWriter, r *http.Request, q *tasks.Runtime) {
	qs := r.URL.Query()
	state := qs.Get("state")
	if state == "" {
		state = tasks.ListPending
	}
	limit := defaultList
	if v := qs.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > tasks.MaxList {
			writeInvalid(w, "limit", "limit: want 1.."+strconv.Itoa(tasks.MaxList))
			return
		}
		limit = n
	}
	withPayload := false
	if v := qs.Get("payload"); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			writeInvalid(w, "payload", "payload: want true or false")
			return
		}
		withPayload = b
	}
	page, err := q.List(r.Context(), state, qs.Get("after"), limit, withPayload)
	switch {
	case errors.Is(err, tasks.ErrBadState):
		writeInvalid(w, "state", err.Error())
	case errors.Is(err, queue.ErrBadCursor):
		writeInvalid(w, "after", "after: "+err.Error()+": give the \"next\" of the previous page")
	case err != nil:
		s.taskFail(w, err, q)
	default:
		writeJSON(w, http.StatusOK, page)
	}
}

// validIDs checks the ids of a requeue or purge: 1 to tasks.MaxRequeue
// valid task ids.
func validIDs(ids []string) error {
	if len(ids) == 0 || len(ids) > tasks.MaxRequeue {
		return errors.New(`ids: give 1 to ` + strconv.Itoa(tasks.MaxRequeue) + ` task ids`)
	}
	for _, id := range ids {
		if err := queue.ValidateSerial(id); err != nil {
			return err
		}
	}
	return nil
}

func (s *Server) requeueTasks(w http.ResponseWriter, r *http.Request, q *tasks.Runtime) {
	var b struct {
		IDs []string `json:"ids"`
		All bool     `json:"all"`
	}
	if !decodeBody(w, r, &b) {
		return
	}
	if b.All == (b.IDs != nil) {
		writeError(w, http.StatusBadRequest, `give "ids" or "all": true, not both`)
		return
	}
	if b.All {
		res, left, err := q.RequeueAll(r.Context())
		if err != nil {
			s.taskFail(w, err, q)
			return
		}
		s.log.Warn("dead letters requeued by an operator", zap.String("queue", q.Config.Name), zap.Int("count", res.Requeued))
		writeJSON(w, http.StatusOK, map[string]any{"requeued": res.Requeued, "skipped": res.Skipped, "dead_left": left})
		return
	}
	if err := validIDs(b.IDs); err != nil {
		writeInvalid(w, "ids", err.Error())
		return
	}
	res, err := q.Requeue(r.Context(), b.IDs)
	if err != nil {
		s.taskFail(w, err, q)
		return
	}
	s.log.Warn("dead letters requeued by an operator", zap.String("queue", q.Config.Name), zap.Int("count", res.Requeued))
	writeJSON(w, http.StatusOK, res)
}

func (s *Server) purgeTasks(w http.ResponseWriter, r *http.Request, q *tasks.Runtime) {
	var b struct {
		IDs       []string `json:"ids"`
		All       bool     `json:"all"`
		OlderThan string   `json:"older_than"`
	}
	if !decodeBody(w, r, &b) {
		return
	}
	given := 0
	for _, g := range []bool{b.IDs != nil, b.All, b.OlderThan != ""} {
		if g {
			given++
		}
	}
	if given != 1 {
		writeError(w, http.StatusBadRequest, `give one of "ids", "all": true or "older_than" (e.g. "168h")`)
		return
	}
	var n int
	var err error
	switch {
	case b.IDs != nil:
		if err := validIDs(b.IDs); err != nil {
			writeInvalid(w, "ids", err.Error())
			return
		}
		n, err = q.Purge(r.Context(), b.IDs)
	case b.All:
		n, err = q.PurgeOlder(r.Context(), 0)
	default:
		var older time.Duration
		if older, err = parseDurationField("older_than", b.OlderThan); err != nil {
			writeInvalid(w, "older_than", err.Error())
			return
		}
		n, err = q.PurgeOlder(r.Context(), older)
	}
	if err != nil {
		s.taskFail(w, err, q)
		return
	}
	s.log.Warn("dead letters purged by an operator", zap.String("queue", q.Config.Name), zap.Int("count", n))
	writeJSON(w, http.StatusOK, map[string]int{"purged": n})
}

func (s *Server) pauseQueue(w http.ResponseWriter, r *http.Request, q *tasks.Runtime) {
	var b struct {
		Reason string `json:"reason"`
	}
	if !decodeBody(w, r, &b) {
		return
	}
	st, err := q.Pause(r.Context(), b.Reason)
	if err != nil {
		s.taskFail(w, err, q)
		return
	}
	s.log.Warn("task queue paused by an operator", zap.String("queue", q.Config.Name), zap.String("reason", st.Reason))
	writeJSON(w, http.StatusOK, st)
}

func (s *Server) resumeQueue(w http.ResponseWriter, r *http.Request, q *tasks.Runtime) {
	if !decodeBody(w, r, &struct{}{}) { // none, or {}
		return
	}
	if err := q.Resume(r.Context()); err != nil {
		s.taskFail(w, err, q)
		return
	}
	s.log.Warn("task queue resumed by an operator", zap.String("queue", q.Config.Name))
	writeJSON(w, http.StatusOK, admin.PauseState{})
}
