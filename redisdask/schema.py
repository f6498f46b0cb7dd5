"""Every Redis key name, every Lua script and the schema version, in one place.

All keys of one cluster share the hash tag ``{<cluster>}`` so that multi-key scripts and
MULTI/EXEC stay valid on Redis Cluster, Valkey and managed Redis::

    rd:{c}:meta                        hash    schema version, secret, sequence counter
    rd:{c}:lease                       string  fencing token of the active scheduler (PX ttl)
    rd:{c}:lease-token                 string  INCR counter the tokens come from
    rd:{c}:scheduler                   hash    id, host, pid, since of the lease holder
    rd:{c}:stream:clients              stream  client -> scheduler messages (group "scheduler")
    rd:{c}:stream:workers              stream  worker -> scheduler messages (group "scheduler")
    rd:{c}:stream:dead-letter          stream  input entries that could not be decoded
    rd:{c}:events                      stream  cluster event log (capped)
    rd:{c}:deaths                      stream  one death record per worker death (capped)
    rd:{c}:story                       stream  the scheduler's task transitions (capped)
    rd:{c}:summary                     hash    task counts per prefix and state, throughput
    rd:{c}:ready                       zset    queued task keys, score = priority
    rd:{c}:ready-signal                stream  one entry per batch that queued work (capped)
    rd:{c}:tasks                       set     every task key the scheduler knows
    rd:{c}:task:<key>                  hash    one task: state, spec, deps, who_has, ...
    rd:{c}:workers                     hash    worker address -> msgpack info
    rd:{c}:heartbeats                  hash    worker address -> msgpack metrics
    rd:{c}:worker:<addr>:alive         string  present while the worker heartbeats (PX ttl)
    rd:{c}:worker:<addr>:processing    set     tasks claimed by that worker
    rd:{c}:worker:<addr>:ready         zset    queued tasks restricted to that worker
    rd:{c}:worker:<addr>:constrained   zset    queued tasks with resources it could run
    rd:{c}:worker:<addr>:inbox         stream  scheduler -> worker messages
    rd:{c}:worker:<addr>:story         stream  that worker's own story (capped; kept a
                                               while after it left)
    rd:{c}:clients                     hash    client id -> msgpack info
    rd:{c}:client:<id>:alive           string  present while the client heartbeats (PX ttl)
    rd:{c}:client:<id>:events          stream  scheduler -> client messages
    rd:{c}:client:<id>:wants           set     keys the client holds futures for

``docs/redis-schema.md`` describes who writes and who reads each key.

Stream entries carry one field, ``m``: a msgpack-encoded *list* of messages, each a map
with an ``op``.  Nothing on a stream is ever unpickled to route it; opaque pickled payloads
(task specs, exceptions) travel as msgpack ``bin`` values.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import redis
from redis.commands.core import Script

SCHEMA_VERSION = 1
SCHEDULER_GROUP = "scheduler"
SCHEDULER_CONSUMER = "scheduler"  # one consumer: only the lease holder ever reads
READY_SIGNAL_MAXLEN = 1000
STORY_CHUNK = 100  # transitions per entry of a story stream

_CLUSTER_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def validate_cluster_name(name: str) -> str:
    if not _CLUSTER_NAME.match(name):
        raise ValueError(
            f"invalid cluster name {name!r}: use 1-64 letters, digits, '.', '_' or '-' "
            "(it becomes the Redis hash tag of every key of the cluster)"
        )
    return name


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names of one cluster."""

    cluster: str

    def __post_init__(self) -> None:
        validate_cluster_name(self.cluster)

    @property
    def prefix(self) -> str:
        return f"rd:{{{self.cluster}}}:"

    @property
    def meta(self) -> str:
        return self.prefix + "meta"

    @property
    def lease(self) -> str:
        return self.prefix + "lease"

    @property
    def lease_token(self) -> str:
        return self.prefix + "lease-token"

    @property
    def scheduler(self) -> str:
        return self.prefix + "scheduler"

    @property
    def client_stream(self) -> str:
        return self.prefix + "stream:clients"

    @property
    def worker_stream(self) -> str:
        return self.prefix + "stream:workers"

    @property
    def dead_letter(self) -> str:
        return self.prefix + "stream:dead-letter"

    @property
    def events(self) -> str:
        return self.prefix + "events"

    @property
    def deaths(self) -> str:
        return self.prefix + "deaths"

    @property
    def story(self) -> str:
        return self.prefix + "story"

    @property
    def summary(self) -> str:
        return self.prefix + "summary"

    @property
    def ready(self) -> str:
        return self.prefix + "ready"

    @property
    def ready_signal(self) -> str:
        return self.prefix + "ready-signal"

    @property
    def tasks(self) -> str:
        return self.prefix + "tasks"

    @property
    def task_prefix(self) -> str:
        return self.prefix + "task:"

    def task(self, key: str) -> str:
        return self.task_prefix + key

    @property
    def workers(self) -> str:
        return self.prefix + "workers"

    @property
    def heartbeats(self) -> str:
        return self.prefix + "heartbeats"

    def worker_alive(self, address: str) -> str:
        return f"{self.prefix}worker:{address}:alive"

    def worker_processing(self, address: str) -> str:
        return f"{self.prefix}worker:{address}:processing"

    def worker_connection(self, address: str) -> str:
        """The CLIENT SETNAME of every Redis connection of that worker (not a key)."""
        return f"rd-{self.cluster}-worker-{address}"

    def worker_ready(self, address: str) -> str:
        return f"{self.prefix}worker:{address}:ready"

    def worker_constrained(self, address: str) -> str:
        return f"{self.prefix}worker:{address}:constrained"

    def worker_inbox(self, address: str) -> str:
        return f"{self.prefix}worker:{address}:inbox"

    def worker_story(self, address: str) -> str:
        return f"{self.prefix}worker:{address}:story"

    @property
    def clients(self) -> str:
        return self.prefix + "clients"

    def client_alive(self, client_id: str) -> str:
        return f"{self.prefix}client:{client_id}:alive"

    def client_events(self, client_id: str) -> str:
        return f"{self.prefix}client:{client_id}:events"

    def client_wants(self, client_id: str) -> str:
        return f"{self.prefix}client:{client_id}:wants"


