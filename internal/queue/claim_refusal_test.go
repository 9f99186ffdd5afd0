package queue_test

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// claimCommands are the commands claimScript sends. A script's writes
// stay when a later command fails, so each is refused in turn below.
var claimCommands = []string{
	"time", "zrange", "exists", "object", "hstrlen", "hmget", "zmscore", "zscore",
	"hexists", "hincrby", "zrem", "hdel", "hset", "hget", "hlen",
	"zremrangebyrank", "zadd",
}

// An ACL tightened while the daemon runs (the start-up permission check
// cannot see it), or a server where that check is skipped, refuses one of
// the claim's commands after the script's first write. Whatever the
// command, every entry must stay where a later claim finds it: in the
// queue key, in the per-member inflight set, or in an expired batch whose
// list names it and whose token its lease record carries; a malformed
// entry in the queue key or the dead-letter set. And once the ACL is mended,
// claims lease every valid entry again.
//
// The state the refused claim meets has every path of the script: fresh
// due entries, an expired lease (a batch, or per-member entries), a member
// of it a producer wrote into the queue again (a takeover), a malformed
// member and a deadline too far ahead.
func TestClaimRefusedAnyCommandLosesNoEntry(t *testing.T) {
	admin, addr := testenv.PrivateRedis(t)
	ctx := context.Background()
	claimer := redis.NewClient(&redis.Options{Addr: addr, Username: "claimer", Password: "pw"})
	t.Cleanup(func() { claimer.Close() })
	for _, cmd := range claimCommands {
		for _, batch := range []bool{true, false} {
			t.Run(fmt.Sprintf("-%s/batch=%v", cmd, batch), func(t *testing.T) {
				k := queue.NewKeys(fmt.Sprintf("refuse:%s:%v", cmd, batch))
				st := queue.NewStore(admin, k)
				base := dueAt(t, st, 0)
				var valid []string
				var zs []redis.Z
				for i := range 6 {
					s := fmt.Sprintf("OLD-%d", i)
					valid = append(valid, s)
					zs = append(zs, redis.Z{Score: base + float64(i), Member: s})
				}
				if err := admin.ZAdd(ctx, k.Queue, zs...).Err(); err != nil {
					t.Fatal(err)
				}
				first, err := st.Claim(ctx, queue.ClaimArgs{Limit: 6, Lease: time.Millisecond, Token: "t:1", Batch: batch})
				if err != nil || len(first.Items) != 6 {
					t.Fatalf("first claim: %+v, %v", first, err)
				}
				zs = []redis.Z{
					{Score: base + 50, Member: "OLD-0"}, // a producer wrote it again: due
					{Score: base + 60, Member: "bad serial\x01"},
					{Score: float64(queue.DeadlineMillis(time.Now().AddDate(20, 0, 0))), Member: "FAR-1"},
				}
				for i := range 20 {
					s := fmt.Sprintf("NEW-%02d", i)
					valid = append(valid, s)
					zs = append(zs, redis.Z{Score: base + 100 + float64(i), Member: s})
				}
				if err := admin.ZAdd(ctx, k.Queue, zs...).Err(); err != nil {
					t.Fatal(err)
				}
				waitRedisPast(t, st, first.Now+1)

				if err := admin.Do(ctx, "ACL", "SETUSER", "claimer", "reset", "on", ">pw", "~*", "&*", "+@all", "-"+cmd).Err(); err != nil {
					t.Fatal(err)
				}
				_, err = queue.NewStore(claimer, k).Claim(ctx, queue.ClaimArgs{Limit: 100, Lease: time.Millisecond, Token: "t:2", Batch: batch})
				t.Logf("refused claim: %v", err)
				if err != nil && !queue.IsRefused(err) {
					t.Errorf("IsRefused(%v) = false for an ACL refusal", err)
				}
				if err := admin.Do(ctx, "ACL", "SETUSER", "claimer", "+"+cmd).Err(); err != nil {
					t.Fatal(err)
				}

				for _, s := range valid {
					if where := findable(t, admin, k, s); where == "" {
						t.Errorf("%s: in no place a claim looks (%s)", s, leaseState(t, admin, k, s))
					}
				}
				for _, s := range []string{"bad serial\x01", "FAR-1"} {
					inQueue := admin.ZScore(ctx, k.Queue, s).Err() == nil
					inDead := admin.ZScore(ctx, k.Dead, s).Err() == nil
					if !inQueue && !inDead {
						t.Errorf("%q: neither in the queue key nor dead-lettered", s)
					}
				}

				// Once mended, claims lease every valid entry again (the
				// refused claim's lease, if any was written, lasted 1 ms).
				now, err := st.Now(ctx)
				if err != nil {
					t.Fatal(err)
				}
				waitRedisPast(t, st, queue.DeadlineMillis(now)+1)
				got := map[string]bool{}
				for round := 0; round < 5; round++ {
					r, err := st.Claim(ctx, queue.ClaimArgs{Limit: 1000, Lease: time.Minute, Token: fmt.Sprintf("t:after.%d", round), Batch: batch})
					if err != nil {
						t.Fatalf("claim after the ACL is mended: %v", err)
					}
					if len(r.Items) == 0 {
						break
					}
					for _, it := range r.Items {
						got[it.Serial] = true
					}
				}
				var missing []string
				for _, s := range valid {
					if !got[s] {
						missing = append(missing, s)
					}
				}
				if len(missing) > 0 {
					t.Errorf("never leased again after the refusal: %v", missing)
				}
			})
		}
	}
}

