package queue

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// Operators' tools for task queues: page through a queue's sorted sets,
// requeue and purge dead letters without touching a live task of the same
// id. The order queue's requeue and purge (dead.go) do not fit task
// queues: they neither look for a leased task of the same id nor remove
// payloads.

// Cursor is a position in a sorted set: the score and member of the last
// entry a page returned. The next page starts after it, in the set's own
// order (by score, then member byte by byte), so entries added or removed
// between pages never make a page repeat or skip one that stayed.
type Cursor struct {
	Score float64
	ID    string
}

// ErrBadCursor: a cursor that no page handed out.
var ErrBadCursor = errors.New("bad cursor")

// String encodes c for a URL (base64url of "score|id").
func (c Cursor) String() string {
	return base64.RawURLEncoding.EncodeToString([]byte(strconv.FormatFloat(c.Score, 'g', -1, 64) + "|" + c.ID))
}

// ParseCursor decodes what Cursor.String made.
func ParseCursor(s string) (Cursor, error) {
	raw, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil {
		return Cursor{}, fmt.Errorf("%w: not base64url", ErrBadCursor)
	}
	score, id, ok := strings.Cut(string(raw), "|")
	if !ok || id == "" {
		return Cursor{}, fmt.Errorf("%w: no position", ErrBadCursor)
	}
	f, err := strconv.ParseFloat(score, 64)
	if err != nil || f != f { // NaN is no score
		return Cursor{}, fmt.Errorf("%w: no score", ErrBadCursor)
	}
	return Cursor{Score: f, ID: id}, nil
}

// pageScript returns up to ARGV[3] entries of a sorted set after a
// position, with their scores.
//
//	KEYS[1] -> the sorted set
//	ARGV[1] -> score of the position ("" for the start); ARGV[2] -> its member
//	ARGV[3] -> limit
//
// Members of equal score are ordered byte by byte (memcmp), so the first
// entry after (score, member) is found by binary search over the ranks of
// that score: O(log n) calls whether or not the member is still there.
// Lua's own string comparison follows the server's locale, hence less().
var pageScript = redis.NewScript(`
local function less(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end
local start = 0
if ARGV[1] ~= '' then
  local lo = redis.call('ZCOUNT', KEYS[1], '-inf', '(' .. ARGV[1])
  local hi = lo + redis.call('ZCOUNT', KEYS[1], ARGV[1], ARGV[1])
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    local m = redis.call('ZRANGE', KEYS[1], mid, mid)[1]
    if less(ARGV[2], m) then hi = mid else lo = mid + 1 end
  end
  start = lo
end
return redis.call('ZRANGE', KEYS[1], start, start + tonumber(ARGV[3]) - 1, 'WITHSCORES')
`)

// Page returns up to limit entries of the sorted set key (one of the
// store's: Keys().Queue, Inflight or Dead) after the position after (nil:
// from the start).
func (s *Store) Page(ctx context.Context, key string, after *Cursor, limit int) ([]redis.Z, error) {
	score, id := "", ""
	if after != nil {
		score, id = strconv.FormatFloat(after.Score, 'g', -1, 64), after.ID
	}
	raw, err := pageScript.Run(ctx, s.rdb, []string{key}, score, id, limit).StringSlice()
	if err != nil {
		return nil, fmt.Errorf("page %s: %w", key, err)
	}
	if len(raw)%2 != 0 {
		return nil, fmt.Errorf("page %s: %w: odd reply", key, ErrReply)
	}
	out := make([]redis.Z, 0, len(raw)/2)
	for i := 0; i < len(raw); i += 2 {
		f, err := strconv.ParseFloat(raw[i+1], 64)
		if err != nil {
			return nil, fmt.Errorf("page %s: %w: score %q", key, ErrReply, raw[i+1])
		}
		out = append(out, redis.Z{Member: raw[i], Score: f})
	}
	return out, nil
}

// Outcomes of RequeueTasks, per id.
const (
	RequeueDone    = "requeued"
	RequeueLive    = "live"     // a live task has the id: both left alone
	RequeueNotDead = "not_dead" // no dead letter with the id
)

