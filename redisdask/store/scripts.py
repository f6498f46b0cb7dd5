"""The core Lua scripts (the fenced write, the lease, claims, finishes) and ``Scripts``,
which calls them with named parameters.  Key names: ``keyspace.py``; the coordination
primitives' scripts: ``redisdask/coordination/scripts.py``."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

import redis
import redis.asyncio
from redis.commands.core import Script

from redisdask.durations import KEY_PREFIX_LUA
from redisdask.store.codecs import pack_for_lua
from redisdask.store.keyspace import READY_SIGNAL_MAXLEN, XADD_WITH_SPECS, Keys

# --------------------------------------------------------------------------- scripts

# The fence of the scheduler's writes, shared by its scripts: whether the lease is held
# with the token ARGV[1].  KEYS[1] lease, KEYS[2] lease-token.  A lease that expired and
# that nobody took since is still ours: the counter still stands at our token, so no
# scheduler was ever handed a newer one and nobody else can have written.  A leader that
# overran its TTL (a long batch, a GC pause, a stalled machine) goes on; one that a
# standby took over from (or that released the lease) is refused.
_FENCE = """
local function ours(token)
  local current = redis.call('GET', KEYS[1])
  if current then return current == token, current end
  return token ~= '' and redis.call('GET', KEYS[2]) == token, 'none (expired)'
end
"""

# Applies a scheduler batch atomically, fenced by the lease token.  ARGV[2] is a msgpack
# list of Redis commands (each a list of arguments) computed by the scheduler driver from
# the state machine's instructions, including the XACK of the batch: effects and
# acknowledgement land together or not at all, and only while the lease is ours.
# KEYS: lease, lease-token, applying, leader.  ARGV: token, commands, ttl ms, part,
# parts.  ``leader`` is renewed with the lease (``Keys.leader``).
# A big write is cut into parts (so that no script runs long enough for Redis to answer
# other clients BUSY), sent as one MULTI/EXEC: nothing runs between them.  Each part
# checks the fence and that the part before it succeeded (``applying`` holds the number
# of the last part that did), so a command that fails stops the rest of the write,
# acknowledgements included (they are in the last part): the batch stays pending.
APPLY_FENCED = (
    _FENCE
    + f"local XADD_WITH_SPECS = '{XADD_WITH_SPECS}'\n"
    + """
local held, current = ours(ARGV[1])
if not held then
  return redis.error_reply('FENCED lease token is ' .. tostring(current) .. ', ours is ' .. ARGV[1])
end
local part, parts = tonumber(ARGV[4]), tonumber(ARGV[5])
if part > 1 and redis.call('GET', KEYS[3]) ~= tostring(part - 1) then
  return redis.error_reply('ABORTED part ' .. part .. ' of ' .. parts .. ': an earlier part failed')
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])  -- first: through a full Redis (see THROUGH)
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
redis.call('SET', KEYS[4], '1', 'PX', ARGV[3])
local commands = cmsgpack.unpack(ARGV[2])
for i = 1, #commands do
  local command = commands[i]
  if command[1] == XADD_WITH_SPECS then  -- {_, stream, id, field, value, then pairs of
    command[1] = 'XADD'  -- (field, task record): the field gets the record's spec}
    for j = 6, #command, 2 do command[j + 1] = redis.call('HGET', command[j + 1], 'spec') or '' end
  end
  local reply = redis.pcall(unpack(command))
  if type(reply) == 'table' and reply.err then
    redis.call('DEL', KEYS[3])
    return reply
  end
end
if part < parts then redis.call('SET', KEYS[3], part) else redis.call('DEL', KEYS[3]) end
return #commands
"""
)

# Takes (or renews) the scheduler lease.  KEYS: lease, lease-token, scheduler, leader
# (renewed with the lease: ``Keys.leader``).  ARGV:
# our token ('' to ask for a new one), ttl ms, the name of our Redis connection, the
# token of a holder whose connection closed ('' if none: see ``lease.HolderWatch``), whose
# lease is then taken although it has not expired, and a random nonce.  A new token is
# ``<n>.<nonce>``, n one more than the last token's: the nonce makes every token unique
# even where the counter went back (a failover to a replica that missed the last
# acquisition hands out the same n again: two schedulers must not share a token).  It is
# written with the connection's name into the scheduler hash, for the standbys to watch.
# Returns the token held, or false.
ACQUIRE_LEASE = (
    _FENCE
    + """
if ours(ARGV[1]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])  -- first: through a full Redis (see THROUGH)
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  redis.call('SET', KEYS[4], '1', 'PX', ARGV[2])
  return ARGV[1]
