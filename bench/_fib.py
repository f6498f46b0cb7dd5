"""Recursive fib as distributed's documentation writes it, for
``bench/tasks_in_tasks.py``; in a module of its own so that both systems pickle it by
reference (``_fib.fib``), and their keys repeat (one task per ``(n, run)``)."""

from __future__ import annotations

import _tasks  # noqa: F401  (puts bench/ on the workers' PYTHONPATH)


def fib(n: int, run: int, system: str) -> int:
    """``system``: whose ``worker_client`` ("redisdask" or "dask")."""
    if system == "dask":
        from distributed import worker_client
    else:
        from redisdask import worker_client
    if n < 2:
        return n
    with worker_client() as client:
        a = client.submit(fib, n - 1, run, system)
        b = client.submit(fib, n - 2, run, system)
        a, b = client.gather([a, b])
    return a + b
