package queue

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// forwardScript moves due tasks into the queue's stream or ready list in
// one atomic step: a task is either still queued or delivered, never both
// and never neither — but for a command refused mid-script (an ACL
// tightened at runtime: a script's writes before it stay), which can
// leave a task delivered and still queued, to be delivered again (at
// least once, as ever), never in neither. A refused HDEL of a delivered
// task's payload leaves that one field behind with no task (a later put
// of the id overwrites it): removing the payload before the task leaves
// the queue key would, refused in between, queue it without its payload.
//
//	KEYS[1] -> queue  KEYS[2] -> {queue}:payload  KEYS[3] -> {queue}:paused
//	KEYS[4] -> {queue}:stream or {queue}:ready
//	KEYS[5] -> {queue}:dead  KEYS[6] -> {queue}:deadinfo
//	KEYS[7] -> {queue}:unacked  KEYS[8] -> {queue}:taken  KEYS[9] -> {queue}:processing
//	KEYS[10] -> {queue}:deliveries  KEYS[11] -> {queue}:deliveryids
//	ARGV[1] -> "stream" | "list"; ARGV[2] -> limit
//	ARGV[3] -> stream: MAXLEN ~; list: most items in the ready list (0: no cap)
//	ARGV[4] -> queue name; ARGV[5] -> "1" to recover unacked list items
//	ARGV[6] -> ack timeout, ms; ARGV[7] -> max attempts (deliveries)
//
// Stream entries carry id, deadline (ms), queue and payload (a delivery
// count lives in each consumer group's pending entries list); list items
// are JSON {"id","deadline_ms","payload"}. A forwarded task's payload
// leaves {queue}:payload with it, unless a dead letter of the same id
// exists (the producer reused the id): it keeps the payload for a requeue.
//
// Recovery (reliable lists): an item taken at least ack timeout ago and
// not acknowledged goes back to the ready list, unless it has been taken
// max attempts times: then it is dead-lettered as "failed", its payload
// back in {queue}:payload (HSETNX: a newer task of the same id keeps its
// own) so that GET shows it and a requeue runs it again. An item recorded
// as taken but still in the ready list (a take refused before it moved
// the item, see takeScript) was never delivered: its records go, and the
// item moves to the ready list's end, taken next, with no attempt spent.
//
// A capped ready list (list, ARGV[3] > 0) takes due tasks only while it
// holds fewer than ARGV[3] items: the rest stay in the queue, due, exactly
// as they were (no attempt spent, not dead-lettered), and move once
// consumers have drained the list. Recovered items go back regardless, so
// the list can hold up to the cap plus the items consumers had taken.
//
// Returns the claim script's shape {now, next deadline or -1, next
// recovery or -1, {}, dead (serial, reason), paused} plus the number
// forwarded and recovered (redelivered or dead-lettered), per task
// forwarded how late (ms, now minus its deadline), and 1 if the ready list
// was full while tasks were due (else 0).
var forwardScript = redis.NewScript(luaValidSerial + luaHelpers + luaSplitListItem + `
local now = now_ms()
local function head()
  local h = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if h[2] then return tonumber(h[2]) end
  return -1
end
local ack, maxAttempts = tonumber(ARGV[6]), tonumber(ARGV[7])
local function nextRecovery()
  if ARGV[5] ~= '1' then return -1 end
  local h = redis.call('ZRANGE', KEYS[7], 0, 0, 'WITHSCORES')
  if h[2] then return tonumber(h[2]) + ack end
  return -1
end
if redis.call('EXISTS', KEYS[3]) == 1 then
  return {now, head(), nextRecovery(), {}, {}, 1, 0, 0, {}, 0}
end
local limit = tonumber(ARGV[2])
local full = 0
local recovered, late = 0, {}
local dead, n = {}, 0
if ARGV[5] == '1' then
  local late = redis.call('ZRANGE', KEYS[7], '-inf', now - ack, 'BYSCORE', 'LIMIT', 0, limit)
  for _, id in ipairs(late) do
    -- The delivery's number goes first (see takeScript): no ack matches
    -- it from here on, and a refusal after it leaves records the next
    -- recovery returns.
    redis.call('HDEL', KEYS[11], id)
    local body = redis.call('HGET', KEYS[8], id)
    if body then
      -- An item recorded as taken that is not in the processing list but
      -- still in the ready list was never delivered (a take refused
      -- before its LMOVE): it goes to the ready list's end, once, and is
      -- not dead-lettered. The ready list is searched only then; an item
      -- in neither list (a recovery, or an ack, refused after its LREM)
      -- is recovered as ever. Its records go last, so a refusal between
      -- the LREM and the RPUSH leaves it for the next recovery.
      local fresh = redis.call('LREM', KEYS[9], 1, body) == 0 and redis.call('LREM', KEYS[4], -1, body) == 1
      local taken = tonumber(redis.call('HGET', KEYS[10], id) or '0')
      if taken >= maxAttempts and not fresh then
        local _, d, payload = split_item(body)
        redis.call('ZADD', KEYS[5], now, id)
        redis.call('HSET', KEYS[6], id, 'failed|' .. taken .. '|' .. (d or '0') ..
          '|taken ' .. taken .. ' times, never acknowledged within ack_timeout')
        if payload then redis.call('HSETNX', KEYS[2], id, payload) end
        redis.call('HDEL', KEYS[10], id)
        dead[#dead+1] = id; dead[#dead+1] = 'failed'
      else
        redis.call('RPUSH', KEYS[4], body)
      end
    end
    -- The record goes before the entry: an entry alone is dropped by the
    -- next recovery, a record alone no recovery reaches, and every take
    -- would pass its id over.
    redis.call('HDEL', KEYS[8], id)
    redis.call('ZREM', KEYS[7], id)
    recovered = recovered + 1
  end
end
local take = limit
local cap = tonumber(ARGV[3])
if ARGV[1] == 'list' and cap > 0 then
  take = math.min(limit, cap - redis.call('LLEN', KEYS[4]))
  if take <= 0 then
    take = 0
    local h = head()
    if h >= 0 and h <= now then full = 1 end
  end
end
local due = {}
if take > 0 then
  due = redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, take, 'WITHSCORES')
end
-- Each task is delivered (or dead-lettered) before it leaves the queue
-- key, and its payload goes after that (see the doc comment). Whether a
-- dead letter keeps the payload is read before the first write: refused
-- there, nothing of the task is written.
for i = 1, #due, 2 do
  local id, d = due[i], tonumber(due[i+1])
  local payload = redis.call('HGET', KEYS[2], id) or 'null'
  if not valid_serial(id) or d ~= math.floor(d) or d < 946684800000 then
    local reason = 'malformed'
    if valid_serial(id) and d == math.floor(d) then reason = 'score_out_of_range' end
    redis.call('ZADD', KEYS[5], now, id)
    redis.call('HSET', KEYS[6], id, reason .. '|0|' .. due[i+1] .. '|')
    redis.call('ZREM', KEYS[1], id)
    dead[#dead+1] = id; dead[#dead+1] = reason
  else
    local keep = redis.call('ZSCORE', KEYS[5], id)
    if ARGV[1] == 'stream' then
      redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[3], '*', 'id', id, 'deadline', d,
        'queue', ARGV[4], 'payload', payload)
    else
      redis.call('LPUSH', KEYS[4], '{"id":' .. cjson.encode(id) .. ',"deadline_ms":' .. d .. ',"payload":' .. payload .. '}')
    end
    redis.call('ZREM', KEYS[1], id)
    if not keep then redis.call('HDEL', KEYS[2], id) end
    n = n + 1
    late[n] = now - d
  end
end
return {now, head(), nextRecovery(), {}, dead, 0, n, recovered, late, full}
`)

