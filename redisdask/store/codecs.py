"""The msgpack codecs of what redisdask keeps in Redis: stream entries, the workers
hash, a rebalance's record.  Nothing here unpickles: an extension type comes back as
``msgpack.ExtType``, and a malformed record is a ``RecordError`` naming it."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from redisdask.utils.packing import packb

# --------------------------------------------------------------------------- encoding

EVIDENCE = 80  # characters of a malformed value quoted in its error


def evidence(raw: Any, limit: int = EVIDENCE) -> str:
    """A bounded ``repr`` of a malformed value, for an error or a log line."""
    text = repr(raw)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(raw)} bytes)"


def pack(obj: Any) -> bytes:
    return packb(obj)


def pack_for_lua(obj: Any) -> bytes:
    """msgpack for Redis's Lua ``cmsgpack``, which predates the ``bin`` type: bytes go
    as raw strings, which Lua strings are anyway."""
    return packb(obj, use_bin_type=False)


def unpack(data: bytes) -> Any:
    """``data`` decoded; ``ValueError`` for every input that is no msgpack (msgpack's own
    errors, and a map whose key cannot be a dict key, are turned into it).  Never
    unpickles: an extension type comes back as ``msgpack.ExtType``."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except TypeError as exc:  # (an unhashable map key: a map or a list as key)
        raise ValueError(f"not msgpack this reader can take: {exc}") from None


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


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


# the fields of a workers entry others read, and what each must be when present (a
# worker writes more: ``workers/worker.py``, ``Worker.register``)
_WORKER_INFO: dict[str, Any] = {
    "address": lambda v: isinstance(v, str),
    "name": lambda v: isinstance(v, str | int),
    "host": lambda v: isinstance(v, str),
    "pid": _is_count,
    "nthreads": _is_count,
    "memory_limit": lambda v: v is None or (_is_number(v) and v >= 0),
    "started": _is_number,
    "nanny": lambda v: v is None or _is_count(v),
    "restarts": _is_count,
    "local_directory": lambda v: isinstance(v, str),
    "resources": lambda v: (
        isinstance(v, dict)
        and all(isinstance(k, str) and _is_number(x) and x >= 0 for k, x in v.items())
    ),
    "versions": lambda v: isinstance(v, dict),
    "memory_fractions": lambda v: isinstance(v, dict),
}


def worker_info(record: str, raw: bytes) -> dict[str, Any]:
    """An entry of the workers hash (``record`` names it: ``rd:{c}:workers/<address>``),
    decoded and checked: ``RecordError`` when it is no msgpack map with str keys, or a
    field others read has the wrong type.  Unknown fields are kept as they are."""
    from redisdask.errors import RecordError  # (errors imports nothing of ours)

    try:
        info = unpack(raw)
    except ValueError as exc:
        problem = f"is not msgpack ({exc or type(exc).__name__})"
        raise RecordError(record, "info", evidence(raw), problem) from None
    if not isinstance(info, dict) or not all(isinstance(k, str) for k in info):
        raise RecordError(record, "info", evidence(raw), "should be a msgpack map of str keys")
    for name, check in _WORKER_INFO.items():
        if name in info and not check(info[name]):
            raise RecordError(record, name, evidence(info[name]), "has the wrong type")
    return info


def worker_info_or_empty(raw: bytes | None) -> dict[str, Any]:
    """A workers entry for a reader that shows what it can: ``{}`` when it is malformed
    (the scheduler, which acts on it, logs and repairs it: ``scheduler/quarantine.py``)."""
    from redisdask.errors import RecordError

    try:
        return worker_info("", raw or b"")
    except RecordError:
        return {}


MOVE_FIELD = "move:"  # a move in flight, in a rebalance's record: move:<key> -> [snd, rec]


@dataclass(slots=True)
class RebalanceRecord:
    """A rebalance's record in Redis, as ``Client.rebalance`` and ``load_state`` read it."""

    client: str = ""
    status: str = ""  # running | done ("" before the scheduler read the request)
    moves: int = 0
    moved: int = 0
    failed: list[str] = field(default_factory=list)
    pending: dict[str, tuple[str, str]] = field(default_factory=dict)  # key -> (snd, rec)

    @classmethod
    def from_hash(cls, raw: Mapping[bytes, bytes]) -> RebalanceRecord:
        rec = cls(
            client=raw.get(b"client", b"").decode(),
            status=raw.get(b"status", b"").decode(),
            moves=int(raw.get(b"moves") or 0),
            moved=int(raw.get(b"moved") or 0),
            failed=[str(k) for k in unpack_or(raw.get(b"failed"), [], list)],
        )
        prefix = MOVE_FIELD.encode()
        for name, value in raw.items():
            if name.startswith(prefix):
                pair = unpack_or(value, [], list)
                if len(pair) == 2:
                    rec.pending[name[len(prefix) :].decode()] = (str(pair[0]), str(pair[1]))
        return rec


def entry(messages: Sequence[dict[str, Any]]) -> dict[str, bytes]:
    """The fields of one stream entry carrying ``messages``."""
    return {"m": pack(list(messages))}
