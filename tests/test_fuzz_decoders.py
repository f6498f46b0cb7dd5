"""Fuzzing every decoder of what a stranger can write (hypothesis, 10,000 cases each):
stream entries and messages (``protocol``, ``scheduler.translator.decode_entry``), task
records (``task_record``), workers entries and msgpack (``store.codecs``), and the frames of a
peer connection (``comm.MessageReader``).

Each decoder lets only its documented error escape (``ProtocolError``, ``RecordError``,
``ValueError`` for ``codecs.unpack``; the tolerant readers nothing at all), and nothing
is ever unpickled: the inputs are seeded with a pickle whose loading would leave a trace
(``TRAP``), and the trace must stay empty.  Derandomized, with no example database: the
same cases on every run, on CI too.
"""

from __future__ import annotations

import contextlib
import math
import pickle
import struct
import time
from collections.abc import Callable
from dataclasses import fields as dataclass_fields
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redisdask import comm
from redisdask.errors import ProtocolError, RecordError
from redisdask.protocol import CHANNELS, SCHEDULER_EVENTS, parse
from redisdask.scheduler.translator import decode_entry, rejected_graphs
from redisdask.store import codecs
from redisdask.store.task_record import FIELDS, TaskRecord

pytestmark = pytest.mark.timeout(300)

CASES = 10_000
PER_EXAMPLE = 10
FUZZ = settings(
    max_examples=CASES // PER_EXAMPLE,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)

SPRUNG: list[str] = []  # what an unpickled TRAP leaves


def spring(tag: str) -> None:
    SPRUNG.append(tag)


class Trap:
    def __reduce__(self) -> tuple[Callable[[str], None], tuple[str]]:
        return spring, ("unpickled from unauthenticated input",)


TRAP = pickle.dumps(Trap(), protocol=5)


@pytest.fixture(autouse=True)
def _no_trap_sprung() -> Any:
    pickle.loads(TRAP)  # the trap works: loading it leaves the trace
    assert SPRUNG == ["unpickled from unauthenticated input"]
    SPRUNG.clear()
    yield
    assert not SPRUNG, "a decoder unpickled untrusted bytes"


# --------------------------------------------------------------------------- strategies

blobs = st.one_of(st.binary(max_size=64), st.just(TRAP), st.just(b""))
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(),
    st.text(max_size=16),
    blobs,
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-5, 5)), inner, max_size=3),
    ),
    max_leaves=6,
)
keys = st.text(max_size=12)
TYPED: dict[str, st.SearchStrategy[Any]] = {
    "str": keys,
    "bool": st.booleans(),
    "int": st.integers(-(2**40), 2**40),
    "int | None": st.none() | st.integers(-10, 10**6),
    "float": st.floats() | st.integers(-10, 10),
    "bytes": blobs,
    "bytes | None": st.none() | blobs,
    "list[str]": st.lists(keys, max_size=4),
    "list[str] | None": st.none() | st.lists(keys, max_size=4),
    "list[Any]": st.lists(values, max_size=2),
    "list[dict[str, Any]]": st.lists(st.dictionaries(keys, scalars, max_size=6), max_size=2),
    "dict[str, Any]": st.dictionaries(keys, values, max_size=3),
    "dict[str, int]": st.dictionaries(keys, st.integers(-5, 10**6), max_size=4),
    "dict[str, float]": st.dictionaries(keys, st.floats() | st.integers(-5, 10), max_size=4),
    "dict[str, list[str]]": st.dictionaries(keys, st.lists(keys, max_size=3), max_size=3),
}


def message_of(cls: type) -> st.SearchStrategy[dict[str, Any]]:
    """Maps with the class's op whose fields are mostly well typed (to reach the checks
    beyond the types) and sometimes anything at all."""
    wire = [f for f in dataclass_fields(cls) if f.name != "stimulus_id"]
    optional = {f.name: TYPED[str(f.type)] | scalars for f in wire}
    return st.fixed_dictionaries({"op": st.just(cls.op)}, optional=optional)


ALL_CLASSES = sorted(
    {cls for channel in CHANNELS.values() for cls in channel.values()}, key=lambda c: c.op
)
messages = st.one_of(*(message_of(cls) for cls in ALL_CLASSES), values)