// waitRedisPast waits until Redis's clock is past ms.
func waitRedisPast(t *testing.T, st *queue.Store, ms int64) {
	t.Helper()
	testenv.WaitFor(t, "redis clock past "+fmt.Sprint(ms), 10*time.Second, func() bool {
		now, err := st.Now(context.Background())
		return err == nil && queue.DeadlineMillis(now) > ms
	})
}

// findable says where a claim would find serial s: "queue", "inflight",
// "batch <token>", or "" for nowhere.
func findable(t *testing.T, rdb *redis.Client, k queue.Keys, s string) string {
	t.Helper()
	ctx := context.Background()
	if rdb.ZScore(ctx, k.Queue, s).Err() == nil {
		return "queue"
	}
	if rdb.ZScore(ctx, k.Inflight, s).Err() == nil {
		return "inflight"
	}
	rec, err := rdb.HGet(ctx, k.Lease, s).Result()
	if err != nil {
		return ""
	}
	parts := strings.Split(rec, "|")
	if len(parts) < 3 {
		return ""
	}
	tok := parts[2]
	if rdb.ZScore(ctx, k.Leases, tok).Err() != nil {
		return ""
	}
	list, _ := rdb.HGet(ctx, k.LeaseBatch, tok).Result()
	for _, m := range strings.Split(list, "\n") {
		if m == s {
			return "batch " + tok
		}
	}
	return ""
}

// keyState is one read of the keys a claim looks in, to answer findable
// for every serial of a state without a round trip each (the checks after
// each refusal point ask about hundreds). A key of a foreign type reads
// as empty, as findable's commands on it fail.
type keyState struct {
	queue, inflight, leases, dead map[string]float64
	lease, leaseBatch             map[string]string
}

func readKeyState(t *testing.T, rdb *redis.Client, k queue.Keys) keyState {
	t.Helper()
	ctx := context.Background()
	pipe := rdb.Pipeline()
	zs := []*redis.ZSliceCmd{pipe.ZRangeWithScores(ctx, k.Queue, 0, -1), pipe.ZRangeWithScores(ctx, k.Inflight, 0, -1),
		pipe.ZRangeWithScores(ctx, k.Leases, 0, -1), pipe.ZRangeWithScores(ctx, k.Dead, 0, -1)}
	hs := []*redis.MapStringStringCmd{pipe.HGetAll(ctx, k.Lease), pipe.HGetAll(ctx, k.LeaseBatch)}
	if _, err := pipe.Exec(ctx); err != nil && !strings.HasPrefix(err.Error(), "WRONGTYPE") {
		t.Fatal(err)
	}
	zm := make([]map[string]float64, len(zs))
	for i, c := range zs {
		zm[i] = map[string]float64{}
		for _, z := range c.Val() {
			zm[i][z.Member.(string)] = z.Score
		}
	}
	hm := make([]map[string]string, len(hs))
	for i, c := range hs {
		hm[i] = c.Val()
		if hm[i] == nil {
			hm[i] = map[string]string{}
		}
	}
	return keyState{queue: zm[0], inflight: zm[1], leases: zm[2], dead: zm[3], lease: hm[0], leaseBatch: hm[1]}
}

