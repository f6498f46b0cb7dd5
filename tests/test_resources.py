"""Worker resources and placement like Dask, end to end: real Redis, real worker, nanny and
scheduler processes.  Tasks record when they ran in files (one per run), so how many ran
at once on each worker is counted from timestamps, never inferred from sleeps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import dask
import pytest
import redis
from conftest import ClusterFactory
from dask import delayed
from polling import poll
from rich.console import Console

from redisdask import Client, LocalCluster, comm
from redisdask.observe.inspect import read_task, render_task
from redisdask.observe.snapshot import read_snapshot
from redisdask.observe.views import header
from redisdask.store.bootstrap import ensure_cluster
from redisdask.store.codecs import pack
from redisdask.store.keyspace import Keys
from redisdask.store.scripts import Scripts

pytestmark = pytest.mark.timeout(120)

GPU = {"GPU": 1}


def name_of(*_: Any) -> str:
    from redisdask.workers import get_worker

    threading.Event().wait(0.02)  # stands for work
    return str(get_worker().name)


def who(*_: Any) -> tuple[str, str, int]:
    from redisdask.workers import get_worker

    worker = get_worker()
    return worker.address, str(worker.name), os.getpid()


def device_work(i: int, runs: str, seconds: float = 0.05) -> int:
    """A task on the device: its run is written to ``runs`` as it ends."""
    from redisdask.workers import get_worker

    start = time.monotonic()
    threading.Event().wait(seconds)  # stands for work on the device
    stop = time.monotonic()
    record = {"worker": get_worker().address, "start": start, "stop": stop, "i": i}
    Path(runs, f"{i}-{uuid.uuid4().hex}.json").write_text(json.dumps(record))
    return i


def most_at_once(runs: Path) -> dict[str, int]:
    """Per worker, the most runs that overlapped in time (an end before a start at the
    same instant)."""
    edges: dict[str, list[tuple[float, int]]] = {}
    for path in runs.glob("*.json"):
        run = json.loads(path.read_text())
        edges.setdefault(run["worker"], []).extend([(run["start"], 1), (run["stop"], -1)])
    peaks = {}
    for worker, points in edges.items():
        running = peak = 0
        for _, step in sorted(points):
            running += step
            peak = max(peak, running)
        peaks[worker] = peak
    return peaks


def gpu_cluster(
    redis_url: str, cluster_name: str, n_workers: int, threads: int, gpus: float
) -> LocalCluster:
    """Workers with ``threads`` threads and ``gpus`` GPUs each."""
    return LocalCluster(
        n_workers=n_workers,
        threads_per_worker=threads,
        resources={"GPU": gpus},
        redis_url=redis_url,
        cluster_name=cluster_name,
    )


def worker_resources(cluster: LocalCluster) -> dict[str, dict[str, Any]]:
    """Each live worker's own count of its resources (its ``inspect`` answer over TCP)."""
    r = cluster.redis
    pool = comm.BlockingPool(ensure_cluster(r, cluster.keys), timeout=5)
    try:
        return {
            a.decode(): pool.rpc(a.decode(), {"op": "inspect"})[0]["resources"]
            for a in r.hkeys(cluster.keys.workers)
        }
    finally:
        pool.close()


