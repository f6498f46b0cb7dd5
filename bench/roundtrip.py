"""The sequential round trip, ``submit(inc, i).result()`` one at a time, and what it costs
each process: redisdask (a 2-worker ``LocalCluster``, 1 thread each) and Ray
(``ray.init(num_cpus=2)``) side by side, in alternating runs (not a test).

CPU is each process's user + system time over the loop (``psutil``), divided by the
round trips: on a shared machine it moves far less with the load than the wall time, and
it says where a round trip's work goes (client, scheduler, workers, Redis).  To compare
two versions of redisdask, run this from each checkout in turn.

    python bench/roundtrip.py [--n 300] [--repeats 3] [--only redisdask|ray]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import _tasks
import psutil


def _role(proc: psutil.Process) -> str:
    cmd = " ".join(proc.cmdline())
    for role in ("redis-server", "scheduler", "ray"):
        if role in cmd:
            return role
    if " worker " in cmd:  # a nanny runs ``redisdask worker``, its child ``... --no-nanny``
        return "worker" if "--no-nanny" in cmd else "nanny"
    return "other"


def _cpu(procs: dict[str, psutil.Process]) -> dict[str, float]:
    out = {}
    for name, proc in procs.items():
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        out[name] = times.user + times.system
    return out


def measure(call: Callable[[int], Any], n: int) -> tuple[float, dict[str, float]]:
    """Median round trip (ms) and CPU per round trip (ms) of every process of the tree."""
    me = psutil.Process()
    procs = {"client": me}
    procs.update({f"{_role(p)}-{p.pid}": p for p in me.children(recursive=True)})
    for i in range(20):  # warm-up
        call(i)
    before = _cpu(procs)
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        value = call(i)
        times.append(time.perf_counter() - t0)
        if value != i + 1:
            raise AssertionError(f"inc({i}) returned {value!r}")
    after = _cpu(procs)
    per = {k: (after[k] - before[k]) / n * 1e3 for k in after if k in before}
    return statistics.median(times) * 1e3, per


def run_redisdask(n: int) -> tuple[float, dict[str, float]]:
    from redisdask import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, log_directory=tempfile.mkdtemp()
        ) as cluster,
        Client(cluster) as client,
    ):
        return measure(lambda i: client.submit(_tasks.inc, i, pure=False).result(timeout=30), n)


def run_ray(n: int) -> tuple[float, dict[str, float]]:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR,
             log_to_driver=False)  # fmt: skip
    try:
        inc = ray.remote(_tasks.inc)
        return measure(lambda i: ray.get(inc.remote(i)), n)
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=300, help="round trips per run")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs")
    parser.add_argument("--only", choices=["redisdask", "ray"])
    args = parser.parse_args()
    runners = {"redisdask": run_redisdask, "ray": run_ray}
    names = [args.only] if args.only else list(runners)
    medians: dict[str, list[float]] = {name: [] for name in names}
    print(f"load average at the start: {os.getloadavg()[0]:.2f}")
    for run in range(args.repeats):
        for name in names[run % len(names) :] + names[: run % len(names)]:
            median, cpu = runners[name](args.n)
            medians[name].append(median)
            roles: dict[str, float] = {}
            for process, ms in cpu.items():
                role = process.rsplit("-", 1)[0]
                roles[role] = roles.get(role, 0.0) + ms
            ranked = sorted(roles.items(), key=lambda x: -x[1])
            shown = ", ".join(f"{r} {ms:.2f}" for r, ms in ranked)
            print(f"{name:10s} run {run + 1}: median {median:.2f} ms; CPU ms per round trip: "
                  f"{shown}; total {sum(roles.values()):.2f}", flush=True)  # fmt: skip
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    for name in names:
        print(f"{name:10s} median of medians: {statistics.median(medians[name]):.2f} ms")


if __name__ == "__main__":
    main()
