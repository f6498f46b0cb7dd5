"""``redisdask demo``: a small real computation on a local cluster.

A few hundred tasks: chunks of random numbers are made on the workers, normalised and
summarised, the summaries reduced pairwise in a tree; the chunks (numpy arrays of 8 MB)
move between workers peer-to-peer when a task on one worker needs a chunk from another.
"""

from __future__ import annotations

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
    from workers import get_worker

    return float(chunk.sum()), float((chunk**2).sum()), chunk.size, get_worker().name or ""


def combine(a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[float, float, int, str]:
    return a[0] + b[0], a[1] + b[1], a[2] + b[2], "tree"


def square(x: int) -> int:
    return x * x


def run_demo(redis_url: str | None = None, n_workers: int = 2) -> int:
    from redisdask import Client, LocalCluster
    from redisdask.diagnostics import progress

    console = Console()
    start = time.perf_counter()
    with LocalCluster(n_workers=n_workers, threads_per_worker=1, redis_url=redis_url) as cluster:
        console.print(f"[bold]redisdask demo[/] on {cluster!r}")
        with Client(cluster) as client:
            chunks = client.map(make_chunk, range(N_CHUNKS))
            shifted = [
                client.submit(shift, chunks[i], chunks[(i + 1) % N_CHUNKS]) for i in range(N_CHUNKS)
            ]
            summaries = client.map(summarise, shifted)
            level = summaries
            while len(level) > 1:
                level = [
                    client.submit(combine, a, b)
                    for a, b in zip(level[::2], level[1::2], strict=True)
                ]
            squares = client.map(square, range(200))
            total_sq = client.submit(sum, squares)
            everything = [*chunks, *shifted, *summaries, *squares, total_sq, level[0]]
            progress(everything, console=console)
            s, s2, n, _ = level[0].result()
            sum_of_squares = total_sq.result()
            per_chunk = client.gather(summaries)
            holders = client.who_has(chunks)
            workers = client.scheduler_info()["workers"]
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
    return 0 if ok else 1
