package httpapi

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base32"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"reflect"
	"strconv"
	"sync"
	"time"

	"github.com/oklog/ulid/v2"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/producer"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/tasks"
)

// Producing tasks without choosing their ids, and in batches:
//
//	POST /v1/queues/{queue}/tasks        {"after":"5m"|"at":"...", "payload":{...}}  -> 201, id made by the service
//	POST /v1/queues/{queue}/tasks/batch  {"tasks":[{"id":"...", "after":"5m", "payload":{...}}, ...]}
//
// Both take an optional Idempotency-Key header (see idempotentID).

// MaxBatchTasks bounds the tasks of one batch create.
const MaxBatchTasks = 1000

// MaxBatchBytes bounds a batch create's body: far less than MaxBatchTasks
// maximal payloads, so one request cannot hold 64 MB in the daemon.
const MaxBatchBytes = 4 << 20

// MaxIdempotencyKeyBytes bounds an Idempotency-Key header.
const MaxIdempotencyKeyBytes = 255

// idempotentPrefix starts every id derived from an Idempotency-Key.
const idempotentPrefix = "idem-"

// ids makes time-ordered task ids: ULIDs (48 bits of Unix milliseconds,
// then 80 bits from crypto/rand, 26 characters of Crockford base32). Within
// one process they strictly increase, even in the same millisecond or when
// the wall clock steps back; across replicas they order by the replicas'
// clocks, and 80 random bits make a collision practically impossible.
type ids struct {
	mu      sync.Mutex
	last    uint64
	entropy *ulid.MonotonicEntropy
}

func (g *ids) next() (string, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.entropy == nil {
		g.entropy = ulid.Monotonic(rand.Reader, 0)
	}
	ms := max(ulid.Now(), g.last)
	id, err := ulid.New(ms, g.entropy)
	if err != nil {
		return "", fmt.Errorf("new task id: %w", err)
	}
	g.last = ms
	return id.String(), nil
}

// idempotentID derives a task id from an Idempotency-Key (and, in a batch,
// the item's index): "idem-" and 26 base32 characters of its SHA-256. The
// same key always yields the same id on the same queue, so a retried
// create finds the task its first attempt made instead of making another.
// Such ids are not time-ordered.
func idempotentID(key string, index int) string {
	h := sha256.New()
	h.Write([]byte("orderdelay idempotency key\x00"))
	h.Write([]byte(key))
	if index >= 0 {
		fmt.Fprintf(h, "\x00%d", index)
	}
	return idempotentPrefix + base32.StdEncoding.EncodeToString(h.Sum(nil)[:16])[:26]
}

// idempotencyKey reads the optional Idempotency-Key header: 1 to 255
// printable ASCII characters. ok is false (and the answer written) when
// it is malformed.
func idempotencyKey(w http.ResponseWriter, r *http.Request) (key string, given, ok bool) {
	vs := r.Header.Values("Idempotency-Key")
	if len(vs) == 0 {
		return "", false, true
	}
	key = vs[0]
	bad := len(vs) > 1 || key == "" || len(key) > MaxIdempotencyKeyBytes
	for i := 0; i < len(key) && !bad; i++ {
		bad = key[i] < 0x20 || key[i] > 0x7e
	}
	if bad {
		writeInvalid(w, "Idempotency-Key", fmt.Sprintf("Idempotency-Key: want one header of 1 to %d printable ASCII characters", MaxIdempotencyKeyBytes))
		return "", true, false
	}
	return key, true, true
}

// newTaskBody is a created task: PUT's body without the mode flags, and,
// in a batch, with an optional id.
type newTaskBody struct {
	ID      *string         `json:"id"`
	After   string          `json:"after"`
	At      string          `json:"at"`
	Payload json.RawMessage `json:"payload"`
}

// due checks b and returns its due time (rounded up to the millisecond)
// and payload ("null" when none).
func (b newTaskBody) due(now time.Time) (time.Time, json.RawMessage, error) {
	req := producer.Request{}
	if b.After != "" {
		d, err := time.ParseDuration(b.After)
		if err != nil || d <= 0 {
			return time.Time{}, nil, errors.New("after: want a positive duration such as 5m")
		}
		req.After = d
	}
	if b.At != "" {
		t, err := parseAt(b.At)
		if err != nil {
			return time.Time{}, nil, fmt.Errorf("at: %w", err)
		}
		req.At = t
	}
	at, err := req.Deadline(now)
	if err != nil {
		return time.Time{}, nil, err
	}
	ms := queue.DeadlineMillis(at)
	if err := queue.ValidateDeadline(ms, now); err != nil {
		return time.Time{}, nil, err
	}
	at = time.UnixMilli(ms) // what every tier stores and answers
	p := b.Payload
	if len(p) == 0 {
		p = json.RawMessage("null")
	}
	if err := client.ValidatePayload(p); err != nil {
		return time.Time{}, nil, err
	}
	return at, p, nil
}

