
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
-- release takes k members off the batch lease token (leases: the batch
-- expiries, info: the batch records) and drops the batch with the last
-- one. It reports whether token is a batch lease's (false: a per-member
-- lease, a backoff, a task's).
local function release(leases, info, token, k)
  if redis.call('HEXISTS', info, '#' .. token) == 0 then return false end
  if k > 0 and redis.call('HINCRBY', info, '#' .. token, -k) <= 0 then
    redis.call('ZREM', leases, token)
    redis.call('HDEL', info, token, '#' .. token, '<' .. token)
  end
  return true
end

local at = now_ms() + tonumber(ARGV[2])
local spend = tonumber(ARGV[3])
local err = string.gsub(ARGV[4], '|', '/')
local mine = owned(KEYS[2], ARGV[1], 5)
local batch = release(KEYS[4], KEYS[5], ARGV[1], #mine)
for _, e in ipairs(mine) do
  redis.call('HSET', KEYS[2], e[1], e[2] .. '|' .. (e[3] + spend) .. '|-|' .. err)
  redis.call('ZADD', KEYS[1], at, e[1])
  if batch then redis.call('ZADD', KEYS[3], e[2], e[1]) end
end
return {#mine, at}
