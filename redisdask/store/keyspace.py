"""Every Redis key name of a cluster and the schema version, in one place (the scripts that
write them: ``scripts.py``; their codecs: ``codecs.py`` and ``task_record.py``).

All keys of one cluster share the hash tag ``{<cluster>}`` so that multi-key scripts and
MULTI/EXEC stay valid on Redis Cluster, Valkey and managed Redis::

    rd:{c}:meta                        hash    schema version, sequence counter, versions
    rd:{c}:secret                      string  the peer-to-peer HMAC key (hex): its own key,
                                               which the ``monitor`` ACL role cannot read
    rd:{c}:lease                       string  fencing token of the active scheduler (PX ttl)
    rd:{c}:lease-token                 string  the last token handed out (<n>.<nonce>)
    rd:{c}:leader                      string  present while a scheduler leads (the lease's
                                               PX ttl): what clients look at, who may not
                                               be given the lease itself
    rd:{c}:scheduler                   hash    id, host, pid, since, token, conn of the holder
    rd:{c}:applying                    string  within one cut fenced write: the last part done
    rd:{c}:stream:clients              stream  client -> scheduler messages (group "scheduler")
    rd:{c}:stream:workers              stream  worker -> scheduler messages (group "scheduler")
    rd:{c}:stream:dead-letter          stream  input entries that could not be decoded
    rd:{c}:events                      stream  cluster event log (capped)
    rd:{c}:deaths                      stream  one death record per worker death (capped)
    rd:{c}:story                       stream  the scheduler's task transitions (capped)
    rd:{c}:summary                     hash    task counts per prefix and state, throughput
    rd:{c}:ready                       zset    queued task keys, score = priority
    rd:{c}:placed                      zset    queued tasks placed by data on one worker
    rd:{c}:ready-signal                stream  one entry per batch that queued work (capped)
    rd:{c}:tasks                       set     every task key the scheduler knows
    rd:{c}:task:<key>                  hash    one task: state, spec, deps, who_has, ...
    rd:{c}:workers                     hash    worker address -> msgpack info
    rd:{c}:heartbeats                  hash    worker address -> msgpack metrics
    rd:{c}:worker:<addr>:alive         string  present while the worker heartbeats (PX ttl)
    rd:{c}:worker:<addr>:processing    set     tasks claimed by that worker
    rd:{c}:worker:<addr>:ready         zset    queued tasks restricted (or placed) there
    rd:{c}:worker:<addr>:constrained   zset    queued tasks with resources it could run
    rd:{c}:worker:<addr>:inbox         stream  scheduler -> worker messages
    rd:{c}:worker:<addr>:story         stream  that worker's own story (capped; kept a
                                               while after it left)
    rd:{c}:clients                     hash    client id -> msgpack info
    rd:{c}:client:<id>:alive           string  present while the client heartbeats (PX ttl)
    rd:{c}:client:<id>:events          stream  scheduler -> client messages
    rd:{c}:client:<id>:wants           set     keys the client holds futures for
    rd:{c}:worker-plugins              hash    plugin name -> msgpack {plugin, time, token}
    rd:{c}:uploads                     hash    file name -> msgpack {data, load, time, token}
    rd:{c}:holders                     set     holder ids with wanted keys (see below)

Holders are client ids that are no client: a dataset, a variable, a queue or
fire-and-forget (``holder:<kind>:<name>``, ``holder:fire-and-forget``).  They want keys as
a client does (``client:<id>:wants``), but never heartbeat, get no events stream, and are
restored from ``holders`` by a restarted scheduler.  The coordination primitives'
keys (locks, semaphores, events, variables, queues, datasets) are listed with their
scripts, in ``redisdask/coordination/scripts.py``.

``docs/redis-schema.md`` describes who writes and who reads each key.

Stream entries carry one field, ``m``: a msgpack-encoded *list* of messages, each a map
with an ``op``.  Nothing on a stream is ever unpickled to route it; opaque pickled payloads
(task specs, exceptions) travel as msgpack ``bin`` values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SCHEMA_VERSION = 1
SCHEDULER_GROUP = "scheduler"
SCHEDULER_CONSUMER = "scheduler"  # one consumer: only the lease holder ever reads
READY_SIGNAL_MAXLEN = 1000
STORY_CHUNK = 100  # transitions per entry of a story stream

COORDINATION_KINDS = ("lock", "semaphore", "event", "variable", "queue", "multilock")
# in a who_has list: the task's record holds the result itself (field ``value``), a
# result small enough to travel with its report (``worker.inline-result-bytes``); worker
# addresses have a scheme (tcp://...), so no worker is called this
REDIS_COPY = "redis"
HOLDER_PREFIX = "holder:"  # a client id with this prefix is a holder (see above)
FIRE_AND_FORGET = HOLDER_PREFIX + "fire-and-forget"


def holder(kind: str, name: str) -> str:
    """The id of the holder of a primitive's futures: ``holder:dataset:<name>``, ..."""
    return f"{HOLDER_PREFIX}{kind}:{name}"


# the cluster-wide keys every process reads, and their types: the scheduler rebuilds one
# of another type (``scheduler.quarantine``), and a worker waits meanwhile
CLUSTER_KEY_TYPES = {
    "workers": b"hash",
    "clients": b"hash",
    "holders": b"set",
    "tasks": b"set",
    "rebalances": b"set",
    "durations": b"hash",
    "heartbeats": b"hash",
}


