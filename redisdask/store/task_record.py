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
as opaque bytes; ``rejected``, ``loose`` and ``sticky`` as ``1`` or empty.  The ``CLAIM``
script in ``store/scripts.py`` reads ``spec``, ``deps``, ``state``, ``queued_on``, ``resources``,
``sticky``, ``who_has`` and ``nbytes`` in the same formats (a test checks that it names
only fields of this record).

Reading is tolerant: a missing field takes its default (records written by older code
lack ``queued_on``, for instance: ``None`` then says "absent", unlike an empty list),
and a value that cannot be decoded does too, so a reader shows what it can instead of
failing on what anyone may have written.  Writing takes each field in its decoded type
(a list of words, a list of deaths), so this module is the only encoder.

The scheduler, which acts on what it reads, decodes with ``TaskRecord.checked``
instead: a record without ``state``, or with a field that cannot be decoded (a score that
is no finite number, ``deps`` that are no msgpack list of keys, an unknown state...),
raises ``RecordError`` naming the record, the field and what was found, and the
scheduler quarantines it (``docs/design.md``, "Malformed records").  No decoder here
ever unpickles: ``spec``, ``exception``, ``value`` stay bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import redis

from redisdask.errors import RecordError
from redisdask.placement import format_resources, split_resources
from redisdask.store import codecs
from redisdask.store.codecs import evidence

Raw = bytes | None  # a field as redis-py returns it (None: absent)

# the states a task record may be in (the scheduler's states but ``forgotten``, whose
# record is deleted)
STATES = frozenset(("released", "waiting", "queued", "processing", "memory", "erred", "no-worker"))
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
    return codecs.pack(value)


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
    "claim": _same,
    "who_has": join_words,
    "nbytes": _same,
    "type": _same,
    "retries": _same,
    "workers": join_words,
    "loose": _flag,
    "resources": format_resources,
    "queued_on": join_words,
    "sticky": _flag,
    "passed_over": _same,
    "chain": _packed,
    "notify": _packed,
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
    "value": _bytes_or_empty,
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
    claim: str = ""  # the workers stream entry id that announced that claim (CLAIM writes it)
    who_has: list[str] = field(default_factory=list)
    nbytes: int = 0
    type: str = ""
    retries: int = 0
    workers: list[str] = field(default_factory=list)  # the restriction as given
    loose: bool = False  # allow_other_workers: the restriction is a preference
    resources: dict[str, float] = field(default_factory=dict)  # what one run needs
    queued_on: list[str] | None = None  # None: absent (a record older than the field)
    sticky: bool = False  # placed by data: waits while its worker is busy (decide.sticky)
    passed_over: str = ""  # Redis's time (ms) when a worker first left it placed (CLAIM)
    chain: list[str] = field(default_factory=list)  # dependents FINISH may claim with it
    # pushed: the clients that wanted it then -> their generation read (FINISH tells them)
    notify: dict[str, int] = field(default_factory=dict)
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
    # memory: the result itself, pickled, when small enough (who_has names keyspace.REDIS_COPY)
    value: bytes | None = None

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
        return cls.from_pairs(raw.items())

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[bytes, bytes]]) -> TaskRecord:
        """Decode ``(field, value)`` pairs: only the fields present cost anything (a
        reloading scheduler decodes 1,000,000 records); unknown fields are ignored."""
        record = cls()
        for name, value in pairs:
            decode = _DECODERS.get(name)
            if decode is not None:
                setattr(record, decode[0], decode[1](value))
        return record

    @classmethod
    def checked(cls, name: str, pairs: Iterable[tuple[bytes, bytes]]) -> TaskRecord:
        """Decode ``(field, value)`` pairs of the hash ``name`` strictly, for a reader that
        acts on them (the scheduler): ``RecordError`` when ``state`` is missing or a
        field cannot be decoded.  Unknown fields are ignored, as by ``from_pairs``."""
        record = cls()
        state_seen = False
        for field_name, value in pairs:
            decode = _CHECKED.get(field_name)
            if decode is None:
                continue
            try:
                setattr(record, decode[0], decode[1](value))
            except (ValueError, TypeError, OverflowError) as exc:
                raise RecordError(
                    name, field_name.decode(errors="replace"), evidence(value), str(exc)
                ) from None
            state_seen = state_seen or field_name == b"state"
        if not state_seen:
            raise RecordError(name, "state", "no such field", "is missing")
        if record.state == "processing" and not record.worker:
            raise RecordError(
                name,
                "worker",
                evidence(record.worker),
                "should name the worker of a processing task",
            )
        return record

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


