"""Client-side progress: ``redisdask.progress(futures)`` draws a ``rich`` bar per task
prefix in a terminal and says one line when done otherwise (a log file or a CI job gets
no escape codes and no thousand redraws)."""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from redisdask.spec import key_prefix

MAX_ROWS = 8  # prefixes drawn one bar each; more share one "other" bar


def progress(
    futures: Any,
    *,
    description: str | None = None,
    console: Console | None = None,
    timeout: float | None = None,
) -> None:
    """Block until every future in ``futures`` (any nesting of lists, tuples, dicts) is
    done, finished or erred, drawing one bar per task prefix (``inc``, ``sum``, ...).

    Raises ``TimeoutError`` when ``timeout`` seconds pass first; errors are counted, not
    raised: call ``future.result()`` to get one."""
    from redisdask.client.futures import futures_of

    fs = futures_of(futures)
    console = console or Console(file=sys.stderr)
    finished: list[Any] = []
    changed = threading.Condition()

    def on_done(future: Any) -> None:
        with changed:
            finished.append(future)
            changed.notify()

    for f in fs:
        f.add_done_callback(on_done)
    deadline = None if timeout is None else time.monotonic() + timeout
    totals = Counter(key_prefix(f.key) for f in fs)
    rows = [p for p, _ in totals.most_common(MAX_ROWS)]
    if len(totals) > MAX_ROWS:
        rows.append("other")

    def row_of(future: Any) -> str:
        prefix = key_prefix(future.key)
        return prefix if prefix in rows else "other"

    if not console.is_terminal:
        _wait(changed, finished, len(fs), deadline, lambda _new: None)
        erred = sum(f.status == "error" for f in fs)
        label = description or f"{len(fs)} tasks"
        console.print(f"{label}: {len(fs) - erred} done" + (f", {erred} erred" if erred else ""))
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(complete_style="green", finished_style="green"),
        MofNCompleteColumn(),
        TextColumn("{task.fields[erred]}", style="red"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as bar:
        per_row = Counter(row_of(f) for f in fs)
        bars = {
            row: bar.add_task(
                row if description is None else f"{description}: {row}",
                total=per_row[row],
                erred="",
            )
            for row in rows
        }
        erred: Counter[str] = Counter()

        def advance(new: list[Any]) -> None:
            for future in new:
                row = row_of(future)
                if future.status == "error":
                    erred[row] += 1
                    bar.update(bars[row], erred=f"{erred[row]} erred")
                bar.advance(bars[row])

        _wait(changed, finished, len(fs), deadline, advance)


def _wait(
    changed: threading.Condition,
    finished: list[Any],
    total: int,
    deadline: float | None,
    advance: Any,
) -> None:
    seen = 0
    while seen < total:
        with changed:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"{total - seen} of {total} futures were not done in time")
            changed.wait_for(lambda seen=seen: len(finished) > seen, timeout=remaining)
            new = finished[seen:]
        seen += len(new)
        advance(new)
