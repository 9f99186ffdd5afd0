package queue

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// The lease mechanism: a claim MOVES an entry out of the queue key into
// same-slot companions, so a producer's later write is always told apart
// from the lease. Each leased or backing-off entry has a record in
// {Q}:lease, "deadline|attempts|token|last error", that says who holds it;
// every change to it is a compare-and-set on that token. Where its expiry
// lives depends on the lease:
//
//   - Order claims lease per batch: one entry per claim in {Q}:leases (the
//     token, scored by the lease expiry) and, in {Q}:leasebatch, the
//     claim's members (field token, "\n"-separated), how many of them it
//     still holds (field "#"+token) and their oldest deadline (field
//     "<"+token). A claim of 500 orders writes 500 records and three
//     fields, not 1,500 sorted-set entries; the true deadline is in the
//     record. finish, retry, bury and hand-back count the members they take
//     off the batch and drop it with the last one.
//   - Per member (task queues' claims, backoffs, and leases written by
//     daemons before batch leases): {Q}:inflight scores the member by its
//     expiry and {Q}:deadlines by its true deadline. A retry turns a batch
//     member into a per-member backoff.
//
// So:
//
//   - GET, inspect and the overdue gauges read the true deadline from the
//     record or {Q}:deadlines while an entry is held; a hand-back puts it
//     back into the queue key with that deadline.
//   - A producer that re-adds or reschedules a held serial writes the queue
//     key (or drops the lease record); the replica holding the lease only
//     ever removes entries whose record still carries its token, so the
//     producer's entry survives.
//   - An entry whose lease expired is found again by the next claim on any
//     replica (re-claim): a per-member one through {Q}:inflight, a batch's
//     members still carrying its token through {Q}:leases. A re-claim moves
//     per-member leases (an upgrade's) into the new claim's batch.
//
// Every script takes all its keys in KEYS, in one slot, so it is safe on
// Redis Cluster. Scripts do bounded work (at most the batch size); Go loops.

// luaValidSerial is the claim script's copy of queue.ValidateSerial: 1..128
// bytes of UTF-8 without control characters (C0, DEL, C1). Tests hold the
// two in agreement.
const luaValidSerial = `
local function valid_serial(s)
  local len = #s
  if len == 0 or len > 128 then return false end
  if not string.find(s, '[^\32-\126]') then return true end
  local i = 1
  while i <= len do
    local c = string.byte(s, i)
    if c < 32 or c == 127 then return false end
    if c < 128 then
      i = i + 1
    else
      local n, lo, cp
      if c >= 0xC2 and c <= 0xDF then n = 1; lo = 0x80; cp = c - 0xC0
      elseif c >= 0xE0 and c <= 0xEF then n = 2; lo = 0x800; cp = c - 0xE0
      elseif c >= 0xF0 and c <= 0xF4 then n = 3; lo = 0x10000; cp = c - 0xF0
      else return false end
      if i + n > len then return false end
      for j = 1, n do
        local cc = string.byte(s, i + j)
        if cc < 0x80 or cc > 0xBF then return false end
        cp = cp * 64 + (cc - 0x80)
      end
      if cp < lo or cp > 0x10FFFF or (cp >= 0xD800 and cp <= 0xDFFF) then return false end
      if cp >= 0x80 and cp <= 0x9F then return false end
      i = i + n + 1
    end
  end
  return true
end
`

// luaTouch marks batch leases that a script other than their claim has
// changed (see touch), for the scripts that change lease records.
const luaTouch = `
-- touch marks batch lease tok of info ({queue}:leasebatch) as changed
-- since its claim: its oldest deadline (field "<"..tok, Unix ms) is
-- stored negated. A script calls it before it changes, drops or re-leases
-- a lease record that may carry tok: while a batch is unmarked (clean,
-- below), every member the claim leased still has the record the claim
-- wrote, so the holder's fence and finish need not read them back.
-- Written first, a mark outlives a command refused after it (an ACL
-- tightened at runtime), and a mark too many only costs the holder the
-- full compare-and-set. A token that is not a batch's (a per-member lease,
-- a backoff ('-'), a task's) has no such field and gets none. The mark is
-- in a field every version deletes with the batch, so no release leaves
-- it behind. (Its HGET and HSET of "<"..tok are what the adversarial
-- tests set aside when they compare command counts with the scripts
-- before marks.)
-- record_token is the token of lease record rec, nil for no record.
local function record_token(rec)
  return rec and string.match(rec, '^[^|]*|[^|]*|([^|]*)')
end
local function touch(info, tok)
  if not tok or tok == '-' then return end
  local o = redis.call('HGET', info, '<' .. tok)
  if o and string.sub(o, 1, 1) ~= '-' then redis.call('HSET', info, '<' .. tok, '-' .. o) end
end
`

// luaHelpers are shared by the scripts below: the Redis clock in integer
// milliseconds, lease-record parsing, chunked variadic calls (unpack of
// thousands of arguments would overflow Lua's C stack) and touch.
const luaHelpers = luaTouch + `
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function parse(rec)
  if not rec then return nil end
  local d, a, tok, e = string.match(rec, '^([^|]*)|([^|]*)|([^|]*)|?(.*)$')
  return tonumber(d), tonumber(a) or 0, tok, e
end
-- owned returns {serial, deadline, attempts} for each serial of
-- ARGV[first..] whose lease record in key carries token: the
-- compare-and-set every change to a leased entry goes through. Records are
-- read with one HMGET per 500 serials.
local function owned(key, token, first)
  local out = {}
  for i = first, #ARGV, 500 do
    local recs = redis.call('HMGET', key, unpack(ARGV, i, math.min(i + 499, #ARGV)))
    for j = 1, #recs do
      local d, a, tok = parse(recs[j])
      if tok == token then out[#out+1] = {ARGV[i + j - 1], d, a} end
    end
  end
  return out
end
local function bulk(cmd, key, args)
  for i = 1, #args, 500 do
    redis.call(cmd, key, unpack(args, i, math.min(i + 499, #args)))
  end
end
-- later returns, of the serials ARGV[first..], those queue key key holds
-- with a deadline after cutoff (a producer wrote them there): the fence's
-- question to the queue key, whatever else it asks.
local function later(key, cutoff, first)
  local out, n = {}, 0
  for i = first, #ARGV, 500 do
    local last = math.min(i + 499, #ARGV)
    local qs = redis.call('ZMSCORE', key, unpack(ARGV, i, last))
    for j = 1, #qs do
      local q = qs[j] and tonumber(qs[j])
      if q and q > cutoff then n = n + 1; out[n] = ARGV[i + j - 1] end
    end
  end
  return out
end
-- records reads the lease records (from lease) and the queue scores (from
-- queue) of list, 500 at a time: the i-th of each is list[i]'s,
-- false where there is none.
local function records(lease, queue, list)
  local recs, queued = {}, {}
  for i = 1, #list, 500 do
    local last = math.min(i + 499, #list)
    local part = redis.call('HMGET', lease, unpack(list, i, last))
    local qs = redis.call('ZMSCORE', queue, unpack(list, i, last))
    for j = 1, #part do recs[i + j - 1] = part[j]; queued[i + j - 1] = qs[j] end
  end
  return recs, queued
end
-- carries reports whether lease record rec ("deadline|attempts|token|last
-- error") carries the token of needle, "|" .. token .. "|", with one plain
-- search: a daemon's token has a ':' (Consumer.token), so it never equals
-- the numbers before it, and the last error has no '|' to end a match in.
local function carries(rec, needle)
  return rec and string.find(rec, needle, 1, true) ~= nil
end
-- unlease takes k members off the batch lease token (leases: the batch
-- expiries, info: the batch records), which must be one (release asks),
-- and drops the batch with the last one. A script that moves members out
-- of a batch calls it last, once their new place is written: its writes
-- stay when a later command fails, and a batch dropped while members
-- still carry its token leaves them in no place a claim reads (a count
-- too high only keeps the batch until it expires: the claim that re-takes
-- it finds none of its members and drops it). Refused at the HDEL, the
-- batch has left {queue}:leases and its three fields stay, read by
-- nothing: claims, gauges and unbatch find batches by {queue}:leases, and
-- a release by the token finds no record carrying it (tokens are unique
-- per claim, and every member counted has moved).
local function unlease(leases, info, token, k)
  if k > 0 and redis.call('HINCRBY', info, '#' .. token, -k) <= 0 then
    redis.call('ZREM', leases, token)
    redis.call('HDEL', info, token, '#' .. token, '<' .. token)
  end
end
-- release is unlease for a token that may not be a batch lease's. It
-- reports whether token is one (false: a per-member lease, a backoff, a
-- task's).
local function release(leases, info, token, k)
  if redis.call('HEXISTS', info, '#' .. token) == 0 then return false end
  unlease(leases, info, token, k)
  return true
end
-- clean reports whether batch lease token is still as its claim, which
-- leased claimed entries, wrote it, for a fence or finish of n of them:
-- no script has marked it (touch), and its count is still claimed, so no
-- member has left it either (a script of a release from before marks,
-- during a rolling upgrade, still takes a member off the count). Then
-- every serial the claim leased still has the lease record the claim
-- wrote, and the holder's fence and finish need not read them back (half
-- of what they cost Redis per order: BenchmarkDrainScripts). The serials
-- named must be ones the claim leased; naming more than it leased takes
-- the full compare-and-set. It also returns the batch's oldest deadline.
local function clean(info, token, claimed, n)
  if not claimed or claimed <= 0 or n > claimed then return false end
  local v = redis.call('HMGET', info, '#' .. token, '<' .. token)
  local o = v[2]
  return tonumber(v[1]) == claimed and o and string.sub(o, 1, 1) ~= '-', o
end
`

