
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local now = now_ms()
local out, n = {}, 0
for i = 1, #ARGV do
  local id = ARGV[i]
  if not redis.call('ZSCORE', KEYS[3], id) then
    out[i] = 0
  elseif redis.call('ZSCORE', KEYS[1], id) or redis.call('HEXISTS', KEYS[2], id) == 1
      or redis.call('HEXISTS', KEYS[5], id) == 1 then
    out[i] = 2
  else
    redis.call('ZREM', KEYS[3], id)
    redis.call('HDEL', KEYS[4], id)
    redis.call('ZADD', KEYS[1], now, id)
    out[i] = 1
    n = n + 1
  end
end
if n > 0 then redis.call('PUBLISH', KEYS[6], now) end
return out
