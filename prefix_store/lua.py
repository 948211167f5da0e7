"""Server-side scripts of the Redis prefix index: each operation is one atomic round trip.

Keys share one hash tag, `{namespace}`, so a Redis Cluster keeps them in one slot. Liveness
is a sorted set of engine -> deadline (ms, Redis' own clock, so gateways' clocks never
matter); every per-engine key also carries the same TTL so a dead engine's data frees itself.
"""

# Shared prologue: `now` in ms from the server clock.
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# A live engine has a future deadline and a sequence number; refresh pushes both forward.
_ALIVE_AND_REFRESH = """
local function alive(engines, seqkey, engine)
  local deadline = redis.call('ZSCORE', engines, engine)
  return deadline and tonumber(deadline) > now and redis.call('EXISTS', seqkey) == 1
end
local function refresh(engines, blocks, seqkey, engine, ttl)
  redis.call('ZADD', engines, now + ttl, engine)
  redis.call('PEXPIRE', blocks, ttl)
  redis.call('PEXPIRE', seqkey, ttl)
  redis.call('ZREMRANGEBYSCORE', engines, '-inf', now)
end
"""

# KEYS: engines, blocks, seq. ARGV: engine, ttl_ms, then per event: seq, kind (1 stored,
# 2 removed, 3 cleared), n, and n block hashes. Returns 1 when applied, 0 when the engine
# must publish a snapshot (then nothing is applied).
APPLY_EVENTS = _NOW + _ALIVE_AND_REFRESH + """
local engine, ttl = ARGV[1], tonumber(ARGV[2])
if not alive(KEYS[1], KEYS[3], engine) then return 0 end
local last = tonumber(redis.call('GET', KEYS[3]))
local expected, first = last + 1, nil
local i = 3
while i <= #ARGV do
  local s = tonumber(ARGV[i])
  if s > last then
    if s ~= expected then return 0 end
    expected = expected + 1
    first = first or i
  end
  i = i + 3 + tonumber(ARGV[i + 2])
end
i = first or (#ARGV + 1)
while i <= #ARGV do
  local kind, n = ARGV[i + 1], tonumber(ARGV[i + 2])
  if kind == '1' then
    for k = i + 3, i + 2 + n do redis.call('HINCRBY', KEYS[2], ARGV[k], 1) end
  elseif kind == '2' then
    for k = i + 3, i + 2 + n do
      if redis.call('HINCRBY', KEYS[2], ARGV[k], -1) <= 0 then redis.call('HDEL', KEYS[2], ARGV[k]) end
    end
  else
    redis.call('DEL', KEYS[2])
  end
  i = i + 3 + n
end
if first then redis.call('SET', KEYS[3], expected - 1) end
refresh(KEYS[1], KEYS[2], KEYS[3], engine, ttl)
return 1
"""

# KEYS: engines, blocks, seq, stage. ARGV: engine, ttl_ms, next_seq, staged (0 or 1), then
# (hash, count) pairs. A large snapshot is first written to the stage key in small commands
# (one long script would stall every gateway's lookups) and swapped in here at once.
PUBLISH_SNAPSHOT = _NOW + _ALIVE_AND_REFRESH + """
local engine, ttl = ARGV[1], tonumber(ARGV[2])
redis.call('UNLINK', KEYS[2])  -- freed off the main thread
if ARGV[4] == '1' then
  if redis.call('EXISTS', KEYS[4]) == 0 then return 0 end  -- the stage expired: start over
  redis.call('RENAME', KEYS[4], KEYS[2])
end
for i = 5, #ARGV, 400 do  -- 200 pairs per call: few calls, and unpack stays small
  redis.call('HSET', KEYS[2], unpack(ARGV, i, math.min(i + 399, #ARGV)))
end
redis.call('SET', KEYS[3], tonumber(ARGV[3]) - 1)
refresh(KEYS[1], KEYS[2], KEYS[3], engine, ttl)
return 1
"""

# KEYS: engines, blocks, seq. ARGV: engine, ttl_ms. Returns 1 if the engine was live.
HEARTBEAT = _NOW + _ALIVE_AND_REFRESH + """
local engine, ttl = ARGV[1], tonumber(ARGV[2])
if not alive(KEYS[1], KEYS[3], engine) then return 0 end
refresh(KEYS[1], KEYS[2], KEYS[3], engine, ttl)
return 1
"""

# KEYS: engines. ARGV: blocks key prefix, k (prompts), k lengths, then every prompt's block
# hashes in order. Returns {live engines, then for each prompt two counts per engine: the leading
# blocks in its pool, and those in its pool or its KV tier (keys tagged 'T', prefix_store.events)}.
# Reads each engine's hash in chunks and stops at its first miss, so a short match costs little.
MATCH = _NOW + """
local engines = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
local out = {engines}
local k = tonumber(ARGV[2])
local start = 3 + k
for p = 1, k do
  local last = start + tonumber(ARGV[2 + p]) - 1
  local counts = {}
  for _, engine in ipairs(engines) do
    local key = ARGV[1] .. engine
    local n, reach, i, pooled, done = 0, 0, start, true, false
    while i <= last and not done do
      local j = math.min(i + 31, last)
      local fields = {}
      for f = i, j do
        fields[#fields + 1] = ARGV[f]
        fields[#fields + 1] = 'T' .. ARGV[f]
      end
      local vals = redis.call('HMGET', key, unpack(fields))
      for v = 1, #vals, 2 do
        if vals[v] and pooled then
          n = n + 1
          reach = reach + 1
        elseif vals[v] or vals[v + 1] then
          pooled = false
          reach = reach + 1
        else
          done = true
          break
        end
      end
      i = j + 1
    end
    counts[#counts + 1] = n
    counts[#counts + 1] = reach
  end
  out[#out + 1] = counts
  start = last + 1
end
return out
"""

# KEYS: engines. Returns the live engines.
LIVE_ENGINES = _NOW + """
return redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
"""
