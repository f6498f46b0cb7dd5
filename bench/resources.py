"""Worker resources: redisdask vs Dask ``distributed`` on the same machine (not a test).

1. capacity: one worker process with 4 threads and ``GPU=2``; 200 tasks of 20 ms with
   ``resources={"GPU": 1}``: the wall time (2.0 s if both GPUs are always busy) and the
   most tasks that ran at once (from the times each task returns; must be 2);
2. overhead: 2 workers x 1 thread, each with ``GPU=1e6`` (resources never run out):
   tasks/s of ``map`` + ``gather`` of 10,000 no-ops with ``resources={"GPU": 1}`` and
   without, median of ``--repeats`` after a warm-up.

    python bench/resources.py [--repeats 3] [--only redisdask|dask]

Numbers are noisy on a shared machine: compare ratios, rerun before trusting one.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import _tasks

N_DEVICE, DELAY, N_MAP = 200, 0.02, 10_000


def most_at_once(runs: list[tuple[float, float]]) -> int:
    running = peak = 0
    for _, step in sorted([(s, 1) for s, _ in runs] + [(e, -1) for _, e in runs]):
        running += step
        peak = max(peak, running)
    return peak


def measure(client: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    runs = client.gather(
        client.map(_tasks.timed, range(N_DEVICE), delay=DELAY, resources={"GPU": 1}, pure=False)
    )
    out["device_s"] = time.perf_counter() - t0
    out["device_at_once"] = most_at_once(runs)
    return out


def throughput(client: Any, repeats: int, **resources: Any) -> float:
    def once(offset: int) -> float:
        t0 = time.perf_counter()
        futures = client.map(_tasks.noop, range(offset, offset + N_MAP), pure=False, **resources)
        assert client.gather(futures) == list(range(offset, offset + N_MAP))
        return time.perf_counter() - t0

    once(0)
    return N_MAP / statistics.median(once((r + 1) * N_MAP) for r in range(repeats))


@contextmanager
def redisdask_client(n_workers: int, threads: int, gpus: float) -> Iterator[Any]:
    from redisdask import Client, LocalCluster

    with (
        LocalCluster(n_workers=n_workers, threads_per_worker=threads, resources={"GPU": gpus})
        as cluster,
        Client(cluster) as client,
    ):  # fmt: skip
        yield client


@contextmanager
def dask_client(n_workers: int, threads: int, gpus: float) -> Iterator[Any]:
    import distributed

    with (
        distributed.LocalCluster(
            n_workers=n_workers, threads_per_worker=threads, processes=True,
            dashboard_address=None, silence_logs=logging.ERROR, resources={"GPU": gpus},
        ) as cluster,
        distributed.Client(cluster) as client,
    ):  # fmt: skip
        yield client


def run(name: str, make: Callable[..., Any], repeats: int) -> dict[str, float]:
    with make(1, 4, 2) as client:
        results = measure(client)
    with make(2, 1, 1e6) as client:
        results["map_resources_per_s"] = throughput(client, repeats, resources={"GPU": 1})
        results["map_plain_per_s"] = throughput(client, repeats)
    print(f"{name}: {results}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=["redisdask", "dask"])
    args = parser.parse_args()
    systems = {"redisdask": redisdask_client, "dask": dask_client}
    chosen = {n: make for n, make in systems.items() if args.only in (None, n)}
    results = {n: run(n, make, args.repeats) for n, make in chosen.items()}
    print(f"\n{'':38}" + "".join(f"{n:>12}" for n in results))
    rows = [
        ("device_s", f"{N_DEVICE} x {DELAY * 1000:.0f} ms, GPU=2, 4 threads: s", "{:.2f}"),
        ("device_at_once", "  most GPU tasks at once", "{:.0f}"),
        ("map_resources_per_s", f"map {N_MAP:,} no-ops, resources=: tasks/s", "{:,.0f}"),
        ("map_plain_per_s", f"map {N_MAP:,} no-ops, none: tasks/s", "{:,.0f}"),
    ]
    for key, label, fmt in rows:
        print(f"{label:38}" + "".join(f"{fmt.format(r[key]):>12}" for r in results.values()))


if __name__ == "__main__":
    main()
