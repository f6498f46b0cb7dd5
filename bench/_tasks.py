"""Task functions for the benchmarks, in their own module so that both redisdask and Dask
pickle them by reference (``_tasks.noop``) rather than by value.

Importing it puts ``bench/`` on ``PYTHONPATH``, so that the worker processes a benchmark
starts (of both systems) can import it too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

BENCH_DIR = str(Path(__file__).resolve().parent)
if BENCH_DIR not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in [BENCH_DIR, os.environ.get("PYTHONPATH", "")] if p
    )


def noop(x: Any) -> Any:
    return x


def inc(x: int) -> int:
    return x + 1


def add(x: int, y: int) -> int:
    return x + y


def make_array(nbytes: int) -> Any:
    import numpy as np

    return np.ones(nbytes // 8)


def consume(a: Any) -> int:
    """Touch the array cheaply (the point is the transfer, not the compute)."""
    return int(a.nbytes)


def sleep_inc(x: int, delay: float = 0.05) -> int:
    import time

    time.sleep(delay)  # stands for 50 ms of work
    return x + 1


def exit_process(code: int) -> None:
    """Kill the worker process running it, as a segfaulting extension would."""
    import os

    os._exit(code)


def allocate_until_killed(limit: int, where: str, marker: str | None) -> None:
    """Grow by 20 MB every 20 ms, noting ``time rss`` after each step from 80% of
    ``limit`` on (in the Redis list ``marker`` at ``where``, or in the file ``where``),
    so the moment the process passed 95% can be read back after it was killed."""
    import time

    import psutil

    process, blocks = psutil.Process(), []
    note = None
    if marker is not None:
        import redis

        r = redis.Redis.from_url(where)

        def note(line: str) -> None:
            r.rpush(marker, line)

    while True:
        blocks.append(b"\x01" * 20_000_000)
        rss = process.memory_info().rss
        if rss > 0.8 * limit:
            line = f"{time.time()!r} {rss}"
            if note is not None:
                note(line)
            else:
                with open(where, "a") as f:
                    f.write(line + "\n")
                    f.flush()
        time.sleep(0.02)


def dask_local_cluster(**options: Any) -> Any:
    """Dask's own ``LocalCluster`` as every benchmark here runs it: 2 worker processes x
    1 thread, no dashboard, quiet (``options``: more of its arguments)."""
    import logging

    import distributed

    return distributed.LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        silence_logs=logging.ERROR,
        **options,
    )


def timed(x: int, delay: float = 0.02) -> tuple[float, float]:
    """``delay`` seconds of work; when it ran (``time.monotonic``, one clock per machine)."""
    import time

    start = time.monotonic()
    time.sleep(delay)  # stands for work on a device
    return start, time.monotonic()
