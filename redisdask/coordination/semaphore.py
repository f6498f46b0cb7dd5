"""``Semaphore``: at most ``max_leases`` holders at once, across every process of a
cluster, with distributed's names and semantics (``Lock`` is one with one lease).

The state is one Redis hash, ``rd:{c}:semaphore:<name>`` (``lock:<name>`` for a
``Lock``): ``max`` and, per lease, when it lapses (Redis's clock, ms).  A lease lasts
``scheduler.locks.lease-timeout`` (30 s, as in Dask) and its holder's process renews it
every fifth of that from one background thread, so a holder killed with -9 frees its
lease when it lapses, and a live one keeps it as long as it likes.  The hash is deleted
with the last lease.  Blocking ``acquire`` waits on the signal stream (see
``backend.wait_until``), waking at each release and at the next lapse.

As in distributed, a lease that lapses while its holder still runs (a process paused
longer than the timeout) can be taken by another: overbooking, logged as a warning by
the renewal that finds it gone; that holder's ``release`` then raises
``LeaseNotHeldError``.
"""

from __future__ import annotations

import logging
import threading
import uuid
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

import redis

from redisdask.coordination.backend import Attempt, Backend, Bound, script_error, seconds
from redisdask.errors import LeaseNotHeldError, RedisDaskError

if TYPE_CHECKING:
    from redisdask.client.client import Client

logger = logging.getLogger("redisdask.coordination")


class Semaphore(Bound):
    """A semaphore of ``max_leases`` leases named ``name``; two instances of one name, in
    any processes of a cluster, share it.  ``client``: the client to use (default: the
    default client; inside a task, the worker's Redis).  ``register``, ``scheduler_rpc``
    and ``loop`` are distributed's and have no use here.

    ``acquire(timeout=None) -> bool``, ``release() -> bool``, ``get_value()`` (the leases
    held now), ``close()``, and ``with sem: ...``; on an asynchronous client each returns
    an awaitable, and ``async with sem: ...`` (as distributed's)."""

    kind = "semaphore"

    def __init__(
        self,
        max_leases: int = 1,
        name: Any = None,
        client: Client | None = None,
        *,
        register: bool = True,
        scheduler_rpc: Any = None,
        loop: Any = None,
    ) -> None:
        if isinstance(max_leases, bool) or not isinstance(max_leases, int) or max_leases < 1:
            raise ValueError(f"max_leases must be an int >= 1, got {max_leases!r}")
        super().__init__(name, client)
        self.max_leases = max_leases
        self.id = uuid.uuid4().hex
        self._leases: deque[str] = deque()  # held by this instance, oldest first
        self._lock = threading.Lock()

    def acquire(self, timeout: float | str | None = None) -> Any:
        """Take a lease, waiting for one at most ``timeout`` seconds (None: as long as
        it takes); True if taken (awaitable on an asynchronous client)."""
        return self._acquire(seconds(timeout), "acquire()")

    def _acquire(self, timeout: float | None, op: str) -> Any:
        what = self._what(op)
        lease = uuid.uuid4().hex

        def attempt(b: Backend) -> Attempt:
            lease_ms = int(b.lease_timeout * 1000)

            def once(waiter: str, wait_ms: int) -> tuple[bool, Any, str, float | None]:
                try:
                    reply = b.scripts.acquire(
                        kind=self.kind, name=self._name, waiter=waiter, wait_ms=wait_ms,
                        lease=lease, max_leases=self.max_leases, lease_ms=lease_ms,
                    )  # fmt: skip
                except redis.ResponseError as exc:
                    if script_error(exc, "INCONSISTENT"):
                        raise ValueError(
                            f"{what}: {type(self).__name__} {self.name!r} is in use with "
                            f"other max_leases ({str(exc).rsplit(' ', 1)[-1]}; this one has "
                            f"{self.max_leases}): give every instance of one name the same "
                            "max_leases, or use another name"
                        ) from None
                    raise
                if reply[0] == 1:
                    return True, None, "", None
                return False, None, reply[1].decode(), int(reply[2]) / 1000

            return once

        def then(acquired: bool, _: Any) -> bool:
            if acquired:
                with self._lock:
                    self._leases.append(lease)
                renewer.add(self)
            return acquired

        return self._waiting(op, timeout, attempt, then)

    def release(self) -> Any:
        """Give back this instance's oldest lease (awaitable on an asynchronous client).
        ``RuntimeError("Released too often")``, as distributed raises, if it holds none
        (a ``LeaseNotHeldError``)."""
        what = self._what("release()")
        with self._lock:
            if not self._leases:
                raise LeaseNotHeldError(
                    f"Released too often: {what}: this instance holds no lease of "
                    f"{self.name!r} (released more often than acquired, or never acquired "
                    f"here: a {type(self).__name__} pickled into a task is a new instance, "
                    "so acquire and release it in the same process)"
                )
            lease = self._leases.popleft()

        def run(b: Backend) -> bool:
            if not b.scripts.release(kind=self.kind, name=self._name, lease=lease):
                raise LeaseNotHeldError(
                    f"{what}: its lease of {self.name!r} had lapsed: nothing renewed it for "
                    f"scheduler.locks.lease-timeout ({b.lease_timeout:g} s; was this process "
                    "paused, or cut off from Redis?), so another holder may have had it "
                    "meanwhile"
                )
            return True

        return self._call("release()", run)

    def get_value(self) -> Any:
        """How many leases are held now, by anyone."""
        return self._call(
            "get_value()", lambda b: int(b.scripts.count_leases(kind=self.kind, name=self._name))
        )

    def register(self, **kwargs: Any) -> Any:
        """distributed's; a semaphore here needs no registering."""
        return self._call("register()", lambda b: None)

    def close(self) -> Any:
        """Delete the semaphore, with any lease still held (as distributed's ``close``,
        which warns about those); waiters start afresh."""
        with self._lock:
            held = list(self._leases)
            self._leases.clear()

        def run(b: Backend) -> None:
            if b.scripts.count_leases(kind=self.kind, name=self._name) > len(held):
                logger.warning("closing %s while other instances hold leases of it", self)
            b.scripts.close(kind=self.kind, name=self._name)

        return self._call("close()", run)

    def _holds(self) -> bool:
        """Whether this instance holds a lease (to renew)."""
        return bool(self._leases)

    def _renew(self) -> bool:
        """Renew this instance's leases; False once it holds none (or cannot)."""
        with self._lock:
            leases = list(self._leases)
        b = self._backend
        if not leases or b is None or (b.client is not None and b.client.status != "running"):
            return False
        lease_ms = int(b.lease_timeout * 1000)
        lost = b.scripts.renew(kind=self.kind, name=self._name, leases=leases, lease_ms=lease_ms)
        if lost:
            logger.warning(
                "%s: %d lease(s) of this instance lapsed before they were renewed "
                "(scheduler.locks.lease-timeout %g s): another holder may have taken them",
                self,
                len(lost),
                b.lease_timeout,
            )
        return True

    def __enter__(self) -> Semaphore:
        if self._asynchronous(self._bind("__enter__()")):
            raise TypeError(
                f"{self._what('__enter__()')}: on an asynchronous client use 'async with'"
            )
        self._acquire(None, "__enter__()")
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    async def __aenter__(self) -> Semaphore:
        await self._acquire(None, "__aenter__()")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()

    def __reduce__(self) -> Any:
        return type(self), (self.max_leases, self.name)


