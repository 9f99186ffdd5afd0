package client

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/orderdelay/orderdelay/internal/durabletier"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// MaxPayloadBytes bounds a task's payload.
const MaxPayloadBytes = 64 << 10

// MaxPayloadDepth bounds how deeply a task's payload may nest arrays and
// objects. Go's decoder accepts 10,000 levels, Redis's cjson only 1,000: a
// payload between the two could be stored but never read back by a script
// (a reliable-list item that can never be acknowledged). 64 levels is far
// more than any real payload needs and far below both limits.
const MaxPayloadDepth = 64

// ErrInvalidPayload: the payload is not JSON, is too large or nests too
// deeply.
var ErrInvalidPayload = errors.New("invalid payload")

// ValidatePayload reports whether p is an acceptable task payload: valid
// JSON of at most MaxPayloadBytes, nested at most MaxPayloadDepth levels.
// Errors wrap ErrInvalidPayload and name the limit broken. Every way a
// payload enters (HTTP API, CLI, this client, durable queues) checks it.
func ValidatePayload(p []byte) error {
	if len(p) > MaxPayloadBytes {
		return fmt.Errorf("%w: %d bytes, the limit is %d", ErrInvalidPayload, len(p), MaxPayloadBytes)
	}
	if !json.Valid(p) {
		return fmt.Errorf("%w: not valid JSON", ErrInvalidPayload)
	}
	if d := jsonDepth(p); d > MaxPayloadDepth {
		return fmt.Errorf("%w: nested %d levels deep, the limit is %d", ErrInvalidPayload, d, MaxPayloadDepth)
	}
	return nil
}

// jsonDepth returns the deepest nesting of arrays and objects in valid
// JSON p (0 for a scalar).
func jsonDepth(p []byte) int {
	depth, deepest := 0, 0
	inString, escaped := false, false
	for _, b := range p {
		switch {
		case inString:
			switch {
			case escaped:
				escaped = false
			case b == '\\':
				escaped = true
			case b == '"':
				inString = false
			}
		case b == '"':
			inString = true
		case b == '[' || b == '{':
			depth++
			deepest = max(deepest, depth)
		case b == ']' || b == '}':
			depth--
		}
	}
	return deepest
}

// Writers of a task queue, as the put and delete scripts know them.
const (
	writerClient  = queue.WriterClient
	writerDurable = queue.WriterDurable // the daemon's durable tier (internal/durabletier)
)

func init() {
	durabletier.Writer = func(c any) any {
		cp := *c.(*Client)
		cp.writer = writerDurable
		return &cp
	}
}

func (c *Client) writerArg() string {
	if c.writer == "" {
		return writerClient
	}
	return c.writer
}

func (c *Client) durableErr() error {
	return fmt.Errorf("%w: queue %s is durable: its tasks live in PostgreSQL, which this client cannot reach; "+
		"put and delete them through the daemon's HTTP API (/v1/queues/<name>/tasks/<id>) or `orderdelay task`", ErrDurableQueue, c.keys.Queue)
}

// QueueFullError is the error of a put refused by the queue's max_pending
// cap; it wraps ErrQueueFull. Nothing was written for the tasks it names.
type QueueFullError struct {
	Queue      string // the queue's key
	MaxPending int64  // the cap in force (max_pending in the daemon's queues file)
	// Refused lists, for PutTasks, the indexes of the items refused, in
	// order; every other item was written. Nil for PutTask.
	Refused []int
}

func (e *QueueFullError) Error() string {
	what := "the task is refused"
	if e.Refused != nil {
		what = fmt.Sprintf("%d new tasks refused (items %v), the others written", len(e.Refused), e.Refused)
	}
	return fmt.Sprintf("queue full: queue %s holds its max_pending of %d pending tasks; %s; retry once it drains, "+
		"or raise max_pending in the queues file", e.Queue, e.MaxPending, what)
}

// Unwrap makes errors.Is(err, ErrQueueFull) true.
func (e *QueueFullError) Unwrap() error { return ErrQueueFull }

