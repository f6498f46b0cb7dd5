"""``redisdask demo``: a small real computation on a local cluster.

Futures: a few hundred tasks: chunks of random numbers are made on the workers,
normalised and summarised, the summaries reduced pairwise in a tree; the chunks (numpy
arrays of 8 MB) move between workers peer-to-peer when a task on one worker needs a chunk
from another.

Dask collections (with dask installed; ``--dask`` runs only these): a dask.dataframe
groupby-mean and a dask.array ``(x + x.T).mean()``, unchanged dask code run on the
cluster (the client is dask's scheduler), each checked against dask's own synchronous
scheduler.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

N_CHUNKS = 32
CHUNK = 1_000_000


def make_chunk(i: int) -> np.ndarray:
    return np.random.default_rng(i).random(CHUNK)


def shift(chunk: np.ndarray, other: np.ndarray) -> np.ndarray:
    """Needs two chunks, usually made on different workers: one travels peer-to-peer."""
    return chunk - other.mean()


def summarise(chunk: np.ndarray) -> tuple[float, float, int, str]:
    from redisdask.workers import get_worker

    return float(chunk.sum()), float((chunk**2).sum()), chunk.size, get_worker().name or ""


def combine(a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[float, float, int, str]:
    return a[0] + b[0], a[1] + b[1], a[2] + b[2], "tree"


def square(x: int) -> int:
    return x * x


def run_demo(redis_url: str | None = None, n_workers: int = 2, only_dask: bool = False) -> int:
    from redisdask import Client, LocalCluster

    console = Console()
    with_dask = only_dask or importlib.util.find_spec("dask") is not None
    with (
        LocalCluster(n_workers=n_workers, threads_per_worker=1, redis_url=redis_url) as cluster,
        Client(cluster) as client,
    ):
        console.print(f"[bold]redisdask demo[/] on {cluster!r}")
        ok = only_dask or futures_demo(client, console)
        if with_dask:
            ok = dask_demo(client, console) and ok
    return 0 if ok else 1


def futures_demo(client: Any, console: Console) -> bool:
    from redisdask.client.diagnostics import progress

    start = time.perf_counter()
    chunks = client.map(make_chunk, range(N_CHUNKS))
    shifted = [client.submit(shift, chunks[i], chunks[(i + 1) % N_CHUNKS]) for i in range(N_CHUNKS)]
    summaries = client.map(summarise, shifted)
    level = summaries
    while len(level) > 1:
        level = [client.submit(combine, a, b) for a, b in zip(level[::2], level[1::2], strict=True)]
    squares = client.map(square, range(200))
    total_sq = client.submit(sum, squares)
    everything = [*chunks, *shifted, *summaries, *squares, total_sq, level[0]]
    progress(everything, console=console)
    s, s2, n, _ = level[0].result()
    sum_of_squares = total_sq.result()
    per_chunk = client.gather(summaries)
    holders = client.who_has(chunks)
    workers = client.scheduler_info(n_workers=-1)["workers"]
    ntasks = len(everything) + len(level) - 1

    expected = sum(
        float((c - make_chunk((i + 1) % N_CHUNKS).mean()).sum())
        for i, c in enumerate(make_chunk(i) for i in range(N_CHUNKS))
    )
    table = Table(title="where the chunks were made and summarised")
    for column in ("worker", "name", "chunks held", "summaries computed"):
        table.add_column(column)
    for address, info in sorted(workers.items()):
        held = sum(address in h for h in holders.values())
        computed = sum(r[3] == info.get("name") for r in per_chunk)
        table.add_row(address, str(info.get("name")), str(held), str(computed))
    console.print(table)
    mean = s / n
    std = (s2 / n - mean**2) ** 0.5
    console.print(
        f"{n:,} shifted numbers: mean {mean:+.6f} (checked locally: "
        f"{expected / n:+.6f}), std {std:.4f} (uniform: 0.2887); "
        f"sum of squares 0..199: {sum_of_squares:,}"
    )
    ok = abs(s - expected) < 1e-6 * max(1.0, abs(expected)) and sum_of_squares == sum(
        i * i for i in range(200)
    )
    console.print(
        f"{ntasks} tasks in {time.perf_counter() - start:.2f} s: "
        f"{'[green]correct[/]' if ok else '[red]WRONG[/]'}"
    )
    return ok


def dask_demo(client: Any, console: Console) -> bool:
    """Unchanged dask code; ``compute()`` runs on the cluster (the client is dask's
    default scheduler), each result checked against ``scheduler="sync"``."""
    import dask.array as da
    import dask.dataframe as dd
    import pandas as pd

    rng = np.random.default_rng(7)
    frame = pd.DataFrame({"key": rng.integers(0, 20, 400_000), "value": rng.random(400_000)})
    table = Table(title="dask collections on the cluster")
    for column in ("computation", "tasks", "seconds", "result", "vs dask's sync scheduler"):
        table.add_column(column)
    ok = True
    for name, make in (
        ("dask.dataframe groupby-mean, 400,000 rows, 8 partitions",
         lambda: dd.from_pandas(frame, npartitions=8).groupby("key").value.mean()),
        ("dask.array (x + x.T).mean(), 4,000 x 4,000, 500 x 500 chunks",
         lambda: (lambda x: (x + x.T).mean())(
             da.random.default_rng(0).random((4000, 4000), chunks=(500, 500)))),
    ):  # fmt: skip
        collection = make()
        ntasks = len(collection.__dask_graph__())
        start = time.perf_counter()
        got = collection.compute()  # on the cluster
        seconds = time.perf_counter() - start
        expected = make().compute(scheduler="sync")
        same = bool(np.allclose(np.asarray(got), np.asarray(expected)))
        ok = ok and same
        shown = f"{float(got):.6f}" if np.ndim(got) == 0 else f"{type(got).__name__} of {len(got)}"
        verdict = "[green]equal[/]" if same else "[red]DIFFERENT[/]"
        table.add_row(name, f"{ntasks:,}", f"{seconds:.2f}", shown, verdict)
    console.print(table)
    return ok
