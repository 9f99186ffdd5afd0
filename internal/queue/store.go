package queue

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
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

// IsRefused reports whether err is Redis refusing the connection's user a
// command, key or channel (its ACL): NOPERM from a command, or the error
// a script gets when it calls a command its user may not run, or names a
// key or a channel its user may not use ("The user executing the script
// can't run this command or subcommand", "… can't access at least one of
// the keys mentioned in the command arguments", "… can't publish to the
// channel mentioned in the command", 6.2 to 7.x). Redis answered: it is no
// outage, and no retry mends it until an operator changes the ACL.
//
// Only Redis's own reply counts (an error in err's chain that is a
// redis.Error), so that another error merely worded like a refusal — a
// PostgreSQL error raised by a shop's trigger, a task action's error — is
// never taken for one.
func IsRefused(err error) bool {
	var reply redis.Error
	if !errors.As(err, &reply) {
		return false
	}
	msg := reply.Error()
	if strings.Contains(msg, "NOPERM") {
		return true
	}
	for _, refused := range scriptRefusals {
		if strings.Contains(msg, refused) {
			return true
		}
	}
	return false
}

// scriptRefusals are the words of Redis's errors to a script whose user
// may not run a command it calls, or use a key or channel it names.
var scriptRefusals = []string{
	"The user executing the script can't run this command",
	"The user executing the script can't access at least one of the keys",
	"The user executing the script can't publish to the channel",
}

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
	return DistinctBy(serials, func(s string) string { return s })
}

// DistinctBy returns xs keeping the first of each key, in order. Without
// repeats (the rule for a claim's batch) it returns xs itself and
// allocates nothing: the set it checks on is reused (seenSets); only xs
// with repeats is copied.
func DistinctBy[T any](xs []T, key func(T) string) []T {
	if len(xs) < 2 {
		return xs
	}
	seen := seenSets.Get().(map[string]struct{})
	defer func() { clear(seen); seenSets.Put(seen) }()
	for i, x := range xs {
		k := key(x)
		if has(seen, k) {
			// The first repeat: copy what came before it, then keep only
			// keys not seen yet.
			out := append(make([]T, 0, len(xs)-1), xs[:i]...)
			for _, x := range xs[i+1:] {
				if k := key(x); !has(seen, k) {
					seen[k] = struct{}{}
					out = append(out, x)
				}
			}
			return out
		}
		seen[k] = struct{}{}
	}
	return xs
}

func has(set map[string]struct{}, k string) bool {
	_, ok := set[k]
	return ok
}

// seenSets holds the sets DistinctBy checks on: one per call, as large as
// a batch, was the largest allocation of a drain.
var seenSets = sync.Pool{New: func() any { return map[string]struct{}{} }}
