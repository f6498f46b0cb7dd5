"""What a task's thread knows: the worker it belongs to, the task it runs, and the default
client (distributed's ``get_worker``, ``secede``, ``rejoin``, ``default_client``).

A worker binds every thread of its pool, and its event loop's thread, to itself
(``bind_thread``), and marks the task a pool thread runs (``start_task``/``end_task``).
The functions here read that binding, so they answer per thread: the in-thread workers of
one process (``LocalCluster(processes=False)``) each see their own, and the user's
threads see none.  The worker is a ``TaskHost`` here: the kernel imports neither
``redisdask.workers`` nor the client; ``get_client`` and ``worker_client``, which make
clients, are the client side's (``client/worker_client.py``).

* ``default_client()``: in a worker's threads the worker's own client, one per worker,
  made on first use (``TaskHost.task_client``); elsewhere the client last made with
  ``set_as_default`` (``set_default``), else ``ValueError``.
* ``secede()``: the task leaves the worker's thread pool.  Its thread goes on (and may
  wait on other tasks) but no longer counts against ``nthreads``: the worker may claim
  and run another task.  ``rejoin()`` blocks until a slot is free again; the task then
  counts again.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import threading
from collections.abc import Coroutine, Hashable, MutableMapping
from typing import TYPE_CHECKING, Any, Protocol

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

    def log_event(self, topic: str | list[str], msg: Any) -> None:
        """Log ``msg`` under ``topic`` (``client.log_event``'s, from a task)."""
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


def thread_key() -> str | None:
    """The key of the task the calling pool thread runs (None on the event loop, where
    ``async def`` tasks run: ``current_key`` names theirs)."""
    return _thread.key


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


def current_host() -> TaskHost | None:
    """The worker the calling thread belongs to, if any."""
    return _thread.host


def seceded() -> bool:
    """Whether the task the calling thread runs left its worker's thread pool."""
    return _thread.seceded


def running_task(what: str) -> tuple[TaskHost, str]:
    """The calling thread's worker and task, or ``ValueError`` naming ``what`` was
    called outside a task."""
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
    host, key = running_task("secede")
    if not _thread.seceded:
        _thread.seceded = True
        host.secede_task(key)


def rejoin() -> None:
    """Have a seceded task count against its worker's ``nthreads`` again
    (``distributed.rejoin``): blocks until a slot is free.  Does nothing in a task that
    has not seceded."""
    host, key = running_task("rejoin")
    if _thread.seceded:
        host.rejoin_task(key)
        _thread.seceded = False


# --------------------------------------------------------------------------- the default client

_default: list[Client | None] = [None]


def set_default(client: Client) -> None:
    """Make ``client`` the default outside tasks (``Client(set_as_default=True)``)."""
    _default[0] = client


def clear_default(client: Client) -> None:
    """``client`` closed: it is the default no more (another one stays)."""
    if _default[0] is client:
        _default[0] = None


def default_client() -> Client:
    """In a worker's threads its own client (``get_client``), else the default one."""
    client = task_client() or _default[0]
    if client is None:
        raise ValueError("no Client is running: create one with Client(...)")
    return client
