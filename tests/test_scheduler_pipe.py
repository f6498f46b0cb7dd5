"""The scheduler's write in flight and the read behind it (redisdask/scheduler/pipe.py):
the crash windows it opens keep "every entry is acknowledged by the write that applies
it", and no batch computed on a write that did not land is ever written (real Redis; the
driver's own steps, in the order its lead loop takes them)."""

from __future__ import annotations

import pytest
import redis
from polling import poll

from redisdask.errors import FencedError
from redisdask.scheduler.driver import Scheduler
from redisdask.store.bootstrap import ensure_cluster
from redisdask.store.codecs import entry
from redisdask.store.keyspace import SCHEDULER_GROUP, Keys

pytestmark = pytest.mark.timeout(60)


def submit(r: redis.Redis, keys: Keys, key: str) -> bytes:
    """One client entry submitting task ``key``; its stream id."""
    graph = {"op": "update-graph", "client": "c", "wanted": [key],
             "tasks": [{"key": key, "spec": b"s", "deps": []}]}  # fmt: skip
    return r.xadd(keys.client_stream, entry([graph]))


def pending_ids(r: redis.Redis, keys: Keys) -> list[bytes]:
    return [
        p["message_id"] for p in r.xpending_range(keys.client_stream, SCHEDULER_GROUP, "-", "+", 10)
    ]


def entries_read(
    redis_url: str, cluster_name: str, *tasks: str, batch_size: int = 100
) -> tuple[redis.Redis, Keys, Scheduler]:
    """A leading scheduler that has read (a blocking read) the entries submitting
    ``tasks``, ``batch_size`` at most."""
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    scheduler = Scheduler(redis_url, cluster_name, batch_size=batch_size, validate=True)
    scheduler.acquire_lease()
    scheduler.state = scheduler._load()
    for key in tasks:
        submit(r, keys, key)
    assert scheduler._read(pending=False, block_ms=100)
    return r, keys, scheduler


def two_entries_read(redis_url: str, cluster_name: str) -> tuple[redis.Redis, Keys, Scheduler]:
    """A leading scheduler that has read the entry of task x (a blocking read) and,
    ahead, the entry of task y (the read sent behind nothing, as the loop does)."""
    r, keys, scheduler = entries_read(redis_url, cluster_name, "x", "y", batch_size=1)
    scheduler._send(None, read=True)
    return r, keys, scheduler


def one_entry_read(redis_url: str, cluster_name: str) -> tuple[redis.Redis, Keys, Scheduler]:
    """A leading scheduler that has read the entry of task x, and nothing more."""
    return entries_read(redis_url, cluster_name, "x")


def taken_over(redis_url: str, cluster_name: str, r: redis.Redis, keys: Keys) -> Scheduler:
    """A standby that took the lease (the leader's ran out, or it died)."""
    r.delete(keys.lease)
    standby = Scheduler(redis_url, cluster_name, validate=True)
    standby.acquire_lease()
    return standby


def applies_what_is_pending(r: redis.Redis, keys: Keys, leader: Scheduler) -> None:
    """The new leader loads the state, re-reads the pending entries and applies them."""
    leader.state = leader._load()
    assert leader._read(pending=True, block_ms=100)
    while leader.ahead:
        leader.process(leader.ahead.popleft())
    assert pending_ids(r, keys) == []


def test_a_scheduler_killed_with_a_write_in_flight_and_the_next_read_done_loses_nothing(
    redis_url: str, cluster_name: str
) -> None:
    """Batch x's write is in flight and the entry of y was read behind it when the
    scheduler dies: x's write landed with its acknowledgement, y's entry is pending, and
    the next scheduler applies y, and only y (x is not applied twice)."""
    r, keys, old = two_entries_read(redis_url, cluster_name)
    old.process(old.ahead.popleft(), ahead=True)  # x computed, y collected, x's write sent
    assert old.pipe.in_flight and [e.id for e in old.ahead[0]] == pending_ids(r, keys)[-1:]
    poll(lambda: r.hget(keys.task("x"), "state") == b"queued", timeout=10)
    y_id = pending_ids(r, keys)
    assert len(y_id) == 1  # x acknowledged by the write that applied it; y read, pending
    old.pipe.connection.disconnect()  # killed: never collected, y never computed
    new = taken_over(redis_url, cluster_name, r, keys)
    new.state = new._load()
    assert set(new.state.tasks) == {"x"}
    assert new._read(pending=True, block_ms=100)
    assert [e.id for batch in new.ahead for e in batch] == y_id  # only y is re-read
    new.process(new.ahead.popleft())
    assert r.hget(keys.task("y"), "state") == b"queued"
    assert pending_ids(r, keys) == [] and r.xlen(keys.client_stream) == 0
    assert not new._read(pending=True, block_ms=100)
    assert set(new.state.tasks) == {"x", "y"}


