"""The scheduler driver: atomic batches, fencing, restarts (real Redis, real processes)."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import ClusterFactory
from polling import poll

from redisdask import Client
from redisdask.errors import FencedError
from redisdask.protocol import FreeKeys, KeysRecorded
from redisdask.scheduler.driver import Scheduler, decode_reply
from redisdask.scheduler.instructions import Forget, StoreTask, WorkerMsg
from redisdask.scheduler.translator import Translator, load_state, rejected_graphs
from redisdask.store.bootstrap import ensure_cluster
from redisdask.store.codecs import entry, pack, unpack
from redisdask.store.keyspace import SCHEDULER_GROUP, Keys
from redisdask.store.lease import token_number
from redisdask.store.scripts import CLAIM_PASSED

pytestmark = pytest.mark.timeout(60)


def inc(x: int) -> int:
    return x + 1


def test_forget_and_resubmit_in_one_batch_writes_the_new_task_last(
    redis_url: str, cluster_name: str
) -> None:
    keys = Keys(cluster_name)
    key = keys.task("x")
    cmds = Translator(keys).to_commands(
        [Forget("s", "x"), StoreTask("s", "x", b"spec", [], 1.0, "released")]
    )
    deletes = [i for i, c in enumerate(cmds) if c[0] == "DEL" and key in c]
    writes = [i for i, c in enumerate(cmds) if c[0] == "HSET" and c[1] == key]
    assert deletes and writes and max(deletes) < min(writes)
    assert ["SADD", keys.tasks, "x"] in cmds
    assert not any(c[0] == "SREM" and c[1] == keys.tasks for c in cmds)


def test_a_refused_update_graph_still_names_its_client_and_keys_to_tell() -> None:
    tuple_key = {"key": ["x", 0], "spec": b"s", "deps": []}  # msgpack made the tuple a list
    m = entry(
        [
            {
                "op": "update-graph",
                "client": "c1",
                "tasks": [tuple_key, {"key": "y"}],
                "wanted": ["y", 3],
            },
            {"op": "update-graph", "client": 7, "tasks": [], "wanted": ["z"]},  # nobody to tell
            {"op": "client-releases-keys", "client": "c1", "keys": ["q"]},
        ]
    )["m"]
    [rejected] = rejected_graphs(b"1-0", {b"m": m}, "bad key", "clients")
    assert (rejected.client, rejected.keys, rejected.reason) == ("c1", ["y"], "bad key")
    assert rejected.stimulus_id == "clients:1-0/0"
    assert rejected_graphs(b"1-1", {b"m": b"\xc1"}, "not msgpack") == []
    assert rejected_graphs(b"1-2", {b"junk": b"1"}, "no m") == []


def test_a_workers_messages_keep_their_order_when_free_keys_are_merged(
    redis_url: str, cluster_name: str
) -> None:
    """free-keys of one batch are merged, but never moved past another message to the
    same worker: a keys-recorded made after a free-keys of the same key must reach the
    worker after it (or the worker drops data scattered to it again)."""
    keys = Keys(cluster_name)
    w = "tcp://10.0.0.1:1"
    cmds = Translator(keys).to_commands(
        [
            WorkerMsg("s", w, FreeKeys(["a"])),
            WorkerMsg("s", w, FreeKeys(["d"])),
            WorkerMsg("s", w, KeysRecorded(["d"])),
            WorkerMsg("s", w, FreeKeys(["b"])),
        ]
    )
    (xadd,) = [c for c in cmds if c[0] == "XADD" and c[1] == keys.worker_inbox(w)]
    assert unpack(xadd[-1]) == [
        {"op": "free-keys", "keys": ["a", "d"]},
        {"op": "keys-recorded", "keys": ["d"]},
        {"op": "free-keys", "keys": ["b"]},
    ]


def test_a_batch_and_its_acknowledgement_land_together(redis_url: str, cluster_name: str) -> None:
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    scheduler = Scheduler(redis_url, cluster_name, validate=True)
    scheduler.acquire_lease()
    r.xadd(
        keys.client_stream,
        entry(
            [
                {
                    "op": "update-graph",
                    "client": "c",
                    "wanted": ["x"],
                    "tasks": [{"key": "x", "spec": b"s", "deps": []}],
                }
            ]
        ),
    )
    entries = r.xreadgroup(SCHEDULER_GROUP, "scheduler", {keys.client_stream: ">"})
    scheduler.process(decode_reply(entries))
    assert r.hget(keys.task("x"), "state") == b"queued"
    assert r.zscore(keys.ready, "x") is not None
    assert r.xpending(keys.client_stream, SCHEDULER_GROUP)["pending"] == 0
    assert r.xlen(keys.client_stream) == 0


def test_a_task_restricted_by_host_is_claimed_once_and_leaves_every_ready_set(
    redis_url: str, cluster_name: str
) -> None:
    """The restriction names a host; the scheduler queues the task on both workers there
    and writes their addresses in ``queued_on``, which CLAIM reads to clear the other's
    ready set; a reload keeps them."""
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    a, b = "tcp://10.9.9.9:1", "tcp://10.9.9.9:2"
    for address, name in ((a, "wa"), (b, "wb")):
        r.hset(keys.workers, address, pack({"name": name, "host": "box"}))
    scheduler = Scheduler(redis_url, cluster_name, validate=True)
    scheduler.acquire_lease()
    scheduler.state = scheduler._load()
    task = {"key": "x", "spec": b"s", "deps": [], "workers": ["10.9.9.9"]}
    r.xadd(
        keys.client_stream,
        entry([{"op": "update-graph", "client": "c", "wanted": ["x"], "tasks": [task]}]),
    )
    entries = r.xreadgroup(SCHEDULER_GROUP, "scheduler", {keys.client_stream: ">"})
    scheduler.process(decode_reply(entries))
    assert r.zscore(keys.worker_ready(a), "x") is not None
    assert r.zscore(keys.worker_ready(b), "x") is not None
    assert r.hmget(keys.task("x"), "workers", "queued_on") == [b"10.9.9.9", f"{a} {b}".encode()]
    assert scheduler._load().tasks["x"].queued_on == (a, b)
    claimed, *_ = scheduler.scripts.claim(worker=b, count=5, last_inbox_id="0-0")
    assert [task[0] for task in claimed] == [b"x"]
    assert r.zcard(keys.worker_ready(a)) == r.zcard(keys.worker_ready(b)) == 0


def test_a_fenced_scheduler_cannot_write(redis_url: str, cluster_name: str) -> None:
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    old = Scheduler(redis_url, cluster_name)
    old.acquire_lease()
    r.delete(keys.lease)  # as if the old one paused past its lease
    new = Scheduler(redis_url, cluster_name)
    assert token_number(new.acquire_lease()) > token_number(old.token)  # type: ignore[arg-type]
    with pytest.raises(FencedError):
        old.apply([["SET", keys.prefix + "late-write", 1]])
    assert not r.exists(keys.prefix + "late-write")
    with pytest.raises(FencedError):
        old.lease.renew()
    new.apply([["SET", keys.prefix + "write", 1]])
    assert r.exists(keys.prefix + "write")


def test_killed_scheduler_is_restarted_and_every_computation_finishes(
    make_cluster: ClusterFactory,
) -> None:
    with (
        make_cluster(
            nanny=False,
            n_workers=2,
            scheduler_options={"lease_ttl": 1},
        ) as cluster,
        Client(cluster) as client,
    ):
        assert client.submit(inc, 0).result(timeout=10) == 1
        cluster.scheduler_process.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        cluster.scheduler_process.wait()  # type: ignore[union-attr]
        # submitted while no scheduler runs: the messages wait in Redis
        x = client.submit(inc, 100)
        for _ in range(199):
            x = client.submit(inc, x)
        futures = client.map(inc, range(500))
        assert not x.done()
        cluster.start_scheduler()
        assert x.result(timeout=30) == 300
        assert client.gather(futures) == list(range(1, 501))


def test_standby_takes_over_when_the_lease_expires(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    with (
        make_cluster(
            nanny=False,
            n_workers=1,
            scheduler_options={"lease_ttl": 1},
        ) as cluster,
        Client(cluster) as client,
    ):
        r = redis.Redis.from_url(redis_url)
        keys = Keys(cluster_name)
        first = cluster.scheduler_process
        standby = cluster.start_scheduler(standby=True)
        assert client.submit(inc, 1).result(timeout=10) == 2
        token = r.get(keys.lease)
        first.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        poll(lambda: r.get(keys.lease) not in (None, token))
        assert standby.poll() is None
        assert client.submit(inc, 2).result(timeout=10) == 3
        first.wait()  # type: ignore[union-attr]


def test_a_second_scheduler_without_standby_refuses_to_start(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    with make_cluster(
        nanny=False,
        n_workers=1,
        scheduler_options={"lease_ttl": 1},
    ):
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "redisdask",
                "scheduler",
                redis_url,
                "--cluster",
                cluster_name,
                "--lease-ttl",
                "1",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 1
        assert "start this one with --standby" in result.stderr


def test_an_entry_that_crashes_the_state_machine_is_dead_lettered(
    redis_url: str, cluster_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection in our own state machine (a stand-in for a bug): the batch is
    retried entry by entry, the bad entry dead-lettered, the good ones applied."""
    from redisdask.scheduler.state import SchedulerState, UpdateGraph

    original = SchedulerState._handle_update_graph

    def buggy(self, ev):  # type: ignore[no-untyped-def]
        if any(t["key"] == "poison" for t in ev.tasks):
            raise RuntimeError("injected bug")
        return original(self, ev)

    # handlers are chosen by event type, from the class's table
    monkeypatch.setitem(SchedulerState._HANDLERS, UpdateGraph, buggy)
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    scheduler = Scheduler(redis_url, cluster_name, validate=True)
    scheduler.acquire_lease()
    for key in ("good-1", "poison", "good-2"):
        r.xadd(
            keys.client_stream,
            entry(
                [
                    {
                        "op": "update-graph",
                        "client": "c",
                        "wanted": [key],
                        "tasks": [{"key": key, "spec": b"s", "deps": []}],
                    }
                ]
            ),
        )
    entries = r.xreadgroup(SCHEDULER_GROUP, "scheduler", {keys.client_stream: ">"})
    scheduler.process(decode_reply(entries))
    assert r.hget(keys.task("good-1"), "state") == r.hget(keys.task("good-2"), "state") == b"queued"
    assert not r.exists(keys.task("poison"))
    [(_id, fields)] = r.xrange(keys.dead_letter)
    assert b"injected bug" in fields[b"error"]
    assert r.xpending(keys.client_stream, SCHEDULER_GROUP)["pending"] == 0
    # and its client is told, so that the future of "poison" errs instead of waiting
    news = [m for _id, f in r.xrange(keys.client_events("c")) for m in unpack(f[b"m"])]
    [poisoned] = [m for m in news if m.get("key") == "poison"]
    assert poisoned["op"] == "task-erred" and poisoned["rejected"]
    assert "injected bug" in poisoned["exception_text"]