// ForwardArgs are a forward's parameters (forwardScript).
type ForwardArgs struct {
	Kind        string        // "stream" (to Keys.Stream) or "list" (to Keys.Ready)
	Limit       int           // most tasks to forward
	MaxLen      int64         // stream: approximate cap (XADD MAXLEN ~); list: most items in the ready list (0: no cap)
	Queue       string        // the queue's name, written into each stream entry
	Reliable    bool          // recover unacknowledged list items
	AckTimeout  time.Duration // how long a taken list item may stay unacknowledged
	MaxAttempts int           // deliveries after which a recovered item is dead-lettered
}

// ForwardResult is what a forward did. Its ClaimResult has no Items;
// NextExpiry is the next recovery of a reliable list.
type ForwardResult struct {
	ClaimResult
	Forwarded int             // tasks moved into the stream or the ready list
	Recovered int             // unacknowledged list items redelivered or dead-lettered
	Late      []time.Duration // per task forwarded, how late (Redis's clock minus its deadline)
	Full      bool            // the ready list was full while tasks were due
}

// Forward moves due tasks into the queue's stream or ready list (see
// forwardScript).
func (s *Store) Forward(ctx context.Context, a ForwardArgs) (ForwardResult, error) {
	k := s.keys
	target := k.Stream
	if a.Kind == "list" {
		target = k.Ready
	}
	raw, err := forwardScript.Run(ctx, s.rdb,
		[]string{k.Queue, k.Payload, k.Paused, target, k.Dead, k.DeadInfo, k.Unacked, k.Taken, k.Processing, k.Deliveries,
			k.DeliveryIDs},
		a.Kind, a.Limit, a.MaxLen, a.Queue, boolArg(a.Reliable), a.AckTimeout.Milliseconds(), a.MaxAttempts).Slice()
	if err != nil {
		return ForwardResult{}, fmt.Errorf("forward: %w", err)
	}
	if len(raw) != 10 {
		return ForwardResult{}, fmt.Errorf("forward: %w: %d fields, want 10", ErrReply, len(raw))
	}
	n, ok1 := raw[6].(int64)
	recovered, ok2 := raw[7].(int64)
	late, ok3 := raw[8].([]any)
	full, ok4 := raw[9].(int64)
	if !ok1 || !ok2 || !ok3 || !ok4 {
		return ForwardResult{}, fmt.Errorf("forward: %w: counts", ErrReply)
	}
	cr, err := parseClaim(raw[:6])
	if err != nil {
		return ForwardResult{}, fmt.Errorf("forward: %w", err)
	}
	res := ForwardResult{ClaimResult: cr, Forwarded: int(n), Recovered: int(recovered), Full: full == 1,
		Late: make([]time.Duration, 0, len(late))}
	for _, l := range late {
		if ms, ok := l.(int64); ok {
			res.Late = append(res.Late, time.Duration(ms)*time.Millisecond)
		}
	}
	return res, nil
}