// findable is findable(t, rdb, k, s) on the state read.
func (ks keyState) findable(s string) string {
	if _, ok := ks.queue[s]; ok {
		return "queue"
	}
	if _, ok := ks.inflight[s]; ok {
		return "inflight"
	}
	rec, ok := ks.lease[s]
	if !ok {
		return ""
	}
	parts := strings.Split(rec, "|")
	if len(parts) < 3 {
		return ""
	}
	tok := parts[2]
	if _, ok := ks.leases[tok]; !ok {
		return ""
	}
	for _, m := range strings.Split(ks.leaseBatch[tok], "\n") {
		if m == s {
			return "batch " + tok
		}
	}
	return ""
}

// leaseState describes every key that might hold s, for a failure's message.
func leaseState(t *testing.T, rdb *redis.Client, k queue.Keys, s string) string {
	t.Helper()
	ctx := context.Background()
	rec, _ := rdb.HGet(ctx, k.Lease, s).Result()
	toks, _ := rdb.ZRange(ctx, k.Leases, 0, -1).Result()
	lists, _ := rdb.HGetAll(ctx, k.LeaseBatch).Result()
	keys := make([]string, 0, len(lists))
	for f := range lists {
		keys = append(keys, f)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, f := range keys {
		fmt.Fprintf(&b, " %q=%q", f, lists[f])
	}
	return fmt.Sprintf("record %q, batches %v, batch hash:%s", rec, toks, b.String())
}

// IsRefused tells an ACL refusal, from a command or from a script, from
// Redis's other errors.
func TestIsRefused(t *testing.T) {
	admin, addr := testenv.PrivateRedis(t)
	ctx := context.Background()
	if err := admin.Do(ctx, "ACL", "SETUSER", "ro", "on", ">pw", "~*", "+@all", "-hset").Err(); err != nil {
		t.Fatal(err)
	}
	ro := redis.NewClient(&redis.Options{Addr: addr, Username: "ro", Password: "pw"})
	t.Cleanup(func() { ro.Close() })
	// A user whose ACL names keys and channels: every command, on keys
	// that start with "q" and on channel "w" only.
	if err := admin.Do(ctx, "ACL", "SETUSER", "keys", "on", ">pw", "resetkeys", "~q*", "resetchannels", "&w", "+@all").Err(); err != nil {
		t.Fatal(err)
	}
	narrow := redis.NewClient(&redis.Options{Addr: addr, Username: "keys", Password: "pw"})
	t.Cleanup(func() { narrow.Close() })
	if err := admin.Set(ctx, "str", "x", 0).Err(); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		what string
		err  error
		want bool
	}{
		{"a refused command", ro.HSet(ctx, "h", "f", "v").Err(), true},
		{"a refused command in a script", ro.Eval(ctx, "return redis.call('HSET', KEYS[1], 'f', 'v')", []string{"h"}).Err(), true},
		{"a refusal wrapped by a caller", fmt.Errorf("fence: %w", ro.HSet(ctx, "h", "f", "v").Err()), true},
		{"a key refused to a command", narrow.HSet(ctx, "h", "f", "v").Err(), true},
		{"a key refused in a script", narrow.Eval(ctx, "redis.call('HSET', KEYS[1], 'f', 'v') return redis.call('HSET', 'h', 'f', 'v')", []string{"q1"}).Err(), true},
		{"a channel refused to a command", narrow.Publish(ctx, "c", "x").Err(), true},
		{"a channel refused in a script", narrow.Eval(ctx, "return redis.call('PUBLISH', KEYS[1], 'x')", []string{"q2"}).Err(), true},
		{"a key of the wrong type", admin.HSet(ctx, "str", "f", "v").Err(), false},
		// Not Redis's answer, only worded like one: a PostgreSQL error from
		// a shop's trigger, a task action's error.
		{"another error worded like a refusal", errors.New("NOPERM this user has no permissions to run the 'update' command"), false},
		{"another error quoting a script's refusal", fmt.Errorf("task: %w", errors.New("The user executing the script can't run this command or subcommand")), false},
		{"a script's own error", admin.Eval(ctx, "return redis.error_reply('boom')", nil).Err(), false},
		{"no such key", admin.Get(ctx, "absent").Err(), false},
		{"a deadline", context.DeadlineExceeded, false},
		{"nil", nil, false},
	} {
		if got := queue.IsRefused(tc.err); got != tc.want {
			t.Errorf("%s: IsRefused(%v) = %v, want %v", tc.what, tc.err, got, tc.want)
		}
	}
}
