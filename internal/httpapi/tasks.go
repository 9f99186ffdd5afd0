package httpapi

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/producer"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/tasks"
)

// Task API, for the queues of the queues file (producer tokens apply):
//
//	PUT    /v1/queues/{queue}/tasks/{id}   {"after":"5m"|"at":"...", "payload":{...}, "reschedule":true|"only_later":true}
//	POST   /v1/queues/{queue}/tasks        the same without an id or mode flags: the service names the task
//	                                       (ULID), 201 + Location; Idempotency-Key: <key> makes a retry safe
//	POST   /v1/queues/{queue}/tasks/batch  {"tasks":[{"id":"...", "after":"5m", "payload":{...}}, ...]} (tasks_produce.go)
//	GET    /v1/queues/{queue}/tasks/{id}
//	DELETE /v1/queues/{queue}/tasks/{id}
//	POST   /v1/queues/{queue}/batch-delete {"ids":["a","b"]}
//	POST   /v1/queues/{queue}/poll?max=N[&wait=10s]  due tasks under a lease of their own (poll queues);
//	                                       wait: up to 20 s for one to be due (tasks_wait.go)
//	POST   /v1/queues/{queue}/ack          {"token":"...","ids":["a"]} (compare-and-set on the token)

// maxPoll bounds one poll's task count, and one ack's.
const maxPoll = 1000

// MaxPollBytes bounds one poll's answer: tasks are added while the body
// stays within it, the first whatever its size; the rest stay due,
// untouched, for the next poll.
const MaxPollBytes = 1 << 20

// pollEnvelopeBytes bounds a poll's answer around its tasks:
// {"token":"poll.<26 base32>","lease_ms":<at most 20 digits>,"tasks":[ ]}\n
// is 87 bytes at most; rounded up.
const pollEnvelopeBytes = 128

// EnableTasks serves the task API for m's queues.
func (s *Server) EnableTasks(m *tasks.Manager) { s.tasks = m }

func (s *Server) taskRoutes(mux router) {
	if s.tasks == nil {
		return
	}
	mux.HandleFunc("PUT /v1/queues/{queue}/tasks/{id}", s.auth(s.withQueue(s.putTask)))
	mux.HandleFunc("GET /v1/queues/{queue}/tasks/{id}", s.auth(s.withQueue(s.getTask)))
	mux.HandleFunc("DELETE /v1/queues/{queue}/tasks/{id}", s.auth(s.withQueue(s.deleteTask)))
	mux.HandleFunc("POST /v1/queues/{queue}/batch-delete", s.auth(s.withQueue(s.batchDelete)))
	mux.HandleFunc("POST /v1/queues/{queue}/poll", s.auth(s.withQueue(s.poll)))
	mux.HandleFunc("POST /v1/queues/{queue}/ack", s.auth(s.withQueue(s.ack)))
	mux.HandleFunc("POST /v1/queues/{queue}/tasks", s.auth(s.withQueue(s.createTask)))
	mux.HandleFunc("POST /v1/queues/{queue}/tasks/batch", s.auth(s.withQueue(s.createTasks)))
	s.taskOpsRoutes(mux) // tasks_ops.go: list, stats, dead letters, pause
}

type queueHandler func(w http.ResponseWriter, r *http.Request, q *tasks.Runtime)

func (s *Server) withQueue(h queueHandler) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		q, ok := s.tasks.Queue(r.PathValue("queue"))
		if !ok {
			writeError(w, http.StatusNotFound, "no such queue: "+r.PathValue("queue"))
			return
		}
		h(w, r, q)
	}
}

type putTaskBody struct {
	After      string          `json:"after"`
	At         string          `json:"at"`
	Payload    json.RawMessage `json:"payload"`
	Reschedule bool            `json:"reschedule"`
	OnlyLater  bool            `json:"only_later"`
}

