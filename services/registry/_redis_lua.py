"""The Lua script behind `RedisStore`: every read and mutation of the shared state, atomically.

One script, dispatched on ARGV[1] (the command), ARGV[2] the event stream's MAXLEN, ARGV[3]
the recovery grace (seconds), ARGV[4..7] the caller's clock check (below), command arguments
from ARGV[8] (ARGS[3] in the script). KEYS[1] is `<prefix>events`; every key starts with
`<prefix>`, which is a Redis Cluster hash tag (`{namespace}:`), so all keys of a fleet live in
one slot.

Time is Redis's own (`TIME`, plus the fix in `<prefix>clock` that undoes a step of Redis's
clock, which the replicas detect against their monotonic clocks: see the script), so replicas
need no clock agreement: replies carry the script's `now` next to absolute Redis times, and
the Python side turns each into a duration on its own clock (DESIGN invariant 5). Floats are
returned as strings (a Lua number in a reply is truncated to an integer).

Keys (P = prefix):
  P h:<holder>       hash: host port tp bs fp ttl x(expire) ver s(state) la(lost at) rb(blocks)
  P ha:<holder>      set: the holder's ACTIVE lease ids
  P hd:<holder>      set: its dead lease ids the holder has not confirmed freeing
  P holders          zset: live (active, draining) holder -> expire time
  P lost             zset: lost holder -> lost time (kept until its dead leases are freed)
  P l:<lease>        hash: t c h r p(hashes + uint32 block ids) n(tokens) b(blocks) e(epoch)
                     i(idle ttl) m(max lifetime) ct(created) x(expire) s(state) k(pin count)
  P leases           zset (score 0): every lease id, in id order for listing
  P lexp             zset: ACTIVE lease -> expire time
  P c:<tenant> <conv>  string: the conversation's current lease id
  P ta:<tenant>      set: the tenant's ACTIVE lease ids (for quotas and listing)
  P td:<tenant>      set: the tenant's dead lease ids not yet freed (for listing; layout 3)
  P tb               hash: tenant -> blocks of its ACTIVE leases (for quotas)
  P p:<pin>          hash: l(lease) x(expire)
  P pexp             zset: pin -> expire time
  P events           stream: lease events (t l tn c h e w lt), read by every replica
  P renew_watch      string with a TTL: set while some replica watches renewals
  P pin_secret       the key of derived pin ids (kvbridge.ids.pin_id_maker), set by the first
                     replica to start, read by the others; written back by the next tick
                     when Redis lost it (every tick returns it)
  P clock            hash: fix (seconds added to TIME after a step), off and tstep (tests)
  P layout           hash: version (the newest state layout of the replicas that shared it),
                     min (the oldest layout that may still share it; see _redis.LAYOUT)
  P owed             string: RECLAIMABLE events held back by the grace are owed (the first
                     tick after it queues them in P paying)
  P paying           zset: dead lease ids whose owed RECLAIMABLE is yet to be sent (a share
                     each tick; replicas of layout 2 before it ignore it: they leave the
                     sending to the others)
  P ticker           hash: o (the ticker token of the replica whose turn it is to run the
                     scheduled ticks), x (until when that turn holds, on the script's clock)
  P started, P hold_until  when this state began (empty), and until when nothing is reported
                     reclaimable (pins granted before a loss of Redis data may still be read)
"""

