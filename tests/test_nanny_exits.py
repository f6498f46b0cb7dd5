"""Which exits a nanny replaces, for real: an exit its worker did not choose (a task's
``os._exit(0)``) is a death counted against the task and replaced; one it chose
(``retire_workers``, the end of its lifetime) is not.  And a worker stopped with SIGTERM
under tasks that use its client and a ``Semaphore``: every result right."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import redis
from conftest import ClusterFactory
from polling import poll
from test_nanny import deaths, workers_of

from redisdask import (
    Client,
    KilledWorker,
    Semaphore,
    get_client,
    get_worker,
    rejoin,
    secede,
)
from redisdask.nanny.deaths import WorkerExit, classify
from redisdask.protocol import CloseWorker
from redisdask.store import codecs
from redisdask.store.keyspace import Keys

pytestmark = pytest.mark.timeout(120)


def quit_quietly() -> None:
    os._exit(0)  # what some libraries do: no traceback, exit code 0


def inc(x: int) -> int:
    return x + 1


def test_exit_code_0_is_graceful_only_with_the_reason_the_worker_wrote() -> None:
    assert classify(WorkerExit(0, exit_reason="lifetime")) == ("graceful", "closed: lifetime")
    kind, reason = classify(WorkerExit(0))
    assert kind == "exit-code"
    assert reason.startswith("exited with code 0 without closing itself: a task (or a library")


def test_a_task_calling_os_exit_0_ends_in_killed_worker_and_every_worker_stays(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    with (
        make_cluster(
            n_workers=2,
            nanny=True,
            scheduler_options={"allowed_failures": 1},
        ),
        Client(redis_url, cluster_name=cluster_name) as client,
    ):
        before = {w["pid"] for w in workers_of(redis_url, cluster_name).values()}
        started = time.monotonic()
        with pytest.raises(KilledWorker) as info:
            client.submit(quit_quietly).result(timeout=60)
        took = time.monotonic() - started
        message = str(info.value)
        assert message.count("exited with code 0 without closing itself") == 2, message
        print(f"KilledWorker after {took:.1f} s: {message}")
        poll(lambda: len(workers_of(redis_url, cluster_name)) == 2, timeout=30)
        assert not before & {w["pid"] for w in workers_of(redis_url, cluster_name).values()}
        records = [d for d in deaths(redis_url, cluster_name)]
        assert [d["kind"] for d in records] == ["exit-code", "exit-code"]
        assert all(d["evidence"]["restarted"] for d in records)
        assert client.submit(inc, 1).result(timeout=30) == 2


def test_a_worker_retired_by_the_client_is_not_replaced(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    with (
        make_cluster(n_workers=2, nanny=True),
        Client(redis_url, cluster_name=cluster_name) as client,
    ):
        leaving, staying = sorted(workers_of(redis_url, cluster_name))
        client.retire_workers(workers=[leaving])
        poll(lambda: any(d["worker"] == leaving for d in deaths(redis_url, cluster_name)))
        [record] = deaths(redis_url, cluster_name)
        assert record["kind"] == "graceful" and record["reason"] == "closed: retired; not restarted"
        assert list(workers_of(redis_url, cluster_name)) == [staying]
        assert client.submit(inc, 1).result(timeout=30) == 2


def test_a_worker_at_the_end_of_its_lifetime_is_not_replaced(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    with make_cluster(
        n_workers=1,
        nanny=True,
        worker_options={"lifetime": "1s"},
    ) as cluster:
        poll(lambda: deaths(redis_url, cluster_name), timeout=30)
        [record] = deaths(redis_url, cluster_name)
        assert record["reason"] == "closed: lifetime; not restarted"
        assert cluster.worker_processes[0].wait(30) == 0  # its nanny ended
        assert not workers_of(redis_url, cluster_name)


def guarded(i: int, name: str) -> int:
    """Hold a lease of ``name`` while working a little and submitting a sub-task through
    the worker's client; then wait for the sub-task (seceded: waiting takes no thread)."""
    with Semaphore(max_leases=2, name=name):
        threading.Event().wait(0.2)  # stands for work done while holding the lease
        sub = get_client().submit(inc, i, pure=False)
        threading.Event().wait(0.2)
    secede()
    value = sub.result(timeout=60)
    rejoin()
    return value * 10


