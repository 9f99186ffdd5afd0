package consumer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Task is a claimed task of a named queue.
type Task struct {
	ID       string          `json:"id"`
	Deadline time.Time       `json:"deadline"`
	Attempts int             `json:"attempts"` // failed attempts so far
	Payload  json.RawMessage `json:"payload"`
}

// ProcessFunc runs a queue's action on claimed tasks and returns one error
// per task: nil, done; an error, an attempt spent (retried by the queue's
// policy, dead-lettered after MaxAttempts); an error wrapped by
// Unavailable or Later, retried without spending an attempt (see
// NoAttemptError). It must return within ctx's deadline.
type ProcessFunc func(ctx context.Context, tasks []Task) []error

// ReasonFailed dead-letters a task whose action kept failing.
const ReasonFailed = "failed"

// processTasks is process for task queues: the action runs, done tasks are
// removed with their payloads, failed ones are retried by the queue's
// policy and dead-lettered as "failed" after MaxAttempts.
func (c *Consumer) processTasks(workCtx, ctx context.Context, items []item) {
	tasks, err := c.loadTasks(items)
	if err != nil {
		c.m.Errors.WithLabelValues(metrics.StageClaim).Inc()
		c.log.Warn("reading task payloads failed; the tasks return when their lease expires", zap.Error(err))
		return
	}
	errs := c.cfg.Process(c.withHeld(ctx, items), tasks)
	if len(errs) != len(tasks) {
		errs = make([]error, len(tasks))
		for i := range errs {
			errs[i] = errors.New("action returned no outcome")
		}
	}
	now := c.now()
	var done, later, down []item
	var laterErr, downErr error
	failed := map[int][]item{} // by attempts after this one
	lastErr := map[int]string{}
	for i, it := range items {
		if errs[i] == nil {
			done = append(done, it)
			c.m.Lateness.Observe(now.Sub(time.UnixMilli(it.deadline)).Seconds())
			continue
		}
		if workCtx.Err() != nil {
			c.handBack([]item{it})
			continue
		}
		if na := noAttempt(errs[i]); na != nil { // see NoAttemptError
			if na.Unavailable {
				down, downErr = append(down, it), na.Err
			} else {
				later, laterErr = append(later, it), na.Err
			}
			continue
		}
		a := it.attempts + 1
		failed[a] = append(failed[a], it)
		lastErr[a] = errs[i].Error()
	}
	c.finish(done)
	c.m.Closed.Add(float64(len(done)))
	for a, group := range failed {
		c.m.Errors.WithLabelValues(metrics.StageClose).Add(float64(len(group)))
		if a >= c.cfg.MaxAttempts {
			c.bury(group, ReasonFailed, lastErr[a])
			continue
		}
		delay := time.Second << min(a-1, 10)
		if c.cfg.Retry != nil {
			delay = c.cfg.Retry(a)
		}
		c.retry(group, delay, true, lastErr[a])
	}
	if len(done) > 0 && len(down) == 0 {
		c.pgBackReset()
	}
	c.retryNoAttempt(workCtx, later, down, laterErr, downErr)
}

// loadTasks reads the payloads of claimed items.
func (c *Consumer) loadTasks(items []item) ([]Task, error) {
	ctx, cancel := bookkeeping()
	defer cancel()
	vals, err := c.rdb.HMGet(ctx, c.cfg.Keys.Payload, serialsOf(items)...).Result()
	if err != nil {
		return nil, err
	}
	tasks := make([]Task, len(items))
	for i, it := range items {
		tasks[i] = Task{ID: it.serial, Deadline: time.UnixMilli(it.deadline), Attempts: it.attempts, Payload: json.RawMessage("null")}
		if s, ok := vals[i].(string); ok {
			tasks[i].Payload = json.RawMessage(s)
		}
	}
	return tasks, nil
}

