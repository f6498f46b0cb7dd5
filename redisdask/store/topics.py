"""Structured events by topic, as distributed's ``log_event`` / ``get_events`` /
``subscribe_topic``: each topic a capped stream, ``rd:{c}:topic:<name>``, whose entries
are ``{t: time, m: msgpack of the message}``, and the set of topics ever logged,
``rd:{c}:topics``.  The cluster's own event log (worker joined, removed, died with its
reason, task erred, ...) reads as the topic ``CLUSTER``, so a program can react to a
worker's death without parsing logs (distributed#7375)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from redisdask.store import codecs
from redisdask.store.keyspace import Keys

CLUSTER = "cluster"  # the topic of the cluster's own event log (``rd:{c}:events``)
Event = tuple[float, Any]  # (time, message), as distributed's


def stream(keys: Keys, topic: str) -> str:
    """The stream of ``topic``."""
    if not isinstance(topic, str) or not topic:
        raise TypeError(f"a topic is a non-empty string, not {topic!r}")
    return keys.events if topic == CLUSTER else keys.topic(topic)


def pack(msg: Any) -> bytes:
    """``msg`` as msgpack: ``TypeError`` naming it if it is not plain data (as
    distributed asks: numbers, strings, bytes, lists, dicts, None)."""
    try:
        return codecs.pack(msg)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"an event's message must be plain data that msgpack packs (numbers, strings, "
            f"bytes, lists, dicts, None); {type(msg).__name__} is not: {exc}"
        ) from None


def commands(keys: Keys, topics: str | Iterable[str], msg: Any, maxlen: int) -> list[list[Any]]:
    """The writes that log ``msg`` under each of ``topics`` (capped at ``maxlen``)."""
    names = [topics] if isinstance(topics, str) else list(topics)
    if CLUSTER in names:
        raise ValueError(f"topic {CLUSTER!r} is the cluster's own event log: it is read-only")
    fields = ["t", repr(time.time()), "m", pack(msg)]
    out: list[list[Any]] = []
    for name in names:
        out.append(["XADD", stream(keys, name), "MAXLEN", maxlen, "*", *fields])
        out.append(["SADD", keys.topics, name])
    return out


def events(entries: Iterable[tuple[Any, dict[bytes, bytes]]], topic: str) -> list[Event]:
    """Decoded entries of ``topic``'s stream (malformed ones skipped)."""
    out: list[Event] = []
    for _id, fields in entries:
        if topic == CLUSTER:
            event = codecs.unpack_or(fields.get(b"m"), None, dict)
            if event is not None:
                out.append((float(event.get("time") or 0.0), event))
            continue
        try:
            out.append((float(fields[b"t"]), codecs.unpack(fields[b"m"])))
        except (KeyError, ValueError, TypeError):
            continue
    return out
