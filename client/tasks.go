package client

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

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

// putTaskScript adds or moves a task and writes its payload, atomically,
// unless the queue's meta hash (written by the daemon from its queues
// file) forbids it.
//
//	KEYS[1] -> queue  KEYS[2] -> {queue}:lease  KEYS[3] -> {queue}:inflight
//	KEYS[4] -> {queue}:deadlines  KEYS[5] -> {queue}:wake  KEYS[6] -> {queue}:payload
//	KEYS[7] -> {queue}:meta
//	ARGV[1] -> mode "nx" | "set" | "later"; ARGV[2] id; ARGV[3] deadline ms; ARGV[4] payload
//	ARGV[5] -> writer: "client", or "durable" for the daemon's durable tier
//
// Returns {result, n}: result 0 unchanged, 1 created, 2 moved, with n the
// deadline; or, with nothing written, -1: the queue is durable and the
// writer is not its durable tier (n 0); -2: the task is new and the queue
// already holds max_pending pending tasks, queued plus inflight (n the
// cap). An unchanged task keeps its payload too. A task that exists
// (queued, leased or backing off) is never refused for the cap, so an
// idempotent retry or a reschedule always goes through.
var putTaskScript = redis.NewScript(`
local meta = redis.call('HMGET', KEYS[7], 'durable', 'max_pending')
if meta[1] == '1' and ARGV[5] ~= 'durable' then return {-1, 0} end
local mode, id, d = ARGV[1], ARGV[2], tonumber(ARGV[3])
local cur = redis.call('ZSCORE', KEYS[1], id)
local leased = false
if not cur then
  local rec = redis.call('HGET', KEYS[2], id)
  if rec then cur = string.match(rec, '^([^|]*)'); leased = true end
end
if cur then cur = tonumber(cur) end
local res = 0
if not cur then
  local cap = tonumber(meta[2])
  if cap and redis.call('ZCARD', KEYS[1]) + redis.call('ZCARD', KEYS[3]) >= cap then return {-2, cap} end
  res = 1
elseif (mode == 'set' and d ~= cur) or (mode == 'later' and d > cur) then
  res = 2
  if leased then
    redis.call('HDEL', KEYS[2], id)
    redis.call('ZREM', KEYS[3], id)
    redis.call('ZREM', KEYS[4], id)
  end
else
  return {0, cur}
end
local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
redis.call('ZADD', KEYS[1], d, id)
redis.call('HSET', KEYS[6], id, ARGV[4])
if not head[2] or d < tonumber(head[2]) then redis.call('PUBLISH', KEYS[5], d) end
return {res, d}
`)

// Writers of a task queue, as the put and delete scripts know them.
const (
	writerClient  = "client"
	writerDurable = "durable" // the daemon's durable tier (internal/durabletier)
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

// Script replies that refuse a write (see putTaskScript, deleteTasksScript).
const (
	replyDurable = -1
	replyFull    = -2
)

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
	v, err := putTaskScript.Run(ctx, c.rdb, c.putTaskKeys(), mode.arg(), id, ms, string(payload), c.writerArg()).Int64Slice()
	if err != nil {
		return Unchanged, time.Time{}, fmt.Errorf("put task %q: %w", id, err)
	}
	if len(v) != 2 {
		return Unchanged, time.Time{}, fmt.Errorf("put task %q: reply of %d fields", id, len(v))
	}
	switch v[0] {
	case replyDurable:
		return Unchanged, time.Time{}, c.durableErr()
	case replyFull:
		return Unchanged, time.Time{}, &QueueFullError{Queue: c.keys.Queue, MaxPending: v[1]}
	}
	return Result(v[0]), time.UnixMilli(v[1]), nil
}

func (c *Client) putTaskKeys() []string {
	k := c.keys
	return []string{k.Queue, k.Lease, k.Inflight, k.Deadlines, k.Wake, k.Payload, k.Meta}
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
	p, err := c.rdb.HGet(ctx, c.keys.Payload, id).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return Task{}, fmt.Errorf("get task %q: %w", id, err)
	}
	t := Task{Entry: e}
	if p != "" {
		t.Payload = json.RawMessage(p)
	}
	return t, nil
}