// requeueTasksScript puts dead-lettered tasks back on the queue, due now
// (Redis's clock), with the payload they died with.
//
//	KEYS[1] -> queue  KEYS[2] -> {queue}:lease  KEYS[3] -> {queue}:dead
//	KEYS[4] -> {queue}:deadinfo  KEYS[5] -> {queue}:taken
//	KEYS[6] -> {queue}:wake
//	ARGV[1..] -> task ids
//
// An id that is live as well (queued, leased or backing off, or taken
// from a reliable list) belongs to a task a producer wrote after the dead
// one: its deadline, lease and payload (the payload hash holds one per id,
// so the live task's) are left alone, and so is the dead letter. A task
// forwarded to a stream or a plain list is out of reach and not seen as
// live. A reliable list's delivery count ({queue}:deliveries) is left
// alone: dead-lettering cleared the dead item's, so a count there belongs
// to a newer item of the id waiting in the ready list. Returns per id 1
// (requeued), 2 (live) or 0 (no dead letter).
//
// A task is queued before its dead letter goes: a script's writes stay
// when a later command fails (an ACL tightened at runtime), so a refusal
// leaves it dead-lettered, queued, or both (a later requeue of it finds
// it live and leaves both alone), never neither; its payload stays. The
// wake-up (PUBLISH) comes last, as in putTaskScript: refused, only the
// wake-up is lost.
var requeueTasksScript = redis.NewScript(luaNowMS + `
local now = now_ms()
local out, n = {}, 0
for i = 1, #ARGV do
  local id = ARGV[i]
  if not redis.call('ZSCORE', KEYS[3], id) then
    out[i] = 0
  elseif redis.call('ZSCORE', KEYS[1], id) or redis.call('HEXISTS', KEYS[2], id) == 1
      or redis.call('HEXISTS', KEYS[5], id) == 1 then
    out[i] = 2
  else
    redis.call('ZADD', KEYS[1], now, id)
    redis.call('HDEL', KEYS[4], id)
    redis.call('ZREM', KEYS[3], id)
    out[i] = 1
    n = n + 1
  end
end
if n > 0 then redis.call('PUBLISH', KEYS[6], now) end
return out
`)

// RequeueTasks puts the dead letters ids (at most 1,000) back on the
// queue, due now, with their payloads, and returns each id's outcome
// (RequeueDone, RequeueLive or RequeueNotDead).
func (s *Store) RequeueTasks(ctx context.Context, ids []string) ([]string, error) {
	if len(ids) == 0 {
		return nil, nil
	}
	k := s.keys
	v, err := requeueTasksScript.Run(ctx, s.rdb,
		[]string{k.Queue, k.Lease, k.Dead, k.DeadInfo, k.Taken, k.Wake}, scriptArgs(ids)...).Int64Slice()
	if err != nil {
		return nil, fmt.Errorf("requeue: %w", err)
	}
	if len(v) != len(ids) {
		return nil, fmt.Errorf("requeue: %w: %d answers for %d ids", ErrReply, len(v), len(ids))
	}
	out := make([]string, len(v))
	for i, x := range v {
		out[i] = [...]string{RequeueNotDead, RequeueDone, RequeueLive}[min(max(x, 0), 2)]
	}
	return out, nil
}

// purgeTasksScript removes dead letters with their records, and their
// payloads unless a live task of the same id owns the payload field: one
// queued, leased or backing off. A task taken from a reliable list (or
// forwarded into a stream or list) carries its payload in its item, and a
// recovery that dead-letters it writes that back, so the field is the dead
// letter's alone: keeping it would leave it behind once the item is acked.
// KEYS[5] is unused by the purge (the requeue's keys, shared).
//
//	KEYS[1] -> queue  KEYS[2] -> {queue}:lease  KEYS[3] -> {queue}:dead
//	KEYS[4] -> {queue}:deadinfo  KEYS[5] -> {queue}:taken  KEYS[6] -> {queue}:payload
//	ARGV[1] -> "ids": ARGV[2..] are the ids; or "before": ARGV[2] is a
//	           time of death (Unix ms, "+inf" for all) and ARGV[3] a limit
//
// Returns the number removed.
//
// The dead set's entry goes last, after the record and the payload (as in
// purgeScript): a script's writes stay when a later command fails (an ACL
// tightened at runtime), and a purge stopped so leaves the letter where
// the next purge finds it, never a record or a payload no purge reaches.
// The ids "before" names are read from the dead set; named ids are looked
// up there first.
var purgeTasksScript = redis.NewScript(`
local ids = {}
local named = ARGV[1] ~= 'before'
if named then
  for i = 2, #ARGV do ids[#ids+1] = ARGV[i] end
else
  ids = redis.call('ZRANGE', KEYS[3], '-inf', ARGV[2], 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[3]))
end
local n = 0
for _, id in ipairs(ids) do
  if not named or redis.call('ZSCORE', KEYS[3], id) then
    redis.call('HDEL', KEYS[4], id)
    if not redis.call('ZSCORE', KEYS[1], id) and redis.call('HEXISTS', KEYS[2], id) == 0 then
      redis.call('HDEL', KEYS[6], id)
    end
    n = n + redis.call('ZREM', KEYS[3], id)
  end
end
return n
`)

