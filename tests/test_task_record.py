"""The task record's one codec (``redisdask/store/task_record.py``), against a real Redis."""

from __future__ import annotations

import re

import pytest
import redis

from redisdask.scheduler.instructions import SetState, StoreTask
from redisdask.scheduler.translator import Translator
from redisdask.store import codecs, scripts
from redisdask.store.codecs import pack
from redisdask.store.keyspace import Keys
from redisdask.store.task_record import FIELDS, TaskRecord, split_words

pytestmark = pytest.mark.timeout(30)


def full_record() -> TaskRecord:
    return TaskRecord(
        state="erred",
        spec=b"\x80\x05spec",
        deps=["a", "('x', 0)"],
        score=-2199023255551.0,
        worker="",
        who_has=["tcp://10.0.0.1:1", "tcp://10.0.0.2:2"],
        nbytes=123,
        type="numpy.ndarray",
        retries=2,
        workers=["10.0.0.1", "w1"],
        queued_on=["tcp://10.0.0.1:1"],
        exception=b"exc",
        traceback=b"tb",
        exception_text="ZeroDivisionError: x",
        traceback_text="line 1",
        erred_on="tcp://10.0.0.1:1",
        exception_blame="a",
        suspicious=1,
        deaths=[{"worker": "tcp://10.0.0.3:3", "how": "heartbeat", "evidence": {"rss": 5}}],
        killed=pack({"task": "a", "deaths": []}),
        replicas=2,
        rejected=True,
    )


def test_a_record_written_to_redis_reads_back_the_same(redis_url: str, cluster_name: str) -> None:
    r = redis.Redis.from_url(redis_url)
    name = Keys(cluster_name).task("x")
    record = full_record()
    r.hset(name, mapping=record.to_fields())
    assert TaskRecord.from_hash(r.hgetall(name)) == record
    assert TaskRecord.read(r, name, ["who_has", "state"]) == TaskRecord(
        state="erred", who_has=record.who_has
    )
    r.delete(name)


def test_reading_is_tolerant_of_old_and_odd_records() -> None:
    old = TaskRecord.from_hash({b"state": b"queued", b"workers": b"tcp://h:1 tcp://h:2"})
    assert old.queued_on is None  # absent: a record from before the field existed
    assert old.workers == ["tcp://h:1", "tcp://h:2"] and old.replicas == 1
    assert TaskRecord.from_hash({b"queued_on": b""}).queued_on == []  # present, empty
    odd = TaskRecord.from_hash(
        {b"nbytes": b"12.0", b"retries": b"x", b"deps": b"\xc1", b"deaths": pack({"a": 1})}
    )
    assert (odd.nbytes, odd.retries, odd.deps, odd.deaths) == (12, 0, [], [])
    assert TaskRecord.from_hash({}) == TaskRecord()  # no record: state ""
    assert TaskRecord.from_hmget(["state", "who_has"], [None, None]).state == ""
    assert split_words(b" a  b ") == ["a", "b"] and split_words(None) == []


def test_partial_writes_take_decoded_values_only() -> None:
    """The codec is the only encoder: a field handed over in a stored form is refused
    instead of being stored twice encoded (or a string joined letter by letter)."""
    typed = TaskRecord.encode({"who_has": ["b", "a"], "deaths": [{"x": 1}], "rejected": True})
    assert typed == {"who_has": "b a", "deaths": pack([{"x": 1}]), "rejected": 1}
    with pytest.raises(TypeError, match="a list of words"):
        TaskRecord.encode({"who_has": "b a"})
    assert TaskRecord.encode({"rejected": b"", "killed": b"", "exception": None}) == {
        "rejected": b"",
        "killed": b"",
        "exception": b"",
    }
    with pytest.raises(KeyError):
        TaskRecord.encode({"colour": "red"})  # not a field of the record
    assert list(full_record().to_fields(["spec", "state"])) == ["spec", "state"]
    assert "spec" not in TaskRecord(state="released").to_fields()  # absent stays absent


