
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local now = now_ms()
local n = 0
for i = 1, #ARGV do
  local s = ARGV[i]
  if redis.call('ZREM', KEYS[2], s) == 1 then
    redis.call('HDEL', KEYS[3], s)
    redis.call('ZADD', KEYS[1], 'NX', now, s)
    n = n + 1
  end
end
return n
