-- kvbridge registry: the shared state in Redis, as one Redis Functions library.
--
-- This file: the call context and the helpers every operation shares. The operations are in
-- holders.lua, leases.lua, reads.lua and tick.lua; `_redis_lua.py` loads them as one library
-- after a generated preamble (the enum values, refusal reasons, sizes and function names,
-- from the Python source), so that each rule and constant is written once.
--
-- Every function is called with one key, `<prefix>events` (every key starts with `<prefix>`,
-- a Redis Cluster hash tag `{namespace}:`, so a fleet's keys live in one slot), and its own
-- arguments followed by the call context (CONTEXT_ARGS of them, see `begin`). Replies start
-- with 'OK' and the stamp (see `stamp`), or 'ERR' and a refusal reason. Floats are returned
-- as strings (a Lua number in a reply is truncated to an integer).

-- Per call, set by `begin` (functions may not set globals; these are the library's own).
local EV, P, MAXLEN  -- the event stream key, the key prefix, the stream's MAXLEN
local NOW            -- the fleet's time for this call (the clock below, plus the tests' `off`)
local BASE, RAW, STEPPED, GEN, FIX  -- the clock check (see `begin`)
-- Until when nothing is reported reclaimable (math.huge: not looked up, see `begin`).
local HOLD_UNTIL
local GRACE   -- the recovery grace, from the call context
local RUN_ID  -- this Redis process's run id (INFO server), looked up once
local SERVED  -- who serves the state, for this call (see `serving`; reset by `begin`)

local function F(x) return string.format('%.6f', x) end

-- Until when nothing is reported reclaimable. State that another Redis wrote, or none did, may
-- lack pins that readers hold: a new namespace or a Redis that lost its data (a restarted
-- registry's), a restart from an older file, a failover to an asynchronous replica (it has the
-- primary's state but maybe not its last writes, and no replica can tell which). So the state
-- keeps who serves it (`rid`, see `serving`), and the first call that finds another (every
-- replica's calls check, in the function that decides) holds reclaims for the grace: every pin
-- granted before, lost or not, ends first.
--
-- The other way round, such state may hold leases that their holders have freed: the grant
-- that superseded one, or the revoke, and the holder's confirmation that it freed the blocks,
-- lost with the writes that did not reach it. So each holder record keeps who served the state
-- when it registered (`rid`, see `confirmed`): a holder registered under another is asked to
-- register again, with the leases it holds (its heartbeat answers HOLDER_NOT_FOUND), and none
-- of its leases is read until it has.
--
-- Who serves: the Redis process (its run id: a restart) and its term as primary (its
-- replication id, which a promotion changes). The process alone is not enough: a primary that
-- stalls, is replaced, resyncs from its replacement (taking on state that lacks its own last
-- writes) and is promoted again is the same process with another history.
local function serving()
  if not SERVED then
    RUN_ID = RUN_ID or string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
      or error('kvbridge: Redis tells no run_id (INFO server)')
    local term = string.match(redis.call('INFO', 'replication'), 'master_replid:(%x+)')
      or error('kvbridge: Redis tells no master_replid (INFO replication)')
    SERVED = RUN_ID .. ':' .. term
  end
  return SERVED
end

-- No holder could heartbeat while the state changed hands (Redis restarting, a failover,
-- however long it took): each live one gets its TTL from now to register again, as after a
-- registry restart, rather than be lost, and every lease with it, for an outage not its own.
local function spare_holders()
  for _, hid in ipairs(redis.call('ZRANGE', P .. 'holders', 0, -1)) do
    local H = P .. 'h:' .. hid
    local f = redis.call('HMGET', H, 'x', 'ttl')
    local x = NOW + tonumber(f[2])
    if tonumber(f[1]) < x then
      redis.call('HSET', H, 'x', F(x))
      redis.call('ZADD', P .. 'holders', F(x), hid)
    end
  end
end

local function hold_until()
  local v = redis.call('MGET', P .. 'rid', P .. 'hold_until')
  local until_ = tonumber(v[2] or '0')
  if v[1] ~= serving() then
    until_ = math.max(until_, NOW + GRACE)
    redis.call('MSET', P .. 'rid', SERVED, P .. 'hold_until', F(until_))
    spare_holders()
  end
  return until_
end

-- Whether a holder registered with whoever serves the state now (see above): only then does
-- it hold what the state says it does.
local function confirmed(hid)
  return redis.call('HGET', P .. 'h:' .. hid, 'rid') == serving()
end

-- Start a call: read the call context (the last CONTEXT_ARGS arguments: the stream's MAXLEN,
-- the recovery grace, the caller's clock check) and set the call's time. Returns how many
-- arguments are the function's own (args[1] .. args[n]).
--
-- The fleet's clock: Redis's TIME plus `fix`, which undoes steps of Redis's own clock (an NTP
-- step, a failover to a host whose clock differs). A step forward would end pins early (a
-- lease reclaimed while prefill still reads it); one back would let a pin outlive its holder's
-- hard deadline. The caller sends its monotonic reading as sent, the bounds it knows of (this
-- clock - its monotonic clock; empty before its first reply) and the generation of the fix
-- they were learned under; bounds learned under an older fix are not checked against (the
-- caller learns them anew). A clock outside the bounds by more than CLOCK_STEP has stepped
-- (back: certainly; forward: or the call waited that long): this call then runs at the
-- earliest time it can have run, the caller's reading plus the lower bound (so its deadlines
-- are off by at most the bounds' spread, under a millisecond on a quick link), and its reply
-- says so: the caller confirms a step with its round trip and stores the fix (`clockfix`,
-- which bumps `gen`). `off` and `tstep` are for tests only: `off` moves every replica's time
-- forward (as if time passed), `tstep` steps Redis's clock.
--
-- A read (`hot`, the hot path) does not look up the recovery grace (`hold_until`) unless it
-- has a lease to report reclaimable.
local function begin(keys, args, hot)
  local n = #args - CONTEXT_ARGS
  EV = keys[1]
  P = string.sub(EV, 1, -7)
  MAXLEN = args[n + 1]
  GRACE = tonumber(args[n + 2])
  local sent, lo, hi, gen = args[n + 3], args[n + 4], args[n + 5], args[n + 6]
  local clk = redis.call('HMGET', P .. 'clock', 'fix', 'off', 'tstep', 'gen')
  GEN = clk[4] or '0'
  FIX = tonumber(clk[1] or '0')
  local t = redis.call('TIME')
  RAW = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(clk[3] or '0') + FIX
  BASE, STEPPED = RAW, false
  if lo ~= '' and gen == GEN then
    sent = tonumber(sent)
    local lo_t, hi_t = sent + tonumber(lo), sent + tonumber(hi)
    if RAW < lo_t - CLOCK_STEP or RAW > hi_t + CLOCK_STEP then
      BASE, STEPPED = lo_t, true
    end
  end
  NOW = BASE + tonumber(clk[2] or '0')
  HOLD_UNTIL, SERVED = math.huge, nil
  if not hot then HOLD_UNTIL = hold_until() end
  return n
end

-- A reply's first field after OK: NOW, the clock without `off`, the fix's generation, and
-- after a step the clock as Redis had it.
local function stamp()
  if STEPPED then
    return string.format('%.6f %.6f %s %.6f', NOW, BASE, GEN, RAW)
  end
  return string.format('%.6f %.6f %s', NOW, BASE, GEN)
end

local function emit(etype, lid, tenant, conv, hid, epoch, lateness)
  redis.call('XADD', EV, 'MAXLEN', '~', MAXLEN, '*', 't', etype, 'l', lid, 'tn', tenant,
             'c', conv, 'h', hid, 'e', epoch, 'w', F(NOW), 'lt', F(lateness))
end

-- RECLAIMABLE (f: the lease's t c h e), or, within the recovery grace (when heartbeats report
-- nothing reclaimable: pins from before may be live), owed: the first tick after it sends one
-- for every dead lease no pin holds then (so, until that tick, this one is owed too).
local function emit_reclaimable(lid, f)
  if HOLD_UNTIL == math.huge then HOLD_UNTIL = hold_until() end  -- a read
  if NOW < HOLD_UNTIL or redis.call('EXISTS', P .. 'owed') == 1 then
    redis.call('SET', P .. 'owed', '1')
  else
    -- Sent now, so not again from the queue of owed ones (a lease pinned when it was queued)
    redis.call('ZREM', P .. 'paying', lid)
    emit(EV_RECLAIMABLE, lid, f[1], f[2], f[3], f[4], 0)
  end
end

-- The lookup by content: `tk:<tenant>` maps each history key (16 bytes, binary) to the
-- tenant's ACTIVE lease most recently granted or restored under it; a lease keeps the keys
-- it was granted with in its `hk` field (concatenated), to leave the index when it stops
-- being active (`kill`, the one place where a lease does). Keys go a chunk at a time: unpack
-- has a stack limit. `tkn` counts the entries of every tenant's index (a metric): whatever
-- adds or removes some counts them.
local KEYS_A_CALL = 256

local function count_entries(n)
  if n ~= 0 then redis.call('INCRBY', P .. 'tkn', n) end
end

-- The keys of `hk`, KEYS_A_CALL to a list.
local function key_chunks(hk)
  local chunks = {}
  local step = KEYS_A_CALL * HISTORY_KEY_SIZE
  for i = 1, #hk, step do
    local keys = {}
    for j = i, math.min(i + step, #hk + 1) - 1, HISTORY_KEY_SIZE do
      keys[#keys + 1] = string.sub(hk, j, j + HISTORY_KEY_SIZE - 1)
    end
    chunks[#chunks + 1] = keys
  end
  return chunks
end

local function index(lid, tenant, hk)
  local TK = P .. 'tk:' .. tenant
  for _, keys in ipairs(key_chunks(hk)) do
    local fv = {}
    for _, key in ipairs(keys) do
      fv[#fv + 1] = key
      fv[#fv + 1] = lid
    end
    count_entries(redis.call('HSET', TK, unpack(fv)))  -- the new ones
  end
end

-- Drop the keys of `hk` that still point to `lid` (a later lease may have taken some).
local function unindex(lid, tenant, hk)
  local TK = P .. 'tk:' .. tenant
  for _, keys in ipairs(key_chunks(hk)) do
    local at = redis.call('HMGET', TK, unpack(keys))
    local gone = {}
    for j = 1, #keys do
      if at[j] == lid then gone[#gone + 1] = keys[j] end
    end
    if #gone > 0 then count_entries(-redis.call('HDEL', TK, unpack(gone))) end
  end
end

-- Give an ACTIVE lease the history keys it was granted with ('' for none: no field), and
-- index it under them.
local function add_history(lid, tenant, hk)
  if hk == '' then return end
  redis.call('HSET', P .. 'l:' .. lid, 'hk', hk)
  index(lid, tenant, hk)
end

-- Leases whose hash a key-evicting Redis dropped (see the docs) are skipped by kill and
-- forget below rather than failing the call: an error there would fail every tick, and no
-- pin, lease or holder would expire again.
local function kill(lid, state, lateness)
  local L = P .. 'l:' .. lid
  local f = redis.call('HMGET', L, 't', 'c', 'h', 'e', 'k', 'b', 'hk')
  if not f[1] then
    redis.call('ZREM', P .. 'lexp', lid)
    return false
  end
  if f[7] then  -- a dead lease needs its keys no more
    unindex(lid, f[1], f[7])
    redis.call('HDEL', L, 'hk')
  end
  redis.call('HSET', L, 's', state)
  redis.call('ZREM', P .. 'lexp', lid)
  redis.call('SREM', P .. 'ha:' .. f[3], lid)
  if redis.call('SREM', P .. 'ta:' .. f[1], lid) == 1 then
    -- A tenant with no active lease left leaves the hash (it would grow with every tenant).
    if redis.call('HINCRBY', P .. 'tb', f[1], -tonumber(f[6])) <= 0 then
      redis.call('HDEL', P .. 'tb', f[1])
    end
  end
  redis.call('SADD', P .. 'hd:' .. f[3], lid)
  redis.call('SADD', P .. 'td:' .. f[1], lid)
  emit(DEAD_EVENT[state], lid, f[1], f[2], f[3], f[4], lateness)
  if tonumber(f[5]) == 0 then emit_reclaimable(lid, f) end
  return true
end

local function lose_holder(hid)
  redis.call('HSET', P .. 'h:' .. hid, 's', H_LOST, 'la', F(NOW))
  redis.call('ZREM', P .. 'holders', hid)
  redis.call('ZADD', P .. 'lost', F(NOW), hid)
  local active = redis.call('SMEMBERS', P .. 'ha:' .. hid)
  for _, lid in ipairs(active) do
    if not kill(lid, HOLDER_LOST, 0) then redis.call('SREM', P .. 'ha:' .. hid, lid) end
  end
  return #active
end

-- The holder's state after applying a missed TTL; nil when unknown.
local function holder_state(hid)
  local f = redis.call('HMGET', P .. 'h:' .. hid, 's', 'x')
  if not f[1] then return nil end
  local s = tonumber(f[1])
  if s ~= H_LOST and tonumber(f[2]) <= NOW and HOLD_UNTIL == math.huge then
    -- A read, the first call since the state changed hands maybe: the holders are spared first.
    HOLD_UNTIL = hold_until()
    f[2] = redis.call('HGET', P .. 'h:' .. hid, 'x')
  end
  if s ~= H_LOST and tonumber(f[2]) <= NOW then
    lose_holder(hid)
    s = H_LOST
  end
  return s
end

-- The lease's state after applying a deadline that passed; nil when unknown.
local function refresh(lid)
  local f = redis.call('HMGET', P .. 'l:' .. lid, 's', 'h', 'x')
  if not f[1] then return nil end
  local s = tonumber(f[1])
  if s == ACTIVE then
    if holder_state(f[2]) == H_LOST then return HOLDER_LOST end
    local x = tonumber(f[3])
    if x <= NOW then
      kill(lid, EXPIRED, NOW - x)
      return EXPIRED
    end
  end
  return s
end

local function forget(lid)
  local L = P .. 'l:' .. lid
  local f = redis.call('HMGET', L, 't', 'c', 'h', 'e', 'b')
  if not f[1] then
    redis.call('ZREM', P .. 'leases', lid)
    return
  end
  redis.call('SREM', P .. 'hd:' .. f[3], lid)
  redis.call('SREM', P .. 'td:' .. f[1], lid)
  redis.call('HINCRBY', P .. 'h:' .. f[3], 'rb', -tonumber(f[5]))
  redis.call('DEL', L)
  redis.call('ZREM', P .. 'leases', lid)
  local C = P .. 'c:' .. f[1] .. ' ' .. f[2]
  if redis.call('GET', C) == lid then redis.call('DEL', C) end
  emit(EV_RECLAIMED, lid, f[1], f[2], f[3], f[4], 0)
end

local function pins_of(lid)
  return tonumber(redis.call('HGET', P .. 'l:' .. lid, 'k') or '0')
end

local function unpin(lid)
  local L = P .. 'l:' .. lid
  local f = redis.call('HMGET', L, 's', 't')  -- every lease has a state: nil when it is gone
  local state = f[1]
  if not state then return end
  -- The tenant's live pins (tenant_max_pins); a tenant with none left leaves the hash.
  if redis.call('HINCRBY', P .. 'tp', f[2], -1) <= 0 then redis.call('HDEL', P .. 'tp', f[2]) end
  local k = redis.call('HINCRBY', L, 'k', -1)
  if k == 0 and tonumber(state) ~= ACTIVE then
    emit_reclaimable(lid, redis.call('HMGET', L, 't', 'c', 'h', 'e'))
  end
end

-- Dead leases no pin holds: the holder may free them. Sorted, for stable replies.
local function reclaimable_of(hid)
  local out = {}
  if NOW < HOLD_UNTIL then return out end
  for _, lid in ipairs(redis.call('SMEMBERS', P .. 'hd:' .. hid)) do
    if pins_of(lid) == 0 then out[#out + 1] = lid end
  end
  table.sort(out)
  return out
end

local LF = {'t', 'c', 'h', 'r', 'p', 'n', 'e', 'i', 'm', 'ct', 'x', 's', 'k'}
-- The lease as replies carry it; `f`: its LF fields when the caller has read them already.
local function lease_enc(lid, f)
  f = f or redis.call('HMGET', P .. 'l:' .. lid, unpack(LF))
  table.insert(f, 1, lid)
  return f
end

local HF = {'host', 'port', 'tp', 'bs', 'fp', 'ttl', 'x', 'ver', 's', 'rb'}
local function holder_enc(hid, f)
  f = f or redis.call('HMGET', P .. 'h:' .. hid, unpack(HF))
  table.insert(f, 1, hid)
  f[#f + 1] = redis.call('SCARD', P .. 'ha:' .. hid)
  return f
end

-- Store a new ACTIVE lease (the caller schedules or kills it); returns its expire time.
local function add_lease(lid, hid, tenant, conv, rrid, payload, tokens, blocks, epoch, idle,
                         life, created)
  local x = math.min(NOW + idle, created + life)
  redis.call('HSET', P .. 'l:' .. lid, 't', tenant, 'c', conv, 'h', hid, 'r', rrid,
             'p', payload, 'n', tokens, 'b', blocks, 'e', epoch, 'i', F(idle), 'm', F(life),
             'ct', F(created), 'x', F(x), 's', ACTIVE, 'k', 0)
  redis.call('ZADD', P .. 'leases', 0, lid)
  redis.call('SADD', P .. 'ha:' .. hid, lid)
  redis.call('HINCRBY', P .. 'h:' .. hid, 'rb', blocks)
  redis.call('SADD', P .. 'ta:' .. tenant, lid)
  redis.call('HINCRBY', P .. 'tb', tenant, blocks)
  return x
end

-- Register an operation under this library version's name for it (FUNCTION_PREFIX), so that
-- replicas of other versions sharing the Redis keep theirs.
local function expose(name, fn)
  redis.register_function(FUNCTION_PREFIX .. name, fn)
end