func (s *Server) putFn(q *tasks.Runtime) func(context.Context, string, json.RawMessage, time.Time, client.Mode) (client.Result, time.Time, error) {
	if q.Durable != nil {
		return q.Durable.Put // PostgreSQL first, then Redis within the window
	}
	return q.Client.PutTask
}

func taskLocation(q *tasks.Runtime, id string) string {
	return "/v1/queues/" + url.PathEscape(q.Config.Name) + "/tasks/" + url.PathEscape(id)
}

// createTask is POST /v1/queues/{queue}/tasks: the service names the task.
func (s *Server) createTask(w http.ResponseWriter, r *http.Request, q *tasks.Runtime) {
	key, keyed, ok := idempotencyKey(w, r)
	if !ok {
		return
	}
	var b newTaskBody
	if tooBig, err := decodeStrict(http.MaxBytesReader(w, r.Body, client.MaxPayloadBytes+MaxBodyBytes), &b); err != nil {
		if tooBig {
			writeError(w, http.StatusRequestEntityTooLarge, "body too large")
			return
		}
		writeInvalid(w, "body", "body: "+err.Error())
		return
	}
	if b.ID != nil {
		writeInvalid(w, "id", `id: the service names the task here; to name it yourself, PUT /v1/queues/`+q.Config.Name+`/tasks/{id}`)
		return
	}
	at, payload, err := b.due(time.Now())
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	put := s.putFn(q)
	var id string
	var res client.Result
	if keyed {
		id = idempotentID(key, -1)
		res, at, err = put(r.Context(), id, payload, at, client.Create)
		if err == nil && res == client.Unchanged {
			if conflict, cerr := s.samePayload(r.Context(), q, id, payload); cerr != nil {
				err = cerr
			} else if conflict {
				writeProblem(w, http.StatusConflict, ProblemIdempotencyKeyReused,
					"Idempotency-Key was used before for this queue with a different payload; nothing changed", map[string]any{"id": id})
				return
			}
		}
	} else {
		// A fresh ULID never exists; should one ever collide, take another
		// rather than answer with someone else's task.
		for range 3 {
			if id, err = s.newIDs.next(); err != nil {
				break
			}
			if res, at, err = put(r.Context(), id, payload, at, client.Create); err != nil || res != client.Unchanged {
				break
			}
		}
		if err == nil && res == client.Unchanged {
			err = errors.New("generated task ids collided three times")
		}
	}
	if err != nil {
		s.taskFail(w, err, q)
		return
	}
	w.Header().Set("Location", taskLocation(q, id))
	writePut(w, q, id, res, at)
}

// samePayload reports whether existing task id's payload differs from p,
// as JSON values (PostgreSQL's jsonb does not keep the bytes). A task
// that is gone by now (done, cancelled) is no conflict.
func (s *Server) samePayload(ctx context.Context, q *tasks.Runtime, id string, p json.RawMessage) (conflict bool, err error) {
	var cur json.RawMessage
	if q.Durable != nil {
		row, err := q.Durable.Get(ctx, id)
		if err != nil {
			return false, ignoreNotFound(err)
		}
		cur = row.Payload
	} else {
		t, err := q.Client.GetTask(ctx, id)
		if err != nil {
			return false, ignoreNotFound(err)
		}
		cur = t.Payload
	}
	if len(cur) == 0 {
		cur = json.RawMessage("null")
	}
	return !jsonEqual(cur, p), nil
}

func ignoreNotFound(err error) error {
	if errors.Is(err, client.ErrNotFound) {
		return nil
	}
	return err
}

func jsonEqual(a, b []byte) bool {
	if bytes.Equal(a, b) {
		return true
	}
	var va, vb any
	da, db := json.NewDecoder(bytes.NewReader(a)), json.NewDecoder(bytes.NewReader(b))
	da.UseNumber()
	db.UseNumber()
	if da.Decode(&va) != nil || db.Decode(&vb) != nil {
		return false
	}
	return reflect.DeepEqual(va, vb)
}

// batchItemResult is one task's outcome in a batch create's answer.
type batchItemResult struct {
	Index      int       `json:"index"`
	ID         string    `json:"id"`
	Result     string    `json:"result"` // "created", "exists" or "refused" (the queue is full: tasks_cap.go)
	Deadline   time.Time `json:"deadline"`
	DeadlineMS int64     `json:"deadline_ms"`
}

// batchInvalid is one refused task in a batch create's 400 answer.
type batchInvalid struct {
	Index int    `json:"index"`
	Error string `json:"error"`
}

