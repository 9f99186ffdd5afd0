package queue

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// The order queue's producer side: enqueue (add, reschedule, move later,
// adopt into a shard), get and cancel, which package client validates and
// wraps for outside callers. Each reads or drops a lease record, so they
// live beside the lease scripts.

// ModeAdopt is the enqueue script's ModeCreate that publishes nothing: a
// sharded client moving an entry into its shard.
const ModeAdopt = "adopt"

// luaUnbatch is unbatch for the scripts that drop a lease record: it takes
// the record's member off its batch lease, if it has one (field "#"+token
// of {queue}:leasebatch counts the members a batch still holds; the
// claim script writes it), and drops the batch with its last
// member, so the gauges count no member twice. Refused at the HDEL, the
// batch's fields stay with no {queue}:leases entry, read by nothing (see
// unlease in luaHelpers). It needs luaTouch (record_token) before it.
const luaUnbatch = `
local function unbatch(leases, info, rec)
  if not rec then return end
  local tok = record_token(rec)
  if not tok or redis.call('HEXISTS', info, '#' .. tok) == 0 then return end
  if redis.call('HINCRBY', info, '#' .. tok, -1) <= 0 then
    redis.call('ZREM', leases, tok)
    redis.call('HDEL', info, tok, '#' .. tok, '<' .. tok)
  end
end
`

// maxPerCall bounds how many entries one enqueue script call writes, so a huge batch
// never blocks Redis for long.
const maxPerCall = 1000

// enqueueScript adds or moves entries.
//
//	KEYS[1] -> queue            KEYS[2] -> {queue}:lease
//	KEYS[3] -> {queue}:inflight KEYS[4] -> {queue}:deadlines
//	KEYS[5] -> {queue}:wake (channel)
//	KEYS[6] -> {queue}:leases KEYS[7] -> {queue}:leasebatch
//	ARGV[1] -> mode: "nx" | "set" | "later" | "adopt" (nx that publishes
//	           nothing: a sharded client moving an entry into its shard)
//	ARGV[2k], ARGV[2k+1] -> serial, deadline (integer Unix ms), k = 1..n
//
// Returns a flat array: for each serial its result (0 unchanged, 1 created,
// 2 moved) and its deadline after the call.
//
// An entry held under a lease or backing off lives in the lease hash instead
// of the queue; it counts as existing. Moving it drops the lease record, so
// the replica holding it cannot remove it (its compare-and-set fails) and the
// new deadline is kept; a batch lease (see claimScript) holds
// one member fewer. The script publishes the earliest written deadline
// when it is earlier than the queue's head, so sleeping daemons wake up.
//
// A script's writes stay when a later command fails (an ACL tightened at
// runtime refuses one), so the queue key is written before any lease is
// dropped, and each lease record before its batch counts it out: a
// refusal leaves a moved entry in its lease, or in the queue key and its
// lease (the state a raw ZADD makes: the claim drops the stale lease, the
// holder's fence sees the new deadline), never in neither, and never a
// batch counting fewer members than carry its token. The wake-up
// (PUBLISH) comes last, for the reason given at putTaskScript: refused,
// only the wake-up is lost.
var enqueueScript = redis.NewScript(luaTouch + luaUnbatch + `
local mode = ARGV[1]
local n = (#ARGV - 1) / 2
local members = {}
for i = 1, n do members[i] = ARGV[2 * i] end
-- Current scores and lease records, read in a few calls, not one per item.
local scores, recs, missing, at = {}, {}, {}, {}
for i = 1, n, 500 do
  local part = redis.call('ZMSCORE', KEYS[1], unpack(members, i, math.min(i + 499, n)))
  for j = 1, #part do scores[i + j - 1] = part[j] end
end
for i = 1, n do
  if not scores[i] then missing[#missing + 1] = members[i]; at[#at + 1] = i end
end
for i = 1, #missing, 500 do
  local part = redis.call('HMGET', KEYS[2], unpack(missing, i, math.min(i + 499, #missing)))
  for j = 1, #part do recs[at[i + j - 1]] = part[j] end
end
local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local headScore = head[2] and tonumber(head[2]) or nil
local earliest = nil
local out, zadd, seen, drops = {}, {}, {}, {}
for i = 1, n do
  local s = members[i]
  local d = tonumber(ARGV[2 * i + 1])
  local res = 0
  local cur, leased = seen[s], false
  if cur == nil then
    if scores[i] then
      cur = tonumber(scores[i])
    elseif recs[i] then
      cur = tonumber(string.match(recs[i], '^([^|]*)'))
      leased = true
    end
  end
  if not cur then
    res = 1
  elseif (mode == 'set' and d ~= cur) or (mode == 'later' and d > cur) then
    if leased then drops[#drops + 1] = i end
    res = 2
  else
    d = cur
  end
  if res ~= 0 then
    zadd[#zadd + 1] = d; zadd[#zadd + 1] = s
    if earliest == nil or d < earliest then earliest = d end
  end
  seen[s] = d
  out[#out + 1] = res
  out[#out + 1] = d
end
for i = 1, #zadd, 1000 do
  redis.call('ZADD', KEYS[1], unpack(zadd, i, math.min(i + 999, #zadd)))
end
-- The leases of the entries moved go once the queue key holds them, each
-- record before its batch counts it out (see the doc comment).
for _, i in ipairs(drops) do
  local s = members[i]
  touch(KEYS[7], record_token(recs[i]))
  redis.call('HDEL', KEYS[2], s)
  unbatch(KEYS[6], KEYS[7], recs[i])
  redis.call('ZREM', KEYS[3], s)
  redis.call('ZREM', KEYS[4], s)
end
if mode ~= 'adopt' and earliest ~= nil and (headScore == nil or earliest < headScore) then
  redis.call('PUBLISH', KEYS[5], earliest)
end
return out
`)

