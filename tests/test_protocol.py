"""The wire protocol (``redisdask.protocol``): every message class round-trips, rejects a
malformed map naming the field, and matches the tables of ``docs/redis-schema.md``."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import msgpack
import pytest

from redisdask import protocol as wire
from redisdask.errors import ProtocolError

pytestmark = pytest.mark.timeout(10)

W1 = "tcp://10.0.0.1:8000"
W2 = "tcp://10.0.0.2:8000"
TASK = {"key": "x", "spec": b"spec", "deps": ["y"], "priority": 2, "retries": 0}


def samples() -> list[wire.Message]:
    """One message of every class, with every field set (away from its default where
    the type allows)."""
    return [
        wire.UpdateGraph(client="c", tasks=[TASK], wanted=["x"], stimulus_id="s"),
        wire.ClientDesiresKeys(client="c", keys=["x"], stimulus_id="s"),
        wire.ClientReleasesKeys(client="c", keys=["x"], stimulus_id="s"),
        wire.CancelKeys(client="c", keys=["x", "y"], generation=3, stimulus_id="s"),
        wire.RetryKeys(client="c", keys=["x"], stimulus_id="s"),
        wire.CloseClient(client="c", stimulus_id="s"),
        wire.UpdateData(
            client="c", who_has={"x": [W1]}, nbytes={"x": 3}, types={"x": "int"}, stimulus_id="s"
        ),
        wire.Replicate(client="c", keys=["x"], n=3, stimulus_id="s"),
        wire.Rebalance(client="c", request="r1", keys=["x"], workers=[W1], stimulus_id="s"),
        wire.Restart(client="c", stimulus_id="s"),
        wire.RetireWorkers(client="c", workers=[W1], force=True, stimulus_id="s"),
        wire.AddWorker(
            worker=W1, info={"nthreads": 2}, resync={"keys": {"x": 1}}, stimulus_id="s"
        ),
        wire.RemoveWorker(
            worker=W1, reason="gone", how="nanny", evidence={"rss": 1}, stimulus_id="s"
        ),
        wire.TaskClaimed(worker=W1, keys=["x"], scores=[1.0], stimulus_id="s"),
        wire.Holding(worker=W1, keys=["x"], stimulus_id="s"),
        wire.ClientsTold(worker=W1, keys=["x"], scores=[1.5], stimulus_id="s"),
        wire.TaskFinished(
            worker=W1, key="x", nbytes=3, type="int", start=1.0, stop=2.5, score=7.0,
            stimulus_id="s",
        ),
        wire.TaskErred(
            worker=W1, key="x", exception=b"e", traceback=b"tb", exception_text="E",
            traceback_text="T", score=7.0, stimulus_id="s",
        ),
        wire.MissingData(worker=W1, keys=["x"], errant_worker=W2, stimulus_id="s"),
        wire.ClientMissingData(client="c", who_failed={"x": [W1, W2]}, stimulus_id="s"),
        wire.AddKeys(worker=W1, keys=["x"], nbytes={"x": 1}, stimulus_id="s"),
        wire.ReleasedKeys(worker=W1, keys=["x"], stimulus_id="s"),
        wire.StolenKeys(
            worker=W1, thief=W2, keys=["x"], scores=[3.0], refused=["y"], stimulus_id="s"
        ),
        wire.FreeKeys(["x"]),
        wire.KeysRecorded(["x"]),
        wire.WhoHas({"x": [W1]}),
        wire.AcquireReplicas({"x": [W1, W2]}),
        wire.RestartWorker(),
        wire.RetireWorker(),
        wire.RetireAborted("the workers that were to take its 3 results left"),
        wire.CloseWorker("the cluster is closing"),
        wire.StealRequest(["x"], thief=W2),
        wire.ComputeTask("x", 1.5, 1700000000.25, estimate=0.01, chain=True),
        wire.KeyInMemory("x", [W1], nbytes=3, type="int"),
        wire.KeyErred(
            "x", exception=b"e", traceback=b"tb", exception_text="E", traceback_text="T",
            erred_on=W1, exception_blame="y", killed=b"k", suspicious=2, deaths=b"d",
            rejected=True,
        ),
        wire.CancelledKeys(["x"], generation=2),
        wire.TaskRetried("x"),
        wire.Restarted(by="c"),
        wire.RetireRefused([W1], reason="no worker would stay"),
    ]  # fmt: skip


def all_classes() -> set[type[wire.Message]]:
    return {cls for channel in wire.CHANNELS.values() for cls in channel.values()}


def test_every_class_of_every_channel_has_a_sample() -> None:
    assert {type(m) for m in samples()} == all_classes()


@pytest.mark.parametrize("message", samples(), ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: wire.Message) -> None:
    d = message.to_dict()
    assert d["op"] == type(message).op
    assert "stimulus_id" not in d  # named by the receiver, never on the wire
    packed = msgpack.unpackb(msgpack.packb(d, use_bin_type=True), raw=False)
    assert packed == d
    back = type(message).from_dict(packed, "s")
    assert back == message and type(back) is type(message)
    # its channel's base class (and parse) find the class by op
    base = wire.Stimulus if isinstance(message, wire.Stimulus) else type(message).__mro__[1]
    assert type(base.from_dict(packed, "s")) is type(message)


def test_events_take_the_stimulus_id_of_the_receiver() -> None:
    d = wire.CloseClient(client="c").to_dict()
    assert wire.Stimulus.from_dict(d, "clients:1-0/0").stimulus_id == "clients:1-0/0"
    assert wire.Stimulus.from_dict(d).stimulus_id == "replay"
    with pytest.raises(TypeError):
        wire.CloseClient("s", "c")  # type: ignore[misc]  # stimulus_id is keyword-only


def test_optional_fields_stay_off_the_wire_at_their_default() -> None:
    """The maps the streams always carried: a worker's goodbye has no how/evidence, a
    client's retire-workers no force, a report without a run no score."""
    assert wire.RemoveWorker(worker=W1, reason="bye").to_dict() == {
        "op": "remove-worker",
        "worker": W1,
        "reason": "bye",
    }
    assert wire.RetireWorkers(client="c", workers=[W1]).to_dict() == {
        "op": "retire-workers",
        "client": "c",
        "workers": [W1],
    }
    finished = wire.TaskFinished(worker=W1, key="x").to_dict()
    assert "score" not in finished
    assert math.isnan(wire.TaskFinished.from_dict(finished).score)
    assert "resync" not in wire.AddWorker(worker=W1).to_dict()
    erred = wire.KeyErred("x", exception_text="E").to_dict()
    assert not {"killed", "suspicious", "deaths", "rejected"} & set(erred)
    assert wire.TaskFinished(worker=W1, key="x", score=wire.NO_SCORE) == wire.TaskFinished(
        worker=W1, key="x"
    )


