"""``MultiLock``: several locks taken together, with distributed's names and semantics:
``MultiLock(names=["x", "y"])``, ``acquire(blocking=True, timeout=None,
num_locks=None)`` (``num_locks`` of the names, all by default), ``release()``,
``locked()``, ``with ml:`` (and, on an asynchronous client, ``await ml.acquire()`` and
``async with ml:``).

As in distributed's scheduler extension, each name has a queue of requests in arrival
order, and the head of a queue holds that lock.  A request joins the queues of its
names in one Lua script (``coordination/scripts.py``, ``MULTILOCK_ACQUIRE``), the
shortest first, stopping as soon as it heads ``num_locks`` of them; otherwise it waits,
holding the ones it heads, and is handed each lock as the requests before it leave.  So
nobody overtakes an earlier request, and no two requests wait for each other (each waits
only for earlier ones).  Its names are ``rd:{c}:multilock:<name>``, a namespace of their own:
``MultiLock(["x"])`` and ``Lock("x")`` are two things, as in distributed.

Leases as ``Lock``'s: a holder's request lapses ``scheduler.locks.lease-timeout`` after
its process last renewed it (the lease renewer of ``semaphore.py``), and a waiter's after
its word (a few seconds), so the locks of a process killed with -9 pass on by
themselves; every script first takes out the requests that lapsed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import redis

from redisdask import spec
from redisdask.coordination.backend import Attempt, Backend, Bound, as_key, seconds
from redisdask.coordination.semaphore import renewer
from redisdask.errors import LeaseNotHeldError

if TYPE_CHECKING:
    from redisdask.client.client import Client

logger = logging.getLogger("redisdask.coordination")


class MultiLock(Bound):
    """The locks ``names`` (each a str or any dask-key-like value), shared by every
    ``MultiLock`` naming them in the cluster.  ``client``: the client to use (default:
    the default client; inside a task, the worker's)."""

    kind = "multilock"

    def __init__(self, names: Sequence[Any] | None = None, client: Client | None = None) -> None:
        self.id = uuid.uuid4().hex
        super().__init__(self.id, client)
        self.names = names or []
        self._names = _lock_names(self.names)
        self._locked = False  # what locked() says: acquired, and not released since
        self._renewing = False  # holds a lease to renew

    def acquire(
        self,
        blocking: bool = True,
        timeout: float | str | None = None,
        num_locks: int | None = None,
    ) -> Any:
        """Take ``num_locks`` of the locks (None: all), waiting at most ``timeout``
        seconds (None: as long as it takes; ``blocking=False``: only if free now).  True
        if taken (awaitable on an asynchronous client)."""
        what = self._what("acquire()")
        wait = seconds(timeout)
        if not blocking:
            if timeout is not None:
                raise ValueError("can't specify a timeout for a non-blocking call")
            wait = 0.0
        need = self._need(num_locks, what)
        if self._locked:
            raise RuntimeError(
                f"{what}: this MultiLock holds its locks already: release() it first, or "
                "make another MultiLock of the same names to wait for them"
            )

        def attempt(b: Backend) -> Attempt:
            lease_ms = int(b.lease_timeout * 1000)
            fresh = True

            def once(_waiter: str, wait_ms: int) -> tuple[bool, Any, str, float | None]:
                nonlocal fresh
                reply = b.scripts.multilock_acquire(
                    id=self.id, fresh=fresh, wait_ms=wait_ms, lease_ms=lease_ms,
                    num_locks=need, names=self._names,
                )  # fmt: skip
                fresh = False
                if reply[0] == 1:
                    return True, None, "", None
                again = int(reply[2]) / 1000 if len(reply) > 2 else None
                return False, None, reply[1].decode(), again

            return once

        def then(acquired: bool, _: Any) -> bool:
            if acquired:
                self._locked = self._renewing = True
                renewer.add(self)
            return acquired

        try:
            return self._guarded(self._waiting("acquire()", wait, attempt, then))
        except BaseException:  # interrupted (Ctrl-C, its client closed): leave the queues
            self._leave()
            raise

    def _need(self, num_locks: int | None, what: str) -> int:
        if not self._names:
            raise ValueError(f"{what}: a MultiLock of no names has nothing to acquire")
        if num_locks is None or num_locks == 0:  # distributed: num_locks or len(names)
            return len(self._names)
        if isinstance(num_locks, bool) or not isinstance(num_locks, int):
            raise TypeError(f"{what}: num_locks must be an int or None, got {num_locks!r}")
        if not 1 <= num_locks <= len(self._names):
            raise ValueError(
                f"{what}: num_locks={num_locks}, but there are {len(self._names)} distinct "
                "names: ask for between 1 and that many (None: all)"
            )
        return num_locks

    def _guarded(self, result: Any) -> Any:
        """``result``; an interrupted asynchronous wait (a cancelled task, a closed
        client) leaves the queues at once instead of holding its place until its word
        lapses."""
        if not asyncio.iscoroutine(result):
            return result

        async def waited() -> Any:
            try:
                return await result
            except BaseException:
                self._leave()
                raise

        return waited()

    def _leave(self) -> None:
        """Take this instance's request out of its queues now, if it is in them (best
        effort: else it lapses with its word, in a few seconds)."""
        b = self._backend
        if b is None:
            return
        release = functools.partial(b.scripts.multilock_release, id=self.id)
        with contextlib.suppress(RuntimeError, redis.RedisError):
            if self._asynchronous(b):
                b.client.loop.run_in_executor(None, release)  # (the loop must not block)
            else:
                release()

    def release(self) -> Any:
        """Give the locks back (awaitable on an asynchronous client); ``ValueError``, as
        in distributed, if this instance does not hold them."""
        what = self._what("release()")
        if not self._locked:
            raise ValueError(f"Lock is not yet acquired: {what}: this MultiLock holds nothing")
        self._locked = self._renewing = False

        def run(b: Backend) -> None:
            if not b.scripts.multilock_release(id=self.id):
                raise LeaseNotHeldError(
                    f"{what}: its lease of {self.names!r} had lapsed: nothing renewed it for "
                    f"scheduler.locks.lease-timeout ({b.lease_timeout:g} s; was this process "
                    "paused, or cut off from Redis?), so another holder may have had them "
                    "meanwhile"
                )

        return self._call("release()", run)

    def locked(self) -> bool:
        """Whether this instance holds its locks (distributed's: a plain bool)."""
        return self._locked

    def _holds(self) -> bool:
        return self._renewing

    def _renew(self) -> bool:
        """Renew this instance's lease; False once it holds none (or cannot)."""
        b = self._backend
        if not self._renewing or b is None or b.client.status != "running":
            return False
        if not b.scripts.multilock_renew(id=self.id, lease_ms=int(b.lease_timeout * 1000)):
            self._renewing = False
            logger.warning(
                "%s: its lease lapsed before it was renewed (scheduler.locks.lease-timeout "
                "%g s): another holder may have taken its locks",
                self,
                b.lease_timeout,
            )
            return False
        return True

    def __enter__(self) -> MultiLock:
        if self._asynchronous(self._bind("__enter__()")):
            raise TypeError(
                f"{self._what('__enter__()')}: on an asynchronous client use 'async with'"
            )
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    async def __aenter__(self) -> MultiLock:
        await self.acquire()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()

    def _what(self, op: str) -> str:
        return f"MultiLock({self.names!r}).{op}"

    def __repr__(self) -> str:
        return f"<MultiLock: {self.names!r}>"

    def __reduce__(self) -> Any:
        return type(self), (self.names,)


def _lock_names(names: Sequence[Any]) -> list[str]:
    """The distinct names' string forms in Redis, in their order (as ``Lock``'s)."""
    if isinstance(names, str | bytes):
        raise TypeError(f"MultiLock takes a list of names, got one name {names!r}: use [name]")
    out: list[str] = []
    for name in names:
        key = as_key(name)
        if key is None:
            raise TypeError(
                "a MultiLock's names are each a str, bytes, int, float or a tuple of those "
                f"(as a dask key), got {type(name).__name__} {name!r}"
            )
        if spec.stringify(key) not in out:
            out.append(spec.stringify(key))
    return out