def test_a_fenced_write_in_flight_stops_the_scheduler_before_the_next_batch_is_written(
    redis_url: str, cluster_name: str
) -> None:
    """A standby took over before batch x's write ran: that write is refused (FENCED)
    while batch y is computed on the state that assumed it; y's write is never sent, and
    both entries stay pending for the new leader."""
    r, keys, old = two_entries_read(redis_url, cluster_name)
    standby = taken_over(redis_url, cluster_name, r, keys)
    old.process(old.ahead.popleft(), ahead=True)  # x's write in flight, to be refused
    assert len(old.ahead) == 1
    with pytest.raises(FencedError):
        old.process(old.ahead.popleft(), ahead=True)  # y computed; x's reply: fenced
    assert not old.pipe.in_flight
    assert not r.exists(keys.task("x")) and not r.exists(keys.task("y"))
    assert len(pending_ids(r, keys)) == 2
    applies_what_is_pending(r, keys, standby)
    assert r.hget(keys.task("x"), "state") == r.hget(keys.task("y"), "state") == b"queued"


def test_a_write_in_flight_that_fails_reloads_the_state_without_the_batch_after_it(
    redis_url: str, cluster_name: str
) -> None:
    """Batch x's write fails in Redis (a command error) while batch y is computed: the
    state is reloaded from Redis, so it holds neither x nor y, and y's write is never
    sent; y's entry stays pending."""
    r, keys, scheduler = two_entries_read(redis_url, cluster_name)
    r.set(keys.task("x"), "not a hash")  # x's HSET fails: WRONGTYPE
    scheduler.process(scheduler.ahead.popleft(), ahead=True)
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        scheduler.process(scheduler.ahead.popleft(), ahead=True)
    assert "y" not in scheduler.state.tasks and "x" not in scheduler.state.tasks
    assert not r.exists(keys.task("y"))
    assert len(pending_ids(r, keys)) == 2  # x's acknowledgement went with its failed write


def test_a_refused_write_in_flight_is_written_again_before_the_next(
    redis_url: str, cluster_name: str
) -> None:
    """A write in flight that Redis did not run (here: its script was flushed, NOSCRIPT;
    a BUSY or OOM refusal takes the same way) is written again, synchronously, before
    the next batch's: both land, in order, each with its acknowledgement."""
    r, keys, scheduler = two_entries_read(redis_url, cluster_name)
    scheduler._send([["SET", keys.prefix + "first", 1]], read=False)  # (loads the script)
    scheduler._collect()
    r.script_flush()
    scheduler.process(scheduler.ahead.popleft(), ahead=True)
    scheduler.process(scheduler.ahead.popleft(), ahead=True)
    scheduler._collect()
    assert r.hget(keys.task("x"), "state") == r.hget(keys.task("y"), "state") == b"queued"
    assert pending_ids(r, keys) == [] and set(scheduler.state.tasks) == {"x", "y"}


def blocked_reader(r: redis.Redis, scheduler: Scheduler) -> bool:
    """Whether the connection of the scheduler's write pipe is blocked in XREADGROUP."""
    port = scheduler.pipe.connection._sock.getsockname()[1]
    return any(
        c["addr"].endswith(f":{port}") and c["cmd"] == "xreadgroup" and "b" in c["flags"]
        for c in r.client_list()
    )


