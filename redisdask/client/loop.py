"""The event loop a client's I/O runs on, and the bridge from blocking code to it.

A ``Client`` has one implementation of its I/O, in coroutines on redis-py's asyncio
client and ``comm.ConnectionPool`` (as distributed's client is written): an asynchronous
client runs them on the caller's loop, a blocking one on a ``LoopThread`` of its own and
waits for them (``run_blocking``), as distributed's ``sync()`` does.

Blocking on a loop from that loop's own thread would wait forever: ``run_blocking``
refuses, naming the way out (await the call, or make it from another thread).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """An asyncio loop running in a daemon thread until ``stop()``."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), name=name, daemon=True)
        self.thread.start()
        started.wait()

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(started.set)
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel what still runs on the loop, then stop it and join its thread."""
        if not self.thread.is_alive():
            return
        if threading.current_thread() is self.thread:
            raise RuntimeError("a client's loop thread cannot stop itself")

        async def cancel_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            asyncio.run_coroutine_threadsafe(cancel_rest(), self.loop).result(timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The loop running in this thread, if any."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def run_blocking(
    loop: asyncio.AbstractEventLoop,
    make: Callable[..., Coroutine[Any, Any, T]],
    *args: Any,
    **kwargs: Any,
) -> T:
    """Run ``make(*args, **kwargs)`` on ``loop`` (another thread's) and wait for it.
    Interrupted (Ctrl-C), the coroutine is cancelled too."""
    if running_loop() is loop:
        raise RuntimeError(
            f"{getattr(make, '__qualname__', make)} would block the client's own event loop "
            "and wait forever: await it (an asynchronous client's methods return "
            "awaitables), or call it from another thread"
        )
    if loop.is_closed():
        raise RuntimeError("the client's event loop is closed: create a new Client")
    future = asyncio.run_coroutine_threadsafe(make(*args, **kwargs), loop)
    try:
        return future.result()
    except BaseException:
        future.cancel()
        raise


def awaitable_on(
    loop: asyncio.AbstractEventLoop,
    make: Callable[..., Coroutine[Any, Any, T]],
    *args: Any,
    **kwargs: Any,
) -> Awaitable[T]:
    """``make(...)`` to await in the current thread's loop: the coroutine itself when
    that is ``loop``, else a future of it run on ``loop`` (a blocking client's calls
    awaited from other asyncio code)."""
    if running_loop() is loop:
        return make(*args, **kwargs)
    return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(make(*args, **kwargs), loop))


def offloaded(method: Callable[..., T]) -> Callable[..., Any]:
    """For a blocking method of the client (its cluster-wide calls: they read Redis with
    the blocking connection and poll): an asynchronous client runs it in a thread of the
    loop's executor and returns an awaitable of it, as distributed's methods are
    awaitable there; a blocking client runs it as it is."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.asynchronous and running_loop() is self.loop:
            return self.loop.run_in_executor(None, functools.partial(method, self, *args, **kwargs))
        return method(self, *args, **kwargs)

    return run


def wake(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
    """Set ``event`` (of ``loop``) from any thread."""
    if running_loop() is loop:
        event.set()
    elif not loop.is_closed():
        loop.call_soon_threadsafe(event.set)