def test_the_scheduler_writes_the_same_bytes_as_before_the_codec() -> None:
    """The fields and their encoding, as the translation wrote them before the codec."""
    keys = Keys("c")
    cmds = Translator(keys).to_commands(
        [
            StoreTask("s", "x", b"spec", ["a"], 1.5, "released", 2, ("h1", "h2")),
            StoreTask("s", "y", None, [], 0.0, "released"),
            SetState("s", "z", "memory", {"who_has": ["w1", "w2"], "nbytes": 8, "type": "int"}),
        ]
    )
    hsets = [c for c in cmds if c[0] == "HSET"]
    assert hsets == [
        ["HSET", keys.task("x"), "state", "released", "deps", pack(["a"]), "score", 1.5,
         "retries", 2, "workers", "h1 h2", "spec", b"spec", "worker", ""],
        ["HSET", keys.task("y"), "state", "released", "deps", pack([]), "score", 0.0,
         "retries", 0, "workers", "", "worker", ""],
        ["HSET", keys.task("z"), "state", "memory", "who_has", "w1 w2", "nbytes", 8,
         "type", "int", "worker", ""],
    ]  # fmt: skip


def test_the_claim_script_reads_only_fields_of_the_record() -> None:
    named = set(re.findall(r"'(\w+)'", " ".join(re.findall(r"HMGET', [^)]*", scripts.CLAIM))))
    assert named and named <= set(FIELDS), named - set(FIELDS)
    assert {"spec", "deps", "state", "queued_on", "who_has", "nbytes"} <= named
    written = re.findall(r"HSET', tkey, (.*)\)", scripts.CLAIM)
    assert set(re.findall(r"'(\w+)'", written[0])) <= set(FIELDS) | {"processing"}


def test_releasing_an_erred_task_stores_an_empty_list_of_deaths() -> None:
    """The release of an erred task empties ``deaths`` in the record's own format (a
    msgpack list), not a stored form (``b""``) that the codec packs again into a msgpack
    ``bin``; the codec refuses such a stored form for its packed fields."""
    from redisdask.protocol import ClientReleasesKeys, TaskClaimed, TaskErred, UpdateGraph
    from redisdask.scheduler.state import AddWorker, SchedulerState

    w = "tcp://10.0.0.1:8000"
    s = SchedulerState(validate=True)
    s.handle_stimulus(AddWorker(worker=w, info={}, stimulus_id="a"))
    graph = [{"key": "x", "spec": b"s", "deps": []}]
    s.handle_stimulus(UpdateGraph(client="c", tasks=graph, wanted=["x"], stimulus_id="g"))
    s.handle_stimulus(TaskClaimed(worker=w, keys=["x"], stimulus_id="cl"))
    s.handle_stimulus(TaskErred(worker=w, key="x", exception_text="boom", stimulus_id="e"))
    out = s.handle_stimulus(ClientReleasesKeys(client="c", keys=["x"], stimulus_id="r"))
    released = [i for i in out if isinstance(i, SetState) and i.state == "released"]
    assert released and "deaths" in released[0].fields
    keys = Keys("c")
    (hset,) = [c for c in Translator(keys).to_commands(released[:1]) if c[0] == "HSET"]
    stored = dict(zip(hset[2::2], hset[3::2], strict=True))
    assert codecs.unpack(stored["deaths"]) == []
    for name in ("deaths", "deps"):
        with pytest.raises(TypeError, match="stored form"):
            TaskRecord.encode({name: b""})


def test_the_finish_script_reads_only_fields_of_the_record() -> None:
    named = set(re.findall(r"'(\w+)'", " ".join(re.findall(r"HMGET', [^)]*", scripts.FINISH))))
    assert named and named <= set(FIELDS), named - set(FIELDS)
    assert {"spec", "deps", "state", "chain", "who_has", "value", "score"} <= named
    written = re.findall(r"HSET', (?:tkey|prefix \.\. key), (.*)\)", scripts.FINISH)
    assert written and set(re.findall(r"'(\w+)'", " ".join(written))) <= set(FIELDS) | {
        "processing"
    }
