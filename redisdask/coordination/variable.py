"""``Variable``: one value shared by a cluster's clients, with distributed's names and
semantics: ``set(value)``, ``get(timeout=None)``, ``delete()``.

The value is any picklable object (distributed takes a future or msgpack-able data):
a ``Future``, or futures anywhere inside it, stay alive while the variable holds them
(its holder ``holder:variable:<name>`` wants their keys, even after the client that set
it released its own), and ``get`` hands the getting client futures of its own, whose
wants are sent with the read, atomically.  The state is one hash,
``rd:{c}:variable:<name>`` (``data``, ``keys``, ``epoch``), deleted by ``delete()``;
``get`` on an unset variable waits for a ``set`` (on the signal stream, see
``backend.wait_until``), and raises ``TimeoutError`` after ``timeout``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from redisdask.coordination.backend import (
    Attempt,
    Backend,
    Bound,
    decode,
    encode,
    hand_over,
    learn_states,
    seconds,
)
from redisdask.store import codecs

if TYPE_CHECKING:
    from redisdask.client.client import Client


class Variable(Bound):
    """A variable named ``name`` (a random name if None), shared by every instance of
    that name in the cluster.  ``client``: the client to use and to own the futures
    ``get`` returns (default: the default client).  On an asynchronous client every
    method returns an awaitable."""

    kind = "variable"

    def __init__(self, name: Any = None, client: Client | None = None) -> None:
        super().__init__(name, client)

    def set(self, value: Any, timeout: float | str | None = "30 s", **kwargs: Any) -> Any:
        """Set the value (any picklable object; futures inside stay alive while it is
        set).  A cancelled future raises ``TimeoutError`` ("unknown to scheduler"), as
        in distributed, which waits ``timeout`` for its key to come back; here nothing
        else is waited for."""
        what = self._what("set()")
        data, keys = encode(value, what, cancelled=TimeoutError)

        def run(b: Backend) -> None:
            with b.client.sending():
                b.scripts.variable_set(name=self._name, holder=self._holder, data=data, keys=keys)

        return self._call("set()", run)

    def get(self, timeout: float | str | None = None, **kwargs: Any) -> Any:
        """The value, once set; ``TimeoutError`` if it is not within ``timeout`` seconds.
        Futures in it are this client's own (they keep their keys alive too), and start
        with their tasks' states."""
        what = self._what("get()")

        def attempt(b: Backend) -> Attempt:
            def once(waiter: str, wait_ms: int) -> tuple[bool, Any, str, float | None]:
                with b.client.sending():
                    reply = b.scripts.variable_get(
                        name=self._name, waiter=waiter, wait_ms=wait_ms, client=b.client_id
                    )
                    if reply[0] == 0:
                        return False, None, reply[1].decode(), None
                    _, data, packed, epoch, current = reply
                    futures = hand_over(b, codecs.unpack(packed), epoch != current)
                value = decode(data, futures)
                learn_states(b, list(futures.values()))
                return True, value, "", None

            return once

        def then(found: bool, value: Any) -> Any:
            if not found:
                raise TimeoutError(f"{what}: variable {self.name!r} was not set within {timeout} s")
            return value

        return self._waiting("get()", seconds(timeout), attempt, then)

    def delete(self) -> Any:
        """Delete the variable (for every client): the futures it held are let go."""

        def run(b: Backend) -> None:
            with b.client.sending():
                b.scripts.variable_delete(name=self._name, holder=self._holder)

        return self._call("delete()", run)

    def __reduce__(self) -> Any:
        return Variable, (self.name,)
