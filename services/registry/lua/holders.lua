-- Holders: register (with the leases a holder still retains), heartbeat, deregister, list.

-- A lease a re-registering holder still retains: its SNAPSHOT_ARGS arguments from args[b]
-- (S_* are their offsets; the quota is 0 for none). One that would put its tenant over the
-- quota is restored revoked: the holder frees it (a restore makes no room by revoking others).
-- One restored active is indexed under its history keys again.
local function restore(hid, args, b)
  local lid, tenant, conv = args[b + S_LEASE_ID], args[b + S_TENANT], args[b + S_CONVERSATION]
  local epoch, age = tonumber(args[b + S_EPOCH]), tonumber(args[b + S_AGE])
  local QL, QB = tonumber(args[b + S_QUOTA_LEASES]), tonumber(args[b + S_QUOTA_BLOCKS])
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
  local blocks = tonumber(args[b + S_BLOCKS])
  local fits = true
  if QL > 0 or QB > 0 then
    local n = redis.call('SCARD', P .. 'ta:' .. tenant)
    local used = tonumber(redis.call('HGET', P .. 'tb', tenant) or '0')
    if replaced > 0 then n, used = n - 1, used - replaced end
    fits = not ((QL > 0 and n + 1 > QL) or (QB > 0 and used + blocks > QB))
  end
  local x = add_lease(lid, hid, tenant, conv, args[b + S_REMOTE_REQUEST_ID],
                      args[b + S_PAYLOAD], args[b + S_TOKENS], blocks, epoch,
                      tonumber(args[b + S_IDLE]), tonumber(args[b + S_LIFE]), created)
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
    add_history(lid, tenant, args[b + S_HISTORY_KEYS])
  else
    kill(lid, SUPERSEDED, 0)
  end
end

