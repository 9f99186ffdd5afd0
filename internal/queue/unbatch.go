package queue

import (
	"context"
	"fmt"
	"math"
	"strconv"

	"github.com/redis/go-redis/v9"
)

// Unbatching is the way back from batch leases, for a rollback to a
// release that leases per member only. Such a daemon re-claims expired
// leases through {Q}:inflight alone and its reconciler leaves every order
// with a lease record alone, so a batch lease of a pod that was killed
// (nothing handed it back) would close by neither path. UnbatchLeases
// gives every member of every batch the per-member lease that release
// understands — the same expiry, the true deadline — and drops the
// batches. Each member keeps its lease record and token, so a holder that
// is still alive fences and finishes it as before; a daemon that leases
// per batch re-claims an expired per-member lease into a batch of its own.

// UnbatchPerCall is how many batch leases one unbatch script call
// converts when the caller does not say.
const UnbatchPerCall = 100

// unbatchMembersPerCall bounds the member names one call reads: it takes
// no further batch once it has read this many (but always one batch
// whole, at most the largest batch size, 5000).
const unbatchMembersPerCall = 2000

// unbatchScript turns batch leases into per-member leases.
//
//	KEYS[1] -> {queue}:leases    KEYS[2] -> {queue}:leasebatch
//	KEYS[3] -> {queue}:lease     KEYS[4] -> {queue}:inflight
//	KEYS[5] -> {queue}:deadlines
//	ARGV[1] -> most batches to take
//	ARGV[2] -> most member names to read (the first batch is read whole)
//	ARGV[3] -> highest expiry to take (later batches are left for a later run)
//	ARGV[4] -> batches to pass over first: those earlier calls left in place
//
// Batches are taken in expiry order. For each, every member its list
// names whose lease record still carries the batch's token gets
// ZADD {queue}:inflight <batch expiry> and ZADD {queue}:deadlines
// <deadline from the record>; its record stays as it is. The other
// members left the batch already (settled, retried, handed back, moved by
// a producer, re-claimed): nothing is done for them. Then the batch's
// {queue}:leases entry and its three {queue}:leasebatch fields go.
//
// Nothing is guessed: a batch whose token cannot be in a record (empty,
// or with "|" or a newline), whose expiry is not an integer, or that has
// no member list is left exactly as it is; a member whose record carrying
// the token has no integer deadline stays in its batch, which then lists
// (and counts) only such members. Each is reported.
//
// Returns {batches converted, members converted, members that had left,
// batches left in place, batches seen, problems} where problems is a flat
// array of token, serial ("" for the whole batch), reason.
var unbatchScript = redis.NewScript(luaTouch + `
local maxBatches, maxRead = tonumber(ARGV[1]), tonumber(ARGV[2])
local toks = redis.call('ZRANGE', KEYS[1], '-inf', ARGV[3], 'BYSCORE', 'LIMIT', tonumber(ARGV[4]), maxBatches, 'WITHSCORES')
local batches, members, departed, left, read = 0, 0, 0, 0, 0
local problems = {}
local function problem(tok, serial, reason)
  problems[#problems+1] = tok; problems[#problems+1] = serial; problems[#problems+1] = reason
end
-- integer reports whether string s is an integer a double holds exactly.
local function integer(s)
  local x = tonumber(s)
  return x ~= nil and x == math.floor(x) and x >= -9007199254740992 and x <= 9007199254740992
end
local seen = 0
for i = 1, #toks, 2 do
  if seen > 0 and read >= maxRead then break end
  seen = seen + 1
  local tok, expiry = toks[i], toks[i+1]
  local list = redis.call('HGET', KEYS[2], tok)
  if tok == '' or string.find(tok, '[|\n]') then
    left = left + 1; problem(tok, '', 'token is empty or holds "|" or a newline: no lease record can carry it')
  elseif not integer(expiry) then
    left = left + 1; problem(tok, '', 'expiry ' .. expiry .. ' is not an integer number of milliseconds')
  elseif not list then
    left = left + 1; problem(tok, '', 'no member list in {queue}:leasebatch')
  else
    local names = {}
    for m in string.gmatch(list, '[^\n]+') do names[#names+1] = m end
    read = read + #names
    local inflight, deadlines, bad = {}, {}, {}
    for j = 1, #names, 500 do
      local part = {}
      for k = j, math.min(j + 499, #names) do part[#part+1] = names[k] end
      local recs = redis.call('HMGET', KEYS[3], unpack(part))
      for k = 1, #part do
        local rec = recs[k]
        local d, t
        if rec then d, t = string.match(rec, '^([^|]*)|[^|]*|([^|]*)') end
        if t ~= tok then
          departed = departed + 1
        elseif not integer(d) then
          bad[#bad+1] = part[k]
          problem(tok, part[k], 'lease record "' .. rec .. '" has no integer deadline')
        else
          inflight[#inflight+1] = expiry; inflight[#inflight+1] = part[k]
          deadlines[#deadlines+1] = d; deadlines[#deadlines+1] = part[k]
          members = members + 1
        end
      end
      if #inflight > 0 then
        redis.call('ZADD', KEYS[4], unpack(inflight))
        redis.call('ZADD', KEYS[5], unpack(deadlines))
        inflight, deadlines = {}, {}
      end
    end
    if #bad == 0 then
      redis.call('ZREM', KEYS[1], tok)
      redis.call('HDEL', KEYS[2], tok, '#' .. tok, '<' .. tok)
      batches = batches + 1
    else
      touch(KEYS[2], tok)
      redis.call('HSET', KEYS[2], tok, table.concat(bad, '\n'), '#' .. tok, #bad)
      left = left + 1
    end
  end
end
return {batches, members, departed, left, seen, problems}
`)