// claimScript leases due entries.
//
//	KEYS[1] -> queue            KEYS[2] -> {queue}:inflight
//	KEYS[3] -> {queue}:deadlines KEYS[4] -> {queue}:lease
//	KEYS[5] -> {queue}:dead      KEYS[6] -> {queue}:deadinfo
//	KEYS[7] -> {queue}:paused    KEYS[8] -> {queue}:payload
//	KEYS[9] -> {queue}:leases    KEYS[10] -> {queue}:leasebatch
//	ARGV[1] -> limit: most entries to lease
//	ARGV[2] -> lease duration, ms
//	ARGV[3] -> lease token (unique per claim; no '|', no "\n")
//	ARGV[4] -> how far ahead a deadline may lie, ms (larger: dead-lettered)
//	ARGV[5] -> close delay, ms: an entry is due at deadline + delay
//	ARGV[6] -> "1" to count a re-claim of an expired lease as an attempt
//	           (task queues whose consumers poll), else "0"
//	ARGV[7] -> byte budget of a poll's answer, or 0 for none
//	ARGV[8] -> bytes a task costs besides its payload and twice its id
//	ARGV[9] -> "1" to lease the claim as one batch ({queue}:leases; the
//	           order queue), "0" to lease per member ({queue}:inflight and
//	           {queue}:deadlines; task queues). KEYS[9] and KEYS[10] are
//	           read in both modes (expired batches are re-claimed only in
//	           batch mode).
//
// With a byte budget, each entry about to be leased is charged the length
// of its payload (KEYS[8]) plus twice its id's (JSON escaping at most
// doubles an id) plus ARGV[8]; the first entry that would overrun the
// budget, and everything after it, is left exactly as it was. The first
// entry is always leased, however large, so a poll never comes back empty
// while a task is due.
//
// First it takes back entries whose lease or backoff expired (unless a
// producer wrote the serial into the queue key meanwhile: then the queue
// key's deadline decides and the stale lease is dropped) — per-member ones
// from {queue}:inflight, then in batch mode the members of expired batches
// that still carry the batch's token — then due entries from the queue. A
// due queue entry whose serial another replica still leases is taken over:
// the producer wrote it after that claim, and the other replica's fence
// (fenceScript) sees its token gone. Members that
// are not valid serials, scores that are not integers or lie outside
// [2000-01-01, now + ARGV[4]] go to the dead-letter set instead, and a
// lease or backoff of the same serial is dropped with them (the bad score
// is the producer's latest write: the old deadline must not close it). So
// does (as malformed) a member of an expired batch whose lease record
// gives no deadline or names no holder a claim reads (no token, the
// batch's own without its closing '|', a batch not in {queue}:leases, or
// a per-member token with no {queue}:inflight entry): no script writes
// one, and no claim would ever read it again. "Now" is Redis's clock, so all replicas
// agree and nothing is claimed before its deadline.
//
// While KEYS[7] exists (an operator paused closing) it claims nothing and
// changes nothing.
//
// Returns {now, next queue deadline or -1, next expiry or -1, claimed, dead,
// paused (1 or 0), fresh}
// where claimed is a flat array of serial, deadline, attempts, re-claimed
// (1 if a lease of a replica expired, else 0), fresh a flat array of
// serial, deadline of entries leased for the first time with no attempt
// spent (most of a claim: half the reply; the deadline as Redis printed
// the score, in decimal digits), and dead a flat array of serial, reason.
var claimScript = redis.NewScript(luaValidSerial + luaHelpers + `
local now = now_ms()
-- head is the lowest score of key, nil when it is empty.
local function head(key)
  local h = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  if h[2] then return tonumber(h[2]) end
  return nil
end
-- answer is the reply's form of a head: -1 for none.
local function answer(x) return x or -1 end
local function earlier(a, b)
  if not a or (b and b < a) then return answer(b) end
  return a
end
-- The heads, read once: an idle claim (nothing due, nothing expired) reads
-- nothing else but the far end of the queue and changes nothing, so they
-- are its answer too.
local qHead, infHead, batHead = head(KEYS[1]), head(KEYS[2]), head(KEYS[9])
if redis.call('EXISTS', KEYS[7]) == 1 then
  return {now, answer(qHead), earlier(infHead, batHead), {}, {}, 1, {}}
end
local changed = false
local limit = tonumber(ARGV[1])
local expiry = now + tonumber(ARGV[2])
local token = ARGV[3]
local maxScore = now + tonumber(ARGV[4])
local cutoff = now - tonumber(ARGV[5])
local batch = ARGV[9] == '1'
-- compact: the lease hash was a listpack (a ziplist before 7.0) when this
-- claim began, read before its first write, and only when it may lease:
-- a script's writes stay when a later command fails, so a command the
-- server may refuse (OBJECT, to an ACL that lists commands, or renamed)
-- is asked with pcall, here, and its refusal only means no conversion
-- (see the end). Only deletes touch the hash before the records are
-- written, and they keep its form.
local compact = false
if (infHead and infHead <= now) or (batch and batHead and batHead <= now)
    or (qHead and qHead <= cutoff) then
  local enc = redis.pcall('OBJECT', 'ENCODING', KEYS[4])
  compact = enc == 'listpack' or enc == 'ziplist'
end
local sfx = '|' .. token .. '|'
local claimed, dead, fresh = {}, {}, {}
local inflightArgs, deadlineArgs, leaseArgs = {}, {}, {}
local members, oldest = {}, nil
local unmember = {}
local deadArgs, deadInfoArgs = {}, {}
local n, nla, nia, nmem, nf = 0, 0, 0, 0, 0
local budget, overhead = tonumber(ARGV[7]) or 0, tonumber(ARGV[8]) or 0
local spent, full = 0, false

-- fits charges s to the byte budget, if there is one, and says whether it
-- may be leased.
local function fits(s)
  if budget <= 0 then return true end
  if full then return false end
  local cost = redis.call('HSTRLEN', KEYS[8], s) + 2 * #s + overhead
  if n > 0 and spent + cost > budget then
    full = true
    return false
  end
  spent = spent + cost
  return true
end

-- lease records s (deadline d, attempts a) as leased by this claim; rec
-- is its lease record when the caller has built it. Tables grow by
-- counters: Lua's # is a search.
local function lease(s, d, a, rec)
  n = n + 1
  nla = nla + 1; leaseArgs[nla] = s
  nla = nla + 1; leaseArgs[nla] = rec or (d .. '|' .. a .. sfx)
  if batch then
    nmem = nmem + 1; members[nmem] = s
    if not oldest or d < oldest then oldest = d end
  else
    nia = nia + 1; inflightArgs[nia] = expiry; deadlineArgs[nia] = d
    nia = nia + 1; inflightArgs[nia] = s; deadlineArgs[nia] = s
  end
end
-- rewritten holds the expired batches step 1b rewrites (their counts are
-- set whole at the end, so no release of this claim applies to them).
local rewritten = {}
-- releaseAll takes per[tok] members off each batch tok of per. A count
-- is taken down only after the records stop carrying the token: a script
-- stopped between the two (a command refused) leaves a count too high,
-- which the next claim of the batch mends (it reads the list and the
-- records), never one too low, which would drop a batch that still holds
-- members.
local function releaseAll(per)
  for tok, k in pairs(per) do
    if not rewritten[tok] then release(KEYS[9], KEYS[10], tok, k) end
  end
end
-- drop forgets the leases of serials (records read already: recs[i] is
-- list[i]'s): records, per-member entries, then their batches' counts.
local function drop(list, recs)
  if #list == 0 then return end
  local per = {}
  for i = 1, #list do
    local _, _, tok = parse(recs[i] or nil)
    if tok then per[tok] = (per[tok] or 0) + 1 end
  end
  for tok in pairs(per) do touch(KEYS[10], tok) end
  bulk('HDEL', KEYS[4], list)
  bulk('ZREM', KEYS[2], list)
  bulk('ZREM', KEYS[3], list)
  releaseAll(per)
end
local function hmget(key, list)
  local out = {}
  for i = 1, #list, 500 do
    local part = redis.call('HMGET', key, unpack(list, i, math.min(i + 499, #list)))
    for j = 1, #part do out[i + j - 1] = part[j] end
  end
  return out
end
local buried = {}
local function bury(s, reason, score)
  buried[#buried+1] = s
  dead[#dead+1] = s; dead[#dead+1] = reason
  deadArgs[#deadArgs+1] = now; deadArgs[#deadArgs+1] = s
  deadInfoArgs[#deadInfoArgs+1] = s
  deadInfoArgs[#deadInfoArgs+1] = reason .. '|0|' .. score .. '|'
end

-- 1. expired per-member leases and finished backoffs. A serial that is in
-- the queue key as well was written there by a producer meanwhile (a raw
-- ZADD during the lease or backoff): the queue key's deadline decides, so
-- the stale companion is dropped here and the queue entry is claimed below
-- when it is due, never twice in one batch.
local exp = {}
-- took holds the serials step 1 leases in batch mode: their records are
-- rewritten only at the end, so step 1b must not take one again from an
-- expired batch whose token its old record still carries (an inflight
-- entry beside a batch lease: no script writes one, a foreign write can).
local took = {}
-- batchWrites: the expired batches step 1b took members of, each with the
-- members left in it, rewritten only once the new leases are written.
local batchWrites, nbw = {}, 0
-- released counts, by token, the members step 1 re-leases: their old
-- batches' counts go down once the new records are written.
local released = {}
if infHead and infHead <= now then
  exp = redis.call('ZRANGE', KEYS[2], '-inf', now, 'BYSCORE', 'LIMIT', 0, limit, 'WITHSCORES')
end
if #exp > 0 then
  changed = true
  local list = {}
  for i = 1, #exp, 2 do list[#list+1] = exp[i] end
  local recs, queued = records(KEYS[4], KEYS[1], list)
  local stale, staleRecs = {}, {}
  for i = 1, #list do
    local s = list[i]
    if queued[i] then
      stale[#stale+1] = s; staleRecs[#stale] = recs[i]
    elseif not fits(s) then
      break
    else
      local d, a, tok = parse(recs[i] or nil)
      if not d then d = tonumber(redis.call('ZSCORE', KEYS[3], s)) or tonumber(exp[2 * i]) end
      local again = 0
      if tok and tok ~= '-' then again = 1 end
      a = a or 0
      if again == 1 and ARGV[6] == '1' then a = a + 1 end
      if tok then released[tok] = (released[tok] or 0) + 1 end
      lease(s, d, a)
      if batch then unmember[#unmember+1] = s; took[s] = true end
      claimed[#claimed+1] = s; claimed[#claimed+1] = d
      claimed[#claimed+1] = a; claimed[#claimed+1] = again
    end
  end
  drop(stale, staleRecs)
end

-- 1b. members of expired batch leases that still carry their batch's
-- token (the others were settled, retried, taken over or moved by a
-- producer since). A batch is taken whole while there is room; the
-- members there is no room for stay in it, still expired, for the next
-- claim. A member whose record names no holder another claim reads (no
-- script writes one) is in no place a claim finds once its batch goes:
-- it is dead-lettered as malformed, with the records that carry the
-- token but no numeric deadline.
if batch and n < limit and not full and batHead and batHead <= now then
  changed = true
  local exb = redis.call('ZRANGE', KEYS[9], '-inf', now, 'BYSCORE', 'LIMIT', 0, limit)
  -- Lists name members that left their batch since, too: the records
  -- read are bounded as well as the members leased (the batches left are
  -- the next claim's; they are still expired).
  local read = 0
  -- unknown: the members buried here (two lists may name one).
  local unknown = {}
  for _, t in ipairs(exb) do
    if n >= limit or read >= limit then break end
    local list = {}
    for m in string.gmatch(redis.call('HGET', KEYS[10], t) or '', '[^\n]+') do list[#list+1] = m end
    read = read + #list
    -- Its members' records change below (re-leased, or dropped as
    -- stale): the batch is marked first, so its holder's fence reads them.
    touch(KEYS[10], t)
    local recs, queued = records(KEYS[4], KEYS[1], list)
    local stale, rest = {}, {}
    local needle = '|' .. t .. '|'
    for i = 1, #list do
      local s = list[i]
      if carries(recs[i], needle) and not took[s] then
        if queued[i] then
          stale[#stale+1] = s
        elseif n >= limit then
          rest[#rest+1] = s
        else
          local d, a = parse(recs[i])
          if d then
            lease(s, d, a or 0)
            claimed[#claimed+1] = s; claimed[#claimed+1] = d
            claimed[#claimed+1] = a or 0; claimed[#claimed+1] = 1
          elseif not unknown[s] then
            -- A record without a numeric deadline (no script writes one):
            -- the order's deadline is unknown, so it is not closed but
            -- dead-lettered for an operator, and the queue goes on.
            unknown[s] = true
            bury(s, 'malformed', string.match(recs[i], '^[^|]*'))
          end
        end
      elseif recs[i] and not queued[i] and not took[s] and not unknown[s] then
        -- A record that names no holder a claim reads: unless the queue
        -- key holds the serial (a producer's write, which step 2 takes
        -- over when due) or {queue}:inflight does (a per-member lease or
        -- a backoff: step 1 takes it back when it expires), only another
        -- batch lease does, if the record names one that is in
        -- {queue}:leases. No token (garbage, or empty), this batch's
        -- without the closing '|' (parse reads it as this batch's,
        -- carries does not: once the batch goes, no one's), a batch that
        -- is gone, or a per-member token or backoff with no inflight
        -- entry: nothing else would ever read it.
        local _, _, tok = parse(recs[i])
        local held = tok and tok ~= '' and tok ~= t and tok ~= '-' and redis.call('ZSCORE', KEYS[9], tok)
        if not held and not redis.call('ZSCORE', KEYS[2], s) then
          unknown[s] = true
          bury(s, 'malformed', string.match(recs[i], '^[^|]*'))
        end
      end
    end
    if #stale > 0 then bulk('HDEL', KEYS[4], stale) end
    nbw = nbw + 1; batchWrites[nbw] = {t, rest}
    rewritten[t] = true
  end
end

-- 2. due entries of the queue. Most have no lease record: they are
-- leased with their score as Redis prints it (an integer below 2^53 prints
-- in full) and answered in fresh, two fields each. This is the per-order
-- cost of a backlog drain, so the common case is kept to table stores
-- and one string concatenation per entry (BenchmarkDrainScripts).
local room = limit - n
-- over: the leases step 2 takes over, with their records; nrem: the queue
-- entries it handled.
local over, overRecs, nrem = {}, {}, 0
if room > 0 and not full and qHead and qHead <= cutoff then
  changed = true
  local due = redis.call('ZRANGE', KEYS[1], '-inf', cutoff, 'BYSCORE', 'LIMIT', 0, room, 'WITHSCORES')
  local list = {}
  for i = 1, #due / 2 do list[i] = due[2 * i - 1] end
  -- Lease records left by earlier attempts (or held by a lease this entry
  -- takes over), read in one call per 500 — unless the lease hash is
  -- empty: then no entry has one.
  local recs = {}
  if redis.call('HLEN', KEYS[4]) > 0 then recs = hmget(KEYS[4], list) end
  -- One anchored match over all the serials: when every byte is printable
  -- ASCII, only a serial's length can make it invalid; otherwise each is
  -- checked in full.
  local printable = string.find(table.concat(list), '^[\32-\126]*$') ~= nil
  -- The same for the scores: Redis prints a whole score in plain digits
  -- (below 10^17 in 6.2 and 7.0, further in 7.2) and any other with a
  -- '.', an 'e' or a sign (-0 prints as "0", which the lowest score's
  -- check below refuses), so when every score is digits and the lowest
  -- (the first) is not before 2000-01-01, no entry's score makes it
  -- malformed or out of range, and none is turned into a number (the
  -- score as printed is the lease record's and the reply's deadline; a
  -- due one is at most now: 13 digits).
  local plain = false
  if #list > 0 then
    local raws = {}
    for i = 1, #list do raws[i] = due[2 * i] end
    plain = string.find(table.concat(raws, ','), '^[%d,]*$') ~= nil and tonumber(raws[1]) >= 946684800000
  end
  local floor = math.floor
  local zsfx = '|0' .. sfx
  -- freshHead: the score of the first entry leased fresh in batch mode,
  -- the oldest of them (the queue key is read in score order).
  local freshHead = nil
  -- The entries handled (leased or buried) are the first nrem of the
  -- queue key by rank: ZRANGE from -inf starts at rank 0, and nothing
  -- changes the queue key before they are removed (among the writes at
  -- the end).
  for i = 1, #list do
    local s, raw = list[i], due[2 * i]
    local d = nil
    if not plain then d = tonumber(raw) end
    local len = #s
    if len == 0 or len > 128 or not (printable or valid_serial(s)) or (d and d ~= floor(d)) then
      bury(s, 'malformed', raw)
    elseif d and d < 946684800000 then
      bury(s, 'score_out_of_range', raw)
    elseif budget > 0 and not fits(s) then
      break
    else
      local rec = recs[i]
      if rec then
        local _, a = parse(rec)
        d = d or tonumber(raw)
        over[#over+1] = s; overRecs[#over] = rec
        lease(s, d, a or 0)
        claimed[#claimed+1] = s; claimed[#claimed+1] = d
        claimed[#claimed+1] = a or 0; claimed[#claimed+1] = 0
      elseif batch then
        -- lease(s, d, 0, raw .. zsfx), inline, the oldest deadline taken
        -- from freshHead below
        n = n + 1
        nla = nla + 1; leaseArgs[nla] = s
        nla = nla + 1; leaseArgs[nla] = raw .. zsfx
        nmem = nmem + 1; members[nmem] = s
        if not freshHead then freshHead = raw end
        nf = nf + 1; fresh[nf] = s
        nf = nf + 1; fresh[nf] = raw
      else
        lease(s, d or tonumber(raw), 0, raw .. zsfx)
        nf = nf + 1; fresh[nf] = s
        nf = nf + 1; fresh[nf] = raw
      end
    end
    nrem = i
  end
  if freshHead then
    local o = tonumber(freshHead)
    if not oldest or o < oldest then oldest = o end
  end
end

-- 3. deadlines too far ahead never become due: dead-letter them now
local far = redis.call('ZRANGE', KEYS[1], '(' .. maxScore, '+inf', 'BYSCORE', 'LIMIT', 0, limit, 'WITHSCORES')
local farList = {}
if #far > 0 then
  changed = true
  for i = 1, #far, 2 do
    farList[#farList+1] = far[i]
    bury(far[i], 'score_out_of_range', far[i+1])
  end
end

-- The writes. A script's writes stay when a later command fails (an ACL
-- tightened while the daemon runs refuses one), so they go in an order
-- where a failure at any command leaves every entry where a claim finds
-- it and no lease a fence would accept that it should not: first the
-- dead letters and the end of the buried serials' old leases, then the
-- places leased entries move to (the new batch or per-member entries,
-- then the lease records, which make the new batch theirs), and only
-- then the removals from the places they leave (expired batches, the
-- queue key, per-member entries) and the old batches' counts. Until the
-- records are written the old places are the judge; after, both hold an
-- entry and the next claim takes it over. The writes above are removals
-- of leases whose serials the queue key still holds (step 1's and 1b's
-- stale ones), records first.
if #deadArgs > 0 then
  bulk('ZADD', KEYS[5], deadArgs)
  bulk('HSET', KEYS[6], deadInfoArgs)
end
-- A buried entry is the producer's latest write (or, from step 1b, a
-- record without a deadline): a lease or backoff of the same serial from
-- before it must not close the order at its old deadline (the holder's
-- fence sees its token gone), and goes before the entry leaves the queue
-- key. Buried serials are never leased in this call, so the records
-- written below are not theirs.
if #buried > 0 then drop(buried, hmget(KEYS[4], buried)) end
if n > 0 then
  -- The leases this claim takes from others (step 1's expired per-member
  -- ones, step 2's take-overs) are rewritten below: a batch among them is
  -- marked first (step 1b marked its own).
  for tok in pairs(released) do touch(KEYS[10], tok) end
  for i = 1, #over do
    local _, _, tok = parse(overRecs[i])
    touch(KEYS[10], tok)
  end
  if batch then
    redis.call('ZADD', KEYS[9], expiry, token)
    redis.call('HSET', KEYS[10], token, table.concat(members, '\n'), '#' .. token, #members, '<' .. token, oldest)
  else
    bulk('ZADD', KEYS[2], inflightArgs)
    bulk('ZADD', KEYS[3], deadlineArgs)
  end
  -- Redis keeps a hash of up to hash-max-listpack-entries fields (512 by
  -- default) as a listpack (a ziplist before 7.0), where each field a
  -- command names is found by a scan of the whole hash: a batch of 500
  -- would cost this HSET, and the fence's and finish's HMGET and HDEL, 500
  -- scans each. Past 128 records a compact hash is made a table first, by
  -- a field whose value no listpack takes (over hash-max-listpack-value,
  -- 64 by default), removed again at once; Redis never turns a table back
  -- into a listpack while it runs (a restart may: the next claim turns it
  -- again). The field "\0" is no serial, and nothing reads the hash in
  -- between. A table is left alone, so the pair is written (and
  -- replicated) only when the hash changes form: when it was compact at
  -- the start (compact, above) or does not exist (a new hash is compact).
  local held = redis.call('HLEN', KEYS[4])
  local wide = held + n > 128 and (held == 0 or compact)
  if wide then redis.call('HSET', KEYS[4], '\0', string.rep('-', 1024)) end
  bulk('HSET', KEYS[4], leaseArgs)
  if wide then redis.call('HDEL', KEYS[4], '\0') end
end
-- Step 1b's batches: those it emptied go, the others keep the members
-- there was no room for, counted whole.
for i = 1, nbw do
  local t, rest = batchWrites[i][1], batchWrites[i][2]
  if #rest == 0 then
    redis.call('ZREM', KEYS[9], t)
    redis.call('HDEL', KEYS[10], t, '#' .. t, '<' .. t)
  else
    redis.call('HSET', KEYS[10], t, table.concat(rest, '\n'), '#' .. t, #rest)
  end
end
-- Step 1's members left their old batches.
releaseAll(released)
if nrem > 0 then redis.call('ZREMRANGEBYRANK', KEYS[1], 0, nrem - 1) end
-- Leases this claim takes over (a producer wrote the serial into the
-- queue key while another claim held it): that claim's batch no longer
-- holds them, and their per-member entries go.
if #over > 0 then
  local per = {}
  for i = 1, #over do
    local _, _, tok = parse(overRecs[i])
    if tok then per[tok] = (per[tok] or 0) + 1 end
  end
  if batch then
    bulk('ZREM', KEYS[2], over)
    bulk('ZREM', KEYS[3], over)
  end
  releaseAll(per)
end
if #farList > 0 then bulk('ZREM', KEYS[1], farList) end
if #unmember > 0 then
  bulk('ZREM', KEYS[2], unmember)
  bulk('ZREM', KEYS[3], unmember)
end

if not changed then return {now, answer(qHead), earlier(infHead, batHead), claimed, dead, 0, fresh} end
return {now, answer(head(KEYS[1])), earlier(head(KEYS[2]), head(KEYS[9])), claimed, dead, 0, fresh}
`)

