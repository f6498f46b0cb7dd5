"""Task functions for bench/throughput.py, in their own module so that both redisdask
and Dask pickle them by reference (``_tasks.noop``) rather than by value."""

from __future__ import annotations

from typing import Any


def noop(x: Any) -> Any:
    return x


def inc(x: int) -> int:
    return x + 1


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
    """Grow by 20 MB every 20 ms; note (in Redis at ``where``/``marker``, or in the file
    ``where``) the moment the process passed 95% of ``limit``."""
    import time

    import psutil

    process, blocks, noted = psutil.Process(), [], False
    while True:
        blocks.append(b"\x01" * 20_000_000)
        if not noted and process.memory_info().rss > 0.95 * limit:
            noted = True
            if marker is None:
                with open(where, "w") as f:
                    f.write(repr(time.time()))
            else:
                import redis

                redis.Redis.from_url(where).set(marker, time.time())
        time.sleep(0.02)
