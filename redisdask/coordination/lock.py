"""``Lock``: a ``Semaphore`` of one lease, as distributed's is, with its names:
``acquire(blocking=True, timeout=None)``, ``release()``, ``locked()``, ``with lock:``
(and, on an asynchronous client, ``await lock.acquire()`` and ``async with lock:``).
Its state is ``rd:{c}:lock:<name>`` (a namespace of its own: ``Lock("x")`` and
``Semaphore(name="x")`` are two things).  A holder killed with -9 frees the lock when
its lease lapses (``scheduler.locks.lease-timeout``); a ``release`` by an instance that
does not hold it raises ``LeaseNotHeldError`` (``RuntimeError("Released too often")``
in distributed)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from redisdask.coordination.backend import seconds
from redisdask.coordination.semaphore import Semaphore

if TYPE_CHECKING:
    from redisdask.client.client import Client


class Lock(Semaphore):
    """A lock named ``name`` (a random name if None), shared by every instance of that
    name in the cluster.  ``client``: as for ``Semaphore``."""

    kind = "lock"

    def __init__(
        self,
        name: Any = None,
        client: Client | None = None,
        *,
        scheduler_rpc: Any = None,
        loop: Any = None,
    ) -> None:
        super().__init__(max_leases=1, name=name, client=client)

    def acquire(self, blocking: bool = True, timeout: float | str | None = None) -> Any:
        """Take the lock; with ``blocking=False`` only if it is free now, else waiting
        at most ``timeout`` seconds (None: as long as it takes).  True if taken
        (awaitable on an asynchronous client, as every method here)."""
        if not blocking:
            if timeout is not None:
                raise ValueError("can't specify a timeout for a non-blocking call")
            return self._acquire(0.0, "acquire()")
        return self._acquire(seconds(timeout), "acquire()")

    def locked(self) -> Any:
        """Whether anyone holds the lock now."""
        return self._call(
            "locked()", lambda b: b.scripts.count_leases(kind=self.kind, name=self._name) >= 1
        )

    def __reduce__(self) -> Any:
        return type(self), (self.name,)
