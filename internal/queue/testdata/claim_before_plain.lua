
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
  local floor = math.floor
  local zsfx = '|0' .. sfx
  -- The entries handled (leased or buried) are the first nrem of the
  -- queue key by rank: ZRANGE from -inf starts at rank 0, and nothing
  -- changes the queue key before they are removed (among the writes at
  -- the end).
  for i = 1, #list do
    local s, raw = list[i], due[2 * i]
    local d = tonumber(raw)
    local len = #s
    if len == 0 or len > 128 or not (printable or valid_serial(s)) or d ~= floor(d) then
      bury(s, 'malformed', raw)
    elseif d < 946684800000 then
      bury(s, 'score_out_of_range', raw)
    elseif budget > 0 and not fits(s) then
      break
    else
      local rec = recs[i]
      if rec then
        local _, a = parse(rec)
        over[#over+1] = s; overRecs[#over] = rec
        lease(s, d, a or 0)
        claimed[#claimed+1] = s; claimed[#claimed+1] = d
        claimed[#claimed+1] = a or 0; claimed[#claimed+1] = 0
      elseif batch then
        -- lease(s, d, 0, raw .. zsfx), inline
        n = n + 1
        nla = nla + 1; leaseArgs[nla] = s
        nla = nla + 1; leaseArgs[nla] = raw .. zsfx
        nmem = nmem + 1; members[nmem] = s
        if not oldest or d < oldest then oldest = d end
        nf = nf + 1; fresh[nf] = s
        nf = nf + 1; fresh[nf] = d
      else
        lease(s, d, 0, raw .. zsfx)
        nf = nf + 1; fresh[nf] = s
        nf = nf + 1; fresh[nf] = d
      end
    end
    nrem = i
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
