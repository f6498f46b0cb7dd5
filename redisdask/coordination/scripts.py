"""The coordination primitives' Lua scripts, beside the primitives that call them, and
``CoordinationScripts``, which registers them on a Redis client (issue 25: each concern
with its own code; the core scripts, which the scheduler, workers and clients share, stay
in ``redisdask/store/scripts.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
from redis.commands.core import Script

from redisdask.store.codecs import pack_for_lua
from redisdask.store.keyspace import Keys

# The coordination primitives (``redisdask/coordination``) keep their whole state in Redis,
# changed only by the scripts below, so they need no scheduler and survive one's restart:
#
#     rd:{c}:lock:<name>            hash    max -> 1, lease id -> expiry (ms, Redis TIME)
#     rd:{c}:semaphore:<name>       hash    max -> max_leases, lease id -> expiry
#     rd:{c}:event:<name>           string  present while the event is set
#     rd:{c}:variable:<name>        hash    data (pickle), keys (its futures), epoch
#     rd:{c}:queue:<name>           list    items: msgpack [epoch, keys, data]
#     rd:{c}:queue-refs:<name>      hash    "<epoch>:<key>" -> items holding that future
#     rd:{c}:datasets               hash    name -> msgpack [epoch, keys, data, name pickle]
#     rd:{c}:multilock:<name>       list    MultiLock requests (ids) for that lock, in
#                                           arrival order: the first holds it
#     rd:{c}:multilock-requests     hash    request id -> msgpack [locks still needed, names
#                                           of the queues it is in]
#     rd:{c}:multilock-leases       zset    request id -> when it lapses (ms): its lease once
#                                           it holds, its word while it waits
#     rd:{c}:waiters:<kind>:<name>  zset    who blocks on a primitive, scored by when
#                                           their word lapses (ms)
#     rd:{c}:signal:<kind>:<name>   stream  one entry, added at each change while anyone
#                                           waits: waiters XREAD BLOCK on it (a
#                                           MultiLock's: signal:multilock:<request id>,
#                                           when that request holds all it needs)
#
# Each key is deleted as soon as it means nothing (no lease, event clear, queue empty,
# nobody waiting); a lease, a waiter's word and the keys kept for it also lapse on
# their own, so a process killed with -9 leaves nothing behind for long.  Futures inside
# values are held by holders (``holder:<kind>:<name>``): the scripts send the scheduler
# ``client-desires-keys`` and ``client-releases-keys`` on the clients stream in the same
# atomic step as the change, so a key is never unwanted in between, and a getter's own
# want is asked for before the holder lets go.  ``epoch`` is ``meta.restarts`` at the
# write: a future recorded before a ``Client.restart`` is gone.

_COORDINATION_PRELUDE = """
if redis.replicate_commands then redis.replicate_commands() end  -- Redis 6.2: TIME, then writes
local t = redis.call('TIME')
local NOW = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function ms(x) return string.format('%d', x) end
local function epoch(meta) return redis.call('HGET', meta, 'restarts') or '0' end
local function latest_waiter(waiters)  -- when the last waiter's word lapses, or nil
  redis.call('ZREMRANGEBYSCORE', waiters, '-inf', NOW)
  local last = redis.call('ZRANGE', waiters, -1, -1, 'WITHSCORES')
  if #last == 0 then return nil end
  return last[2]
end
local function wake(waiters, signal)  -- the state changed: tell whoever waits
  local until_ = latest_waiter(waiters)
  if until_ then
    redis.call('XADD', signal, 'MAXLEN', 1, '*', 'n', 1)
    redis.call('PEXPIREAT', signal, until_)
  else
    redis.call('DEL', signal)
  end
end
local function stop_waiting(waiters, signal, id)
  if redis.call('ZREM', waiters, id) == 1 and not latest_waiter(waiters) then
    redis.call('DEL', signal)
  end
end
local function wait_or_stop(waiters, signal, id, wait)  -- a failed attempt: the id to block
  if wait <= 0 then                                     -- from, or '' (no more waiting)
    stop_waiting(waiters, signal, id)
    return ''
  end
  redis.call('ZADD', waiters, ms(NOW + wait), id)
  local until_ = latest_waiter(waiters)
  redis.call('PEXPIREAT', waiters, until_)
  local top = redis.call('XREVRANGE', signal, '+', '-', 'COUNT', 1)
  if #top == 0 then return '0-0' end
  redis.call('PEXPIREAT', signal, until_)
  return top[1][1]
