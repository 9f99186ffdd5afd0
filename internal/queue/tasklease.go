package queue

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// The lease operations of a poll queue beyond the claim and AckTasks, for
// the HTTP API and the Go worker library (package worker): extend a lease
// while a handler runs, retry after a delay, dead-letter now, and hand back
// tasks that were never started. Each is a compare-and-set on the lease
// token a poll's claim handed out (NewPollToken), so a task whose lease
// expired and was taken by another poll or worker, or that a producer
// moved or deleted, is left alone.

// PollTokenPrefix starts every token NewPollToken makes; pollTokenChars
// base32 characters (rand.Text's 128 bits) follow.
const (
	PollTokenPrefix = "poll."
	pollTokenChars  = 26
)

// ErrInvalidPollToken: a token that no poll can have handed out (the retry
// marker "-", a replica's own lease token, anything else).
var ErrInvalidPollToken = errors.New("not a poll's lease token")

// NewPollToken is the lease token of one poll: 128 bits from crypto/rand,
// so no one can guess it and no other poll holds it.
func NewPollToken() string { return PollTokenPrefix + rand.Text() }

// ValidPollToken reports whether tok has the shape of a token NewPollToken
// makes.
func ValidPollToken(tok string) bool {
	rest, ok := strings.CutPrefix(tok, PollTokenPrefix)
	if !ok || len(rest) != pollTokenChars {
		return false
	}
	for _, r := range rest {
		if (r < 'A' || r > 'Z') && (r < '2' || r > '7') {
			return false
		}
	}
	return true
}

// extendScript moves the lease expiry of tasks still leased under a token.
//
//	KEYS[1] -> {queue}:inflight  KEYS[2] -> {queue}:lease
//	ARGV[1] -> lease token; ARGV[2] -> lease, ms; ARGV[3..] -> task ids
//
// Compare-and-set as finishScript: a task is extended only while its lease
// record carries the token (a lease that ran out but that no claim has
// taken yet is still the token's, and is extended) and it is in
// {queue}:inflight. Returns the Redis clock (ms) and the ids extended.
var extendScript = redis.NewScript(luaHelpers + `
local now = now_ms()
local at = now + tonumber(ARGV[2])
local out = {}
for _, e in ipairs(owned(KEYS[2], ARGV[1], 3)) do
  if redis.call('ZSCORE', KEYS[1], e[1]) then
    redis.call('ZADD', KEYS[1], at, e[1])
    out[#out+1] = e[1]
  end
end
return {now, out}
`)

// releaseScript hands back leased tasks that were never started, keeping
// their attempt count.
//
//	KEYS[1] -> queue  KEYS[2] -> {queue}:inflight  KEYS[3] -> {queue}:deadlines
//	KEYS[4] -> {queue}:lease
//	ARGV[1] -> lease token; ARGV[2..] -> task ids
//
// Compare-and-set as finishScript. A task with no attempt spent and no
// last error goes back into the queue key with its true deadline, as
// handBackScript does (ZADD NX keeps an entry a producer wrote meanwhile).
// Any other becomes a backoff due now (token "-", expiry now), so its
// attempts survive (and a last error, though a claim clears it): the next claim, by a poll or a worker,
// takes it at once without counting an attempt. Returns the number handed
// back.
//
// A task goes back into the queue key before its lease goes: a script's
// writes stay when a later command fails (an ACL tightened at runtime),
// so a refusal leaves it leased or queued (or both: the claim drops the
// stale lease), never in neither.
var releaseScript = redis.NewScript(luaHelpers + `
local now = now_ms()
local n = 0
for _, e in ipairs(owned(KEYS[4], ARGV[1], 2)) do
  local s, d, a = e[1], e[2], e[3]
  local _, _, _, err = parse(redis.call('HGET', KEYS[4], s))
  if a == 0 and (err == nil or err == '') then
    redis.call('ZADD', KEYS[1], 'NX', d, s)
    redis.call('HDEL', KEYS[4], s)
    redis.call('ZREM', KEYS[2], s)
    redis.call('ZREM', KEYS[3], s)
  else
    redis.call('HSET', KEYS[4], s, d .. '|' .. a .. '|-|' .. (err or ''))
    redis.call('ZADD', KEYS[2], now, s)
  end
  n = n + 1
end
return n
`)

