"""Malformed records in Redis, planted as a stranger (or a bug) would write them: a task
hash without ``state``, a score that is no number, a workers entry that is no msgpack,
garbage stream entries.  Every reader survives them; the scheduler skips them, logs each
once, dead-letters a copy, errs the tasks whose record is lost (their futures raise,
naming the record: no hang), and finishes the rest of the work with every result right.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import ClusterFactory
from mixed_state import CLIENT, build
from polling import poll
from tasklib import wait_for_file

from redisdask import Client
from redisdask.errors import SchedulerRejectedError
from redisdask.observe.snapshot import read_snapshot
from redisdask.scheduler.quarantine import Quarantined
from redisdask.scheduler.translator import load_state
from redisdask.store.codecs import unpack
from redisdask.store.keyspace import Keys

pytestmark = pytest.mark.timeout(120)

NOT_MSGPACK = b"\xc1\xc1 never msgpack"  # 0xc1 is the one byte msgpack never uses


def inc(x: int) -> int:
    return x + 1


def first_char(path: str) -> str:
    return path[0]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "redisdask", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, COLUMNS="160"),
    )


def test_load_state_skips_each_malformed_record_and_says_what_was_wrong(
    redis_url: str, cluster_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ours = build(r, keys, 200)
    queued = sorted(k for k, ts in ours.tasks.items() if ts.state == "queued")
    waiting = sorted(k for k, ts in ours.tasks.items() if ts.state == "waiting")
    no_state, bad_score, bad_deps = queued[0], queued[1], waiting[0]
    r.hdel(keys.task(no_state), "state")
    r.hset(keys.task(bad_score), "score", "not-a-number")
    r.hset(keys.task(bad_deps), "deps", NOT_MSGPACK)
    worker = sorted(ours.workers)[0]
    r.hset(keys.workers, worker, NOT_MSGPACK)
    r.hset(keys.meta, "seq", "twelve")
    r.sadd(keys.rebalances, "rb-1")
    r.hset(keys.rebalance("rb-1"), mapping={"client": "c", "status": "moving", "moves": "x"})

    found: list[Quarantined] = []
    with caplog.at_level(logging.WARNING, "redisdask.scheduler"):
        state = load_state(r, keys, quarantined=found)
    by_name = {q.name: q for q in found}
    assert set(by_name) == {no_state, bad_score, bad_deps, worker, None}
    assert [q.kind for q in found if q.name is None] == ["rebalance"]
    assert by_name[no_state].error.field == "state"
    assert by_name[bad_score].error.field == "score"
    assert "not-a-number" in by_name[bad_score].error.evidence
    assert by_name[bad_deps].error.field == "deps"
    assert by_name[worker].kind == "worker" and by_name[worker].error.field == "info"
    # each stands in the state as a task nothing will run until BadRecord errs it
    for key in (no_state, bad_score, bad_deps):
        assert state.tasks[key].state == "released" and not state.tasks[key].has_spec
    assert state.workers[worker].info == {}  # registered still: watched, its work recovered
    # the good records are loaded as they were
    good = set(ours.tasks) - {no_state, bad_score, bad_deps}
    assert all(state.tasks[k].state == ours.tasks[k].state for k in good)
    text = caplog.text
    for key in (no_state, bad_score, bad_deps):
        assert keys.task(key) in text
    assert "'score'" in text and "not-a-number" in text and "XRANGE" in text
    assert "seq" in text and "twelve" in text

    # the repair (the driver writes it fenced, with the tasks' errors; here as it is)
    pipe = r.pipeline(transaction=True)
    for one in found:
        for command in one.commands(keys):
            pipe.execute_command(*command)
    pipe.execute()
    dead = [f for _, f in r.xrange(keys.dead_letter)]
    assert {f[b"stream"] for f in dead} == {
        keys.task(no_state).encode(), keys.task(bad_score).encode(),
        keys.task(bad_deps).encode(), f"{keys.workers}/{worker}".encode(),
        keys.rebalance("rb-1").encode(),
    }  # fmt: skip
    assert all(f[b"id"] == b"record" for f in dead)
    assert unpack(r.hget(keys.workers, worker)) == {}
    rebalance = r.hgetall(keys.rebalance("rb-1"))
    assert rebalance[b"status"] == b"done" and b"malformed" in rebalance[b"failed"]
    caplog.clear()
    again: list[Quarantined] = []
    with caplog.at_level(logging.WARNING, "redisdask.scheduler"):
        load_state(r, keys, quarantined=again)
    assert again == [] and "skipped a malformed" not in caplog.text  # repaired: logged once


def test_a_restarted_scheduler_skips_malformed_records_and_the_good_work_finishes(
    redis_url: str, cluster_name: str, tmp_path: Path, make_cluster: ClusterFactory
) -> None:
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    gate = tmp_path / "gate"
    with (
        make_cluster(
            nanny=False,
            n_workers=2,
            threads_per_worker=2,
            log_directory=tmp_path / "logs",
        ) as cluster,
        Client(cluster) as client,
    ):
        assert client.gather(client.map(inc, range(10))) == list(range(1, 11))
        blocked = client.submit(wait_for_file, str(gate), key="blocked")
        good = client.submit(first_char, blocked, key="good-dependent")
        no_state = client.submit(first_char, blocked, key="victim-no-state")
        behind = client.submit(inc, 1, key="behind")  # (a dependency of the next)
        bad_score = client.submit(lambda a, b: a, blocked, behind, key="victim-score")
        after_bad = client.submit(len, no_state, key="victim-dependent")
        poll(lambda: r.hget(keys.task("blocked"), "state") == b"processing")
        poll(lambda: r.hget(keys.task("victim-dependent"), "state") == b"waiting")

        cluster.scheduler_process.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        cluster.scheduler_process.wait(10)  # type: ignore[union-attr]
        r.hdel(keys.task("victim-no-state"), "state")
        r.hset(keys.task("victim-score"), "score", "very high")
        worker = sorted(a.decode() for a in r.hkeys(keys.workers))[0]
        r.hset(keys.workers, worker, NOT_MSGPACK)
        r.xadd(keys.client_stream, {"m": NOT_MSGPACK})
        r.xadd(keys.worker_stream, {"garbage": b"\x00" * 100})
        r.hset(keys.summary, "finished_total", "many")

        # the readers survive the records while they are bad
        status = run_cli("status", redis_url, "--cluster", cluster_name)
        assert status.returncode == 0, status.stderr
        snap = read_snapshot(r, keys)
        assert worker in {w.address for w in snap.workers}
        for args in (
            ("task", "victim-no-state"),
            ("task", "victim-score"),
            ("worker", worker),
            ("keys",),
            ("events",),
        ):
            done = run_cli("inspect", *args, redis_url, "--cluster", cluster_name)
            assert done.returncode == 0, (args, done.stdout, done.stderr)
        assert (
            "state"
            in run_cli(
                "inspect", "task", "victim-score", redis_url, "--cluster", cluster_name, "--json"
            ).stdout
        )

        start_another_scheduler(cluster, r, keys)

        # the tasks whose record was lost err, naming it, and so does a dependent
        for future, field in ((no_state, "'state'"), (bad_score, "'score'")):
            with pytest.raises(SchedulerRejectedError, match=field) as info:
                future.result(timeout=30)
            assert future.key in str(info.value) and "dead-letter" in str(info.value)
        with pytest.raises(SchedulerRejectedError, match="victim-no-state"):
            after_bad.result(timeout=30)
        # the good work finishes, every result right
        gate.write_text("go")
        assert good.result(timeout=30) == str(gate)[0]
        assert blocked.result(timeout=30) == str(gate)
        assert behind.result(timeout=30) == 2
        assert client.gather(client.map(inc, range(50))) == list(range(1, 51))

        # copies in the dead-letter stream, each saying what was wrong
        dead = {
            f[b"stream"].decode(): f
            for _, f in r.xrange(keys.dead_letter)  # (stream entries and records)
        }
        assert b"'state'" in dead[keys.task("victim-no-state")][b"error"]
        copy = unpack(dead[keys.task("victim-score")][b"sample"])
        assert copy[b"score"] == b"very high" and copy[b"spec"]  # the whole record
        assert f"{keys.workers}/{worker}" in dead
        assert {keys.client_stream, keys.worker_stream} <= set(dead)

        # logged once: a second restart finds nothing left to skip
        log = tmp_path / "logs" / "scheduler.log"
        assert log.read_text().count("skipped a malformed") == 3
        cluster.scheduler_process.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        cluster.scheduler_process.wait(10)  # type: ignore[union-attr]
        start_another_scheduler(cluster, r, keys)
        assert client.gather(client.map(inc, range(5))) == list(range(1, 6))
        assert log.read_text().count("skipped a malformed") == 3
        assert "Traceback" not in log.read_text()

        keys_json = run_cli("inspect", "keys", redis_url, "--cluster", cluster_name, "--json")
        assert keys_json.returncode == 0 and json.loads(keys_json.stdout)


def test_load_state_quarantines_records_of_the_wrong_type(
    redis_url: str, cluster_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A client's ``wants`` set, a task hash and a rebalance record that are strings (each
    read raised WRONGTYPE, and every scheduler start exited 1): skipped, dead-lettered,
    repaired.  The client whose set was lost is given what nobody else wants, so that no
    future of it waits for news nobody sends."""
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ours = build(r, keys, 200)
    wants = keys.client_wants(CLIENT)
    r.delete(wants)
    r.set(wants, "not a set")
    victim = sorted(k for k, ts in ours.tasks.items() if ts.state == "queued")[0]
    r.delete(keys.task(victim))
    r.set(keys.task(victim), "not a hash")
    r.sadd(keys.rebalances, "rb-2")
    r.set(keys.rebalance("rb-2"), "not a hash")

    found: list[Quarantined] = []
    with caplog.at_level(logging.WARNING, "redisdask.scheduler"):
        state = load_state(r, keys, validate=True, quarantined=found)
    by_kind = {q.kind: q for q in found}
    assert sorted(by_kind) == ["rebalance", "task", "wants"] and len(found) == 3
    assert by_kind["wants"].error.field == "type" and "string" in by_kind["wants"].error.evidence
    assert by_kind["task"].name == victim and by_kind["task"].error.field == "type"
    # every task the client wanted is its own again (and what nobody else wanted)
    wanted = {k for k, ts in ours.tasks.items() if CLIENT in ts.who_wants} - {victim}
    assert wanted <= {ts.key for ts in state.clients[CLIENT]}
    assert all(CLIENT in state.tasks[k].who_wants for k in wanted)
    assert wants in caplog.text and "not a set" not in caplog.text  # (its copy is dead-lettered)

    pipe = r.pipeline(transaction=True)
    for one in found:
        for command in one.commands(keys):
            pipe.execute_command(*command)
    pipe.execute()
    dead = {f[b"stream"].decode(): f for _, f in r.xrange(keys.dead_letter)}
    assert {wants, keys.task(victim), keys.rebalance("rb-2")} <= set(dead)
    assert unpack(dead[wants][b"sample"])[b"type"] == b"string"
    assert r.type(wants) == b"set" and {m.decode() for m in r.smembers(wants)} >= wanted
    again: list[Quarantined] = []
    reloaded = load_state(r, keys, validate=True, quarantined=again)
    assert again == []
    assert wanted <= {ts.key for ts in reloaded.clients[CLIENT]}