func (s *Server) putTask(w http.ResponseWriter, r *http.Request, q *tasks.Runtime) {
	var b putTaskBody
	if tooBig, err := decodeStrict(http.MaxBytesReader(w, r.Body, client.MaxPayloadBytes+MaxBodyBytes), &b); err != nil {
		if tooBig {
			writeError(w, http.StatusRequestEntityTooLarge, "body too large")
			return
		}
		writeInvalid(w, "body", "body: "+err.Error())
		return
	}
	req := producer.Request{Serial: r.PathValue("id"), Reschedule: b.Reschedule, OnlyLater: b.OnlyLater}
	if b.After != "" {
		d, err := time.ParseDuration(b.After)
		if err != nil || d <= 0 {
			writeInvalid(w, "after", "after: want a positive duration such as 5m")
			return
		}
		req.After = d
	}
	if b.At != "" {
		t, err := parseAt(b.At)
		if err != nil {
			writeInvalid(w, "at", "at: "+err.Error())
			return
		}
		req.At = t
	}
	deadline, err := req.Deadline(time.Now())
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	mode, err := req.Mode()
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	put := q.Client.PutTask
	if q.Durable != nil {
		put = q.Durable.Put
	}
	res, at, err := put(r.Context(), req.Serial, b.Payload, deadline, mode)
	if err != nil {
		s.taskFail(w, err, q)
		return
	}
	writePut(w, q, req.Serial, res, at)
}

// writePut answers a PUT or POST of one task: 201 when it was created
// (counted as enqueued), else 200, with the task's id and due time.
func writePut(w http.ResponseWriter, q *tasks.Runtime, id string, res client.Result, at time.Time) {
	code := http.StatusOK
	if res == client.Created {
		code = http.StatusCreated
		q.Metrics.Enqueued.Inc()
	}
	writeJSON(w, code, map[string]any{"id": id, "queue": q.Config.Name, "deadline": at.UTC(),
		"deadline_ms": at.UnixMilli(), "result": res.String()})
}

func (s *Server) taskFail(w http.ResponseWriter, err error, q *tasks.Runtime) {
	if writeQueueFull(w, err, q) {
		return
	}
	switch {
	case errors.Is(err, client.ErrInvalidSerial), errors.Is(err, client.ErrInvalidDeadline), errors.Is(err, client.ErrInvalidPayload):
		writeError(w, http.StatusBadRequest, err.Error())
	case errors.Is(err, client.ErrNotFound):
		writeError(w, http.StatusNotFound, "no such task")
	default:
		q.Metrics.Errors.WithLabelValues("api").Inc()
		s.log.Warn("task api: redis call failed")
		writeError(w, http.StatusServiceUnavailable, "queue unavailable; retry later")
	}
}

func (s *Server) getTask(w http.ResponseWriter, r *http.Request, q *tasks.Runtime) {
	if q.Durable != nil {
		row, err := q.Durable.Get(r.Context(), r.PathValue("id"))
		if err != nil {
			s.taskFail(w, err, q)
			return
		}
		writeJSON(w, http.StatusOK, row)
		return
	}
	t, err := q.Client.GetTask(r.Context(), r.PathValue("id"))
	if err != nil {
		s.taskFail(w, err, q)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"id": t.Serial, "queue": q.Config.Name, "deadline": t.Deadline.UTC(),
		"state": t.State, "attempts": t.Attempts, "reason": t.Reason, "last_error": t.LastError, "payload": t.Payload})
}

