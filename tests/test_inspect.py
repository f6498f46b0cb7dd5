"""``redisdask inspect``, run as a command against a real cluster's Redis: it answers
"why did my worker die?" and writes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import redis

from redisdask import Client, KilledWorker, LocalCluster
from redisdask.schema import Keys

pytestmark = pytest.mark.timeout(120)

WRITES = {
    "xadd", "set", "hset", "del", "unlink", "xtrim", "xack", "xdel", "evalsha", "eval",
    "sadd", "srem", "zadd", "zrem", "expire", "pexpire", "incr", "hdel", "rpush", "hsetnx",
}  # fmt: skip


def allocate_forever(step: int) -> None:
    import threading

    blocks = []
    while True:
        blocks.append(b"\x01" * step)
        threading.Event().wait(0.02)  # grows as a leaky task would


def calls(r: redis.Redis) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in r.info("commandstats").items()}


def inspect(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "redisdask", "inspect", *args, redis_url],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, COLUMNS="160"),
    )


def test_inspect_deaths_names_a_memory_death_with_its_figures_and_writes_nothing(
    redis_url: str, cluster_name: str
) -> None:
    with (
        LocalCluster(
            n_workers=1,
            nanny=True,
            redis_url=redis_url,
            cluster_name=cluster_name,
            worker_options={"memory_limit": "300MB"},
            scheduler_options={"allowed_failures": 0},
        ) as cluster,
        Client(cluster) as client,
        pytest.raises(KilledWorker),
    ):
        client.submit(allocate_forever, 20_000_000).result(timeout=60)
    r = redis.Redis.from_url(redis_url)
    r.xadd(Keys(cluster_name).deaths, {"m": b"\xc1 not msgpack"})  # a stranger's entry
    before = calls(r)
    result = inspect(redis_url, "deaths", "--cluster", cluster_name, "--json")
    text = inspect(redis_url, "deaths", "--cluster", cluster_name, "--since", "1h")
    increased = {k for k, v in calls(r).items() if v > before.get(k, 0)}
    assert result.returncode == 0, result.stderr
    memory = [d for d in json.loads(result.stdout) if d["kind"] == "memory"]
    assert len(memory) == 1, result.stdout
    [death] = memory
    assert death["how"] == "nanny" and "killed by its nanny" in death["reason"]
    assert death["evidence"]["memory_limit"] == 300_000_000
    assert death["evidence"]["rss"] > 0.95 * 300_000_000
    assert "allocate_forever" in " ".join(death["processing"] + death["executing"])
    assert text.returncode == 0 and "killed by its nanny" in text.stdout
    assert "memory" in text.stdout and "MiB" in text.stdout
    assert "pausing its thread pool" in text.stdout  # the log tail, brackets and all
    assert "WARNING worker:worker-0[" in text.stdout
    assert not increased & WRITES, increased  # read-only
    other = inspect(redis_url, "deaths", "--cluster", cluster_name, "--worker", "nobody")
    assert "No worker deaths recorded." in other.stdout
