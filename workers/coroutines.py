"""``async def`` functions as tasks: their coroutine runs on the worker's event loop.

distributed runs a task whose function is a coroutine function on its worker's event loop
and takes what the coroutine returns as the task's result (``Worker.execute``,
``_run_task_async``); an exception in it is the task's error.  Here the task's pool
thread calls the function (as for any task); what it returns, a coroutine, is then
awaited on the worker's event loop while the thread waits, so the task still counts
against ``nthreads`` as in distributed, and ``get_worker()`` answers in the coroutine.
A ``BaseException`` that is no ``Exception`` raised in it (``SystemExit``) is caught
before it reaches the event loop, which it would stop: the task fails instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from typing import Any

from redisdask import context

POLL = 0.5  # seconds between checks that the worker still runs, while a coroutine does


class _Interrupted(Exception):
    """Carries a ``BaseException`` out of the event loop without stopping it."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(repr(error))
        self.error = error


async def _guarded(key: str, coro: Coroutine[Any, Any, Any]) -> Any:
    try:
        return await context.run_as_task(key, coro)
    except (KeyboardInterrupt, SystemExit) as exc:  # asyncio would re-raise these
        raise _Interrupted(exc) from None
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is not None and task.cancelling():  # the worker closes: it cancelled
            raise
        raise _Interrupted(exc) from None  # the task's own: its error, as distributed's


def run_coroutine(
    coro: Coroutine[Any, Any, Any],
    key: str,
    loop: asyncio.AbstractEventLoop,
    running: Callable[[], bool],
) -> Any:
    """In a task's pool thread: the result of ``coro``, awaited on ``loop`` as task
    ``key``, or its exception.  Cancelled (``CancelledError``) once ``running()`` turns
    false or the loop closes: the worker is closing, and hands the task back."""
    try:
        future = asyncio.run_coroutine_threadsafe(_guarded(key, coro), loop)
    except RuntimeError:  # the loop is closed: the worker is gone
        coro.close()
        raise asyncio.CancelledError(f"the worker closed before task {key!r} ran") from None
    while not concurrent.futures.wait([future], timeout=POLL).done:
        if loop.is_closed() or not running():
            future.cancel()
            raise asyncio.CancelledError(f"the worker closed while task {key!r} ran")
    try:
        return future.result()
    except _Interrupted as exc:
        raise exc.error from None  # (with its own traceback: the coroutine's frames)