def test_the_claim_script_takes_only_what_fits_what_the_worker_has_free(
    redis_url: str, cluster_name: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    scripts = Scripts(r, keys)
    me, other = "tcp://10.0.0.1:1", "tcp://10.0.0.2:2"
    r.hset(keys.workers, mapping={me: pack({}), other: pack({})})
    needs = {"a": "GPU=1", "b": "GPU=2", "c": "GPU=1 MEM=0.5", "d": "GPU=0.5"}
    for score, (key, resources) in enumerate(needs.items()):
        r.hset(
            keys.task(key),
            mapping={
                "state": "queued",
                "spec": b"s",
                "deps": pack([]),
                "resources": resources,
                "queued_on": f"{me} {other}",
            },
        )
        r.zadd(keys.worker_constrained(me), {key: score})
        r.zadd(keys.worker_constrained(other), {key: score})  # fmt: skip
    tasks, _, _, blocked, _ = scripts.claim(worker=me, count=4, last_inbox_id="0-0", free="GPU=2")
    # a (1 of 2), not b (2 > 1 left), not c (its MEM is not there), d (0.5 of 1)
    assert [(t[0], t[4]) for t in tasks] == [(b"a", b"GPU=1"), (b"d", b"GPU=0.5")]
    assert blocked == 1  # tasks left for lack of resources: claim again when some free
    assert r.zrange(keys.worker_constrained(me), 0, -1) == [b"b", b"c"]
    assert r.zrange(keys.worker_constrained(other), 0, -1) == [b"b", b"c"]  # taken out there
    assert r.hget(keys.task("a"), "state") == b"processing"
    assert r.hget(keys.task("b"), "state") == b"queued"
    tasks, _, _, blocked, _ = scripts.claim(worker=me, count=4, last_inbox_id="0-0", free="")
    assert (tasks, blocked) == ([], 1)  # nothing free: nothing claimed
    free = "GPU=3 MEM=1"
    tasks, _, _, blocked, _ = scripts.claim(worker=me, count=4, last_inbox_id="0-0", free=free)
    assert ([t[0] for t in tasks], blocked) == ([b"b", b"c"], 0)
    for name in r.scan_iter(match=keys.prefix.replace("{", "[{]") + "*"):
        r.delete(name)


def test_tasks_needing_a_resource_run_only_where_it_is_and_wait_when_none_has_enough(
    make_cluster: ClusterFactory,
) -> None:
    with make_cluster(n_workers=1, threads_per_worker=2) as cluster:
        cluster.start_worker(name="gpu", resources="GPU=1")
        cluster.wait_for_workers(2)
        with Client(cluster) as client:
            assert set(client.gather(client.map(name_of, range(30), resources=GPU))) == {"gpu"}
            assert client.submit(name_of, "s", resources=GPU).result(timeout=30) == "gpu"
            assert client.get({"g": (name_of, 7)}, "g", resources=GPU) == "gpu"
            task = delayed(name_of)("c")
            assert client.compute(task, resources=GPU).result(timeout=30) == "gpu"
            with dask.annotate(resources=GPU):
                annotated = delayed(name_of)("a")
            assert annotated.compute() == "gpu"  # through dask, the client as its scheduler
            # what needs no GPU runs on both (this is what the GPU tasks did not do)
            plain = client.map(name_of, range(60), pure=False)
            assert set(client.gather(plain)) == {"worker-0", "gpu"}

            # a task no registered worker could ever run waits, and says why
            big = client.submit(name_of, "big", resources={"GPU": 2})
            keys, r = cluster.keys, cluster.redis
            poll(lambda: r.hget(keys.task(big.key), "state") == b"no-worker")
            task_info = read_task(r, keys, big.key)
            assert task_info["resources"] == {"GPU": 2.0}
            reason = task_info["waits_because"]
            assert "it needs GPU=2 on one worker and no registered worker has that much" in reason
            assert "gpu (tcp://" in reason and "): GPU=1" in reason
            assert "worker-0 (tcp://" in reason and "no resources" in reason
            console = Console(width=200, record=True)
            render_task(task_info, console)
            assert "waits because" in console.export_text()
            # the monitor shows it (from the summary the scheduler writes)
            poll(lambda: read_snapshot(r, keys).no_worker)
            [waiting] = read_snapshot(r, keys).no_worker
            assert (waiting["count"], waiting["key"]) == (1, big.key)
            assert "1 no-worker" in header(read_snapshot(r, keys), "redis://x").plain
            # a worker with enough joins: it runs there
            cluster.start_worker(name="big-gpu", resources={"GPU": 2})
            assert big.result(timeout=30) == "big-gpu"
            poll(lambda: not read_snapshot(r, keys).no_worker)


def test_a_worker_never_runs_more_than_its_capacity_under_fifty_concurrent_tasks(
    redis_url: str, cluster_name: str, tmp_path: Path
) -> None:
    """GPU=2 and 4 threads: at most 2 GPU tasks at once, while the other threads run tasks
    that need no GPU."""
    gpu_runs, plain_runs = tmp_path / "gpu", tmp_path / "plain"
    gpu_runs.mkdir()
    plain_runs.mkdir()
    with (
        gpu_cluster(redis_url, cluster_name, n_workers=1, threads=4, gpus=2) as cluster,
        Client(cluster) as client,
    ):
        [info] = client.scheduler_info()["workers"].values()
        assert info["resources"] == {"GPU": 2.0}  # as Dask's scheduler_info shows it
        gpu = client.map(device_work, range(50), runs=str(gpu_runs), resources=GPU)
        plain = client.map(device_work, range(100, 140), runs=str(plain_runs), seconds=0.02)
        assert client.gather(gpu) == list(range(50))
        assert client.gather(plain) == list(range(100, 140))
        [peak] = most_at_once(gpu_runs).values()
        assert peak == 2  # never more than its GPUs, and both used
        both = tmp_path / "both"
        both.mkdir()
        for path in [*gpu_runs.glob("*"), *plain_runs.glob("*")]:
            (both / path.name).write_text(path.read_text())
        assert most_at_once(both)[info["address"]] > 2  # the other threads did not idle
        assert worker_resources(cluster) == {
            info["address"]: {"total": {"GPU": 2.0}, "available": {"GPU": 2.0}}
        }


@pytest.mark.parametrize("disruption", ["worker-death", "scheduler-restart", "retirement"])
def test_resource_counts_stay_right_across_a_disruption_in_the_middle(
    redis_url: str, cluster_name: str, tmp_path: Path, disruption: str
) -> None:
    with (
        gpu_cluster(redis_url, cluster_name, n_workers=2, threads=2, gpus=1) as cluster,
        Client(cluster) as client,
    ):
        r, keys = cluster.redis, cluster.keys
        workers = client.scheduler_info()["workers"]
        victim = next(a for a, w in workers.items() if w["name"] == "worker-0")
        futures = client.map(device_work, range(60), runs=str(tmp_path), resources=GPU)
        poll(lambda: sum(f.done() for f in futures) >= 10)
        if disruption == "worker-death":
            os.kill(workers[victim]["pid"], signal.SIGKILL)
            poll(lambda: not r.hexists(keys.workers, victim))
        elif disruption == "scheduler-restart":
            cluster.scheduler_process.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
            cluster.scheduler_process.wait()  # type: ignore[union-attr]
            cluster.start_scheduler()
        else:
            assert list(client.retire_workers(["worker-0"])) == [victim]
        assert client.gather(futures) == list(range(60))
        peaks = most_at_once(tmp_path)
        assert peaks and max(peaks.values()) == 1, peaks  # one GPU each: never two at once
        expected = {"total": {"GPU": 1.0}, "available": {"GPU": 1.0}}
        # a run that the restart made twice may still be finishing (cancelled) and hold its
        # GPU for a moment; a count that leaked would never come back
        poll(lambda: all(c == expected for c in worker_resources(cluster).values()), timeout=10)
        staying = worker_resources(cluster)
        assert staying and all(counts == expected for counts in staying.values()), staying
        if disruption != "scheduler-restart":  # (a nanny may have started a new worker-0)
            assert victim not in staying and set(workers) - {victim} <= set(staying)
            assert not r.exists(keys.worker_constrained(victim))  # nothing left behind
        # and the cluster still places by its GPUs
        assert client.submit(device_work, 99, str(tmp_path), resources=GPU).result(30) == 99


def test_names_hosts_and_preferences_place_tasks_as_dask_does_and_a_name_survives_a_restart(
    make_cluster: ClusterFactory,
) -> None:
    with (
        make_cluster(n_workers=1, nanny=True, resources=GPU) as cluster,
        Client(cluster) as client,
    ):
        r, keys = cluster.redis, cluster.keys
        [(address, info)] = client.scheduler_info()["workers"].items()
        assert client.submit(who, 1, workers=["worker-0"]).result(timeout=30)[0] == address
        assert client.submit(who, 2, workers="127.0.0.1").result(timeout=30)[0] == address
        # a preference for a worker that is not there: it runs elsewhere at once
        loose = client.submit(who, 3, workers=["nobody"], allow_other_workers=True)
        assert loose.result(timeout=30)[0] == address
        # a restriction naming no registered worker waits, visibly, until one joins
        later = client.submit(who, 4, workers=["later"])
        poll(lambda: r.hget(keys.task(later.key), "state") == b"no-worker")
        reason = read_task(r, keys, later.key)["waits_because"]
        assert reason.startswith("workers=['later'] matches no registered worker")
        cluster.start_worker(name="later", resources={})  # no GPU
        assert later.result(timeout=30)[1] == "later"
        # the nanny restarts worker-0 as a new process on a new port: its name still places
        os.kill(info["pid"], signal.SIGKILL)
        poll(lambda: not r.hexists(keys.workers, address))
        again = client.submit(who, 5, workers=["worker-0"])
        new_address, name, pid = again.result(timeout=60)
        assert name == "worker-0" and pid != info["pid"]
        assert client.scheduler_info()["workers"][new_address]["resources"] == {"GPU": 1.0}
        # its nanny gave the new process its resources too
        assert client.submit(who, 6, resources=GPU).result(timeout=30)[0] == new_address


def test_bad_resources_are_refused_at_start_with_what_to_write(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    for flag, said in (
        ("GPU=-1", "the amount of 'GPU' is -1; it must be 0 or more"),
        ("GPU=two", "the amount of 'GPU' is 'two', not a number"),
        ("GPU", "'GPU' is not NAME=AMOUNT; write the pairs like 'GPU=2,MEM=10e9'"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "redisdask", "worker", redis_url, "--cluster", cluster_name,
             "--no-nanny", "--resources", flag],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert "invalid config worker.resources" in done.stderr and said in done.stderr
        assert "from command-line flag --resources" in done.stderr
        assert "Traceback" not in done.stderr
    with pytest.raises(TypeError, match="the amount of 'GPU' must be a number"):
        make_cluster(resources={"GPU": "1"})
    r = redis.Redis.from_url(redis_url)
    assert not r.exists(Keys(cluster_name).workers)  # nothing started, nothing written
    with (
        make_cluster(n_workers=1) as cluster,
        Client(cluster) as client,
    ):
        with pytest.raises(ValueError, match="the amount of 'GPU' is -1"):
            client.submit(name_of, 1, resources={"GPU": -1})
        with pytest.raises(TypeError, match="must be a dict"):
            client.map(name_of, [1], resources="GPU=1")  # type: ignore[arg-type]
        assert client.submit(name_of, 2).result(timeout=30) == "worker-0"
        assert r.scard(cluster.keys.tasks) == 1  # the refused ones were never sent