// ClaimArgs are a claim's parameters (claimScript's ARGV).
type ClaimArgs struct {
	Limit             int           // most entries to lease
	Lease             time.Duration // how long the lease lasts
	Token             string        // lease token, unique per claim; no '|', no "\n"
	CloseDelay        time.Duration // an entry is due at its deadline + CloseDelay
	CountRedeliveries bool          // a re-claim of an expired lease spends an attempt (poll queues)
	MaxBytes          int           // byte budget of a poll's answer; 0: none
	Overhead          int           // with MaxBytes: bytes a task costs besides its payload and twice its id
	Batch             bool          // lease the claim as one batch (the order queue); false: per member
}

// Leased is one entry a claim leased.
type Leased struct {
	Serial   string
	Deadline int64 // Unix ms: the true deadline
	Attempts int   // attempts spent so far
}

// ClaimResult is what a claim (Claim), a dry run's peek or a forward did.
type ClaimResult struct {
	Now        int64          // Redis's clock, Unix ms
	NextQueue  int64          // the queue key's earliest deadline afterwards, or -1
	NextExpiry int64          // the earliest lease or backoff expiry afterwards, or -1
	Items      []Leased       // entries leased (or peeked)
	Reclaimed  int            // of Items, those whose lease by a replica had expired
	Paused     bool           // closing is paused: nothing was claimed or changed
	Dead       map[string]int // entries dead-lettered, by reason (nil: none)
}

