
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local now = now_ms()
local group = string.gsub(ARGV[1], '|', '/')
local maxAttempts = tonumber(ARGV[3])
local buried, gone = 0, 0
for i = 4, #ARGV do
  local eid = ARGV[i]
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', ARGV[2], eid, eid, 1)
  if p[1] and tonumber(p[1][4]) >= maxAttempts then
    local count = tonumber(p[1][4])
    redis.call('XACK', KEYS[1], ARGV[1], eid)
    local e = redis.call('XRANGE', KEYS[1], eid, eid)
    local id, d, payload
    if e[1] then
      local f = e[1][2]
      for j = 1, #f - 1, 2 do
        if f[j] == 'id' then id = f[j+1]
        elseif f[j] == 'deadline' then d = f[j+1]
        elseif f[j] == 'payload' then payload = f[j+1] end
      end
    end
    if id then
      redis.call('ZADD', KEYS[2], now, id)
      redis.call('HSET', KEYS[3], id, 'failed|' .. count .. '|' .. (d or '0') ..
        '|consumer group ' .. group .. ': delivered ' .. count .. ' times, never acknowledged within ack_timeout')
      if payload then redis.call('HSETNX', KEYS[4], id, payload) end
      buried = buried + 1
    else
      gone = gone + 1
    end
  end
end
return {buried, gone}