# --------------------------------------------------------------------------- encoding


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def pack_for_lua(obj: Any) -> bytes:
    """msgpack for Redis's Lua ``cmsgpack``, which predates the ``bin`` type: bytes go
    as raw strings, which Lua strings are anyway."""
    return msgpack.packb(obj, use_bin_type=False)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def unpack_or(raw: bytes | None, default: Any, kind: type | None = None) -> Any:
    """``raw`` unpacked, or ``default`` when it is missing, not msgpack, or (given
    ``kind``) not of that type: readers of what anyone may have written show what they
    can instead of failing."""
    if not raw:
        return default
    try:
        value = unpack(raw)
    except (ValueError, TypeError):
        return default
    return default if kind is not None and not isinstance(value, kind) else value


def entry(messages: Sequence[dict[str, Any]]) -> dict[str, bytes]:
    """The fields of one stream entry carrying ``messages``."""
    return {"m": pack(list(messages))}


# --------------------------------------------------------------------------- scripts

# Applies a scheduler batch atomically, fenced by the lease token.  ARGV[2] is a msgpack
# list of Redis commands (each a list of arguments) computed by the scheduler driver from
# the state machine's instructions, including the XACK of the batch: effects and
# acknowledgement land together or not at all, and only while the lease is ours.
APPLY_FENCED = """
local current = redis.call('GET', KEYS[1])
if current ~= ARGV[1] then
  return redis.error_reply('FENCED lease token is ' .. tostring(current) .. ', ours is ' .. ARGV[1])
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
local commands = cmsgpack.unpack(ARGV[2])
for i = 1, #commands do
  redis.call(unpack(commands[i]))
end
return #commands
"""

# Takes (or renews) the scheduler lease.  KEYS: lease, lease-token.  ARGV: our token
# ('' to ask for a new one), ttl ms.  Returns the token held, or false.
ACQUIRE_LEASE = """
local current = redis.call('GET', KEYS[1])
if current and current == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return current
end
if current then return false end
local token = tostring(redis.call('INCR', KEYS[2]))
redis.call('SET', KEYS[1], token, 'PX', ARGV[2])
return token
"""

