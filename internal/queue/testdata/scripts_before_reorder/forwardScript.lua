
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

local function split_item(body)
  if string.sub(body, 1, 6) ~= '{"id":' then return nil end
  local a, b = string.find(body, ',"deadline_ms":', 7, true)
  if not a then return nil end
  local ok, id = pcall(cjson.decode, string.sub(body, 7, a - 1))
  if not ok or type(id) ~= 'string' then return nil end
  local c, e, d = string.find(body, '^(%d+),"payload":', b + 1)
  if not c or string.sub(body, -1) ~= '}' then return nil end
  return id, d, string.sub(body, e + 1, -2)
end

local now = now_ms()
local function head()
  local h = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if h[2] then return tonumber(h[2]) end
  return -1
end
local ack, maxAttempts = tonumber(ARGV[6]), tonumber(ARGV[7])
local function nextRecovery()
  if ARGV[5] ~= '1' then return -1 end
  local h = redis.call('ZRANGE', KEYS[7], 0, 0, 'WITHSCORES')
  if h[2] then return tonumber(h[2]) + ack end
  return -1
end
if redis.call('EXISTS', KEYS[3]) == 1 then
  return {now, head(), nextRecovery(), {}, {}, 1, 0, 0, {}, 0}
end
local limit = tonumber(ARGV[2])
local full = 0
local recovered, late = 0, {}
local dead, n = {}, 0
if ARGV[5] == '1' then
  local late = redis.call('ZRANGE', KEYS[7], '-inf', now - ack, 'BYSCORE', 'LIMIT', 0, limit)
  for _, id in ipairs(late) do
    local body = redis.call('HGET', KEYS[8], id)
    if body then
      redis.call('LREM', KEYS[9], 1, body)
      local taken = tonumber(redis.call('HGET', KEYS[10], id) or '0')
      if taken >= maxAttempts then
        local _, d, payload = split_item(body)
        redis.call('ZADD', KEYS[5], now, id)
        redis.call('HSET', KEYS[6], id, 'failed|' .. taken .. '|' .. (d or '0') ..
          '|taken ' .. taken .. ' times, never acknowledged within ack_timeout')
        if payload then redis.call('HSETNX', KEYS[2], id, payload) end
        redis.call('HDEL', KEYS[10], id)
        dead[#dead+1] = id; dead[#dead+1] = 'failed'
      else
        redis.call('RPUSH', KEYS[4], body)
      end
    end
    redis.call('ZREM', KEYS[7], id)
    redis.call('HDEL', KEYS[8], id)
    recovered = recovered + 1
  end
end
local take = limit
local cap = tonumber(ARGV[3])
if ARGV[1] == 'list' and cap > 0 then
  take = math.min(limit, cap - redis.call('LLEN', KEYS[4]))
  if take <= 0 then
    take = 0
    local h = head()
    if h >= 0 and h <= now then full = 1 end
  end
end
local due = {}
if take > 0 then
  due = redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, take, 'WITHSCORES')
end
for i = 1, #due, 2 do
  local id, d = due[i], tonumber(due[i+1])
  redis.call('ZREM', KEYS[1], id)
  local payload = redis.call('HGET', KEYS[2], id) or 'null'
  if not valid_serial(id) or d ~= math.floor(d) or d < 946684800000 then
    local reason = 'malformed'
    if valid_serial(id) and d == math.floor(d) then reason = 'score_out_of_range' end
    redis.call('ZADD', KEYS[5], now, id)
    redis.call('HSET', KEYS[6], id, reason .. '|0|' .. due[i+1] .. '|')
    dead[#dead+1] = id; dead[#dead+1] = reason
  else
    if ARGV[1] == 'stream' then
      redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[3], '*', 'id', id, 'deadline', d,
        'queue', ARGV[4], 'payload', payload)
    else
      redis.call('LPUSH', KEYS[4], '{"id":' .. cjson.encode(id) .. ',"deadline_ms":' .. d .. ',"payload":' .. payload .. '}')
    end
    if not redis.call('ZSCORE', KEYS[5], id) then redis.call('HDEL', KEYS[2], id) end
    n = n + 1
    late[n] = now - d
  end
end
return {now, head(), nextRecovery(), {}, dead, 0, n, recovered, late, full}
