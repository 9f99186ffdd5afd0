package queue

import (
	"context"
	"fmt"

	"github.com/redis/go-redis/v9"
)

// nextDueScript tells a waiting poll when to look again.
//
//	KEYS[1] -> queue  KEYS[2] -> {queue}:inflight  KEYS[3] -> {queue}:paused
//
// Returns {Redis's clock in Unix ms, the earliest of the queue's head and
// the first lease to expire (-1: neither, or the queue is paused)}.
var nextDueScript = redis.NewScript(luaNowMS + `
local now = now_ms()
if redis.call('EXISTS', KEYS[3]) == 1 then return {now, -1} end
local next = -1
for i = 1, 2 do
  local h = redis.call('ZRANGE', KEYS[i], 0, 0, 'WITHSCORES')
  if h[2] then
    local s = tonumber(h[2])
    if next < 0 or s < next then next = s end
  end
end
return {now, next}
`)

// NextDue returns Redis's clock and when the next task of a polled queue
// becomes claimable (its due time, or the end of a lease that a poll may
// take over), both in Unix ms; next is -1 when nothing is queued or leased,
// or the queue is paused.
func (s *Store) NextDue(ctx context.Context) (now, next int64, err error) {
	k := s.keys
	v, err := nextDueScript.Run(ctx, s.rdb, []string{k.Queue, k.Inflight, k.Paused}).Int64Slice()
	if err != nil {
		return 0, 0, fmt.Errorf("next due: %w", err)
	}
	if len(v) != 2 {
		return 0, 0, fmt.Errorf("next due: %w: %d fields, want 2", ErrReply, len(v))
	}
	return v[0], v[1], nil
}