@pytest.fixture
def one_worker(make_cluster: ClusterFactory, tmp_path: Path) -> Iterator[tuple[Any, Client]]:
    """A cluster of one bare worker, its logs in ``tmp_path / "logs"``, and a client."""
    with (
        make_cluster(nanny=False, n_workers=1, log_directory=tmp_path / "logs") as cluster,
        Client(cluster) as client,
    ):  # fmt: skip
        yield cluster, client


def start_another_scheduler(cluster: Any, r: redis.Redis, keys: Keys) -> None:
    """Start a scheduler and wait until it leads (a lease token of its own)."""
    old_token = r.get(keys.lease)
    cluster.start_scheduler()
    poll(lambda: r.get(keys.lease) not in (None, old_token), timeout=30)


def killed_under_a_pair(client: Client, cluster: Any, keys: Keys, gate: Path) -> tuple[Any, Any]:
    """A task that waits for ``gate`` and its dependent, the first one running, and the
    scheduler killed with -9 under them."""
    r = redis.Redis.from_url(client.redis_url)
    blocked = client.submit(wait_for_file, str(gate), key="blocked")
    after = client.submit(first_char, blocked, key="after")
    poll(lambda: r.hget(keys.task("blocked"), "state") == b"processing")
    cluster.scheduler_process.send_signal(signal.SIGKILL)
    cluster.scheduler_process.wait(10)
    return blocked, after


