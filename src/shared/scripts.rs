//! The Lua scripts that make each shared-state step atomic in Redis: a
//! script runs alone on the server, so two replicas can never both read a
//! bucket, both see room, and both take the last token. Every script reads
//! the time from Redis itself (`TIME`), so replicas whose clocks disagree
//! still agree on when a bucket refills or a lease expires.

/// Milliseconds since the epoch, by the Redis server's clock.
const NOW: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"#;

/// A bucket's level at `now`: `cap` is `len` seconds of `rate` (per
/// second): a minute of policy time (less wall time under `[sim] speed`).
/// A bucket Redis does not hold (a new quota, or a Redis that came back
/// empty) starts at `seed` of its capacity where the caller knows the
/// fleet's last level (`seed` ≥ 0), full otherwise. A level may be below
/// zero: spending reported after the fact (a replica that served while
/// Redis was unreachable) is a debt the bucket refills out of.
const LEVEL: &str = r#"
local function level(l, a, rate, seed, len)
  local cap = rate * len
  local lv = tonumber(l)
  local at = tonumber(a)
  if lv == nil or at == nil then
    if seed ~= nil and seed >= 0 then return math.min(cap, cap * seed) end
    return cap
  end
  if now > at then lv = math.min(cap, lv + rate * (now - at) / 1000) end
  return lv
end
local function frac(lv, rate, len)
  if rate <= 0 then return '-' end
  return tostring(lv / (rate * len))
end
"#;