// Claim runs claimScript once: it leases at most a.Limit due entries under
// a.Token and dead-letters the malformed ones it meets.
func (s *Store) Claim(ctx context.Context, a ClaimArgs) (ClaimResult, error) {
	k := s.keys
	res, err := runClaim(ctx, s.rdb,
		[]string{k.Queue, k.Inflight, k.Deadlines, k.Lease, k.Dead, k.DeadInfo, k.Paused, k.Payload, k.Leases, k.LeaseBatch},
		a.Limit, a.Lease.Milliseconds(), a.Token, MaxAhead.Milliseconds(),
		a.CloseDelay.Milliseconds(), boolArg(a.CountRedeliveries), a.MaxBytes, a.Overhead, boolArg(a.Batch))
	if err != nil {
		return ClaimResult{}, fmt.Errorf("claim: %w", err)
	}
	return res, nil
}

// parseClaim reads a claim's reply (claimScript), or the first six fields
// of a peek's or a forward's, which have no fresh list.
func parseClaim(raw []any) (ClaimResult, error) {
	var r ClaimResult
	if len(raw) == 6 {
		raw = append(raw[:6:6], []any{})
	}
	if len(raw) != 7 {
		return r, fmt.Errorf("%w: %d fields, want 6 or 7", ErrReply, len(raw))
	}
	var paused int64
	ints := [...]struct {
		i int
		p *int64
	}{{0, &r.Now}, {1, &r.NextQueue}, {2, &r.NextExpiry}, {5, &paused}}
	for _, f := range ints {
		v, ok := raw[f.i].(int64)
		if !ok {
			return r, fmt.Errorf("%w: field %d is %T", ErrReply, f.i, raw[f.i])
		}
		*f.p = v
	}
	r.Paused = paused == 1
	claimed, ok1 := raw[3].([]any)
	dead, ok2 := raw[4].([]any)
	fresh, ok3 := raw[6].([]any)
	if !ok1 || !ok2 || !ok3 || len(claimed)%4 != 0 || len(dead)%2 != 0 || len(fresh)%2 != 0 {
		return r, fmt.Errorf("%w: malformed claimed, dead or fresh list", ErrReply)
	}
	r.Items = make([]Leased, 0, len(claimed)/4+len(fresh)/2)
	for i := 0; i < len(claimed); i += 4 {
		s, ok := claimed[i].(string)
		d, ok2 := claimed[i+1].(int64)
		a, ok3 := claimed[i+2].(int64)
		again, ok4 := claimed[i+3].(int64)
		if !ok || !ok2 || !ok3 || !ok4 {
			return r, fmt.Errorf("%w: malformed claimed entry %d", ErrReply, i/4)
		}
		r.Items = append(r.Items, Leased{Serial: s, Deadline: d, Attempts: int(a)})
		if again == 1 {
			r.Reclaimed++
		}
	}
	for i := 0; i < len(fresh); i += 2 {
		s, ok := fresh[i].(string)
		var d int64
		ok2 := false
		switch v := fresh[i+1].(type) {
		case string:
			d, ok2 = plainDeadline(v)
		case int64:
			d, ok2 = v, true
		}
		if !ok || !ok2 {
			return r, fmt.Errorf("%w: malformed fresh entry %d", ErrReply, i/2)
		}
		r.Items = append(r.Items, Leased{Serial: s, Deadline: d})
	}
	if len(dead) > 0 {
		r.Dead = map[string]int{}
		for i := 1; i < len(dead); i += 2 {
			reason, _ := dead[i].(string)
			r.Dead[reason]++
		}
	}
	return r, nil
}

