"""Coordination primitives, measured: redisdask vs Dask ``distributed`` (not a test).

The same code runs against each system's ``Lock`` and ``Queue`` from a client process:

1. ``lock``: an uncontended ``acquire()`` + ``release()`` round trip (one holder),
   ``--n`` times in a row; median per pair, in ms, and pairs per second;
2. ``lock-4-threads``: 4 threads of one client, each with its own ``Lock`` of one name,
   ``--n`` / 4 acquire+release pairs each: handed from holder to holder, pairs per
   second (the waiters' wake-ups are what this measures);
3. ``queue``: ``--n`` ``put(i)`` then ``--n`` ``get()`` of small ints, operations per
   second (puts and gets together);
4. ``queue-futures``: the same with futures as items (the queue holds them; each get
   hands the future to the client), ``--n`` / 10 items.

redisdask: ``LocalCluster(n_workers=1)`` on its embedded Redis (the primitives need no
worker nor scheduler: each operation is one Lua script in Redis).  Dask:
``distributed.LocalCluster(n_workers=1, processes=False)`` (each operation is a round
trip to the scheduler, which runs in the same process).  Medians of ``--repeats`` runs
after a warm-up.

    python bench/coordination.py [--repeats 3] [--n 1000] [--only redisdask|dask]

The machine is shared and noisy: compare ratios, rerun before trusting one.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("bench.coordination")


def inc(x: int) -> int:
    return x + 1


@contextlib.contextmanager
def redisdask_system() -> Iterator[tuple[Any, Any]]:
    import redisdask

    with redisdask.LocalCluster(n_workers=1) as cluster, redisdask.Client(cluster) as client:
        yield redisdask, client


@contextlib.contextmanager
def dask_system() -> Iterator[tuple[Any, Any]]:
    import distributed

    logging.getLogger("distributed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    with (
        distributed.LocalCluster(
            n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        yield distributed, client


def lock_pairs(mod: Any, client: Any, n: int) -> dict[str, float]:
    lock = mod.Lock(f"bench-{uuid.uuid4().hex}")
    times = []
    for _ in range(n):
        started = time.perf_counter()
        lock.acquire()
        lock.release()
        times.append(time.perf_counter() - started)
    return {"lock_pair_ms": statistics.median(times) * 1e3, "lock_pairs_per_s": n / sum(times)}


def lock_contended(mod: Any, client: Any, n: int) -> dict[str, float]:
    name = f"bench-{uuid.uuid4().hex}"
    per_thread = max(1, n // 4)
    inside = [0]
    overlaps = [0]

    def work() -> None:
        lock = mod.Lock(name)
        for _ in range(per_thread):
            lock.acquire()
            inside[0] += 1
            overlaps[0] += inside[0] > 1
            inside[0] -= 1
            lock.release()

    threads = [threading.Thread(target=work) for _ in range(4)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    assert not overlaps[0], "two holders at once"
    return {"lock_4_threads_pairs_per_s": 4 * per_thread / elapsed}


def queue_values(mod: Any, client: Any, n: int) -> dict[str, float]:
    q = mod.Queue(f"bench-{uuid.uuid4().hex}")
    started = time.perf_counter()
    for i in range(n):
        q.put(i)
    got = [q.get() for _ in range(n)]
    elapsed = time.perf_counter() - started
    assert got == list(range(n))
    return {"queue_ops_per_s": 2 * n / elapsed}


def queue_futures(mod: Any, client: Any, n: int) -> dict[str, float]:
    n = max(1, n // 10)
    futures = client.map(inc, range(n))
    client.gather(futures)
    q = mod.Queue(f"bench-{uuid.uuid4().hex}")
    started = time.perf_counter()
    for f in futures:
        q.put(f)
    got = [q.get() for _ in range(n)]
    elapsed = time.perf_counter() - started
    assert [f.key for f in got] == [f.key for f in futures]
    return {"queue_futures_ops_per_s": 2 * n / elapsed}


SCENARIOS: dict[str, Callable[[Any, Any, int], dict[str, float]]] = {
    "lock": lock_pairs,
    "lock-4-threads": lock_contended,
    "queue": queue_values,
    "queue-futures": queue_futures,
}

ROWS = [  # metric, label, higher is better
    ("lock_pair_ms", "Lock acquire+release, median ms", False),
    ("lock_pairs_per_s", "Lock acquire+release pairs/s", True),
    ("lock_4_threads_pairs_per_s", "Lock, 4 threads contending, pairs/s", True),
    ("queue_ops_per_s", "Queue put+get of ints, ops/s", True),
    ("queue_futures_ops_per_s", "Queue put+get of futures, ops/s", True),
]


def measure(system: Callable[[], Any], n: int, repeats: int) -> dict[str, float]:
    runs: dict[str, list[float]] = {}
    with system() as (mod, client):
        for name, scenario in SCENARIOS.items():
            scenario(mod, client, max(10, n // 10))  # warm-up
            for _ in range(repeats):
                for metric, value in scenario(mod, client, n).items():
                    runs.setdefault(metric, []).append(value)
            log.info("%s done", name)
    return {metric: statistics.median(values) for metric, values in runs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per scenario (median)")
    parser.add_argument("--n", type=int, default=1000, help="operations per run")
    parser.add_argument("--only", choices=["redisdask", "dask"], help="run one system")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results: dict[str, dict[str, float]] = {}
    if args.only != "dask":
        results["redisdask"] = measure(redisdask_system, args.n, args.repeats)
    if args.only != "redisdask":
        results["dask"] = measure(dask_system, args.n, args.repeats)
    print(f"\nmedians of {args.repeats} runs of {args.n} operations")
    print(f"{'':42} {'redisdask':>12} {'distributed':>12} {'ratio':>8}")
    for metric, label, higher in ROWS:
        ours = results.get("redisdask", {}).get(metric)
        theirs = results.get("dask", {}).get(metric)
        ratio = ""
        if ours and theirs:
            better = ours / theirs if higher else theirs / ours
            ratio = f"{better:.1f}x"
        cells = [f"{v:12,.2f}" if v is not None else f"{'-':>12}" for v in (ours, theirs)]
        print(f"{label:42} {cells[0]} {cells[1]} {ratio:>8}")
    print("(ratio: how many times better redisdask does; > 1 is faster)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