end
local function tell(stream, msgs)  -- messages for the scheduler, as a client sends them
  if #msgs > 0 then redis.call('XADD', stream, '*', 'm', cmsgpack.pack(msgs)) end
end
local function wants(op, client, keys, msgs)
  if #keys > 0 then msgs[#msgs + 1] = {op = op, client = client, keys = keys} end
end
local function leases(state)  -- the live leases (expired ones are deleted)
  local fields = redis.call('HGETALL', state)
  local out = {count = 0, latest = 0}
  for i = 1, #fields, 2 do
    local field, value = fields[i], tonumber(fields[i + 1])
    if field == 'max' then out.max = value
    elseif value <= NOW then redis.call('HDEL', state, field); out.expired = true
    else
      out.count = out.count + 1
      if not out.soonest or value < out.soonest then out.soonest = value end
      if value > out.latest then out.latest = value end
    end
  end
  return out
end
local function minus(keys, kept)  -- keys not in kept
  local keep, out = {}, {}
  for _, k in ipairs(kept) do keep[k] = true end
  for _, k in ipairs(keys) do if not keep[k] then out[#out + 1] = k end end
  return out
end
"""

# KEYS: state, waiters, signal.  ARGV: waiter, wait ms, lease id, max leases, lease ms.
# Returns {1} (acquired) or {0, signal id to block from, ms until the next lease lapses}.
SEMAPHORE_ACQUIRE = """
local l = leases(KEYS[1])
local max = tonumber(ARGV[4])
if l.max and l.max ~= max and l.count > 0 then
  return redis.error_reply('INCONSISTENT max_leases is ' .. l.max)
end
if l.count < max then
  local expiry = NOW + tonumber(ARGV[5])
  redis.call('HSET', KEYS[1], 'max', ARGV[4], ARGV[3], ms(expiry))
  redis.call('PEXPIREAT', KEYS[1], ms(math.max(l.latest, expiry)))
  stop_waiting(KEYS[2], KEYS[3], ARGV[1])
  if l.expired and l.count + 1 < max then wake(KEYS[2], KEYS[3]) end
  return {1}
end
return {0, wait_or_stop(KEYS[2], KEYS[3], ARGV[1], tonumber(ARGV[2])), ms(l.soonest - NOW)}
"""

# KEYS: state, waiters, signal.  ARGV: lease id.  Returns 1, or 0 if it was not held.
SEMAPHORE_RELEASE = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
if leases(KEYS[1]).count == 0 then redis.call('DEL', KEYS[1]) end
wake(KEYS[2], KEYS[3])
return 1
"""

# KEYS: state.  ARGV: lease ms, lease ids.  Returns the ids no longer held.
SEMAPHORE_RENEW = """
local lost = {}
for i = 2, #ARGV do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then
    redis.call('HSET', KEYS[1], ARGV[i], ms(NOW + tonumber(ARGV[1])))
  else
    lost[#lost + 1] = ARGV[i]
  end
end
local l = leases(KEYS[1])
if l.count > 0 then redis.call('PEXPIREAT', KEYS[1], ms(l.latest)) end
return lost
"""

# KEYS: state.  Returns how many leases are held.
SEMAPHORE_COUNT = """
local l = leases(KEYS[1])
if l.count == 0 then redis.call('DEL', KEYS[1]) end
return l.count
"""

# KEYS: state, waiters, signal.  Deletes the primitive and wakes its waiters.
COORDINATION_CLOSE = """
redis.call('DEL', KEYS[1])
wake(KEYS[2], KEYS[3])
return 1
"""

# MultiLock (distributed's queues, in Redis): a request joins the queue of each of its
# names, the shortest first, until it heads ``num_locks`` of them; heading a queue is
# holding that lock, so a waiter holds what it heads while it waits for the rest (as
# distributed's, whose fairness this is: nobody overtakes an earlier request).  Leaving
# (release, giving up, lapsing) hands each lock it headed to the next in that queue;
# a request that needs no more is told on its own signal stream.  Every script first
# takes out the requests that lapsed (a holder or waiter that died).
# KEYS: requests, leases.  ARGV[1], ARGV[2]: the prefixes of the queues and signals.
_MULTILOCK_PRELUDE = """
local REQ, LEASES, QUEUE, SIGNAL = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
local function record(id)  -- {locks still needed, names...}, or nil
  local raw = redis.call('HGET', REQ, id)
  if raw then return cmsgpack.unpack(raw) end
end
local function promote(q, ready)  -- the head of queue q holds that lock now
  while true do
    local head = redis.call('LINDEX', q, 0)
    if not head then return end
    local r = record(head)
    if r then
      if r[1] > 0 then
        r[1] = r[1] - 1
        redis.call('HSET', REQ, head, cmsgpack.pack(r))
        if r[1] == 0 then ready[#ready + 1] = head end
      end
      return
    end
    redis.call('LPOP', q)  -- gone with its record: skip it
  end
end
local function retain(id, ready)  -- take the request out of every queue it is in
  local rec = record(id)
  redis.call('HDEL', REQ, id)
  redis.call('ZREM', LEASES, id)
  redis.call('DEL', SIGNAL .. id)
  if not rec then return end
  for i = 2, #rec do
    local q = QUEUE .. rec[i]
    if redis.call('LINDEX', q, 0) == id then
      redis.call('LPOP', q)
      promote(q, ready)
    else
      redis.call('LREM', q, 0, id)
    end
  end
end
local function purge(ready)  -- requests whose holder or waiter died
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', LEASES, '-inf', NOW)) do retain(id, ready) end
end
local function tell_ready(ready, except)  -- wake the requests that hold all they need
  for _, id in ipairs(ready) do
    local until_ = redis.call('ZSCORE', LEASES, id)
    if until_ and id ~= except then
      redis.call('XADD', SIGNAL .. id, 'MAXLEN', 1, '*', 'n', 1)
      redis.call('PEXPIREAT', SIGNAL .. id, until_)
    end
  end
end
local function touch(names)  -- the keys live as long as the last lease or word
  local last = redis.call('ZRANGE', LEASES, -1, -1, 'WITHSCORES')
  if #last == 0 then return end
  redis.call('PEXPIREAT', REQ, last[2])
  redis.call('PEXPIREAT', LEASES, last[2])
  for _, n in ipairs(names) do redis.call('PEXPIREAT', QUEUE .. n, last[2]) end
end
local function request(id, need, names)  -- join the queues, shortest first, until need held
  local order = {}
  for i, n in ipairs(names) do order[i] = {redis.call('LLEN', QUEUE .. n), i, n} end
  table.sort(order, function(a, b) return a[1] < b[1] or (a[1] == b[1] and a[2] < b[2]) end)
  local rec = {need}
  for _, o in ipairs(order) do
    redis.call('RPUSH', QUEUE .. o[3], id)
    rec[#rec + 1] = o[3]
    if o[1] == 0 then
      rec[1] = rec[1] - 1
      if rec[1] == 0 then break end
    end
  end
  redis.call('HSET', REQ, id, cmsgpack.pack(rec))
  return rec
end
"""

# ARGV: prefixes, id, fresh ('1': a new acquire: a request of this id left by an
# interrupted one starts afresh), wait ms, lease ms, num_locks, names.  Returns {1}
# (holding num_locks of them), {0, ''} (gave up) or {0, signal id to block from, ms until
# another request lapses}.
MULTILOCK_ACQUIRE = """
local id, wait, ready = ARGV[3], tonumber(ARGV[5]), {}
purge(ready)
local rec = record(id)
if rec and ARGV[4] == '1' then retain(id, ready); rec = nil end
if not rec then rec = request(id, tonumber(ARGV[7]), {unpack(ARGV, 8)}) end
local names = {unpack(rec, 2)}
if rec[1] == 0 then
  redis.call('ZADD', LEASES, ms(NOW + tonumber(ARGV[6])), id)
  redis.call('DEL', SIGNAL .. id)
  tell_ready(ready, id)
  touch(names)
  return {1}
end
if wait <= 0 then
  retain(id, ready)
  tell_ready(ready, id)
  return {0, ''}
end
redis.call('ZADD', LEASES, ms(NOW + wait), id)
tell_ready(ready, id)
touch(names)
local top = redis.call('XREVRANGE', SIGNAL .. id, '+', '-', 'COUNT', 1)
local first = redis.call('ZRANGE', LEASES, 0, 1, 'WITHSCORES')
for i = 1, #first, 2 do
  if first[i] ~= id then return {0, top[1] and top[1][1] or '0-0', ms(first[i + 1] - NOW)} end
end
return {0, top[1] and top[1][1] or '0-0'}
"""

# ARGV: prefixes, id.  Returns 1, or 0 if it held nothing (its lease had lapsed).
MULTILOCK_RELEASE = """
local ready = {}
purge(ready)
local rec = record(ARGV[3])
if rec then retain(ARGV[3], ready) end
tell_ready(ready)
return (rec and rec[1] == 0) and 1 or 0
"""

# ARGV: prefixes, id, lease ms.  Returns 1, or 0 if it holds nothing (its lease lapsed).
MULTILOCK_RENEW = """
local ready = {}
purge(ready)
tell_ready(ready)
local rec = record(ARGV[3])
if not rec or rec[1] ~= 0 then return 0 end
redis.call('ZADD', LEASES, ms(NOW + tonumber(ARGV[4])), ARGV[3])
touch({unpack(rec, 2)})
return 1
"""

# KEYS: state, waiters, signal.
EVENT_SET = """
redis.call('SET', KEYS[1], '1')
wake(KEYS[2], KEYS[3])
return 1
"""

# KEYS: state, waiters, signal.  ARGV: waiter, wait ms.  Returns {1} or {0, signal id}.
EVENT_WAIT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  stop_waiting(KEYS[2], KEYS[3], ARGV[1])
  return {1}
end
return {0, wait_or_stop(KEYS[2], KEYS[3], ARGV[1], tonumber(ARGV[2]))}
"""

# KEYS: state, waiters, signal, clients stream, meta.  ARGV: holder, data, keys (msgpack).
VARIABLE_SET = """
local old = redis.call('HMGET', KEYS[1], 'keys', 'epoch')
local current = epoch(KEYS[5])
local new = cmsgpack.unpack(ARGV[3])
redis.call('HSET', KEYS[1], 'data', ARGV[2], 'keys', ARGV[3], 'epoch', current)
local msgs = {}
wants('client-desires-keys', ARGV[1], new, msgs)
if old[1] and old[2] == current then
  wants('client-releases-keys', ARGV[1], minus(cmsgpack.unpack(old[1]), new), msgs)
end
tell(KEYS[4], msgs)
wake(KEYS[2], KEYS[3])
return 1
"""

# KEYS: state, waiters, signal, clients stream, meta.  ARGV: waiter, wait ms, client.
# Returns {1, data, keys, epoch, current epoch} or {0, signal id}.
VARIABLE_GET = """
local rec = redis.call('HMGET', KEYS[1], 'data', 'keys', 'epoch')
if not rec[1] then return {0, wait_or_stop(KEYS[2], KEYS[3], ARGV[1], tonumber(ARGV[2]))} end
stop_waiting(KEYS[2], KEYS[3], ARGV[1])
local keys, current = cmsgpack.unpack(rec[2]), epoch(KEYS[5])
if #keys > 0 and ARGV[3] == '' then return redis.error_reply('NEEDS_CLIENT') end
if rec[3] == current then
  local msgs = {}
  wants('client-desires-keys', ARGV[3], keys, msgs)
  tell(KEYS[4], msgs)
end
return {1, rec[1], rec[2], rec[3], current}
"""

# KEYS: state, clients stream, meta.  ARGV: holder.  Returns 1, or 0 if it was not set.
VARIABLE_DELETE = """
local rec = redis.call('HMGET', KEYS[1], 'keys', 'epoch')
if not rec[1] then return 0 end
redis.call('DEL', KEYS[1])
if rec[2] == epoch(KEYS[3]) then
  local msgs = {}
  wants('client-releases-keys', ARGV[1], cmsgpack.unpack(rec[1]), msgs)
  tell(KEYS[2], msgs)
end
return 1
"""

# KEYS: queue, refs, waiters, signal, clients stream, meta.  ARGV: waiter, wait ms,
# holder, data, keys (msgpack), maxsize.  Returns {1} or {0, signal id} (full).
QUEUE_PUT = """
local maxsize = tonumber(ARGV[6])
if maxsize > 0 and redis.call('LLEN', KEYS[1]) >= maxsize then
  return {0, wait_or_stop(KEYS[3], KEYS[4], ARGV[1], tonumber(ARGV[2]))}
end
stop_waiting(KEYS[3], KEYS[4], ARGV[1])
local keys, current = cmsgpack.unpack(ARGV[5]), epoch(KEYS[6])
redis.call('RPUSH', KEYS[1], cmsgpack.pack({current, keys, ARGV[4]}))
local first = {}
for _, k in ipairs(keys) do
  if redis.call('HINCRBY', KEYS[2], current .. ':' .. k, 1) == 1 then first[#first + 1] = k end
end
local msgs = {}
wants('client-desires-keys', ARGV[3], first, msgs)
tell(KEYS[5], msgs)
wake(KEYS[3], KEYS[4])
return {1}
"""

# KEYS: queue, refs, waiters, signal, clients stream, meta.  ARGV: waiter, wait ms,
# client, holder, count (1: one item, waiting for it; 0: every item there, maybe none).
# Returns {1, current epoch, items...} or {0, signal id} (empty).
QUEUE_GET = """
local items
if ARGV[5] == '0' then
  items = redis.call('LRANGE', KEYS[1], 0, -1)
else
  items = redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[5]) - 1)