// Forward configures a stream or list action.
type Forward struct {
	Kind  string // "stream" or "list"
	Queue string // queue name, written into each stream entry
	// MaxLen, stream: approximate cap (XADD MAXLEN ~). List: most items
	// the ready list may hold; while it holds that many, due tasks stay in
	// the queue (0: no cap).
	MaxLen int64
	// Reliable list: taken items not acknowledged within AckTimeout return
	// to the ready list (recovered in the same script), or are
	// dead-lettered once taken Config.MaxAttempts times.
	Reliable bool
	// AckTimeout is how long a taken list item or a delivered stream entry
	// may stay unacknowledged before that delivery counts as failed.
	AckTimeout time.Duration
}

// DefaultAckTimeout is a stream or reliable list queue's ack_timeout when
// Forward.AckTimeout is zero.
const DefaultAckTimeout = 5 * time.Minute

// ackTimeout is the Forward's ack timeout, or its default.
func (c *Consumer) ackTimeout() time.Duration {
	if c.cfg.Forward == nil || c.cfg.Forward.AckTimeout <= 0 {
		return DefaultAckTimeout
	}
	return c.cfg.Forward.AckTimeout
}

// forwardScript moves due tasks into the queue's stream or ready list in
// one atomic step: a task is either still queued or delivered, never both
// and never neither.
//
//	KEYS[1] -> queue  KEYS[2] -> {queue}:payload  KEYS[3] -> {queue}:paused
//	KEYS[4] -> {queue}:stream or {queue}:ready
//	KEYS[5] -> {queue}:dead  KEYS[6] -> {queue}:deadinfo
//	KEYS[7] -> {queue}:unacked  KEYS[8] -> {queue}:taken  KEYS[9] -> {queue}:processing
//	KEYS[10] -> {queue}:deliveries
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
// own) so that GET shows it and a requeue runs it again.
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
var forwardScript = redis.NewScript(queue.LuaValidSerial + queue.LuaLeaseHelpers + queue.LuaSplitListItem + `
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
    local body = redis.call('HGET', KEYS[8], id)
    if body then
      redis.call('LREM', KEYS[9], 1, body)
      local taken = tonumber(redis.call('HGET', KEYS[10], id) or '0')
      if taken >= maxAttempts then
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
    redis.call('ZREM', KEYS[7], id)
    redis.call('HDEL', KEYS[8], id)
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
for i = 1, #due, 2 do
  local id, d = due[i], tonumber(due[i+1])
  redis.call('ZREM', KEYS[1], id)
  local payload = redis.call('HGET', KEYS[2], id) or 'null'
  if not valid_serial(id) or d ~= math.floor(d) or d < 946684800000 then
    local reason = 'malformed'
    if valid_serial(id) and d == math.floor(d) then reason = 'score_out_of_range' end
    redis.call('ZADD', KEYS[5], now, id)
    redis.call('HSET', KEYS[6], id, reason .. '|0|' .. due[i+1] .. '|')
    dead[#dead+1] = id; dead[#dead+1] = reason
  else
    if ARGV[1] == 'stream' then
      redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[3], '*', 'id', id, 'deadline', d,
        'queue', ARGV[4], 'payload', payload)
    else
      redis.call('LPUSH', KEYS[4], '{"id":' .. cjson.encode(id) .. ',"deadline_ms":' .. d .. ',"payload":' .. payload .. '}')
    end
    if not redis.call('ZSCORE', KEYS[5], id) then redis.call('HDEL', KEYS[2], id) end
    n = n + 1
    late[n] = now - d
  end
end
return {now, head(), nextRecovery(), {}, dead, 0, n, recovered, late, full}
`)

func boolArg(b bool) string {
	if b {
		return "1"
	}
	return "0"
}

