"""How long a cluster takes to start: from ``LocalCluster(...)`` to the first task's result,
and the CPU its processes spent meanwhile; redisdask (2 nannied workers, 1 thread each,
its embedded or the given Redis) and Dask ``distributed`` (2 worker processes under
nannies, 1 thread each) side by side, in alternating runs (not a test).

A nanny restarting a worker, a test suite or a notebook pays this each time.

    python bench/startup.py [--repeats 5] [--only redisdask|dask]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import _tasks
import psutil


def _children_cpu() -> float:
    total = 0.0
    for proc in psutil.Process().children(recursive=True):
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def run_redisdask() -> tuple[float, float]:
    from redisdask import Client, LocalCluster

    t0 = time.perf_counter()
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, log_directory=tempfile.mkdtemp()
        ) as cluster,
        Client(cluster) as client,
    ):
        assert client.submit(_tasks.inc, 1).result(timeout=60) == 2
        return time.perf_counter() - t0, _children_cpu()


def run_dask() -> tuple[float, float]:
    from distributed import Client, LocalCluster

    t0 = time.perf_counter()
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
            silence_logs=logging.ERROR,
        ) as cluster,
        Client(cluster) as client,
    ):  # fmt: skip
        assert client.submit(_tasks.inc, 1).result(timeout=60) == 2
        return time.perf_counter() - t0, _children_cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="alternating runs")
    parser.add_argument("--only", choices=["redisdask", "dask"])
    args = parser.parse_args()
    runners: dict[str, Callable[[], tuple[float, float]]] = {
        "redisdask": run_redisdask,
        "dask": run_dask,
    }
    names = [args.only] if args.only else list(runners)
    walls: dict[str, list[float]] = {name: [] for name in names}
    cpus: dict[str, list[float]] = {name: [] for name in names}
    print(f"load average at the start: {os.getloadavg()[0]:.2f}")
    for run in range(args.repeats):
        for name in names[run % len(names) :] + names[: run % len(names)]:
            wall, cpu = runners[name]()
            walls[name].append(wall)
            cpus[name].append(cpu)
            print(f"{name:10s} run {run + 1}: first result after {wall:.2f} s; "
                  f"the cluster's processes used {cpu:.2f} s of CPU", flush=True)  # fmt: skip
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    for name in names:
        wall, cpu = statistics.median(walls[name]), statistics.median(cpus[name])
        print(f"{name:10s} median: first result after {wall:.2f} s, {cpu:.2f} s of CPU")
    if len(names) == 2:
        ratio = statistics.median(walls["dask"]) / statistics.median(walls["redisdask"])
        print(f"redisdask starts {ratio:.2f}x as fast as Dask")


if __name__ == "__main__":
    main()