func purgeTaskKeys(k Keys) []string {
	return []string{k.Queue, k.Lease, k.Dead, k.DeadInfo, k.Taken, k.Payload}
}

// PurgeTasks removes the dead letters ids (at most 1,000) and returns how
// many there were. A live task of the same id keeps its payload.
func (s *Store) PurgeTasks(ctx context.Context, ids []string) (int, error) {
	if len(ids) == 0 {
		return 0, nil
	}
	n, err := purgeTasksScript.Run(ctx, s.rdb, purgeTaskKeys(s.keys), scriptArgs(ids, "ids")...).Int()
	if err != nil {
		return 0, fmt.Errorf("purge: %w", err)
	}
	return n, nil
}

// purgeStep bounds one purge script call.
const purgeStep = 1000

// PurgeTasksBefore removes dead letters dead-lettered before cutoff (the
// zero time: all of them), 1,000 per script call, and returns how many.
func (s *Store) PurgeTasksBefore(ctx context.Context, cutoff time.Time) (int, error) {
	until := "+inf"
	if !cutoff.IsZero() {
		until = "(" + strconv.FormatInt(cutoff.UnixMilli(), 10)
	}
	total := 0
	for {
		n, err := purgeTasksScript.Run(ctx, s.rdb, purgeTaskKeys(s.keys), "before", until, purgeStep).Int()
		total += n
		if err != nil {
			return total, fmt.Errorf("purge: %w", err)
		}
		if n < purgeStep {
			return total, nil
		}
	}
}

// Record is what a listing shows beside an id of a page: its record in a
// hash (DeadInfo or Lease; "" when it has none) and its payload.
type Record struct {
	Rec        string
	Payload    string
	HasPayload bool // false: no payload field (Payload is "")
}

// Records reads, in one pipeline, the dead-letter records (dead) or lease
// records of ids and, with withPayload, their payloads.
func (s *Store) Records(ctx context.Context, ids []string, dead, withPayload bool) ([]Record, error) {
	hash := s.keys.Lease
	if dead {
		hash = s.keys.DeadInfo
	}
	pipe := s.rdb.Pipeline()
	recs := pipe.HMGet(ctx, hash, ids...)
	var payloads *redis.SliceCmd
	if withPayload {
		payloads = pipe.HMGet(ctx, s.keys.Payload, ids...)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return nil, err
	}
	out := make([]Record, len(ids))
	for i := range out {
		out[i].Rec, _ = recs.Val()[i].(string)
		if payloads != nil {
			out[i].Payload, out[i].HasPayload = payloads.Val()[i].(string)
		}
	}
	return out, nil
}

// Sizes counts the entries of the queue key (waiting, or due and not yet
// claimed) and the inflight set (leased or backing off), in one pipeline.
func (s *Store) Sizes(ctx context.Context) (queued, inflight int64, err error) {
	pipe := s.rdb.Pipeline()
	q := pipe.ZCard(ctx, s.keys.Queue)
	f := pipe.ZCard(ctx, s.keys.Inflight)
	if _, err := pipe.Exec(ctx); err != nil {
		return 0, 0, err
	}
	return q.Val(), f.Val(), nil
}

// DeadIDs returns the ids of the oldest limit dead letters.
func (s *Store) DeadIDs(ctx context.Context, limit int64) ([]string, error) {
	return s.rdb.ZRange(ctx, s.keys.Dead, 0, limit-1).Result()
}

// DeadCount returns how many dead letters there are.
func (s *Store) DeadCount(ctx context.Context) (int64, error) {
	return s.rdb.ZCard(ctx, s.keys.Dead).Result()
}
