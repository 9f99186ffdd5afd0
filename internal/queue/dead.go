package queue

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// Dead letters: an entry the daemon gave up on leaves the queue for
// {Q}:dead (scored by when it died) with a record in {Q}:deadinfo (see
// DeadRecord). Operators list, requeue and purge them here; the order
// queue's requeue and purge are these, a task queue's are in taskops.go.

// DeadEntry is one dead-lettered entry with its record.
type DeadEntry struct {
	Serial    string    `json:"serial"`
	Reason    string    `json:"reason"`
	Attempts  int       `json:"attempts"`
	Deadline  string    `json:"deadline"` // as the producer wrote it (may be garbage)
	LastError string    `json:"last_error,omitempty"`
	At        time.Time `json:"dead_lettered_at"`
}

// DeadRecord is a dead letter's record ({queue}:deadinfo), written by the
// scripts that dead-letter as "reason|attempts|deadline|last error".
type DeadRecord struct {
	Reason    string
	Attempts  int
	Deadline  string // as the producer wrote it (may be garbage)
	LastError string
}

// ParseDeadRecord splits "reason|attempts|deadline|last error"; ok is
// false for anything else.
func ParseDeadRecord(rec string) (r DeadRecord, ok bool) {
	parts := strings.SplitN(rec, "|", 4)
	if len(parts) != 4 {
		return DeadRecord{}, false
	}
	r.Reason, r.Deadline, r.LastError = parts[0], parts[2], parts[3]
	r.Attempts, _ = strconv.Atoi(parts[1]) // a damaged count shows as 0
	return r, true
}

// Dead returns up to limit dead-lettered entries, oldest first.
func (s *Store) Dead(ctx context.Context, limit int64) ([]DeadEntry, error) {
	k := s.keys
	zs, err := s.rdb.ZRangeWithScores(ctx, k.Dead, 0, limit-1).Result()
	if err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	if len(zs) == 0 {
		return nil, nil
	}
	serials := make([]string, len(zs))
	for i, z := range zs {
		m, ok := z.Member.(string)
		if !ok {
			return nil, fmt.Errorf("list dead letters: %w: member of type %T", ErrReply, z.Member)
		}
		serials[i] = m
	}
	infos, err := s.rdb.HMGet(ctx, k.DeadInfo, serials...).Result()
	if err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	out := make([]DeadEntry, len(zs))
	for i, z := range zs {
		e := DeadEntry{Serial: serials[i], At: time.UnixMilli(int64(z.Score))}
		if rec, ok := infos[i].(string); ok {
			if r, ok := ParseDeadRecord(rec); ok {
				e.Reason, e.Attempts, e.Deadline, e.LastError = r.Reason, r.Attempts, r.Deadline, r.LastError
			}
		}
		out[i] = e
	}
	return out, nil
}

// requeueScript moves dead-lettered entries back into the queue, due now
// (Redis's clock): whatever their deadline was, it has passed or was wrong.
//
//	KEYS[1] -> queue KEYS[2] -> {queue}:dead KEYS[3] -> {queue}:deadinfo
//	ARGV[1..] -> serials
//
// ZADD NX keeps an entry a producer wrote meanwhile. Returns the number
// moved.
//
// An entry is queued before its dead letter goes: a script's writes stay
// when a later command fails (an ACL tightened at runtime), so a refusal
// leaves it dead-lettered, queued, or both (a later requeue of it is
// harmless: the close statement decides), never neither.
var requeueScript = redis.NewScript(luaNowMS + `
local now = now_ms()
local n = 0
for i = 1, #ARGV do
  local s = ARGV[i]
  if redis.call('ZSCORE', KEYS[2], s) then
    redis.call('ZADD', KEYS[1], 'NX', now, s)
    redis.call('HDEL', KEYS[3], s)
    redis.call('ZREM', KEYS[2], s)
    n = n + 1
  end
end
return n
`)

// ErrNotDead is returned by Requeue when a named serial is not dead-lettered.
var ErrNotDead = errors.New("not in the dead-letter set")

