"""``Event``: a flag shared by a cluster, with distributed's names and semantics:
``set()``, ``clear()``, ``is_set()`` and ``wait(timeout=None) -> bool``.

Its state is one Redis string, ``rd:{c}:event:<name>``, present while the event is set
and deleted by ``clear()``, so a cleared event leaves nothing behind (distributed also
forgets an event that is clear and waited for by nobody).  ``wait`` blocks on the
signal stream, which ``set`` writes to (see ``backend.wait_until``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from redisdask.coordination.backend import Bound, seconds, wait_until

if TYPE_CHECKING:
    from redisdask.client import Client


class Event(Bound):
    """An event named ``name`` (a random name if None); every instance of that name in
    the cluster sees the same flag.  ``client``: the client to use (default: the default
    client; inside a task, the worker's Redis)."""

    kind = "event"

    def __init__(self, name: str | None = None, client: Client | None = None) -> None:
        super().__init__(name, client)

    def set(self) -> None:
        """Set the flag: every waiter returns True."""
        b = self._bind("set()")
        b.scripts.event_set(name=self.name)

    def clear(self) -> None:
        """Clear the flag: waiters block until the next ``set``."""
        b = self._bind("clear()")
        b.redis.delete(b.keys.coordination(self.kind, self.name))

    def is_set(self) -> bool:
        b = self._bind("is_set()")
        return bool(b.redis.exists(b.keys.coordination(self.kind, self.name)))

    def wait(self, timeout: float | str | None = None) -> bool:
        """Block until the flag is set (True) or ``timeout`` seconds passed (False)."""
        what = self._what("wait()")
        b = self._bind("wait()")

        def attempt(waiter: str, wait_ms: int) -> tuple[bool, Any, str, float | None]:
            reply = b.scripts.event_wait(name=self.name, waiter=waiter, wait_ms=wait_ms)
            if reply[0] == 1:
                return True, None, "", None
            return False, None, reply[1].decode(), None

        is_set, _ = wait_until(b, self.kind, self.name, what, seconds(timeout), attempt)
        return is_set

    def __reduce__(self) -> Any:
        return Event, (self.name,)
