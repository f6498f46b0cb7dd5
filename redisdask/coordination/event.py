"""``Event``: a flag shared by a cluster, with distributed's names and semantics:
``set()``, ``clear()``, ``is_set()`` and ``wait(timeout=None) -> bool``.

Its state is one Redis string, ``rd:{c}:event:<name>``, present while the event is set
and deleted by ``clear()``, so a cleared event leaves nothing behind (distributed also
forgets an event that is clear and waited for by nobody).  ``wait`` blocks on the
signal stream, which ``set`` writes to (see ``backend.wait_until``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from redisdask.coordination.backend import Attempt, Backend, Bound, seconds

if TYPE_CHECKING:
    from redisdask.client.client import Client


class Event(Bound):
    """An event named ``name`` (a random name if None); every instance of that name in
    the cluster sees the same flag.  ``client``: the client to use (default: the default
    client; inside a task, the worker's Redis).  On an asynchronous client every method
    returns an awaitable (``await event.wait()``), and ``await Event(name)`` is the
    event."""

    kind = "event"

    def __init__(self, name: Any = None, client: Client | None = None) -> None:
        super().__init__(name, client)

    def set(self) -> Any:
        """Set the flag: every waiter returns True."""

        def run(b: Backend) -> None:
            b.scripts.event_set(name=self._name)

        return self._call("set()", run)

    def clear(self) -> Any:
        """Clear the flag: waiters block until the next ``set``."""

        def run(b: Backend) -> None:
            b.redis.delete(self._key(b))

        return self._call("clear()", run)

    def is_set(self) -> Any:
        return self._call("is_set()", lambda b: bool(b.redis.exists(self._key(b))))

    def wait(self, timeout: float | str | None = None) -> Any:
        """Block until the flag is set (True) or ``timeout`` seconds passed (False)."""

        def attempt(b: Backend) -> Attempt:
            def once(waiter: str, wait_ms: int) -> tuple[bool, Any, str, float | None]:
                reply = b.scripts.event_wait(name=self._name, waiter=waiter, wait_ms=wait_ms)
                if reply[0] == 1:
                    return True, None, "", None
                return False, None, reply[1].decode(), None

            return once

        return self._waiting("wait()", seconds(timeout), attempt, lambda is_set, _: is_set)

    def _key(self, b: Backend) -> str:
        return b.keys.coordination(self.kind, self._name)

    def __reduce__(self) -> Any:
        return Event, (self.name,)