// EnqueueItem is one entry to write: a serial and its deadline, Unix ms.
type EnqueueItem struct {
	Serial   string
	Deadline int64
}

// Enqueued is what a write did with one item.
type Enqueued struct {
	Result   int   // ResultUnchanged, ResultCreated or ResultMoved
	Deadline int64 // the entry's deadline after the write, Unix ms
}

// EnqueueBatch is the items written to one queue key.
type EnqueueBatch struct {
	Keys  Keys
	Items []EnqueueItem
}

// Enqueue writes batches (one per key: the queue key or a shard's) with
// mode (ModeCreate, ModeReschedule, ModeLater or ModeAdopt) in one round
// trip: chunks of up to 1,000 items per script call, all calls in one
// pipeline. It returns, per batch, each item's result in order. Items are
// not validated here (see ValidateSerial, ValidateDeadline).
func Enqueue(ctx context.Context, rdb redis.UniversalClient, mode string, batches []EnqueueBatch) ([][]Enqueued, error) {
	type call struct {
		b     int // index of the batch
		first int // index into the batch's items of the call's first item
	}
	var cmds []*redis.Cmd
	var calls []call
	run := func(p redis.Scripter) {
		cmds, calls = cmds[:0], calls[:0]
		for b, g := range batches {
			k := g.Keys
			keys := []string{k.Queue, k.Lease, k.Inflight, k.Deadlines, k.Wake, k.Leases, k.LeaseBatch}
			for start := 0; start < len(g.Items); start += maxPerCall {
				end := min(start+maxPerCall, len(g.Items))
				a := make([]any, 0, 2*(end-start)+1)
				a = append(a, mode)
				for _, it := range g.Items[start:end] {
					a = append(a, it.Serial, it.Deadline)
				}
				cmds = append(cmds, enqueueScript.EvalSha(ctx, p, keys, a...))
				calls = append(calls, call{b: b, first: start})
			}
		}
	}
	if err := pipelined(ctx, rdb, run); err != nil {
		return nil, fmt.Errorf("enqueue: %w", err)
	}
	out := make([][]Enqueued, len(batches))
	for b, g := range batches {
		out[b] = make([]Enqueued, len(g.Items))
	}
	got, want := 0, 0
	for _, g := range batches {
		want += len(g.Items)
	}
	for n, cmd := range cmds {
		vals, err := cmd.Int64Slice()
		if err != nil {
			return nil, fmt.Errorf("enqueue: %w", err)
		}
		if len(vals)%2 != 0 {
			return nil, fmt.Errorf("enqueue: odd reply length %d", len(vals))
		}
		b, first := calls[n].b, calls[n].first
		if first+len(vals)/2 > len(out[b]) {
			return nil, fmt.Errorf("enqueue: %d results for %d items", first+len(vals)/2, len(out[b]))
		}
		for i := 0; i < len(vals); i += 2 {
			out[b][first+i/2] = Enqueued{Result: int(vals[i]), Deadline: vals[i+1]}
			got++
		}
	}
	if got != want {
		return nil, fmt.Errorf("enqueue: %d results for %d items", got, want)
	}
	return out, nil
}

