
local meta = redis.call('HMGET', KEYS[7], 'durable', 'max_pending')
if meta[1] == '1' and ARGV[5] ~= 'durable' then return {-1, 0} end
local mode, id, d = ARGV[1], ARGV[2], tonumber(ARGV[3])
local cur = redis.call('ZSCORE', KEYS[1], id)
local leased = false
if not cur then
  local rec = redis.call('HGET', KEYS[2], id)
  if rec then cur = string.match(rec, '^([^|]*)'); leased = true end
end
if cur then cur = tonumber(cur) end
local res = 0
if not cur then
  local cap = tonumber(meta[2])
  if cap and redis.call('ZCARD', KEYS[1]) + redis.call('ZCARD', KEYS[3]) >= cap then return {-2, cap} end
  res = 1
elseif (mode == 'set' and d ~= cur) or (mode == 'later' and d > cur) then
  res = 2
  if leased then
    redis.call('HDEL', KEYS[2], id)
    redis.call('ZREM', KEYS[3], id)
    redis.call('ZREM', KEYS[4], id)
  end
else
  return {0, cur}
end
local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
redis.call('ZADD', KEYS[1], d, id)
redis.call('HSET', KEYS[6], id, ARGV[4])
if not head[2] or d < tonumber(head[2]) then redis.call('PUBLISH', KEYS[5], d) end
return {res, d}