@pytest.mark.parametrize("run", range(3))
def test_a_worker_stopped_with_sigterm_under_running_tasks_loses_no_result(
    redis_url: str, cluster_name: str, run: int, make_cluster: ClusterFactory
) -> None:
    with (
        make_cluster(
            n_workers=2,
            threads_per_worker=2,
            nanny=True,
        ),
        Client(redis_url, cluster_name=cluster_name) as client,
    ):
        name = f"{cluster_name}-sem"
        futures = client.map(guarded, range(12), name=name)
        address, info = next(iter(workers_of(redis_url, cluster_name).items()))
        poll(lambda: Semaphore(name=name).get_value() == 2, timeout=30)  # tasks are in
        os.kill(info["pid"], signal.SIGTERM)
        assert client.gather(futures) == [10 * (i + 1) for i in range(12)]
        poll(lambda: any(d["worker"] == address for d in deaths(redis_url, cluster_name)))
        [record] = deaths(redis_url, cluster_name)
        assert record["reason"] == "closed: signal SIGTERM; not restarted"  # it retired


SLOW_START_PRELOAD = """
import asyncio
from pathlib import Path

FLAG = Path({flag!r})


def dask_setup(worker):
    register = worker._register

    async def register_then_dawdle(*args, **kwargs):
        await register(*args, **kwargs)
        FLAG.write_text("registered")
        while FLAG.read_text() != "signalled":  # (the test sent its SIGTERM)
            await asyncio.sleep(0.05)

    worker._register = register_then_dawdle
"""


def test_a_sigterm_just_after_registering_is_a_graceful_stop_once_started(
    redis_url: str, cluster_name: str, tmp_path: Path, make_cluster: ClusterFactory
) -> None:
    """Registered, it is in the cluster (a test, or an operator, sees it and stops it)
    before its start ends; the signal handlers came only after the start, so SIGTERM
    killed it (the suite saw "killed by SIGTERM; restarted" where a retirement was due)."""
    flag, preload = tmp_path / "flag", tmp_path / "slow_start.py"
    flag.write_text("")
    preload.write_text(SLOW_START_PRELOAD.format(flag=str(flag)))
    with make_cluster(n_workers=1, nanny=True, worker_options={"preload": [str(preload)]}):
        poll(lambda: flag.read_text() == "registered", timeout=30)
        [(address, info)] = workers_of(redis_url, cluster_name).items()
        os.kill(info["pid"], signal.SIGTERM)
        flag.write_text("signalled")
        poll(lambda: any(d["worker"] == address for d in deaths(redis_url, cluster_name)))
        [record] = deaths(redis_url, cluster_name)
        assert record["reason"] == "closed: signal SIGTERM; not restarted"


def client_once_closing(url: str, mark: str) -> str:
    """On the first worker to run it: wait until that worker begins to close, then ask
    for its client (refused: it is closing).  On any other: return where it ran."""
    worker = get_worker()
    if redis.Redis.from_url(url).set(mark, worker.address, nx=True):
        poll(lambda: worker.status != "running", timeout=30)
        get_client()
    return worker.address


def test_an_error_caused_by_the_worker_closing_is_handed_back_not_the_result(
    client: Client, redis_url: str, cluster_name: str
) -> None:
    mark = f"{cluster_name}-first"
    future = client.submit(client_once_closing, redis_url, mark, pure=False)
    r = redis.Redis.from_url(redis_url)
    poll(lambda: r.exists(mark))
    first = r.get(mark).decode()
    keys = Keys(cluster_name)  # the close now that LocalCluster.close sends
    r.xadd(keys.worker_inbox(first), codecs.entry([CloseWorker("told to close").to_dict()]))
    assert future.result(timeout=60) not in ("", first)  # it ran again elsewhere
