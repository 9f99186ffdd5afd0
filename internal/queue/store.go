package queue

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// Store is one queue's data in Redis: its keys (see Keys) and the typed
// operations on them, each Lua script beside the method that runs it. A
// method returns what happened as values and result structs; counting it
// in metrics or logging it is the caller's business.
//
// A Store is cheap (a client and a Keys value) and safe for concurrent
// use; a sharded queue has one Store per key (ShardKeys).
type Store struct {
	rdb  redis.UniversalClient
	keys Keys
}

// NewStore returns the store of the queue whose keys are k, on rdb.
func NewStore(rdb redis.UniversalClient, k Keys) *Store {
	return &Store{rdb: rdb, keys: k}
}

// Keys returns the store's keys.
func (s *Store) Keys() Keys { return s.keys }

// Now reads Redis's clock, the clock every script goes by.
func (s *Store) Now(ctx context.Context) (time.Time, error) {
	t, err := s.rdb.Time(ctx).Result()
	if err != nil {
		return time.Time{}, fmt.Errorf("redis time: %w", err)
	}
	return t, nil
}

// ErrReply is wrapped by the errors of a script reply of the wrong shape.
var ErrReply = errors.New("unexpected reply")

// luaNowMS is the Lua function now_ms(): Redis's clock in integer
// milliseconds.
const luaNowMS = `
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
`

// scriptArgs returns a script's arguments: head, then serials. Each serial
// goes as a pointer into serials, which go-redis writes as the string it
// points to (proto.Writer.WriteArg): a string boxed into an interface costs
// an allocation, a pointer costs none, and a batch's fence and finish send
// every serial of it. serials must not change until the call returns.
func scriptArgs(serials []string, head ...any) []any {
	out := make([]any, len(head), len(head)+len(serials))
	copy(out, head)
	for i := range serials {
		out = append(out, &serials[i])
	}
	return out
}

// distinct returns serials without repeats, in first-seen order (serials
// itself when it has none). The lease scripts count the members they take
// off a batch lease by the records they match: a serial named twice would
// be counted twice, and the batch's count would reach zero (dropping the
// batch from {Q}:leases, so a dead holder's remaining members were never
// re-claimed) while it still held members.
func distinct(serials []string) []string {
	if len(serials) < 2 {
		return serials
	}
	seen := make(map[string]struct{}, len(serials))
	for i, s := range serials {
		if _, dup := seen[s]; dup {
			out := append(make([]string, 0, len(serials)-1), serials[:i]...)
			for _, s := range serials[i+1:] {
				if _, dup := seen[s]; !dup {
					seen[s] = struct{}{}
					out = append(out, s)
				}
			}
			return out
		}
		seen[s] = struct{}{}
	}
	return serials
}
