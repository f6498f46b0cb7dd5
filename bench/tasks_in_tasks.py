"""Tasks that submit tasks: recursive ``fib(20)`` through ``worker_client``, redisdask vs
Dask ``distributed`` (not a test).

Each system runs here one after the other with 2 worker processes x 2 threads
(``distributed.LocalCluster(n_workers=2, threads_per_worker=2, processes=True)``), the
function written as distributed's documentation writes it (``_fib.py``), each system with
its own ``worker_client``.  Equal arguments give equal keys, so ``fib(20)`` is 21 tasks,
each waiting (seceded) on the two below it: the figure is the latency of a chain of 20
submit-run-gather round trips through the cluster.  Each run gets arguments of its own
(a run number), so no run reuses another's results.  Prints the wall time of each system
(median of ``--repeats`` after one warm-up run, which also makes the workers' clients)
and the ratio.

    python bench/tasks_in_tasks.py [--n 20] [--repeats 3] [--only redisdask|dask]

Numbers are noisy on a shared machine: compare ratios, rerun before trusting one.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
import warnings
from typing import Any

import _fib

RUNS = itertools.count()


def expected(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def measure(client: Any, system: str, n: int, repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        got = client.submit(_fib.fib, n, next(RUNS), system).result()
        if i:  # the first run makes the workers' clients and warms connections up
            times.append(time.perf_counter() - start)
        assert got == expected(n), f"fib({n}) = {got}?"
    print(f"  {[f'{t:.3f}' for t in times]} s", file=sys.stderr)
    return statistics.median(times)


def run_redisdask(n: int, repeats: int) -> float:
    from redisdask import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=2) as cluster, Client(cluster) as client:
        print("[redisdask]", file=sys.stderr)
        return measure(client, "redisdask", n, repeats)


def run_dask(n: int, repeats: int) -> float:
    import logging

    import distributed

    with (
        distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=2,
            processes=True,
            dashboard_address=None,
            silence_logs=logging.ERROR,
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        print("[dask distributed]", file=sys.stderr)
        return measure(client, "dask", n, repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20, help="fib(n) (default 20)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median)")
    parser.add_argument("--only", choices=["redisdask", "dask"], help="run one system")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", module="distributed")
    results: dict[str, float] = {}
    if args.only in (None, "redisdask"):
        results["redisdask"] = run_redisdask(args.n, args.repeats)
    if args.only in (None, "dask"):
        results["dask"] = run_dask(args.n, args.repeats)
    import dask

    print(f"\nfib({args.n}) via worker_client, {args.n + 1} tasks, 2 workers x 2 threads")
    for system, seconds in results.items():
        print(f"  {system:10} {seconds:7.3f} s (median of {args.repeats})")
    if len(results) == 2:
        ratio = results["dask"] / results["redisdask"]
        print(f"  dask/redisdask {ratio:.2f}x  (dask {dask.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
