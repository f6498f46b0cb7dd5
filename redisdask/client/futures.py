"""Futures: ``Future``, the state futures of one key share, ``futures_of`` and ``wait``.

A ``Future`` is the client's handle on one task of the cluster; futures of one key share a
``_FutureState`` (status, exception, holders, done callbacks), which the client's
reader task updates from the scheduler's messages.  The client counts references
per key and tells the scheduler to release a key when its last future is
garbage-collected (``Future.release``).  Pickled inside a task's arguments a future is a
reference to its key's value (``spec.reduce_future``); pickled anywhere else (a closure of
the function, a task's result, a value other code stores) it is a future again when
unpickled, bound to the client there: in a task its worker's (``rebind_future``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Generator, Hashable, Iterable, Iterator, Mapping
from concurrent.futures import TimeoutError as FuturesTimeoutError
from typing import TYPE_CHECKING, Any, NamedTuple

from redisdask import comm
from redisdask import spec as specs
from redisdask.client.loop import awaitable_on, running_loop, wake
from redisdask.client.tracebacks import shorten_traceback
from redisdask.config import parse_duration
from redisdask.context import default_client
from redisdask.errors import FutureCancelledError, FuturesCancelledError
from redisdask.typenames import resolve_type

if TYPE_CHECKING:
    from redisdask.client.client import Client

logger = logging.getLogger("redisdask.client")  # the client's log: futures are its side

QUICK_WAIT = 0.25  # seconds a blocking result() waits in its own thread for a small result
_EVENT_LOCK = threading.Lock()  # the making of a future state's event (``_FutureState.wait``)


def inline_value(key: str, raw: bytes) -> Any:
    """A small result as it came with its news or from its record: unpickled (Redis is
    trusted as for the task specs it holds)."""
    try:
        return comm.deserialize([raw])
    except comm.SerializationError as exc:
        raise comm.SerializationError(f"key {key!r}: {exc}", key=key) from exc


# --------------------------------------------------------------------------- futures


class _FutureState:
    """What the client knows of one key, shared by all futures of that key."""

    __slots__ = (
        "_event",
        "callbacks",
        "cancel_reason",
        "exception",
        "finishes",
        "generation",
        "status",
        "traceback",
        "type",
        "unsent",
        "value",
        "who_has",
    )

    def __init__(self) -> None:
        self.status = "pending"
        # made by the first blocking wait only: a threading.Event (with its Condition
        # and Lock) per key was a quarter of the time of a 1,000,000-task ``map``
        self._event: threading.Event | None = None
        self.exception: BaseException | None = None
        self.traceback: Any = None
        self.type = ""
        self.who_has: list[str] = []
        self.value: bytes | None = None  # a small result, pickled, as the news brought it
        self.callbacks: list[Callable[[], None]] = []
        self.generation = 0  # the client's submission counter when last (re)submitted
        self.finishes = 0  # how many key-in-memory messages arrived (to spot stale ones)
        self.cancel_reason = "it was cancelled"
        self.unsent = False  # erred because its graph could not be written to Redis

    def is_set(self) -> bool:
        """Done: finished, erred or cancelled."""
        return self.status != "pending"

    def wait(self, timeout: float) -> bool:
        """Block until done or ``timeout`` seconds passed (from a thread other than the
        client's loop); whether it is done."""
        event = self._event
        if event is None:
            with _EVENT_LOCK:
                if self._event is None:
                    # made, then the status read: a ``_set`` in between finds the event
                    self._event = threading.Event()
                    if self.status != "pending":
                        self._event.set()
                event = self._event
        return event.wait(timeout)

    def _set(self, status: str) -> None:
        self.status = status  # first, then the event read (see ``wait``)
        if self._event is not None:
            self._event.set()
        callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                logger.exception("a future's done callback raised")

    def finish(self, who_has: list[str], type: str, value: bytes | None = None) -> None:
        self.who_has, self.type, self.value = who_has, type, value
        self.finishes += 1
        self._set("finished")

    def set_error(self, exception: BaseException, traceback: Any) -> None:
        self.exception, self.traceback = exception, traceback
        self._set("error")

    def cancel(self, reason: str = "it was cancelled") -> None:
        if self.status != "cancelled":
            self.who_has, self.exception, self.traceback = [], None, None
            self.value = None
            self.cancel_reason = reason
            self._set("cancelled")

    def reset(self) -> None:
        self.status = "pending"
        self.unsent = False
        self.value = None
        if self._event is not None:
            self._event.clear()


class Future:
    """A remotely running computation; ``result()`` brings its value here.

    ``key`` is the task's key in its dask form (a str, or a tuple like ``("x", 0)``);
    inside the cluster the key is its string form, ``_key``.  A future inside the
    arguments of a task, a dask graph or a ``delayed`` call is a dependency on its key
    (see ``spec.dumps_spec``)."""

    def __init__(
        self,
        key: str,
        client: Client,
        *,
        dask_key: Hashable | None = None,
        _state: _FutureState | None = None,
    ) -> None:
        self._key = key
        self.key: Hashable = key if dask_key is None else dask_key
        self.client = client
        self._state = _state or client._state_for(key)
        client._inc_ref(key)
        self._released = False

    @property
    def status(self) -> str:
        return self._state.status

    def done(self) -> bool:
        return self._state.is_set()

    def cancelled(self) -> bool:
        return self._state.status == "cancelled"

    @property
    def type(self) -> type | str | None:
        """The type of the result once finished (``int``), else None, as in distributed;
        its name where the type cannot be found here (see ``redisdask.typenames``)."""
        return resolve_type(self._state.type) if self._state.type else None

    def _wait(self, timeout: float | str | None) -> None:
        """Wait until done, from another thread than the client's loop."""
        self.client._block(self._adone, _seconds(timeout))

    async def _adone(self, timeout: float | None) -> None:
        """Wait until done (see ``Client._await_for``: the same checks as every wait)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        await self.client._await_for([self], deadline, stop_on_error=False)

    def result(self, timeout: float | str | None = None) -> Any:
        """The value, fetched from a worker holding it; the task's error if it erred.
        Awaitable on an asynchronous client (and ``await future`` anywhere).  The
        traceback of a task's error holds the task's frames, not the client's."""
        with shorten_traceback():
            return self._result_in(_seconds(timeout))

    def _result_in(self, seconds: float | None) -> Any:
        if not self.client.asynchronous and running_loop() is not self.client.loop:
            # a small result comes with its news: take it here, without a trip through
            # the client's loop thread (the full path below waits with its checks)
            state, start = self._state, time.monotonic()
            state.wait(QUICK_WAIT if seconds is None else min(seconds, QUICK_WAIT))
            raw = state.value
            if state.status == "finished" and raw is not None:
                return inline_value(self._key, raw)
            if seconds is not None:
                seconds = max(0.0, seconds - (time.monotonic() - start))
        return self.client._sync(self._aresult, seconds)

    async def _aresult(self, timeout: float | None = None) -> Any:
        with shorten_traceback():  # (awaited on an asynchronous client)
            return (await self.client._aresults([self], timeout))[self._key]

    def __await__(self) -> Generator[Any, None, Any]:
        return awaitable_on(self.client.loop, self._aresult).__await__()

    def _raise_if_failed(self) -> None:
        if self._state.status == "error":
            raise self._state.exception.with_traceback(self._state.traceback)  # type: ignore[union-attr]
        if self._state.status == "cancelled":
            raise FutureCancelledError(self._key, self._state.cancel_reason)

    def exception(self, timeout: float | str | None = None) -> Any:
        """The exception of an erred future (None otherwise), once done; awaitable on an
        asynchronous client."""
        return self.client._sync(self._aexception, _seconds(timeout))

    async def _aexception(self, timeout: float | None) -> BaseException | None:
        await self._adone(timeout)
        return self._state.exception

    def traceback(self, timeout: float | str | None = None) -> Any:
        """The traceback of an erred future, once done; awaitable on an asynchronous
        client."""
        return self.client._sync(self._atraceback, _seconds(timeout))

    async def _atraceback(self, timeout: float | None) -> Any:
        await self._adone(timeout)
        return self._state.traceback

    def cancel(self, reason: str | None = None, msg: str | None = None) -> Any:
        return self.client.cancel([self], reason=reason, msg=msg)

    def retry(self) -> Any:
        """Run the task again if it erred (see ``Client.retry``)."""
        return self.client.retry([self])

    def add_done_callback(self, fn: Callable[[Future], Any]) -> None:
        """Call ``fn(future)`` when it finishes (at once if it has).  It runs in a thread
        of the client's own (one, in order), so it may block or wait for futures."""
        client = self.client
        with client._lock:
            if not self._state.is_set():
                self._state.callbacks.append(lambda: client._run_callback(lambda: fn(self)))
                return
        fn(self)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.client._dec_ref(self._key)

    def __del__(self) -> None:
        # never ``release``: it takes the client's lock, which the thread this one runs
        # in (a collection can start in any thread) may hold, or may be waiting for
        if not self._released:
            self._released = True
            with contextlib.suppress(Exception):  # at interpreter shutdown anything goes
                self.client._dropped_future(self._key)

    def __reduce__(self) -> Any:
        return specs.reduce_future(self, self._key) or (rebind_future, (self._key, self.key))

    def __dask_tokenize__(self) -> Any:
        return ("redisdask.Future", self._key)

    def __repr__(self) -> str:
        if self.status == "finished" and self._state.type:
            return f"<Future: finished, type: {self._state.type}, key: {self.key}>"
        return f"<Future: {self.status}, key: {self.key}>"


def rebind_future(key: str, dask_key: Hashable) -> Future:
    """A future unpickled: bound to ``default_client()`` (in a task, its worker's client),
    which then wants its key for as long as the future lives, as if it had submitted it.
    A key the scheduler no longer knows makes the future err with
    ``DataUnavailableError`` (its submitter let it go before it was unpickled here)."""
    from redisdask.protocol import ClientDesiresKeys

    client = default_client()
    with client._lock:
        client._drain_dropped()  # (the collector's takings counted first)
        wanted = client._refcount.get(key, 0) > 0  # it has futures of the key already
        future = Future(key, client, dask_key=None if dask_key == key else dask_key)
    if not wanted:
        client._channel.send([ClientDesiresKeys(client.id, [key])])
    return future


# --------------------------------------------------------------------------- wait


class DoneAndNotDoneFutures(NamedTuple):
    done: set[Future]
    not_done: set[Future]


def futures_of(obj: Any) -> list[Future]:
    """The futures in ``obj``, in order, each once: a future, lists, tuples, sets,
    iterators and dict values of them, nested, or a dask collection (a persisted one's
    graph holds its futures), as distributed's ``futures_of``."""
    out: dict[int, Future] = {}
    todo = [obj]
    while todo:
        x = todo.pop()
        if isinstance(x, Future):
            out.setdefault(id(x), x)
        elif isinstance(x, list | tuple | set | frozenset | Iterator):
            todo.extend(reversed(list(x)))
        elif isinstance(x, Mapping):
            todo.extend(reversed(list(x.values())))
        elif callable(getattr(x, "__dask_graph__", None)) and not isinstance(x, type):
            graph = x.__dask_graph__()
            if isinstance(graph, Mapping):
                todo.extend(reversed([getattr(v, "value", v) for v in graph.values()]))
    return list(out.values())


def wait(fs: Any, timeout: float | str | None = None, return_when: str = "ALL_COMPLETED") -> Any:
    """Wait until all (or the first, ``return_when="FIRST_COMPLETED"``) futures finish.
    ``fs``: a future, a collection of them, or dask collections (``futures_of``).
    ``timeout``: seconds, or a string such as ``"1s"`` or ``"500ms"``.  Returns
    ``(done, not_done)``, or raises ``FuturesCancelledError`` if one of the done futures
    was cancelled (as distributed); awaitable when the futures' client is asynchronous."""
    if return_when not in ("ALL_COMPLETED", "FIRST_COMPLETED"):
        raise ValueError(f"return_when is ALL_COMPLETED or FIRST_COMPLETED, got {return_when!r}")
    futures = futures_of(fs)
    if not futures:
        return DoneAndNotDoneFutures(set(), set())
    return futures[0].client._sync(_await_wait, futures, _seconds(timeout), return_when)


async def _await_wait(
    futures: list[Future], timeout: float | None, return_when: str
) -> DoneAndNotDoneFutures:
    deadline = None if timeout is None else time.monotonic() + timeout
    if return_when == "FIRST_COMPLETED":
        loop = asyncio.get_running_loop()
        first = asyncio.Event()
        for f in futures:
            f.add_done_callback(lambda _f: wake(loop, first))
        if not await _await_checking(first, _clients(futures), deadline):
            raise FuturesTimeoutError(f"none of {len(futures)} futures finished in {timeout} s")
    else:
        for client in _clients(futures):
            mine = [f for f in futures if f.client is client]
            await awaitable_on(client.loop, client._await_for, mine, deadline, False)
    done = {f for f in futures if f.done()}
    cancelled = [f for f in done if f.cancelled()]
    if cancelled:  # as distributed's wait
        raise FuturesCancelledError(
            [FutureCancelledError(f._key, f._state.cancel_reason) for f in cancelled]
        )
    return DoneAndNotDoneFutures(done, set(futures) - done)


# --------------------------------------------------------------------------- helpers


def _clients(futures: Iterable[Future]) -> list[Client]:
    return list(dict.fromkeys(f.client for f in futures))


async def _await_checking(
    event: asyncio.Event, clients: Iterable[Client], deadline: float | None
) -> bool:
    """Wait for ``event`` until ``deadline`` (False then), in slices of at most 0.25 s,
    running each client's checks between slices, as ``Client._await_for`` does."""
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return False
        for client in clients:
            await awaitable_on(client.loop, client._channel.acheck_waiting)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), 0.25 if left is None else min(left, 0.25))
            return True


def _seconds(timeout: float | str | None) -> float | None:
    """A timeout in seconds from a number or a string such as ``"1s"`` or ``"100 ms"``."""
    return None if timeout is None else parse_duration(timeout)


def _flatten(obj: Any) -> Iterator[Any]:
    """The leaves of nested lists, tuples, sets, iterators and dict values (where the
    client, ``wait`` and ``progress`` look for futures)."""
    if isinstance(obj, list | tuple | set | frozenset | Iterator):
        for x in obj:
            yield from _flatten(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _flatten(x)
    else:
        yield obj
