"""A restart redoes nothing that finished (issue 22): tasks that record each of their runs,
a scheduler ``kill -9``'d under them twice (a replacement started each time), and Redis
``kill -9``'d under them (AOF): the tasks run twice are at most those running at the
faults."""

from __future__ import annotations

import signal
from collections import Counter

import pytest
import redis
from conftest import ClusterFactory
from polling import poll

from redisdask import Client, LocalCluster
from redisdask.observe.inspect import read_events

pytestmark = pytest.mark.timeout(120)

THREADS = 2  # 2 workers x 1 thread: at most this many tasks run at a fault


def record(i: int, url: str, runs: str) -> int:
    """A task with a side effect: each run appends its argument to the list ``runs``."""
    redis.Redis.from_url(url).rpush(runs, i)
    return i


def twice(r: redis.Redis, runs: str) -> list[int]:
    counts = Counter(int(v) for v in r.lrange(runs, 0, -1))
    return sorted(i for i, n in counts.items() if n > 1)


def test_a_scheduler_killed_twice_redoes_no_finished_task(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
):
    r = redis.Redis.from_url(redis_url)
    runs = f"runs-{cluster_name}"
    with (
        make_cluster(
            nanny=False,
            n_workers=2,
            threads_per_worker=1,
            scheduler_options={"lease_ttl": 1},
        ) as cluster,
        Client(cluster) as client,
    ):
        n = 2_000
        futures = client.map(record, range(n), url=redis_url, runs=runs)
        for ran in (n // 4, n // 2):
            poll(lambda k=ran: r.llen(runs) >= k, timeout=60)
            old = cluster.scheduler_process
            old.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
            old.wait(10)  # type: ignore[union-attr]
            cluster.start_scheduler()  # takes the lease once the dead one's expires
        assert client.gather(futures) == list(range(n))
        assert len(twice(r, runs)) <= 2 * THREADS, twice(r, runs)
        lost = [e for e in read_events(cluster.redis, cluster.keys) if e["kind"] == "lost-claim"]
        assert not lost
    r.delete(runs)


def test_redis_killed_under_a_computation_redoes_few_tasks(tmp_path, cluster_name: str):  # type: ignore[no-untyped-def]
    from redisdask.deploy.embedded import EmbeddedRedis

    runs = f"runs-{cluster_name}"
    with EmbeddedRedis() as tally, EmbeddedRedis(data_dir=tmp_path) as server:
        # the runs are counted in a Redis of their own: the one killed may lose them
        r = redis.Redis.from_url(tally.url)
        with (
            LocalCluster(
                nanny=False, n_workers=2, redis_url=server.url, cluster_name=cluster_name
            ) as cluster,
            Client(cluster) as client,
        ):
            n = 2_000
            futures = client.map(record, range(n), url=tally.url, runs=runs)
            poll(lambda: r.llen(runs) >= n // 3, timeout=60)
            server.kill()
            server.start()  # same port, same AOF (everysec: its last writes may be lost)
            assert client.gather(futures) == list(range(n))
            # a claim lost with the last second of the AOF is run again, as may be what
            # ran at the kill; nothing that finished before it is
            assert len(twice(r, runs)) <= 4 * THREADS, twice(r, runs)
