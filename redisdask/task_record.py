"""The task record: the hash ``rd:{c}:task:<key>`` and its one codec.

Every process reads this hash and the scheduler writes it, so its encoding lives here
and nowhere else (``docs/redis-schema.md`` lists the fields)::

    TaskRecord.from_hash(r.hgetall(keys.task(key)))        # a full read
    TaskRecord.from_hmget(names, r.hmget(key, names))      # a partial read, or:
    TaskRecord.read(r, keys.task(key), names)
    record.to_fields()                                     # a full write (HSET mapping)
    TaskRecord.encode({"state": "memory", "who_has": ...}) # a partial write

Field formats: text as UTF-8; ints and floats as their text; ``deps`` and ``deaths`` as
msgpack; ``who_has``, ``workers`` and ``queued_on`` as space-separated words (an address,
worker name or host never contains a space); ``resources`` as ``NAME=AMOUNT`` words
(``placement.format_resources``); ``spec``, ``exception``, ``traceback`` and ``killed``
as opaque bytes; ``rejected`` and ``loose`` as ``1`` or empty.  The ``CLAIM`` script in
``schema.py`` reads ``spec``, ``deps``, ``state``, ``queued_on``, ``resources``,
``who_has`` and ``nbytes`` in the same formats (a test checks that it names only fields
of this record).

Reading is tolerant: a missing field takes its default (records written by older code
lack ``queued_on``, for instance: ``None`` then says "absent", unlike an empty list),
and a value that cannot be decoded does too, so a reader shows what it can instead of
failing on what anyone may have written.  Writing takes each field in its decoded type
(a list of words, a list of deaths), so this module is the only encoder.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import redis

from redisdask import schema
from redisdask.placement import format_resources, split_resources

Raw = bytes | None  # a field as redis-py returns it (None: absent)


# --------------------------------------------------------------------------- field codecs


def split_words(raw: bytes | str | None) -> list[str]:
    """A space-separated field (``who_has``, ``workers``, ``queued_on``) as a list."""
    if not raw:
        return []
    return (raw.decode(errors="replace") if isinstance(raw, bytes) else raw).split()


def join_words(words: Iterable[str]) -> str:
    """The stored form of a list of words."""
    if isinstance(words, str | bytes):  # would be joined letter by letter
        raise TypeError(f"a list of words, not {type(words).__name__} {words!r}")
    return " ".join(words)


def _text(raw: Raw, default: str = "") -> str:
    return default if raw is None else raw.decode(errors="replace")


def _int(raw: Raw, default: int = 0) -> int:
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        try:
            return int(float(raw))
        except (ValueError, OverflowError):
            return default


def _float(raw: Raw) -> float:
    try:
        return float(raw) if raw else 0.0
    except ValueError:
        return 0.0


def _packed(value: Any) -> bytes:
    if isinstance(value, str | bytes):  # would be stored packed twice
        raise TypeError(f"a decoded value, not the stored form {value!r}")
    return schema.pack(value)


def _flag(value: Any) -> int | bytes:
    return 1 if value else b""


def _bytes_or_empty(value: bytes | None) -> bytes:
    return value or b""


def _same(value: Any) -> Any:
    return value


_ENCODERS: dict[str, Callable[[Any], Any]] = {
    "state": _same,
    "spec": _same,
    "deps": _packed,
    "score": _same,
    "worker": _same,
    "who_has": join_words,
    "nbytes": _same,
    "type": _same,
    "retries": _same,
    "workers": join_words,
    "loose": _flag,
    "resources": format_resources,
    "queued_on": join_words,
    "exception": _bytes_or_empty,
    "traceback": _bytes_or_empty,
    "exception_text": _same,
    "traceback_text": _same,
    "erred_on": _same,
    "exception_blame": _same,
    "suspicious": _same,
    "deaths": _packed,
    "killed": _bytes_or_empty,
    "replicas": _same,
    "rejected": _flag,
}


# --------------------------------------------------------------------------- the record


@dataclass(slots=True)
class TaskRecord:
    """One task hash, decoded.  Defaults are what an absent field means."""

    state: str = ""  # "": no such field (no record, or a partial read without it)
    spec: bytes | None = None  # the graph history; None: absent (scattered, or no task)
    deps: list[str] = field(default_factory=list)
    score: float = 0.0
    worker: str = ""  # the worker holding the current claim (processing only)
    who_has: list[str] = field(default_factory=list)
    nbytes: int = 0
    type: str = ""
    retries: int = 0
    workers: list[str] = field(default_factory=list)  # the restriction as given
    loose: bool = False  # allow_other_workers: the restriction is a preference
    resources: dict[str, float] = field(default_factory=dict)  # what one run needs
    queued_on: list[str] | None = None  # None: absent (a record older than the field)
    exception: bytes | None = None
    traceback: bytes | None = None
    exception_text: str = ""
    traceback_text: str = ""
    erred_on: str = ""
    exception_blame: str = ""
    suspicious: int = 0
    deaths: list[dict[str, Any]] = field(default_factory=list)
    killed: bytes | None = None  # msgpack {task, deaths}: passed on to clients as it is
    replicas: int = 1
    rejected: bool = False

    # ------------------------------------------------------------------ writing

    def to_fields(self, only: Iterable[str] | None = None) -> dict[str, Any]:
        """The HSET mapping of this record: every field, or those named in ``only``.
        ``spec`` and ``queued_on`` are left out while they are None (absent)."""
        names = FIELDS if only is None else tuple(only)
        return self.encode(
            {
                name: getattr(self, name)
                for name in names
                if not (name in ("spec", "queued_on") and getattr(self, name) is None)
            }
        )

    @staticmethod
    def encode(changes: Mapping[str, Any]) -> dict[str, Any]:
        """The HSET mapping of a partial write: each named field in its stored form.
        An unknown field name raises ``KeyError``: the record has no such field."""
        out = dict(changes)  # most fields are stored as they are (the scheduler's hot path)
        for name, value in changes.items():
            encoder = _ENCODERS[name]
            if encoder is not _same:
                out[name] = encoder(value)
        return out

    # ------------------------------------------------------------------ reading

    @classmethod
    def from_hash(cls, raw: Mapping[bytes, bytes]) -> TaskRecord:
        """Decode an HGETALL reply (or part of one: absent fields take their defaults)."""
        get = raw.get
        deaths = schema.unpack_or(get(b"deaths"), [], list)
        queued_on = get(b"queued_on")
        return cls(
            state=_text(get(b"state")),
            spec=get(b"spec"),
            deps=[d for d in schema.unpack_or(get(b"deps"), [], list) if isinstance(d, str)],
            score=_float(get(b"score")),
            worker=_text(get(b"worker")),
            who_has=split_words(get(b"who_has")),
            nbytes=_int(get(b"nbytes")),
            type=_text(get(b"type")),
            retries=_int(get(b"retries")),
            workers=split_words(get(b"workers")),
            loose=bool(get(b"loose")),
            resources=split_resources(get(b"resources")),
            queued_on=None if queued_on is None else split_words(queued_on),
            exception=get(b"exception") or None,
            traceback=get(b"traceback") or None,
            exception_text=_text(get(b"exception_text")),
            traceback_text=_text(get(b"traceback_text")),
            erred_on=_text(get(b"erred_on")),
            exception_blame=_text(get(b"exception_blame")),
            suspicious=_int(get(b"suspicious")),
            deaths=[d for d in deaths if isinstance(d, dict)],
            killed=get(b"killed") or None,
            replicas=_int(get(b"replicas"), 1),
            rejected=bool(get(b"rejected")),
        )

    @classmethod
    def from_hmget(cls, names: Sequence[str], values: Sequence[Raw]) -> TaskRecord:
        """Decode an HMGET reply of the fields ``names`` (None: absent)."""
        return cls.from_hash(
            {n.encode(): v for n, v in zip(names, values, strict=True) if v is not None}
        )

    @classmethod
    def read(cls, r: redis.Redis, name: str, names: Sequence[str]) -> TaskRecord:
        """The fields ``names`` of the task hash ``name`` (``Keys.task(key)``)."""
        return cls.from_hmget(names, r.hmget(name, list(names)))


FIELDS: tuple[str, ...] = tuple(f.name for f in fields(TaskRecord))
assert set(FIELDS) == set(_ENCODERS), "every field of the record needs an encoder"
