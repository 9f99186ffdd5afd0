
local function unbatch(leases, info, rec)
  if not rec then return end
  local tok = string.match(rec, '^[^|]*|[^|]*|([^|]*)')
  if not tok or redis.call('HEXISTS', info, '#' .. tok) == 0 then return end
  if redis.call('HINCRBY', info, '#' .. tok, -1) <= 0 then
    redis.call('ZREM', leases, tok)
    redis.call('HDEL', info, tok, '#' .. tok, '<' .. tok)
  end
end

local mode = ARGV[1]
local n = (#ARGV - 1) / 2
local members = {}
for i = 1, n do members[i] = ARGV[2 * i] end
-- Current scores and lease records, read in a few calls, not one per item.
local scores, recs, missing, at = {}, {}, {}, {}
for i = 1, n, 500 do
  local part = redis.call('ZMSCORE', KEYS[1], unpack(members, i, math.min(i + 499, n)))
  for j = 1, #part do scores[i + j - 1] = part[j] end
end
for i = 1, n do
  if not scores[i] then missing[#missing + 1] = members[i]; at[#at + 1] = i end
end
for i = 1, #missing, 500 do
  local part = redis.call('HMGET', KEYS[2], unpack(missing, i, math.min(i + 499, #missing)))
  for j = 1, #part do recs[at[i + j - 1]] = part[j] end
end
local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local headScore = head[2] and tonumber(head[2]) or nil
local earliest = nil
local out, zadd, seen, drops = {}, {}, {}, {}
for i = 1, n do
  local s = members[i]
  local d = tonumber(ARGV[2 * i + 1])
  local res = 0
  local cur, leased = seen[s], false
  if cur == nil then
    if scores[i] then
      cur = tonumber(scores[i])
    elseif recs[i] then
      cur = tonumber(string.match(recs[i], '^([^|]*)'))
      leased = true
    end
  end
  if not cur then
    res = 1
  elseif (mode == 'set' and d ~= cur) or (mode == 'later' and d > cur) then
    if leased then drops[#drops + 1] = i end
    res = 2
  else
    d = cur
  end
  if res ~= 0 then
    zadd[#zadd + 1] = d; zadd[#zadd + 1] = s
    if earliest == nil or d < earliest then earliest = d end
  end
  seen[s] = d
  out[#out + 1] = res
  out[#out + 1] = d
end
for i = 1, #zadd, 1000 do
  redis.call('ZADD', KEYS[1], unpack(zadd, i, math.min(i + 999, #zadd)))
end
-- The leases of the entries moved go once the queue key holds them, each
-- record before its batch counts it out (see the doc comment).
for _, i in ipairs(drops) do
  local s = members[i]
  redis.call('HDEL', KEYS[2], s)
  unbatch(KEYS[6], KEYS[7], recs[i])
  redis.call('ZREM', KEYS[3], s)
  redis.call('ZREM', KEYS[4], s)
end
if mode ~= 'adopt' and earliest ~= nil and (headScore == nil or earliest < headScore) then
  redis.call('PUBLISH', KEYS[5], earliest)
end
return out
