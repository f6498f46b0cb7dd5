"""``Queue``: a multi-producer, multi-consumer queue shared by a cluster's clients, with
distributed's names and semantics: ``put(value, timeout=None)``, ``get(timeout=None,
batch=False)``, ``qsize()``.

The queue is one Redis list, ``rd:{c}:queue:<name>``, of msgpack ``[epoch, keys,
data]`` items: it disappears when emptied.  Values are any picklable objects
(distributed takes futures and msgpack-able data).  Futures inside items are held by the
queue's holder, ``holder:queue:<name>``, counted per key in ``rd:{c}:queue-refs:<name>``
(a future put twice is held until both items are taken); a ``get`` sends the getter's
want of them and the holder's release in one step with the pop.  ``get`` on an empty
queue, and ``put`` on a full one (``maxsize``), wait on the signal stream (see
``backend.wait_until``) and raise ``TimeoutError`` after ``timeout``.

Unlike distributed's, the queue lives in Redis, not in a scheduler: it outlives its
clients and a scheduler restart, and ``maxsize`` is a property of each handle (the one
that puts enforces its own) rather than of the queue.  ``close()`` therefore deletes
nothing.
"""

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
    unpack_record,
)

if TYPE_CHECKING:
    from redisdask.client.client import Client


class Queue(Bound):
    """A queue named ``name`` (a random name if None), shared by every instance of that
    name in the cluster.  ``maxsize``: how many items ``put`` lets it hold (0: no bound).
    ``client``: the client to use and to own the futures ``get`` returns.  On an
    asynchronous client every method returns an awaitable, and ``await Queue(name)`` is
    the queue."""

    kind = "queue"

    def __init__(self, name: Any = None, client: Client | None = None, maxsize: int = 0) -> None:
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 0:
            raise ValueError(f"maxsize must be an int >= 0 (0: no bound), got {maxsize!r}")
        super().__init__(name, client)
        self.maxsize = maxsize

    def put(self, value: Any, timeout: float | str | None = None, **kwargs: Any) -> Any:
        """Append ``value`` (any picklable object; futures inside stay alive while it is
        queued); on a full queue wait at most ``timeout`` seconds, then ``TimeoutError``.
        A cancelled future raises ``TimeoutError`` ("unknown to scheduler") at once, as
        distributed's does once ``timeout`` passed."""
        what = self._what("put()")
        data, keys = encode(value, what, cancelled=TimeoutError)

        def attempt(b: Backend) -> Attempt:
            def once(waiter: str, wait_ms: int) -> tuple[bool, Any, str, float | None]:
                with b.client.sending():
                    reply = b.scripts.queue_put(
                        name=self._name, holder=self._holder, waiter=waiter, wait_ms=wait_ms,
                        data=data, keys=keys, maxsize=self.maxsize,
                    )  # fmt: skip
                if reply[0] == 1:
                    return True, None, "", None
                return False, None, reply[1].decode(), None

            return once

        def then(done: bool, _: Any) -> None:
            if not done:
                raise TimeoutError(
                    f"{what}: queue {self.name!r} stayed full ({self.maxsize} items) for "
                    f"{timeout} s"
                )

        return self._waiting("put()", seconds(timeout), attempt, then)

    def get(
        self, timeout: float | str | None = None, batch: bool | int = False, **kwargs: Any
    ) -> Any:
        """The oldest item, waiting at most ``timeout`` seconds for one (then
        ``TimeoutError``).  ``batch=True``: every item there now (a list, maybe empty, at
        once); ``batch=n``: a list of the next ``n`` items, waiting for each (no
        ``timeout`` then, as in distributed).  Futures in items start with their tasks'
        states."""
        timeout_s = seconds(timeout)
        if batch is True:
            return self._take(0, timeout_s)
        if batch is False:
            return self._take(1, timeout_s, one=True)
        if not isinstance(batch, int) or batch < 0:
            raise ValueError(f"batch= is True, False or a count >= 0, got {batch!r}")
        if timeout is not None:
            raise NotImplementedError(
                "Dask queues don't support simultaneous use of integer batch sizes and timeouts"
            )
        if self._asynchronous(self._bind("get()")):
            return self._aget_many(batch)
        out: list[Any] = []
        while len(out) < batch:
            out += self._take(batch - len(out), None)
        return out

    async def _aget_many(self, count: int) -> list[Any]:
        out: list[Any] = []
        while len(out) < count:
            out += await self._take(count - len(out), None)
        return out

    def _take(self, count: int, timeout: float | None, one: bool = False) -> Any:
        """Up to ``count`` items (0: all there are), waiting for the first; ``one``: the
        first item itself."""
        what = self._what("get()")

        def attempt(b: Backend) -> Attempt:
            def once(waiter: str, wait_ms: int) -> tuple[bool, Any, str, float | None]:
                with b.client.sending():
                    reply = b.scripts.queue_get(
                        name=self._name, holder=self._holder, waiter=waiter, wait_ms=wait_ms,
                        client=b.client_id, count=count,
                    )  # fmt: skip
                    if reply[0] == 0:
                        return False, None, reply[1].decode(), None
                    current = reply[1]
                    taken = []
                    for raw in reply[2:]:
                        epoch, keys, data = unpack_record(raw)
                        taken.append((data, hand_over(b, keys, epoch != current)))
                items = [decode(data, futures) for data, futures in taken]
                learn_states(b, [f for _, futures in taken for f in futures.values()])
                return True, items, "", None

            return once

        def then(done: bool, items: Any) -> Any:
            if not done:
                raise TimeoutError(f"{what}: queue {self.name!r} stayed empty for {timeout} s")
            return items[0] if one else items

        return self._waiting("get()", timeout, attempt, then)

    def qsize(self, **kwargs: Any) -> Any:
        """How many items are in the queue now."""
        return self._call(
            "qsize()", lambda b: int(b.redis.llen(b.keys.coordination(self.kind, self._name)))
        )

    def close(self) -> None:
        """distributed's; the queue lives in Redis until emptied, so nothing is deleted."""

    def __reduce__(self) -> Any:
        return type(self), (self.name, None, self.maxsize)
