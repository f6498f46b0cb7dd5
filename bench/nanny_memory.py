"""Nannies and memory, measured: redisdask vs Dask ``distributed`` (not a test).

1. ``terminate -> replaced``: a worker under a nanny with ``--memory-limit 300MB`` runs a
   task that allocates 20 MB every 20 ms; the task itself notes the time at which its
   process memory crossed 95 % of the limit (or its last step, if killed first).
   Measured: from that moment until a new worker process is registered (redisdask: in
   the ``workers`` hash; Dask: in ``scheduler_info()``), polled every 5 ms; median.
2. ``spill`` / ``unspill``: MB/s writing 40 numpy arrays of 10 MB through each system's
   spill buffer to a local directory and reading them back (redisdask's
   ``workers.spill.SpillBuffer``, Dask's ``distributed.spill.SpillBuffer``), in this
   process.  Median of ``--repeats``.
3. ``idle RSS``: the resident memory of an idle nanny + worker pair (one thread), 3 s
   after the worker registered.

    python bench/nanny_memory.py [--repeats 5]

The machine is shared and noisy: compare ratios, rerun before trusting one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _tasks
import psutil
from failures import free_port, poll_until

LIMIT = 300_000_000
ARRAY = 10_000_000
N_ARRAYS = 40


def crossing(lines: list[str]) -> float:
    """When the task's process passed 95% of the limit: the first step noted above it,
    else (killed before it could note it) the last step noted."""
    steps = [(float(t), int(rss)) for t, rss in (line.split() for line in lines)]
    above = [t for t, rss in steps if rss > 0.95 * LIMIT]
    return above[0] if above else steps[-1][0]


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()


def _tree_rss(pid: int) -> int:
    parent = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [parent, *parent.children(recursive=True)])


# ------------------------------------------------------------------------ redisdask


def redisdask_runs(redis_url: str, repeats: int) -> dict[str, list[float]]:
    import redis

    from redisdask import Client
    from redisdask.store.codecs import unpack
    from redisdask.store.keyspace import Keys

    out: dict[str, list[float]] = {"replaced_s": [], "idle_rss_mb": []}
    env = dict(os.environ, REDISDASK__REDIS__URL=redis_url, REDISDASK__LOGGING__LEVEL="ERROR")
    r = redis.Redis.from_url(redis_url)
    for i in range(repeats):
        cluster = f"bench-nanny-{os.getpid()}-{i}"
        keys = Keys(cluster)
        base = [sys.executable, "-m", "redisdask"]
        procs = [
            subprocess.Popen([*base, "scheduler", "--cluster", cluster], env=env),
            subprocess.Popen(
                [
                    *base,
                    "worker",
                    "--cluster",
                    cluster,
                    "--nthreads",
                    "1",
                    "--memory-limit",
                    str(LIMIT),
                ],
                env=env,
            ),
        ]
        try:
            poll_until(lambda: r.hlen(keys.workers) == 1, 60, 0.005)  # noqa: B023
            time.sleep(3)  # idle: let start-up allocations settle
            out["idle_rss_mb"].append(_tree_rss(procs[1].pid) / 1e6)
            [first] = r.hkeys(keys.workers)
            with Client(redis_url, cluster_name=cluster) as client:
                marker = f"{cluster}-crossed"
                client.submit(_tasks.allocate_until_killed, LIMIT, redis_url, marker)

                def replacement() -> bool:
                    return any(a != first for a in r.hkeys(keys.workers))  # noqa: B023

                poll_until(replacement, 60, 0.005)
                registered = time.time()
                crossed = crossing([x.decode() for x in r.lrange(marker, 0, -1)])
                out["replaced_s"].append(registered - crossed)
                [death] = [unpack(f[b"m"]) for _id, f in r.xrange(keys.deaths)][:1]
                print(f"[redisdask] {death['reason']}", file=sys.stderr)
                client.cancel(client.submit(_tasks.inc, 0))  # nothing left queued
        finally:
            _stop(procs[::-1])
    return out


# ------------------------------------------------------------------------ dask


def dask_runs(repeats: int) -> dict[str, list[float]]:
    import distributed

    out: dict[str, list[float]] = {"replaced_s": [], "idle_rss_mb": []}
    for _ in range(repeats):
        port = free_port()
        address = f"tcp://127.0.0.1:{port}"
        base = [sys.executable, "-m"]
        procs = [
            subprocess.Popen(
                [*base, "distributed.cli.dask_scheduler", "--port", str(port), "--no-dashboard"],
                stderr=subprocess.DEVNULL,
            ),
            subprocess.Popen(
                [
                    *base,
                    "distributed.cli.dask_worker",
                    address,
                    "--nthreads",
                    "1",
                    "--memory-limit",
                    str(LIMIT),
                    "--no-dashboard",
                ],
                stderr=subprocess.DEVNULL,
            ),
        ]
        try:
            with distributed.Client(address, timeout=30) as client:
                client.wait_for_workers(1, timeout=30)
                time.sleep(3)
                out["idle_rss_mb"].append(_tree_rss(procs[1].pid) / 1e6)
                [first] = client.scheduler_info()["workers"]
                marker = tempfile.mktemp(prefix="dask-crossed-")
                client.submit(_tasks.allocate_until_killed, LIMIT, marker, None, pure=False)

                def replacement() -> bool:
                    return any(a != first for a in client.scheduler_info()["workers"])  # noqa: B023

                poll_until(replacement, 60, 0.005)
                registered = time.time()
                crossed = crossing(Path(marker).read_text().splitlines())
                out["replaced_s"].append(registered - crossed)
                os.unlink(marker)
        finally:
            _stop(procs[::-1])
    return out


# ------------------------------------------------------------------------ spilling


def spill_throughput(make: Callable[[Path], Any], repeats: int) -> dict[str, list[float]]:
    """No reference to a written array is kept here: a spill buffer may (Dask's does)
    keep a weak reference to values still alive elsewhere and hand those back
    without reading the disk, which is not what is measured."""
    import numpy as np

    out: dict[str, list[float]] = {"spill_MBps": [], "unspill_MBps": []}
    total = N_ARRAYS * ARRAY / 1e6
    for _ in range(repeats):
        directory = Path(tempfile.mkdtemp(prefix="spill-bench-"))
        try:
            buffer = make(directory)
            spent = 0.0
            for i in range(N_ARRAYS):
                a = np.full(ARRAY // 8, i, dtype="f8")
                t0 = time.perf_counter()
                buffer[f"x{i}"] = a  # target 1 byte: every value goes to disk
                spent += time.perf_counter() - t0
                del a
            out["spill_MBps"].append(total / spent)
            t0 = time.perf_counter()
            for i in range(N_ARRAYS):
                assert buffer[f"x{i}"][-1] == i
            out["unspill_MBps"].append(total / (time.perf_counter() - t0))
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    from distributed.spill import SpillBuffer as DaskSpillBuffer

    from redisdask.deploy.embedded import EmbeddedRedis
    from redisdask.workers.spill import SpillBuffer

    results: dict[str, dict[str, list[float]]] = {"redisdask": {}, "dask": {}}
    results["redisdask"].update(spill_throughput(lambda d: SpillBuffer(d, 1), args.repeats))
    results["dask"].update(
        spill_throughput(lambda d: DaskSpillBuffer(str(d), target=1), args.repeats)
    )
    with EmbeddedRedis() as server:
        results["redisdask"].update(redisdask_runs(server.url, args.repeats))
    results["dask"].update(dask_runs(args.repeats))
    rows = [
        ("memory past 95% -> replacement registered, s", "replaced_s", "time"),
        ("spill 40 x 10 MB numpy, MB/s", "spill_MBps", "rate"),
        ("unspill 40 x 10 MB numpy, MB/s", "unspill_MBps", "rate"),
        ("idle nanny + worker RSS, MB", "idle_rss_mb", "time"),
    ]
    print(f"{'metric (median)':48} {'redisdask':>10} {'dask':>10} {'ratio':>8}")
    for label, field, kind in rows:
        a = statistics.median(results["redisdask"][field])
        b = statistics.median(results["dask"][field])
        ratio = b / a if kind == "time" else a / b
        print(f"{label:48} {a:10.2f} {b:10.2f} {ratio:7.2f}x")
    print("ratio > 1: redisdask is faster (or smaller)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