// deleteTasksScript removes tasks wherever they are (queued, leased,
// backing off, dead) with their payloads, unless the queue is durable and
// the writer is not its durable tier.
//
//	KEYS[1] -> queue  KEYS[2] -> {queue}:lease  KEYS[3] -> {queue}:inflight
//	KEYS[4] -> {queue}:deadlines  KEYS[5] -> {queue}:payload
//	KEYS[6] -> {queue}:dead  KEYS[7] -> {queue}:deadinfo  KEYS[8] -> {queue}:meta
//	ARGV[1] -> writer: "client" | "durable"; ARGV[2..] -> ids
//
// Returns how many existed, or -1 (nothing removed) when the queue is
// durable and the writer is not its durable tier.
var deleteTasksScript = redis.NewScript(`
if ARGV[1] ~= 'durable' and redis.call('HGET', KEYS[8], 'durable') == '1' then return -1 end
local n = 0
for i = 2, #ARGV do
  local id = ARGV[i]
  local found = redis.call('ZREM', KEYS[1], id) + redis.call('HDEL', KEYS[2], id) + redis.call('ZREM', KEYS[6], id)
  redis.call('ZREM', KEYS[3], id)
  redis.call('ZREM', KEYS[4], id)
  redis.call('HDEL', KEYS[5], id)
  redis.call('HDEL', KEYS[7], id)
  if found > 0 then n = n + 1 end
end
return n
`)

// DeleteTasks removes tasks (the seeds' batch delete), up to 1,000 per
// script call, and returns how many existed. On a durable queue it removes
// nothing and returns ErrDurableQueue.
func (c *Client) DeleteTasks(ctx context.Context, ids ...string) (int, error) {
	for _, id := range ids {
		if err := queue.ValidateSerial(id); err != nil {
			return 0, err
		}
	}
	k := c.keys
	total := 0
	for start := 0; start < len(ids); start += maxPerCall {
		chunk := ids[start:min(start+maxPerCall, len(ids))]
		args := make([]any, 0, len(chunk)+1)
		args = append(args, c.writerArg())
		for _, id := range chunk {
			args = append(args, id)
		}
		n, err := deleteTasksScript.Run(ctx, c.rdb,
			[]string{k.Queue, k.Lease, k.Inflight, k.Deadlines, k.Payload, k.Dead, k.DeadInfo, k.Meta}, args...).Int()
		if err != nil {
			return total, fmt.Errorf("delete tasks: %w", err)
		}
		if n == replyDurable {
			return total, c.durableErr()
		}
		total += n
	}
	return total, nil
}

// takeScript takes the oldest item of a reliable list queue: it moves it to
// the processing list, records when it was taken and counts the delivery,
// atomically. The daemon returns an item not acknowledged within the
// queue's ack_timeout of being taken to the ready list, or dead-letters it
// once it has been taken max_attempts times.
//
//	KEYS[1] -> {queue}:ready  KEYS[2] -> {queue}:processing
//	KEYS[3] -> {queue}:unacked  KEYS[4] -> {queue}:taken
//	KEYS[5] -> {queue}:deliveries
//
// One delivery of an id at a time: a taken item is tracked by its id
// (KEYS[3], KEYS[4]), so an item whose id is taken already (a producer or
// a requeue wrote the id again while it waited or was held) is not taken
// beside it: it goes to the back of the ready list and waits until the
// first is acknowledged or returned. Taking it as well would make the
// first consumer's Ack remove the second delivery's records, losing it.
// At most takeSkips such items are passed over per call.
//
// Returns {item, deliveries including this one}, or nil when the list is
// empty or holds only items whose ids are taken. The id is read without
// decoding the payload (see queue.LuaSplitListItem); an item of another
// shape is keyed by its whole body.
var takeScript = redis.NewScript(queue.LuaSplitListItem + `
for _ = 1, math.min(redis.call('LLEN', KEYS[1]), tonumber(ARGV[1])) do
  local item = redis.call('LINDEX', KEYS[1], -1)
  local id = split_item(item) or item
  if redis.call('HEXISTS', KEYS[4], id) == 0 then
    redis.call('LMOVE', KEYS[1], KEYS[2], 'RIGHT', 'LEFT')
    local now = redis.call('TIME')
    local at = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
    redis.call('ZADD', KEYS[3], at, id)
    redis.call('HSET', KEYS[4], id, item)
    local n = redis.call('HINCRBY', KEYS[5], id, 1)
    return {item, n}
  end
  redis.call('LMOVE', KEYS[1], KEYS[1], 'RIGHT', 'LEFT')
end
return nil
`)

