"""Blocking calls from a coroutine, in a thread of their own.

``asyncio.to_thread`` uses the loop's default executor, which refuses new work once the
interpreter has begun to exit ("cannot schedule new futures after interpreter
shutdown"): the close of an in-process worker or a client at exit must not depend on it.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def in_thread(fn: Callable[[], T]) -> T:
    """``fn()`` in a new daemon thread; its result (or exception) here."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not done.done():
            outcome()

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:
            loop.call_soon_threadsafe(settle, functools.partial(done.set_exception, exc))
        else:
            loop.call_soon_threadsafe(settle, functools.partial(done.set_result, result))

    threading.Thread(target=run, daemon=True, name=getattr(fn, "__name__", "in-thread")).start()
    return await done
