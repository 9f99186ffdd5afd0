package queue

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/redis/go-redis/v9"
)

// Task queues' producer writes (put, delete) and the reliable list's take
// and ack. Package client validates and wraps them for outside callers;
// the daemon's durable tier writes through the same methods as its own
// writer.

// Write modes of the put script (and of the order enqueue script, Enqueue).
const (
	ModeCreate     = "nx"    // add only if absent
	ModeReschedule = "set"   // set the deadline whether or not it exists
	ModeLater      = "later" // set it only if later (or absent)
)

// Writers of a task queue, as the put and delete scripts know them.
const (
	WriterClient  = "client"
	WriterDurable = "durable" // the daemon's durable tier (internal/durabletier)
)

// Results of a write, as the put and enqueue scripts answer them.
const (
	ResultUnchanged = 0 // the task existed and kept its deadline (and payload)
	ResultCreated   = 1
	ResultMoved     = 2
)

// Script replies that refuse a write (see putTaskScript, deleteTasksScript).
const (
	replyDurable = -1
	replyFull    = -2
)

// ErrDurable: the queue is durable and the writer is not its durable
// tier; nothing was written.
var ErrDurable = errors.New("durable queue")

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
//
// A script's writes stay when a later command fails (an ACL tightened at
// runtime refuses one), so the payload is written first, then the queue
// key, and a lease is dropped last: a refusal leaves the task where it
// was (perhaps with the new payload) or queued, never in neither, and
// never queued without the put's payload — which a retry of the put would
// not mend once the deadline is the put's (unchanged: it writes nothing).
// The wake-up (PUBLISH) is the last command, and the only one a refusal
// there costs: the task is written whole, the put answers the refusal, and
// its retry (unchanged) publishes nothing, so sleeping scanners find the
// earlier head at their next head check (about 350 ms; a scan interval
// without one). Published first, a refused PUBLISH (a user without the
// channel: Redis 7 creates users with resetchannels) would refuse the
// write itself, and wake no one sooner: subscribers act only once the
// script has ended.
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
else
  return {0, cur}
end
local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
redis.call('HSET', KEYS[6], id, ARGV[4])
redis.call('ZADD', KEYS[1], d, id)
if leased then
  redis.call('HDEL', KEYS[2], id)
  redis.call('ZREM', KEYS[3], id)
  redis.call('ZREM', KEYS[4], id)