// forward is claim for stream and list actions.
func (c *Consumer) forward(ctx context.Context, limit int) (claimResult, error) {
	k, f := c.cfg.Keys, c.cfg.Forward
	target := k.Stream
	if f.Kind == "list" {
		target = k.Ready
	}
	raw, err := forwardScript.Run(ctx, c.rdb,
		[]string{k.Queue, k.Payload, k.Paused, target, k.Dead, k.DeadInfo, k.Unacked, k.Taken, k.Processing, k.Deliveries},
		f.Kind, limit, f.MaxLen, f.Queue, boolArg(f.Reliable), c.ackTimeout().Milliseconds(), c.cfg.MaxAttempts).Slice()
	if err != nil {
		return claimResult{}, fmt.Errorf("forward: %w", err)
	}
	if len(raw) != 10 {
		return claimResult{}, fmt.Errorf("forward: %w: %d fields, want 10", errReply, len(raw))
	}
	n, ok1 := raw[6].(int64)
	recovered, ok2 := raw[7].(int64)
	late, ok3 := raw[8].([]any)
	full, ok4 := raw[9].(int64)
	if !ok1 || !ok2 || !ok3 || !ok4 {
		return claimResult{}, fmt.Errorf("forward: %w: counts", errReply)
	}
	// Forwarding is a stream or list task's last step the daemon sees:
	// its lateness is measured there.
	for _, l := range late {
		if ms, ok := l.(int64); ok {
			c.m.Lateness.Observe(float64(ms) / 1000)
		}
	}
	parsed, err := queue.ParseClaim(raw[:6])
	if err != nil {
		return claimResult{}, fmt.Errorf("forward: %w", err)
	}
	res := fromStore(parsed, "")
	res.forwarded = int(n)
	c.readyFull(&res, full == 1)
	c.m.Claimed.Add(float64(n))
	c.m.Forwarded.Add(float64(n))
	for reason, k := range res.dead {
		c.m.DeadLettered.WithLabelValues(reason).Add(float64(k))
	}
	if recovered > 0 {
		c.log.Info("unacknowledged list items redelivered or dead-lettered", zap.Int64("count", recovered),
			zap.Int("dead_lettered", res.dead[ReasonFailed]))
	}
	if f.Kind == "stream" && !res.paused {
		c.sweepStream(ctx, res.now)
	}
	return res, nil
}

// TaskOverheadBytes bounds the JSON encoding of a Task (with HTML
// escaping off) beyond its payload and twice its id: the field names, a
// deadline of at most 37 bytes quoted, an attempt count of at most 20, and
// the comma and newline between tasks of a poll's answer; 103 bytes in all,
// rounded up.
const TaskOverheadBytes = 128

// maxPollClaims bounds the claims of one poll that take only tasks over
// their attempts (each such claim dead-letters what it took).
const maxPollClaims = 8

// ClaimTasks leases up to limit due tasks of a polled queue for lease,
// under a token of this call's own, counting a redelivery after an expired
// lease as an attempt. maxBytes > 0 bounds the tasks' encoded size (each
// costs its payload, twice its id and TaskOverheadBytes); tasks past it are
// left due and untouched, but the first is taken whatever its size. Tasks
// over maxAttempts are dead-lettered as failed instead of returned. It
// returns the tasks and the lease token that acknowledges them ("" with no
// tasks).
func ClaimTasks(ctx context.Context, rdb redis.UniversalClient, k queue.Keys, limit, maxBytes int, lease time.Duration,
	maxAttempts int, m *metrics.Metrics, log *zap.Logger) ([]Task, string, error) {
	// Polled tasks are held by the consumer that polled, not this replica.
	mm := *m
	mm.Inflight = prometheus.NewGauge(prometheus.GaugeOpts{Name: "unused"})
	c := New(Config{Keys: k, BatchSize: limit, Lease: lease, Owner: "poll", MaxAttempts: maxAttempts,
		CountRedeliveries: true, Process: func(context.Context, []Task) []error { return nil }}, rdb, nil, &mm, log)
	tok := queue.NewPollToken()
	for range maxPollClaims {
		res, err := c.claimAs(ctx, limit, tok, maxBytes)
		if err != nil {
			return nil, "", err
		}
		if len(res.items) == 0 {
			return nil, "", nil
		}
		var give, over []item
		for _, it := range res.items {
			if it.attempts >= maxAttempts {
				over = append(over, it)
			} else {
				give = append(give, it)
			}
		}
		if len(over) > 0 {
			c.buryCounted(over, ReasonFailed, "not acknowledged within its lease, max attempts reached")
		}
		if len(give) > 0 {
			tasks, err := c.loadTasks(give)
			return tasks, tok, err
		}
		// All it took was over its attempts: claim again, so a poll does
		// not come back empty while tasks are due.
	}
	return nil, "", nil
}