func boolArg(b bool) string {
	if b {
		return "1"
	}
	return "0"
}

// luaFinishRecords is the finish's compare-and-set, shared by finishScript
// and finishBatchScript.
const luaFinishRecords = `
-- finish_records removes, of the serials ARGV[first..], the entries whose
-- lease record still carries token, and returns how many. Their batch is
-- marked first (touch: it may keep members whose records stay). With
-- KEYS[6..8] (task queues) payloads go with the entries.
local function finish_records(token, first)
  local needle = '|' .. token .. '|'
  local find = string.find
  local rem, k = {}, 0
  for i = first, #ARGV, 500 do
    local last = math.min(i + 499, #ARGV)
    local recs = redis.call('HMGET', KEYS[3], unpack(ARGV, i, last))
    for j = 1, #recs do
      -- carries(recs[j], needle), inline: this runs for every order closed
      local r = recs[j]
      if r and find(r, needle, 1, true) then k = k + 1; rem[k] = ARGV[i + j - 1] end
    end
  end
  if k > 0 then
    touch(KEYS[5], token)
    bulk('HDEL', KEYS[3], rem)
    if not release(KEYS[4], KEYS[5], token, k) then
      bulk('ZREM', KEYS[1], rem)
      bulk('ZREM', KEYS[2], rem)
    end
    if KEYS[6] then
      local drop = {}
      for _, s in ipairs(rem) do
        if not redis.call('ZSCORE', KEYS[7], s) and not redis.call('ZSCORE', KEYS[8], s) then drop[#drop+1] = s end
      end
      if #drop > 0 then bulk('HDEL', KEYS[6], drop) end
    end
  end
  return k
end
`

// finishScript removes settled entries (closed, or paid/closed already).
//
//	KEYS[1] -> {queue}:inflight KEYS[2] -> {queue}:deadlines KEYS[3] -> {queue}:lease
//	KEYS[4] -> {queue}:leases   KEYS[5] -> {queue}:leasebatch
//	KEYS[6] -> {queue}:payload (task queues only: payloads go with the entry)
//	KEYS[7] -> {queue}:dead (task queues only)  KEYS[8] -> queue (task queues only)
//	ARGV[1] -> lease token; ARGV[2..] -> serials
//
// Compare-and-set: only entries whose lease record still carries the token
// are removed; an entry a producer rescheduled meanwhile is left alone. A
// batch lease loses the members removed, and goes with its last. A
// payload stays when a dead letter of the same id exists (the producer
// reused the id): it is that dead letter's now, for a requeue, and goes
// when the dead letter is purged. It also stays when the id is in the
// queue key again (a producer re-added it with a raw ZADD during the
// lease): that live task runs with it, as after a poll's ack (pollAckScript).
// Returns the number removed.
var finishScript = redis.NewScript(luaHelpers + luaFinishRecords + `
return finish_records(ARGV[1], 2)
`)

// finishBatchScript is finishScript for the holder of an order claim's
// batch lease that knows how many entries its claim leased.
//
//	KEYS[1..5] as finishScript's
//	ARGV[1] -> lease token; ARGV[2] -> entries the claim leased;
//	ARGV[3..] -> serials, all leased by that claim
//
// While the batch is clean (see clean in luaHelpers) every serial still
// has the record the claim wrote: the records are deleted without being
// read, after the batch is marked (touch: a refused command after it
// leaves a batch that is not trusted again). Otherwise, finishScript's
// compare-and-set. Returns the number removed.
var finishBatchScript = redis.NewScript(luaHelpers + luaFinishRecords + `
local token = ARGV[1]
local fast, oldest = clean(KEYS[5], token, tonumber(ARGV[2]), #ARGV - 2)
if not fast then return finish_records(token, 3) end
redis.call('HSET', KEYS[5], '<' .. token, '-' .. oldest)
local k = 0
for i = 3, #ARGV, 500 do
  k = k + redis.call('HDEL', KEYS[3], unpack(ARGV, i, math.min(i + 499, #ARGV)))
end
unlease(KEYS[4], KEYS[5], token, k)
return k
`)