end
if not head[2] or d < tonumber(head[2]) then redis.call('PUBLISH', KEYS[5], d) end
return {res, d}
`)

// TaskWrite is one task for PutTask and PutTasks.
type TaskWrite struct {
	ID         string
	DeadlineMS int64
	Payload    string // JSON; "" is stored as null
}

// Put is what the put script did with one task.
type Put struct {
	Result   int   // ResultUnchanged, ResultCreated or ResultMoved; Unchanged when refused
	Deadline int64 // the task's deadline after the call, Unix ms (0 when refused)
	// Durable: refused, the queue is durable and the writer not its tier.
	Durable bool
	// Full: refused, the task is new and the queue holds MaxPending
	// pending tasks.
	Full       bool
	MaxPending int64
}

func putKeys(k Keys) []string {
	return []string{k.Queue, k.Lease, k.Inflight, k.Deadlines, k.Wake, k.Payload, k.Meta}
}

func putArgs(mode, writer string, t TaskWrite) []any {
	payload := t.Payload
	if payload == "" {
		payload = "null"
	}
	return []any{mode, t.ID, t.DeadlineMS, payload, writer}
}

func parsePut(v []int64) Put {
	switch v[0] {
	case replyDurable:
		return Put{Durable: true}
	case replyFull:
		return Put{Full: true, MaxPending: v[1]}
	}
	return Put{Result: int(v[0]), Deadline: v[1]}
}

// PutTask adds or moves task t (mode: ModeCreate, ModeReschedule or
// ModeLater) with its payload, atomically, as writer (WriterClient or
// WriterDurable), unless the queue's meta hash refuses it (Put.Durable,
// Put.Full).
func (s *Store) PutTask(ctx context.Context, mode, writer string, t TaskWrite) (Put, error) {
	v, err := putTaskScript.Run(ctx, s.rdb, putKeys(s.keys), putArgs(mode, writer, t)...).Int64Slice()
	if err != nil {
		return Put{}, fmt.Errorf("put task %q: %w", t.ID, err)
	}
	if len(v) != 2 {
		return Put{}, fmt.Errorf("put task %q: reply of %d fields", t.ID, len(v))
	}
	return parsePut(v), nil
}

// PutTasks is PutTask for a batch, pipelined in one round trip; each task
// is put on its own, atomically, in order.
func (s *Store) PutTasks(ctx context.Context, mode, writer string, ts []TaskWrite) ([]Put, error) {
	if err := putTaskScript.Load(ctx, s.rdb).Err(); err != nil {
		return nil, fmt.Errorf("put tasks: %w", err)
	}
	keys := putKeys(s.keys)
	cmds := make([]*redis.Cmd, len(ts))
	_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, t := range ts {
			cmds[i] = putTaskScript.EvalSha(ctx, p, keys, putArgs(mode, writer, t)...)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("put tasks: %w", err)
	}
	out := make([]Put, len(ts))
	for i, cmd := range cmds {
		v, err := cmd.Int64Slice()
		if err != nil || len(v) != 2 {
			return nil, fmt.Errorf("put tasks: reply %d: %v", i, err)
		}
		out[i] = parsePut(v)
	}
	return out, nil
}

// Payload returns task id's payload, "" when it has none.
func (s *Store) Payload(ctx context.Context, id string) (string, error) {
	p, err := s.rdb.HGet(ctx, s.keys.Payload, id).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return "", err
	}
	return p, nil
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

// deleteStep bounds the ids of one delete script call.
const deleteStep = 1000

// DeleteTasks removes tasks ids wherever they are, with their payloads,
// up to 1,000 per script call, as writer, and returns how many existed.
// On a durable queue whose writer is not its tier it removes nothing more
// and returns ErrDurable with the count of earlier calls.
func (s *Store) DeleteTasks(ctx context.Context, writer string, ids []string) (int, error) {
	k := s.keys
	total := 0
	for start := 0; start < len(ids); start += deleteStep {
		chunk := ids[start:min(start+deleteStep, len(ids))]
		args := make([]any, 0, len(chunk)+1)
		args = append(args, writer)
		for _, id := range chunk {
			args = append(args, id)
		}
		n, err := deleteTasksScript.Run(ctx, s.rdb,
			[]string{k.Queue, k.Lease, k.Inflight, k.Deadlines, k.Payload, k.Dead, k.DeadInfo, k.Meta}, args...).Int()
		if err != nil {
			return total, fmt.Errorf("delete tasks: %w", err)
		}
		if n == replyDurable {
			return total, ErrDurable
		}
		total += n
	}
	return total, nil
}

// ListItem is an item of a list action's ready list, as the forward script
// writes it (see luaSplitListItem).
type ListItem struct {
	ID         string          `json:"id"`
	DeadlineMS int64           `json:"deadline_ms"`
	Payload    json.RawMessage `json:"payload"`
	// Attempts is how many times the item was taken before this Take and
	// not acknowledged in time (0 on the first delivery). It is not part
	// of the item in Redis: Take fills it in from the delivery count.
	Attempts int `json:"attempts"`
	// Delivery names this delivery of the item among every delivery of
	// the queue; Ack names it, so that an Ack that comes too late (the
	// item was returned and taken again) acknowledges nothing. It is not
	// part of the item in Redis: Take fills it in.
	Delivery string `json:"delivery,omitempty"`
}

// ErrNothingToTake: the ready list is empty or holds only items whose ids
// are taken.
var ErrNothingToTake = errors.New("nothing to take")

// takeScript takes the oldest item of a reliable list queue: it moves it to
// the processing list, records when it was taken and counts the delivery,
// atomically. The daemon returns an item not acknowledged within the
// queue's ack_timeout of being taken to the ready list, or dead-letters it
// once it has been taken max_attempts times.
//
//	KEYS[1] -> {queue}:ready  KEYS[2] -> {queue}:processing
//	KEYS[3] -> {queue}:unacked  KEYS[4] -> {queue}:taken
//	KEYS[5] -> {queue}:deliveries  KEYS[6] -> {queue}:deliveryids
//	KEYS[7] -> {queue}:deliveryseq
//
// One delivery of an id at a time: a taken item is tracked by its id
// (KEYS[3], KEYS[4]), so an item whose id is taken already (a producer or
// a requeue wrote the id again while it waited or was held) is not taken
// beside it: it goes to the back of the ready list and waits until the
// first is acknowledged or returned. Taking it as well would make the
// first consumer's Ack remove the second delivery's records, losing it.
// At most takeSkips such items are passed over per call.
//
// Each delivery gets a number, "<seq>-<taken at>": seq one more than the
// queue's last (field "n" of KEYS[7], a hash: HINCRBY, which the take
// needs anyway), taken at the take's time in Unix microseconds (its
// {queue}:unacked score is the same time in ms). It is kept under the id
// in KEYS[6] while the item is taken, and an ack names it, so a consumer
// slower than ack_timeout, whose delivery recovery returned, cannot
// acknowledge a later delivery of the id (of the same task, or of a newer
// one a producer wrote since) that its consumer may never finish. The
// time keeps a number from being given again after Redis went back (a
// failover to a replica that missed the last writes takes seq back), and
// the ack holds the {queue}:unacked score to it, so a number left under
// the id (by an older daemon's recovery or an older consumer's ack) never
// matches a delivery by a consumer older than numbers, whose take writes
// none. The number is written before the delivery's records: a refusal
// there leaves no other trace, and a number whose id is not taken is read
// by no ack.
//
// Returns {item, deliveries including this one, delivery number, id}, or
// nil when the list is empty or holds only items whose ids are taken. The
// id is read without decoding the payload (see luaSplitListItem); an item
// of another shape is keyed by its whole body.
//
// A script's writes stay when a later command fails (an ACL tightened
// at runtime refuses one), and a refused take answers the consumer an
// error, not the item. So the records recovery goes by ({queue}:unacked
// first, then {queue}:taken) are written before the item leaves the ready
// list, and the delivery is counted last: a refusal leaves the item
// either in the ready list — perhaps recorded as taken, which recovery
// (forwardScript) tells by the item still being there: it drops the
// records and neither copies the item nor dead-letters it — or taken
// whole but uncounted, which recovery returns after ack_timeout without
// spending an attempt; never in the processing list with nothing to
// recover it by.
var takeScript = redis.NewScript(luaSplitListItem + `
for _ = 1, math.min(redis.call('LLEN', KEYS[1]), tonumber(ARGV[1])) do
  local item = redis.call('LINDEX', KEYS[1], -1)
  local id = split_item(item) or item
  if redis.call('HEXISTS', KEYS[4], id) == 0 then
    local now = redis.call('TIME')
    local at = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
    local delivery = redis.call('HINCRBY', KEYS[7], 'n', 1) .. '-' .. now[1] .. string.format('%06d', tonumber(now[2]))
    redis.call('HSET', KEYS[6], id, delivery)
    redis.call('ZADD', KEYS[3], at, id)
    redis.call('HSET', KEYS[4], id, item)
    redis.call('LMOVE', KEYS[1], KEYS[2], 'RIGHT', 'LEFT')
    return {item, redis.call('HINCRBY', KEYS[5], id, 1), delivery, id}
  end
  redis.call('LMOVE', KEYS[1], KEYS[1], 'RIGHT', 'LEFT')