def test_state_reloaded_from_redis_keeps_restrictions_retries_and_priorities(
    redis_url: str, cluster_name: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    scheduler = Scheduler(redis_url, cluster_name, validate=True)
    scheduler.acquire_lease()
    tasks = [
        {
            "key": "a",
            "spec": b"s",
            "deps": [],
            "retries": 2,
            "priority": 5,
            "workers": ["tcp://10.0.0.1:1"],
        },
        {"key": "b", "spec": b"s", "deps": ["a"]},
    ]
    r.xadd(
        keys.client_stream,
        entry([{"op": "update-graph", "client": "c", "wanted": ["b"], "tasks": tasks}]),
    )
    entries = r.xreadgroup(SCHEDULER_GROUP, "scheduler", {keys.client_stream: ">"})
    scheduler.process(decode_reply(entries))
    before = scheduler.state.tasks
    assert before["a"].state == "no-worker"  # restricted to a worker that is not there
    reloaded = load_state(r, keys, validate=True)
    reloaded.validate_state()
    for key in ("a", "b"):
        t0, t1 = before[key], reloaded.tasks[key]
        assert (t1.state, t1.score, t1.retries, t1.restrict) == (
            t0.state,
            t0.score,
            t0.retries,
            t0.restrict,
        )
    assert reloaded.unrunnable == {reloaded.tasks["a"]}
    assert {d.key for d in reloaded.tasks["b"].dependencies} == {"a"}
    assert reloaded.tasks["b"].who_wants == set()  # client "c" never registered a heartbeat


def test_a_stopped_scheduler_hands_the_lease_over_at_once(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    with make_cluster(nanny=False, n_workers=1) as cluster:
        r = redis.Redis.from_url(redis_url)
        keys = Keys(cluster_name)
        poll(lambda: r.get(keys.lease) is not None)
        token = r.get(keys.lease)
        first = cluster.scheduler_process
        first.terminate()  # type: ignore[union-attr]
        assert first.wait(timeout=15) == 0  # type: ignore[union-attr]
        assert r.get(keys.lease) != token  # released, not left to expire (5 s)
        cluster.start_scheduler()
        with Client(cluster) as client:
            assert client.submit(inc, 1).result(timeout=15) == 2


@pytest.mark.parametrize("behind", [0, 7])
def test_a_worker_that_said_goodbye_as_its_heartbeat_went_is_not_recorded_dead(
    redis_url: str, cluster_name: str, behind: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A closing worker writes its goodbye, then deletes its ``alive`` key.  A look for
    the dead that falls between the two writes and the scheduler's next read must apply
    the goodbye first: the worker left, it did not die, and is not logged dead (it was,
    at a LocalCluster's close).  Also when the goodbye waits behind more entries than one
    read takes (``behind``; it was recorded dead)."""
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    scheduler = Scheduler(redis_url, cluster_name, validate=True, batch_size=2)
    scheduler.acquire_lease()
    worker = "tcp://10.0.0.1:9000"
    info = {"name": "leaving", "nthreads": 1}
    r.hset(keys.workers, worker, pack(info))
    r.set(keys.worker_alive(worker), 1, px=60_000)
    r.xadd(keys.worker_stream, entry([{"op": "add-worker", "worker": worker, "info": info}]))
    scheduler.look_for_the_dead()  # nobody is dead: nothing read, nothing applied
    reply = r.xreadgroup(SCHEDULER_GROUP, "scheduler", {keys.worker_stream: ">"})
    scheduler.process(decode_reply(reply))
    assert worker in scheduler.state.workers
    scheduler.watch.trust_heartbeats_at = 0.0  # (a scheduler that has run a while)

    for _ in range(behind):  # (its last holding report, say)
        r.xadd(keys.worker_stream, entry([{"op": "holding", "worker": worker, "keys": []}]))
    goodbye = {"op": "remove-worker", "worker": worker, "reason": "closed"}
    r.xadd(keys.worker_stream, entry([goodbye]))  # what Worker.close does, in its order
    r.delete(keys.worker_alive(worker))
    with caplog.at_level(logging.INFO, "redisdask.scheduler"):
        scheduler.look_for_the_dead()

    assert "is dead" not in caplog.text
    assert f"worker {worker} left: it said goodbye" in caplog.text
    assert worker not in scheduler.state.workers and not r.hexists(keys.workers, worker)
    assert r.xlen(keys.deaths) == 0
    kinds = [unpack(f[b"m"])["kind"] for _, f in r.xrange(keys.events)]
    assert "worker-left" in kinds and "worker-died" not in kinds
    assert r.xpending(keys.worker_stream, SCHEDULER_GROUP)["pending"] == 0


def test_a_client_that_said_goodbye_is_logged_as_closed_not_as_silent(
    redis_url: str, cluster_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A closing client writes its goodbye and deletes its ``alive`` key in one write.  A
    look for the dead between that write and the scheduler's next read applies the
    goodbye, and says the client closed: it did not stop heartbeating."""
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    scheduler = Scheduler(redis_url, cluster_name, validate=True)
    scheduler.acquire_lease()
    client = Client(redis_url, cluster_name=cluster_name, set_as_default=False)
    client.submit(inc, 1, key="wanted")
    poll(lambda: r.xlen(keys.client_stream) > 0)
    reply = r.xreadgroup(SCHEDULER_GROUP, "scheduler", {keys.client_stream: ">"})
    scheduler.process(decode_reply(reply))
    assert client.id in scheduler.state.clients
    scheduler.trust_clients_at = 0.0  # (a scheduler that has run a while)

    client.close()
    with caplog.at_level(logging.INFO, "redisdask.scheduler"):
        scheduler.look_for_the_dead()

    assert client.id not in scheduler.state.clients and "wanted" not in scheduler.state.tasks
    assert "stopped heartbeating" not in caplog.text
    assert f"client {client.id} closed: it said goodbye" in caplog.text


def test_a_script_that_ends_without_close_says_goodbye(
    redis_url: str, cluster_name: str, tmp_path: Path, make_cluster: ClusterFactory
) -> None:
    """As distributed closes its client at exit: a script that never calls ``close()``
    says goodbye as it ends, so its keys are released at once (not after the 30 s client
    TTL) and the scheduler does not log it as a client that stopped heartbeating."""
    with make_cluster(nanny=False, n_workers=1, log_directory=tmp_path):  # fmt: skip
        code = (
            "from redisdask import Client\n"
            f"c = Client({redis_url!r}, {cluster_name!r})\n"
            "print(c.id, c.submit(sum, [1, 2]).result(timeout=30))\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        )
        client_id, result = done.stdout.split()
        assert result == "3", done.stderr
        r = redis.Redis.from_url(redis_url)
        poll(lambda: not r.hexists(Keys(cluster_name).clients, client_id), timeout=10)
    assert "stopped heartbeating" not in (tmp_path / "scheduler.log").read_text()


def _where(_data: Any, _i: int = 0) -> str:
    from redisdask import get_worker

    return str(get_worker().address)


def _blocked(name: str) -> None:
    from redisdask import Event

    Event(name).wait(60)


def test_a_dependent_runs_where_its_large_data_is_unless_that_worker_is_busy(
    client: Client, redis_url: str, cluster_name: str
) -> None:
    """Placement by data (redisdask/scheduler/decide.py) on real processes: a 20 MB array scattered
    to A draws its dependents to A; while A's one thread is taken, idle B takes them
    (after ``PLACED_PATIENCE_MS``: the task is sticky, its cost unknown yet)."""
    import numpy as np

    from redisdask import Event

    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    a, b = sorted(client.scheduler_info()["workers"])
    [x] = client.scatter([np.ones(2_500_000)], workers=[a])
    gate = Event(f"gate-{cluster_name}")
    blocker = client.submit(_blocked, gate.name, workers=[a], pure=False)
    poll(lambda: r.sismember(keys.worker_processing(a), blocker.key), timeout=10)
    assert client.submit(_where, x, 0).result(timeout=20) == b  # A is busy: B takes it
    gate.set()
    blocker.result(timeout=20)
    ran = [client.submit(_where, x, i).result(timeout=20) for i in range(1, 4)]
    assert ran == [a, a, a]
    assert r.zcard(keys.placed) == 0


def test_an_idle_worker_leaves_a_cheap_task_on_big_data_to_its_busy_holder(
    client: Client, redis_url: str, cluster_name: str
) -> None:
    """A task of microseconds on 20 MB (0.3 s to move) is sticky (``decide.sticky``):
    while its holder A runs something else, idle B passes it over (its record's
    ``passed_over``) instead of fetching the 20 MB, and takes it only once A kept it
    ``PLACED_PATIENCE_MS``.  Before, B took it at once (bench/balance.py's shuffle moved
    whole groups for splits of a millisecond)."""
    import numpy as np

    from redisdask import Event

    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    a, b = sorted(client.scheduler_info()["workers"])
    [x] = client.scatter([np.ones(2_500_000)], workers=[a])
    assert client.submit(_where, x, -1).result(timeout=20) == a  # (its cost: microseconds)
    gate = Event(f"gate-{cluster_name}")
    blocker = client.submit(_blocked, gate.name, workers=[a], pure=False)
    poll(lambda: r.sismember(keys.worker_processing(a), blocker.key), timeout=10)
    cheap = client.submit(_where, x, 1)
    poll(lambda: r.hget(keys.task(cheap.key), "passed_over") is not None, timeout=10)
    assert cheap.result(timeout=20) == b  # A never came back: B took it after the patience
    gate.set()
    blocker.result(timeout=20)


def test_a_sticky_task_waits_for_its_busy_worker_a_plain_one_does_not(
    redis_url: str, cluster_name: str
) -> None:
    """CLAIM's rule for tasks placed by data, on real Redis (docs/design.md, "Claim").
    ``big`` (10 MB) and ``small`` (100 kB) are on A, whose one thread holds a claim: A
    is busy.  Idle B takes ``merge`` (0.5 s of work on ``small``, 0.1 s to move) at once,
    but passes ``split`` over (a millisecond of work on ``big``, 0.2 s to move:
    ``decide.sticky``), leaving it to A; B takes it once it was passed over for
    ``PLACED_PATIENCE_MS`` (A stays busy), and takes another sticky task at once, without
    passing it over, from a paused A."""
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    a, b = "tcp://10.9.9.9:1", "tcp://10.9.9.9:2"
    for address in (a, b):
        r.hset(keys.workers, address, pack({"name": address, "nthreads": 1}))
        r.hset(keys.heartbeats, address, pack({"status": "running"}))
    r.hset(keys.durations, mapping={"split": "0.001", "merge": "0.5"})
    scheduler = Scheduler(redis_url, cluster_name, validate=True)
    scheduler.acquire_lease()
    scheduler.state = scheduler._load()

    def submit(tasks: dict[str, list[str]]) -> None:
        graph = [{"key": k, "spec": b"s", "deps": deps} for k, deps in tasks.items()]
        message = {"op": "update-graph", "client": "c", "wanted": list(tasks), "tasks": graph}
        r.xadd(keys.client_stream, entry([message]))
        step()

    def step() -> None:
        streams = {keys.client_stream: ">", keys.worker_stream: ">"}
        scheduler.process(decode_reply(r.xreadgroup(SCHEDULER_GROUP, "scheduler", streams)))

    def claim(worker: str, count: int = 5) -> tuple[list[bytes], int]:
        claimed, _, _, flags, _ = scheduler.scripts.claim(
            worker=worker, count=count, last_inbox_id="0-0"
        )
        return [t[0] for t in claimed], flags

    submit({"big": [], "small": [], "blocker": []})
    assert claim(a, 3)[0] == [b"big", b"small", b"blocker"]
    for key, nbytes in (("big", 10_000_000), ("small", 100_000)):
        finished = {"op": "task-finished", "worker": a, "key": key, "nbytes": nbytes}
        r.xadd(keys.worker_stream, entry([finished]))
    step()
    submit({"split-1": ["big"], "merge-1": ["small"]})
    assert set(r.zrange(keys.worker_ready(a), 0, -1)) == {b"merge-1", b"split-1"}
    assert r.hmget(keys.task("split-1"), "sticky", "queued_on") == [b"1", a.encode()]
    assert r.hget(keys.task("merge-1"), "sticky") == b""

    taken, flags = claim(b)
    assert taken == [b"merge-1"]  # A is busy (blocker): B takes it
    assert flags & CLAIM_PASSED and r.hget(keys.task("split-1"), "passed_over")
    assert r.hget(keys.task("split-1"), "state") == b"queued"
    # passed over for PLACED_PATIENCE_MS (A, busy, does not claim): B takes it
    poll(lambda: claim(b, 1)[0] == [b"split-1"], timeout=10)

    submit({"split-2": ["big"]})
    assert r.hget(keys.task("split-2"), "sticky") == b"1"
    r.hset(keys.heartbeats, a, pack({"status": "paused"}))
    assert claim(b) == ([b"split-2"], 0)
    assert r.hget(keys.task("split-2"), "passed_over") is None