// Finish removes the entries serials still leased under token: they were
// closed, or were settled already. payloads is true for task queues, whose
// payloads go with the entry (see finishScript). It returns the number
// removed. A serial named twice counts once (distinct), here and in Retry,
// Bury and HandBack.
func (s *Store) Finish(ctx context.Context, token string, serials []string, payloads bool) (int, error) {
	k := s.keys
	keys := []string{k.Inflight, k.Deadlines, k.Lease, k.Leases, k.LeaseBatch}
	if payloads {
		keys = append(keys, k.Payload, k.Dead, k.Queue)
	}
	n, err := finishScript.Run(ctx, s.rdb, keys, scriptArgs(distinct(serials), token)...).Int()
	if err != nil {
		return 0, fmt.Errorf("finish: %w", err)
	}
	return n, nil
}

// FinishBatch is Finish for the holder of an order claim (Batch) that
// leased claimed entries under token, of which serials are some: while no
// script has changed its batch, the records are not read back
// (finishBatchScript). claimed 0 is Finish.
func (s *Store) FinishBatch(ctx context.Context, token string, claimed int, serials []string) (int, error) {
	if claimed <= 0 {
		return s.Finish(ctx, token, serials, false)
	}
	k := s.keys
	keys := []string{k.Inflight, k.Deadlines, k.Lease, k.Leases, k.LeaseBatch}
	n, err := finishBatchScript.Run(ctx, s.rdb, keys, scriptArgs(distinct(serials), token, claimed)...).Int()
	if err != nil {
		return 0, fmt.Errorf("finish: %w", err)
	}
	return n, nil
}

// FinishScriptHash is finishScript's SHA1, for tests that make it fail.
func FinishScriptHash() string { return finishScript.Hash() }

// FinishBatchScriptHash is finishBatchScript's SHA1, for tests that make it fail.
func FinishBatchScriptHash() string { return finishBatchScript.Hash() }

// RetryScriptHash is retryScript's SHA1, for tests that make it fail.
func RetryScriptHash() string { return retryScript.Hash() }

// retryScript turns leases into backoffs: the entry stays out of the queue,
// its expiry becomes now + delay, its token "-" and, when ARGV[3] is 1, its
// attempt count grows by one. A batch lease's member becomes a per-member
// backoff ({queue}:inflight and {queue}:deadlines) and leaves the batch.
//
//	KEYS[1] -> {queue}:inflight KEYS[2] -> {queue}:lease
//	KEYS[3] -> {queue}:deadlines KEYS[4] -> {queue}:leases
//	KEYS[5] -> {queue}:leasebatch
//	ARGV[1] -> lease token; ARGV[2] -> delay ms; ARGV[3] -> 1 to spend an
//	attempt, 0 not to; ARGV[4] -> last error; ARGV[5..] -> serials
//
// Compare-and-set as finishScript. Returns {number moved, retry time on
// Redis's clock in ms}, so the scanner wakes for it on the same clock.
//
// A command refused mid-script (an ACL tightened at runtime) leaves the
// writes before it: each entry's backoff is written before its record
// stops carrying the batch's token, and the batch lets go of its members
// last (see unlease), so every entry is in its batch or its backoff.
var retryScript = redis.NewScript(luaHelpers + `
local at = now_ms() + tonumber(ARGV[2])
local spend = tonumber(ARGV[3])
local err = string.gsub(ARGV[4], '|', '/')
local mine = owned(KEYS[2], ARGV[1], 5)
local batch = redis.call('HEXISTS', KEYS[5], '#' .. ARGV[1]) == 1
-- A batch's members become backoffs: it is marked first.
if batch and #mine > 0 then touch(KEYS[5], ARGV[1]) end
for _, e in ipairs(mine) do
  redis.call('ZADD', KEYS[1], at, e[1])
  if batch then redis.call('ZADD', KEYS[3], e[2], e[1]) end
  redis.call('HSET', KEYS[2], e[1], e[2] .. '|' .. (e[3] + spend) .. '|-|' .. err)
end
if batch then unlease(KEYS[4], KEYS[5], ARGV[1], #mine) end
return {#mine, at}
`)

// RetryArgs are a retry's parameters (retryScript).
type RetryArgs struct {
	Token     string        // the lease token the entries are held under
	Serials   []string      // the entries
	Delay     time.Duration // backoff, from now on Redis's clock
	Spend     bool          // the retry spends an attempt
	LastError string        // recorded in the lease record ('|' becomes '/')
}

// RetryResult is what a retry did.
type RetryResult struct {
	Moved int   // entries turned into backoffs (the others' lease was lost)
	At    int64 // when they are due again, Unix ms on Redis's clock
}

// backoffMillis is the delay a retry script adds to Redis's clock, in
// whole milliseconds: rounded up, plus one for the clock itself, which the
// scripts read to the millisecond rounded down (now_ms). A backoff of d
// therefore ends no sooner than d after the script ran, never up to a
// millisecond before (worker.RetryAfter promises "no sooner than d"). No
// delay stays none: due at once, to any claim after the retry.
func backoffMillis(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	ms := int64(d / time.Millisecond) // divided first: d near its maximum does not wrap
	if d%time.Millisecond != 0 {
		ms++
	}
	return ms + 1
}

// Retry turns the leases of a.Serials still held under a.Token into
// backoffs due no sooner than a.Delay from now (backoffMillis).
func (s *Store) Retry(ctx context.Context, a RetryArgs) (RetryResult, error) {
	k := s.keys
	args := scriptArgs(distinct(a.Serials), a.Token, backoffMillis(a.Delay), boolArg(a.Spend), a.LastError)
	res, err := retryScript.Run(ctx, s.rdb, []string{k.Inflight, k.Lease, k.Deadlines, k.Leases, k.LeaseBatch}, args...).Int64Slice()
	if err != nil {
		return RetryResult{}, fmt.Errorf("retry: %w", err)
	}
	if len(res) != 2 {
		return RetryResult{}, fmt.Errorf("retry: %w: %d fields, want 2", ErrReply, len(res))
	}
	return RetryResult{Moved: int(res[0]), At: res[1]}, nil
}

// luaFenceRecords is the fence's check of the lease records, shared by
// fenceScript and fenceBatchScript.
const luaFenceRecords = `
-- fence_records returns, of the serials ARGV[first..], those whose lease
-- record no longer carries token or that the queue key holds with a
-- deadline after cutoff.
local function fence_records(token, cutoff, first)
  local needle = '|' .. token .. '|'
  local find = string.find
  local drop, nd = {}, 0
  for i = first, #ARGV, 500 do
    local last = math.min(i + 499, #ARGV)
    local recs = redis.call('HMGET', KEYS[2], unpack(ARGV, i, last))
    local qs = redis.call('ZMSCORE', KEYS[1], unpack(ARGV, i, last))
    for j = 1, #recs do
      -- carries(recs[j], needle), inline: this runs for every order closed
      local r, q = recs[j], qs[j]
      if not r or not find(r, needle, 1, true) or (q and tonumber(q) > cutoff) then nd = nd + 1; drop[nd] = ARGV[i + j - 1] end
    end
  end
  return drop
end
`

// fenceScript is asked, while a close transaction holds its rows and
// before it commits, which of the serials it closed are no longer this
// claim's to close.
//
//	KEYS[1] -> queue  KEYS[2] -> {queue}:lease
//	ARGV[1] -> lease token; ARGV[2] -> close delay, ms; ARGV[3..] -> serials
//
// A serial is dropped when its lease record no longer carries the token
// (another replica took it over, a producer rescheduled it through the API
// or the client, an operator moved it) or when the queue key holds it with
// a deadline not yet due (a raw ZADD moved it while it was leased). Returns
// the serials to drop.
var fenceScript = redis.NewScript(luaHelpers + luaFenceRecords + `
return fence_records(ARGV[1], now_ms() - tonumber(ARGV[2]), 3)
`)