end
return nil
`)

// takeSkips bounds the items of taken ids one Take passes over.
const takeSkips = 100

// Take takes the next item of a reliable list queue (see takeScript), or
// returns ErrNothingToTake.
func (s *Store) Take(ctx context.Context) (ListItem, error) {
	k := s.keys
	v, err := takeScript.Run(ctx, s.rdb,
		[]string{k.Ready, k.Processing, k.Unacked, k.Taken, k.Deliveries, k.DeliveryIDs, k.DeliverySeq}, takeSkips).Slice()
	if errors.Is(err, redis.Nil) {
		return ListItem{}, ErrNothingToTake
	}
	if err != nil {
		return ListItem{}, fmt.Errorf("take: %w", err)
	}
	if len(v) != 4 {
		return ListItem{}, fmt.Errorf("take: reply of %d fields, want 4", len(v))
	}
	item, ok1 := v[0].(string)
	n, ok2 := v[1].(int64)
	delivery, ok3 := v[2].(string)
	id, ok4 := v[3].(string)
	if !ok1 || !ok2 || !ok3 || !ok4 {
		return ListItem{}, fmt.Errorf("take: reply of types %T, %T, %T, %T", v[0], v[1], v[2], v[3])
	}
	var it ListItem
	if err := json.Unmarshal([]byte(item), &it); err != nil {
		return ListItem{}, fmt.Errorf("take: malformed item %q: %w", item, err)
	}
	// The item is taken, recorded and numbered under the id the script
	// read (see luaSplitListItem), which Ack and the recovery go by. For
	// an item the daemon wrote that is the JSON's id; for one of another
	// shape (keys in another order, an id given twice, written by
	// something else) it is the whole body, and so is ID: an ID decoded
	// from the JSON would name no delivery, and its Ack would never match.
	it.ID = id
	it.Attempts = int(n) - 1
	it.Delivery = delivery
	return it, nil
}

// ackScript acknowledges one delivery of a taken item.
//
//	KEYS[1] -> {queue}:processing KEYS[2] -> {queue}:unacked KEYS[3] -> {queue}:taken
//	KEYS[4] -> {queue}:deliveries KEYS[5] -> {queue}:deliveryids
//	ARGV[1] -> id  ARGV[2] -> the delivery's number (see takeScript)
//
// Returns 1 if that delivery was still taken: its number is the id's, and
// the id was taken when the number says (its {queue}:unacked score, to
// the ms). 0 if it had already returned to the ready list (acknowledged
// too late; the id may be taken again since, by a delivery this ack
// leaves alone) or was dead-lettered.
//
// The number goes first: refused after it, the records stay with no
// number, which recovery returns (delivered again: at least once) and no
// ack matches. Then the delivery count, the taken record, the
// {queue}:unacked entry: a script's writes stay when a later command
// fails (an ACL tightened at runtime). An entry left alone is dropped by
// the next recovery, while a record left alone is reached by no recovery
// and makes every take pass its id over; a count left alone once the
// record is gone is found by the next task of the id, which would start
// at the old count (and be dead-lettered before its max_attempts
// deliveries).
//
// A consumer older than delivery numbers acknowledges by id alone (its
// own script), and so still acknowledges whatever delivery of the id is
// taken when its late ack comes: only upgrading it ends that.
var ackScript = redis.NewScript(`
if redis.call('HGET', KEYS[5], ARGV[1]) ~= ARGV[2] then return 0 end
local us = string.match(ARGV[2], '^%d+%-(%d+)$')
local at = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not us or not at or math.floor(tonumber(us) / 1000) ~= tonumber(at) then return 0 end
local item = redis.call('HGET', KEYS[3], ARGV[1])
if not item then return 0 end
redis.call('HDEL', KEYS[5], ARGV[1])
redis.call('LREM', KEYS[1], 1, item)
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
`)

// ErrNoDelivery: an ack named no delivery (an item Take did not return).
var ErrNoDelivery = errors.New("no delivery number: acknowledge the item Take returned")

// AckTaken acknowledges delivery of the taken item of task id; false when
// that delivery was not (or no longer) taken.
func (s *Store) AckTaken(ctx context.Context, id, delivery string) (bool, error) {
	if delivery == "" {
		return false, fmt.Errorf("ack %q: %w", id, ErrNoDelivery)
	}
	k := s.keys
	n, err := ackScript.Run(ctx, s.rdb,
		[]string{k.Processing, k.Unacked, k.Taken, k.Deliveries, k.DeliveryIDs}, id, delivery).Int()
	if err != nil {
		return false, fmt.Errorf("ack: %w", err)
	}
	return n == 1, nil
}

// Payloads reads the payloads of tasks ids in one command; ok[i] is false
// when ids[i] has none.
func (s *Store) Payloads(ctx context.Context, ids []string) (payloads []string, ok []bool, err error) {
	vals, err := s.rdb.HMGet(ctx, s.keys.Payload, ids...).Result()
	if err != nil {
		return nil, nil, fmt.Errorf("payloads: %w", err)
	}
	payloads, ok = make([]string, len(ids)), make([]bool, len(ids))
	for i, v := range vals {
		payloads[i], ok[i] = v.(string)
	}
	return payloads, ok, nil
}