end
local current = redis.call('GET', KEYS[1])
if current and current ~= ARGV[4] then return false end
redis.call('PEXPIRE', KEYS[1], ARGV[2])  -- (absent, or the gone holder's: taken below)
local last = redis.call('GET', KEYS[2])
local n = tonumber(last and string.match(last, '^%d+') or 0) or 0
local token = tostring(n + 1) .. '.' .. ARGV[5]
redis.call('SET', KEYS[2], token)
redis.call('SET', KEYS[1], token, 'PX', ARGV[2])
redis.call('SET', KEYS[4], '1', 'PX', ARGV[2])
redis.call('HSET', KEYS[3], 'token', token, 'conn', ARGV[3])
return token
"""
)

# A worker claims up to ARGV[2] queued tasks, from its own ready set first (tasks
# restricted to it), then its constrained set (tasks with resources it could run), then
# the cluster's.  KEYS: ready, workers, the worker's processing set, worker stream,
# ready-signal, the worker's ready set, the worker's inbox, the worker's constrained set,
# the durations hash.  ARGV: worker address, n, task key prefix, cluster key prefix, the
# last inbox id the worker read, the resources the worker has free ("GPU=1 MEM=5e9"; the
# stored form of ``placement.format_resources``), the claim horizon in seconds and the
# start times of the worker's threads ("0 0.004": ``durations.start_times``), both '' for
# a claim bounded by n alone.  With a horizon, a task is taken only if it starts within it
# on the thread free first, which is then busy for the task's estimate longer (the
# durations hash's entry for its prefix; none: busy for good); the first task that does
# not fit stays queued, in its place, and ends the claim (``full``).  The claim is
# recorded in Redis (task state, processing set, and ``claim``: the id of the entry that
# announces it) and announced to the scheduler in the same atomic step, so a claimed task
# is never invisible, and a scheduler that reloads before reading that entry knows which
# reports came before it.  A task with resources is taken only if what it needs (its
# hash's ``resources``) fits in what is still free, which the claim then counts down: a
# worker never claims more than it can run.  One that does not fit stays in the set; after
# 64 of them the scan stops (bounded work), and ``blocked`` says the worker should claim
# again once resources are freed.  Otherwise fewer than n claimed means the sets are
# empty, unless the claim was ``full``.  A task queued on several workers is taken out of
# the other workers' sets that hold it: the addresses in its hash's ``queued_on`` field
# (the scheduler writes it as it queues the task; ``workers`` holds the restriction as
# given, which may name hosts or names).  Returns {tasks, last ready-signal id, inbox
# entries after ARGV[5], flags (1: blocked for resources, 2: full), the id of the claim's
# entry on the workers stream ('' without a claim)}; each task is {key,
# spec, score, {{dep, who_has, nbytes, score[, value]}...}, resources, estimate ('' if
# none), '1' if its record has a ``chain`` (FINISH looks it up when the task finishes) else
# ''}: a dependency's ``score`` names the submission its value is of (a copy of another
# one kept by the worker is not it: ``ComputeTaskEvent.runs``); ``value``, a dependency's
# result kept in its record, for up to 4 MiB of them per claim (the rest is read when
# fetched).  The inbox entries were written before anything claimed
# here was queued (e.g. free-keys of an earlier run of a key that is queued again); the
# worker applies them first, so the inbox and the ready sets cannot overtake each other.
# KEYS[10], the ``placed`` set, holds the tasks placed by data (``redisdask.scheduler.decide``) on
# one worker (the first word of ``queued_on``), which is in that worker's ready set too.
# A worker with room left after its own sets and the shared one takes from it the tasks
# whose worker is busy (as many tasks in its processing set as it has threads) unless
# the task is ``sticky`` (its data costs more to move than its run: ``decide.sticky``),
# paused or retiring (its heartbeat, KEYS[11], says so), or gone; it leaves those of a
# worker with a free thread, which claims them itself, and the sticky ones of a busy
# worker, but for ``PLACED_PATIENCE_MS`` at most:
# the first worker to pass a task over writes Redis's time in its hash (``passed_over``),
# and a worker that finds it passed over that long ago takes it (a registered worker
# with a free thread that does not claim, stopped or cut off from Redis, holds nothing;
# an idle worker's claim loop looks again within a second, its XREAD's BLOCK).
# A worker that fills its budget while
# its ready set and the placed set still hold tasks XADDs a ready-signal (capped at
# ARGV[9] entries), so that idle workers look again now that it is busy.
# the flags a claim returns (PASSED: it left placed tasks to their worker, for now)
CLAIM_BLOCKED, CLAIM_FULL, CLAIM_PASSED = 1, 2, 4
PLACED_PATIENCE_MS = 500  # how long a placed task waits for its free preferred worker
CLAIM = (
    KEY_PREFIX_LUA
    + f"local PLACED_PATIENCE_MS = {PLACED_PATIENCE_MS}\n"
    + """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 then
  return redis.error_reply('UNKNOWN_WORKER ' .. ARGV[1] .. ' is not registered')
end
local last = redis.call('XREVRANGE', KEYS[5], '+', '-', 'COUNT', 1)
local last_id = '0-0'
if #last > 0 then last_id = last[1][1] end
local want = tonumber(ARGV[2])
local out = {}
local claimed = {}
local scores = {}
local blocked = 0
local SKIP = 64  -- tasks that do not fit, passed over per claim at most
local inline_left = 4194304  -- bytes of small results (``value``) a claim returns at most
local free = {}
for name, amount in string.gmatch(ARGV[6] or '', '([^%s=]+)=(%S+)') do
  free[name] = tonumber(amount)
end
local horizon = tonumber(ARGV[7] or '')  -- nil: no time budget, n alone bounds the claim
local starts = {}
for t in string.gmatch(ARGV[8] or '', '%S+') do starts[#starts + 1] = tonumber(t) end
local full = false  -- a task was left for want of a thread that starts it soon
local known = {}
local function estimate(key)  -- its prefix's duration average, or false: none yet
  local prefix = key_prefix(key)
  local e = known[prefix]
  if e == nil then
    e = tonumber(redis.call('HGET', KEYS[9], prefix)) or false
    known[prefix] = e
  end
  return e
end
local function admit(e)  -- whether a task of estimate e starts within the horizon
  if not horizon then return true end
  local first = nil
  for i = 1, #starts do
    if first == nil or starts[i] < starts[first] then first = i end
  end
  if first == nil or starts[first] > horizon then
    full = true
    return false
  end
  if e then starts[first] = starts[first] + e else starts[first] = math.huge end
  return true
end
local taken = {}  -- claimed here: written 'processing' with the claim's entry id at the end
local function fetch(key)
  local f = redis.call('HMGET', ARGV[3] .. key, 'spec', 'deps', 'state', 'queued_on', 'resources',
                          'chain', 'sticky')
  if taken[key] then f[3] = 'processing' end
  return f
end
local function take(key, score, f, e)  -- (into the processing set at the end, in one SADD)
  taken[key] = true
  local set = ':ready'
  if f[5] and f[5] ~= '' then set = ':constrained' end
  if f[4] and f[4] ~= '' then
    if set == ':ready' then redis.call('ZREM', KEYS[10], key) end
    for other in string.gmatch(f[4], '%S+') do
      if other ~= ARGV[1] then
        redis.call('ZREM', ARGV[4] .. 'worker:' .. other .. set, key)
      end
    end
  end
  local deps = {}
  if f[2] then
    for _, dep in ipairs(cmsgpack.unpack(f[2])) do
      local d = redis.call('HMGET', ARGV[3] .. dep, 'who_has', 'nbytes', 'value', 'score')
      local mine = string.find(' ' .. (d[1] or '') .. ' ', ' ' .. ARGV[1] .. ' ', 1, true)
      if d[3] and d[3] ~= '' and not mine and inline_left >= #d[3] then
        inline_left = inline_left - #d[3]
        deps[#deps + 1] = {dep, d[1] or '', d[2] or '0', d[4] or '', d[3]}
      else
        deps[#deps + 1] = {dep, d[1] or '', d[2] or '0', d[4] or ''}
      end
    end
  end
  local chained = (f[6] and f[6] ~= '') and '1' or ''  -- FINISH may look its chain up
  out[#out + 1] = {key, f[1], score, deps, f[5] or '', e and tostring(e) or '', chained}
  claimed[#claimed + 1] = key
  scores[#scores + 1] = score
end
-- a key no longer queued (claimed through another worker's set, released, forgotten)
-- is a stale entry: dropped.  With a horizon the claim reads (ZRANGE) one task per thread,
-- then twice as many each time, and removes what it took or dropped (ZREM): what a full
-- claim did not reach stays in its place.
local function claim_from(zset)
  local batch = want
  if horizon then batch = math.max(#starts, 1) end
  while #claimed < want and not full do
    local n = math.min(want - #claimed, batch)
    local popped
    if horizon then
      popped = redis.call('ZRANGE', zset, 0, n - 1, 'WITHSCORES')
    else
      popped = redis.call('ZPOPMIN', zset, n)
    end
    if #popped == 0 then return end
    batch = batch * 2
    local gone = {}
    for i = 1, #popped, 2 do
      if full then break end
      local key, score = popped[i], popped[i + 1]
      local f = fetch(key)
      if f[1] and f[3] == 'queued' then
        local e = estimate(key)
        if admit(e) then
          take(key, score, f, e)
          gone[#gone + 1] = key
        end
      else
        gone[#gone + 1] = key
      end
    end
    if horizon and #gone > 0 then redis.call('ZREM', zset, unpack(gone)) end
  end
end
local function fits(text)
  local need = {}
  for name, amount in string.gmatch(text or '', '([^%s=]+)=(%S+)') do
    need[name] = tonumber(amount) or 0
    if need[name] > (free[name] or 0) + 1e-9 then return nil end
  end
  return need
end
local function claim_constrained(zset)
  local skipped = 0  -- the entries left in place sit first: the next read starts after them
  while #claimed < want and not full do
    if skipped >= SKIP then blocked = 1; return end
    local batch = redis.call('ZRANGE', zset, skipped, skipped + 63, 'WITHSCORES')
    if #batch == 0 then return end
    for i = 1, #batch, 2 do
      if #claimed >= want then return end
      local f = fetch(batch[i])
      if f[1] and f[3] == 'queued' then
        local need = fits(f[5])
        local e = need and estimate(batch[i])
        if need and not admit(e) then return end  -- full: it stays in its place
        if need then
          redis.call('ZREM', zset, batch[i])
          for name, n in pairs(need) do free[name] = (free[name] or 0) - n end
          take(batch[i], batch[i + 1], f, e)
        else
          skipped = skipped + 1
          blocked = 1
        end
      else
        redis.call('ZREM', zset, batch[i])
      end
    end
  end
end
local owners = {}
-- 'away' (gone, paused or retiring: it claims nothing now), 'busy' (as many claims as
-- threads: not about to claim its placed tasks itself) or 'free'
local function owner_state(worker)
  if owners[worker] == nil then
    local info = redis.call('HGET', KEYS[2], worker)
    local beat = redis.call('HGET', KEYS[11], worker)
    local ok, i = pcall(cmsgpack.unpack, info or '')
    local okb, b = pcall(cmsgpack.unpack, beat or '')
    local status = okb and type(b) == 'table' and b.status or 'running'
    local n = ok and type(i) == 'table' and tonumber(i.nthreads) or 1
    if not info or status ~= 'running' then
      owners[worker] = 'away'
    elseif redis.call('SCARD', ARGV[4] .. 'worker:' .. worker .. ':processing') >= n then
      owners[worker] = 'busy'
    else
      owners[worker] = 'free'
    end
  end
  return owners[worker]
end
local now_ms = nil
local function clock()  -- Redis's own clock (ms): no two hosts' clocks compared
  if not now_ms then
    local t = redis.call('TIME')
    now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return now_ms
end
local function overdue(key)  -- passed over for PLACED_PATIENCE_MS: its worker does not
  local tkey = ARGV[3] .. key  -- claim it (stopped, cut off from Redis, stuck)
  local since = tonumber(redis.call('HGET', tkey, 'passed_over') or '')
  if not since then
    redis.call('HSET', tkey, 'passed_over', clock())
    return false
  end
  return clock() - since >= PLACED_PATIENCE_MS
end
local passed_over = false  -- placed tasks left for their worker, for now
local function claim_placed()
  local skipped = 0
  while #claimed < want and skipped < SKIP and not full do
    local batch = redis.call('ZRANGE', KEYS[10], skipped, skipped + 63, 'WITHSCORES')
    if #batch == 0 then return end
    for i = 1, #batch, 2 do
      if #claimed >= want then return end
      local key = batch[i]
      local f = fetch(key)
      local owner = string.match(f[4] or '', '%S+')
      local anywhere = (f[5] or '') == ''
        and (redis.call('HGET', ARGV[3] .. key, 'workers') or '') == ''
      if not (f[1] and f[3] == 'queued' and owner and anywhere) then
        redis.call('ZREM', KEYS[10], key)  -- stale
      elseif owner == ARGV[1] or owner_state(owner) == 'away'
          or (owner_state(owner) == 'busy' and f[7] ~= '1') or overdue(key) then
        local e = estimate(key)
        if not admit(e) then return end  -- full: it stays in its place
        redis.call('ZREM', ARGV[4] .. 'worker:' .. owner .. ':ready', key)
        take(key, batch[i + 1], f, e)
      else
        skipped = skipped + 1
        passed_over = true
      end
    end
  end
end
claim_from(KEYS[6])
claim_constrained(KEYS[8])
claim_from(KEYS[1])
claim_placed()
if (full or #claimed >= want) and redis.call('EXISTS', KEYS[6]) == 1
    and redis.call('EXISTS', KEYS[10]) == 1 then
  last_id = redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[9], '*', 'n', 0)
end
local id = ''
if #claimed > 0 then
  redis.call('SADD', KEYS[3], unpack(claimed))
  id = redis.call('XADD', KEYS[4], '*', 'm',
    cmsgpack.pack({{op = 'claimed', worker = ARGV[1], keys = claimed, scores = scores}}))
  for _, key in ipairs(claimed) do
    redis.call('HSET', ARGV[3] .. key, 'state', 'processing', 'worker', ARGV[1], 'claim', id)
  end
end
if full then blocked = blocked + 2 end
if passed_over then blocked = blocked + 4 end
return {out, last_id, redis.call('XRANGE', KEYS[7], '(' .. ARGV[5], '+'), blocked, id}
"""
)


# A worker's reports (THROUGH's opening: KEYS[1], its ``alive`` key, renewed for ARGV[1]
# ms, so they get through a full Redis), and the **chained claim** of the dependents its
# finished tasks free (docs/design.md, "Chains"), in one atomic step.  KEYS: the worker's
# alive key, the workers stream, the worker's processing set, its inbox, the durations
# hash, the workers hash, the clients hash.  ARGV: the alive TTL (ms), the worker's
# address, the task key prefix, the last inbox id the worker read, how many tasks it may
# claim (0: none), the number of reports, the reports (each a msgpack map, concatenated:
# the body of a msgpack array), how many links deeper it may claim (below), the claim
# horizon, the prefix of the clients' keys (``rd:{c}:client:``), the number E of early
# news, E triples (below), then the keys of the tasks whose ``task-finished`` is among
# them.
# **Early news** (docs/design.md, "Push"): each triple is a pushed task's key, the score
# of its run and the worker's ``key-in-memory`` message for it (a small result), packed
# as the client's entry is, a list of that one message, but for the message's last
# key/value pair, ``seen``, which is appended here.  If its record says the
# task is still processing on this worker, for that run, and names in ``notify`` the
# clients that wanted it when it was pushed (msgpack {client: generation}), each of
# those clients still registered (KEYS[7]: a client gone since has its events stream
# deleted, which an XADD would make again, for good) gets the news at once (the 7th
# pair: ``seen``, that generation), and the
# entry says so to the scheduler (a ``told`` message, after the claim), which then does
# not send it again: the result reaches the client with no scheduler hop.  A finished
# task whose record says it is processing on this worker (the claim still holds) may
# name in its ``chain`` field (msgpack list, written by the scheduler) the dependents
# that wait on it alone; each one still ``waiting``, with no ``workers`` nor ``resources``,
# whose other dependencies are in memory, inline (``value``) or held by this worker, is
# claimed here as CLAIM claims: processing, in the processing set, ``claim`` naming the
# entry.  A task claimed here may bring one of its own chain along (its dependencies then
# include it), and so on, ARGV[8] such links at most, while their estimates (durations)
# add up to at most ARGV[9] seconds (the claim horizon) with everything claimed here
# (none: no deeper link): a chain of small tasks runs here link after link with no
# round trip between them, and the worker holds no more than its claim budget allows.
# The entry is one XADD whose ``m`` is [claimed (with
# ``chained``), told, reports...]: the scheduler reads the claim and the results it follows in
# one batch, the claim first (it accepts a chained claim only from the worker the
# unfinished dependencies are processing on, and takes back the links chained on a task
# that does not finish there).  Returns {tasks (as CLAIM's), inbox entries after ARGV[4] (only
# with a claim: the worker applies them first, as CLAIM's), the entry's id ('' without a
# claim)}.
FINISH = (
    KEY_PREFIX_LUA
    + """
redis.call('PEXPIRE', KEYS[1], ARGV[1])
local me, prefix = ARGV[2], ARGV[3]
local want, deep_left = tonumber(ARGV[5]), tonumber(ARGV[8])
local horizon = tonumber(ARGV[9]) or 0
local spent = 0  -- the estimated run time of what this call claimed so far (seconds)
local out, claimed, scores = {}, {}, {}
local early = tonumber(ARGV[11])
local first_finished = 12 + 3 * early
if want > 0 and redis.call('HEXISTS', KEYS[6], me) == 1 then
  local done, queue = {}, {}  -- queue: {chain, deep}: the chains to look at, in order
  for i = first_finished, #ARGV do
    local f = redis.call('HMGET', prefix .. ARGV[i], 'state', 'worker', 'chain')
    if f[1] == 'processing' and f[2] == me then
      done[ARGV[i]] = true
      if f[3] then queue[#queue + 1] = {f[3], false} end
    end
  end
  local seen, first = {}, 0
  local function held(dep)  -- {dep, who_has, nbytes, score[, value]} if this worker can have it
    if done[dep] then return {dep, '', '0', ''} end
    local d = redis.call('HMGET', prefix .. dep, 'state', 'who_has', 'nbytes', 'value', 'score')
    if d[1] ~= 'memory' then return nil end
    if string.find(' ' .. (d[2] or '') .. ' ', ' ' .. me .. ' ', 1, true) then
      return {dep, d[2], d[3] or '0', d[5] or ''}  -- (held here: a value in Redis stays there)
    end
    if d[4] and d[4] ~= '' then return {dep, d[2] or '', d[3] or '0', d[5] or '', d[4]} end
    return nil
  end
  local function take(key, deep)  -- claims ``key`` if it may run here: its record, or nil
    local tkey = prefix .. key
    local e = tonumber(redis.call('HGET', KEYS[5], key_prefix(key)) or '')
    if deep and not (e and spent + e <= horizon) then return nil end  -- (the budget)
    local f = redis.call('HMGET', tkey, 'spec', 'deps', 'state', 'workers', 'resources',
                         'score', 'chain')
    if not (f[1] and f[3] == 'waiting' and (f[4] or '') == '' and (f[5] or '') == '') then
      return nil
    end
    local deps = {}
    for _, dep in ipairs(cmsgpack.unpack(f[2] or '\\144')) do
      local d = held(dep)
      if not d then return nil end
      deps[#deps + 1] = d
    end
    redis.call('HSET', tkey, 'state', 'processing', 'worker', me)
    redis.call('SADD', KEYS[3], key)
    spent = spent + (e or math.huge)
    out[#out + 1] = {key, f[1], f[6] or '0', deps, '', e and tostring(e) or '',
                     (f[7] and f[7] ~= '') and '1' or ''}
    claimed[#claimed + 1] = key
    scores[#scores + 1] = f[6] or '0'
    done[key] = true  -- (what waits on it alone may follow it here)
    return f
  end
  local qi = 1
  while qi <= #queue do
    local chain, deep = queue[qi][1], queue[qi][2]
    qi = qi + 1
    local ok_list, keys = pcall(cmsgpack.unpack, chain)
    if not ok_list or type(keys) ~= 'table' then keys = {} end
    for _, key in ipairs(keys) do
      if (deep and deep_left <= 0) or (not deep and first >= want) then break end
      if type(key) == 'string' and not seen[key] then
        seen[key] = true
        local f = take(key, deep)
        if f then
          if deep then deep_left = deep_left - 1 else first = first + 1 end
          if f[7] then queue[#queue + 1] = {f[7], true} end
          if deep then break end  -- one link further per link claimed here
        end
      end
    end
  end
end
local n = tonumber(ARGV[6])
local body = ARGV[7]
local told, told_scores = {}, {}
for j = 0, early - 1 do
  local key, score, news = ARGV[12 + 3 * j], ARGV[13 + 3 * j], ARGV[14 + 3 * j]
  local f = redis.call('HMGET', prefix .. key, 'state', 'worker', 'score', 'notify')
  local ok, who = pcall(cmsgpack.unpack, f[4] or '')
  local same_run = tonumber(f[3] or '') == tonumber(score)  -- (written as %.17g or repr)
  if f[1] == 'processing' and f[2] == me and same_run and ok and type(who) == 'table' then
    for client, seen in pairs(who) do  -- news: [{the worker's pairs..., seen = seen}]
      if type(client) == 'string' and type(seen) == 'number'
         and redis.call('HEXISTS', KEYS[7], client) == 1 then
        redis.call('XADD', ARGV[10] .. client .. ':events', '*', 'm',
                   news .. cmsgpack.pack('seen') .. cmsgpack.pack(seen))
      end
    end
    told[#told + 1] = key
    told_scores[#told_scores + 1] = tonumber(score)
  end
end
if #told > 0 then
  n = n + 1
  body = cmsgpack.pack({op = 'told', worker = me, keys = told, scores = told_scores}) .. body
end
if #claimed > 0 then
  n = n + 1
  body = cmsgpack.pack({op = 'claimed', worker = me, keys = claimed, scores = scores,
                        chained = true}) .. body
end
local header
if n < 16 then
  header = string.char(144 + n)
elseif n < 65536 then
  header = string.char(220, math.floor(n / 256), n % 256)
else
  header = string.char(221, math.floor(n / 16777216) % 256, math.floor(n / 65536) % 256,
                       math.floor(n / 256) % 256, n % 256)
end
local id = redis.call('XADD', KEYS[2], '*', 'm', header .. body)
if #claimed == 0 then return {out, {}, ''} end
for _, key in ipairs(claimed) do redis.call('HSET', prefix .. key, 'claim', id) end
return {out, redis.call('XRANGE', KEYS[4], '(' .. ARGV[4], '+'), id}
"""
)


# One page of the task records, for ``load_state``: SSCAN of the tasks set from cursor
# ARGV[1] (COUNT ARGV[2]), and each member's hash (the task prefix ARGV[3] + the key)
# without what a reloading scheduler never reads: ``spec`` becomes '' (present: the task
# has its graph history; absent stays absent) and ``value`` (a small result) is left out.
# KEYS: the tasks set.  Returns {next cursor, {{key, field, value, ...}, ...}}.  A page
# of a few thousand hashes takes milliseconds: no other command waits long (BUSY).
LOAD_TASKS = """
local page = redis.call('SSCAN', KEYS[1], ARGV[1], 'COUNT', tonumber(ARGV[2]))
local out = {}
for _, key in ipairs(page[2]) do
  local fields = redis.pcall('HGETALL', ARGV[3] .. key)
  local row = {key}
  if fields.err then  -- a key of another type: {key, its type}, for the loader to quarantine
    row[2] = redis.call('TYPE', ARGV[3] .. key).ok
    fields = {}
  end
  for i = 1, #fields, 2 do
    local name = fields[i]
    if name == 'spec' then
      row[#row + 1] = name
      row[#row + 1] = ''
    elseif name ~= 'value' then
      row[#row + 1] = name
      row[#row + 1] = fields[i + 1]
    end
  end
  out[#out + 1] = row
end
return {page[1], out}
"""


# Writes that must get through a full Redis (docs/design.md, "A full Redis"): under
# ``noeviction`` Redis refuses a script's first write of a command that may add memory
# (``denyoom``: SET, XADD, HSET) and lets every later one through, since it cannot stop a
# script half-way (Redis 6.2 and 7.x alike).  So a write that frees memory or moves
# admitted work forward (the scheduler's batches and lease, heartbeats, a worker's
# reports, a client's releases) opens with one that Redis allows when full: a PEXPIRE of
# the caller's own key that holds that TTL anyway (its ``alive`` key, the lease).  Then
# ARGV[2], a msgpack list of commands, runs.  KEYS[1]: that key; ARGV[1]: its TTL in ms,
# or '' for a key without a TTL (a stream), which is PERSISTed instead (a no-op).
# A MULTI/EXEC cannot do this: a full Redis refuses every command queued in one.
THROUGH = """
if ARGV[1] == '' then
  redis.call('PERSIST', KEYS[1])
else
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
end
local commands = cmsgpack.unpack(ARGV[2])
for i = 1, #commands do redis.call(unpack(commands[i])) end
return #commands
"""


# A client's writes to the clients stream, numbered.  KEYS: the clients stream, the
# client's count of entries written (``Keys.client_written``: "<count> <token>").  ARGV:
# the count the client believes Redis holds, the call's token, then each entry's ``m``
# field.  Writes only when Redis holds that count.  A smaller one: Redis lost entries
# the client wrote (a failover to a replica they had not reached, an AOF's last second),
# which the client writes again first; a larger one: a write the client gave up on had
# landed.  A call made again after its reply was lost (same token) is not written twice.
# Returns {the count after the call, 1 if this call's entries are written} (a call
# without entries only reads).  A KEYS[3] (the clients stream again) marks a write of
# releases only, which frees memory: it opens with a PERSIST of that stream (no TTL; a
# write a full Redis allows), so that it gets through a full Redis (see THROUGH).
WRITE_ENTRIES = """
if KEYS[3] then redis.call('PERSIST', KEYS[3]) end
local held, last = 0, ''
local stored = redis.call('GET', KEYS[2])
if stored then
  local count, token = string.match(stored, '^(%d+) ?(.*)$')
  held, last = tonumber(count) or 0, token or ''
end
local n = #ARGV - 2
if n > 0 and last == ARGV[2] and held == tonumber(ARGV[1]) + n then return {held, 1} end
if held ~= tonumber(ARGV[1]) or n == 0 then return {held, 0} end
for i = 3, #ARGV do
  redis.call('XADD', KEYS[1], '*', 'm', ARGV[i])
end
redis.call('SET', KEYS[2], string.format('%d %s', held + n, ARGV[2]))
return {held + n, 1}
"""


class Scripts:
    """The cluster's Lua scripts, registered on one Redis client (EVALSHA, reloaded on
    NOSCRIPT by redis-py's ``Script``), called with named parameters: each method puts
    them in the KEYS/ARGV order its script above reads.  With an asyncio client each
    method returns an awaitable.  Redis >= 6.2; no Redis 7 Functions."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.keys = keys
        self._apply_fenced: Script = client.register_script(APPLY_FENCED)
        self._acquire_lease: Script = client.register_script(ACQUIRE_LEASE)
        self._claim: Script = client.register_script(CLAIM)
        self._load_tasks: Script = client.register_script(LOAD_TASKS)
        self._through: Script = client.register_script(THROUGH)
        self._finish: Script = client.register_script(FINISH)

    def apply_fenced(
        self,
        *,
        token: str | None,
        commands: list[list[Any]],
        ttl_ms: int,
        part: tuple[int, int] = (1, 1),
        client: Any = None,
    ) -> Any:
        """Run ``commands`` (each a list of arguments) atomically if the lease is held
        with ``token``, renewing it for ``ttl_ms``; raises ``ResponseError`` ``FENCED``.
        ``part`` (number, of how many) and ``client`` (a MULTI/EXEC pipeline): one part
        of a write cut in several (see ``APPLY_FENCED``)."""
        keys = [self.keys.lease, self.keys.lease_token, self.keys.applying, self.keys.leader]
        args = [token or "", pack_for_lua(commands), ttl_ms, *part]
        return self._apply_fenced(keys=keys, args=args, client=client)

    def apply_fenced_command(
        self, *, token: str | None, commands: list[list[Any]], ttl_ms: int
    ) -> list[Any]:
        """The ``EVALSHA`` of ``apply_fenced`` (one part) as a command to send by hand, for
        a write sent without waiting for its reply (``redisdask/scheduler/pipe.py``).  It
        fails ``NOSCRIPT`` where Redis lost the script: the caller sends it again through
        ``apply_fenced``, which loads it."""
        keys = [self.keys.lease, self.keys.lease_token, self.keys.applying, self.keys.leader]
        args = [token or "", pack_for_lua(commands), ttl_ms, 1, 1]
        return ["EVALSHA", self._apply_fenced.sha, len(keys), *keys, *args]

    def load_apply_fenced(self) -> None:
        """``SCRIPT LOAD`` ``APPLY_FENCED``, for ``apply_fenced_command`` on a connection
        to a server that may not hold it yet."""
        self._apply_fenced.registered_client.script_load(APPLY_FENCED)

    def through(
        self, *, key: str, ttl_ms: int | None, commands: list[list[Any]], client: Any = None
    ) -> Any:
        """Run ``commands`` in one script that gets through a full Redis (``THROUGH``),
        opened by renewing ``key`` (the caller's own, which holds that TTL anyway) for
        ``ttl_ms``, or (None) by a PERSIST of a key without a TTL.  ``client``: a
        pipeline to queue it on."""
        args = ["" if ttl_ms is None else ttl_ms, pack_for_lua(commands)]
        return self._through(keys=[key], args=args, client=client)

    def acquire_lease(
        self, *, token: str | None, ttl_ms: int, connection: str = "", gone: str = ""
    ) -> Any:
        """Renew the lease held with ``token``, or take it with a new token if it is free
        or held by ``gone`` (``token`` None asks for a new one); returns the token held,
        or None.  ``connection``: the name of the caller's Redis connection."""
        keys = [self.keys.lease, self.keys.lease_token, self.keys.scheduler, self.keys.leader]
        args = [token or "", ttl_ms, connection, gone, secrets.token_hex(4)]
        return self._acquire_lease(keys=keys, args=args)

    def load_tasks(self, *, cursor: int | bytes, count: int) -> Any:
        """One page of the task records from ``cursor`` (0: the first); returns
        ``[next cursor (b"0": done), [[key, field, value, ...], ...]]`` (see
        ``LOAD_TASKS``)."""
        return self._load_tasks(keys=[self.keys.tasks], args=[cursor, count, self.keys.task_prefix])

    def claim(
        self,
        *,
        worker: str,
        count: int,
        last_inbox_id: str,
        free: str = "",
        horizon: float | None = None,
        starts: Sequence[float] = (),
    ) -> Any:
        """Claim up to ``count`` queued tasks for ``worker``, those with resources only
        within ``free`` (``placement.format_resources`` of what the worker has free), and
        with a ``horizon``, only those that start within it on the threads free at
        ``starts`` (``durations.start_times``); returns ``[tasks, last ready-signal id,
        the inbox entries after last_inbox_id, flags, the claim's entry id]`` (see
        ``CLAIM``)."""
        k = self.keys
        budget = ["", ""] if horizon is None else [repr(horizon), " ".join(map(repr, starts))]
        return self._claim(
            keys=[k.ready, k.workers, k.worker_processing(worker), k.worker_stream,
                  k.ready_signal, k.worker_ready(worker), k.worker_inbox(worker),
                  k.worker_constrained(worker), k.durations, k.placed, k.heartbeats],
            args=[worker, count, k.task_prefix, k.prefix, last_inbox_id, free, *budget,
                  READY_SIGNAL_MAXLEN],
        )  # fmt: skip

    def finish(
        self,
        *,
        worker: str,
        ttl_ms: int,
        reports: Sequence[bytes],
        finished: Sequence[str],
        chain: int,
        last_inbox_id: str,
        deeper: int = 0,
        horizon: float = 0.0,
        early: Sequence[tuple[str, float, bytes]] = (),
    ) -> Any:
        """XADD ``reports`` (each packed alone) as one entry of the workers stream, with
        the ``early`` news of pushed tasks' results (key, score, news: see ``FINISH``),
        and
        claim for ``worker`` up to ``chain`` dependents that the ``finished`` tasks free,
        and up to ``deeper`` links that wait on those alone, of known estimates that add
        up to at most ``horizon`` seconds (see ``FINISH``); returns
        ``[tasks, inbox entries, the claim's entry id]`` (as ``claim``'s)."""
        k = self.keys
        return self._finish(
            keys=[k.worker_alive(worker), k.worker_stream, k.worker_processing(worker),
                  k.worker_inbox(worker), k.durations, k.workers, k.clients],
            args=[ttl_ms, worker, k.task_prefix, last_inbox_id, chain, len(reports),
                  b"".join(reports), deeper, horizon, k.prefix + "client:", len(early),
                  *(x for news in early for x in news), *finished],
        )  # fmt: skip


# --------------------------------------------------------------------------- cluster
