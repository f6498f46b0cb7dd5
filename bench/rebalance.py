"""``Client.rebalance``: redisdask vs Dask ``distributed`` on the same machine (not a test).

Three worker processes (1 thread each); ``--n`` arrays of ``--mb`` MB made on the first
one (``workers=``); then ``client.rebalance()``: its wall time, and the bytes each worker
holds after (from the scheduler's ``who_has``).  The clock starts 3 s after the data is
made (Dask weighs what its workers' heartbeats last said).  Both with the thresholds
distributed's own tests use for small data (``sender-min`` 0, ``sender-recipient-gap``
0; Dask's ``measure: managed``, which is what redisdask weighs by).  Median of
``--repeats``, each on fresh data.

    python bench/rebalance.py [--n 300] [--mb 1] [--repeats 3] [--only redisdask|dask]

Numbers are noisy on a shared machine: compare ratios, rerun before trusting one.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import _tasks

HEARTBEATS = 3.0  # seconds for the workers' memory to reach Dask's scheduler


def held(client: Any, futures: list[Any], nbytes: int) -> list[int]:
    """MB each worker holds of ``futures``, largest first."""
    per: dict[str, int] = {}
    for workers in client.who_has(futures).values():
        for w in workers:
            per[w] = per.get(w, 0) + nbytes
    return sorted((v // 1_000_000 for v in per.values()), reverse=True)


def measure(client: Any, first: str, n: int, mb: float, repeats: int) -> dict[str, Any]:
    nbytes = int(mb * 1_000_000)
    times, spread = [], []
    for _ in range(repeats):
        futures = client.map(_tasks.make_array, [nbytes] * n, pure=False, workers=[first])
        client.gather(futures[:1])
        while not all(f.done() for f in futures):
            time.sleep(0.01)  # (waiting for the data to exist, before the clock starts)
        # Dask caps its managed measure by the process memory its workers' heartbeats
        # report: right after the data is made it sees too little and moves too little
        time.sleep(HEARTBEATS)
        t0 = time.perf_counter()
        client.rebalance()
        times.append(time.perf_counter() - t0)
        spread = held(client, futures, nbytes)
        client.cancel(futures)
        del futures
        time.sleep(0.5)  # let both schedulers forget the data before the next round
    return {"rebalance_s": statistics.median(times), "mb_per_worker": spread}


@contextmanager
def redisdask_client() -> Iterator[tuple[Any, str]]:
    from redisdask import Client, LocalCluster

    os.environ["REDISDASK__WORKER__MEMORY__REBALANCE__SENDER_MIN"] = "0"
    os.environ["REDISDASK__WORKER__MEMORY__REBALANCE__SENDER_RECIPIENT_GAP"] = "0"
    with LocalCluster(n_workers=3, threads_per_worker=1) as cluster, Client(cluster) as client:
        yield client, "worker-0"


@contextmanager
def dask_client() -> Iterator[tuple[Any, str]]:
    import dask
    import distributed

    config = {
        "distributed.worker.memory.rebalance.measure": "managed",
        "distributed.worker.memory.rebalance.sender-min": 0,
        "distributed.worker.memory.rebalance.sender-recipient-gap": 0,
        "distributed.scheduler.active-memory-manager.start": False,
    }
    with (
        dask.config.set(config),
        distributed.LocalCluster(
            n_workers=3, threads_per_worker=1, processes=True, dashboard_address=None,
            silence_logs=logging.ERROR,
        ) as cluster,
        distributed.Client(cluster) as client,
    ):  # fmt: skip
        yield client, sorted(client.scheduler_info()["workers"])[0]


def run(name: str, make: Callable[..., Any], n: int, mb: float, repeats: int) -> dict[str, Any]:
    with make() as (client, first):
        results = measure(client, first, n, mb, repeats)
    print(f"{name}: {results}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--mb", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=["redisdask", "dask"])
    args = parser.parse_args()
    systems = {"redisdask": redisdask_client, "dask": dask_client}
    chosen = {n: make for n, make in systems.items() if args.only in (None, n)}
    results = {n: run(n, make, args.n, args.mb, args.repeats) for n, make in chosen.items()}
    print(f"\n{'':40}" + "".join(f"{n:>16}" for n in results))
    label = f"rebalance {args.n} x {args.mb:g} MB from 1 of 3: s"
    print(f"{label:40}" + "".join(f"{r['rebalance_s']:>16.2f}" for r in results.values()))
    spreads = "".join(f"{'/'.join(map(str, r['mb_per_worker'])):>16}" for r in results.values())
    print(f"{'  MB per worker after':40}" + spreads)


if __name__ == "__main__":
    main()
