package queue_test

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
)

// Test-only copies of claimScript for the adversary tests: the body that
// ships (read from lease.go and checked against claimScript's SHA1) and
// the body before the write reorder (testdata/claim_before_reorder.lua,
// from ac7bab9, the parent of the reorder c557894), each with every redis.call and redis.pcall sent
// through a hook that
//
//   - answers TIME with ARGV[10] (Unix ms) when it is above 0, so two
//     copies run on identical states end in identical states;
//   - counts the calls and fails the ARGV[11]-th (0: none), as a refused
//     command does: an error for redis.call (the script ends, its writes
//     so far stay), an error reply for redis.pcall (the script goes on);
//   - logs each call ("cmd arg1 arg2") to KEYS[11] when given.
//
// The copies are textual: helpers and body are the shipped text with
// "redis.call(" and "redis.pcall(" replaced by the hook.

const claimHookPrologue = `
local __now, __failat, __n = tonumber(ARGV[10]) or 0, tonumber(ARGV[11]) or 0, 0
local function __hook(cmd, a, b)
  __n = __n + 1
  if KEYS[11] then redis.call('RPUSH', KEYS[11], string.lower(cmd) .. ' ' .. tostring(a) .. ' ' .. tostring(b)) end
  return __failat > 0 and __n == __failat
end
local function __call(cmd, ...)
  local a, b = ...
  if __hook(cmd, a, b) then error({err = 'ERR adversary: call ' .. __n .. ' (' .. cmd .. ') refused'}) end
  if __now > 0 and string.upper(cmd) == 'TIME' then
    return {string.format('%d', math.floor(__now / 1000)), string.format('%d', (__now % 1000) * 1000)}
  end
  return redis.call(cmd, ...)
end
local function __pcall(cmd, ...)
  local a, b = ...
  if __hook(cmd, a, b) then return {err = 'ERR adversary: call ' .. __n .. ' (' .. cmd .. ') refused'} end
  return redis.pcall(cmd, ...)
end
`

const claimScriptMarker = "var claimScript = redis.NewScript(luaValidSerial + luaHelpers + `"

// shippedClaimBody is claimScript's body as lease.go has it, checked
// against the compiled script's SHA1.
func shippedClaimBody(t testing.TB) string {
	t.Helper()
	src, err := os.ReadFile("lease.go")
	if err != nil {
		t.Fatal(err)
	}
	s := string(src)
	i := strings.Index(s, claimScriptMarker)
	if i < 0 {
		t.Fatalf("lease.go: no %q", claimScriptMarker)
	}
	s = s[i+len(claimScriptMarker):]
	j := strings.Index(s, "`)")
	if j < 0 {
		t.Fatal("lease.go: claimScript has no end")
	}
	body := s[:j]
	sum := sha1.Sum([]byte(queue.LuaValidSerial + queue.LuaHelpers + body))
	if got := hex.EncodeToString(sum[:]); got != queue.ClaimScriptHash() {
		t.Fatalf("claimScript read from lease.go hashes to %s, the compiled one to %s", got, queue.ClaimScriptHash())
	}
	return body
}