# A worker claims up to ARGV[2] queued tasks, from its own ready set first (tasks
# restricted to it), then its constrained set (tasks with resources it could run), then
# the cluster's.  KEYS: ready, workers, the worker's processing set, worker stream,
# ready-signal, the worker's ready set, the worker's inbox, the worker's constrained set.
# ARGV: worker address, n, task key prefix, cluster key prefix, the last inbox id the
# worker read, the resources the worker has free ("GPU=1 MEM=5e9"; the stored form of
# ``placement.format_resources``).  The claim is recorded in Redis (task state,
# processing set) and announced to the scheduler in the same atomic step, so a claimed
# task is never invisible.  A task with resources is taken only if what it needs
# (its hash's ``resources``) fits in what is still free, which the claim then counts
# down: a worker never claims more than it can run.  One that does not fit stays in the
# set; after 64 of them the scan stops (bounded work), and ``blocked`` says the
# worker should claim again once resources are freed.  Otherwise fewer than n claimed
# means the sets are empty.  A task queued on several workers is taken out of the other
# workers' sets that hold it: the addresses in its hash's ``queued_on`` field (the
# scheduler writes it as it queues the task; ``workers`` holds the restriction as given,
# which may name hosts or names).  Returns {tasks, last ready-signal id, inbox entries
# after ARGV[5], blocked (0 or 1)}; each task is {key, spec, score,
# {{dep, who_has, nbytes}...}, resources}.  The inbox entries were written before anything claimed
# here was queued (e.g. free-keys of an earlier run of a key that is queued again); the
# worker applies them first, so the inbox and the ready sets cannot overtake each other.
CLAIM = """
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
local free = {}
for name, amount in string.gmatch(ARGV[6] or '', '([^%s=]+)=(%S+)') do
  free[name] = tonumber(amount)
end
local function fetch(key)
  return redis.call('HMGET', ARGV[3] .. key, 'spec', 'deps', 'state', 'queued_on', 'resources')
end
local function take(key, score, f)
  local tkey = ARGV[3] .. key
  redis.call('HSET', tkey, 'state', 'processing', 'worker', ARGV[1])
  redis.call('SADD', KEYS[3], key)
  local set = ':ready'
  if f[5] and f[5] ~= '' then set = ':constrained' end
  if f[4] and f[4] ~= '' then
    for other in string.gmatch(f[4], '%S+') do
      if other ~= ARGV[1] then
        redis.call('ZREM', ARGV[4] .. 'worker:' .. other .. set, key)
      end
    end
  end
  local deps = {}
  if f[2] then
    for _, dep in ipairs(cmsgpack.unpack(f[2])) do
      local d = redis.call('HMGET', ARGV[3] .. dep, 'who_has', 'nbytes')
      deps[#deps + 1] = {dep, d[1] or '', d[2] or '0'}
    end
  end
  out[#out + 1] = {key, f[1], score, deps, f[5] or ''}
  claimed[#claimed + 1] = key
  scores[#scores + 1] = score
end
-- a key no longer queued (claimed through another worker's set, released, forgotten)
-- is a stale entry: dropped
local function claim_from(zset)
  while #claimed < want do
    local popped = redis.call('ZPOPMIN', zset, want - #claimed)
    if #popped == 0 then return end
    for i = 1, #popped, 2 do
      local f = fetch(popped[i])
      if f[1] and f[3] == 'queued' then take(popped[i], popped[i + 1], f) end
    end
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
  while #claimed < want do
    if skipped >= SKIP then blocked = 1; return end
    local batch = redis.call('ZRANGE', zset, skipped, skipped + 63, 'WITHSCORES')
    if #batch == 0 then return end
    for i = 1, #batch, 2 do
      if #claimed >= want then return end
      local f = fetch(batch[i])
      if f[1] and f[3] == 'queued' then
        local need = fits(f[5])
        if need then
          redis.call('ZREM', zset, batch[i])
          for name, n in pairs(need) do free[name] = (free[name] or 0) - n end
          take(batch[i], batch[i + 1], f)
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
claim_from(KEYS[6])
claim_constrained(KEYS[8])
claim_from(KEYS[1])
if #claimed > 0 then
  redis.call('XADD', KEYS[4], '*', 'm',
    cmsgpack.pack({{op = 'claimed', worker = ARGV[1], keys = claimed, scores = scores}}))
end
return {out, last_id, redis.call('XRANGE', KEYS[7], '(' .. ARGV[5], '+'), blocked}
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

    def apply_fenced(self, *, token: str | None, commands: list[list[Any]], ttl_ms: int) -> Any:
        """Run ``commands`` (each a list of arguments) atomically if the lease is held
        with ``token``, renewing it for ``ttl_ms``; raises ``ResponseError`` ``FENCED``."""
        args = [token or "", pack_for_lua(commands), ttl_ms]
        return self._apply_fenced(keys=[self.keys.lease], args=args)

    def acquire_lease(self, *, token: str | None, ttl_ms: int) -> Any:
        """Renew the lease held with ``token``, or take it with a new token if it is free
        (``token`` None asks for a new one); returns the token held, or None."""
        keys = [self.keys.lease, self.keys.lease_token]
        return self._acquire_lease(keys=keys, args=[token or "", ttl_ms])

    def claim(self, *, worker: str, count: int, last_inbox_id: str, free: str = "") -> Any:
        """Claim up to ``count`` queued tasks for ``worker``, those with resources only
        within ``free`` (``placement.format_resources`` of what the worker has free);
        returns ``[tasks, last ready-signal id, the inbox entries after last_inbox_id,
        blocked]`` (see ``CLAIM``)."""
        k = self.keys
        return self._claim(
            keys=[k.ready, k.workers, k.worker_processing(worker), k.worker_stream,
                  k.ready_signal, k.worker_ready(worker), k.worker_inbox(worker),
                  k.worker_constrained(worker)],
            args=[worker, count, k.task_prefix, k.prefix, last_inbox_id, free],
        )  # fmt: skip


# --------------------------------------------------------------------------- cluster


def ensure_cluster(client: redis.Redis, keys: Keys) -> bytes:
    """Create the cluster's meta hash, secret and consumer groups if missing.

    Idempotent, so the scheduler and workers may start in any order (clients and the
    read-only tools never create a cluster: see ``cluster_secret``).  Returns the cluster
    secret used to authenticate peer-to-peer connections.  Raises ``SchemaError`` when the
    cluster was created by an incompatible version of redisdask.
    """
    pipe = client.pipeline(transaction=True)
    pipe.hsetnx(keys.meta, "schema_version", SCHEMA_VERSION)
    pipe.hsetnx(keys.meta, "secret", secrets.token_hex(32))
    pipe.hmget(keys.meta, ["schema_version", "secret"])
    version, secret = pipe.execute()[-1]
    for stream in (keys.client_stream, keys.worker_stream):
        try:
            client.xgroup_create(stream, SCHEDULER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
    return _checked_secret(keys, version, secret)


def cluster_secret(client: redis.Redis, keys: Keys) -> bytes | None:
    """The secret of an existing cluster, or None when no scheduler or worker ever created
    one under this name (nothing is written: a mistyped name leaves no keys behind)."""
    version, secret = client.hmget(keys.meta, ["schema_version", "secret"])
    if version is None or secret is None:
        return None
    return _checked_secret(keys, version, secret)


def known_clusters(client: redis.Redis, limit: int = 20) -> list[str]:
    """Names of the clusters on this Redis (for error messages), at most ``limit``."""
    names: set[str] = set()
    for key in client.scan_iter(match="rd:{*}:meta", count=1000):
        raw = key.decode() if isinstance(key, bytes) else key
        names.add(raw[len("rd:{") : -len("}:meta")])
        if len(names) >= limit:
            break
    return sorted(names)


def _checked_secret(keys: Keys, version: bytes | str, secret: bytes | str) -> bytes:
    from redisdask.errors import SchemaError

    if int(version) != SCHEMA_VERSION:
        raise SchemaError(
            f"cluster {keys.cluster!r} in Redis has schema version {int(version)}, this "
            f"redisdask speaks version {SCHEMA_VERSION}: use a matching redisdask or another "
            "--cluster name"
        )
    return bytes.fromhex(secret.decode() if isinstance(secret, bytes) else secret)
