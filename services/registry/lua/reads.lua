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

-- Whether a lease (its LF fields) of a holder (its HF fields) can be read as they stand: a
-- live lease of an active, unexpired holder that registered with this Redis (`confirmed`).
local function live(lf, hf)
  return hf[9] and tonumber(lf[12]) == ACTIVE and tonumber(lf[11]) > NOW
         and tonumber(hf[9]) == H_ACTIVE and tonumber(hf[7]) > NOW and confirmed(lf[3])
end

-- Whether `key` is one of the history keys `hk` (a lease's, concatenated), last first.
local function has_key(hk, key)
  if not hk then return false end
  for i = #hk - HISTORY_KEY_SIZE + 1, 1, -HISTORY_KEY_SIZE do
    if string.sub(hk, i, i + HISTORY_KEY_SIZE - 1) == key then return true end
  end
  return false
end

-- Keys a lookup by content reads a call: LOOKUP_FIRST (a turn that continues a lease matches
-- its last key a few boundaries back: the answer, tool results and the new message follow
-- it), then LOOKUP_GROWTH times more each call, at most LOOKUP_MOST (unpack has a stack
-- limit). Against one HGET a key, this halves what a miss over 4096 keys holds Redis for.
local LOOKUP_FIRST, LOOKUP_GROWTH, LOOKUP_MOST = 4, 8, 256

-- LF and the lease's history keys (built with operators only: loading the library runs this,
-- and a library's load sees no globals)
local LF_HK = {}
for i = 1, #LF do LF_HK[i] = LF[i] end
LF_HK[#LF + 1] = 'hk'

-- The lookup by content: the tenant's readable lease indexed (`tk:<tenant>`, see store.lua)
-- under the longest of `keys` (the request's history keys, shortest prefix first). Returns
-- its id, its LF and its holder's HF fields, how many of `keys` the match covers and whether
-- the key is the lease's last (1 or 0); nil for none. Each key is read once at most, longest
-- first, up to the first readable lease. A lease found that cannot be read is skipped:
-- deadlines that passed are applied (an expired lease, a lost holder's, leave the index with
-- it) and shorter keys are tried. An entry the index should not hold (its lease gone, dead, another
-- tenant's, or not granted under the key: left by a replica of an older layout, or by a Redis
-- that evicted the lease) is dropped as it is met.
local function found_by_history(tenant, keys)
  local TK = P .. 'tk:' .. tenant
  if redis.call('EXISTS', TK) == 0 then return nil end
  local dead = {}  -- lid -> true: dead (its entries go), false: live but not readable now
  -- Longest first, a chunk of keys a call (LOOKUP_FIRST...), so that a miss over a long
  -- history costs a few calls, not one a key. (An entry met later in a chunk may have gone
  -- since the chunk was read: the lease it names is checked before it is used, and nothing
  -- is added meanwhile.)
  local hi, size = math.floor(#keys / HISTORY_KEY_SIZE), LOOKUP_FIRST
  while hi >= 1 do
    local lo = math.max(hi - size + 1, 1)
    local chunk = {}
    for i = hi, lo, -1 do
      chunk[#chunk + 1] = string.sub(keys, (i - 1) * HISTORY_KEY_SIZE + 1,
                                     i * HISTORY_KEY_SIZE)
    end
    local lids = redis.call('HMGET', TK, unpack(chunk))
    for j = 1, #chunk do
      local key, lid = chunk[j], lids[j]
      local d = lid and dead[lid]
      if lid and d == nil then
        local lf = redis.call('HMGET', P .. 'l:' .. lid, unpack(LF_HK))
        local hk = lf[#LF_HK]
        lf[#LF_HK] = nil
        if not lf[3] then
          d = true  -- gone
        elseif lf[1] ~= tenant or not has_key(hk, key) then
          -- not one of that lease's keys (it may have others): this entry only goes
          count_entries(-redis.call('HDEL', TK, key))
        else
          local hf = redis.call('HMGET', P .. 'h:' .. lf[3], unpack(HF))
          if live(lf, hf) then
            local whole = 0
            if string.sub(hk, -HISTORY_KEY_SIZE) == key then whole = 1 end
            return lid, lf, hf, hi - j + 1, whole
          end
          -- Dead by now: killed just now (its keys left with it) or before, by a replica
          -- that keeps no index. Else alive but not readable (a draining holder's).
          d = refresh(lid) ~= ACTIVE
        end
        if d ~= nil then dead[lid] = d end
      end
      if d then count_entries(-redis.call('HDEL', TK, key)) end
    end
    hi, size = lo - 1, math.min(size * LOOKUP_GROWTH, LOOKUP_MOST)
  end
  return nil
end

local function read(keys, args)
  begin(keys, args, true)
  -- mode: 'a' to match the prompt's hashes, 'p' to pin the whole lease (no prompt), 'h' to
  -- pin the whole lease found by content (`prompt`: the request's history keys, no conv)
  local mode, tenant, conv, prompt = args[1], args[2], args[3], args[4]
  local min_tokens, pin_ttl, pin_id = tonumber(args[5]), tonumber(args[6]), args[7]
  local max_pin = tonumber(args[9])  -- args[8]: whether the pin id came from a request_id
  local max_tenant_pins = tonumber(args[10])  -- 0: no limit
  -- Every reply: the miss reason, the blocks matched, the blocks and partial block pinned,
  -- for a lookup by content how many keys matched and whether whole (else 0 0); then, when
  -- a lease was found, it and its holder; then, on a hit, the pin.
  local lid, lf, hid, hf
  local km, whole = 0, 0
  if mode == 'h' then
    lid, lf, hf, km, whole = found_by_history(tenant, prompt)
    if not lid then return {'OK', stamp(), MISS_NO_LEASE, 0, 0, 0, 0, 0} end
    mode, hid = 'p', lf[3]
  else
    lid = redis.call('GET', P .. 'c:' .. tenant .. ' ' .. conv)
    if not lid then return {'OK', stamp(), MISS_NO_LEASE, 0, 0, 0, 0, 0} end
    -- The hot path reads the lease and its holder once each and answers from what it read.
    -- Anything but a live lease of an active, unexpired holder takes the general path
    -- below, which applies passed deadlines first (refresh) and reports the miss.
    lf = redis.call('HMGET', P .. 'l:' .. lid, unpack(LF))  -- t c h r p n e i m ct x s k
    hid = lf[3]
    if not hid then return {'OK', stamp(), MISS_NO_LEASE, 0, 0, 0, 0, 0} end  -- now gone
    hf = redis.call('HMGET', P .. 'h:' .. hid, unpack(HF))  -- host .. s rb
  end
  local L = P .. 'l:' .. lid
  local function miss(reason, k, matched, partial)
    return {'OK', stamp(), reason, k, matched, partial, km, whole, lease_enc(lid),
            holder_enc(hid)}
  end
  if not live(lf, hf) then
    local s = refresh(lid)
    if s ~= ACTIVE then return miss(MISS_FOR_STATE[s], 0, 0, 0) end
    -- a live lease whose holder is draining, or has yet to register with this Redis
    return miss(MISS_HOLDER_GONE, 0, 0, 0)
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
  return {'OK', stamp(), MISS_HIT, k, k, pflag, km, whole, lease_enc(lid, lf),
          holder_enc(hid, hf), pin_id, F(deadline)}
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
