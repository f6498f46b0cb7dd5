"""Malformed records: what ``load_state`` skipped, and the write that quarantines them.

Redis is the source of truth, but anyone who can write to it can write anything: a task
hash without ``state``, a score that is no number, a workers entry that is no msgpack.
One such record must not crash the scheduler at every start (a crash loop that no
restart ends).  So ``load_state`` decodes every record strictly (``TaskRecord.checked``,
``codecs.worker_info``) and, for one that fails, logs it once (the key, the field, what
was found, what to do) and notes it here; the driver then writes, in one fenced write:

* a copy of the record (bounded) into the cluster's dead-letter stream, beside the stream
  entries dead-lettered for the same reason (``stream`` names the record's key, ``id``
  says ``record``, ``error`` why);
* the repair: a task's hash is deleted and the task errs (``BadRecord``: its futures
  raise ``SchedulerRejectedError`` naming the record, instead of waiting for ever), a
  workers entry is replaced by an empty map (the worker stays registered and watched,
  so what it runs is recovered if it is dead), a rebalance's record is marked done with
  the error as what failed (its client raises ``KeyError`` naming it, instead of waiting),
  a client's ``wants`` set of the wrong type is written again as a set of what the client
  is given instead (``_load_wants``: every task nobody else wants, so that none of its
  futures waits for news that would never come; they are released when it closes).

After the write the record is gone, so it is logged once, not at every reload.

A cluster-wide key of the wrong type (``keyspace.CLUSTER_KEY_TYPES``: a WRONGTYPE on
every read of it) is repaired before the load reads it (``cluster_key_repairs``): copied
to the dead-letter stream and rebuilt from the records it indexes, which are keys of
their own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from redisdask.errors import RecordError
from redisdask.scheduler.tasks import BadRecord
from redisdask.store import codecs, keyspace
from redisdask.store.codecs import evidence
from redisdask.store.keyspace import Keys

logger = logging.getLogger("redisdask.scheduler")

DEAD_LETTER_SAMPLE = 4096  # bytes of each field kept of a dead-lettered entry or record
DEAD_LETTER_FIELDS = 16  # fields kept of one
DEAD_LETTER_MAXLEN = 10_000  # entries the dead-letter stream keeps (about)
REBALANCE_RECORD_TTL_MS = 3_600_000  # a finished rebalance's record, for its client to read


def dead_letter_command(
    keys: Keys, source: str, entry_id: bytes | str, fields: dict[bytes, bytes], error: str
) -> list[Any]:
    """The XADD of a bounded copy of a stream entry (or a record) into the dead-letter
    stream: a stranger's entry may have any number of fields of any size."""
    sample = codecs.pack(
        {k: v[:DEAD_LETTER_SAMPLE] for k, v in list(fields.items())[:DEAD_LETTER_FIELDS]}
    )
    return [
        "XADD", keys.dead_letter, "MAXLEN", "~", DEAD_LETTER_MAXLEN, "*",
        "stream", source, "id", entry_id, "error", error[:DEAD_LETTER_SAMPLE],
        "nfields", len(fields), "sample", sample,
    ]  # fmt: skip


def record_copy(r: redis.Redis, key: str | bytes) -> dict[bytes, bytes]:
    """What a record of the wrong type holds, for its dead-letter copy: its type and its
    ``DUMP`` (which ``RESTORE`` takes back)."""
    kind = r.type(key)
    return {b"type": kind if isinstance(kind, bytes) else str(kind).encode(),
            b"dump": r.dump(key) or b""}  # fmt: skip


