"""Short tracebacks for a task's error re-raised in the client (dask's
``shorten_traceback``, which distributed's ``Future.result`` and ``Client.gather`` use).

A task's exception reaches the user's code through the client's machinery: its loop
thread, ``concurrent.futures``, the futures' bookkeeping.  ``shorten_traceback`` drops
those frames from the traceback of an exception leaving its block, keeping the first
frame (the user's call) and the last (where the task raised), so the user reads their
call, then the task function's own frames (the worker sends only those,
``redisdask.workers.failures``).

The frames dropped are those of dask's ``admin.traceback.shorten`` (where dask is
installed: a user who sets it to ``[]`` keeps every frame, as in Dask) and those of
redisdask's client.
"""

from __future__ import annotations

import re
from types import TracebackType

# redisdask's client machinery between the user's call and the task's own frames
PATTERNS = (
    r"concurrent[\\/]futures[\\/]",
    r"asyncio[\\/]",
    r"redisdask[\\/]client[\\/](client|channel|futures|loop|dask_graph)\.py",
)
# dask's default admin.traceback.shorten, where dask is not installed
DASK_PATTERNS = (
    r"dask[\\/](base|core|local|multiprocessing|optimization|threaded|utils)\.py",
    r"dask[\\/]_task_spec\.py",
    r"distributed[\\/](client|scheduler|utils|worker)\.py",
    r"tornado[\\/]gen\.py",
)


def _patterns() -> list[str] | None:
    """What to drop; None when the user turned shortening off (dask's config ``[]``)."""
    try:
        import dask.config
    except ImportError:
        return [*DASK_PATTERNS, *PATTERNS]
    configured = dask.config.get("admin.traceback.shorten", default=list(DASK_PATTERNS))
    if not configured:
        return None
    return [*configured, *PATTERNS]


def shorten(tb: TracebackType) -> TracebackType:
    """``tb`` without the frames of the shortened modules, but for its first and last
    (dask's ``shorten_traceback.shorten``, applied in place)."""
    paths = _patterns()
    if not paths:
        return tb
    expression = re.compile(".*(" + "|".join(paths) + ")")
    current: TracebackType | None = tb
    kept: TracebackType | None = None
    while current is not None:
        if kept is None:
            kept = current  # the first frame
        elif current.tb_next is None or not expression.match(current.tb_frame.f_code.co_filename):
            kept.tb_next = current  # the last frame, or one that is not the machinery's
            kept = current
        current = current.tb_next
    return tb


class shorten_traceback:
    """Shorten the traceback of an exception leaving the block (``shorten``)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None and tb is not None:
            exc.__traceback__ = shorten(tb)