// claimBodyBeforeReorder is claimScript's body on main before the reorder.
func claimBodyBeforeReorder(t testing.TB) string {
	t.Helper()
	b, err := os.ReadFile("testdata/claim_before_reorder.lua")
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// hookedClaim is a copy of claimScript with the hook.
func hookedClaim(body string) string {
	src := queue.LuaValidSerial + queue.LuaHelpers + body
	src = strings.ReplaceAll(src, "redis.call(", "__call(")
	src = strings.ReplaceAll(src, "redis.pcall(", "__pcall(")
	return claimHookPrologue + src
}

func claimKeyList(k queue.Keys) []string {
	return []string{k.Queue, k.Inflight, k.Deadlines, k.Lease, k.Dead, k.DeadInfo, k.Paused, k.Payload, k.Leases, k.LeaseBatch}
}

// evalHookedClaim runs a hooked copy as Store.Claim runs claimScript, on
// Redis's clock now (Unix ms), failing its failAt-th call (0: none) and
// logging its calls to logKey (empty: no log).
func evalHookedClaim(ctx context.Context, rdb redis.Scripter, src string, k queue.Keys, logKey string, a queue.ClaimArgs, now int64, failAt int) (any, error) {
	keys := claimKeyList(k)
	if logKey != "" {
		keys = append(keys, logKey)
	}
	b := func(v bool) string {
		if v {
			return "1"
		}
		return "0"
	}
	return rdb.Eval(ctx, src, keys,
		a.Limit, a.Lease.Milliseconds(), a.Token, queue.MaxAhead.Milliseconds(), a.CloseDelay.Milliseconds(),
		b(a.CountRedeliveries), a.MaxBytes, a.Overhead, b(a.Batch), now, failAt).Result()
}

// queueKeyNames names the keys a claim touches, by role.
func queueKeyNames(k queue.Keys) [][2]string {
	return [][2]string{{"queue", k.Queue}, {"inflight", k.Inflight}, {"deadlines", k.Deadlines}, {"lease", k.Lease},
		{"dead", k.Dead}, {"deadinfo", k.DeadInfo}, {"paused", k.Paused}, {"payload", k.Payload},
		{"leases", k.Leases}, {"leasebatch", k.LeaseBatch}}
}

func dumpQueueKeys(t testing.TB, rdb *redis.Client, k queue.Keys) map[string]keyDump {
	return readKeys(t, rdb, queueKeyNames(k), nil)
}

// callLog is a hooked run's calls: each command and its first argument
// (the key, for all but TIME).
func callLog(t *testing.T, rdb *redis.Client, key string) [][2]string {
	t.Helper()
	l, err := rdb.LRange(context.Background(), key, 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	out := make([][2]string, len(l))
	for i, c := range l {
		f := strings.SplitN(c, " ", 3)
		out[i] = [2]string{f[0], f[1]}
	}
	return out
}

// marking reports whether a call (command, key or role, first argument)
// is one a script makes to mark a batch lease as changed (touch in
// luaHelpers: HGET and HSET of its oldest deadline, "<"+token), which the
// scripts from before marks did not make (they write that field only
// with the rest of a new batch, in an HSET whose first field is the
// token): the differential tests set them aside when they compare
// command counts. leasebatch is that key's name in the caller's log (its
// role, or the key itself).
func marking(cmd, key, arg, leasebatch string) bool {
	return key == leasebatch && (cmd == "hget" || cmd == "hset") && strings.HasPrefix(arg, "<")
}

// trustedBatch is what a batch's holder's fence and finish trust
// (FenceBatch, FinishBatch): its count, and whether it is marked as
// changed (a negated oldest deadline, or none); with the records that
// carry its token.
type trustedBatch struct {
	count    string
	marked   bool
	carriers map[string]bool
}

// batchesOf reads every batch lease of k.
func batchesOf(t testing.TB, rdb *redis.Client, k queue.Keys) map[string]trustedBatch {
	t.Helper()
	ctx := context.Background()
	toks, err := rdb.ZRange(ctx, k.Leases, 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	info, err := rdb.HGetAll(ctx, k.LeaseBatch).Result()
	if err != nil {
		t.Fatal(err)
	}
	recs, err := rdb.HGetAll(ctx, k.Lease).Result()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]trustedBatch{}
	for _, tok := range toks {
		o, ok := info["<"+tok]
		b := trustedBatch{count: info["#"+tok], marked: !ok || strings.HasPrefix(o, "-"), carriers: map[string]bool{}}
		for s, r := range recs {
			if strings.Contains(r, "|"+tok+"|") {
				b.carriers[s] = true
			}
		}
		out[tok] = b
	}
	return out
}

// trustBroken lists the batches of before that a holder trusted (unmarked,
// counting exactly the records carrying its token) and that after still
// trusts (unmarked, the same count) although a record that carried its
// token no longer does: what a script's mark, written before the record
// changes, rules out whatever command is refused.
func trustBroken(before, after map[string]trustedBatch) []string {
	var out []string
	for tok, b := range before {
		a, ok := after[tok]
		if b.marked || b.count != fmt.Sprint(len(b.carriers)) || !ok || a.marked || a.count != b.count {
			continue
		}
		for s := range b.carriers {
			if !a.carriers[s] {
				out = append(out, fmt.Sprintf("batch %s is trusted (unmarked, counts %s) but %q no longer carries its token", tok, a.count, s))
			}
		}
	}
	return out
}

// unmark undoes the batch leases' marks (a negated "<"+token field of
// {Q}:leasebatch) in k, so a state the shipped scripts left compares with
// one the scripts from before marks left; the marks themselves are held
// to their invariant by TestAdvClaimHistoryKeepsTheLeaseInvariants.
func unmark(t testing.TB, rdb *redis.Client, k queue.Keys) {
	t.Helper()
	ctx := context.Background()
	fields, err := rdb.HGetAll(ctx, k.LeaseBatch).Result()
	if err != nil {
		t.Fatal(err)
	}
	for f, v := range fields {
		if strings.HasPrefix(f, "<") && strings.HasPrefix(v, "-") {
			if err := rdb.HSet(ctx, k.LeaseBatch, f, v[1:]).Err(); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// roleOf names a key of k by its role ("lease", "queue", ...).
func roleOf(k queue.Keys, key string) string {
	for _, kn := range queueKeyNames(k) {
		if kn[1] == key {
			return kn[0]
		}
	}
	return key
}

// advSeedRounds is a randomised adversary test's seed and number of
// rounds: ORDERDELAY_ADV_SEED (decimal) replays a run, ORDERDELAY_ADV_ROUNDS
// sets the rounds (default def). It logs both, so a failure can be replayed.
func advSeedRounds(t *testing.T, def int, unit string) (seed uint64, rounds int) {
	t.Helper()
	seed, rounds = uint64(time.Now().UnixNano()), def
	if s := os.Getenv("ORDERDELAY_ADV_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("ORDERDELAY_ADV_SEED=%q: %v", s, err)
		}
		seed = v
	}
	if s := os.Getenv("ORDERDELAY_ADV_ROUNDS"); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v < 1 {
			t.Fatalf("ORDERDELAY_ADV_ROUNDS=%q: want a positive number", s)
		}
		rounds = v
	}
	t.Logf("seed %d (ORDERDELAY_ADV_SEED=%d replays it), %d %s", seed, seed, rounds, unit)
	return seed, rounds
}
