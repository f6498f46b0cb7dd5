"""Dask collections: redisdask vs Dask ``distributed`` on the same workloads (not a test).

Each system runs here one after the other with 2 worker processes x 1 thread, as dask's
default scheduler (``x.compute()``), on:

1. dask.array ``(x + x.T).mean()``, x 4,000 x 4,000 random, 500 x 500 chunks;
2. dask.dataframe groupby-mean over 1,000,000 rows in 20 partitions, made on the workers
   (``dd.from_map``), 20 keys.

Prints the wall time (median of ``--repeats`` after one warm-up run), the ratio and the
number of tasks, and checks each result against dask's synchronous scheduler.

    python bench/dask_collections.py [--repeats 3] [--only redisdask|dask]

Numbers are noisy on a shared machine: compare ratios, rerun before trusting one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import _tasks  # puts bench/ on the workers' PYTHONPATH
import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd

ROWS, PARTITIONS = 1_000_000, 20


def make_partition(i: int) -> pd.DataFrame:
    rng = np.random.default_rng(i)
    n = ROWS // PARTITIONS
    return pd.DataFrame({"key": rng.integers(0, 20, n), "value": rng.random(n)})


def array_workload() -> Any:
    x = da.random.default_rng(0).random((4000, 4000), chunks=(500, 500))
    return (x + x.T).mean()


def dataframe_workload() -> Any:
    meta = make_partition(0).iloc[:0]
    ddf = dd.from_map(make_partition, range(PARTITIONS), meta=meta)
    return ddf.groupby("key").value.mean()


WORKLOADS: dict[str, Callable[[], Any]] = {
    "array (x + x.T).mean() 4000x4000/500": array_workload,
    "dataframe groupby-mean 1M rows/20": dataframe_workload,
}


def n_tasks(collection: Any) -> int:
    from dask._expr import FinalizeCompute
    from dask.base import collections_to_expr

    return len(FinalizeCompute(collections_to_expr([collection])).optimize().__dask_graph__())


def expected_results() -> dict[str, Any]:
    """What dask's synchronous scheduler computes, before any cluster exists."""
    return {name: make().compute(scheduler="sync") for name, make in WORKLOADS.items()}


def measure(repeats: int, expected: dict[str, Any]) -> dict[str, float]:
    """Seconds per workload, the client in use being dask's default scheduler."""
    out = {}
    for name, make in WORKLOADS.items():
        times = []
        for i in range(repeats + 1):
            start = time.perf_counter()
            got = make().compute()
            if i:  # the first run warms imports and connections up
                times.append(time.perf_counter() - start)
        assert np.allclose(np.asarray(got), np.asarray(expected[name])), f"{name}: wrong result"
        out[name] = statistics.median(times)
        print(f"  {name}: {out[name]:.3f} s (median of {repeats})", file=sys.stderr)
    return out


def run_redisdask(repeats: int, expected: dict[str, Any]) -> dict[str, float]:
    from redisdask import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1) as cluster, Client(cluster):
        print("[redisdask]", file=sys.stderr)
        return measure(repeats, expected)


def run_dask(repeats: int, expected: dict[str, Any]) -> dict[str, float]:
    import distributed

    with (
        _tasks.dask_local_cluster() as cluster,
        distributed.Client(cluster),
    ):
        print("[dask distributed]", file=sys.stderr)
        return measure(repeats, expected)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median)")
    parser.add_argument("--only", choices=["redisdask", "dask"], help="run one system")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", module="distributed")
    expected = expected_results()
    results: dict[str, dict[str, float]] = {}
    if args.only in (None, "redisdask"):
        results["redisdask"] = run_redisdask(args.repeats, expected)
    if args.only in (None, "dask"):
        results["dask"] = run_dask(args.repeats, expected)
    print(f"\n{'workload':42} {'tasks':>6} " + " ".join(f"{s:>10}" for s in results), end="")
    print("   dask/redisdask" if len(results) == 2 else "")
    for name, make in WORKLOADS.items():
        row = f"{name:42} {n_tasks(make()):>6} "
        row += " ".join(f"{results[s][name]:>9.3f}s" for s in results)
        if len(results) == 2:
            row += f"   {results['dask'][name] / results['redisdask'][name]:>6.2f}x"
        print(row)
    print(f"\ndask {dask.__version__}, 2 workers x 1 thread each, medians of {args.repeats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