// Requeue puts the named dead-lettered serials back on the queue, due
// now, and returns how many it moved. One serial that is not dead is
// ErrNotDead.
func (s *Store) Requeue(ctx context.Context, serials ...string) (int, error) {
	k := s.keys
	n, err := requeueScript.Run(ctx, s.rdb, []string{k.Queue, k.Dead, k.DeadInfo}, scriptArgs(serials)...).Int()
	if err != nil {
		return 0, fmt.Errorf("requeue: %w", err)
	}
	if n < len(serials) && len(serials) == 1 {
		return n, fmt.Errorf("%s: %w", serials[0], ErrNotDead)
	}
	return n, nil
}

// RequeueAll puts every dead-lettered entry back, 1,000 per script call.
func (s *Store) RequeueAll(ctx context.Context) (int, error) {
	total := 0
	for {
		serials, err := s.rdb.ZRange(ctx, s.keys.Dead, 0, 999).Result()
		if err != nil {
			return total, fmt.Errorf("requeue: %w", err)
		}
		if len(serials) == 0 {
			return total, nil
		}
		n, err := s.Requeue(ctx, serials...)
		total += n
		if err != nil && !errors.Is(err, ErrNotDead) {
			return total, err
		}
	}
}

// purgeScript removes up to ARGV[3] dead letters that are older than
// ARGV[1] (Unix ms; -1: none by age) or beyond the newest ARGV[2] (0: no
// cap), with their records and, on a task queue, their payloads.
//
//	KEYS[1] -> {queue}:dead KEYS[2] -> {queue}:deadinfo
//	KEYS[3] -> {queue}:payload KEYS[4] -> queue KEYS[5] -> {queue}:lease
//
// A dead letter and a live task of the same id share the one payload
// field (a producer re-put the id, or a requeue raced a put): the payload
// is removed only when no live task owns it, i.e. the id is neither in the
// queue key nor leased or backing off (a lease record). A forwarded task's
// payload travels in its stream entry or list item, never in KEYS[3]. The
// order queue has no payloads: KEYS[3] does not exist and HDEL is a no-op.
//
// Returns the number removed.
var purgeScript = redis.NewScript(`
local limit = tonumber(ARGV[3])
local victims = {}
if tonumber(ARGV[1]) >= 0 then
  victims = redis.call('ZRANGE', KEYS[1], '-inf', ARGV[1], 'BYSCORE', 'LIMIT', 0, limit)
end
local keep = tonumber(ARGV[2])
if #victims < limit and keep > 0 then
  local over = redis.call('ZCARD', KEYS[1]) - #victims - keep
  if over > 0 then
    local extra = redis.call('ZRANGE', KEYS[1], #victims, #victims + math.min(over, limit - #victims) - 1)
    for _, s in ipairs(extra) do victims[#victims+1] = s end
  end
end
-- The dead set's entry goes last: a purge stopped by a refused command
-- leaves the letter where the next purge finds it, never a record no
-- purge reaches.
for _, s in ipairs(victims) do
  redis.call('HDEL', KEYS[2], s)
  if not redis.call('ZSCORE', KEYS[4], s) and redis.call('HEXISTS', KEYS[5], s) == 0 then
    redis.call('HDEL', KEYS[3], s)
  end
  redis.call('ZREM', KEYS[1], s)
end
return #victims
`)

// PurgeDead removes dead letters dead-lettered before olderThan ago
// (0: none by age) and the oldest beyond keepMax (0: no cap), in steps of
// 1,000, and returns how many it removed. On a task queue each one's
// payload goes with it unless a live task of the same id owns it.
func (s *Store) PurgeDead(ctx context.Context, olderThan time.Duration, keepMax int) (int, error) {
	k := s.keys
	cutoff := int64(-1)
	if olderThan > 0 {
		now, err := s.rdb.Time(ctx).Result()
		if err != nil {
			return 0, fmt.Errorf("purge dead letters: %w", err)
		}
		cutoff = now.Add(-olderThan).UnixMilli()
	}
	total := 0
	for {
		n, err := purgeScript.Run(ctx, s.rdb, []string{k.Dead, k.DeadInfo, k.Payload, k.Queue, k.Lease}, cutoff, keepMax, 1000).Int()
		total += n
		if err != nil {
			return total, fmt.Errorf("purge dead letters: %w", err)
		}
		if n < 1000 {
			return total, nil
		}
	}
}
