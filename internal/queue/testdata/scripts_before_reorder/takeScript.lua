
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

for _ = 1, math.min(redis.call('LLEN', KEYS[1]), tonumber(ARGV[1])) do
  local item = redis.call('LINDEX', KEYS[1], -1)
  local id = split_item(item) or item
  if redis.call('HEXISTS', KEYS[4], id) == 0 then
    redis.call('LMOVE', KEYS[1], KEYS[2], 'RIGHT', 'LEFT')
    local now = redis.call('TIME')
    local at = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
    redis.call('ZADD', KEYS[3], at, id)
    redis.call('HSET', KEYS[4], id, item)
    local n = redis.call('HINCRBY', KEYS[5], id, 1)
    return {item, n}
  end
  redis.call('LMOVE', KEYS[1], KEYS[1], 'RIGHT', 'LEFT')
end
return nil
