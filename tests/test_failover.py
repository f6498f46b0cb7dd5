"""Redis failover under a running computation: a primary, a replica and a Sentinel
(tests/sentinel_set.py); every process connects with the ``redis+sentinel://`` URL,
the primary is killed with SIGKILL, the Sentinel promotes the replica, and every
process follows it: the computation finishes with every result right."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest
from polling import poll
from sentinel_set import SentinelSet

from redisdask import Client, LocalCluster
from redisdask.connection import connect

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
            with connect(redis_set.url) as r:  # everyone writes to the promoted replica
                assert r.connection_pool.get_master_address()[1] == redis_set.replica.port