// fenceBatchScript is fenceScript for the holder of an order claim's
// batch lease that knows how many entries its claim leased.
//
//	KEYS[1] -> queue  KEYS[2] -> {queue}:lease  KEYS[3] -> {queue}:leasebatch
//	ARGV[1] -> lease token; ARGV[2] -> close delay, ms;
//	ARGV[3] -> entries the claim leased; ARGV[4..] -> serials, all leased
//	by that claim
//
// While the batch is clean (see clean in luaHelpers) every serial still
// carries the token, and only the queue key is asked (a raw ZADD of a
// later deadline is still seen); otherwise fenceScript's full check.
var fenceBatchScript = redis.NewScript(luaHelpers + luaFenceRecords + `
local cutoff = now_ms() - tonumber(ARGV[2])
if not clean(KEYS[3], ARGV[1], tonumber(ARGV[3]), #ARGV - 3) then return fence_records(ARGV[1], cutoff, 4) end
return later(KEYS[1], cutoff, 4)
`)

// Fence returns the serials, among those a close under token is about to
// commit, that are no longer that claim's to close (see fenceScript).
func (s *Store) Fence(ctx context.Context, token string, closeDelay time.Duration, serials []string) ([]string, error) {
	k := s.keys
	args := scriptArgs(serials, token, closeDelay.Milliseconds())
	got, err := fenceScript.Run(ctx, s.rdb, []string{k.Queue, k.Lease}, args...).StringSlice()
	if err != nil {
		return nil, fmt.Errorf("fence: %w", err)
	}
	return got, nil
}

// FenceBatch is Fence for the holder of an order claim (Batch) that leased
// claimed entries under token, of which serials are some: while no script
// has changed its batch, only the queue key is asked (fenceBatchScript).
// claimed 0 is Fence.
func (s *Store) FenceBatch(ctx context.Context, token string, claimed int, closeDelay time.Duration, serials []string) ([]string, error) {
	if claimed <= 0 {
		return s.Fence(ctx, token, closeDelay, serials)
	}
	k := s.keys
	args := scriptArgs(serials, token, closeDelay.Milliseconds(), claimed)
	got, err := fenceBatchScript.Run(ctx, s.rdb, []string{k.Queue, k.Lease, k.LeaseBatch}, args...).StringSlice()
	if err != nil {
		return nil, fmt.Errorf("fence: %w", err)
	}
	return got, nil
}

// laterScript is the fence's question to another key of the same logical
// queue (the queue key, or a serial's shard): which of the serials does it
// hold with a deadline not yet due (a producer wrote it there)?
//
//	KEYS[1] -> a queue key
//	ARGV[1] -> close delay, ms; ARGV[2..] -> serials
//
// Returns those serials.
var laterScript = redis.NewScript(luaHelpers + `
return later(KEYS[1], now_ms() - tonumber(ARGV[1]), 2)
`)

// Later returns the serials the store's queue key holds with a deadline
// not yet due (less closeDelay): the fence's question to another key of
// the same logical queue (see laterScript).
func (s *Store) Later(ctx context.Context, closeDelay time.Duration, serials []string) ([]string, error) {
	args := scriptArgs(serials, closeDelay.Milliseconds())
	got, err := laterScript.Run(ctx, s.rdb, []string{s.keys.Queue}, args...).StringSlice()
	if err != nil {
		return nil, fmt.Errorf("fence: %w", err)
	}
	return got, nil
}

// buryScript dead-letters leased entries.
//
//	KEYS[1] -> {queue}:inflight KEYS[2] -> {queue}:deadlines KEYS[3] -> {queue}:lease
//	KEYS[4] -> {queue}:dead     KEYS[5] -> {queue}:deadinfo
//	KEYS[6] -> {queue}:leases   KEYS[7] -> {queue}:leasebatch
//	ARGV[1] -> lease token; ARGV[2] -> reason; ARGV[3] -> last error;
//	ARGV[4] -> "1" to count the run that failed, "0" when the record counts
//	it already (a claim that re-took an expired lease, PollTasks);
//	ARGV[5..] -> serials
//
// Compare-and-set as finishScript. The dead-letter record keeps reason,
// attempts (including the one that failed), deadline and last error.
// Returns the number moved.
//
// Each entry is dead-lettered before its lease goes, and the batch lets
// go of its members last (see unlease): a command refused mid-script (an
// ACL tightened at runtime) leaves every entry leased or dead-lettered.
var buryScript = redis.NewScript(luaHelpers + `
local now = now_ms()
local err = string.gsub(ARGV[3], '|', '/')
local run = tonumber(ARGV[4])
local mine = owned(KEYS[3], ARGV[1], 5)
if #mine > 0 then touch(KEYS[7], ARGV[1]) end
for _, e in ipairs(mine) do
  local s = e[1]
  redis.call('ZADD', KEYS[4], now, s)
  redis.call('HSET', KEYS[5], s, ARGV[2] .. '|' .. (e[3] + run) .. '|' .. e[2] .. '|' .. err)
  redis.call('HDEL', KEYS[3], s)
  redis.call('ZREM', KEYS[1], s)
  redis.call('ZREM', KEYS[2], s)
end
release(KEYS[6], KEYS[7], ARGV[1], #mine)
return #mine
`)

// BuryArgs are a bury's parameters (buryScript).
type BuryArgs struct {
	Token     string   // the lease token the entries are held under
	Serials   []string // the entries
	Reason    string   // the dead-letter reason (Reason*, or a task action's)
	LastError string   // recorded in the dead-letter record ('|' becomes '/')
	CountRun  bool     // add the run that failed to the attempts (false: the record counts it already)
}

// Bury dead-letters a.Serials still leased under a.Token and returns how
// many it moved; the others' lease was lost.
func (s *Store) Bury(ctx context.Context, a BuryArgs) (int, error) {
	k := s.keys
	args := scriptArgs(distinct(a.Serials), a.Token, a.Reason, a.LastError, boolArg(a.CountRun))
	n, err := buryScript.Run(ctx, s.rdb, []string{k.Inflight, k.Deadlines, k.Lease, k.Dead, k.DeadInfo, k.Leases, k.LeaseBatch}, args...).Int()
	if err != nil {
		return 0, fmt.Errorf("dead-letter: %w", err)
	}
	return n, nil
}

// handBackScript returns leased entries to the queue with their true
// deadline, so another replica can take them at once.
//
//	KEYS[1] -> queue KEYS[2] -> {queue}:inflight KEYS[3] -> {queue}:deadlines
//	KEYS[4] -> {queue}:lease KEYS[5] -> {queue}:leases KEYS[6] -> {queue}:leasebatch
//	ARGV[1] -> lease token; ARGV[2..] -> serials
//
// Compare-and-set as finishScript; ZADD NX keeps an entry a producer wrote
// meanwhile. Returns the number handed back.
//
// Each entry is in the queue key before its lease goes, and the batch
// lets go of its members last (see unlease): a command refused
// mid-script (an ACL tightened at runtime) leaves every entry leased or
// queued (or both: the claim drops such a stale lease).
var handBackScript = redis.NewScript(luaHelpers + `
local mine = owned(KEYS[4], ARGV[1], 2)
if #mine > 0 then touch(KEYS[6], ARGV[1]) end
for _, e in ipairs(mine) do
  local s = e[1]
  redis.call('ZADD', KEYS[1], 'NX', e[2], s)
  redis.call('HDEL', KEYS[4], s)
  redis.call('ZREM', KEYS[2], s)
  redis.call('ZREM', KEYS[3], s)
end
release(KEYS[5], KEYS[6], ARGV[1], #mine)
return #mine
`)

// HandBack returns serials still leased under token to the queue key with
// their true deadlines, and returns how many it handed back.
func (s *Store) HandBack(ctx context.Context, token string, serials []string) (int, error) {
	k := s.keys
	args := scriptArgs(distinct(serials), token)
	n, err := handBackScript.Run(ctx, s.rdb, []string{k.Queue, k.Inflight, k.Deadlines, k.Lease, k.Leases, k.LeaseBatch}, args...).Int()
	if err != nil {
		return 0, fmt.Errorf("hand back: %w", err)
	}
	return n, nil
}

// inQueueScript tells the reconciler which serials a queue still holds.
//
//	KEYS[1] -> queue  KEYS[2] -> {queue}:lease
//	ARGV    -> serials
//
// Returns, for each serial, 1 if it is in the queue key (whatever its
// score, 0 included) or has a lease record (leased or backing off), else 0.
var inQueueScript = redis.NewScript(`
local out = {}
for i = 1, #ARGV, 500 do
  local last = math.min(i + 499, #ARGV)
  local qs = redis.call('ZMSCORE', KEYS[1], unpack(ARGV, i, last))
  local ls = redis.call('HMGET', KEYS[2], unpack(ARGV, i, last))
  for j = 1, #qs do
    if qs[j] or ls[j] then out[#out+1] = 1 else out[#out+1] = 0 end
  end
end
return out
`)

