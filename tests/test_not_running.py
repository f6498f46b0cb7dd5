"""A client of a cluster that is not running says so instead of waiting forever: a
warning at connect, then ``ClusterNotRunningError`` from ``result()``/``gather()`` once no
scheduler has led it, or no worker has been registered, for ``client.no-scheduler-timeout``.
The futures are kept: once the cluster runs, they finish."""

from __future__ import annotations

import logging
import time

import pytest

from redisdask import Client, LocalCluster, as_completed, wait
from redisdask.errors import ClusterNotRunningError

pytestmark = pytest.mark.timeout(90)

QUICK = {"client.no-scheduler-timeout": 1, "client.heartbeat-interval": 0.2}


def inc(x: int) -> int:
    return x + 1


def test_no_scheduler_is_said_at_connect_and_raised_then_the_future_goes_on(
    redis_url: str, cluster_name: str, caplog: pytest.LogCaptureFixture
) -> None:
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
        with LocalCluster(n_workers=1, redis_url=redis_url, cluster_name=cluster_name):
            assert future.result(timeout=30) == 2  # kept, and run once the cluster runs


def test_a_scheduler_without_workers_is_said_too(redis_url: str, cluster_name: str) -> None:
    with (
        LocalCluster(n_workers=0, redis_url=redis_url, cluster_name=cluster_name) as cluster,
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