// createTasks is POST /v1/queues/{queue}/tasks/batch. It is all or
// nothing at the door: every task is checked first, and if any is invalid
// the answer is 400 listing each invalid one by index and nothing is
// written. Each task is then created as a PUT without mode flags would
// (an existing task is left as it is: "exists").
func (s *Server) createTasks(w http.ResponseWriter, r *http.Request, q *tasks.Runtime) {
	key, keyed, ok := idempotencyKey(w, r)
	if !ok {
		return
	}
	var b struct {
		Tasks []newTaskBody `json:"tasks"`
	}
	if tooBig, err := decodeStrict(http.MaxBytesReader(w, r.Body, MaxBatchBytes), &b); err != nil {
		if tooBig {
			writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("body larger than %d bytes: split the batch", MaxBatchBytes))
			return
		}
		writeInvalid(w, "body", "body: "+err.Error())
		return
	}
	if len(b.Tasks) == 0 || len(b.Tasks) > MaxBatchTasks {
		writeInvalid(w, "tasks", fmt.Sprintf(`tasks: give 1 to %d tasks, got %d`, MaxBatchTasks, len(b.Tasks)))
		return
	}
	now := time.Now()
	items := make([]client.TaskItem, len(b.Tasks))
	var invalid []batchInvalid
	for i, t := range b.Tasks {
		at, p, err := t.due(now)
		if err == nil {
			switch {
			case t.ID != nil:
				items[i].ID = *t.ID
				err = queue.ValidateSerial(*t.ID)
			case keyed:
				items[i].ID = idempotentID(key, i)
			default:
				items[i].ID, err = s.newIDs.next()
			}
		}
		if err != nil {
			invalid = append(invalid, batchInvalid{Index: i, Error: err.Error()})
			continue
		}
		items[i].Deadline, items[i].Payload = at, p
	}
	if len(invalid) > 0 {
		writeProblem(w, http.StatusBadRequest, ProblemInvalidTasks,
			fmt.Sprintf("%d of %d tasks are invalid; nothing was written", len(invalid), len(b.Tasks)),
			map[string]any{"invalid": invalid})
		return
	}
	out := make([]batchItemResult, 0, len(items))
	add := func(i int, res client.Result, at time.Time) {
		name := "exists"
		if res == client.Created {
			name = "created"
			q.Metrics.Enqueued.Inc()
		}
		out = append(out, batchItemResult{Index: i, ID: items[i].ID, Result: name, Deadline: at.UTC(), DeadlineMS: at.UnixMilli()})
	}
	if q.Durable != nil {
		// One transaction per task, in order: the durable tier has no
		// batch write yet. A failure stops here; what went before stays.
		for i, it := range items {
			res, at, err := q.Durable.Put(r.Context(), it.ID, it.Payload, it.Deadline, client.Create)
			if err != nil {
				s.batchFail(w, err, q, out, len(items))
				return
			}
			add(i, res, at)
		}
	} else {
		res, err := q.Client.PutTasks(r.Context(), items, client.Create)
		refused := refusedItems(err) // the queue filled up part way: tasks_cap.go
		if err != nil && refused == nil {
			s.batchFail(w, err, q, nil, len(items))
			return
		}
		for i, rs := range res {
			if refused[i] {
				out = append(out, batchItemResult{Index: i, ID: items[i].ID, Result: "refused"})
				continue
			}
			at := items[i].Deadline
			if rs == client.Unchanged {
				at = time.Time{} // filled in below
			}
			add(i, rs, at)
		}
		for i := range out {
			if out[i].Result == "exists" {
				// PutTasks answers only the result; the kept deadline is
				// the existing task's.
				if t, err := q.Client.GetTask(r.Context(), out[i].ID); err == nil {
					out[i].Deadline, out[i].DeadlineMS = t.Deadline.UTC(), t.Deadline.UnixMilli()
				}
			}
		}
		if writeBatchFull(w, err, q, out) {
			return
		}
	}
	writeJSON(w, http.StatusOK, map[string]any{"tasks": out})
}

// batchFail answers a batch that failed part way: 503, with the tasks
// known to be written (a retry is safe for tasks with ids, given or derived
// from an Idempotency-Key: they answer "exists").
func (s *Server) batchFail(w http.ResponseWriter, err error, q *tasks.Runtime, written []batchItemResult, n int) {
	q.Metrics.Errors.WithLabelValues("api").Inc()
	s.log.Warn("task api: batch create failed")
	if written == nil {
		written = []batchItemResult{}
	}
	writeProblem(w, http.StatusServiceUnavailable, ProblemBatchInterrupted,
		"queue unavailable after "+strconv.Itoa(len(written))+" of "+strconv.Itoa(n)+
			" tasks; retry the batch (tasks with ids, or under an Idempotency-Key, are not created twice)",
		map[string]any{"tasks": written})
}
