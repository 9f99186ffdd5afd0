
local function unbatch(leases, info, rec)
  if not rec then return end
  local tok = string.match(rec, '^[^|]*|[^|]*|([^|]*)')
  if not tok or redis.call('HEXISTS', info, '#' .. tok) == 0 then return end
  if redis.call('HINCRBY', info, '#' .. tok, -1) <= 0 then
    redis.call('ZREM', leases, tok)
    redis.call('HDEL', info, tok, '#' .. tok, '<' .. tok)
  end
end

-- The lease goes first and the queue entry last: a cancel stopped by a
-- refused command leaves the producer's latest write in the queue key
-- with no lease from before it (whose holder's fence would then accept
-- the serial, and close it at the older deadline), and takes the batch's
-- count down only once the record no longer carries its token.
local rec = redis.call('HGET', KEYS[2], ARGV[1])
local n = redis.call('HDEL', KEYS[2], ARGV[1])
unbatch(KEYS[5], KEYS[6], rec)
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
n = n + redis.call('ZREM', KEYS[1], ARGV[1])
if n > 0 then return 1 end
return 0