local function register(keys, args)
  local n = begin(keys, args)
  local hid, host, port, tp, bs = args[1], args[2], args[3], args[4], args[5]
  local fp, ttl, version = args[6], tonumber(args[7]), args[8]
  local max_leases, nsnap = tonumber(args[9]), tonumber(args[10])
  -- then nsnap snapshots of SNAPSHOT_ARGS arguments each, from args[11]; then restore_only
  -- (1: a later page of a paged registration, which revokes nothing), the count of held ids
  -- and the ids (a paged registration's first call: every lease the holder retains)
  local function snap(j) return 11 + j * SNAPSHOT_ARGS end
  local tail = snap(nsnap)
  local restore_only, nids = args[tail] == '1', tonumber(args[tail + 1])
  local H = P .. 'h:' .. hid
  local s = holder_state(hid)
  if restore_only and (not s or s == H_LOST or not confirmed(hid)) then
    -- A later page needs the first, which revokes what the holder no longer lists, to have
    -- run on this state (a failover between pages may have lost it): start again.
    return {'ERR', ERR_HOLDER_NOT_FOUND}
  end
  if s and s ~= H_LOST then
    local f = redis.call('HMGET', H, 'bs', 'fp', 'tp')
    if f[1] ~= bs or f[2] ~= fp or f[3] ~= tp then
      return {'ERR', ERR_HOLDER_CONFLICT, f[1], f[3]}
    end
  end
  local unknown = 0
  for j = 0, nsnap - 1 do
    local lid = args[snap(j) + S_LEASE_ID]
    local owner = redis.call('HGET', P .. 'l:' .. lid, 'h')
    if not owner then
      unknown = unknown + 1
    elseif owner ~= hid then  -- another holder's lease: refused, nothing changed
      return {'ERR', ERR_NOT_LEASE_HOLDER, lid, j}
    end
  end
  if redis.call('ZCARD', P .. 'leases') + unknown > max_leases then
    return {'ERR', ERR_CAPACITY_EXHAUSTED}
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
  redis.call('HSET', H, 'host', host, 'port', port, 'ver', version, 'ttl', F(ttl), 'x', F(x),
             's', H_ACTIVE, 'rid', serving())
  redis.call('ZADD', P .. 'holders', F(x), hid)
  -- The holder is the source of truth for its memory: an active lease it no longer lists
  -- must never be read again.
  if not restore_only then
    local held = {}
    if nids > 0 then
      for i = tail + 2, tail + 1 + nids do held[args[i]] = true end
    else
      for j = 0, nsnap - 1 do held[args[snap(j) + S_LEASE_ID]] = true end
    end
    for _, lid in ipairs(redis.call('SMEMBERS', P .. 'ha:' .. hid)) do
      if not held[lid] then kill(lid, REVOKED, 0) end
    end
  end
  local restored = {}
  for j = 0, nsnap - 1 do
    local b = snap(j)
    local lid = args[b + S_LEASE_ID]
    local L = P .. 'l:' .. lid
    if redis.call('EXISTS', L) == 0 then
      restore(hid, args, b)
      restored[#restored + 1] = lid
    else
      local f = redis.call('HMGET', L, 'h', 's')
      if f[1] == hid and tonumber(f[2]) == ACTIVE then restored[#restored + 1] = lid end
    end
  end
  return {'OK', stamp(), holder_enc(hid), restored, reclaimable_of(hid), event}
end

local function heartbeat(keys, args)
  local n = begin(keys, args)
  local hid = args[1]  -- then the ids of dead leases the holder has freed, args[2 .. n]
  local s = holder_state(hid)
  if not s or s == H_LOST or not confirmed(hid) then  -- (unconfirmed: register again)
    return {'ERR', ERR_HOLDER_NOT_FOUND}
  end
  local H = P .. 'h:' .. hid
  local ttl = redis.call('HGET', H, 'ttl')
  local x = NOW + tonumber(ttl)
  redis.call('HSET', H, 'x', F(x))
  redis.call('ZADD', P .. 'holders', F(x), hid)
  for j = 2, n do
    local lid = args[j]
    if redis.call('SISMEMBER', P .. 'hd:' .. hid, lid) == 1 and pins_of(lid) == 0 then
      forget(lid)
      redis.call('SREM', P .. 'hd:' .. hid, lid)  -- also when its hash was evicted
    end
  end
  return {'OK', stamp(), reclaimable_of(hid), ttl}
end

local function deregister(keys, args)
  begin(keys, args)
  local hid = args[1]
  local s = holder_state(hid)
  if not s or s == H_LOST then return {'ERR', ERR_HOLDER_NOT_FOUND} end
  redis.call('HSET', P .. 'h:' .. hid, 's', H_DRAINING)
  for _, lid in ipairs(redis.call('SMEMBERS', P .. 'ha:' .. hid)) do kill(lid, REVOKED, 0) end
  local pinned = 0
  for _, lid in ipairs(redis.call('SMEMBERS', P .. 'hd:' .. hid)) do
    if pins_of(lid) > 0 then pinned = pinned + 1 end
  end
  return {'OK', stamp(), reclaimable_of(hid), pinned}
end

local function holders(keys, args)
  begin(keys, args)
  for _, hid in ipairs(redis.call('ZRANGEBYSCORE', P .. 'holders', '-inf', F(NOW))) do
    lose_holder(hid)
  end
  local out = {}
  for _, hid in ipairs(redis.call('ZRANGE', P .. 'holders', 0, -1)) do
    out[#out + 1] = holder_enc(hid)
  end
  return {'OK', stamp(), out}
end

local function get_holder(keys, args)
  begin(keys, args)
  local hid = args[1]
  local s = holder_state(hid)
  if not s or s == H_LOST then return {'ERR', ERR_HOLDER_NOT_FOUND} end
  return {'OK', stamp(), holder_enc(hid)}
end

expose('register', register)
expose('heartbeat', heartbeat)
expose('deregister', deregister)
expose('holders', holders)
expose('get_holder', get_holder)
