-- Leases: grant (superseding the conversation's current one), renew, revoke, look up, list.

local function grant(keys, args)
  begin(keys, args)
  local hid, bs, lid = args[1], args[2], args[3]  -- bs: the block size the caller checked
  -- args[4]: whether lid came from a request_id
  local tenant, conv, rrid, payload = args[5], args[6], args[7], args[8]
  local tokens, blocks = args[9], tonumber(args[10])
  local idle, life, max_leases = tonumber(args[11]), tonumber(args[12]), tonumber(args[13])
  local QL, QB = tonumber(args[14]), tonumber(args[15])  -- the tenant's quota (0: none)
  local hk = args[16]  -- the history keys, concatenated ('' for none)
  local s = holder_state(hid)
  if not s or s == H_LOST then return {'ERR', ERR_HOLDER_NOT_FOUND} end
  local hbs = redis.call('HGET', P .. 'h:' .. hid, 'bs')
  if hbs ~= bs then return {'STALE', hbs} end
  if s == H_DRAINING then return {'ERR', ERR_HOLDER_DRAINING} end
  local L = P .. 'l:' .. lid
  -- The lease exists already: a retried request_id, or this very call run again (a client
  -- that resent it after losing the reply; the id is drawn once, before the first send).
  -- Either way it is answered as it stands; running on would supersede the lease by itself.
  if redis.call('EXISTS', L) == 1 then
    local f = redis.call('HMGET', L, 't', 'c', 'r', 'h')
    if f[1] ~= tenant or f[2] ~= conv or f[3] ~= rrid or f[4] ~= hid then
      return {'ERR', ERR_REQUEST_ID_REUSED}
    end
    return {'OK', stamp(), lease_enc(lid), holder_enc(hid), {}}
  end
  if redis.call('ZCARD', P .. 'leases') >= max_leases then
    return {'ERR', ERR_CAPACITY_EXHAUSTED}
  end
  local C = P .. 'c:' .. tenant .. ' ' .. conv
  local cur = redis.call('GET', C)
  -- A Redis that evicts keys (see the docs) may have dropped the current lease's hash: then
  -- there is nothing to supersede, and the new epoch, which must still exceed the lost one,
  -- comes from the clock (milliseconds) instead of the lost lease.
  local epoch = 1
  if cur and redis.call('EXISTS', P .. 'l:' .. cur) == 0 then
    redis.call('SREM', P .. 'ta:' .. tenant, cur)
    cur = false
    epoch = math.floor(NOW * 1000)
  end
  local evicted = {}
  if QL > 0 or QB > 0 then
    if QB > 0 and blocks > QB then return {'ERR', ERR_TENANT_QUOTA_EXCEEDED} end
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
      if over() then return {'ERR', ERR_TENANT_QUOTA_EXCEEDED} end
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
  local x = add_lease(lid, hid, tenant, conv, rrid, payload, tokens, blocks, epoch, idle, life,
                      NOW)
  add_history(lid, tenant, hk)  -- after the supersession: the keys it shares are its own now
  redis.call('SET', C, lid)
  redis.call('ZADD', P .. 'lexp', F(x), lid)
  emit(EV_GRANTED, lid, tenant, conv, hid, epoch, 0)
  return {'OK', stamp(), lease_enc(lid), holder_enc(hid), sup, evicted}
end

local function renew(keys, args)
  local n = begin(keys, args)
  -- args[1]: how many lease ids follow (args[2 ..]); then (tenant, conversation) pairs
  local nids = tonumber(args[1])
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
    if watch then emit(EV_RENEWED, lid, f[4], f[5], f[6], f[7], 0) end
  end
  for i = 1, nids do one(args[1 + i], args[1 + i]) end
  local k = 2 + nids
  while k + 1 <= n do
    one('', redis.call('GET', P .. 'c:' .. args[k] .. ' ' .. args[k + 1]))
    k = k + 2
  end
  return {'OK', stamp(), out}
end

local function revoke(keys, args)
  begin(keys, args)
  local lid, hid = args[1], args[2]  -- hid: the caller's holder ('' for an operator)
  if redis.call('EXISTS', P .. 'l:' .. lid) == 0 then return {'ERR', ERR_LEASE_NOT_FOUND} end
  local s = refresh(lid)
  local owner = redis.call('HGET', P .. 'l:' .. lid, 'h')
  if hid ~= '' and owner ~= hid then return {'ERR', ERR_NOT_LEASE_HOLDER} end
  local revoked = 0
  if s == ACTIVE then
    kill(lid, REVOKED, 0)
    revoked = 1
  end
  return {'OK', stamp(), lease_enc(lid), holder_enc(owner), revoked}
end

local function get_lease(keys, args)
  begin(keys, args)
  local lid = args[1]
  if redis.call('EXISTS', P .. 'l:' .. lid) == 0 then return {'ERR', ERR_LEASE_NOT_FOUND} end
  refresh(lid)
  return {'OK', stamp(), lease_enc(lid), holder_enc(redis.call('HGET', P .. 'l:' .. lid, 'h'))}
end

-- Seconds left of the recovery grace (0 when over): see `hold_until` (store.lua).
local function hold(keys, args)
  begin(keys, args)
  return {'OK', stamp(), F(math.max(HOLD_UNTIL - NOW, 0))}
end

local function list(keys, args)
  begin(keys, args)
  local tenant, conv, hid = args[1], args[2], args[3]  -- filters ('' for any)
  local inactive, after, limit = args[4] == '1', args[5], tonumber(args[6])
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
  elseif tenant ~= '' and conv ~= '' then
    -- One conversation: its current lease, and with inactive ones the tenant's dead leases
    -- not yet freed (few: holders free them as told), never the tenant's active ones.
    local cur = redis.call('GET', P .. 'c:' .. tenant .. ' ' .. conv)
    ids = {}
    if inactive then ids = redis.call('SMEMBERS', P .. 'td:' .. tenant) end
    if cur and (not inactive or redis.call('SISMEMBER', P .. 'td:' .. tenant, cur) == 0) then
      ids[#ids + 1] = cur  -- (a dead current lease is in td: already)
    end
    table.sort(ids)
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
  return {'OK', stamp(), out, holders}
end

expose('grant', grant)
expose('renew', renew)
expose('revoke', revoke)
expose('get_lease', get_lease)
expose('hold', hold)
expose('list', list)