def test_a_scheduler_starts_over_a_wants_set_of_the_wrong_type_and_the_client_gets_its_result(
    redis_url: str, cluster_name: str, tmp_path: Path, one_worker: tuple[Any, Client]
) -> None:
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    gate = tmp_path / "gate"
    cluster, client = one_worker
    blocked, after = killed_under_a_pair(client, cluster, keys, gate)
    r.delete(keys.client_wants(client.id))
    r.set(keys.client_wants(client.id), "garbage")

    start_another_scheduler(cluster, r, keys)
    gate.write_text("go")
    assert after.result(timeout=30) == str(gate)[0]
    assert blocked.result(timeout=30) == str(gate)
    assert client.submit(inc, 1).result(timeout=30) == 2
    assert cluster.scheduler_process.poll() is None  # type: ignore[union-attr]
    log = (tmp_path / "logs" / "scheduler.log").read_text()
    assert log.count("skipped a malformed wants record") == 1 and "Traceback" not in log


def test_a_scheduler_rebuilds_cluster_keys_of_the_wrong_type_and_the_work_goes_on(
    redis_url: str, cluster_name: str, tmp_path: Path, one_worker: tuple[Any, Client]
) -> None:
    """The index of the tasks, the workers, clients, durations and heartbeats hashes and
    the holders set overwritten with values of other types while no scheduler runs (each
    read raised WRONGTYPE: every scheduler start stopped on the first one, with a bare
    traceback).  The next scheduler copies each to the dead-letter stream, rebuilds it
    from the records it indexes, and the computation under way finishes on the same
    worker."""
    from redisdask import Variable

    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    gate = tmp_path / "gate"
    cluster, client = one_worker
    (worker,) = client.scheduler_info()["workers"]
    kept = Variable("kept", client=client)
    kept.set(client.submit(inc, 41, key="kept-value"))
    _, after = killed_under_a_pair(client, cluster, keys, gate)
    tasks = {m.decode() for m in r.smembers(keys.tasks)}
    for key in (keys.tasks, keys.clients, keys.holders, keys.durations, keys.heartbeats):
        r.delete(key)
        r.set(key, "junk")
    r.delete(keys.workers)
    r.rpush(keys.workers, "junk")

    start_another_scheduler(cluster, r, keys)
    gate.write_text("go")
    assert after.result(timeout=30) == str(gate)[0]
    assert kept.get(timeout=30).result(timeout=30) == 42  # (its holder's wants came back)
    assert client.submit(inc, 1).result(timeout=30) == 2
    assert list(client.scheduler_info()["workers"]) == [worker]  # not declared dead
    assert {m.decode() for m in r.smembers(keys.tasks)} >= tasks
    assert r.type(keys.workers) == r.type(keys.clients) == b"hash"
    dead = [f[b"stream"].decode() for _, f in r.xrange(keys.dead_letter)]
    assert {keys.tasks, keys.workers, keys.clients, keys.holders, keys.durations} <= set(dead)
    assert cluster.scheduler_process.poll() is None  # type: ignore[union-attr]
    log = (tmp_path / "logs" / "scheduler.log").read_text()
    assert f"{keys.tasks} was a string, not a set" in log and "Traceback" not in log


def test_cluster_keys_overwritten_under_a_running_scheduler_are_rebuilt_within_seconds(
    redis_url: str, cluster_name: str, tmp_path: Path, one_worker: tuple[Any, Client]
) -> None:
    """The same while the scheduler runs: its look at the cluster keys (every
    ``KEY_LOOK_INTERVAL``) finds them, reloads, and rebuilds them first; the worker,
    whose claims meanwhile meet WRONGTYPE, waits instead of leaving."""
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    cluster, client = one_worker
    (worker,) = client.scheduler_info()["workers"]
    assert client.submit(inc, 1).result(timeout=30) == 2
    for key in (keys.workers, keys.tasks):
        r.delete(key)
        r.set(key, "junk")
    poll(lambda: r.type(keys.workers) == b"hash" and r.type(keys.tasks) == b"set", 20)
    assert client.submit(inc, 2).result(timeout=30) == 3
    assert list(client.scheduler_info()["workers"]) == [worker]
    assert cluster.scheduler_process.poll() is None  # type: ignore[union-attr]
    log = (tmp_path / "logs" / "scheduler.log").read_text()
    assert f"{keys.workers} was a string, not a hash" in log and "Traceback" not in log