end
if #items == 0 and ARGV[5] ~= '0' then
  return {0, wait_or_stop(KEYS[3], KEYS[4], ARGV[1], tonumber(ARGV[2]))}
end
local current, records = epoch(KEYS[6]), {}
for i, item in ipairs(items) do
  records[i] = cmsgpack.unpack(item)
  if #records[i][2] > 0 and ARGV[3] == '' then return redis.error_reply('NEEDS_CLIENT') end
end
redis.call('LTRIM', KEYS[1], #items, -1)
local wanted, seen, released = {}, {}, {}
for _, rec in ipairs(records) do
  for _, k in ipairs(rec[2]) do
    local field = rec[1] .. ':' .. k
    if redis.call('HINCRBY', KEYS[2], field, -1) <= 0 then
      redis.call('HDEL', KEYS[2], field)
      if rec[1] == current then released[#released + 1] = k end
    end
    if rec[1] == current and not seen[k] then seen[k] = true; wanted[#wanted + 1] = k end
  end
end
local msgs = {}
wants('client-desires-keys', ARGV[3], wanted, msgs)
wants('client-releases-keys', ARGV[4], released, msgs)
tell(KEYS[5], msgs)
stop_waiting(KEYS[3], KEYS[4], ARGV[1])
if #items > 0 then wake(KEYS[3], KEYS[4]) end
local out = {1, current}
for _, item in ipairs(items) do out[#out + 1] = item end
return out
"""

# KEYS: datasets, clients stream, meta.  ARGV: override ('1' or '0'), then per dataset:
# name, holder, keys (msgpack), data, pickled name.  Error 'EXISTS <name>' (nothing
# written) when one exists and override is '0'.
DATASETS_PUBLISH = """
if ARGV[1] ~= '1' then
  for i = 2, #ARGV, 5 do
    if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then
      return redis.error_reply('EXISTS ' .. ARGV[i])
    end
  end
end
local current, msgs = epoch(KEYS[3]), {}
for i = 2, #ARGV, 5 do
  local keys = cmsgpack.unpack(ARGV[i + 2])
  local old = redis.call('HGET', KEYS[1], ARGV[i])
  redis.call('HSET', KEYS[1], ARGV[i], cmsgpack.pack({current, keys, ARGV[i + 3], ARGV[i + 4]}))
  wants('client-desires-keys', ARGV[i + 1], keys, msgs)
  if old then
    old = cmsgpack.unpack(old)
    if old[1] == current then
      wants('client-releases-keys', ARGV[i + 1], minus(old[2], keys), msgs)
    end
  end
end
tell(KEYS[2], msgs)
return 1
"""

# KEYS: datasets, clients stream, meta.  ARGV: client, names.  Returns {current epoch,
# record or false for each name}; the client's want of the futures found is sent.
DATASETS_GET = """
local current, out, wanted = epoch(KEYS[3]), {}, {}
out[1] = current
for i = 2, #ARGV do
  local raw = redis.call('HGET', KEYS[1], ARGV[i])
  out[i] = raw or false
  if raw then
    local rec = cmsgpack.unpack(raw)
    if #rec[2] > 0 and ARGV[1] == '' then return redis.error_reply('NEEDS_CLIENT') end
    if rec[1] == current then
      for _, k in ipairs(rec[2]) do wanted[#wanted + 1] = k end
    end
  end
end
local msgs = {}
wants('client-desires-keys', ARGV[1], wanted, msgs)
tell(KEYS[2], msgs)
return out
"""

# KEYS: datasets, clients stream, meta.  ARGV: per dataset: name, holder.  Returns how
# many were there.
DATASETS_UNPUBLISH = """
local current, msgs, n = epoch(KEYS[3]), {}, 0
for i = 1, #ARGV, 2 do
  local raw = redis.call('HGET', KEYS[1], ARGV[i])
  if raw then
    n = n + 1
    redis.call('HDEL', KEYS[1], ARGV[i])
    local rec = cmsgpack.unpack(raw)
    if rec[1] == current then wants('client-releases-keys', ARGV[i + 1], rec[2], msgs) end
  end
end
tell(KEYS[2], msgs)
return n
"""


class CoordinationScripts:
    """The coordination primitives' scripts (above), registered on one Redis client and
    called with named parameters.  ``kind`` is one of ``COORDINATION_KINDS``; a
    ``waiter`` is an id of the caller's own, ``wait_ms`` how long it may block before its
    next attempt (0: it gives up: its word is taken back); keys lists are msgpack'd
    here for the scripts' ``cmsgpack``."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.keys = keys

        def register(body: str) -> Script:
            return client.register_script(_COORDINATION_PRELUDE + body)

        self._acquire = register(SEMAPHORE_ACQUIRE)
        self._release = register(SEMAPHORE_RELEASE)
        self._renew = register(SEMAPHORE_RENEW)
        self._count = register(SEMAPHORE_COUNT)
        self._close = register(COORDINATION_CLOSE)
        self._event_set = register(EVENT_SET)
        self._event_wait = register(EVENT_WAIT)
        self._variable_set = register(VARIABLE_SET)
        self._variable_get = register(VARIABLE_GET)
        self._variable_delete = register(VARIABLE_DELETE)
        self._queue_put = register(QUEUE_PUT)
        self._queue_get = register(QUEUE_GET)
        self._publish = register(DATASETS_PUBLISH)
        self._get_datasets = register(DATASETS_GET)
        self._unpublish = register(DATASETS_UNPUBLISH)
        self._multilock_acquire = register(_MULTILOCK_PRELUDE + MULTILOCK_ACQUIRE)
        self._multilock_release = register(_MULTILOCK_PRELUDE + MULTILOCK_RELEASE)
        self._multilock_renew = register(_MULTILOCK_PRELUDE + MULTILOCK_RENEW)

    def _waitable(self, kind: str, name: str) -> list[str]:
        k = self.keys
        return [k.coordination(kind, name), k.waiters(kind, name), k.signal(kind, name)]

    def acquire(
        self, *, kind: str, name: str, waiter: str, wait_ms: int, lease: str, max_leases: int,
        lease_ms: int,
    ) -> Any:  # fmt: skip
        args = [waiter, wait_ms, lease, max_leases, lease_ms]
        return self._acquire(keys=self._waitable(kind, name), args=args)

    def release(self, *, kind: str, name: str, lease: str) -> Any:
        return self._release(keys=self._waitable(kind, name), args=[lease])

    def renew(self, *, kind: str, name: str, leases: Sequence[str], lease_ms: int) -> Any:
        return self._renew(keys=[self.keys.coordination(kind, name)], args=[lease_ms, *leases])

    def count_leases(self, *, kind: str, name: str) -> Any:
        return self._count(keys=[self.keys.coordination(kind, name)])

    def close(self, *, kind: str, name: str) -> Any:
        return self._close(keys=self._waitable(kind, name))

    def event_set(self, *, name: str) -> Any:
        return self._event_set(keys=self._waitable("event", name))

    def event_wait(self, *, name: str, waiter: str, wait_ms: int) -> Any:
        return self._event_wait(keys=self._waitable("event", name), args=[waiter, wait_ms])

    def _with_futures(self, kind: str, name: str) -> list[str]:
        return [*self._waitable(kind, name), self.keys.client_stream, self.keys.meta]

    def variable_set(self, *, name: str, holder: str, data: bytes, keys: list[str]) -> Any:
        args = [holder, data, pack_for_lua(keys)]
        return self._variable_set(keys=self._with_futures("variable", name), args=args)

    def variable_get(self, *, name: str, waiter: str, wait_ms: int, client: str) -> Any:
        args = [waiter, wait_ms, client]
        return self._variable_get(keys=self._with_futures("variable", name), args=args)

    def variable_delete(self, *, name: str, holder: str) -> Any:
        k = self.keys
        keys = [k.coordination("variable", name), k.client_stream, k.meta]
        return self._variable_delete(keys=keys, args=[holder])

    def _queue_keys(self, name: str) -> list[str]:
        k = self.keys
        return [k.coordination("queue", name), k.queue_refs(name), k.waiters("queue", name),
                k.signal("queue", name), k.client_stream, k.meta]  # fmt: skip

    def queue_put(
        self, *, name: str, holder: str, waiter: str, wait_ms: int, data: bytes,
        keys: list[str], maxsize: int,
    ) -> Any:  # fmt: skip
        args = [waiter, wait_ms, holder, data, pack_for_lua(keys), maxsize]
        return self._queue_put(keys=self._queue_keys(name), args=args)

    def queue_get(
        self, *, name: str, holder: str, waiter: str, wait_ms: int, client: str, count: int
    ) -> Any:
        """``count`` items, waiting for the first; 0: every item there, maybe none."""
        args = [waiter, wait_ms, client, holder, count]
        return self._queue_get(keys=self._queue_keys(name), args=args)

    def _multilock(self, id: str, *args: Any) -> dict[str, list[Any]]:
        k = self.keys
        prefixes = [k.coordination("multilock", ""), k.signal("multilock", "")]
        return {"keys": [k.multilock_requests, k.multilock_leases], "args": [*prefixes, id, *args]}

    def multilock_acquire(
        self, *, id: str, fresh: bool, wait_ms: int, lease_ms: int, num_locks: int,
        names: Sequence[str],
    ) -> Any:  # fmt: skip
        """``id`` is the ``MultiLock``'s (one request at a time), its own signal's name."""
        args = ["1" if fresh else "0", wait_ms, lease_ms, num_locks, *names]
        return self._multilock_acquire(**self._multilock(id, *args))

    def multilock_release(self, *, id: str) -> Any:
        return self._multilock_release(**self._multilock(id))

    def multilock_renew(self, *, id: str, lease_ms: int) -> Any:
        return self._multilock_renew(**self._multilock(id, lease_ms))

    def _dataset_keys(self) -> list[str]:
        return [self.keys.datasets, self.keys.client_stream, self.keys.meta]

    def publish(
        self, *, datasets: Sequence[tuple[str, str, list[str], bytes, bytes]], override: bool
    ) -> Any:
        """``datasets``: (name, holder, keys, data, pickled name) each."""
        args: list[Any] = ["1" if override else "0"]
        for name, holder, keys, data, pickled_name in datasets:
            args += [name, holder, pack_for_lua(keys), data, pickled_name]
        return self._publish(keys=self._dataset_keys(), args=args)

    def get_datasets(self, *, client: str, names: Sequence[str]) -> Any:
        return self._get_datasets(keys=self._dataset_keys(), args=[client, *names])

    def unpublish(self, *, datasets: Sequence[tuple[str, str]]) -> Any:
        """``datasets``: (name, holder) each."""
        args = [x for pair in datasets for x in pair]
        return self._unpublish(keys=self._dataset_keys(), args=args)