def packed(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    return strategy.map(lambda v: msgpack.packb(v, use_bin_type=True))


entry_fields = st.one_of(
    st.fixed_dictionaries({b"m": packed(st.lists(messages, max_size=3))}),
    st.fixed_dictionaries({b"m": blobs}),
    st.dictionaries(st.binary(max_size=4), blobs, max_size=4),
)


def fuzz(test: Callable[..., None], *strategies: st.SearchStrategy[Any]) -> int:
    """Run ``test`` on CASES generated cases; the number run (printed for the report).
    Each of hypothesis's examples is a list of PER_EXAMPLE cases: its engine costs more
    per example than drawing a case does, and a failing list shrinks to one case."""
    ran = 0

    @FUZZ
    @given(st.lists(st.tuples(*strategies), min_size=PER_EXAMPLE, max_size=PER_EXAMPLE))
    def case(cases: list[tuple[Any, ...]]) -> None:
        nonlocal ran
        for args in cases:
            ran += 1
            test(*args)

    started = time.monotonic()
    case()
    print(f"{test.__name__}: {ran} cases in {time.monotonic() - started:.1f} s")
    assert ran >= CASES
    return ran


# --------------------------------------------------------------------------- streams


def test_stream_entries_decode_or_raise_protocol_error() -> None:
    def one(entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        try:
            events = decode_entry(entry_id, fields, "clients")
        except ProtocolError:
            pass
        else:
            assert all(type(e).op in SCHEDULER_EVENTS for e in events)
        # what the scheduler tells a refused client: never raises
        for rejected in rejected_graphs(entry_id, fields, "fuzz", "clients"):
            assert isinstance(rejected.client, str) and rejected.keys

    fuzz(one, st.sampled_from([b"1-0", b"1700000000000-7"]), entry_fields)


def test_messages_of_every_channel_parse_or_raise_protocol_error() -> None:
    def one(msg: Any, channel: str) -> None:
        try:
            parsed = parse(msg, CHANNELS[channel], "fuzz/0")
        except ProtocolError:
            return
        assert parsed.to_dict()["op"] == msg["op"]  # what parses is sent again as it came

    fuzz(one, messages, st.sampled_from(sorted(CHANNELS)))


# --------------------------------------------------------------------------- records

record_values = st.one_of(
    blobs,
    st.sampled_from([b"queued", b"memory", b"processing", b"erred", b"nan", b"inf", b"1e999"]),
    st.integers().map(lambda i: str(i).encode()),
    st.floats().map(lambda f: repr(f).encode()),
    packed(values),
    packed(st.lists(keys, max_size=3)),
    st.text(max_size=12).map(str.encode),
)
record_names = st.one_of(st.sampled_from([f.encode() for f in FIELDS]), st.binary(max_size=8))
record_pairs = st.lists(st.tuples(record_names, record_values), max_size=12)


def test_task_records_decode_checked_or_raise_record_error() -> None:
    def one(pairs: list[tuple[bytes, bytes]]) -> None:
        TaskRecord.from_pairs(pairs)  # tolerant: never raises
        try:
            record = TaskRecord.checked("rd:{fuzz}:task:x", pairs)
        except RecordError as exc:
            assert exc.record == "rd:{fuzz}:task:x" and exc.field and exc.evidence
            return
        assert record.state and math.isfinite(record.score)
        assert all(isinstance(d, str) for d in record.deps)
        assert all(isinstance(v, float) and v >= 0 for v in record.resources.values())

    fuzz(one, record_pairs)


worker_infos = st.one_of(
    blobs,
    packed(values),
    packed(
        st.fixed_dictionaries(
            {},
            optional={
                name: values
                for name in ("name", "host", "nthreads", "memory_limit", "started", "resources")
            },
        )
    ),
)


def test_workers_entries_and_msgpack_decode_or_raise_their_error() -> None:
    def one(raw: bytes) -> None:
        codecs.unpack_or(raw, "default")  # tolerant: never raises
        with contextlib.suppress(ValueError):  # its one error
            codecs.unpack(raw)
        try:
            info = codecs.worker_info("rd:{fuzz}:workers/tcp://x:1", raw)
        except RecordError as exc:
            assert exc.field and exc.evidence
            return
        assert isinstance(info, dict) and all(isinstance(k, str) for k in info)

    fuzz(one, worker_infos)


# --------------------------------------------------------------------------- peer frames

SMALL = comm.Limits(max_header_size=1 << 12, max_frames=64, max_message_size=1 << 16)


def framed(header: bytes, frames: list[bytes]) -> bytes:
    parts = [header, *frames]
    lengths = struct.pack(f"<{len(parts)}Q", *map(len, parts))
    return struct.pack("<I", len(parts)) + lengths + b"".join(parts)


wire = st.one_of(
    st.binary(max_size=256),
    st.builds(framed, packed(values), st.lists(blobs, max_size=3)),
    st.builds(framed, blobs, st.lists(blobs, max_size=3)),
    st.builds(lambda a, b: a + b, st.builds(framed, packed(values), st.just([TRAP])), blobs),
)


def test_peer_frames_decode_or_raise_protocol_error() -> None:
    def one(data: bytes, cut: int) -> None:
        reader = comm.MessageReader(SMALL)
        try:
            reader.feed(data[:cut])  # in two reads, as a socket may deliver it
            reader.feed(data[cut:])
        except comm.FramingError:
            return
        while (message := reader.next_message()) is not None:
            header, payload = message
            assert isinstance(header, dict)
            assert all(isinstance(p, memoryview) for p in payload)  # opaque: never loaded

    fuzz(one, wire, st.integers(0, 300))
