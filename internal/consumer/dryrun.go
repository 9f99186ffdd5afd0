package consumer

import (
	"context"
	"fmt"
	"strconv"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/queue"
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
var peekScript = redis.NewScript(queue.LuaLeaseHelpers + `
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

// peek is the dry-run claim: it reads up to limit due entries it has not
// read before (a cursor on the deadline, plus the members already seen at
// the cursor's deadline) and leases nothing.
func (c *Consumer) peek(ctx context.Context, limit int) (claimResult, error) {
	if c.peekSeen == nil {
		c.peekFrom = 0
		c.peekSeen = map[string]struct{}{}
	}
	k := c.cfg.Keys
	raw, err := peekScript.Run(ctx, c.rdb, []string{k.Queue, k.Paused},
		c.peekFrom, limit+len(c.peekSeen), c.cfg.CloseDelay.Milliseconds()).Slice()
	if err != nil {
		return claimResult{}, fmt.Errorf("peek: %w", err)
	}
	parsed, err := queue.ParseClaim(raw)
	if err != nil {
		return claimResult{}, fmt.Errorf("peek: %w", err)
	}
	res := fromStore(parsed, "")
	fresh := res.items[:0]
	for _, it := range res.items {
		if _, seen := c.peekSeen[it.serial]; seen && it.deadline == c.peekFrom {
			continue
		}
		if it.deadline != c.peekFrom {
			c.peekFrom = it.deadline
			clear(c.peekSeen)
		}
		c.peekSeen[it.serial] = struct{}{}
		if err := queue.ValidateSerial(it.serial); err != nil || it.deadline < queue.MinDeadline {
			c.log.Info("dry run: would dead-letter", zap.String("serial", it.serial), zap.Int64("deadline", it.deadline))
			continue
		}
		fresh = append(fresh, it)
		if len(fresh) == limit {
			break
		}
	}
	res.items = fresh
	c.m.Inflight.Add(float64(len(res.items)))
	return res, nil
}

// head reads the entry the idle head check compares with the next wake-up:
// the head of the queue, or in a dry run the first entry after the peek
// cursor. A dry run leaves what it read in the queue, so the plain head is
// an entry already read; taking it for a new deadline would peek again on
// every head check. Either way it is one command per check.
func (c *Consumer) head(ctx context.Context) ([]redis.Z, error) {
	if !c.cfg.DryRun || c.peekSeen == nil {
		return c.rdb.ZRangeWithScores(ctx, c.cfg.Keys.Queue, 0, 0).Result()
	}
	return c.rdb.ZRangeArgsWithScores(ctx, redis.ZRangeArgs{
		Key: c.cfg.Keys.Queue, ByScore: true,
		Start: "(" + strconv.FormatInt(c.peekFrom, 10), Stop: "+inf",
		Count: 1,
	}).Result()
}
