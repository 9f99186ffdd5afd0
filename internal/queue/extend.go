package queue

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// extendBatch bounds one extend script call.
const extendBatch = 500

// extendDeadlinesScript moves entries later, each only if its deadline is still the
// one read (compare-and-set against claims and reschedules meanwhile).
//
//	KEYS[1] -> queue
//	ARGV[1] -> how much later, ms; ARGV[2k], ARGV[2k+1] -> serial, expected deadline
//
// Returns the serials moved.
var extendDeadlinesScript = redis.NewScript(`
local by = tonumber(ARGV[1])
local moved = {}
for i = 2, #ARGV, 2 do
  local cur = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if cur and tonumber(cur) == tonumber(ARGV[i+1]) then
    redis.call('ZADD', KEYS[1], 'XX', tonumber(cur) + by, ARGV[i])
    moved[#moved+1] = ARGV[i]
  end
end
return moved
`)

// ExtendStep is what ExtendDeadlines did.
type ExtendStep struct {
	Moved int // queue entries moved later
	Calls int // script calls made (each bounded)
}

// ExtendDeadlines gives every entry of the queue key due by until
// (including those already overdue and waiting) by more time. It walks
// from until downwards in batches of 500, so moved entries are never met
// again, and after each batch tells moved (if not nil) which serials it
// moved; an error from moved ends the walk and is returned as it is.
// Entries leased right now are not in the queue key and are not moved.
func (s *Store) ExtendDeadlines(ctx context.Context, until time.Time, by time.Duration, moved func([]string) error) (ExtendStep, error) {
	var res ExtendStep
	k := s.keys
	cursor := strconv.FormatInt(DeadlineMillis(until), 10)
	var cursorScore float64 = -1
	seen := map[string]struct{}{}
	for {
		zs, err := s.rdb.ZRangeArgsWithScores(ctx, redis.ZRangeArgs{Key: k.Queue, Start: cursor, Stop: "-inf",
			ByScore: true, Rev: true, Count: int64(extendBatch + len(seen))}).Result()
		if err != nil {
			return res, fmt.Errorf("extend: %w", err)
		}
		args := []any{by.Milliseconds()}
		for _, z := range zs {
			m, _ := z.Member.(string)
			if _, dup := seen[m]; dup && z.Score == cursorScore {
				continue
			}
			if z.Score != cursorScore {
				cursorScore = z.Score
				clear(seen)
			}
			seen[m] = struct{}{}
			args = append(args, m, int64(z.Score))
			if len(args) > 2*extendBatch {
				break
			}
		}
		if len(args) == 1 {
			return res, nil
		}
		cursor = strconv.FormatInt(int64(cursorScore), 10)
		got, err := extendDeadlinesScript.Run(ctx, s.rdb, []string{k.Queue}, args...).StringSlice()
		if err != nil {
			return res, fmt.Errorf("extend: %w", err)
		}
		res.Calls++
		res.Moved += len(got)
		if moved != nil {
			if err := moved(got); err != nil {
				return res, err
			}
		}
	}
}
