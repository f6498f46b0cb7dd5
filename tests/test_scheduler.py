"""The scheduler driver: atomic batches, fencing, restarts (real Redis, real processes)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
import redis

from redisdask import Client, LocalCluster
from redisdask.errors import FencedError
from redisdask.scheduler import Scheduler
from redisdask.scheduler_state import Forget, StoreTask
from redisdask.schema import SCHEDULER_GROUP, Keys, ensure_cluster, entry

pytestmark = pytest.mark.timeout(60)


def inc(x: int) -> int:
    return x + 1


def poll(condition, timeout: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        threading.Event().wait(0.01)


def test_forget_and_resubmit_in_one_batch_writes_the_new_task_last(
    redis_url: str, cluster_name: str
) -> None:
    scheduler = Scheduler(redis_url, cluster_name)
    key = scheduler.keys.task("x")
    cmds = scheduler.to_commands(
        [Forget("s", "x"), StoreTask("s", "x", b"spec", [], 1.0, "released")]
    )
    deletes = [i for i, c in enumerate(cmds) if c[0] == "DEL" and key in c]
    writes = [i for i, c in enumerate(cmds) if c[0] == "HSET" and c[1] == key]
    assert deletes and writes and max(deletes) < min(writes)
    assert ["SADD", scheduler.keys.tasks, "x"] in cmds
    assert not any(c[0] == "SREM" and c[1] == scheduler.keys.tasks for c in cmds)


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
    batch = [(keys.client_stream, eid, fields) for _s, items in entries for eid, fields in items]
    scheduler.process(batch)
    assert r.hget(keys.task("x"), "state") == b"queued"
    assert r.zscore(keys.ready, "x") is not None
    assert r.xpending(keys.client_stream, SCHEDULER_GROUP)["pending"] == 0
    assert r.xlen(keys.client_stream) == 0


def test_a_fenced_scheduler_cannot_write(redis_url: str, cluster_name: str) -> None:
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    old = Scheduler(redis_url, cluster_name)
    old.acquire_lease()
    r.delete(keys.lease)  # as if the old one paused past its lease
    new = Scheduler(redis_url, cluster_name)
    assert int(new.acquire_lease()) > int(old.token)  # type: ignore[arg-type]
    with pytest.raises(FencedError):
        old.apply([["SET", keys.prefix + "late-write", 1]])
    assert not r.exists(keys.prefix + "late-write")
    with pytest.raises(FencedError):
        old.renew_lease()
    new.apply([["SET", keys.prefix + "write", 1]])
    assert r.exists(keys.prefix + "write")


def test_killed_scheduler_is_restarted_and_every_computation_finishes(
    redis_url: str, cluster_name: str
) -> None:
    with (
        LocalCluster(
            n_workers=2,
            redis_url=redis_url,
            cluster_name=cluster_name,
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


def test_standby_takes_over_when_the_lease_expires(redis_url: str, cluster_name: str) -> None:
    with (
        LocalCluster(
            n_workers=1,
            redis_url=redis_url,
            cluster_name=cluster_name,
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
    redis_url: str, cluster_name: str
) -> None:
    with LocalCluster(
        n_workers=1,
        redis_url=redis_url,
        cluster_name=cluster_name,
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