// PutTask enqueues task id with a JSON payload and a deadline (rounded up
// to the millisecond). With Create a retry changes nothing, payload
// included; Reschedule and OnlyLater replace the payload when they move the
// deadline. A new task on a queue that holds its max_pending tasks is
// refused with a *QueueFullError (errors.Is ErrQueueFull); on a durable
// queue every put is refused with ErrDurableQueue. Either way nothing is
// written.
func (c *Client) PutTask(ctx context.Context, id string, payload json.RawMessage, deadline time.Time, mode Mode) (Result, time.Time, error) {
	if err := queue.ValidateSerial(id); err != nil {
		return Unchanged, time.Time{}, err
	}
	if len(payload) == 0 {
		payload = json.RawMessage("null")
	}
	if err := ValidatePayload(payload); err != nil {
		return Unchanged, time.Time{}, err
	}
	ms := queue.DeadlineMillis(deadline)
	if err := queue.ValidateDeadline(ms, c.now()); err != nil {
		return Unchanged, time.Time{}, err
	}
	put, err := c.st.PutTask(ctx, mode.arg(), c.writerArg(), queue.TaskWrite{ID: id, DeadlineMS: ms, Payload: string(payload)})
	if err != nil {
		return Unchanged, time.Time{}, err
	}
	switch {
	case put.Durable:
		return Unchanged, time.Time{}, c.durableErr()
	case put.Full:
		return Unchanged, time.Time{}, &QueueFullError{Queue: c.keys.Queue, MaxPending: put.MaxPending}
	}
	return Result(put.Result), time.UnixMilli(put.Deadline), nil
}

// Task is a task as GetTask sees it.
type Task struct {
	Entry
	Payload json.RawMessage
}

// GetTask returns task id with its payload, or ErrNotFound.
func (c *Client) GetTask(ctx context.Context, id string) (Task, error) {
	e, err := c.Get(ctx, id)
	if err != nil {
		return Task{}, err
	}
	p, err := c.st.Payload(ctx, id)
	if err != nil {
		return Task{}, fmt.Errorf("get task %q: %w", id, err)
	}
	t := Task{Entry: e}
	if p != "" {
		t.Payload = json.RawMessage(p)
	}
	return t, nil
}

// DeleteTasks removes tasks (the seeds' batch delete), up to 1,000 per
// script call, and returns how many existed. On a durable queue it removes
// nothing and returns ErrDurableQueue.
func (c *Client) DeleteTasks(ctx context.Context, ids ...string) (int, error) {
	for _, id := range ids {
		if err := queue.ValidateSerial(id); err != nil {
			return 0, err
		}
	}
	n, err := c.st.DeleteTasks(ctx, c.writerArg(), ids)
	if errors.Is(err, queue.ErrDurable) {
		return n, c.durableErr()
	}
	return n, err
}

// ListItem is an item of a list action's ready list.
type ListItem struct {
	// ID is the task's id. An item of another shape than the daemon's
	// (written to the ready list by something else: its keys in another
	// order, an id given twice) is taken by its whole body, and Take
	// gives that body as its ID.
	ID         string          `json:"id"`
	DeadlineMS int64           `json:"deadline_ms"`
	Payload    json.RawMessage `json:"payload"`
	// Attempts is how many times the item was taken before this Take and
	// not acknowledged in time (0 on the first delivery). It is not part
	// of the item in Redis: Take fills it in from the delivery count.
	Attempts int `json:"attempts"`
	// Delivery names this delivery among every delivery of the queue
	// (opaque to callers). Ack sends it, so an Ack that
	// comes after the item was returned and taken again acknowledges
	// nothing. Take fills it in; keep it with the item until the Ack.
	Delivery string `json:"delivery,omitempty"`
}

// Take takes the next item of a reliable list queue ("list" action with
// reliable: true). Acknowledge it with Ack once handled. An item not
// acknowledged within the queue's ack_timeout (set in the queues file and
// enforced by the daemon) goes back to the ready list and is delivered
// again; after retry.max_attempts deliveries it is dead-lettered as
// "failed" instead. An id is delivered to one consumer at a time: an item
// whose id is taken already waits until that one is acknowledged or
// returned. It returns ErrNotFound when the list is empty or holds only
// such items.
func (c *Client) Take(ctx context.Context) (ListItem, error) {
	it, err := c.st.Take(ctx)
	if errors.Is(err, queue.ErrNothingToTake) {
		return ListItem{}, ErrNotFound
	}
	return ListItem(it), err
}

