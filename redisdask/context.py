"""Tasks that submit tasks: ``get_worker``, ``get_client``, ``worker_client``, ``secede``
and ``rejoin``, with distributed's names, arguments and behaviour.

A worker binds every thread of its pool, and its event loop's thread, to itself
(``bind_thread``), and marks the task a pool thread runs (``start_task``/``end_task``).
The functions here read that binding, so they answer per thread: the in-thread workers of
one process (``LocalCluster(processes=False)``) each see their own, and the user's
threads see none.  The worker is a ``TaskHost`` here: ``redisdask`` does not import
``redisdask.workers``.

* ``get_client()`` inside a task: the worker's client, one per worker, made on first use
  with the worker's Redis URL and cluster name (``TaskHost.task_client``); it is also
  what ``redisdask.client.default_client()`` answers in that thread.  Outside a task: the
  default client, else ``ValueError``, as in distributed.
* ``secede()``: the task leaves the worker's thread pool.  Its thread goes on (and may
  wait on other tasks) but no longer counts against ``nthreads``: the worker may claim
  and run another task.  ``rejoin()`` blocks until a slot is free again; the task then
  counts again.  ``worker_client()`` secedes for its duration and rejoins at its end.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import threading
from collections.abc import Coroutine, Hashable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any, Protocol

from redisdask.config import parse_duration

if TYPE_CHECKING:
    from redisdask.client.client import Client


class TaskHost(Protocol):
    """What a worker offers the tasks it runs (``redisdask.workers.worker.Worker``)."""

    address: str
    name: str | None
    nthreads: int
    data: MutableMapping[str, Any]
    redis_url: str

    def get_current_task(self) -> Hashable:
        """The key of the task calling this (``current_task``)."""
        ...

    def task_client(self, timeout: float | None = None) -> Client:
        """The worker's client (made on first use)."""
        ...

    def secede_task(self, key: str) -> None:
        """``key``'s thread left the pool (returns at once)."""
        ...

    def rejoin_task(self, key: str) -> None:
        """Block until ``key``'s thread may count against ``nthreads`` again."""
        ...


class _ThreadState(threading.local):
    host: TaskHost | None = None  # the worker this thread belongs to
    key: str | None = None  # the task it runs now
    seceded: bool = False  # that task left the pool and has not rejoined


_thread = _ThreadState()
# the task an ``async def`` task's asyncio task runs (on the worker's event loop, where
# many may run at once: per asyncio task, not per thread)
_async_key: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "redisdask_async_task", default=None
)


def bind_thread(host: TaskHost) -> None:
    """Make the calling thread ``host``'s (a pool thread, or the worker's event loop)."""
    _thread.host = host


def start_task(key: str) -> None:
    _thread.key, _thread.seceded = key, False


def end_task() -> None:
    _thread.key, _thread.seceded = None, False


def current_key() -> str | None:
    """The key of the task the calling thread (or ``async def`` task) runs, if any."""
    return _thread.key if _thread.key is not None else _async_key.get()


def current_task() -> Hashable:
    """The key of the running task as the client named it (``('x', 0)``, a tuple, for
    a dask collection's; Redis holds it as its ``repr``): ``Worker.get_current_task``."""
    key = current_key()
    if key is None:
        raise ValueError(
            "get_current_task() was called outside of a task running on a redisdask worker"
        )
    if key.startswith("("):
        with contextlib.suppress(ValueError, SyntaxError, TypeError, MemoryError):
            parsed = ast.literal_eval(key)
            if isinstance(parsed, tuple):
                return parsed
    return key


async def run_as_task(key: str, coro: Coroutine[Any, Any, Any]) -> Any:
    """Await an ``async def`` task's coroutine as task ``key`` (``current_key`` answers
    it inside), in the asyncio task this runs in."""
    _async_key.set(key)  # (this asyncio task's own context: no reset needed)
    return await coro


def task_client() -> Client | None:
    """The client of the worker the calling thread belongs to (made on first use), or
    None outside a worker's threads: what ``default_client()`` answers first."""
    host = _thread.host
    return None if host is None else host.task_client()