// takeSkips bounds the items of taken ids one Take passes over.
const takeSkips = 100

// ListItem is an item of a list action's ready list.
type ListItem struct {
	ID         string          `json:"id"`
	DeadlineMS int64           `json:"deadline_ms"`
	Payload    json.RawMessage `json:"payload"`
	// Attempts is how many times the item was taken before this Take and
	// not acknowledged in time (0 on the first delivery). It is not part
	// of the item in Redis: Take fills it in from the delivery count.
	Attempts int `json:"attempts"`
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
	k := c.keys
	v, err := takeScript.Run(ctx, c.rdb, []string{k.Ready, k.Processing, k.Unacked, k.Taken, k.Deliveries}, takeSkips).Slice()
	if errors.Is(err, redis.Nil) {
		return ListItem{}, ErrNotFound
	}
	if err != nil {
		return ListItem{}, fmt.Errorf("take: %w", err)
	}
	if len(v) != 2 {
		return ListItem{}, fmt.Errorf("take: reply of %d fields, want 2", len(v))
	}
	s, ok1 := v[0].(string)
	n, ok2 := v[1].(int64)
	if !ok1 || !ok2 {
		return ListItem{}, fmt.Errorf("take: reply of types %T, %T", v[0], v[1])
	}
	var it ListItem
	if err := json.Unmarshal([]byte(s), &it); err != nil {
		return ListItem{}, fmt.Errorf("take: malformed item %q: %w", s, err)
	}
	it.Attempts = int(n) - 1
	return it, nil
}

// ackScript acknowledges a taken item.
//
//	KEYS[1] -> {queue}:processing KEYS[2] -> {queue}:unacked KEYS[3] -> {queue}:taken
//	KEYS[4] -> {queue}:deliveries
//	ARGV[1] -> id
//
// Returns 1 if the item was still taken, 0 if it had already returned to
// the ready list (acknowledged too late) or was dead-lettered.
var ackScript = redis.NewScript(`
local item = redis.call('HGET', KEYS[3], ARGV[1])
if not item then return 0 end
redis.call('LREM', KEYS[1], 1, item)
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
return 1
`)

// Ack acknowledges an item taken with Take. It returns ErrNotFound when the
// item was not (or no longer) taken: it went back to the ready list after
// the queue's ack_timeout and may be delivered again, or was dead-lettered.
func (c *Client) Ack(ctx context.Context, id string) error {
	k := c.keys
	n, err := ackScript.Run(ctx, c.rdb, []string{k.Processing, k.Unacked, k.Taken, k.Deliveries}, id).Int()
	if err != nil {
		return fmt.Errorf("ack: %w", err)
	}
	if n == 0 {
		return ErrNotFound
	}
	return nil
}

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
		if len(items[i].Payload) == 0 {
			continue // stored as null; the caller's item is left as it is
		}
		if err := ValidatePayload(items[i].Payload); err != nil {
			return nil, fmt.Errorf("task %d: %w", i, err)
		}
		if err := queue.ValidateDeadline(queue.DeadlineMillis(items[i].Deadline), now); err != nil {
			return nil, fmt.Errorf("task %d: %w", i, err)
		}
	}
	keys := c.putTaskKeys()
	if err := putTaskScript.Load(ctx, c.rdb).Err(); err != nil {
		return nil, fmt.Errorf("put tasks: %w", err)
	}
	writer := c.writerArg()
	cmds := make([]*redis.Cmd, len(items))
	_, err := c.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, it := range items {
			payload := string(it.Payload)
			if payload == "" {
				payload = "null"
			}
			cmds[i] = putTaskScript.EvalSha(ctx, p, keys, mode.arg(), it.ID, queue.DeadlineMillis(it.Deadline), payload, writer)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("put tasks: %w", err)
	}
	out := make([]Result, len(items))
	var full *QueueFullError
	durable := false
	for i, cmd := range cmds {
		v, err := cmd.Int64Slice()
		if err != nil || len(v) != 2 {
			return nil, fmt.Errorf("put tasks: reply %d: %v", i, err)
		}
		switch v[0] {
		case replyDurable:
			durable = true
		case replyFull:
			if full == nil {
				full = &QueueFullError{Queue: c.keys.Queue, MaxPending: v[1], Refused: []int{}}
			}
			full.Refused = append(full.Refused, i)
		default:
			out[i] = Result(v[0])
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