// Enqueue writes items to the store's queue key (see Enqueue).
func (s *Store) Enqueue(ctx context.Context, mode string, items []EnqueueItem) ([]Enqueued, error) {
	out, err := Enqueue(ctx, s.rdb, mode, []EnqueueBatch{{Keys: s.keys, Items: items}})
	if err != nil {
		return nil, err
	}
	return out[0], nil
}

// pipelined runs the enqueue script calls that build adds in one pipeline
// with EVALSHA, and once more after loading the script if Redis had lost
// it (a restarted Redis has no scripts; EVALSHA inside a pipeline does not
// fall back to EVAL by itself).
func pipelined(ctx context.Context, rdb redis.UniversalClient, build func(redis.Scripter)) error {
	for try := 0; ; try++ {
		_, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error { build(p); return nil })
		if err == nil {
			return nil
		}
		if try == 0 && redis.HasErrorPrefix(err, "NOSCRIPT") {
			if err := enqueueScript.Load(ctx, rdb).Err(); err != nil {
				return err
			}
			continue
		}
		return err
	}
}

// getScript reads one entry wherever it is.
//
//	KEYS[1] -> queue  KEYS[2] -> {queue}:lease  KEYS[3] -> {queue}:inflight
//	KEYS[4] -> {queue}:deadinfo KEYS[5] -> {queue}:leases
//	ARGV[1] -> serial
//
// A member of a batch lease has no entry of its own in {queue}:inflight:
// its lease ends when its batch's does. Returns {state, deadline, attempts, token, until, reason, last error} or
// nil when there is no entry.
var getScript = redis.NewScript(`
local s = ARGV[1]
local q = redis.call('ZSCORE', KEYS[1], s)
if q then return {'queued', q, '0', '', '0', '', ''} end
local rec = redis.call('HGET', KEYS[2], s)
if rec then
  local d, a, tok, e = string.match(rec, '^([^|]*)|([^|]*)|([^|]*)|?(.*)$')
  local until_ = redis.call('ZSCORE', KEYS[3], s) or redis.call('ZSCORE', KEYS[5], tok) or '0'
  local state = 'leased'
  if tok == '-' then state = 'backoff' end
  return {state, d, a, tok, until_, '', e or ''}
end
local dead = redis.call('HGET', KEYS[4], s)
if dead then
  local r, a, d, e = string.match(dead, '^([^|]*)|([^|]*)|([^|]*)|?(.*)$')
  return {'dead', d, a, '', '0', r, e or ''}
end
return nil
`)

// States of an entry, as Get reads them.
const (
	StateQueued  = "queued"
	StateLeased  = "leased"
	StateBackoff = "backoff"
	StateDead    = "dead"
)

// Entry is one entry as Get finds it.
type Entry struct {
	State     string    // StateQueued, StateLeased, StateBackoff or StateDead
	Deadline  time.Time // the true deadline
	Attempts  int
	Token     string    // leased: the lease token; backoff: "-"
	Until     time.Time // leased or backoff: when the lease or backoff ends (zero: unknown)
	Reason    string    // dead: the dead-letter reason
	LastError string
}

// Get reads serial's entry wherever it is (getScript); ok is false when
// there is none.
func (s *Store) Get(ctx context.Context, serial string) (Entry, bool, error) {
	k := s.keys
	vals, err := getScript.Run(ctx, s.rdb, []string{k.Queue, k.Lease, k.Inflight, k.DeadInfo, k.Leases}, serial).StringSlice()
	if errors.Is(err, redis.Nil) {
		return Entry{}, false, nil
	}
	if err != nil {
		return Entry{}, false, fmt.Errorf("get %q: %w", serial, err)
	}
	if len(vals) != 7 {
		return Entry{}, false, fmt.Errorf("get %q: reply of %d fields, want 7", serial, len(vals))
	}
	deadline, err1 := parseMillis(vals[1])
	attempts, err2 := strconv.Atoi(vals[2])
	until, err3 := parseMillis(vals[4])
	if err := errors.Join(err1, err2, err3); err != nil {
		return Entry{}, false, fmt.Errorf("get %q: malformed record: %w", serial, err)
	}
	r := Entry{State: vals[0], Deadline: deadline, Attempts: attempts, Token: vals[3], Reason: vals[5], LastError: vals[6]}
	if r.State == StateLeased || r.State == StateBackoff {
		r.Until = until
	}
	return r, true, nil
}