// ackScript completes polled tasks leased under a token.
//
//	KEYS[1] -> queue  KEYS[2] -> {queue}:inflight  KEYS[3] -> {queue}:deadlines
//	KEYS[4] -> {queue}:lease  KEYS[5] -> {queue}:payload  KEYS[6] -> {queue}:dead
//	ARGV[1] -> lease token; ARGV[2..] -> task ids
//
// Compare-and-set: only a task whose lease record carries the token is
// completed. A task whose lease expired and was polled again carries the
// new poll's token, a task moved by a producer through the API has no
// record: both are left alone. A task a producer re-added with a raw ZADD
// during the lease is in the queue key again: its lease ends, its queue
// entry and payload stay; so does the payload of an id that also has a
// dead letter (the producer reused the id: the dead letter keeps it for a
// requeue). Returns Redis's clock (Unix ms) and then, per id, the
// completed task's deadline (Unix ms, so above zero), else 0.
var ackScript = redis.NewScript(queue.LuaLeaseHelpers + `
local out = {now_ms()}
for i = 2, #ARGV, 500 do
  local last = math.min(i + 499, #ARGV)
  local recs = redis.call('HMGET', KEYS[4], unpack(ARGV, i, last))
  local qs = redis.call('ZMSCORE', KEYS[1], unpack(ARGV, i, last))
  for j = 1, #recs do
    local id = ARGV[i + j - 1]
    local d, _, tok = parse(recs[j] or nil)
    if tok == ARGV[1] then
      redis.call('HDEL', KEYS[4], id)
      redis.call('ZREM', KEYS[2], id)
      redis.call('ZREM', KEYS[3], id)
      if not qs[j] and not redis.call('ZSCORE', KEYS[6], id) then redis.call('HDEL', KEYS[5], id) end
      out[#out+1] = math.max(tonumber(d) or 1, 1)
    else
      out[#out+1] = 0
    end
  end
end
return out
`)

// AckTasks completes the polled tasks ids (distinct) leased under token
// and returns those it did not complete: no longer leased under token
// (the lease expired and another poll took the task, or it was acked
// already, or a producer moved it). A token no poll can have handed out is
// ErrInvalidPollToken.
func AckTasks(ctx context.Context, rdb redis.Scripter, k queue.Keys, token string, ids []string) ([]string, error) {
	missed, _, err := AckTasksLateness(ctx, rdb, k, token, ids)
	return missed, err
}

// AckTasksLateness is AckTasks that also returns, for each completed task,
// how late it was acknowledged (Redis's clock minus its deadline), for
// orderdelay_task_lateness_seconds.
func AckTasksLateness(ctx context.Context, rdb redis.Scripter, k queue.Keys, token string, ids []string) ([]string, []time.Duration, error) {
	if !queue.ValidPollToken(token) {
		return nil, nil, queue.ErrInvalidPollToken
	}
	args := append([]any{token}, anys(ids)...)
	done, err := ackScript.Run(ctx, rdb, []string{k.Queue, k.Inflight, k.Deadlines, k.Lease, k.Payload, k.Dead}, args...).Int64Slice()
	if err != nil {
		return nil, nil, fmt.Errorf("ack: %w", err)
	}
	if len(done) != len(ids)+1 {
		return nil, nil, fmt.Errorf("ack: %w: %d answers for %d ids", errReply, len(done), len(ids))
	}
	now := done[0]
	var missed []string
	var late []time.Duration
	for i, d := range done[1:] {
		if d <= 0 {
			missed = append(missed, ids[i])
			continue
		}
		late = append(late, time.Duration(now-d)*time.Millisecond)
	}
	return missed, late, nil
}