LUA = r"""
local EV = KEYS[1]
local P = string.sub(EV, 1, -7)
local cmd = ARGV[1]
local MAXLEN = ARGV[2]
local GRACE = tonumber(ARGV[3])
-- The command's arguments: ARGS[3] onwards (ARGV without the grace and the clock check).
local ARGS = {ARGV[1], ARGV[2]}
for i = 8, #ARGV do ARGS[#ARGS + 1] = ARGV[i] end

-- The fleet's clock: Redis's TIME plus `fix`, which undoes steps of Redis's own clock (an NTP
-- step, a failover to a host whose clock differs). A step forward would end pins early (a
-- lease reclaimed while prefill still reads it); one back would let a pin outlive its holder's
-- hard deadline. The caller sends its monotonic reading as sent (ARGV[4]), the bounds it
-- knows of (this clock - its monotonic clock) (ARGV[5], ARGV[6]; empty before its first
-- reply) and the generation of the fix they were learned under (ARGV[7]); bounds learned
-- under an older fix are not checked against (the caller learns them anew). A clock outside
-- the bounds by more than STEP has stepped (back: certainly; forward: or the call waited that
-- long): this call then runs at the earliest time it can have run, the caller's reading plus
-- the lower bound (so its deadlines are off by at most the bounds' spread, under a
-- millisecond on a quick link), and its reply says so: the caller confirms a step with its
-- round trip and stores the fix (`clockfix`, which bumps `gen`). `off` and `tstep` are for
-- tests only: `off` moves every replica's time forward (as if time passed), `tstep` steps
-- Redis's clock.
local STEP = 1.0
local CLK = redis.call('HMGET', P .. 'clock', 'fix', 'off', 'tstep', 'gen')
local GEN = CLK[4] or '0'
local FIX = tonumber(CLK[1] or '0')
local t = redis.call('TIME')
local RAW = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(CLK[3] or '0') + FIX
local BASE, STEPPED = RAW, false
if ARGV[5] ~= '' and ARGV[7] == GEN then
  local sent = tonumber(ARGV[4])
  local lo_t, hi_t = sent + tonumber(ARGV[5]), sent + tonumber(ARGV[6])
  if RAW < lo_t - STEP or RAW > hi_t + STEP then
    BASE, STEPPED = lo_t, true
  end
end
local NOW = BASE + tonumber(CLK[2] or '0')
-- A reply's first field after OK: NOW, the clock without `off`, the fix's generation, and
-- after a step the clock as Redis had it.
local function STAMP()
  if STEPPED then
    return string.format('%.6f %.6f %s %.6f', NOW, BASE, GEN, RAW)
  end
  return string.format('%.6f %.6f %s', NOW, BASE, GEN)
end

-- State that starts empty (a new namespace, or a Redis that lost its data) may be a restarted
-- one: readers may hold pins from before. Report nothing reclaimable for the grace. A read
-- (the hot path) neither starts state nor reports reclaimable leases: it skips this, and
-- anything it might ask is held back.
local HOLD_UNTIL = math.huge
if cmd ~= 'read' then
  if redis.call('EXISTS', P .. 'started') == 0 then
    redis.call('SET', P .. 'started', string.format('%.6f', NOW))
    redis.call('SET', P .. 'hold_until', string.format('%.6f', NOW + GRACE))
  end
  HOLD_UNTIL = tonumber(redis.call('GET', P .. 'hold_until') or '0')
end

local ACTIVE, EXPIRED, REVOKED, SUPERSEDED, HOLDER_LOST = 1, 2, 3, 4, 5
local H_ACTIVE, H_DRAINING, H_LOST = 1, 2, 3
local DEAD_EVENT = {[2] = 4, [3] = 5, [4] = 3, [5] = 6}
local MISS_FOR_STATE = {[2] = 2, [3] = 6, [4] = 1, [5] = 3}
local HASH = 16

local function F(x) return string.format('%.6f', x) end

local function emit(etype, lid, tenant, conv, hid, epoch, lateness)
  redis.call('XADD', EV, 'MAXLEN', '~', MAXLEN, '*', 't', etype, 'l', lid, 'tn', tenant,
             'c', conv, 'h', hid, 'e', epoch, 'w', F(NOW), 'lt', F(lateness))
end

-- RECLAIMABLE (f: the lease's t c h e), or, within the recovery grace (when heartbeats report
-- nothing reclaimable: pins from before may be live), owed: the first tick after it sends one
-- for every dead lease no pin holds then (so, until that tick, this one is owed too).
local function emit_reclaimable(lid, f)
  if HOLD_UNTIL == math.huge then  -- a read, which did not look it up
    HOLD_UNTIL = tonumber(redis.call('GET', P .. 'hold_until') or '0')
  end
  if NOW < HOLD_UNTIL or redis.call('EXISTS', P .. 'owed') == 1 then
    redis.call('SET', P .. 'owed', '1')
  else
    -- Sent now, so not again from the queue of owed ones (a lease pinned when it was queued)
    redis.call('ZREM', P .. 'paying', lid)
    emit(7, lid, f[1], f[2], f[3], f[4], 0)
  end
end

-- Leases whose hash a key-evicting Redis dropped (see the README) are skipped by kill and
-- forget below rather than failing the script: an error there would fail every tick, and no
-- pin, lease or holder would expire again.
local function kill(lid, state, lateness)
  local L = P .. 'l:' .. lid
  local f = redis.call('HMGET', L, 't', 'c', 'h', 'e', 'k', 'b')
  if not f[1] then
    redis.call('ZREM', P .. 'lexp', lid)
    return false
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
  emit(8, lid, f[1], f[2], f[3], f[4], 0)
end

local function pins_of(lid)
  return tonumber(redis.call('HGET', P .. 'l:' .. lid, 'k') or '0')
end

local function unpin(lid)
  local L = P .. 'l:' .. lid
  local state = redis.call('HGET', L, 's')  -- every lease has one: nil when it is gone
  if not state then return end
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

-- A lease a re-registering holder still retains (SNAP arguments from ARGS[b]; the last two
-- are its tenant's quota, 0 for none). One that would put its tenant over the quota is
-- restored revoked: the holder frees it (a restore makes no room by revoking others).
local SNAP = 13
local function restore(hid, b)
  local lid, tenant, conv = ARGS[b], ARGS[b + 1], ARGS[b + 2]
  local epoch, age = tonumber(ARGS[b + 7]), tonumber(ARGS[b + 8])
  local QL, QB = tonumber(ARGS[b + 11]), tonumber(ARGS[b + 12])
  local created = NOW - age
  local C = P .. 'c:' .. tenant .. ' ' .. conv
  local cur = redis.call('GET', C)
  local newer, replaced = true, 0
  if cur and cur ~= lid and redis.call('EXISTS', P .. 'l:' .. cur) == 1 then
    local f = redis.call('HMGET', P .. 'l:' .. cur, 'e', 'ct', 's', 'b')
    local ce, cc = tonumber(f[1]), tonumber(f[2])
    newer = ce < epoch or (ce == epoch and cc < created)
    if newer and tonumber(f[3]) == ACTIVE then replaced = tonumber(f[4]) end
  end
  local blocks = tonumber(ARGS[b + 6])
  local fits = true
  if QL > 0 or QB > 0 then
    local n = redis.call('SCARD', P .. 'ta:' .. tenant)
    local used = tonumber(redis.call('HGET', P .. 'tb', tenant) or '0')
    if replaced > 0 then n, used = n - 1, used - replaced end
    fits = not ((QL > 0 and n + 1 > QL) or (QB > 0 and used + blocks > QB))
  end
  local x = add_lease(lid, hid, tenant, conv, ARGS[b + 3], ARGS[b + 4], ARGS[b + 5],
                      blocks, epoch, tonumber(ARGS[b + 9]), tonumber(ARGS[b + 10]), created)
  if x <= NOW then
    kill(lid, EXPIRED, 0)
    return
  end
  if not fits then
    kill(lid, REVOKED, 0)
    return
  end
  if newer and replaced > 0 then kill(cur, SUPERSEDED, 0) end
  if newer then
    redis.call('SET', C, lid)
    redis.call('ZADD', P .. 'lexp', F(x), lid)
  else
    kill(lid, SUPERSEDED, 0)
  end
end

-- How many leading blocks of `theirs` match the first `blocks` hashes of `ours`.
local function matching(ours, theirs, blocks)
  local n = math.min(blocks, math.floor(#theirs / HASH))
  if string.sub(ours, 1, n * HASH) == string.sub(theirs, 1, n * HASH) then return n end
  local k = 0
  while k < n and string.sub(ours, k * HASH + 1, (k + 1) * HASH)
      == string.sub(theirs, k * HASH + 1, (k + 1) * HASH) do
    k = k + 1
  end
  return k
end

if cmd == 'register' then
  local hid, bs, fp, tp = ARGS[3], ARGS[7], ARGS[8], ARGS[6]
  local ttl, max_leases, nsnap = tonumber(ARGS[9]), tonumber(ARGS[11]), tonumber(ARGS[12])
  local H = P .. 'h:' .. hid
  local s = holder_state(hid)
  if s and s ~= H_LOST then
    local f = redis.call('HMGET', H, 'bs', 'fp', 'tp')
    if f[1] ~= bs or f[2] ~= fp or f[3] ~= tp then
      return {'ERR', 'HOLDER_CONFLICT', f[1], f[3]}
    end
  end
  local unknown = 0
  for j = 0, nsnap - 1 do
    local owner = redis.call('HGET', P .. 'l:' .. ARGS[13 + j * SNAP], 'h')
    if not owner then
      unknown = unknown + 1
    elseif owner ~= hid then  -- another holder's lease: refused, nothing changed
      return {'ERR', 'NOT_LEASE_HOLDER', ARGS[13 + j * SNAP], j}
    end
  end
  if redis.call('ZCARD', P .. 'leases') + unknown > max_leases then
    return {'ERR', 'CAPACITY_EXHAUSTED'}
  end
  local event = 'holder_reregistered'
  if not s then
    event = 'holder_registered'
    redis.call('HSET', H, 'bs', bs, 'fp', fp, 'tp', tp, 'rb', 0, 'la', 0)
  elseif s == H_LOST then
    redis.call('HSET', H, 'bs', bs, 'fp', fp, 'tp', tp)
    redis.call('ZREM', P .. 'lost', hid)
  end
  local x = NOW + ttl
  redis.call('HSET', H, 'host', ARGS[4], 'port', ARGS[5], 'ver', ARGS[10], 'ttl', F(ttl),
             'x', F(x), 's', H_ACTIVE)
  redis.call('ZADD', P .. 'holders', F(x), hid)
  -- The holder is the source of truth for its memory: an active lease it no longer lists
  -- must never be read again.
  local held = {}
  for j = 0, nsnap - 1 do held[ARGS[13 + j * SNAP]] = true end
  for _, lid in ipairs(redis.call('SMEMBERS', P .. 'ha:' .. hid)) do
    if not held[lid] then kill(lid, REVOKED, 0) end
  end
  local restored = {}
  for j = 0, nsnap - 1 do
    local b = 13 + j * SNAP
    local lid = ARGS[b]
    local L = P .. 'l:' .. lid
    if redis.call('EXISTS', L) == 0 then
      restore(hid, b)
      restored[#restored + 1] = lid
    else
      local f = redis.call('HMGET', L, 'h', 's')
      if f[1] == hid and tonumber(f[2]) == ACTIVE then restored[#restored + 1] = lid end
    end
  end
  return {'OK', STAMP(), holder_enc(hid), restored, reclaimable_of(hid), event}

elseif cmd == 'heartbeat' then
  local hid = ARGS[3]
  local s = holder_state(hid)
  if not s or s == H_LOST then return {'ERR', 'HOLDER_NOT_FOUND'} end
  local H = P .. 'h:' .. hid
  local ttl = redis.call('HGET', H, 'ttl')
  local x = NOW + tonumber(ttl)
  redis.call('HSET', H, 'x', F(x))
  redis.call('ZADD', P .. 'holders', F(x), hid)
  for j = 4, #ARGS do
    local lid = ARGS[j]
    if redis.call('SISMEMBER', P .. 'hd:' .. hid, lid) == 1 and pins_of(lid) == 0 then
      forget(lid)
      redis.call('SREM', P .. 'hd:' .. hid, lid)  -- also when its hash was evicted
    end
  end
  return {'OK', STAMP(), reclaimable_of(hid), ttl}

elseif cmd == 'deregister' then
  local hid = ARGS[3]
  local s = holder_state(hid)
  if not s or s == H_LOST then return {'ERR', 'HOLDER_NOT_FOUND'} end
  redis.call('HSET', P .. 'h:' .. hid, 's', H_DRAINING)
  for _, lid in ipairs(redis.call('SMEMBERS', P .. 'ha:' .. hid)) do kill(lid, REVOKED, 0) end
  local pinned = 0
  for _, lid in ipairs(redis.call('SMEMBERS', P .. 'hd:' .. hid)) do
    if pins_of(lid) > 0 then pinned = pinned + 1 end
  end
  return {'OK', STAMP(), reclaimable_of(hid), pinned}

elseif cmd == 'holders' then
  for _, hid in ipairs(redis.call('ZRANGEBYSCORE', P .. 'holders', '-inf', F(NOW))) do
    lose_holder(hid)
  end
  local out = {}
  for _, hid in ipairs(redis.call('ZRANGE', P .. 'holders', 0, -1)) do
    out[#out + 1] = holder_enc(hid)
  end
  return {'OK', STAMP(), out}

elseif cmd == 'get_holder' then
  local s = holder_state(ARGS[3])
  if not s or s == H_LOST then return {'ERR', 'HOLDER_NOT_FOUND'} end
  return {'OK', STAMP(), holder_enc(ARGS[3])}

elseif cmd == 'grant' then
  local hid, lid = ARGS[3], ARGS[5]
  local s = holder_state(hid)
  if not s or s == H_LOST then return {'ERR', 'HOLDER_NOT_FOUND'} end
  local bs = redis.call('HGET', P .. 'h:' .. hid, 'bs')
  if bs ~= ARGS[4] then return {'STALE', bs} end
  if s == H_DRAINING then return {'ERR', 'HOLDER_DRAINING'} end
  local tenant, conv, rrid = ARGS[7], ARGS[8], ARGS[9]
  local L = P .. 'l:' .. lid
  -- The lease exists already: a retried request_id, or this very call run again (a client
  -- that resent it after losing the reply; the id is drawn once, before the first send).
  -- Either way it is answered as it stands; running on would supersede the lease by itself.
  if redis.call('EXISTS', L) == 1 then
    local f = redis.call('HMGET', L, 't', 'c', 'r', 'h')
    if f[1] ~= tenant or f[2] ~= conv or f[3] ~= rrid or f[4] ~= hid then
      return {'ERR', 'REQUEST_ID_REUSED'}
    end
    return {'OK', STAMP(), lease_enc(lid), holder_enc(hid), {}}
  end
  if redis.call('ZCARD', P .. 'leases') >= tonumber(ARGS[15]) then
    return {'ERR', 'CAPACITY_EXHAUSTED'}
  end
  local C = P .. 'c:' .. tenant .. ' ' .. conv
  local cur = redis.call('GET', C)
  -- A Redis that evicts keys (see the README) may have dropped the current lease's hash: then
  -- there is nothing to supersede, and the new epoch, which must still exceed the lost one,
  -- comes from the clock (milliseconds) instead of the lost lease.
  local epoch = 1
  if cur and redis.call('EXISTS', P .. 'l:' .. cur) == 0 then
    redis.call('SREM', P .. 'ta:' .. tenant, cur)
    cur = false
    epoch = math.floor(NOW * 1000)
  end
  local evicted = {}
  local QL, QB = tonumber(ARGS[16]), tonumber(ARGS[17])
  if QL > 0 or QB > 0 then
    local blocks = tonumber(ARGS[12])
    if QB > 0 and blocks > QB then return {'ERR', 'TENANT_QUOTA_EXCEEDED'} end
    local TA = P .. 'ta:' .. tenant
    for _, m in ipairs(redis.call('SMEMBERS', TA)) do  -- passed deadlines; evicted ones go
      if not refresh(m) then redis.call('SREM', TA, m) end
    end
    local n = redis.call('SCARD', TA)
    local used = tonumber(redis.call('HGET', P .. 'tb', tenant) or '0')
    if cur and redis.call('SISMEMBER', TA, cur) == 1 then  -- superseded below
      n = n - 1
      used = used - tonumber(redis.call('HGET', P .. 'l:' .. cur, 'b'))
    end
    local function over()
      return (QL > 0 and n + 1 > QL) or (QB > 0 and used + blocks > QB)
    end
    if over() then
      -- The tenant's own soonest-expiring unpinned leases give way; never another tenant's.
      local cands = {}
      for _, m in ipairs(redis.call('SMEMBERS', TA)) do
        if m ~= cur then
          local f = redis.call('HMGET', P .. 'l:' .. m, 'x', 'k', 'b')
          if tonumber(f[2]) == 0 then
            cands[#cands + 1] = {m, tonumber(f[1]), tonumber(f[3])}
          end
        end
      end
      table.sort(cands, function(a, b)
        if a[2] ~= b[2] then return a[2] < b[2] end
        return a[1] < b[1]
      end)
      for _, c in ipairs(cands) do
        if not over() then break end
        evicted[#evicted + 1] = c[1]
        n = n - 1
        used = used - c[3]
      end
      if over() then return {'ERR', 'TENANT_QUOTA_EXCEEDED'} end
      for _, v in ipairs(evicted) do kill(v, REVOKED, 0) end
    end
  end
  local sup = {}
  if cur and cur ~= lid then  -- never the new lease itself (see the replay check above)
    local f = redis.call('HMGET', P .. 'l:' .. cur, 'e', 's', 'h')
    epoch = tonumber(f[1]) + 1
    if tonumber(f[2]) == ACTIVE then
      kill(cur, SUPERSEDED, 0)
      sup = {lease_enc(cur), holder_enc(f[3])}
    end
  end
  local x = add_lease(lid, hid, tenant, conv, rrid, ARGS[10], ARGS[11], tonumber(ARGS[12]),
                      epoch, tonumber(ARGS[13]), tonumber(ARGS[14]), NOW)
  redis.call('SET', C, lid)
  redis.call('ZADD', P .. 'lexp', F(x), lid)
  emit(1, lid, tenant, conv, hid, epoch, 0)
  return {'OK', STAMP(), lease_enc(lid), holder_enc(hid), sup, evicted}

elseif cmd == 'renew' then
  local nids = tonumber(ARGS[3])
  local watch = redis.call('EXISTS', P .. 'renew_watch') == 1
  local out = {}
  local function one(name, lid)
    if not lid or redis.call('EXISTS', P .. 'l:' .. lid) == 0 then
      out[#out + 1] = {name, 0, 0, '0'}
      return
    end
    local s = refresh(lid)
    if s ~= ACTIVE then
      out[#out + 1] = {lid, 0, s, '0'}
      return
    end
    local L = P .. 'l:' .. lid
    local f = redis.call('HMGET', L, 'i', 'ct', 'm', 't', 'c', 'h', 'e')
    local x = math.min(NOW + tonumber(f[1]), tonumber(f[2]) + tonumber(f[3]))
    redis.call('HSET', L, 'x', F(x))
    redis.call('ZADD', P .. 'lexp', F(x), lid)
    out[#out + 1] = {lid, 1, ACTIVE, F(x - NOW)}
    if watch then emit(2, lid, f[4], f[5], f[6], f[7], 0) end
  end
  for i = 1, nids do one(ARGS[3 + i], ARGS[3 + i]) end
  local k = 4 + nids
  while k + 1 <= #ARGS do
    one('', redis.call('GET', P .. 'c:' .. ARGS[k] .. ' ' .. ARGS[k + 1]))
    k = k + 2
  end
  return {'OK', STAMP(), out}

elseif cmd == 'revoke' then
  local lid, hid = ARGS[3], ARGS[4]
  if redis.call('EXISTS', P .. 'l:' .. lid) == 0 then return {'ERR', 'LEASE_NOT_FOUND'} end
  local s = refresh(lid)
  local owner = redis.call('HGET', P .. 'l:' .. lid, 'h')
  if hid ~= '' and owner ~= hid then return {'ERR', 'NOT_LEASE_HOLDER'} end
  local revoked = 0
  if s == ACTIVE then
    kill(lid, REVOKED, 0)
    revoked = 1
  end
  return {'OK', STAMP(), lease_enc(lid), holder_enc(owner), revoked}

elseif cmd == 'get_lease' then
  local lid = ARGS[3]
  if redis.call('EXISTS', P .. 'l:' .. lid) == 0 then return {'ERR', 'LEASE_NOT_FOUND'} end
  refresh(lid)
  return {'OK', STAMP(), lease_enc(lid), holder_enc(redis.call('HGET', P .. 'l:' .. lid, 'h'))}

elseif cmd == 'hold' then
  -- Seconds left of the recovery grace (0 when over), which started above if state was empty.
  return {'OK', STAMP(), F(math.max(HOLD_UNTIL - NOW, 0))}

elseif cmd == 'list' then
  local tenant, conv, hid = ARGS[3], ARGS[4], ARGS[5]
  local inactive, after, limit = ARGS[6] == '1', ARGS[7], tonumber(ARGS[8])
  local out, holders, seen = {}, {}, {}
  local function consider(lid)
    if lid <= after then return end
    local f = redis.call('HMGET', P .. 'l:' .. lid, 't', 'c')
    if not f[1] then return end
    if (tenant ~= '' and f[1] ~= tenant) or (conv ~= '' and f[2] ~= conv) then return end
    local s = refresh(lid)
    if inactive or s == ACTIVE then
      local enc = lease_enc(lid)
      out[#out + 1] = enc
      if not seen[enc[4]] then
        seen[enc[4]] = true
        holders[#holders + 1] = holder_enc(enc[4])
      end
    end
  end
  local ids = nil
  if hid ~= '' then
    ids = redis.call('SUNION', P .. 'ha:' .. hid, P .. 'hd:' .. hid)
    table.sort(ids)
  elseif tenant ~= '' and conv ~= '' and not inactive then
    local cur = redis.call('GET', P .. 'c:' .. tenant .. ' ' .. conv)
    ids = {}
    if cur then ids[1] = cur end
  elseif tenant ~= '' then
    -- The tenant's own indexes: a listing costs what that tenant has, not the registry.
    if inactive then
      ids = redis.call('SUNION', P .. 'ta:' .. tenant, P .. 'td:' .. tenant)
    else
      ids = redis.call('SMEMBERS', P .. 'ta:' .. tenant)
    end
    table.sort(ids)
  end
  if ids then
    for _, lid in ipairs(ids) do
      if #out >= limit then break end
      consider(lid)
    end
  else
    -- No filter: lease ids in order until the page is full.
    local start = '-'
    if after ~= '' then start = '(' .. after end
    while #out < limit do
      local chunk = redis.call('ZRANGEBYLEX', P .. 'leases', start, '+', 'LIMIT', 0, 512)
      if #chunk == 0 then break end
      for _, lid in ipairs(chunk) do
        if #out >= limit then break end
        consider(lid)
      end
      start = '(' .. chunk[#chunk]
    end
  end
  return {'OK', STAMP(), out, holders}

elseif cmd == 'read' then
  local mode, tenant, conv, prompt = ARGS[3], ARGS[4], ARGS[5], ARGS[6]
  local min_tokens, pin_ttl, pin_id = tonumber(ARGS[7]), tonumber(ARGS[8]), ARGS[9]
  local max_pin = tonumber(ARGS[11])  -- ARGS[10]: whether the pin id came from a request_id
  local lid = redis.call('GET', P .. 'c:' .. tenant .. ' ' .. conv)
  if not lid then return {'OK', STAMP(), 1, 0, 0, 0} end
  local L = P .. 'l:' .. lid
  -- The hot path reads the lease and its holder once each and answers from what it read.
  -- Anything but a live lease of an active, unexpired holder takes the general path below,
  -- which applies passed deadlines first (refresh) and reports the miss.
  local lf = redis.call('HMGET', L, unpack(LF))  -- t c h r p n e i m ct x s k
  local hid = lf[3]
  if not hid then return {'OK', STAMP(), 1, 0, 0, 0} end  -- a pointer to a lease now gone
  local hf = redis.call('HMGET', P .. 'h:' .. hid, unpack(HF))  -- host .. s rb
  local function miss(reason, k, matched, partial)
    return {'OK', STAMP(), reason, k, matched, partial, lease_enc(lid), holder_enc(hid)}
  end
  if not (hf[9] and tonumber(lf[12]) == ACTIVE and tonumber(lf[11]) > NOW
          and tonumber(hf[9]) == H_ACTIVE and tonumber(hf[7]) > NOW) then
    local s = refresh(lid)
    if s ~= ACTIVE then return miss(MISS_FOR_STATE[s], 0, 0, 0) end
    return miss(3, 0, 0, 0)  -- a live lease whose holder is draining (or unknown)
  end
  local n, bs = tonumber(lf[6]), tonumber(hf[4])
  local created, life = tonumber(lf[10]), tonumber(lf[9])
  local full = math.floor(n / bs)
  local k, partial, reusable
  if mode == 'a' then
    k = matching(lf[5], prompt, full)
    partial = k == full and n % bs ~= 0
    reusable = k * bs
    if partial then reusable = reusable + n - full * bs end
    if reusable == 0 then
      if full > 0 and #prompt > 0 then return miss(4, k, 0, 0) end
      return miss(5, k, 0, 0)
    end
  else
    if n == 0 then return miss(5, 0, 0, 0) end
    k, partial, reusable = full, n % bs ~= 0, n
  end
  local pflag = 0
  if partial then pflag = 1 end
  if reusable < min_tokens then return miss(5, k, k, pflag) end
  local PK = P .. 'p:' .. pin_id
  -- Always looked up, request_id or not: a call run again (resent after its reply was lost;
  -- the pin id is drawn once, before the first send) must not count its pin twice.
  local existing = redis.call('HMGET', PK, 'l', 'x')
  local deadline
  local pins = tonumber(lf[13])
  if existing and existing[1] then
    if existing[1] ~= lid then return {'ERR', 'REQUEST_ID_REUSED'} end
    deadline = tonumber(existing[2])
  else
    deadline = math.min(NOW + pin_ttl, created + life + max_pin)
    if deadline <= NOW then return miss(2, k, 0, 0) end
    redis.call('HSET', PK, 'l', lid, 'x', F(deadline))
    redis.call('ZADD', P .. 'pexp', F(deadline), pin_id)
    pins = pins + 1
  end
  -- A read is conversation activity: keep the lease for the turn that follows.
  local x = F(math.min(NOW + tonumber(lf[8]), created + life))
  redis.call('HSET', L, 'x', x, 'k', pins)
  redis.call('ZADD', P .. 'lexp', x, lid)
  lf[11], lf[13] = x, pins
  return {'OK', STAMP(), 0, k, k, pflag, lease_enc(lid, lf), holder_enc(hid, hf), pin_id,
          F(deadline)}

elseif cmd == 'release' then
  local pin = ARGS[3]
  local PK = P .. 'p:' .. pin
  local lid = redis.call('HGET', PK, 'l')
  if not lid then return {'OK', STAMP(), 0} end
  redis.call('DEL', PK)
  redis.call('ZREM', P .. 'pexp', pin)
  unpin(lid)
  return {'OK', STAMP(), 1}

elseif cmd == 'tick' then
  local batch, retention = tonumber(ARGS[3]), tonumber(ARGS[4])
  -- Every tick's reply: what it expired and lost, when to tick next, the counts, the layout
  -- minimum and the pin secret (a replica takes them from any tick, its own turn or not).
  local function tick_reply(expired, nxt, lost)
    local next_in = ''
    if nxt then next_in = F(nxt - NOW) end
    return {'OK', STAMP(), expired, next_in, lost, redis.call('ZCARD', P .. 'lexp'),
            redis.call('ZCARD', P .. 'leases'), redis.call('ZCARD', P .. 'holders'),
            redis.call('ZCARD', P .. 'pexp'), redis.call('HGET', P .. 'layout', 'min') or '0',
            redis.call('GET', P .. 'pin_secret') or ''}
  end
  -- A scheduled tick (ARGS[9]: the replica's ticker token, ARGS[10]: how long its turn holds)
  -- is left to the replica that took the turn while its hold lasts: the fleet's deadlines are
  -- processed by one replica at a time, so ticks do not grow with the number of replicas. It
  -- comes back when the turn ends (if the replica with it stopped ticking, this one takes
  -- over then). An unscheduled tick (no token) always runs. A turn that ends further away
  -- than one hold (the clock went back since it was taken) has ended: a clock step cannot
  -- stall the ticks.
  if ARGS[9] and ARGS[9] ~= '' then
    local turn = redis.call('HMGET', P .. 'ticker', 'o', 'x')
    local ends = tonumber(turn[2]) or 0  -- not a number (a hand edit): the turn is over
    if turn[1] and turn[1] ~= ARGS[9] and ends > NOW and ends <= NOW + tonumber(ARGS[10]) then
      return tick_reply(0, ends, {})
    end
    redis.call('HSET', P .. 'ticker', 'o', ARGS[9], 'x', F(NOW + tonumber(ARGS[10])))
  end
  -- The layout record, written again by the ticking replica when Redis lost it (ARGS[5..6]:
  -- the caller's layout and minimum): an older replica started after a loss must still see it.
  if ARGS[5] and redis.call('EXISTS', P .. 'layout') == 0 then
    redis.call('HSET', P .. 'layout', 'version', ARGS[5], 'min', ARGS[6])
  end
  -- Likewise the pin secret (ARGS[8], the caller's): the replicas keep agreeing on pin ids.
  if ARGS[8] then redis.call('SET', P .. 'pin_secret', ARGS[8], 'NX') end
  -- The grace is over: the RECLAIMABLE events it held, first (what this tick kills is then
  -- sent as it dies). Every dead lease is queued once (P paying, by Redis itself: no Lua per
  -- lease), then ARGS[7] a tick are sent: one script over them all would stall Redis.
  if NOW >= HOLD_UNTIL then
    if redis.call('EXISTS', P .. 'owed') == 1 then
      redis.call('DEL', P .. 'owed')
      for _, z in ipairs({'holders', 'lost'}) do
        local hids = redis.call('ZRANGE', P .. z, 0, -1)
        for i = 1, #hids, 200 do  -- 200 sets a call: unpack has a stack limit
          local keys = {P .. 'paying'}
          for j = i, math.min(i + 199, #hids) do keys[#keys + 1] = P .. 'hd:' .. hids[j] end
          redis.call('ZUNIONSTORE', P .. 'paying', #keys, unpack(keys))
        end
      end
    end
    for _, lid in ipairs(redis.call('ZRANGE', P .. 'paying', 0, tonumber(ARGS[7]) - 1)) do
      redis.call('ZREM', P .. 'paying', lid)
      local f = redis.call('HMGET', P .. 'l:' .. lid, 't', 'c', 'h', 'e', 'k')
      -- forgotten since (its holder freed it): nothing to send; pinned: sent as it is unpinned
      if f[1] and tonumber(f[5]) == 0 then emit(7, lid, f[1], f[2], f[3], f[4], 0) end
    end
  end
  local lost = {}
  local due_holders = redis.call('ZRANGEBYSCORE', P .. 'holders', '-inf', F(NOW),
                                 'LIMIT', 0, batch)
  for _, hid in ipairs(due_holders) do lost[#lost + 1] = {hid, lose_holder(hid)} end
  -- Past a lost holder's own hard deadline it has freed everything it held.
  for _, hid in ipairs(redis.call('ZRANGEBYSCORE', P .. 'lost', '-inf', F(NOW - retention),
                                  'LIMIT', 0, 100)) do
    local dead = redis.call('SMEMBERS', P .. 'hd:' .. hid)
    local pinned = false
    for _, lid in ipairs(dead) do
      if pins_of(lid) > 0 then pinned = true end
    end
    if not pinned then
      for _, lid in ipairs(dead) do forget(lid) end
      redis.call('DEL', P .. 'h:' .. hid, P .. 'ha:' .. hid, P .. 'hd:' .. hid)
      redis.call('ZREM', P .. 'lost', hid)
    end
  end
  -- Ended pins: each one's lease is unpinned; their records go in one removal per 200 (the
  -- tick holds Redis, and every read waiting behind it, for as long as it runs).
  local ended = redis.call('ZRANGEBYSCORE', P .. 'pexp', '-inf', F(NOW), 'LIMIT', 0, batch)
  for i = 1, #ended, 200 do
    local keys = {}
    for j = i, math.min(i + 199, #ended) do
      local key = P .. 'p:' .. ended[j]
      keys[#keys + 1] = key
      local lid = redis.call('HGET', key, 'l')
      if lid then unpin(lid) end
    end
    redis.call('DEL', unpack(keys))
  end
  -- The lowest-scored members are exactly those just read: nothing above touches pexp.
  if #ended > 0 then redis.call('ZREMRANGEBYRANK', P .. 'pexp', 0, #ended - 1) end
  local expired = 0
  local due = redis.call('ZRANGEBYSCORE', P .. 'lexp', '-inf', F(NOW), 'WITHSCORES',
                         'LIMIT', 0, batch)
  for i = 1, #due, 2 do
    if kill(due[i], EXPIRED, NOW - tonumber(due[i + 1])) then expired = expired + 1 end
  end
  -- When to tick next: at the first deadline.
  local nxt = nil
  if redis.call('EXISTS', P .. 'owed') == 1 or redis.call('EXISTS', P .. 'paying') == 1 then
    nxt = HOLD_UNTIL
  end
  for _, z in ipairs({'holders', 'pexp', 'lexp'}) do
    local first = redis.call('ZRANGE', P .. z, 0, 0, 'WITHSCORES')
    if first[2] then
      local v = tonumber(first[2])
      if not nxt or v < nxt then nxt = v end
    end
  end
  return tick_reply(expired, nxt, lost)

elseif cmd == 'clockfix' then
  -- Store a fix a caller confirmed, moved by the step it saw: only over the generation it saw
  -- (another replica may have stored one since).
  if ARGS[3] ~= GEN then return {'OK', STAMP(), 0} end
  redis.call('HSET', P .. 'clock', 'fix', F(FIX + tonumber(ARGS[4])),
             'gen', tostring(tonumber(GEN) + 1))
  return {'OK', STAMP(), 1}
end
return {'ERR', 'UNKNOWN_COMMAND'}
"""