// UnbatchProblem is a batch lease, or one member of it, that UnbatchLeases
// left as it was because converting it would mean guessing.
type UnbatchProblem struct {
	Token  string `json:"token"`            // the batch's lease token
	Serial string `json:"serial,omitempty"` // the member; empty: the whole batch
	Reason string `json:"reason"`
}

// UnbatchResult is what UnbatchLeases did.
type UnbatchResult struct {
	Batches  int              `json:"batches"`  // batch leases converted and removed
	Members  int              `json:"members"`  // members given a per-member lease
	Departed int              `json:"departed"` // members listed that had left their batch already
	Problems []UnbatchProblem `json:"problems,omitempty"`
	// Remaining is how many batch leases {queue}:leases holds at the end:
	// those left with a problem, and those made after the walk began (a
	// daemon that leases per batch is still running).
	Remaining int64 `json:"remaining"`
	Calls     int   `json:"calls"` // script calls made (each bounded)
}

// UnbatchLeases converts the queue's batch leases into per-member leases
// (see unbatchScript), perCall batches per script call (UnbatchPerCall
// when perCall ≤ 0), until every batch that existed when it began is
// converted or reported. It is idempotent, and safe while daemons run:
// a live holder still finishes, retries, buries or hands back its members
// by their lease records; a daemon that leases per batch re-claims the
// expired ones into batches of its own (run it again once no such daemon
// runs). Batches it cannot convert are left exactly as they were and
// returned in Problems.
func (s *Store) UnbatchLeases(ctx context.Context, perCall int) (UnbatchResult, error) {
	var res UnbatchResult
	if perCall <= 0 {
		perCall = UnbatchPerCall
	}
	k := s.keys
	last, err := s.rdb.ZRangeWithScores(ctx, k.Leases, -1, -1).Result()
	if err != nil {
		return res, fmt.Errorf("unbatch: %w", err)
	}
	if len(last) > 0 {
		until := "+inf"
		if sc := last[0].Score; !math.IsInf(sc, 0) && !math.IsNaN(sc) {
			until = strconv.FormatFloat(sc, 'f', -1, 64)
		}
		skip := 0
		for {
			raw, err := unbatchScript.Run(ctx, s.rdb, []string{k.Leases, k.LeaseBatch, k.Lease, k.Inflight, k.Deadlines},
				perCall, unbatchMembersPerCall, until, skip).Slice()
			if err != nil {
				return res, fmt.Errorf("unbatch: %w", err)
			}
			res.Calls++
			step, problems, err := parseUnbatch(raw)
			if err != nil {
				return res, fmt.Errorf("unbatch: %w", err)
			}
			res.Batches += int(step[0])
			res.Members += int(step[1])
			res.Departed += int(step[2])
			res.Problems = append(res.Problems, problems...)
			skip += int(step[3])
			if step[4] == 0 {
				break
			}
		}
	}
	if res.Remaining, err = s.rdb.ZCard(ctx, k.Leases).Result(); err != nil {
		return res, fmt.Errorf("unbatch: %w", err)
	}
	return res, nil
}

// parseUnbatch checks and splits unbatchScript's reply.
func parseUnbatch(raw []any) ([5]int64, []UnbatchProblem, error) {
	var counts [5]int64
	if len(raw) != 6 {
		return counts, nil, fmt.Errorf("%w: %d fields, want 6", ErrReply, len(raw))
	}
	for i := range counts {
		n, ok := raw[i].(int64)
		if !ok {
			return counts, nil, fmt.Errorf("%w: field %d of type %T", ErrReply, i, raw[i])
		}
		counts[i] = n
	}
	flat, ok := raw[5].([]any)
	if !ok || len(flat)%3 != 0 {
		return counts, nil, fmt.Errorf("%w: problems of type %T, length %d", ErrReply, raw[5], len(flat))
	}
	var out []UnbatchProblem
	for i := 0; i < len(flat); i += 3 {
		tok, ok1 := flat[i].(string)
		serial, ok2 := flat[i+1].(string)
		reason, ok3 := flat[i+2].(string)
		if !ok1 || !ok2 || !ok3 {
			return counts, nil, fmt.Errorf("%w: problem %d not three strings", ErrReply, i/3)
		}
		out = append(out, UnbatchProblem{Token: tok, Serial: serial, Reason: reason})
	}
	return counts, out, nil
}
