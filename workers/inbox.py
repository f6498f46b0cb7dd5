"""What the worker reads from Redis, decoded, and the news its reports carry: the
entries of its inbox (``protocol.SCHEDULER_TO_WORKER``) become state machine events
(``INBOX_EVENTS``), tasks pushed to it (``Pushed``) and commands for the driver
(``Command``); ``early_news`` is the ``key-in-memory`` a report of a pushed task carries
for ``FINISH`` to send its clients.  Pure functions of the messages: the driver
(``workers/worker.py``) does the reading and the writing."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redisdask.errors import ProtocolError
from redisdask.protocol import (
    SCHEDULER_TO_WORKER,
    AcquireReplicas,
    CloseWorker,
    ComputeTask,
    FreeKeys,
    KeyInMemory,
    KeysRecorded,
    RetireAborted,
    StealRequest,
    WhoHas,
    parse,
)
from redisdask.store import codecs, keyspace
from redisdask.workers.events import (
    AcquireReplicasEvent,
    ComputeTaskEvent,
    FreeKeysEvent,
    KeysRecordedEvent,
    StateMachineEvent,
    StealRequestEvent,
    UpdateWhoHasEvent,
)

logger = logging.getLogger("redisdask.worker")


def parse_id(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def script_entries(raw: list[Any]) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """Stream entries as a Lua script returns them (``[id, [field, value, ...]]``) in the
    shape redis-py gives XREAD's (``(id, {field: value})``)."""
    return [(entry_id, dict(zip(flat[::2], flat[1::2], strict=True))) for entry_id, flat in raw]


@dataclass(slots=True)
class Command:
    """An inbox message for the driver rather than the state machine: ``restart`` (drop
    everything), ``retire`` (leave gracefully), ``retire-aborted`` (work on), ``close``
    (leave now)."""

    op: str
    stimulus_id: str
    reason: str = ""


def early_news(
    batch: list[dict[str, Any]], pushed: set[str], address: str
) -> list[tuple[str, float, bytes]]:
    """The ``key-in-memory`` news of the pushed tasks whose small results the batch of
    reports carries, for ``FINISH`` to send their clients at once (docs/design.md,
    "Push"): (key, score, the message packed as a one-message list, but for its last
    pair, ``seen``, which FINISH appends).  The reported keys leave ``pushed``."""
    early = []
    for m in batch:
        if m.get("op") != "task-finished" or m["key"] not in pushed:
            continue
        pushed.discard(m["key"])
        if m.get("value") is None or "score" not in m:
            continue  # (a result too big for Redis, or a report of no known run:
            # the scheduler tells its clients)
        news = {
            "op": KeyInMemory.op,
            "key": m["key"],
            "who_has": [address, keyspace.REDIS_COPY],
            "nbytes": m.get("nbytes", 0),
            "type": m.get("type", ""),
            "value": m["value"],
        }
        opening = bytes([0x91, 0x80 + len(news) + 1])  # [{...news, seen}]: fixarray, fixmap
        pairs = b"".join(codecs.pack(k) + codecs.pack(v) for k, v in news.items())
        early.append((m["key"], m["score"], opening + pairs))
    return early


@dataclass(slots=True)
class Pushed:
    """A task the scheduler gave this worker (``compute-task``, ``redisdask.scheduler.push``)."""

    event: ComputeTaskEvent
    chain: bool


def _pushed(msg: ComputeTask, fields: dict[bytes, bytes], sid: str) -> Pushed | None:
    """None for a push without its spec (the task was forgotten in the batch that pushed
    it: the message after it frees it; else the scheduler queues it again once the
    worker's holding reports go without it)."""
    spec = fields.get(keyspace.push_spec_field(msg.key).encode())
    if not spec:
        logger.warning("ignoring compute-task %r: its spec did not come with it", msg.key)
        return None
    estimate = msg.estimate if msg.estimate >= 0 else None
    event = ComputeTaskEvent(msg.key, spec, (msg.score,), {}, sid, {}, estimate)
    return Pushed(event, msg.chain)


# the state machine's event for each scheduler message of the inbox (``ComputeTask`` and
# the commands for the driver are read apart: ``inbox_events``)
INBOX_EVENTS: dict[type, Callable[[Any, str], StateMachineEvent]] = {
    FreeKeys: lambda msg, sid: FreeKeysEvent(
        msg.keys,
        sid,
        seen=parse_id(msg.seen) if msg.seen else None,
        run=None if math.isnan(msg.run) else float(msg.run),
    ),
    KeysRecorded: lambda msg, sid: KeysRecordedEvent(msg.keys, sid),
    WhoHas: lambda msg, sid: UpdateWhoHasEvent(msg.who_has, sid),
    AcquireReplicas: lambda msg, sid: AcquireReplicasEvent(msg.who_has, sid),
    StealRequest: lambda msg, sid: StealRequestEvent(msg.keys, msg.thief, sid),
}


def inbox_events(
    entry_id: str, fields: dict[bytes, bytes], started: float
) -> list[StateMachineEvent | Command | Pushed]:
    """Events from one inbox entry (``protocol.SCHEDULER_TO_WORKER``) of the worker
    process ``started`` then; ProtocolError (or KeyError, ValueError from a field that is
    not msgpack) when it is malformed."""
    messages = codecs.unpack(fields[b"m"])
    if not isinstance(messages, list):
        raise ProtocolError("field 'm' is not a list of messages")
    events: list[StateMachineEvent | Command | Pushed] = []
    for i, raw in enumerate(messages):
        sid = f"{entry_id}/{i}"
        msg = parse(raw, SCHEDULER_TO_WORKER)
        if isinstance(msg, ComputeTask):
            pushed = _pushed(msg, fields, sid) if msg.started == started else None
            if pushed is not None:  # (not one for a process gone from this address)
                events.append(pushed)
        elif type(msg) in INBOX_EVENTS:
            events.append(INBOX_EVENTS[type(msg)](msg, sid))
        else:  # restart, retire, retire-aborted, close: for the driver
            reason = msg.reason if isinstance(msg, CloseWorker | RetireAborted) else msg.op
            events.append(Command(msg.op, sid, reason))
    return events
