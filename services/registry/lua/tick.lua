-- The fleet's upkeep: expiry (tick), the clock fix, and the record of the state layout.

local function tick(keys, args)
  begin(keys, args)
  -- batch: the most holders, pins and leases each processed; retention: how long a lost
  -- holder's dead leases are kept (its own hard deadline)
  local batch, retention = tonumber(args[1]), tonumber(args[2])
  local layout, layout_min = args[3], args[4]  -- the caller's layout and minimum
  local owed_per_tick, pin_secret = tonumber(args[5]), args[6]
  local ticker, turn = args[7], tonumber(args[8])  -- '' and 0: an unscheduled tick
  -- Every tick's reply: what it expired and lost, when to tick next, the counts, the layout
  -- minimum, the pin secret and the history keys indexed (a replica takes them from any tick,
  -- its own turn or not).
  local function tick_reply(expired, nxt, lost)
    local next_in = ''
    if nxt then next_in = F(nxt - NOW) end
    return {'OK', stamp(), expired, next_in, lost, redis.call('ZCARD', P .. 'lexp'),
            redis.call('ZCARD', P .. 'leases'), redis.call('ZCARD', P .. 'holders'),
            redis.call('ZCARD', P .. 'pexp'), redis.call('HGET', P .. 'layout', 'min') or '0',
            redis.call('GET', P .. 'pin_secret') or '', redis.call('GET', P .. 'tkn') or '0'}
  end
  -- A scheduled tick (the replica's ticker token, and how long its turn holds) is left to the
  -- replica that took the turn while its hold lasts: the fleet's deadlines are processed by
  -- one replica at a time, so ticks do not grow with the number of replicas. It comes back
  -- when the turn ends (if the replica with it stopped ticking, this one takes over then). An
  -- unscheduled tick (no token) always runs. A turn that ends further away than one hold (the
  -- clock went back since it was taken) has ended: a clock step cannot stall the ticks.
  if ticker ~= '' then
    local held = redis.call('HMGET', P .. 'ticker', 'o', 'x')
    local ends = tonumber(held[2]) or 0  -- not a number (a hand edit): the turn is over
    if held[1] and held[1] ~= ticker and ends > NOW and ends <= NOW + turn then
      return tick_reply(0, ends, {})
    end
    redis.call('HSET', P .. 'ticker', 'o', ticker, 'x', F(NOW + turn))
  end
  -- The layout record, written again by the ticking replica when Redis lost it: an older
  -- replica started after a loss must still see it.
  if redis.call('EXISTS', P .. 'layout') == 0 then
    redis.call('HSET', P .. 'layout', 'version', layout, 'min', layout_min)
  end
  -- Likewise the pin secret (the caller's): the replicas keep agreeing on pin ids.
  redis.call('SET', P .. 'pin_secret', pin_secret, 'NX')
  -- The grace is over: the RECLAIMABLE events it held, first (what this tick kills is then
  -- sent as it dies). Every dead lease is queued once (P paying, by Redis itself: no Lua per
  -- lease), then owed_per_tick a tick are sent: one call over them all would stall Redis.
  if NOW >= HOLD_UNTIL then
    if redis.call('EXISTS', P .. 'owed') == 1 then
      redis.call('DEL', P .. 'owed')
      for _, z in ipairs({'holders', 'lost'}) do
        local hids = redis.call('ZRANGE', P .. z, 0, -1)
        for i = 1, #hids, 200 do  -- 200 sets a call: unpack has a stack limit
          local sets = {P .. 'paying'}
          for j = i, math.min(i + 199, #hids) do sets[#sets + 1] = P .. 'hd:' .. hids[j] end
          redis.call('ZUNIONSTORE', P .. 'paying', #sets, unpack(sets))
        end
      end
    end
    for _, lid in ipairs(redis.call('ZRANGE', P .. 'paying', 0, owed_per_tick - 1)) do
      redis.call('ZREM', P .. 'paying', lid)
      local f = redis.call('HMGET', P .. 'l:' .. lid, 't', 'c', 'h', 'e', 'k')
      -- forgotten since (its holder freed it): nothing to send; pinned: sent as it is unpinned
      if f[1] and tonumber(f[5]) == 0 then
        emit(EV_RECLAIMABLE, lid, f[1], f[2], f[3], f[4], 0)
      end
    end
  end
  local lost = {}
  local due_holders = redis.call('ZRANGEBYSCORE', P .. 'holders', '-inf', F(NOW),
                                 'LIMIT', 0, batch)
  for _, hid in ipairs(due_holders) do
    lost[#lost + 1] = {hid, lose_holder(hid)}
    -- One that held nothing has nothing to free: forgotten now (lapsed holders must not
    -- pile up for the whole retention).
    if redis.call('SCARD', P .. 'hd:' .. hid) == 0 then
      redis.call('DEL', P .. 'h:' .. hid, P .. 'ha:' .. hid, P .. 'hd:' .. hid)
      redis.call('ZREM', P .. 'lost', hid)
    end
  end
  -- Past a lost holder's own hard deadline (strictly) it has freed everything it held. One
  -- whose dead leases a pin still holds is looked at again a second later (it moves back in
  -- the queue: pinned ones never block the others).
  for _, hid in ipairs(redis.call('ZRANGEBYSCORE', P .. 'lost', '-inf',
                                  '(' .. F(NOW - retention), 'LIMIT', 0, 100)) do
    local dead = redis.call('SMEMBERS', P .. 'hd:' .. hid)
    local pinned = false
    for _, lid in ipairs(dead) do
      if pins_of(lid) > 0 then pinned = true end
    end
    if pinned then
      redis.call('ZADD', P .. 'lost', F(NOW - retention + 1), hid)
    else
      for _, lid in ipairs(dead) do forget(lid) end
      redis.call('DEL', P .. 'h:' .. hid, P .. 'ha:' .. hid, P .. 'hd:' .. hid)
      redis.call('ZREM', P .. 'lost', hid)
    end
  end
  -- Ended pins: each one's lease is unpinned; their records go in one removal per 200 (the
  -- tick holds Redis, and every read waiting behind it, for as long as it runs).
  local ended = redis.call('ZRANGEBYSCORE', P .. 'pexp', '-inf', F(NOW), 'LIMIT', 0, batch)
  for i = 1, #ended, 200 do
    local pins = {}
    for j = i, math.min(i + 199, #ended) do
      local key = P .. 'p:' .. ended[j]
      pins[#pins + 1] = key
      local lid = redis.call('HGET', key, 'l')
      if lid then unpin(lid) end
    end
    redis.call('DEL', unpack(pins))
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
  for _, z in ipairs({'holders', 'pexp', 'lexp', 'lost'}) do
    local first = redis.call('ZRANGE', P .. z, 0, 0, 'WITHSCORES')
    if first[2] then
      local v = tonumber(first[2])
      if z == 'lost' then v = v + retention end  -- scored by when it was lost
      if not nxt or v < nxt then nxt = v end
    end
  end
  return tick_reply(expired, nxt, lost)
end

-- Store a fix a caller confirmed, moved by the step it saw: only over the generation it saw
-- (another replica may have stored one since).
local function clockfix(keys, args)
  begin(keys, args)
  local gen, step = args[1], tonumber(args[2])
  if gen ~= GEN then return {'OK', stamp(), 0} end
  redis.call('HSET', P .. 'clock', 'fix', F(FIX + step), 'gen', tostring(tonumber(GEN) + 1))
  return {'OK', stamp(), 1}
end

-- Record the caller's state layout in `<prefix>layout` (keys[1]), or refuse it when the
-- replicas sharing the namespace need a newer one: {1 or 0, the newest layout, the minimum}.
-- Called alone, before anything else, without the call context.
local function layout(keys, args)
  local K = keys[1]
  local mine, min = tonumber(args[1]), tonumber(args[2])
  local f = redis.call('HMGET', K, 'version', 'min')
  local v, m = tonumber(f[1] or '0'), tonumber(f[2] or '0')
  if mine < m then return {0, tostring(v), tostring(m)} end
  if mine > v then v = mine; redis.call('HSET', K, 'version', v) end
  if min > m then m = min; redis.call('HSET', K, 'min', m) end
  return {1, tostring(v), tostring(m)}
end

expose('tick', tick)
expose('clockfix', clockfix)
expose('layout', layout)