@dataclass(slots=True)
class Quarantined:
    """One malformed record ``load_state`` skipped."""

    kind: str  # "task", "worker", "rebalance" or "wants"
    key: str | bytes  # the record's Redis key (for a workers entry, the workers hash)
    member: bytes  # its name: the task key, the worker's address, the rebalance request
    error: RecordError
    fields: dict[bytes, bytes]  # what the record held (for the dead-letter copy)
    # the member as text (the task a placeholder stands for in the loaded state, the
    # worker loaded without its info); None when it is no UTF-8: nobody's name
    name: str | None = None
    wanted: list[str] = field(default_factory=list)  # "wants": what its client is given

    @property
    def source(self) -> str:
        """What the dead-letter entry names: the key (and the hash field of an entry)."""
        key = self.key.decode(errors="replace") if isinstance(self.key, bytes) else self.key
        member = self.member.decode(errors="replace")
        return f"{key}/{member}" if self.kind == "worker" else key

    def log(self, keys: Keys) -> None:
        then = {
            "task": "its task errs with SchedulerRejectedError; submit it again",
            "worker": "the worker stays registered without its info; restart it",
            "rebalance": "that rebalance ends, failed; ask for it again",
            "wants": f"its client is given the {len(self.wanted)} tasks nobody else wants, "
            "until it releases them or closes",
        }[self.kind]
        logger.warning(
            "skipped a malformed %s record: %s. It is copied to the dead-letter stream and "
            "repaired: %s. Find what wrote it: XRANGE %s - +",
            self.kind, self.error, then, keys.dead_letter,
        )  # fmt: skip

    def commands(self, keys: Keys) -> list[list[Any]]:
        out = [dead_letter_command(keys, self.source, "record", self.fields, str(self.error))]
        if self.kind == "task":
            out.append(["DEL", self.key])  # (the task's erred record is written after this)
            if self.name is None:  # (a key no client can name: not even a placeholder)
                out.append(["SREM", keys.tasks, self.member])
        elif self.kind == "worker":
            if self.name is None:  # (an address that is no text: no worker's)
                out.append(["HDEL", keys.workers, self.member])
            else:
                out.append(["HSET", keys.workers, self.member, codecs.pack({})])
        elif self.kind == "wants":
            out.append(["DEL", self.key])
            step = 2000  # (arguments per command in a fenced write: Lua's unpack limit)
            out += [["SADD", self.key, *self.wanted[i : i + step]]
                    for i in range(0, len(self.wanted), step)]  # fmt: skip
        else:  # done, with the error as what failed: its client raises instead of waiting
            failed = codecs.pack([f"the rebalance's record was malformed: {self.error}"])
            out += [
                ["DEL", self.key],
                ["SREM", keys.rebalances, self.member],
                ["HSET", self.key, "status", "done", "moves", 0, "moved", 0, "failed", failed],
                ["PEXPIRE", self.key, REBALANCE_RECORD_TTL_MS],
            ]
        return out

    def events(self) -> list[BadRecord]:
        if self.kind != "task" or self.name is None:
            return []
        reason = f"field {self.error.field!r} {self.error.problem}, found {self.error.evidence}"
        return [BadRecord(key=self.name, reason=reason, stimulus_id=f"bad-record-{self.name}")]


# --------------------------------------------------------------------------- cluster keys

SCAN_COUNT = 1000  # keys per SCAN step while a cluster key is rebuilt
SADD_STEP = 2000  # members per command of a fenced write (Lua's unpack limit)


def misfits(r: redis.Redis, keys: Keys) -> list[tuple[str, bytes, bytes]]:
    """The cluster-wide keys of the wrong type: (name, type expected, type found); one
    pipeline of ``TYPE``."""
    pipe = r.pipeline(transaction=False)
    for name in keyspace.CLUSTER_KEY_TYPES:
        pipe.type(getattr(keys, name))
    out = []
    types = keyspace.CLUSTER_KEY_TYPES.items()
    for (name, expected), found in zip(types, pipe.execute(), strict=True):
        found = found if isinstance(found, bytes) else str(found).encode()
        if found not in (expected, b"none"):
            out.append((name, expected, found))
    return out