def get_worker() -> TaskHost:
    """The worker running the calling task (``distributed.get_worker``): its
    ``address``, ``name``, ``nthreads`` and ``data`` (the results it holds, by key)."""
    host = _thread.host
    if host is None:
        raise ValueError(
            "No worker found: get_worker() called outside of a task running on a redisdask worker"
        )
    return host


def get_client(
    address: str | None = None, timeout: float | str | None = None, resolve_address: bool = True
) -> Client:
    """A client while within a task (``distributed.get_client``): the worker's own,
    connected to the worker's cluster.  Outside a task, the default client; with an
    ``address`` (a Redis URL) of another cluster, a new client of it.  ``timeout``:
    for connecting (seconds, or a string such as ``"10s"``).  ``resolve_address`` is
    accepted for distributed's sake (a Redis URL needs no resolving)."""
    seconds = None if timeout is None else parse_duration(timeout)
    host = _thread.host
    if host is not None and (not address or address == host.redis_url):
        return host.task_client(seconds)
    from redisdask.client.client import Client, default_client

    try:
        client: Client | None = default_client()
    except ValueError:
        client = None
    if client is not None and (not address or client.redis_url == address):
        return client
    if address:
        return Client(address, timeout=seconds)
    raise ValueError(
        "No global client found and no address provided: get_client() was called outside "
        "of a task with no Client running; create one with Client(...) first, or pass "
        "the cluster's Redis URL"
    )


def _running_task(what: str) -> tuple[TaskHost, str]:
    host, key = _thread.host, _thread.key
    if host is None or key is None:
        raise ValueError(
            f"{what}() was called outside of a task running on a redisdask worker: only a "
            "task can leave or rejoin its worker's thread pool"
        )
    return host, key


def secede() -> None:
    """Have this task leave its worker's thread pool (``distributed.secede``).

    Its thread goes on, but no longer counts against the worker's ``nthreads``: the
    worker may run (and claim) another task meanwhile.  Call it before waiting on other
    tasks (``client.gather`` of the futures a task submitted), so that they can run
    even where every thread is taken by such waiting tasks.  Once is enough: a second
    call does nothing.  ``rejoin()`` makes the task count again."""
    host, key = _running_task("secede")
    if not _thread.seceded:
        _thread.seceded = True
        host.secede_task(key)


def rejoin() -> None:
    """Have a seceded task count against its worker's ``nthreads`` again
    (``distributed.rejoin``): blocks until a slot is free.  Does nothing in a task that
    has not seceded."""
    host, key = _running_task("rejoin")
    if _thread.seceded:
        host.rejoin_task(key)
        _thread.seceded = False


@contextlib.contextmanager
def worker_client(
    timeout: float | str | None = None, separate_thread: bool = True
) -> Iterator[Client]:
    """The worker's client, for a task to submit tasks and wait for them
    (``distributed.worker_client``)::

        def total(paths):
            with worker_client() as client:
                return sum(client.gather(client.map(load, paths)))

    With ``separate_thread`` (the default) the task secedes for the duration of the
    block (unless it already had) and rejoins at its end, so tasks waiting on the tasks
    they submitted never hold every thread of a cluster: recursion cannot deadlock."""
    _running_task("worker_client")
    client = get_client(timeout=timeout)
    leave = separate_thread and not _thread.seceded
    if leave:
        secede()
    try:
        yield client
    finally:
        if leave:
            rejoin()


def dask_get(dsk: Any, keys: Any, **kwargs: Any) -> Any:
    """dask's scheduler in a worker's own process (``Worker.install_dask_scheduler``):
    inside a task, the cluster, through the worker's client (what distributed's
    ``get_client()`` gives dask there); elsewhere, dask's threads."""
    if _thread.key is None:
        import dask.threaded

        return dask.threaded.get(dsk, keys, **kwargs)
    return get_client().get(dsk, keys, **kwargs)