def test_from_dict_defaults_missing_optional_fields() -> None:
    ev = wire.Stimulus.from_dict({"op": "claimed", "worker": W1})
    assert isinstance(ev, wire.TaskClaimed) and ev.keys == [] and ev.stimulus_id == "replay"


@pytest.mark.parametrize(
    ("msg", "named"),
    [
        ({"op": "claimed", "worker": 5, "keys": ["x"]}, "'worker'"),
        ({"op": "claimed", "keys": ["x"]}, "'worker' is missing"),
        ({"op": "task-finished", "worker": W1}, "'key' is missing"),
        ({"op": "task-finished", "worker": W1, "key": "x", "nbytes": "big"}, "'nbytes'"),
        ({"op": "close-client"}, "'client' is missing"),
        ({"op": "close-client", "client": "c", "stimulus_id": 7}, "'stimulus_id'"),
        ({"op": "update-graph", "client": "c", "tasks": [{"key": 1}]}, "'key'"),
        ({"op": "retire-workers", "workers": [W1], "force": "yes"}, "'force'"),
    ],
)
def test_from_dict_names_the_bad_field(msg: dict[str, Any], named: str) -> None:
    with pytest.raises(ProtocolError, match=re.escape(named)):
        wire.Stimulus.from_dict(msg)