// InQueue reports, for each serial, whether the store holds it: in the
// queue key, or leased or backing off. One script reads both, atomically.
func (s *Store) InQueue(ctx context.Context, serials []string) ([]bool, error) {
	in, err := inQueueScript.Run(ctx, s.rdb, []string{s.keys.Queue, s.keys.Lease}, scriptArgs(serials)...).Int64Slice()
	if err != nil {
		return nil, fmt.Errorf("in queue: %w", err)
	}
	if len(in) != len(serials) {
		return nil, fmt.Errorf("in queue: %w: %d answers for %d serials", ErrReply, len(in), len(serials))
	}
	out := make([]bool, len(in))
	for i, v := range in {
		out[i] = v == 1
	}
	return out, nil
}

// statsScript reads the queue gauges in one consistent step, on Redis's
// clock. The reads are O(log n), plus O(k) in the entries leased per
// member or backing off when there are at most 2000 of them, plus O(b) in
// the batch leases.
//
//	KEYS[1] -> queue KEYS[2] -> {queue}:inflight KEYS[3] -> {queue}:deadlines
//	KEYS[4] -> {queue}:dead KEYS[5] -> {queue}:leases KEYS[6] -> {queue}:leasebatch
//	KEYS[7] -> {queue}:lease
//
// A serial a producer wrote into the queue key while it was leased or
// backing off sits in both keys until the claim drops the stale companion;
// it is counted once, at the queue key's deadline (the producer's). Beyond
// 2000 per-member companions (a long database outage) that correction is
// skipped and such serials may count twice. Members of batch leases are
// read one by one when the batches hold at most 2000 (they hold what the
// replicas' workers are closing) and their lists name at most 2000 (a list
// keeps the members that left its batch); beyond that their batches' counts stand
// for them, uncorrected, and each batch's oldest claimed deadline for
// theirs (a batch lives for one close: the double count and an oldest
// older than the truth last until it ends, or its lease expires).
//
// Every member of a batch lease is overdue: it was claimed at or after its
// deadline, on this clock.
//
// The oldest and next deadlines are taken among valid scores only (from
// 2000-01-01, queue.MinDeadline, to ten years ahead, queue.MaxAhead): a
// raw producer's -inf or seconds-for-milliseconds score, which the next
// claim dead-letters, would otherwise hide the real oldest overdue entry
// (-inf reads as the smallest integer) or stand in for it (56 years).
// Overdue still counts such members: they are due.
//
// Returns {now, depth, overdue, oldest deadline or -1, dead depth,
// next deadline or -1, held}: held counts the entries leased or backing
// off, on every replica.
var statsScript = redis.NewScript(luaHelpers + `
local now = now_ms()
local held = redis.call('ZCARD', KEYS[2])
local both, bothOverdue = 0, 0
if held > 0 and held <= 2000 then
  local ms = redis.call('ZRANGE', KEYS[2], 0, -1)
  for i = 1, #ms, 500 do
    local last = math.min(i + 499, #ms)
    local qs = redis.call('ZMSCORE', KEYS[1], unpack(ms, i, last))
    local ds = redis.call('ZMSCORE', KEYS[3], unpack(ms, i, last))
    for j = 1, #qs do
      if qs[j] then
        both = both + 1
        if ds[j] and tonumber(ds[j]) <= now then bothOverdue = bothOverdue + 1 end
      end
    end
  end
end
local oldest = -1
local batched = 0
local toks = redis.call('ZRANGE', KEYS[5], 0, -1)
for i = 1, #toks, 250 do
  local f = {}
  for j = i, math.min(i + 249, #toks) do
    f[#f+1] = '#' .. toks[j]; f[#f+1] = '<' .. toks[j]
  end
  local v = redis.call('HMGET', KEYS[6], unpack(f))
  for j = 1, #v, 2 do
    local k = tonumber(v[j]) or 0
    if k > 0 then
      batched = batched + k
      local o = tonumber(v[j+1])
      if o and o < 0 then o = -o end -- marked as changed (touch)
      if o and o >= 946684800000 and (oldest == -1 or o < oldest) then oldest = o end
    end
  end
end
-- A batch's list names every member it was given, also those that left
-- it since (a batch settled order by order holds few of the many it
-- names): the lists are read only when they name at most 2000 in all.
local lists, listed = {}, 0
if batched > 0 and batched <= 2000 then
  for i, t in ipairs(toks) do
    lists[i] = redis.call('HGET', KEYS[6], t) or ''
    if lists[i] ~= '' then listed = listed + select(2, string.gsub(lists[i], '\n', '')) + 1 end
    if listed > 2000 then break end
  end
end
if batched > 0 and batched <= 2000 and listed <= 2000 then
  -- Few enough to read: count the members that still carry their batch's
  -- token, once, at the producer's deadline when the queue key has them.
  batched, oldest = 0, -1
  for ti, t in ipairs(toks) do
    local needle = '|' .. t .. '|'
    local list = {}
    for m in string.gmatch(lists[ti], '[^\n]+') do list[#list+1] = m end
    local recs, qs = records(KEYS[7], KEYS[1], list)
    for j = 1, #list do
      if carries(recs[j], needle) and not qs[j] then
        batched = batched + 1
        local d = parse(recs[j])
        if d and d >= 946684800000 and (oldest == -1 or d < oldest) then oldest = d end
      end
    end
  end
end
local depth = redis.call('ZCARD', KEYS[1]) + held + batched - both
local overdue = redis.call('ZCOUNT', KEYS[1], '-inf', now) + redis.call('ZCOUNT', KEYS[3], '-inf', now) + batched - bothOverdue
local h = redis.call('ZRANGE', KEYS[1], 946684800000, now, 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')
if h[2] and (oldest == -1 or tonumber(h[2]) < oldest) then oldest = tonumber(h[2]) end
h = redis.call('ZRANGE', KEYS[3], 946684800000, '+inf', 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')
if h[2] and (oldest == -1 or tonumber(h[2]) < oldest) then oldest = tonumber(h[2]) end
local nextD = -1
h = redis.call('ZRANGE', KEYS[1], '(' .. now, now + 315360000000, 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')
if h[2] then nextD = tonumber(h[2]) end
return {now, depth, overdue, oldest, redis.call('ZCARD', KEYS[4]), nextD, held + batched}
`)

// Stats are a queue's gauges, read from Redis in one step. They are the
// same on every replica.
type Stats struct {
	Now          time.Time     // Redis's clock
	Depth        int64         // entries queued, leased or backing off
	Overdue      int64         // entries past their deadline, leased ones included
	OldestDue    time.Duration // age of the oldest overdue entry (0 if none)
	DeadLetters  int64         // entries in the dead-letter set
	NextDeadline time.Time     // earliest deadline still ahead (zero if none)
	Held         int64         // entries leased or backing off, by any replica or poll
}

// Stats reads the store's gauges (statsScript).
func (s *Store) Stats(ctx context.Context) (Stats, error) { return ReadStats(ctx, s.rdb, s.keys) }

// ReadStats reads the gauges of the queue with keys k, for callers that
// hold only a script runner.
func ReadStats(ctx context.Context, rdb redis.Scripter, k Keys) (Stats, error) {
	v, err := statsScript.Run(ctx, rdb, []string{k.Queue, k.Inflight, k.Deadlines, k.Dead, k.Leases, k.LeaseBatch, k.Lease}).Int64Slice()
	if err != nil {
		return Stats{}, fmt.Errorf("read stats: %w", err)
	}
	if len(v) != 7 {
		return Stats{}, fmt.Errorf("read stats: %w: %d fields, want 7", ErrReply, len(v))
	}
	s := Stats{Now: time.UnixMilli(v[0]), Depth: v[1], Overdue: v[2], DeadLetters: v[4], Held: v[6]}
	if v[3] >= 0 && v[3] <= v[0] {
		s.OldestDue = time.Duration(v[0]-v[3]) * time.Millisecond
	}
	if v[5] >= 0 {
		s.NextDeadline = time.UnixMilli(v[5])
	}
	return s, nil
}