/// Claims one request of every quota that applies to it (its tenant's,
/// its tier's, its model's), all or nothing: each is checked, then all are
/// taken, in one step.
/// KEYS: per quota, 1 its hash (bucket levels, GPU-seconds today), 2 its
/// concurrency leases (a sorted set: member = request, score = expiry);
/// last, the claim's marker (see [`UNCLAIM`]).
/// ARGV: 1 tokens needed, 2 lease member, 3 lease ms, then per quota seven:
/// requests/s (0: none), tokens/s (0: none), concurrency limit (0: none),
/// GPU-seconds a day (-1: none), the requests and tokens buckets' seeds
/// (see `level`; -1: none), and the seconds a bucket holds; last, the
/// marker's lifetime in ms.
/// A granted claim leaves its marker (deleted by [`RELEASE`]), so that a
/// replica that never got the answer can take it back ([`UNCLAIM`]).
/// Returns {1, then per quota its requests and tokens buckets' share left
/// ("-" for none)} or {0, limit, retry ms, the refusing quota (1-based)}.
const CLAIM: &str = r#"
local need = tonumber(ARGV[1])
local lease = tonumber(ARGV[3])
local n = math.floor(#KEYS / 2)
local day = math.floor(now / 86400000)
local got = {}
for i = 1, n do
  local o = 3 + (i - 1) * 7
  local len = tonumber(ARGV[o + 7])
  local req_rate = tonumber(ARGV[o + 1])
  local tok_rate = tonumber(ARGV[o + 2])
  local conc = tonumber(ARGV[o + 3])
  local gpu = tonumber(ARGV[o + 4])
  local qk = KEYS[2 * i - 1]
  local lk = KEYS[2 * i]
  if conc > 0 then
    redis.call('ZREMRANGEBYSCORE', lk, '-inf', now)
    if redis.call('ZCARD', lk) >= conc then
      return {0, 'concurrency', 1000, i}
    end
  end
  local h = redis.call('HMGET', qk, 'rl', 'ra', 'tl', 'ta', 'gd', 'gu')
  if gpu >= 0 then
    local gd = tonumber(h[5]) or -1
    local gu = tonumber(h[6]) or 0
    if gd == day and gu >= gpu then
      return {0, 'gpu-seconds', (day + 1) * 86400000 - now, i}
    end
  end
  local rl = nil
  local tl = nil
  if req_rate > 0 then
    rl = level(h[1], h[2], req_rate, tonumber(ARGV[o + 5]), len)
    if rl < 1 then
      return {0, 'requests', math.max(1, math.ceil((1 - rl) / req_rate * 1000)), i}
    end
  end
  if tok_rate > 0 then
    tl = level(h[3], h[4], tok_rate, tonumber(ARGV[o + 6]), len)
    if tl < need then
      return {0, 'tokens', math.max(1, math.ceil((need - tl) / tok_rate * 1000)), i}
    end
  end
  got[i] = {rl, tl, req_rate, tok_rate, conc, len}
end
local out = {1}
for i = 1, n do
  local g = got[i]
  local qk = KEYS[2 * i - 1]
  if g[1] ~= nil then redis.call('HSET', qk, 'rl', tostring(g[1] - 1), 'ra', now) end
  if g[2] ~= nil then redis.call('HSET', qk, 'tl', tostring(g[2] - need), 'ta', now) end
  if g[5] > 0 then
    redis.call('ZADD', KEYS[2 * i], now + lease, ARGV[2])
    redis.call('PEXPIRE', KEYS[2 * i], lease * 2)
  end
  redis.call('PEXPIRE', qk, 172800000)
  if g[1] ~= nil then table.insert(out, frac(g[1] - 1, g[3], g[6])) else table.insert(out, '-') end
  if g[2] ~= nil then table.insert(out, frac(g[2] - need, g[4], g[6])) else table.insert(out, '-') end
end
redis.call('SET', KEYS[#KEYS], '1', 'PX', tonumber(ARGV[#ARGV]))
return out
"#;

/// A claimed request ended: refund unused tokens, drop its lease, charge
/// its GPU-seconds to today, for every quota it claimed.
/// KEYS: as [`CLAIM`] (the claim's marker, last, is deleted). ARGV:
/// 1 tokens to refund, 2 lease member, 3 GPU-seconds used, then per quota
/// three: tokens/s (0: none), 1 when it has a GPU-seconds limit, the
/// seconds a bucket holds.
const RELEASE: &str = r#"
local refund = tonumber(ARGV[1])
local gpu = tonumber(ARGV[3])
local n = math.floor(#KEYS / 2)
for i = 1, n do
  local tok_rate = tonumber(ARGV[3 + (i - 1) * 3 + 1])
  local gpu_limited = ARGV[3 + (i - 1) * 3 + 2] == '1'
  local len = tonumber(ARGV[3 + (i - 1) * 3 + 3])
  local qk = KEYS[2 * i - 1]
  if tok_rate > 0 and refund > 0 then
    local h = redis.call('HMGET', qk, 'tl', 'ta')
    local lv = level(h[1], h[2], tok_rate, nil, len)
    redis.call('HSET', qk, 'tl', tostring(math.min(tok_rate * len, lv + refund)), 'ta', now)
  end
  redis.call('ZREM', KEYS[2 * i], ARGV[2])
  if gpu > 0 and gpu_limited then
    local day = math.floor(now / 86400000)
    local h = redis.call('HMGET', qk, 'gd', 'gu')
    local gu = 0
    if tonumber(h[1]) == day then gu = tonumber(h[2]) or 0 end
    redis.call('HSET', qk, 'gd', day, 'gu', tostring(gu + gpu))
  end
end
redis.call('DEL', KEYS[#KEYS])
return 1
"#;

/// Takes back a claim whose answer the replica never got (the call timed
/// out after the script ran, or the connection dropped): the replica
/// decided that request by itself and reports what it spent, so what the
/// claim took is given back, once. Only a claim that was granted left a
/// marker, and the first call deletes it: a claim that never ran, or one
/// already released or taken back, changes nothing.
/// KEYS: as [`CLAIM`]. ARGV: 1 tokens the claim took, 2 lease member, then
/// per quota three: requests/s (0: none), tokens/s (0: none), the seconds
/// a bucket holds.
/// Returns 1 when it gave something back, 0 otherwise.
const UNCLAIM: &str = r#"
if redis.call('DEL', KEYS[#KEYS]) == 0 then return 0 end
local need = tonumber(ARGV[1])
local n = math.floor(#KEYS / 2)
for i = 1, n do
  local o = 2 + (i - 1) * 3
  local req_rate = tonumber(ARGV[o + 1])
  local tok_rate = tonumber(ARGV[o + 2])
  local len = tonumber(ARGV[o + 3])
  local qk = KEYS[2 * i - 1]
  local h = redis.call('HMGET', qk, 'rl', 'ra', 'tl', 'ta')
  if req_rate > 0 and h[1] then
    local lv = level(h[1], h[2], req_rate, nil, len)
    redis.call('HSET', qk, 'rl', tostring(math.min(req_rate * len, lv + 1)), 'ra', now)
  end
  if tok_rate > 0 and need > 0 and h[3] then
    local lv = level(h[3], h[4], tok_rate, nil, len)
    redis.call('HSET', qk, 'tl', tostring(math.min(tok_rate * len, lv + need)), 'ta', now)
  end
  redis.call('ZREM', KEYS[2 * i], ARGV[2])
end
return 1
"#;

/// Charges what replicas spent on their own (while Redis was unreachable,
/// or for a quota their claim did not cover) to the fleet's buckets, and
/// reads every bucket's level back.
/// KEYS: the quotas' hashes, then the id of the last report this replica
/// had charged. ARGV: 1 this report's id ("": nothing to charge), 2 its
/// lifetime in ms, then per quota eight: requests/s (0: none), tokens/s
/// (0: none), requests spent, tokens spent (negative: refunded), the
/// requests and tokens buckets' seeds (see `level`), the seconds a bucket
/// holds, and GPU-seconds used (charged to today where `gd`/`gu` count
/// them, i.e. the quota limits GPU-seconds).
/// A report is charged once: a replica whose call timed out after the
/// script ran sends the same report (same id) again, and the second finds
/// it charged already and only reads the levels.
/// A bucket is charged from its level by Redis's clock (refilled since it
/// was last written, by its rate), or, where Redis lost it, from the seed:
/// the fleet's last level the replica saw, refilled since. It may go below
/// zero (by at most a bucket): the fleet then admits nothing until it
/// refilled past what was spent.
/// Returns per quota its requests and tokens buckets' share left ("-" for
/// none).
const SYNC: &str = r#"
local out = {}
local rk = KEYS[#KEYS]
local charge = ARGV[1] ~= '' and redis.call('GET', rk) ~= ARGV[1]
if charge then redis.call('SET', rk, ARGV[1], 'PX', tonumber(ARGV[2])) end
local day = math.floor(now / 86400000)
for i = 1, #KEYS - 1 do
  local o = 2 + (i - 1) * 8
  local len = tonumber(ARGV[o + 7])
  local rates = {tonumber(ARGV[o + 1]), tonumber(ARGV[o + 2])}
  local spent = {tonumber(ARGV[o + 3]), tonumber(ARGV[o + 4])}
  local seeds = {tonumber(ARGV[o + 5]), tonumber(ARGV[o + 6])}
  local gpu = tonumber(ARGV[o + 8])
  if not charge then
    spent = {0, 0}
    gpu = 0
  end
  local h = redis.call('HMGET', KEYS[i], 'rl', 'ra', 'tl', 'ta')
  local wrote = false
  if gpu > 0 then
    local g = redis.call('HMGET', KEYS[i], 'gd', 'gu')
    local gu = 0
    if tonumber(g[1]) == day then gu = tonumber(g[2]) or 0 end
    redis.call('HSET', KEYS[i], 'gd', day, 'gu', tostring(gu + gpu))
    wrote = true
  end
  for b = 1, 2 do
    local rate = rates[b]
    if rate > 0 then
      local lv = level(h[2 * b - 1], h[2 * b], rate, seeds[b], len)
      if spent[b] ~= 0 then
        local cap = rate * len
        lv = math.max(-cap, math.min(cap, lv - spent[b]))
        if b == 1 then
          redis.call('HSET', KEYS[i], 'rl', tostring(lv), 'ra', now)
        else
          redis.call('HSET', KEYS[i], 'tl', tostring(lv), 'ta', now)
        end
        wrote = true
      end
      table.insert(out, frac(lv, rate, len))
    else
      table.insert(out, '-')
    end
  end
  if wrote then redis.call('PEXPIRE', KEYS[i], 172800000) end
end
return out
"#;

/// Extends the leases a live replica holds. KEYS: 1 a tenant's leases.
/// ARGV: 1 lease ms, 2… members. Only members still present are renewed
/// (`XX`): one released meanwhile stays released.
const RENEW: &str = r#"
local lease = tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', now + lease, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], lease * 2)
return 1
"#;

/// Folds a replica's fair-share service into the fleet's counters and
/// returns them. KEYS: 1 the counters of one (model, variant, tier).
/// ARGV: 1 decay window ms (0: none), then tenant, service pairs.
/// A counter decays as the scheduler's do (`v * exp(-dt / window)`).
/// Returns tenant, counter pairs (counters as strings: exact floats).
const SHARE: &str = r#"
local window = tonumber(ARGV[1])
local function decayed(v, a)
  v = tonumber(v) or 0
  a = tonumber(a) or now
  if window > 0 and now > a and v > 0 then v = v * math.exp(-(now - a) / window) end
  return v
end
for i = 2, #ARGV, 2 do
  local t = ARGV[i]
  local h = redis.call('HMGET', KEYS[1], 'v:' .. t, 'a:' .. t)
  local v = decayed(h[1], h[2]) + tonumber(ARGV[i + 1])
  if v < 0 then v = 0 end
  redis.call('HSET', KEYS[1], 'v:' .. t, tostring(v), 'a:' .. t, now)
end
local all = redis.call('HGETALL', KEYS[1])
local out = {}
local vals = {}
local ats = {}
for i = 1, #all, 2 do
  local f = all[i]
  local kind = string.sub(f, 1, 2)
  local t = string.sub(f, 3)
  if kind == 'v:' then vals[t] = all[i + 1] elseif kind == 'a:' then ats[t] = all[i + 1] end
end
for t, v in pairs(vals) do
  table.insert(out, t)
  table.insert(out, tostring(decayed(v, ats[t])))
end
redis.call('PEXPIRE', KEYS[1], 604800000)
return out
"#;

/// Takes or renews a named lease (one writer at a time). KEYS: 1 the
/// lease. ARGV: 1 holder, 2 ms. Returns 1 when the caller holds it now.
const LEASE: &str = r#"
local cur = redis.call('GET', KEYS[1])
if cur == false or cur == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[2]))
  return 1
end
return 0
"#;

/// Gives a lease back, only if the caller still holds it.
/// A money budget's period over a fleet (a hash: replica → what it spent
/// this period). A replica writes its own total (the larger of what it
/// holds and what the hash has for it, so one restarted with nothing goes
/// on from what it had spent), and reads what the others spent. Absolute
/// values, not increments: a call whose answer was lost, run again,
/// charges nothing twice.
/// KEYS[1] the period's hash; ARGV: replica, its total, ttl (s).
/// Returns {its total as kept, the others' sum}, as strings.
const BUDGET: &str = r#"
local own = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0') or 0
local mine = math.max(own, tonumber(ARGV[2]) or 0)
redis.call('HSET', KEYS[1], ARGV[1], tostring(mine))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
local total = 0
for _, v in ipairs(redis.call('HVALS', KEYS[1])) do
  total = total + (tonumber(v) or 0)
end
return {tostring(mine), tostring(total - mine)}
"#;

/// Adds an API key managed through the fleet (KEYS: the keys by hash,
/// the names, the epoch, the revoked hashes; ARGV: hash, name, record):
/// refused (0) where the name is taken or the hash was revoked (a key
/// once revoked never comes back), else the fleet's new epoch.
const KEYS_ADD: &str = r#"
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 1 then return 0 end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
if redis.call('HEXISTS', KEYS[4], ARGV[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[1])
return redis.call('INCR', KEYS[3])
"#;

/// Revokes a key (same KEYS; ARGV: its hash, its name where the fleet
/// manages it (else empty: a key of kiln.toml), the record): the managed
/// entry goes, the hash is recorded as revoked; 0 where the name no
/// longer names that hash (revoked or replaced meanwhile), else the new
/// epoch.
const KEYS_REVOKE: &str = r#"
if ARGV[2] ~= '' then
  if redis.call('HGET', KEYS[2], ARGV[2]) ~= ARGV[1] then return 0 end
  redis.call('HDEL', KEYS[2], ARGV[2])
  redis.call('HDEL', KEYS[1], ARGV[1])
end
redis.call('HSET', KEYS[4], ARGV[1], ARGV[3])
return redis.call('INCR', KEYS[3])
"#;

/// Puts back what a replica last read where Redis lost it (restarted
/// empty, or flushed): each record is set only where absent, and the
/// epoch moves past both (ARGV: the replica's epoch, then the number of
/// managed records, then hash/name/record triples, then hash/record pairs
/// of revoked ones). A revoked hash wins over a managed one.
const KEYS_RESTORE: &str = r#"
local n = tonumber(ARGV[2])
local i = 3
for _ = 1, n do
  if redis.call('HEXISTS', KEYS[4], ARGV[i]) == 0
    and redis.call('HEXISTS', KEYS[2], ARGV[i + 1]) == 0
    and redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 2]) == 1 then
    redis.call('HSET', KEYS[2], ARGV[i + 1], ARGV[i])
  end
  i = i + 3
end
while i < #ARGV do
  redis.call('HSETNX', KEYS[4], ARGV[i], ARGV[i + 1])
  i = i + 2
end
local e = tonumber(redis.call('GET', KEYS[3]) or '0') or 0
local want = tonumber(ARGV[1]) or 0
if e <= want then
  redis.call('SET', KEYS[3], want + 1)
  return want + 1
end
return redis.call('INCR', KEYS[3])
"#;

const UNLEASE: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"#;

/// Slots of a shared upstream, split among the replicas of a fleet by
/// fair share: a tenant backlogged on n replicas brings each of them
/// weight/n, and a replica's target is the capacity times its part of
/// the total. A replica takes what it wants up to what the others hold or
/// are entitled to and want (and a share of what nobody wants); it is
/// recorded as holding at least what it runs and what it may still start,
/// so the sum
/// of holdings never exceeds the capacity; one over its target gives slots
/// back as its requests finish. A replica that stopped renewing (its lease
/// lapsed) holds nothing.
/// A target is rarely whole (weights 1:3 on 6 slots: 1.5 and 4.5): each
/// replica is entitled to its target's whole slots, and the slots the
/// fractions add up to go by turns, an epoch at a time, to the replicas
/// owed most, so that over time each holds its exact target.
/// KEYS: 1 holdings (replica → slots), 2 expiries (replica → ms),
/// 3 demands (replica → "want|tenant=weight,…"), 4 turns (replica → slots
/// owed; `_epoch`, and `_extra`: who holds an extra slot this epoch).
/// ARGV: 1 replica, 2 slots it wants, 3 slots in flight, 4 capacity,
/// 5 lease ms, 6 its backlogged tenants ("tenant=weight,…"), 7 the slots it
/// may use until it applies the answer (its grant in force), 8 an epoch's
/// length in ms.
/// Returns the slots it may use from now on (possibly fewer than it runs:
/// it then starts nothing until enough finish). What is stored is never
/// less than what it runs or may still start: a grant that shrinks is
/// applied by the replica first and recorded as smaller on its next call,
/// so the others never count on slots it could still fill.
const SLOTS: &str = r#"
local me = ARGV[1]
local want = tonumber(ARGV[2])
local busy = tonumber(ARGV[3])
local cap = tonumber(ARGV[4])
local lease = tonumber(ARGV[5])
redis.call('HSET', KEYS[2], me, now + lease)
redis.call('HSET', KEYS[3], me, ARGV[2] .. '|' .. ARGV[6])
local exps = redis.call('HGETALL', KEYS[2])
local live = {}
for i = 1, #exps, 2 do
  if tonumber(exps[i + 1]) < now then
    redis.call('HDEL', KEYS[1], exps[i])
    redis.call('HDEL', KEYS[2], exps[i])
    redis.call('HDEL', KEYS[3], exps[i])
  else
    live[exps[i]] = true
  end
end
local wants = {}
local tenants = {}
local count = {}
for r, _ in pairs(live) do
  local d = redis.call('HGET', KEYS[3], r) or '0|'
  local bar = string.find(d, '|', 1, true) or (#d + 1)
  wants[r] = tonumber(string.sub(d, 1, bar - 1)) or 0
  tenants[r] = {}
  for t, w in string.gmatch(string.sub(d, bar + 1), '([^,=]+)=([^,]+)') do
    tenants[r][t] = tonumber(w) or 1
    count[t] = (count[t] or 0) + 1
  end
end
local share = {}
local total = 0
for r, ts in pairs(tenants) do
  local s = 0
  for t, w in pairs(ts) do s = s + w / count[t] end
  share[r] = s
  total = total + s
end
local function target(r)
  if total <= 0 then return 0 end
  return cap * share[r] / total
end
-- Whole slots by target, and the slots the fractions add up to by turns:
-- each epoch every live replica is owed its target's fraction more, and
-- the ones owed most take one each (a tie goes to the name first in
-- order), so over time each holds its exact target, not a rounding of it
-- that a race decides.
local epoch = math.floor(now / tonumber(ARGV[8]))
local turns = redis.call('HMGET', KEYS[4], '_epoch', '_extra')
local extra = {}
if tonumber(turns[1]) == epoch then
  for r in string.gmatch(turns[2] or '', '[^,]+') do extra[r] = true end
else
  local names = {}
  local whole = 0
  for r, _ in pairs(live) do
    table.insert(names, r)
    whole = whole + math.floor(target(r))
  end
  table.sort(names)
  local owed = {}
  for _, r in ipairs(names) do
    local t = target(r)
    owed[r] = (tonumber(redis.call('HGET', KEYS[4], r) or '0') or 0) + t - math.floor(t)
  end
  local left = 0
  if total > 0 then left = math.max(0, math.floor(cap - whole + 0.5)) end
  local order = {}
  for _, r in ipairs(names) do table.insert(order, r) end
  table.sort(order, function(x, y)
    if owed[x] ~= owed[y] then return owed[x] > owed[y] end
    return x < y
  end)
  local chosen = {}
  for i = 1, math.min(left, #order) do
    local r = order[i]
    extra[r] = true
    owed[r] = owed[r] - 1
    table.insert(chosen, r)
  end
  redis.call('DEL', KEYS[4])
  redis.call('HSET', KEYS[4], '_epoch', epoch, '_extra', table.concat(chosen, ','))
  for _, r in ipairs(names) do
    -- Bounded: what a replica is owed never runs away.
    redis.call('HSET', KEYS[4], r, tostring(math.max(-1, math.min(1, owed[r]))))
  end
end
local function entitled(r)
  local e = math.floor(target(r))
  if extra[r] then e = e + 1 end
  return e
end
local others = 0
for r, _ in pairs(live) do
  if r ~= me then
    local held = tonumber(redis.call('HGET', KEYS[1], r) or '0') or 0
    others = others + math.max(held, math.min(wants[r], entitled(r)))
  end
end
local free = math.max(0, cap - others)
-- Not floored at what it runs: a replica over its share takes no new
-- work until enough of its requests finish (a full one would otherwise
-- keep every slot it ever got).
local mine = math.max(0, math.min(want, free))
-- While the fleet wants fewer slots than there are, the rest is spread
-- over the live replicas, so a request arriving at an idle replica finds
-- one without waiting for the next exchange. Once they want more, nobody
-- gets spare slots, and one holding spare gives them back at its next
-- call (the others' wants count against it above).
local n = 0
local wanted = 0
for r, _ in pairs(live) do
  n = n + 1
  wanted = wanted + (wants[r] or 0)
end
if n > 0 and wanted < cap and free > mine then mine = mine + math.floor((free - mine) / n) end
local in_force = tonumber(ARGV[7]) or cap
redis.call('HSET', KEYS[1], me, math.max(mine, in_force, busy))
for i = 1, 4 do redis.call('PEXPIRE', KEYS[i], lease * 4) end
return mine
"#;

/// Reads a hash-chained record (governance's) in one step, so its state
/// and its chain are never seen half written. KEYS: 1 the state, 2 the
/// chain (a list of lines), 3 the chain's head hash, 4 a side record (the
/// rollout in progress), 5 the checkpoint of the lines trimmed from the
/// chain's start (a hash: `entries` trimmed, `head` the last trimmed
/// line's hash, `extra` what the writer kept of them). ARGV: 1 the first
/// line wanted (0-based, counting trimmed lines).
/// Returns {state, head, length (trimmed lines included), side,
/// checkpoint entries, checkpoint head, checkpoint extra, lines…} ("" for
/// what is missing): the lines from the one wanted, or from the oldest
/// kept where that one was trimmed (the reader resumes from the
/// checkpoint).
const CHAIN_READ: &str = r#"
local st = redis.call('GET', KEYS[1]) or ''
local head = redis.call('GET', KEYS[3]) or ''
local cp = redis.call('HMGET', KEYS[5], 'entries', 'head', 'extra')
local base = tonumber(cp[1]) or 0
local kept = redis.call('LLEN', KEYS[2])
local side = redis.call('GET', KEYS[4]) or ''
local out = {st, head, base + kept, side, base, cp[2] or '', cp[3] or ''}
local from = math.max(0, tonumber(ARGV[1]) - base)
if from < kept then
  local lines = redis.call('LRANGE', KEYS[2], from, -1)
  for i = 1, #lines do table.insert(out, lines[i]) end
end
return out
"#;

/// Extends a hash-chained record, all or nothing, and only where the
/// writer still holds the record's lease and the chain still ends where
/// the writer read it: a writer that lost its lease, or read a chain that
/// moved since, can never fork it. KEYS: 1 the lease, 2 the chain, 3 its
/// head, 4 the state, 5 the side record, 6 the checkpoint (see
/// [`CHAIN_READ`]). ARGV: 1 holder, 2 expected length (trimmed lines
/// included), 3 expected head ("" for none yet), 4 new head, 5 "1" to
/// write the state, 6 the state, 7 "1" to write the side record, 8 it (""
/// deletes it), 9 its lifetime in ms, 10 the most lines the chain keeps
/// (0: all), 11 the checkpoint's extra, 12… lines. Returns 1 (written), 0
/// (lease not held) or -1 (the chain moved).
/// A chain over its bound is cut to three quarters of it, oldest lines
/// first: the checkpoint then counts them and holds the hash of the last
/// one cut, so the lines kept still verify link by link from it (and a
/// copy of the cut lines verifies against it).
const CHAIN_COMMIT: &str = r#"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local base = tonumber(redis.call('HGET', KEYS[6], 'entries')) or 0
if base + redis.call('LLEN', KEYS[2]) ~= tonumber(ARGV[2]) then return -1 end
local head = redis.call('GET', KEYS[3]) or ''
if head ~= ARGV[3] then return -1 end
if #ARGV >= 12 then
  for i = 12, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
  redis.call('SET', KEYS[3], ARGV[4])
end
local bound = tonumber(ARGV[10])
local kept = redis.call('LLEN', KEYS[2])
if bound > 0 and kept > bound then
  local cut = kept - math.max(1, math.floor(bound * 3 / 4))
  local last = cjson.decode(redis.call('LINDEX', KEYS[2], cut - 1))
  redis.call('HSET', KEYS[6], 'entries', base + cut, 'head', last['hash'], 'extra', ARGV[11])
  redis.call('LTRIM', KEYS[2], cut, -1)
end
if ARGV[5] == '1' then redis.call('SET', KEYS[4], ARGV[6]) end
if ARGV[7] == '1' then
  if ARGV[8] == '' then
    redis.call('DEL', KEYS[5])
  else
    redis.call('SET', KEYS[5], ARGV[8], 'PX', tonumber(ARGV[9]))
  end
end
return 1
"#;

/// Makes `files` the fleet's policy under a new epoch and rings the bell.
/// KEYS: 1 the policy hash. ARGV: 1 version, 2 files (JSON), 3 channel.
/// Returns the new epoch.
const POLICY: &str = r#"
local e = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'files', ARGV[2])
redis.call('PUBLISH', ARGV[3], e)
return e
"#;

fn with_now(body: &str, level: bool) -> String {
    let mut s = String::from(NOW);
    if level {
        s.push_str(LEVEL);
    }
    s.push_str(body);
    s
}

/// The scripts, loaded once (redis-rs sends `EVALSHA`, and the text only
/// when the server does not have it yet, e.g. after a Redis restart).
pub struct Scripts {
    pub claim: redis::Script,
    pub release: redis::Script,
    pub sync: redis::Script,
    pub unclaim: redis::Script,
    pub renew: redis::Script,
    pub share: redis::Script,
    pub lease: redis::Script,
    pub unlease: redis::Script,
    pub slots: redis::Script,
    pub chain_read: redis::Script,
    pub chain_commit: redis::Script,
    pub policy: redis::Script,
    pub budget: redis::Script,
    pub keys_add: redis::Script,
    pub keys_revoke: redis::Script,
    pub keys_restore: redis::Script,
}

impl Scripts {
    pub fn new() -> Scripts {
        Scripts {
            claim: redis::Script::new(&with_now(CLAIM, true)),
            release: redis::Script::new(&with_now(RELEASE, true)),
            sync: redis::Script::new(&with_now(SYNC, true)),
            unclaim: redis::Script::new(&with_now(UNCLAIM, true)),
            renew: redis::Script::new(&with_now(RENEW, false)),
            share: redis::Script::new(&with_now(SHARE, false)),
            lease: redis::Script::new(LEASE),
            unlease: redis::Script::new(UNLEASE),
            slots: redis::Script::new(&with_now(SLOTS, false)),
            policy: redis::Script::new(POLICY),
            chain_read: redis::Script::new(CHAIN_READ),
            chain_commit: redis::Script::new(CHAIN_COMMIT),
            budget: redis::Script::new(BUDGET),
            keys_add: redis::Script::new(KEYS_ADD),
            keys_revoke: redis::Script::new(KEYS_REVOKE),
            keys_restore: redis::Script::new(KEYS_RESTORE),
        }
    }
}

impl Default for Scripts {
    fn default() -> Self {
        Scripts::new()
    }
}