def is_holder(client_id: str) -> bool:
    """Whether a client id names a holder (no process: never expires, gets no events)."""
    return client_id.startswith(HOLDER_PREFIX)


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
    def secret(self) -> str:
        """The cluster's peer-to-peer secret: a key of its own, so that a read-only user
        (the ``monitor`` role of ``redisdask/store/acl.py``) can be refused it alone."""
        return self.prefix + "secret"

    @property
    def lease(self) -> str:
        return self.prefix + "lease"

    @property
    def lease_token(self) -> str:
        return self.prefix + "lease-token"

    @property
    def leader(self) -> str:
        """Present while a scheduler leads, with the lease's TTL: set with it by every
        renewal.  Clients look here, not at the lease: Redis 6.2's ACL cannot give a key
        read-only, so the ``client`` role gets this copy instead of write access to the
        lease (``redisdask/store/acl.py``)."""
        return self.prefix + "leader"

    @property
    def scheduler(self) -> str:
        return self.prefix + "scheduler"

    @property
    def applying(self) -> str:
        return self.prefix + "applying"

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
    def durations(self) -> str:
        """Task prefix -> its duration average in seconds (``redisdask/durations.py``)."""
        return self.prefix + "durations"

    @property
    def placed(self) -> str:
        return self.prefix + "placed"

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

    def scheduler_connection(self, scheduler_id: str) -> str:
        """The CLIENT SETNAME of the Redis connections of that scheduler (not a key)."""
        return f"rd-{self.cluster}-{scheduler_id}"

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

    def worker_logs(self, address: str) -> str:
        """A worker's log records (``store.logship``)."""
        return f"{self.prefix}worker:{address}:logs"

    def topic(self, name: str) -> str:
        """The events logged under a topic (``store.topics``)."""
        return f"{self.prefix}topic:{name}"

    @property
    def topics(self) -> str:
        """The names of the topics ever logged."""
        return self.prefix + "topics"

    @property
    def scheduler_logs(self) -> str:
        """The log records of every scheduler process of the cluster."""
        return self.prefix + "logs:scheduler"

    def nanny_logs(self, name: str) -> str:
        """A nanny process's own log records (``name``: its worker's, or host:pid)."""
        return f"{self.prefix}logs:nanny:{name}"

    @property
    def clients(self) -> str:
        return self.prefix + "clients"

    def client_alive(self, client_id: str) -> str:
        return f"{self.prefix}client:{client_id}:alive"

    def client_events(self, client_id: str) -> str:
        return f"{self.prefix}client:{client_id}:events"

    def client_written(self, client_id: str) -> str:
        """How many entries the client wrote to the clients stream (``WRITE_ENTRIES``)."""
        return f"{self.prefix}client:{client_id}:written"

    def client_wants(self, client_id: str) -> str:
        return f"{self.prefix}client:{client_id}:wants"

    @property
    def worker_plugins(self) -> str:
        """Worker plugins every current and future worker sets up (``register_plugin``)."""
        return self.prefix + "worker-plugins"

    @property
    def uploads(self) -> str:
        """Files every current and future worker writes and imports (``upload_file``)."""
        return self.prefix + "uploads"

    @property
    def holders(self) -> str:
        return self.prefix + "holders"

    @property
    def rebalances(self) -> str:
        """The requests of the rebalances under way (``Client.rebalance``)."""
        return self.prefix + "rebalances"

    def rebalance(self, request: str) -> str:
        """A rebalance's plan and progress (``scheduler.moves``)."""
        return f"{self.prefix}rebalance:{request}"

    # the coordination primitives (redisdask/coordination/scripts.py)

    def coordination(self, kind: str, name: str) -> str:
        """The state of a primitive: ``rd:{c}:lock:<name>``, ``...:queue:<name>``, ..."""
        if kind not in COORDINATION_KINDS:
            raise ValueError(f"unknown coordination primitive {kind!r}")
        return f"{self.prefix}{kind}:{name}"

    def waiters(self, kind: str, name: str) -> str:
        return f"{self.prefix}waiters:{kind}:{name}"

    def signal(self, kind: str, name: str) -> str:
        return f"{self.prefix}signal:{kind}:{name}"

    def queue_refs(self, name: str) -> str:
        return f"{self.prefix}queue-refs:{name}"

    @property
    def multilock_requests(self) -> str:
        """``MultiLock`` requests (waiting or holding): id -> msgpack [locks left, names]."""
        return self.prefix + "multilock-requests"

    @property
    def multilock_leases(self) -> str:
        """When each ``MultiLock`` request lapses (its lease, or a waiter's word), ms."""
        return self.prefix + "multilock-leases"

    @property
    def datasets(self) -> str:
        return self.prefix + "datasets"


# A pseudo-command of a scheduler batch: an XADD to a worker's inbox whose entry carries,
# beside its messages, the spec of each task pushed to it (``protocol.ComputeTask``),
# copied from the task's record inside the script (the scheduler keeps no specs).
XADD_WITH_SPECS = "RD.XADD-WITH-SPECS"


def push_spec_field(key: str) -> str:
    """The field of a worker's inbox entry that holds the spec of pushed task ``key``."""
    return "s:" + key