// Ack acknowledges the delivery of an item Take returned (its ID and
// Delivery). It returns ErrNotFound when that delivery is no longer
// taken: it went back to the ready list after the queue's ack_timeout
// and may be delivered again (perhaps taken by another consumer already,
// whose delivery this Ack leaves alone), or was dead-lettered. An item
// without a Delivery (one Take did not return) is refused with an error
// matching ErrNoDelivery, and nothing is acknowledged.
func (c *Client) Ack(ctx context.Context, it ListItem) error {
	ok, err := c.st.AckTaken(ctx, it.ID, it.Delivery)
	if errors.Is(err, queue.ErrNoDelivery) {
		return fmt.Errorf("client: ack of %q: %w", it.ID, ErrNoDelivery)
	}
	if err != nil {
		return err
	}
	if !ok {
		return ErrNotFound
	}
	return nil
}

// ErrNoDelivery is returned by Ack for an item without a Delivery: Ack
// takes the ListItem Take returned, not one built from an id.
var ErrNoDelivery = errors.New("item has no delivery number (acknowledge the ListItem Take returned)")

// TaskItem is one task for PutTasks.
type TaskItem struct {
	ID       string
	Payload  json.RawMessage
	Deadline time.Time
}

// PutTasks is PutTask for a batch, pipelined in one round trip. Items are
// validated first; nothing is written if any is invalid. Each item is then
// put on its own, atomically, in order: on a queue near its max_pending
// cap the new items that find it full are refused (nothing written for
// them; their Result is Unchanged) while every other item, existing tasks
// included, is written, and the error is a *QueueFullError listing the
// refused indexes. A retry of the whole batch with Create is safe: the
// written items come back Unchanged. On a durable queue nothing is written
// and the error is ErrDurableQueue; only a batch that meets a change of
// the queue's durable setting part way (a rolling update of the daemons'
// file) has items written, the error then naming them.
func (c *Client) PutTasks(ctx context.Context, items []TaskItem, mode Mode) ([]Result, error) {
	now := c.now()
	for i := range items {
		if err := queue.ValidateSerial(items[i].ID); err != nil {
			return nil, fmt.Errorf("task %d: %w", i, err)
		}
		if err := queue.ValidateDeadline(queue.DeadlineMillis(items[i].Deadline), now); err != nil {
			return nil, fmt.Errorf("task %d: %w", i, err)
		}
		if len(items[i].Payload) == 0 {
			continue // stored as null; the caller's item is left as it is
		}
		if err := ValidatePayload(items[i].Payload); err != nil {
			return nil, fmt.Errorf("task %d: %w", i, err)
		}
	}
	ts := make([]queue.TaskWrite, len(items))
	for i, it := range items {
		ts[i] = queue.TaskWrite{ID: it.ID, DeadlineMS: queue.DeadlineMillis(it.Deadline), Payload: string(it.Payload)}
	}
	puts, err := c.st.PutTasks(ctx, mode.arg(), c.writerArg(), ts)
	if err != nil {
		return nil, err
	}
	out := make([]Result, len(items))
	var full *QueueFullError
	durable := false
	for i, put := range puts {
		switch {
		case put.Durable:
			durable = true
		case put.Full:
			if full == nil {
				full = &QueueFullError{Queue: c.keys.Queue, MaxPending: put.MaxPending, Refused: []int{}}
			}
			full.Refused = append(full.Refused, i)
		default:
			out[i] = Result(put.Result)
		}
	}
	if durable {
		// Items written beside a refusal met the queue on the other side
		// of a change of its durable setting (a rolling update of the
		// daemons' file): say which, as they are in Redis without a row.
		var written []int
		for i, r := range out {
			if r != Unchanged {
				written = append(written, i)
			}
		}
		if len(written) > 0 {
			return out, fmt.Errorf("%w; its durable setting changed during this batch, and items %v were written to Redis "+
				"(a durable queue's executor drops tasks without a row): put the whole batch again through the daemon", c.durableErr(), written)
		}
		return out, c.durableErr()
	}
	if full != nil {
		return out, full
	}
	return out, nil
}
