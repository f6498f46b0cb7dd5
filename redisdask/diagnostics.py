"""Client-side progress: a ``rich`` bar in a terminal, a plain line otherwise."""

from __future__ import annotations

import sys
import threading
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def progress(
    futures: Any,
    *,
    description: str = "tasks",
    console: Console | None = None,
    timeout: float | None = None,
) -> None:
    """Block until ``futures`` finish, drawing a progress bar (quiet when not a TTY)."""
    from redisdask.client import Future, _flatten

    fs = [f for f in _flatten(futures) if isinstance(f, Future)]
    done = threading.Semaphore(0)
    console = console or Console(file=sys.stderr)
    for f in fs:
        f.add_done_callback(lambda _f: done.release())
    if not console.is_terminal:
        for _ in fs:
            if not done.acquire(timeout=timeout):
                raise TimeoutError(f"futures did not finish within {timeout} s")
        console.print(f"{description}: {len(fs)}/{len(fs)} done")
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(description, total=len(fs))
        for _ in fs:
            if not done.acquire(timeout=timeout):
                raise TimeoutError(f"futures did not finish within {timeout} s")
            bar.advance(task)
