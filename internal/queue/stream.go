package queue

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// Stream queues: the "stream" action forwards due tasks to {Q}:stream,
// where consumer groups read them. Redis counts each entry's deliveries
// in each group's pending entries list; the daemon reads them here and
// dead-letters entries that used up their deliveries (BuryStreamEntries).

// StreamGroup is a consumer group of a queue's stream.
type StreamGroup struct {
	Name    string
	Pending int64 // entries delivered and not acknowledged
}

// StreamGroups returns the consumer groups of the queue's stream; none
// when nothing was forwarded yet (no stream).
func (s *Store) StreamGroups(ctx context.Context) ([]StreamGroup, error) {
	groups, err := s.rdb.XInfoGroups(ctx, s.keys.Stream).Result()
	// HasErrorPrefix strips the reply's "ERR " before comparing, so the
	// prefix must not carry it: with it, this never matched.
	if redis.HasErrorPrefix(err, "no such key") {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	out := make([]StreamGroup, len(groups))
	for i, g := range groups {
		out[i] = StreamGroup{Name: g.Name, Pending: g.Pending}
	}
	return out, nil
}

// StreamPending returns up to count of group's pending entries idle for at
// least idle, from start ("-": the first; "(id": after id).
func (s *Store) StreamPending(ctx context.Context, group string, idle time.Duration, start string, count int64) ([]redis.XPendingExt, error) {
	return s.rdb.XPendingExt(ctx, &redis.XPendingExtArgs{
		Stream: s.keys.Stream, Group: group, Idle: idle, Start: start, End: "+", Count: count,
	}).Result()
}

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
//
// The entry is acknowledged last, once its task is dead-lettered with its
// payload: a script's writes stay when a later command fails (an ACL
// tightened at runtime), so a refusal leaves it pending (the next pass
// dead-letters it again, which changes nothing but the time), never
// acknowledged with its task nowhere.
var streamBuryScript = redis.NewScript(luaNowMS + `
local now = now_ms()
local group = string.gsub(ARGV[1], '|', '/')
local maxAttempts = tonumber(ARGV[3])
local buried, gone = 0, 0
for i = 4, #ARGV do
  local eid = ARGV[i]
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', ARGV[2], eid, eid, 1)
  if p[1] and tonumber(p[1][4]) >= maxAttempts then
    local count = tonumber(p[1][4])
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
    redis.call('XACK', KEYS[1], ARGV[1], eid)
  end
end
return {buried, gone}
`)

// StreamBury is what BuryStreamEntries did.
type StreamBury struct {
	DeadLettered int // tasks dead-lettered as failed
	Gone         int // exhausted entries acknowledged whose entry was trimmed away (or had no id)
}

// BuryStreamEntries dead-letters the entries ids of group that are still
// pending, idle for at least ackTimeout and delivered at least maxAttempts
// times (see streamBuryScript); the others are left alone.
func (s *Store) BuryStreamEntries(ctx context.Context, group string, ackTimeout time.Duration, maxAttempts int, ids []string) (StreamBury, error) {
	k := s.keys
	args := scriptArgs(ids, group, ackTimeout.Milliseconds(), maxAttempts)
	v, err := streamBuryScript.Run(ctx, s.rdb, []string{k.Stream, k.Dead, k.DeadInfo, k.Payload}, args...).Int64Slice()
	if err != nil {
		return StreamBury{}, err
	}
	if len(v) != 2 {
		return StreamBury{}, fmt.Errorf("%w: %d fields, want 2", ErrReply, len(v))
	}
	return StreamBury{DeadLettered: int(v[0]), Gone: int(v[1])}, nil
}