@pytest.mark.parametrize(
    ("cls", "msg", "named"),
    [
        (wire.FreeKeys, {"op": "free-keys"}, "'keys' is missing"),
        (wire.KeysRecorded, {"op": "keys-recorded", "keys": [3]}, "'keys'"),
        (wire.WhoHas, {"op": "who-has", "who_has": "x"}, "'who_has'"),
        (wire.AcquireReplicas, {"op": "acquire-replicas", "who_has": {"x": [1]}}, "'who_has'"),
        (wire.CloseWorker, {"op": "close", "reason": 3}, "'reason'"),
        (wire.KeyInMemory, {"op": "key-in-memory", "key": "x"}, "'who_has' is missing"),
        (wire.KeyErred, {"op": "task-erred", "key": "x", "exception": "text"}, "'exception'"),
        (
            wire.CancelledKeys,
            {"op": "cancelled-keys", "keys": ["x"], "generation": "1"},
            "'generation'",
        ),
        (wire.FreeKeys, {"op": "keys-recorded", "keys": ["x"]}, "expected op 'free-keys'"),
    ],
)
def test_outbound_messages_are_checked_too(
    cls: type[wire.Message], msg: dict[str, Any], named: str
) -> None:
    with pytest.raises(ProtocolError, match=re.escape(named)):
        cls.from_dict(msg)


@pytest.mark.parametrize(
    "msg",
    [
        {},
        7,
        {"op": "no-such-op"},
        {"op": None},
        {"op": ["update-graph"]},  # unhashable
        {"op": {"x": 1}},
        {"op": "free-keys", "keys": ["x"]},  # another channel's
    ],
)
def test_unknown_ops_are_refused(msg: Any) -> None:
    with pytest.raises(ProtocolError, match="unknown op"):
        wire.parse(msg, wire.SCHEDULER_EVENTS)


