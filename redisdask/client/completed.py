"""``as_completed``: futures in the order they finish, as distributed's ``as_completed``.

Read from distributed 2026.8 (``distributed/client.py``, ``tests/test_as_completed.py``):

* only futures go in (``TypeError: Input must be a future, got 1``); a future added
  twice comes out twice;
* ``with_results=True`` yields ``(future, result)``: an erred future raises its error
  there, or with ``raise_errors=False`` yields ``(future, (type, exception,
  traceback))``; a cancelled future yields ``(future, CancelledError)`` either way;
* ``timeout`` counts from the making of the ``as_completed``, not from each ``next``;
* ``next_batch(block=True)`` raises ``StopIteration`` when nothing is left to come
  (``batches()`` ends there); the futures of a batch after its first never raise;
* ``count()`` is the futures still computing plus those finished and not handed out,
  ``repr`` says ``<as_completed: waiting=N done=M>``.

A future's done callback (run on its client's callback thread) puts it in ``queue``; a
result is fetched when its pair is handed out, not before.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from redisdask.client.futures import Future, _await_checking, _seconds
from redisdask.client.loop import awaitable_on, wake
from redisdask.errors import FutureCancelledError

if TYPE_CHECKING:
    from redisdask.client.client import Client


class as_completed:
    """Iterate over futures in the order they finish (``for`` or ``async for``); ``add``
    and ``update`` add more while iterating; ``batches()`` yields lists of every future
    finished since the last list."""

    def __init__(
        self,
        futures: Iterable[Future] | None = None,
        loop: Any = None,
        with_results: bool = False,
        raise_errors: bool = True,
        *,
        timeout: float | str | None = None,
    ) -> None:
        self.futures: defaultdict[Future, int] = defaultdict(int)  # not done: times added
        self.queue: queue.Queue[Future] = queue.Queue()  # done, not handed out yet
        self.lock = threading.Lock()
        self.with_results = with_results
        self.raise_errors = raise_errors
        seconds = _seconds(timeout)
        self._timeout = seconds
        self._deadline = None if seconds is None else time.monotonic() + seconds
        # the loop and event of each wait for the next one (``_await_ready``)
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._clients: dict[Client, None] = {}  # whose waits' checks apply
        if futures:
            self.update(futures)

    def update(self, futures: Iterable[Future]) -> None:
        """Add futures; each comes out once it finishes (errs, or is cancelled)."""
        for future in futures:
            if not isinstance(future, Future):
                raise TypeError(f"Input must be a future, got {future}")
            with self.lock:
                self.futures[future] += 1
                self._clients[future.client] = None
            future.add_done_callback(self._on_done)

    def add(self, future: Future) -> None:
        """Add a future; it comes out once it finishes."""
        self.update((future,))

    def _on_done(self, future: Future) -> None:
        with self.lock:
            if future not in self.futures:  # cleared meanwhile
                return
            self.futures[future] -= 1
            if not self.futures[future]:
                del self.futures[future]
            self.queue.put_nowait(future)
            waiters = list(self._waiters)
        for waiter in waiters:
            wake(*waiter)

    def count(self) -> int:
        """The futures still computing plus those finished and not yet handed out."""
        with self.lock:
            return len(self.futures) + self.queue.qsize()

    def is_empty(self) -> bool:
        """Whether no future is left to come out."""
        return not self.count()

    def has_ready(self) -> bool:
        """Whether a finished future is waiting to be handed out."""
        return not self.queue.empty()

    def clear(self) -> None:
        """Forget every future not handed out yet."""
        with self.lock:
            self.futures.clear()
            while not self.queue.empty():
                self.queue.get_nowait()

    def __repr__(self) -> str:
        return f"<as_completed: waiting={len(self.futures)} done={self.queue.qsize()}>"

    # ------------------------------------------------------------------ blocking

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return self._output(self._next_future(), raising=True)

    next = __next__

    def next_batch(self, block: bool = True) -> list[Any]:
        """The futures finished so far (with ``block``, at least one: ``StopIteration``
        when none is left to come), or ``(future, result)`` pairs."""
        batch = [self._next_future()] if block else []
        batch.extend(self._drain())
        return [self._output(f, raising=block and i == 0) for i, f in enumerate(batch)]

    def batches(self) -> Iterator[list[Any]]:
        """Yield lists of the futures finished since the last list, until none is left."""
        while True:
            try:
                yield self.next_batch(block=True)
            except StopIteration:
                return

    def _next_future(self) -> Future:
        """The next finished future, waited for on a client's loop; ``StopIteration``
        when none is left to come."""
        while True:
            with self.lock:
                if self.queue.empty() and not self.futures:
                    raise StopIteration
                client = next(iter(self._clients))
            try:
                return self.queue.get_nowait()
            except queue.Empty:
                client._block(self._await_ready)

    def _drain(self) -> list[Future]:
        out = []
        while not self.queue.empty():
            out.append(self.queue.get_nowait())
        return out

    def _output(self, future: Future, raising: bool) -> Any:
        if not self.with_results:
            return future
        return future.client._block(self._aoutput, future, raising)

    # ------------------------------------------------------------------ asynchronous

    def __aiter__(self) -> as_completed:
        return self

    async def __anext__(self) -> Any:
        while True:
            with self.lock:
                if self.queue.empty() and not self.futures:
                    raise StopAsyncIteration
            try:
                future = self.queue.get_nowait()
            except queue.Empty:
                await self._await_ready()
            else:
                return await self._aoutput(future, raising=True)

    async def _await_ready(self) -> None:
        """Wait until a future is finished or none is left to come; ``TimeoutError``
        past the deadline.  Waits run the clients' checks (Redis away or the cluster
        not running too long raises), as every wait on futures does."""
        loop = asyncio.get_running_loop()
        waiter = (loop, asyncio.Event())
        try:
            while True:
                with self.lock:
                    if not self.queue.empty() or not self.futures:
                        return
                    waiter[1].clear()
                    self._waiters.add(waiter)
                    clients = list(self._clients)
                if not await _await_checking(waiter[1], clients, self._deadline):
                    raise TimeoutError(f"no future finished within {self._timeout} s")
        finally:
            with self.lock:
                self._waiters.discard(waiter)

    async def _aoutput(self, future: Future, raising: bool) -> Any:
        """``(future, result)``, as distributed's ``Future._result(raiseit=False)``."""
        if not self.with_results:
            return future
        state = future._state
        if state.status == "error":
            exception = state.exception
            if raising and self.raise_errors:
                raise exception.with_traceback(state.traceback)  # type: ignore[union-attr]
            return future, (type(exception), exception, state.traceback)
        if state.status == "cancelled":
            return future, FutureCancelledError(future._key, state.cancel_reason)
        try:
            return future, await awaitable_on(future.client.loop, future._aresult)
        except FutureCancelledError as exc:  # cancelled while its value was fetched
            return future, exc
