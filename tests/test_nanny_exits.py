"""Which exits a nanny replaces, for real: an exit its worker did not choose (a task's
``os._exit(0)``) is a death counted against the task and replaced; one it chose
(``retire_workers``, the end of its lifetime) is not.  And a worker stopped with SIGTERM
under tasks that use its client and a ``Semaphore``: every result right."""

from __future__ import annotations

import os
import time

import pytest
from polling import poll
from test_nanny import deaths, workers_of

from redisdask import Client, KilledWorker, LocalCluster
from redisdask.nanny.deaths import WorkerExit, classify

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
    redis_url: str, cluster_name: str
) -> None:
    with (
        LocalCluster(
            n_workers=2,
            nanny=True,
            redis_url=redis_url,
            cluster_name=cluster_name,
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


def test_a_worker_retired_by_the_client_is_not_replaced(redis_url: str, cluster_name: str) -> None:
    with (
        LocalCluster(n_workers=2, nanny=True, redis_url=redis_url, cluster_name=cluster_name),
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
    redis_url: str, cluster_name: str
) -> None:
    with LocalCluster(
        n_workers=1,
        nanny=True,
        redis_url=redis_url,
        cluster_name=cluster_name,
        worker_options={"lifetime": "1s"},
    ) as cluster:
        poll(lambda: deaths(redis_url, cluster_name), timeout=30)
        [record] = deaths(redis_url, cluster_name)
        assert record["reason"] == "closed: lifetime; not restarted"
        assert cluster.worker_processes[0].wait(30) == 0  # its nanny ended
        assert not workers_of(redis_url, cluster_name)
