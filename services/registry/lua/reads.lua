-- Reads: a pin on the conversation's lease for the blocks a prompt can reuse, and its release.

-- How many leading blocks of `theirs` match the first `blocks` hashes of `ours`.
local function matching(ours, theirs, blocks)
  local n = math.min(blocks, math.floor(#theirs / HASH_SIZE))
  if string.sub(ours, 1, n * HASH_SIZE) == string.sub(theirs, 1, n * HASH_SIZE) then
    return n
  end
  local k = 0
  while k < n and string.sub(ours, k * HASH_SIZE + 1, (k + 1) * HASH_SIZE)
      == string.sub(theirs, k * HASH_SIZE + 1, (k + 1) * HASH_SIZE) do
    k = k + 1
  end
  return k
end

local function read(keys, args)
  begin(keys, args, true)
  -- mode: 'a' to match the prompt's hashes, 'p' to pin the whole lease (no prompt)
  local mode, tenant, conv, prompt = args[1], args[2], args[3], args[4]
  local min_tokens, pin_ttl, pin_id = tonumber(args[5]), tonumber(args[6]), args[7]
  local max_pin = tonumber(args[9])  -- args[8]: whether the pin id came from a request_id
  local max_tenant_pins = tonumber(args[10])  -- 0: no limit
  local lid = redis.call('GET', P .. 'c:' .. tenant .. ' ' .. conv)
  if not lid then return {'OK', stamp(), MISS_NO_LEASE, 0, 0, 0} end
  local L = P .. 'l:' .. lid
  -- The hot path reads the lease and its holder once each and answers from what it read.
  -- Anything but a live lease of an active, unexpired holder takes the general path below,
  -- which applies passed deadlines first (refresh) and reports the miss.
  local lf = redis.call('HMGET', L, unpack(LF))  -- t c h r p n e i m ct x s k
  local hid = lf[3]
  if not hid then return {'OK', stamp(), MISS_NO_LEASE, 0, 0, 0} end  -- a lease now gone
  local hf = redis.call('HMGET', P .. 'h:' .. hid, unpack(HF))  -- host .. s rb
  local function miss(reason, k, matched, partial)
    return {'OK', stamp(), reason, k, matched, partial, lease_enc(lid), holder_enc(hid)}
  end
  if not (hf[9] and tonumber(lf[12]) == ACTIVE and tonumber(lf[11]) > NOW
          and tonumber(hf[9]) == H_ACTIVE and tonumber(hf[7]) > NOW) then
    local s = refresh(lid)
    if s ~= ACTIVE then return miss(MISS_FOR_STATE[s], 0, 0, 0) end
    return miss(MISS_HOLDER_GONE, 0, 0, 0)  -- a live lease whose holder is draining
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
      if full > 0 and #prompt > 0 then return miss(MISS_HASH_MISMATCH, k, 0, 0) end
      return miss(MISS_BELOW_MINIMUM, k, 0, 0)
    end
  else
    if n == 0 then return miss(MISS_BELOW_MINIMUM, 0, 0, 0) end
    k, partial, reusable = full, n % bs ~= 0, n
  end
  local pflag = 0
  if partial then pflag = 1 end
  if reusable < min_tokens then return miss(MISS_BELOW_MINIMUM, k, k, pflag) end
  local PK = P .. 'p:' .. pin_id
  -- Always looked up, request_id or not: a call run again (resent after its reply was lost;
  -- the pin id is drawn once, before the first send) must not count its pin twice.
  local existing = redis.call('HMGET', PK, 'l', 'x')
  local deadline
  local pins = tonumber(lf[13])
  if existing and existing[1] then
    if existing[1] ~= lid then return {'ERR', ERR_REQUEST_ID_REUSED} end
    deadline = tonumber(existing[2])
  else
    deadline = math.min(NOW + pin_ttl, created + life + max_pin)
    if deadline <= NOW then return miss(MISS_EXPIRED, k, 0, 0) end
    if max_tenant_pins > 0 and
        tonumber(redis.call('HGET', P .. 'tp', lf[1]) or '0') >= max_tenant_pins then
      return {'ERR', ERR_TENANT_PINS_EXCEEDED}
    end
    redis.call('HINCRBY', P .. 'tp', lf[1], 1)
    redis.call('HSET', PK, 'l', lid, 'x', F(deadline))
    redis.call('ZADD', P .. 'pexp', F(deadline), pin_id)
    pins = pins + 1
  end
  -- A read is conversation activity: keep the lease for the turn that follows.
  local x = F(math.min(NOW + tonumber(lf[8]), created + life))
  redis.call('HSET', L, 'x', x, 'k', pins)
  redis.call('ZADD', P .. 'lexp', x, lid)
  lf[11], lf[13] = x, pins
  return {'OK', stamp(), MISS_HIT, k, k, pflag, lease_enc(lid, lf), holder_enc(hid, hf), pin_id,
          F(deadline)}
end

local function release(keys, args)
  begin(keys, args)
  local pin = args[1]
  local PK = P .. 'p:' .. pin
  local lid = redis.call('HGET', PK, 'l')
  if not lid then return {'OK', stamp(), 0} end
  redis.call('DEL', PK)
  redis.call('ZREM', P .. 'pexp', pin)
  unpin(lid)
  return {'OK', stamp(), 1}
end

expose('read', read)
expose('release', release)