// pollAckScript completes polled tasks leased under a token.
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
var pollAckScript = redis.NewScript(luaHelpers + `
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
// and returns those it did not complete — no longer leased under token
// (the lease expired and another poll took the task, or it was acked
// already, or a producer moved it) — and, for each completed task, how
// late it was acknowledged (Redis's clock minus its deadline), for
// orderdelay_task_lateness_seconds. A token no poll can have handed out is
// ErrInvalidPollToken.
func (s *Store) AckTasks(ctx context.Context, token string, ids []string) ([]string, []time.Duration, error) {
	if !ValidPollToken(token) {
		return nil, nil, ErrInvalidPollToken
	}
	k := s.keys
	args := scriptArgs(ids, token)
	done, err := pollAckScript.Run(ctx, s.rdb, []string{k.Queue, k.Inflight, k.Deadlines, k.Lease, k.Payload, k.Dead}, args...).Int64Slice()
	if err != nil {
		return nil, nil, fmt.Errorf("ack: %w", err)
	}
	if len(done) != len(ids)+1 {
		return nil, nil, fmt.Errorf("ack: %w: %d answers for %d ids", ErrReply, len(done), len(ids))
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

// ExtendTasks extends, to lease from now on Redis's clock, the leases of
// the tasks ids (distinct) still leased under token, and returns those it
// could not extend: their lease was lost (another claim took them after it
// expired, a producer moved or deleted them, or they were settled). A token
// no poll can have handed out is ErrInvalidPollToken.
func (s *Store) ExtendTasks(ctx context.Context, token string, lease time.Duration, ids []string) ([]string, error) {
	if !ValidPollToken(token) {
		return nil, ErrInvalidPollToken
	}
	if len(ids) == 0 {
		return nil, nil
	}
	k := s.keys
	args := scriptArgs(ids, token, lease.Milliseconds())
	raw, err := extendScript.Run(ctx, s.rdb, []string{k.Inflight, k.Lease}, args...).Slice()
	if err != nil {
		return nil, fmt.Errorf("extend lease: %w", err)
	}
	if len(raw) != 2 {
		return nil, fmt.Errorf("extend lease: %w: %d fields, want 2", ErrReply, len(raw))
	}
	got, ok := raw[1].([]any)
	if !ok {
		return nil, fmt.Errorf("extend lease: %w: ids", ErrReply)
	}
	kept := make(map[string]bool, len(got))
	for _, v := range got {
		s, ok := v.(string)
		if !ok {
			return nil, fmt.Errorf("extend lease: %w: id", ErrReply)
		}
		kept[s] = true
	}
	var lost []string
	for _, id := range ids {
		if !kept[id] {
			lost = append(lost, id)
		}
	}
	return lost, nil
}

// RetryTasks turns the leases of tasks ids still leased under token into
// backoffs due after delay (on Redis's clock), spending one attempt and
// recording lastErr, as a daemon's failed action does. Any poll or worker
// claims them when the delay is over. It returns how many it moved; the
// others' lease was lost.
func (s *Store) RetryTasks(ctx context.Context, token string, delay time.Duration, lastErr string, ids []string) (int, error) {
	if !ValidPollToken(token) {
		return 0, ErrInvalidPollToken
	}
	res, err := s.Retry(ctx, RetryArgs{Token: token, Serials: ids, Delay: max(delay, 0), Spend: true, LastError: lastErr})
	return res.Moved, err
}

// BuryTasks dead-letters tasks ids still leased under token with reason
// and lastErr; the record's attempts include the one that failed. The
// payload stays, so GET shows the task and a requeue runs it again. It
// returns how many it moved; the others' lease was lost.
func (s *Store) BuryTasks(ctx context.Context, token, reason, lastErr string, ids []string) (int, error) {
	if !ValidPollToken(token) {
		return 0, ErrInvalidPollToken
	}
	return s.Bury(ctx, BuryArgs{Token: token, Serials: ids, Reason: reason, LastError: lastErr, CountRun: true})
}

// ReleaseTasks hands back tasks ids still leased under token that were
// never started (see releaseScript): they are due again at once, for any
// poll or worker, with their attempts unchanged. It returns how many it
// handed back.
func (s *Store) ReleaseTasks(ctx context.Context, token string, ids []string) (int, error) {
	if !ValidPollToken(token) {
		return 0, ErrInvalidPollToken
	}
	return s.Release(ctx, token, ids)
}

// Release hands back tasks ids still leased under token, the daemon's own
// or a poll's, keeping what they have spent (see releaseScript): a task
// never run, or one whose runs left nothing, goes back into the queue key
// with its true deadline; any other is due again at once as a backoff
// with its attempts. It returns how many it handed back. HandBack, which
// the order queue uses, drops the lease record and its attempts with it.
func (s *Store) Release(ctx context.Context, token string, ids []string) (int, error) {
	k := s.keys
	args := scriptArgs(ids, token)
	n, err := releaseScript.Run(ctx, s.rdb, []string{k.Queue, k.Inflight, k.Deadlines, k.Lease}, args...).Int()
	if err != nil {
		return 0, fmt.Errorf("hand back: %w", err)
	}
	return n, nil
}