func (s *Server) deleteTask(w http.ResponseWriter, r *http.Request, q *tasks.Runtime) {
	if q.Durable != nil {
		err := q.Durable.Cancel(r.Context(), r.PathValue("id"))
		if errors.Is(err, tasks.ErrNotScheduled) {
			err = client.ErrNotFound
		}
		if err != nil {
			s.taskFail(w, err, q)
			return
		}
		w.WriteHeader(http.StatusNoContent)
		return
	}
	n, err := q.Client.DeleteTasks(r.Context(), r.PathValue("id"))
	if err == nil && n == 0 {
		err = client.ErrNotFound
	}
	if err != nil {
		s.taskFail(w, err, q)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (s *Server) batchDelete(w http.ResponseWriter, r *http.Request, q *tasks.Runtime) {
	var b struct {
		IDs []string `json:"ids"`
	}
	if !decodeBody(w, r, &b) {
		return
	}
	if len(b.IDs) == 0 || len(b.IDs) > 1000 {
		writeInvalid(w, "ids", `give "ids": 1 to 1000 task ids`)
		return
	}
	var n int
	var err error
	if q.Durable != nil {
		for _, id := range b.IDs {
			switch cerr := q.Durable.Cancel(r.Context(), id); {
			case cerr == nil:
				n++
			case !errors.Is(cerr, tasks.ErrNotScheduled):
				err = cerr
			}
		}
	} else {
		n, err = q.Client.DeleteTasks(r.Context(), b.IDs...)
	}
	if err != nil {
		s.taskFail(w, err, q)
		return
	}
	writeJSON(w, http.StatusOK, map[string]int{"deleted": n})
}

func (s *Server) poll(w http.ResponseWriter, r *http.Request, q *tasks.Runtime) {
	if q.Config.Action.Type != tasks.ActionPoll {
		refuseNotPolled(w, q)
		return
	}
	// max and wait are query parameters; a body is none, or {}.
	if !decodeBody(w, r, &struct{}{}) {
		return
	}
	max := 10
	if v := r.URL.Query().Get("max"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > maxPoll {
			writeInvalid(w, "max", "max: want 1..1000")
			return
		}
		max = n
	}
	wait, ok := pollWait(w, r)
	if !ok {
		return
	}
	lease := time.Duration(q.Config.Lease)
	ts, token, err := s.claimPolled(r.Context(), q, max, lease, wait)
	if err != nil {
		s.taskFail(w, err, q)
		return
	}
	writePoll(w, token, lease, ts)
}

// writePoll streams a poll's answer one task at a time, so it is never
// built whole, and lets each payload go once it is written. HTML escaping
// is off: the encoding is then no longer than the stored payload, which is
// what the poll's claim charged. If the client goes away mid-answer the tasks
// stay leased and come back after the lease, like any task not acked.
func writePoll(w http.ResponseWriter, token string, lease time.Duration, ts []queue.Task) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(http.StatusOK)
	bw := bufio.NewWriterSize(w, 32<<10)
	enc := json.NewEncoder(bw)
	enc.SetEscapeHTML(false)
	// The token is base32 after "poll.", or empty: nothing to escape.
	bw.WriteString(`{"token":"` + token + `","lease_ms":` + strconv.FormatInt(lease.Milliseconds(), 10) + `,"tasks":[`)
	for i := range ts {
		if i > 0 {
			bw.WriteByte(',')
		}
		if !json.Valid(ts[i].Payload) {
			// Only a raw HSET can store this; hand it over as a string
			// rather than break the answer.
			ts[i].Payload, _ = json.Marshal(string(ts[i].Payload))
		}
		if err := enc.Encode(ts[i]); err != nil {
			return // the client went away
		}
		ts[i].Payload = nil
	}
	bw.WriteString("]}\n")
	_ = bw.Flush() // the client went away; nothing to do
}

func (s *Server) ack(w http.ResponseWriter, r *http.Request, q *tasks.Runtime) {
	if q.Config.Action.Type != tasks.ActionPoll {
		refuseNotPolled(w, q)
		return
	}
	var b struct {
		Token string   `json:"token"`
		IDs   []string `json:"ids"`
	}
	if !decodeBody(w, r, &b) {
		return
	}
	if !queue.ValidPollToken(b.Token) {
		writeInvalid(w, "token", `token: give the "token" of the poll that returned the tasks`)
		return
	}
	if len(b.IDs) == 0 || len(b.IDs) > maxPoll {
		writeInvalid(w, "ids", `ids: give 1 to 1000 ids of tasks the poll returned`)
		return
	}
	ids := make([]string, 0, len(b.IDs))
	seen := make(map[string]bool, len(b.IDs))
	for _, id := range b.IDs {
		if err := queue.ValidateSerial(id); err != nil {
			writeInvalid(w, "ids", err.Error())
			return
		}
		if !seen[id] {
			seen[id] = true
			ids = append(ids, id)
		}
	}
	missed, late, err := q.Store.AckTasks(r.Context(), b.Token, ids)
	if err != nil {
		s.taskFail(w, err, q)
		return
	}
	n := len(ids) - len(missed)
	q.Metrics.Closed.Add(float64(n))
	for _, l := range late {
		q.Metrics.Lateness.Observe(l.Seconds())
	}
	if len(missed) > 0 {
		writeProblem(w, http.StatusConflict, ProblemLeaseLost,
			fmt.Sprintf("%d of %d tasks are not leased under this token: the lease expired and another poll took them, "+
				"or they were acked already or moved by a producer; the others were acked", len(missed), len(ids)),
			map[string]any{"acked": n, "expired": len(missed), "expired_ids": missed})
		return
	}
	writeJSON(w, http.StatusOK, map[string]int{"acked": n, "expired": 0})
}