def cluster_key_repairs(
    r: redis.Redis, keys: Keys, workers: dict[str, dict[str, Any]] | None = None
) -> list[list[Any]]:
    """The fenced write that repairs the cluster-wide keys of the wrong type (nothing for
    a sound cluster: ``misfits``).  Each is copied to the dead-letter stream, deleted,
    and rebuilt from the records it indexes, which are keys of their own:

    * ``tasks`` from the task hashes, ``rebalances`` from the rebalance records not done;
    * ``clients`` and ``holders`` from the ``wants`` sets (and, for clients, the ``alive``
      keys), each client with an empty entry (its next heartbeat writes its own);
    * ``workers`` from the ``alive`` keys and the ``heartbeats`` hash, each with the info
      a running scheduler holds (``workers``), or else an empty entry: the worker stays
      registered and watched, as for a malformed entry;
    * ``durations`` and ``heartbeats`` empty: the next results and beats write them.

    What cannot be rebuilt is what those keys alone held: a client's host and versions
    until its next heartbeat; at a scheduler's start, a worker's info."""
    commands: list[list[Any]] = []
    for name, expected, found in misfits(r, keys):
        key = getattr(keys, name)
        members = _REBUILD[name](r, keys)
        error = RecordError(key, "type", evidence(found), f"is no {expected.decode()}")
        logger.error(
            "%s was a %s, not a %s (written by something other than redisdask?): copied to "
            "the dead-letter stream and rebuilt (%d members). Find what wrote it: XRANGE %s - +",
            key, found.decode(), expected.decode(), len(members), keys.dead_letter,
        )  # fmt: skip
        commands.append(dead_letter_command(keys, key, "record", record_copy(r, key), str(error)))
        commands.append(["DEL", key])
        if expected == b"set":
            commands += [["SADD", key, *members[i : i + SADD_STEP]]
                         for i in range(0, len(members), SADD_STEP)]  # fmt: skip
        else:
            known = workers or {}
            for i in range(0, len(members), SADD_STEP // 2):
                chunk = members[i : i + SADD_STEP // 2]
                pairs = [(m, codecs.pack(known.get(m.decode(errors="replace"), {}))) for m in chunk]
                commands.append(["HSET", key, *(x for pair in pairs for x in pair)])
    return commands


def _named(r: redis.Redis, key_of: Callable[[str], str]) -> list[bytes]:
    """The names ``n`` of the keys ``key_of(n)`` there are (SCAN), as Redis holds them."""
    first, last = (part.encode() for part in key_of("\0").split("\0"))
    found = {raw[len(first) : len(raw) - len(last)]
             for raw in r.scan_iter(match=first + b"*" + last, count=SCAN_COUNT)}  # fmt: skip
    return sorted(found)


def _tasks(r: redis.Redis, keys: Keys) -> list[bytes]:
    return _named(r, keys.task)


def _nothing(r: redis.Redis, keys: Keys) -> list[bytes]:
    return []


def _rebalances(r: redis.Redis, keys: Keys) -> list[bytes]:
    requests = _named(r, keys.rebalance)
    pipe = r.pipeline(transaction=False)
    for request in requests:
        pipe.hget(keys.rebalance("").encode() + request, "status")
    # (a record of the wrong type is kept: the load quarantines it)
    statuses = pipe.execute(raise_on_error=False)
    return [q for q, s in zip(requests, statuses, strict=True) if s != b"done"]


def _wanting(r: redis.Redis, keys: Keys) -> list[bytes]:
    return _named(r, keys.client_wants)


def _is_holder(name: bytes) -> bool:
    return name.startswith(keyspace.HOLDER_PREFIX.encode())


def _clients(r: redis.Redis, keys: Keys) -> list[bytes]:
    ids = set(_wanting(r, keys)) | set(_named(r, keys.client_alive))
    return sorted(i for i in ids if not _is_holder(i))


def _holders(r: redis.Redis, keys: Keys) -> list[bytes]:
    return [i for i in _wanting(r, keys) if _is_holder(i)]


def _workers(r: redis.Redis, keys: Keys) -> list[bytes]:
    try:
        beating = set(r.hkeys(keys.heartbeats))
    except redis.ResponseError:  # (WRONGTYPE too: the alive keys say it)
        beating = set()
    return sorted(beating | set(_named(r, keys.worker_alive)))


_REBUILD = {
    "workers": _workers,
    "clients": _clients,
    "holders": _holders,
    "tasks": _tasks,
    "rebalances": _rebalances,
    "durations": _nothing,
    "heartbeats": _nothing,
}
