"""Redis failover under a running computation: a primary, a replica and a Sentinel
(tests/sentinel_set.py); every process connects with the ``redis+sentinel://`` URL,
the primary is killed with SIGKILL, the Sentinel promotes the replica, and every
process follows it: the computation finishes with every result right."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from polling import poll
from sentinel_set import SentinelSet

from redisdask import Client, LocalCluster
from redisdask.deploy.embedded import HOST, EmbeddedRedis
from redisdask.scheduler.driver import Scheduler
from redisdask.store.bootstrap import ensure_cluster
from redisdask.store.connection import connect

pytestmark = pytest.mark.timeout(60)

N = 40  # first-stage tasks
RUN_TIME = 0.1  # seconds each first-stage task works


def square(i: int, directory: str) -> int:
    """i*i, after RUN_TIME of work; leaves a file saying when this run started."""
    Path(directory, f"{i}-{uuid.uuid4().hex}").write_text(repr(time.time()))
    threading.Event().wait(RUN_TIME)  # the task's work, not a synchronisation
    return i * i


def add(a: int, b: int) -> int:
    return a + b


def total(*values: int) -> int:
    return sum(values)


def test_a_computation_follows_a_failover_to_the_replica(tmp_path: Path) -> None:
    starts = tmp_path / "starts"
    starts.mkdir()
    with SentinelSet() as redis_set:
        poll(redis_set.replica_in_sync, timeout=20)
        with (
            LocalCluster(
                n_workers=2,
                threads_per_worker=1,
                redis_url=redis_set.url,
                cluster_name=f"failover-{uuid.uuid4().hex[:8]}",
                log_directory=tmp_path / "logs",
            ) as cluster,
            Client(cluster) as client,
        ):
            squares = [client.submit(square, i, str(starts), pure=False) for i in range(N)]
            pairs = [client.submit(add, squares[i], squares[i + 1]) for i in range(0, N, 2)]
            grand = client.submit(total, *pairs)
            poll(lambda: sum(f.done() for f in squares) >= N // 4, timeout=20)
            assert not grand.done()  # the kill lands mid-computation

            redis_set.primary.kill()
            killed_at = time.time()
            poll(lambda: redis_set.primary_port() == redis_set.replica.port, timeout=20)
            promoted_at = time.time()

            assert grand.result(timeout=40) == sum(i * i for i in range(N))
            assert client.gather(pairs) == [(2 * k) ** 2 + (2 * k + 1) ** 2 for k in range(N // 2)]
            assert client.gather(squares) == [i * i for i in range(N)]
            # the scheduler and the workers followed the failover: none was replaced
            assert cluster.scheduler_process is not None
            assert cluster.scheduler_process.poll() is None
            assert all(p.poll() is None for p in cluster.worker_processes)

            runs = sorted(float(p.read_text()) for p in starts.iterdir())
            moving_at = min(t for t in runs if t > promoted_at)
            print(
                f"\nfailover: promoted {promoted_at - killed_at:.2f} s after the kill, "
                f"tasks started again {moving_at - killed_at:.2f} s after it; "
                f"{len(runs) - N} first-stage runs repeated"
            )
            assert len(runs) - N <= 2  # at most what the 2 threads ran at the kill (issue 22)
            with connect(redis_set.url) as r:  # everyone writes to the promoted replica
                assert r.connection_pool.get_master_address()[1] == redis_set.replica.port
            # compose's healthchecks follow the Sentinels too
            env = {
                **os.environ,
                "REDISDASK__REDIS__URL": redis_set.url,
                "REDISDASK__CLUSTER__NAME": cluster.keys.cluster,
            }
            for role in ("scheduler", "worker"):
                checked = subprocess.run(
                    [sys.executable, "-m", "redisdask.healthcheck", role],
                    env=env, capture_output=True, text=True, timeout=30,
                )  # fmt: skip
                assert checked.returncode == 0, (role, checked.stderr)


@pytest.fixture
def primary_and_replica() -> Iterator[tuple[EmbeddedRedis, EmbeddedRedis]]:
    with (
        EmbeddedRedis(args=["--repl-diskless-sync-delay", "0"]) as primary,
        EmbeddedRedis(args=["--replicaof", HOST, str(primary.port)]) as replica,
    ):
        with replica.client(decode_responses=True) as r:
            poll(lambda: r.info("replication").get("master_link_status") == "up", timeout=20)
        yield primary, replica


def test_a_scheduler_write_returns_once_a_replica_has_it(
    primary_and_replica: tuple[EmbeddedRedis, EmbeddedRedis],
) -> None:
    """redis.wait-replicas 1: a batch's write is done only when the replica has it, so
    the replica promoted by a failover holds every batch the scheduler went on from."""
    primary, replica = primary_and_replica
    cluster = f"wait-{uuid.uuid4().hex[:8]}"
    scheduler = Scheduler(primary.url, cluster, wait_replicas=1, wait_timeout=30)
    ensure_cluster(scheduler.redis, scheduler.keys)
    scheduler.acquire_lease()
    key = scheduler.keys.prefix + "replicated"
    assert replica.pid is not None
    os.kill(replica.pid, signal.SIGSTOP)  # a replica that cannot acknowledge yet
    try:
        writer = threading.Thread(target=scheduler.apply, args=([["SET", key, 1]],))
        writer.start()
        writer.join(0.5)  # (a bounded look: the write must still be waiting)
        assert writer.is_alive()
        assert scheduler.redis.get(key) == b"1"  # done on the primary, not yet replicated
    finally:
        os.kill(replica.pid, signal.SIGCONT)
    writer.join(20)
    assert not writer.is_alive()
    with replica.client() as r:
        assert r.get(key) == b"1"


def test_a_wait_that_times_out_is_logged_and_the_scheduler_goes_on(
    primary_and_replica: tuple[EmbeddedRedis, EmbeddedRedis], caplog: pytest.LogCaptureFixture
) -> None:
    """The write is done on the primary and cannot be taken back; stopping the scheduler
    while a replica is away would make the loss of a replica the loss of the cluster."""
    primary, _replica = primary_and_replica
    scheduler = Scheduler(primary.url, f"wait-{uuid.uuid4().hex[:8]}", wait_replicas=2,
                          wait_timeout=0.05)  # fmt: skip
    ensure_cluster(scheduler.redis, scheduler.keys)
    scheduler.acquire_lease()
    with caplog.at_level(logging.WARNING, logger="redisdask.scheduler"):
        scheduler.apply([["SET", scheduler.keys.prefix + "a", 1]])
        scheduler.apply([["SET", scheduler.keys.prefix + "b", 1]])  # within the warning's 10 s
    assert scheduler.redis.mget(scheduler.keys.prefix + "a", scheduler.keys.prefix + "b") == [
        b"1",
        b"1",
    ]
    warnings = [r.getMessage() for r in caplog.records if "wait-replicas" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "not acknowledged by 2 replicas within 50 ms" in warnings[0]
    assert scheduler.unreplicated == 1  # the second, counted for the next warning
