package consumer

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/metrics"
)

// Stream queues: Redis counts the deliveries of every entry in each
// consumer group's pending entries list (XREADGROUP delivers once,
// XAUTOCLAIM and XCLAIM once more each). The daemon reads those counts and
// dead-letters an entry that was delivered max_attempts times and then
// left unacknowledged for the queue's ack_timeout, instead of letting
// consumers reclaim it forever.

// streamSweepEvery bounds how often a stream queue's groups are swept.
const streamSweepEvery = time.Second

// streamBuryScript dead-letters stream entries that used up their
// deliveries in one consumer group, re-checking each against the pending
// entries list so that an entry a consumer reclaimed (or acknowledged)
// since the caller looked is left alone.
//
//	KEYS[1] -> {queue}:stream  KEYS[2] -> {queue}:dead  KEYS[3] -> {queue}:deadinfo
//	KEYS[4] -> {queue}:payload
//	ARGV[1] -> group; ARGV[2] -> ack timeout, ms; ARGV[3] -> max attempts
//	ARGV[4..] -> entry ids
//
// An entry still pending, idle for at least the ack timeout and delivered
// at least max attempts times is acknowledged in that group (so no consumer
// reclaims it again) and its task dead-lettered as "failed" with the
// delivery count as attempts; the payload goes back to {queue}:payload
// (HSETNX: a newer task of the same id keeps its own), so GET shows it and
// a requeue runs it again. The entry itself stays in the stream for the
// other groups.
//
// Returns {dead-lettered, acknowledged without a task (the entry was
// trimmed from the stream or has no id field)}.
var streamBuryScript = redis.NewScript(luaHelpers + `
local now = now_ms()
local group = string.gsub(ARGV[1], '|', '/')
local maxAttempts = tonumber(ARGV[3])
local buried, gone = 0, 0
for i = 4, #ARGV do
  local eid = ARGV[i]
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', ARGV[2], eid, eid, 1)
  if p[1] and tonumber(p[1][4]) >= maxAttempts then
    local count = tonumber(p[1][4])
    redis.call('XACK', KEYS[1], ARGV[1], eid)
    local e = redis.call('XRANGE', KEYS[1], eid, eid)
    local id, d, payload
    if e[1] then
      local f = e[1][2]
      for j = 1, #f - 1, 2 do
        if f[j] == 'id' then id = f[j+1]
        elseif f[j] == 'deadline' then d = f[j+1]
        elseif f[j] == 'payload' then payload = f[j+1] end
      end
    end
    if id then
      redis.call('ZADD', KEYS[2], now, id)
      redis.call('HSET', KEYS[3], id, 'failed|' .. count .. '|' .. (d or '0') ..
        '|consumer group ' .. group .. ': delivered ' .. count .. ' times, never acknowledged within ack_timeout')
      if payload then redis.call('HSETNX', KEYS[4], id, payload) end
      buried = buried + 1
    else
      gone = gone + 1
    end
  end
end
return {buried, gone}
`)

// streamSweep is what one sweep of a stream queue's groups did.
type streamSweep struct {
	deadLettered int // tasks dead-lettered as failed
	gone         int // exhausted entries acknowledged whose entry was trimmed away
}

// sweepStream runs sweepStreamOnce at most every streamSweepEvery (on
// Redis's clock, redisNow in ms); a failure is logged and counted, and the
// next forward pass tries again.
func (c *Consumer) sweepStream(ctx context.Context, redisNow int64) {
	if redisNow-c.streamSwept < streamSweepEvery.Milliseconds() {
		return
	}
	c.streamSwept = redisNow
	res, err := c.sweepStreamOnce(ctx)
	if err != nil {
		if ctx.Err() == nil {
			c.m.Errors.WithLabelValues(metrics.StageClaim).Inc()
			c.log.Warn("sweeping the stream's pending entries failed; retried on the next pass", zap.Error(err))
		}
		return
	}
	if res.deadLettered+res.gone > 0 {
		c.m.DeadLettered.WithLabelValues(ReasonFailed).Add(float64(res.deadLettered))
		c.log.Info("stream entries delivered max_attempts times without an ack were dead-lettered",
			zap.Int("dead_lettered", res.deadLettered), zap.Int("trimmed", res.gone))
	}
}

// sweepStreamOnce looks at up to a batch of each group's pending entries
// idle for at least the ack timeout, continuing where the last sweep of
// that group stopped (so a long list of entries still being retried does
// not hide exhausted ones behind it), and dead-letters those delivered
// MaxAttempts times.
func (c *Consumer) sweepStreamOnce(ctx context.Context) (streamSweep, error) {
	k := c.cfg.Keys
	var out streamSweep
	groups, err := c.rdb.XInfoGroups(ctx, k.Stream).Result()
	if redis.HasErrorPrefix(err, "ERR no such key") {
		return out, nil // nothing forwarded yet
	}
	if err != nil {
		return out, fmt.Errorf("stream sweep: %w", err)
	}
	if c.pelCursor == nil {
		c.pelCursor = map[string]string{}
	}
	ack := c.ackTimeout()
	for _, g := range groups {
		if g.Pending == 0 {
			delete(c.pelCursor, g.Name)
			continue
		}
		start := c.pelCursor[g.Name]
		if start == "" {
			start = "-"
		}
		batch := int64(c.cfg.BatchSize)
		pend, err := c.rdb.XPendingExt(ctx, &redis.XPendingExtArgs{
			Stream: k.Stream, Group: g.Name, Idle: ack, Start: start, End: "+", Count: batch,
		}).Result()
		if err != nil {
			return out, fmt.Errorf("stream sweep: group %q: %w", g.Name, err)
		}
		if int64(len(pend)) < batch {
			delete(c.pelCursor, g.Name)
		} else {
			c.pelCursor[g.Name] = "(" + pend[len(pend)-1].ID
		}
		args := []any{g.Name, ack.Milliseconds(), c.cfg.MaxAttempts}
		for _, p := range pend {
			if p.RetryCount >= int64(c.cfg.MaxAttempts) {
				args = append(args, p.ID)
			}
		}
		if len(args) == 3 {
			continue
		}
		v, err := streamBuryScript.Run(ctx, c.rdb, []string{k.Stream, k.Dead, k.DeadInfo, k.Payload}, args...).Int64Slice()
		if err != nil {
			return out, fmt.Errorf("stream sweep: group %q: %w", g.Name, err)
		}
		if len(v) != 2 {
			return out, fmt.Errorf("stream sweep: %w: %d fields, want 2", errReply, len(v))
		}
		out.deadLettered += int(v[0])
		out.gone += int(v[1])
	}
	return out, nil
}
