package queue

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// peekScript reads due entries without leasing them, for dry runs.
//
//	KEYS[1] -> queue  KEYS[2] -> {queue}:paused
//	ARGV[1] -> lowest deadline to read (inclusive), ms
//	ARGV[2] -> limit
//	ARGV[3] -> close delay, ms
//
// Returns the claim script's shape: {now, next deadline or -1, -1,
// entries (serial, deadline, 0, 0), {}, paused}.
var peekScript = redis.NewScript(luaHelpers + `
local now = now_ms()
local cutoff = now - tonumber(ARGV[3])
local function first_after(min)
  local h = redis.call('ZRANGE', KEYS[1], min, '+inf', 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')
  if h[2] then return tonumber(h[2]) end
  return -1
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {now, first_after('-inf'), -1, {}, {}, 1}
end
local out = {}
local due = redis.call('ZRANGE', KEYS[1], ARGV[1], cutoff, 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[2]), 'WITHSCORES')
for i = 1, #due, 2 do
  local d = tonumber(due[i+1])
  out[#out+1] = due[i]; out[#out+1] = d; out[#out+1] = 0; out[#out+1] = 0
end
return {now, first_after('(' .. cutoff), -1, out, {}, 0}
`)

// Peek reads up to limit due entries (deadline + closeDelay past, on
// Redis's clock) from deadline from (Unix ms, inclusive) on, without
// leasing or changing anything: a dry run's claim. The result's Items
// carry no attempts; a paused queue answers Paused and no Items.
func (s *Store) Peek(ctx context.Context, from int64, limit int, closeDelay time.Duration) (ClaimResult, error) {
	raw, err := peekScript.Run(ctx, s.rdb, []string{s.keys.Queue, s.keys.Paused},
		from, limit, closeDelay.Milliseconds()).Slice()
	if err != nil {
		return ClaimResult{}, fmt.Errorf("peek: %w", err)
	}
	res, err := parseClaim(raw)
	if err != nil {
		return ClaimResult{}, fmt.Errorf("peek: %w", err)
	}
	return res, nil
}

// Head returns the earliest deadline (Unix ms) in the queue key after
// deadline after (exclusive), or from the start when after is negative;
// ok is false when there is none. One command: the scan loop's idle head
// check.
func (s *Store) Head(ctx context.Context, after int64) (deadline int64, ok bool, err error) {
	var zs []redis.Z
	if after < 0 {
		zs, err = s.rdb.ZRangeWithScores(ctx, s.keys.Queue, 0, 0).Result()
	} else {
		zs, err = s.rdb.ZRangeArgsWithScores(ctx, redis.ZRangeArgs{
			Key: s.keys.Queue, ByScore: true,
			Start: "(" + strconv.FormatInt(after, 10), Stop: "+inf",
			Count: 1,
		}).Result()
	}
	if err != nil || len(zs) == 0 {
		return 0, false, err
	}
	return int64(zs[0].Score), true, nil
}