// parseMillis parses a Unix-millisecond score as Redis prints it (which may
// be in exponent form for large values).
func parseMillis(s string) (time.Time, error) {
	f, err := strconv.ParseFloat(s, 64)
	if err != nil {
		return time.Time{}, err
	}
	return time.UnixMilli(int64(f)), nil
}

// cancelScript removes an entry that is queued, leased or backing off.
//
//	KEYS[1] -> queue  KEYS[2] -> {queue}:lease  KEYS[3] -> {queue}:inflight
//	KEYS[4] -> {queue}:deadlines KEYS[5] -> {queue}:leases
//	KEYS[6] -> {queue}:leasebatch
//	ARGV[1] -> serial
//
// Returns 1 if something was removed, else 0. A replica closing the order
// right now finishes its close (the SQL decides) but cannot re-add it.
//
// The lease record goes before its batch counts it out: a script's
// writes stay when a later command fails (an ACL tightened at runtime),
// and a batch counting fewer members than carry its token is dropped by
// the holder's settle of the others while one still carries it, in no
// place a claim reads.
var cancelScript = redis.NewScript(luaTouch + luaUnbatch + `
-- The lease goes first and the queue entry last: a cancel stopped by a
-- refused command leaves the producer's latest write in the queue key
-- with no lease from before it (whose holder's fence would then accept
-- the serial, and close it at the older deadline), and takes the batch's
-- count down only once the record no longer carries its token.
local rec = redis.call('HGET', KEYS[2], ARGV[1])
touch(KEYS[6], record_token(rec))
local n = redis.call('HDEL', KEYS[2], ARGV[1])
unbatch(KEYS[5], KEYS[6], rec)
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
n = n + redis.call('ZREM', KEYS[1], ARGV[1])
if n > 0 then return 1 end
return 0
`)

// Cancel removes serial's entry if it is queued, leased or backing off
// (cancelScript) and reports whether there was one.
func (s *Store) Cancel(ctx context.Context, serial string) (bool, error) {
	k := s.keys
	n, err := cancelScript.Run(ctx, s.rdb, []string{k.Queue, k.Lease, k.Inflight, k.Deadlines, k.Leases, k.LeaseBatch}, serial).Int()
	if err != nil {
		return false, fmt.Errorf("cancel %q: %w", serial, err)
	}
	return n > 0, nil
}

// Deadlines returns, for each serial, its entry's current deadline (Unix
// ms) in the queue key or, when it is not there, in its lease record
// (leased or backing off), and whether it has one (false: neither, or
// only a damaged record: see ParseLeaseRecord). One pipelined round trip; not atomic across
// serials.
func (s *Store) Deadlines(ctx context.Context, serials []string) ([]int64, []bool, error) {
	k := s.keys
	scores := make([]*redis.FloatCmd, len(serials))
	leases := make([]*redis.StringCmd, len(serials))
	_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, serial := range serials {
			scores[i] = p.ZScore(ctx, k.Queue, serial)
			leases[i] = p.HGet(ctx, k.Lease, serial)
		}
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		return nil, nil, err
	}
	out, found := make([]int64, len(serials)), make([]bool, len(serials))
	for i := range serials {
		switch score, err := scores[i].Result(); {
		case err == nil:
			out[i], found[i] = int64(score), true
		case !errors.Is(err, redis.Nil):
			return nil, nil, err
		default:
			rec, err := leases[i].Result()
			if errors.Is(err, redis.Nil) {
				continue
			}
			if err != nil {
				return nil, nil, err
			}
			if r, ok := ParseLeaseRecord(rec); ok && r.Deadline != 0 {
				out[i], found[i] = r.Deadline, true
			}
		}
	}
	return out, found, nil
}