def _strs(raw: bytes) -> list[str]:
    return [d for d in codecs.unpack_or(raw, [], list) if isinstance(d, str)]


def _maps(raw: bytes) -> list[dict[str, Any]]:
    return [d for d in codecs.unpack_or(raw, [], list) if isinstance(d, dict)]


def _bytes_or_none(raw: bytes) -> bytes | None:
    return raw or None


def _as_is(raw: bytes) -> bytes:
    return raw


# stored field -> (attribute, decoder of a present value); absent fields keep the
# record's defaults
_DECODERS: dict[bytes, tuple[str, Callable[[bytes], Any]]] = {
    name.encode(): (name, decode)
    for name, decode in {
        "state": _text,
        "spec": _as_is,
        "deps": _strs,
        "score": _float,
        "worker": _text,
        "claim": _text,
        "who_has": split_words,
        "nbytes": _int,
        "type": _text,
        "retries": _int,
        "workers": split_words,
        "loose": bool,
        "resources": split_resources,
        "queued_on": split_words,
        "sticky": bool,
        "passed_over": _text,
        "chain": _strs,
        "notify": lambda raw: {
            k: v
            for k, v in codecs.unpack_or(raw, {}, dict).items()
            if isinstance(k, str) and isinstance(v, int)
        },
        "exception": _bytes_or_none,
        "traceback": _bytes_or_none,
        "exception_text": _text,
        "traceback_text": _text,
        "erred_on": _text,
        "exception_blame": _text,
        "suspicious": _int,
        "deaths": _maps,
        "killed": _bytes_or_none,
        "replicas": lambda raw: _int(raw, 1),
        "rejected": bool,
        "value": _bytes_or_none,
    }.items()
}


def _checked_state(raw: bytes) -> str:
    state = raw.decode()
    if state not in STATES:
        raise ValueError(f"is no task state (one of {', '.join(sorted(STATES))})")
    return state


def _checked_float(raw: bytes) -> float:
    value = float(raw)
    if not math.isfinite(value):
        raise ValueError("is no finite number")
    return value


def _checked_int(raw: bytes) -> int:
    try:
        return int(raw)
    except ValueError:
        return int(_checked_float(raw))  # (an int written as a float: 3.0)


def _checked_list(raw: bytes, kind: type, what: str) -> list[Any]:
    try:
        value = codecs.unpack(raw)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"is not msgpack ({exc or type(exc).__name__})") from None
    if not isinstance(value, list) or not all(isinstance(x, kind) for x in value):
        raise ValueError(f"should be a msgpack list of {what}")
    return value


def _checked_resources(raw: bytes) -> dict[str, float]:
    out = {}
    for word in raw.decode().split():
        name, _, amount = word.partition("=")
        value = float(amount) if name else math.nan
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"should be NAME=AMOUNT words, not {word!r}")
        out[name] = value
    return out


# the decoders of ``TaskRecord.checked``: those that raise where ``_DECODERS`` default
_CHECKED: dict[bytes, tuple[str, Callable[[bytes], Any]]] = {
    **_DECODERS,
    **{
        name.encode(): (name, decode)
        for name, decode in {
            "state": _checked_state,
            "deps": lambda raw: _checked_list(raw, str, "keys"),
            "score": _checked_float,
            "nbytes": _checked_int,
            "retries": _checked_int,
            "resources": _checked_resources,
            "suspicious": _checked_int,
            "deaths": lambda raw: _checked_list(raw, dict, "maps"),
            "replicas": _checked_int,
        }.items()
    },
}

FIELDS: tuple[str, ...] = tuple(f.name for f in fields(TaskRecord))
assert set(FIELDS) == set(_ENCODERS), "every field of the record needs an encoder"
assert {n.decode() for n in _DECODERS} == set(FIELDS), "every field needs a decoder"