@pytest.mark.parametrize(
    "msg",
    [
        {"op": "claimed", "worker": W1, "keys": "x"},
        {"op": "claimed", "worker": W1, "keys": [1, 2]},
        {"op": "claimed", "worker": W1, "keys": [["x"]]},
        {"op": "task-finished", "worker": W1, "key": "x", "start": "now"},
        {"op": "task-finished", "worker": W1, "key": None},
        {"op": "task-erred", "worker": W1, "key": "x", "exception": "not-bytes"},
        {"op": "update-graph", "client": "c", "tasks": "x", "wanted": []},
        {"op": "update-graph", "client": "c", "tasks": [1], "wanted": []},
        {"op": "update-graph", "client": "c", "tasks": [{"spec": b""}], "wanted": []},
        {"op": "update-graph", "client": "c", "tasks": [{"key": "x", "deps": "y"}]},
        {"op": "update-graph", "client": "c", "tasks": [{"key": "x", "deps": [1]}]},
        {"op": "update-graph", "client": "c", "tasks": [{"key": "x", "priority": "hi"}]},
        {"op": "update-graph", "client": "c", "tasks": [{"key": "x", "retries": "2"}]},
        {"op": "update-graph", "client": "c", "tasks": [{"key": "x", "spec": "str"}]},
        {"op": "update-graph", "client": "c", "tasks": [], "wanted": [3]},
        {"op": "update-graph", "client": ["c"], "tasks": []},
        {"op": "update-data", "client": "c", "who_has": {"x": W1}},
        {"op": "update-data", "client": "c", "who_has": {"x": [1]}},
        {"op": "update-data", "client": "c", "who_has": {1: [W1]}},
        {"op": "update-data", "client": "c", "who_has": {"x": [W1]}, "nbytes": {"x": "1"}},
        {"op": "add-keys", "worker": W1, "keys": ["x"], "nbytes": {"x": None}},
        {"op": "add-worker", "worker": W1, "info": []},
        {"op": "missing-data", "worker": W1, "keys": ["x"], "errant_worker": 3},
        {"op": "retire-workers", "workers": W1},
    ],
)
def test_from_dict_rejects_malformed_messages(msg: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        wire.Stimulus.from_dict(msg)


def test_channel_bases_parse_only_their_channel() -> None:
    assert isinstance(wire.InboxMessage.from_dict({"op": "restart"}), wire.RestartWorker)
    assert isinstance(wire.Stimulus.from_dict({"op": "restart", "client": "c"}), wire.Restart)
    assert isinstance(wire.ClientEvent.from_dict({"op": "task-erred", "key": "x"}), wire.KeyErred)
    assert isinstance(
        wire.Stimulus.from_dict({"op": "task-erred", "worker": W1, "key": "x"}), wire.TaskErred
    )
    with pytest.raises(ProtocolError):
        wire.ClientEvent.from_dict({"op": "free-keys", "keys": []})


# --------------------------------------------------------------------------- the docs

SCHEMA_DOC = Path(__file__).resolve().parent.parent / "docs" / "redis-schema.md"
HEADING = re.compile(r"^#{2,4} .*\((\w+) → (\w+)\)\s*$")


def documented_tables() -> dict[str, dict[str, str]]:
    """``channel -> {op: row text}`` from the message tables of docs/redis-schema.md (a
    heading ending in ``(x → y)``, then a table whose first column is the op)."""
    tables: dict[str, dict[str, str]] = {}
    channel = None
    for line in SCHEMA_DOC.read_text().splitlines():
        heading = HEADING.match(line)
        if heading:
            channel = f"{heading[1]} -> {heading[2]}"
            tables[channel] = {}
        elif line.startswith("#"):
            channel = None
        elif channel and line.startswith("| `"):
            op = line.split("|")[1].strip().strip("`")
            tables[channel][op] = line
    return tables


def test_the_docs_tables_list_every_op_of_every_channel_and_no_other() -> None:
    tables = documented_tables()
    assert set(tables) == set(wire.CHANNELS)
    for channel, registry in wire.CHANNELS.items():
        assert set(tables[channel]) == set(registry), channel


def test_the_docs_tables_name_every_wire_field() -> None:
    """Each field a class puts on the wire is named (in backticks) in its row: a field
    added, renamed or dropped in one place and not the other fails here."""
    tables = documented_tables()
    for channel, registry in wire.CHANNELS.items():
        for op, cls in registry.items():
            row = tables[channel][op]
            for f in wire._spec(cls):
                if f.name == "worker" and channel in ("worker -> scheduler", "nanny -> scheduler"):
                    continue  # "Every message carries `worker`", said once above the table
                assert f"`{f.name}`" in row, (channel, op, f.name)


def test_the_docs_name_protocol_py_as_the_definition() -> None:
    assert "redisdask/protocol.py" in SCHEMA_DOC.read_text()


def test_the_client_handles_every_message_the_scheduler_may_send_it() -> None:
    """A message class added to the client's channel without a handler would fail
    the client's event reader at its first arrival: the dispatch table covers it."""
    from redisdask.client import channel
    from redisdask.protocol import SCHEDULER_TO_CLIENT

    assert set(channel._HANDLERS) == set(SCHEDULER_TO_CLIENT.values())


def test_the_worker_driver_carries_out_every_instruction_and_reads_every_inbox_message() -> None:
    """The worker's dispatch tables cover what its state machine emits and what the
    scheduler writes to its inbox (ComputeTask and the driver's commands are read apart)."""
    import typing

    from redisdask.protocol import (
        SCHEDULER_TO_WORKER,
        CloseWorker,
        ComputeTask,
        RestartWorker,
        RetireAborted,
        RetireWorker,
    )
    from redisdask.workers import events, inbox, worker
    from redisdask.workers.events import Instruction, Report

    # (a slotted dataclass is a second class: the first stays among the subclasses until
    # it is collected, so only the classes the module names count)
    instructions = {
        c for c in Instruction.__subclasses__() if getattr(events, c.__name__, None) is c
    }
    emitted = instructions | set(typing.get_args(Report))
    assert set(worker._CARRY_OUT) == emitted
    apart = {ComputeTask, RestartWorker, RetireWorker, RetireAborted, CloseWorker}
    assert set(inbox.INBOX_EVENTS) | apart == set(SCHEDULER_TO_WORKER.values())
    assert not set(inbox.INBOX_EVENTS) & apart


@pytest.mark.parametrize("name", ["codecs.pack", "codecs.pack_for_lua", "frames.encode_header"])
def test_packing_a_small_message_allocates_a_few_kilobytes(name: str) -> None:
    """msgpack's own ``packb`` allocates a 256 KiB buffer per message; in a worker, which
    gives freed memory back at once, that grew and shrank the heap around every report
    (31 ``brk`` calls per round trip, ``utils/packing.py``).  Measured with tracemalloc,
    which sees msgpack's buffer (``PyMem_Malloc``)."""
    import tracemalloc

    from redisdask.comm import frames
    from redisdask.store import codecs

    pack = {"codecs.pack": codecs.pack, "codecs.pack_for_lua": codecs.pack_for_lua,
            "frames.encode_header": frames.encode_header}[name]  # fmt: skip
    message = {"op": "key-in-memory", "key": "inc-1", "who_has": ["tcp://10.0.0.1:1"]}
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        packed = pack(message)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert msgpack.unpackb(packed) == message
    assert peak < 16 << 10, f"packing {len(packed)} bytes allocated {peak} bytes"
