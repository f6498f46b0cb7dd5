"""``redisdask inspect``, run as a command against a real cluster's Redis: it answers
"why did my worker die?" and writes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from conftest import ClusterFactory
from polling import poll
from tasklib import allocate_forever

from redisdask import Client, KilledWorker
from redisdask.observe.inspect import read_deaths
from redisdask.store.keyspace import Keys

pytestmark = pytest.mark.timeout(120)

WRITES = {
    "xadd", "set", "hset", "del", "unlink", "xtrim", "xack", "xdel", "evalsha", "eval",
    "sadd", "srem", "zadd", "zrem", "expire", "pexpire", "incr", "hdel", "rpush", "hsetnx",
}  # fmt: skip


def calls(r: redis.Redis) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in r.info("commandstats").items()}


def inspect(redis_url: str, *args: str, after: int = 1) -> subprocess.CompletedProcess[str]:
    """``redisdask inspect WHAT [positionals] URL [options]``: the URL after ``after`` args."""
    args = (*args[:after], redis_url, *args[after:])
    return subprocess.run(
        [sys.executable, "-m", "redisdask", "inspect", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, COLUMNS="160"),
    )


def test_inspect_deaths_names_a_memory_death_with_its_figures_and_writes_nothing(
    redis_url: str,
    read_only_url: str,
    cluster_name: str,
    tmp_path: Path,
    make_cluster: ClusterFactory,
) -> None:
    with (
        make_cluster(
            n_workers=1,
            nanny=True,
            worker_options={"memory_limit": "300MB"},
            scheduler_options={"allowed_failures": 0},
        ) as cluster,
        Client(cluster) as client,
    ):
        go = tmp_path / "go"
        future = client.submit(allocate_forever, 2_000_000, str(go))
        # the worker's story has shipped its claim (with a heartbeat) before the leak starts
        [address] = client.scheduler_info()["workers"]
        story = Keys(cluster_name).worker_story(address)
        poll(lambda: any(future.key.encode() in f[b"m"] for _, f in cluster.redis.xrange(story)))
        go.touch()
        with pytest.raises(KilledWorker):
            future.result(timeout=60)
        # while the cluster runs, as a Redis user that cannot write
        task = inspect(
            read_only_url, "task", future.key, "--cluster", cluster_name, "--json", after=2
        )
        task_text = inspect(read_only_url, "task", future.key, "--cluster", cluster_name, after=2)
        keys = inspect(read_only_url, "keys", "--cluster", cluster_name, "--json")
        events = inspect(read_only_url, "events", "--cluster", cluster_name, "--json")
        dead_address = read_deaths(cluster.redis, Keys(cluster_name))[0]["worker"]
        worker = inspect(
            read_only_url, "worker", dead_address, "--cluster", cluster_name, "--json", after=2
        )
    check_task(task, task_text, future.key)
    check_keys_and_events(keys, events)
    assert worker.returncode == 0, worker.stderr
    dead = json.loads(worker.stdout)
    assert dead["alive"] is False and dead["death"]["kind"] == "memory"
    assert dead["last_heartbeat"]["memory_limit"] == 300_000_000
    assert any(row["key"] == future.key for row in dead["story"])  # what it was doing
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
    assert "WARNING worker worker-0[" in text.stdout  # the one log format
    assert not increased & WRITES, increased  # read-only
    other = inspect(redis_url, "deaths", "--cluster", cluster_name, "--worker", "nobody")
    assert "No worker deaths recorded." in other.stdout


def check_task(
    result: subprocess.CompletedProcess[str], text: subprocess.CompletedProcess[str], key: str
) -> None:
    assert result.returncode == 0, result.stderr
    task = json.loads(result.stdout)
    assert task["state"] == "erred" and task["suspicious"] == 1
    assert task["exception_text"].startswith("KilledWorker:")
    [death] = task["deaths"]
    assert death["kind"] == "memory" and death["evidence"]["memory_limit"] == 300_000_000
    states = [row["state"] for row in task["story"]]
    assert states[:2] == ["released", "queued"] and states[-1] == "erred"
    assert "processing" in states
    claim = next(row for row in task["story"] if row["state"] == "processing")
    assert claim["cause"] in ("claimed", "pushed") and claim["origin"] == death["worker"]
    died = task["story"][-1]
    assert died["cause"] == "remove-worker" and died["origin"] == death["worker"]
    assert [r["finish"] for r in task["worker_story"]][:2] == ["ready", "executing"]
    assert text.returncode == 0, text.stderr
    assert "KilledWorker" in text.stdout and "story (scheduler)" in text.stdout


def check_keys_and_events(
    keys: subprocess.CompletedProcess[str], events: subprocess.CompletedProcess[str]
) -> None:
    assert keys.returncode == 0, keys.stderr
    kinds = {row["kind"]: row for row in json.loads(keys.stdout)}
    assert kinds["task:*"]["count"] == 1 and kinds["task:*"]["bytes"] > 0
    assert kinds["deaths"]["type"] == "stream" and kinds["events"]["count"] == 1
    assert {"meta", "lease", "workers", "heartbeats", "summary", "story"} <= set(kinds)
    assert events.returncode == 0, events.stderr
    described = [e["kind"] for e in json.loads(events.stdout)]
    assert described[0] == "scheduler-start" and "worker-died" in described
    assert described.count("worker-joined") == 2 and "killed-worker" in described