def test_with_nothing_left_to_compute_the_wait_for_the_next_entry_goes_behind_the_write(
    redis_url: str, cluster_name: str
) -> None:
    """One entry at a time (a sequential ``submit().result()``): the blocking read the
    loop sends next goes behind the batch's write, on its connection, in one packet.  The
    write lands while the read waits, and an entry that comes meanwhile is read at once,
    not at the read's timeout."""
    r, keys, scheduler = one_entry_read(redis_url, cluster_name)
    scheduler.process(scheduler.ahead.popleft(), ahead=False, wait_ms=20_000)
    assert scheduler.pipe.waiting
    poll(lambda: r.hget(keys.task("x"), "state") == b"queued", timeout=10)
    poll(lambda: blocked_reader(r, scheduler), timeout=10)
    assert scheduler.pipe.waiting  # (the driver has collected nothing yet)
    y_id = submit(r, keys, "y")
    scheduler._collect()  # returns with y: the test's own timeout is far below 20 s
    assert [e.id for batch in scheduler.ahead for e in batch] == [y_id]
    assert not scheduler.pipe.in_flight and pending_ids(r, keys) == [y_id]


def test_a_write_fenced_while_the_read_behind_it_waits_stops_the_scheduler_losing_nothing(
    redis_url: str, cluster_name: str
) -> None:
    """A standby took over before batch x's write ran, and the read behind that write
    waits: the write is refused (FENCED), the entry y the read delivered is not computed
    by the fenced scheduler, and the new leader applies x and y from the pending entries."""
    r, keys, old = one_entry_read(redis_url, cluster_name)
    standby = taken_over(redis_url, cluster_name, r, keys)
    old.process(old.ahead.popleft(), ahead=False, wait_ms=20_000)
    poll(lambda: blocked_reader(r, old), timeout=10)
    submit(r, keys, "y")
    with pytest.raises(FencedError):
        old._collect()
    assert not old.ahead and not old.pipe.in_flight
    assert not r.exists(keys.task("x")) and not r.exists(keys.task("y"))
    assert len(pending_ids(r, keys)) == 2  # both delivered to the old leader, neither acked
    applies_what_is_pending(r, keys, standby)
    assert r.hget(keys.task("x"), "state") == r.hget(keys.task("y"), "state") == b"queued"


def test_a_fenced_write_is_said_though_the_read_behind_it_failed(
    redis_url: str, cluster_name: str
) -> None:
    """The write behind which a read waits is refused (FENCED), and the read then fails
    too (here: its stream deleted while it waited, which Redis answers with an error):
    the scheduler learns that it was fenced, not only that a read failed."""
    r, keys, old = one_entry_read(redis_url, cluster_name)
    taken_over(redis_url, cluster_name, r, keys)
    old.process(old.ahead.popleft(), ahead=False, wait_ms=20_000)
    poll(lambda: blocked_reader(r, old), timeout=10)
    r.delete(keys.client_stream)
    with pytest.raises(FencedError):
        old._collect()
    assert not r.exists(keys.task("x"))


def test_a_scheduler_killed_while_the_read_behind_its_write_waits_loses_nothing(
    redis_url: str, cluster_name: str
) -> None:
    """x's write landed and the read behind it took y's entry when the scheduler dies
    (never collected): y is pending, and the next leader applies y, and only y."""
    r, keys, old = one_entry_read(redis_url, cluster_name)
    old.process(old.ahead.popleft(), ahead=False, wait_ms=20_000)
    poll(lambda: blocked_reader(r, old), timeout=10)
    y_id = submit(r, keys, "y")
    poll(lambda: pending_ids(r, keys) == [y_id], timeout=10)  # delivered to the dead one
    assert r.hget(keys.task("x"), "state") == b"queued"
    old.pipe.connection.disconnect()  # killed: y never computed
    new = taken_over(redis_url, cluster_name, r, keys)
    new.state = new._load()
    assert set(new.state.tasks) == {"x"}
    applies_what_is_pending(r, keys, new)
    assert set(new.state.tasks) == {"x", "y"} and r.hget(keys.task("y"), "state") == b"queued"
    assert r.xlen(keys.client_stream) == 0