class Renewable(Protocol):
    """What holds leases to renew: a ``Semaphore`` (a ``Lock``), a ``MultiLock``."""

    _backend: Backend | None

    def _holds(self) -> bool: ...

    def _renew(self) -> bool: ...


class _Renewer:
    """One daemon thread per process renewing every held lease, every fifth of its
    timeout.  It keeps its holders weakly: one garbage-collected while holding a
    lease stops being renewed, and its lease lapses (as in distributed)."""

    def __init__(self) -> None:
        self._held: weakref.WeakSet[Renewable] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._interval = 0.0  # of the current sleep (0: not sleeping)
        self._thread: threading.Thread | None = None

    def add(self, sem: Renewable) -> None:
        interval = sem._backend.lease_timeout / 5 if sem._backend else 1.0
        with self._lock:
            self._held.add(sem)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="redisdask-lease-renewer", daemon=True
                )
                self._thread.start()
            elif interval < self._interval:
                self._wake.set()  # renew sooner than it planned

    def _run(self) -> None:
        while True:
            with self._lock:
                held = list(self._held)
                if not held:
                    self._thread = None
                    return
                self._interval = (
                    min((s._backend.lease_timeout for s in held if s._backend), default=5.0) / 5
                )
            self._wake.wait(self._interval)
            self._wake.clear()
            for sem in held:
                try:
                    keep = sem._renew()
                except (redis.RedisError, RedisDaskError) as exc:
                    logger.warning("could not renew the leases of %s: %s", sem, exc)
                    keep = True  # try again next time: Redis may be back
                if not keep:
                    with self._lock:
                        if not sem._holds():
                            self._held.discard(sem)


renewer = _Renewer()
