"""A client of a cluster that is not running says so instead of waiting forever: a
warning at connect, then ``ClusterNotRunningError`` from ``result()``/``gather()`` once no
scheduler has led it, or no worker has been registered, for ``client.no-scheduler-timeout``.
The futures are kept: once the cluster runs, they finish."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import redis
from conftest import ClusterFactory

from redisdask import Client, KilledWorker, LocalCluster, as_completed, wait
from redisdask.errors import ClusterNotRunningError
from redisdask.store.bootstrap import ensure_cluster
from redisdask.store.keyspace import Keys

pytestmark = pytest.mark.timeout(90)

QUICK = {"client.no-scheduler-timeout": 1, "client.heartbeat-interval": 0.2}


def inc(x: int) -> int:
    return x + 1


def test_no_scheduler_is_said_at_connect_and_raised_then_the_future_goes_on(
    redis_url: str,
    cluster_name: str,
    caplog: pytest.LogCaptureFixture,
    make_cluster: ClusterFactory,
) -> None:
    ensure_cluster(redis.Redis.from_url(redis_url), Keys(cluster_name))  # its scheduler died
    with (
        caplog.at_level(logging.WARNING, logger="redisdask.client"),
        Client(redis_url, cluster_name=cluster_name, set_as_default=False, **QUICK) as client,
    ):
        assert f"no scheduler leads cluster {cluster_name!r}" in caplog.text
        assert "redisdask scheduler" in caplog.text
        future = client.submit(inc, 1)
        started = time.monotonic()
        with pytest.raises(ClusterNotRunningError, match="no scheduler leads") as info:
            future.result(timeout=30)
        assert time.monotonic() - started < 10  # not the result's own timeout
        assert "client.no-scheduler-timeout" in str(info.value)
        assert isinstance(info.value, TimeoutError)
        with pytest.raises(ClusterNotRunningError):
            client.gather([future])
        with pytest.raises(ClusterNotRunningError):
            wait([future])
        with pytest.raises(ClusterNotRunningError):
            wait([future], return_when="FIRST_COMPLETED")
        with pytest.raises(ClusterNotRunningError):
            next(as_completed([future]))
        with pytest.raises(ClusterNotRunningError):
            future.exception()
        with make_cluster(n_workers=1):
            assert future.result(timeout=30) == 2  # kept, and run once the cluster runs


def test_a_scheduler_without_workers_is_said_too(
    cluster_name: str, make_cluster: ClusterFactory
) -> None:
    with (
        make_cluster(n_workers=0) as cluster,
        Client(
            cluster.redis_url, cluster_name=cluster_name, set_as_default=False, **QUICK
        ) as client,
    ):
        future = client.submit(inc, 1)
        with pytest.raises(ClusterNotRunningError, match="no worker is registered"):
            future.result(timeout=30)
        cluster.start_worker(name="late")
        cluster.wait_for_workers(1)
        assert future.result(timeout=30) == 2


def _keys_of(redis_url: str, cluster_name: str) -> list[bytes]:
    return list(redis.Redis.from_url(redis_url).scan_iter(match=f"rd:{{{cluster_name}}}:*"))


def test_a_mistyped_cluster_name_creates_no_keys_and_names_the_clusters_there(
    redis_url: str, cluster_name: str
) -> None:
    ensure_cluster(redis.Redis.from_url(redis_url), Keys(cluster_name))
    typo = cluster_name + "-typo"
    started = time.monotonic()
    with pytest.raises(ClusterNotRunningError, match="no cluster named") as info:
        Client(redis_url, cluster_name=typo, set_as_default=False, **QUICK)
    assert time.monotonic() - started < 10
    assert cluster_name in str(info.value)  # the one that exists, to pick from
    assert "redisdask scheduler" in str(info.value)
    status = subprocess.run(
        [sys.executable, "-m", "redisdask", "status", redis_url, "--cluster", typo],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert f"no cluster named {typo!r}" in status.stdout, status.stdout + status.stderr
    assert cluster_name in status.stdout
    assert status.returncode == 1  # and the line that says why, not a success
    assert f"no cluster named {typo!r}" in status.stderr and cluster_name in status.stderr
    assert _keys_of(redis_url, typo) == []


def test_a_client_started_before_its_cluster_waits_for_it(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    clients: list[Client] = []
    connecting = threading.Thread(
        target=lambda: clients.append(
            Client(
                redis_url,
                cluster_name=cluster_name,
                set_as_default=False,
                **{"client.no-scheduler-timeout": 60},
            )
        )
    )
    connecting.start()
    with make_cluster(n_workers=1):
        connecting.join(timeout=60)
        assert clients, "the client did not connect once the cluster existed"
        with clients[0] as client:
            assert client.submit(inc, 1).result(timeout=30) == 2


def test_client_with_no_address_starts_a_local_cluster_and_closes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("REDISDASK__REDIS__URL", raising=False)
    monkeypatch.setenv("REDISDASK_CONFIG", os.devnull)  # no configured URL either
    with Client(n_workers=1, threads_per_worker=2, set_as_default=False) as client:
        cluster = client.cluster
        assert isinstance(cluster, LocalCluster)
        assert client.submit(inc, 1).result(timeout=30) == 2
        assert sum(w["nthreads"] for w in client.scheduler_info()["workers"].values()) == 2
        pids = [p.pid for p in cluster.subprocesses]
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    with pytest.raises(TypeError, match="LocalCluster arguments"):
        Client("redis://127.0.0.1:1/0", n_workers=2)


def segfault() -> None:
    os.kill(os.getpid(), signal.SIGSEGV)


def test_a_segfaulting_task_ends_in_killed_worker_on_a_default_local_cluster(
    make_cluster: ClusterFactory,
) -> None:
    """Workers run under nannies by default: they come back after each crash, so the task
    is blamed after allowed-failures deaths instead of leaving no worker and a client
    waiting forever."""
    with (
        make_cluster(n_workers=2) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        assert cluster.nanny
        with pytest.raises(KilledWorker, match="segfault"):
            client.submit(segfault).result(timeout=90)
        assert client.submit(inc, 1).result(timeout=30) == 2  # the workers are back
