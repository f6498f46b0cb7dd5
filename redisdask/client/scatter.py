"""``Client.scatter``: data sent from the client straight to workers, as distributed's
``Client._scatter`` shapes it.

What becomes one future per element and what stays one value is decided by the exact
type, as in distributed: a ``dict`` (one future per value, under its key), a ``list``,
``tuple``, ``set``, ``frozenset`` or ``range`` (one per element, returned in the same
type; a ``range`` as a list), a namedtuple (one per field, rebuilt as that namedtuple).
Anything else, subclasses of those included (a dict subclass keeps its type on the
worker), is one value and one future.  An iterator or a queue is refused, as distributed
refuses it: its elements would be consumed here.  Values go round robin over the target
workers, continuing where the previous scatter stopped, so that scattering one value at a
time spreads them too.  ``ScatterMethods`` is a mixin of ``Client``.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from concurrent.futures import TimeoutError as FuturesTimeoutError
from numbers import Number
from typing import TYPE_CHECKING, Any

import cloudpickle

from redisdask import comm
from redisdask import spec as specs
from redisdask.client.futures import Future, _seconds
from redisdask.errors import RedisDaskError
from redisdask.protocol import UpdateData
from redisdask.store import codecs
from redisdask.typenames import type_name

if TYPE_CHECKING:
    from redisdask.store.keyspace import Keys

_SEQUENCES = (list, tuple, set, frozenset)
_round_robin = itertools.count()  # where the next scatter starts among the targets


def scatter_items(data: Any) -> tuple[list[tuple[Hashable | None, Any]], Callable[[list], Any]]:
    """The ``(name or None, value)`` items ``data`` scatters as, and the function that
    builds what ``scatter`` returns from their futures (one per item, in order)."""
    if isinstance(data, queue.Queue | Iterator):
        raise TypeError(
            "Dask no longer supports mapping over Iterators or Queues. Consider using a "
            "normal for loop and Client.submit (scatter a list: client.scatter(list(it)))"
        )
    if type(data) is range:
        data = list(data)
    if type(data) is dict:
        return list(data.items()), lambda futures: dict(zip(data, futures, strict=True))
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # a namedtuple
        return [(None, v) for v in data], lambda futures: type(data)(*futures)
    if type(data) in _SEQUENCES:
        return [(None, v) for v in data], type(data)
    return [(None, data)], lambda futures: futures[0]


def resolve_workers(registered: Mapping[str, str], workers: Any, cluster: str) -> list[str] | None:
    """The addresses of ``workers`` (addresses or names, one or several; None: None)
    among ``registered`` ({address: name}); ``ValueError`` naming any unknown one."""
    if workers is None:
        return None
    wanted = [workers] if isinstance(workers, str | Number) else list(workers)
    by_name = {name: address for address, name in registered.items()}
    unknown = [w for w in wanted if w not in registered and str(w) not in by_name]
    if unknown:
        raise ValueError(
            f"no worker with address or name {unknown} in cluster {cluster!r}; its workers "
            f"are {sorted(registered.values())}"
        )
    return list(dict.fromkeys(w if w in registered else by_name[str(w)] for w in wanted))


def registered_workers(raw: Mapping[bytes, bytes]) -> dict[str, str]:
    """``{address: name}`` from the workers hash (a worker without a name: its address)."""
    out = {}
    for address, info in raw.items():
        text = address.decode(errors="replace")
        out[text] = str(codecs.worker_info_or_empty(info).get("name") or text)
    return out


class ScatterMethods:
    """``scatter`` of ``Client``: a mixin, whose attributes (below) and helpers
    (``_check_running``, ``_sync``, ``_state_for``, ``_asend``) are the client's."""

    keys: Keys
    timeout: float
    _aredis: Any
    _peers: comm.ConnectionPool

    def scatter(
        self,
        data: Any,
        workers: str | Iterable[str] | None = None,
        broadcast: bool | int = False,
        direct: bool | None = None,
        hash: bool = True,
        timeout: float | str | None = None,
        asynchronous: bool | None = None,
    ) -> Any:
        """Send data straight to workers; returns futures in the shape of ``data`` (see
        the module docstring).  Keys name the data by a token of the whole value
        (``dask.tokenize`` with dask installed, else a hash of every pickled frame), so
        equal data gets one key and different data never shares one.  ``workers``:
        addresses or names (or one).  ``broadcast``: a copy on every target worker (an
        int: on that many).  ``timeout``: how long to wait for a worker to scatter to
        (the client's connection timeout by default), then ``TimeoutError``.  ``direct``
        is accepted for distributed's sake: data always goes straight to the workers
        here.  Awaitable on an asynchronous client."""
        self._check_running()
        items, shape = scatter_items(data)  # (an iterator is refused before anything runs)
        wait = self.timeout if timeout is None else _seconds(timeout) or 0.0
        return self._sync(self._ascatter, items, shape, workers, broadcast, hash, wait)

    async def _ascatter(
        self,
        items: list[tuple[Hashable | None, Any]],
        shape: Callable[[list], Any],
        workers: Any,
        broadcast: bool | int,
        hash: bool,
        timeout: float,
    ) -> Any:
        targets = await self._scatter_targets(workers, timeout)
        keyed: dict[str, Any] = {}
        item_keys: list[str] = []  # one per item (equal items share a key and a future)
        for name, value in items:
            key = _item_key(name, value, hash)
            keyed[key] = value
            item_keys.append(key)
        copies = len(targets) if broadcast is True else max(1, int(broadcast or 1))
        who_has: dict[str, list[str]] = defaultdict(list)
        by_worker: dict[str, dict[str, Any]] = defaultdict(dict)
        for key, value in keyed.items():
            start = next(_round_robin)
            for i in range(min(copies, len(targets))):
                address = targets[(start + i) % len(targets)]
                by_worker[address][key] = value
                who_has[key].append(address)
        await self._put_data(by_worker)
        nbytes = {k: _sizeof(v) for k, v in keyed.items()}
        types = {k: type_name(type(v)) for k, v in keyed.items()}
        with self._lock:
            for key in keyed:
                self._state_for(key).finish(who_has[key], types[key])
        futures = {k: Future(k, self) for k in keyed}
        await self._channel.asend([UpdateData(self.id, dict(who_has), nbytes, types)])
        return shape([futures[key] for key in item_keys])

    async def _scatter_targets(self, workers: Any, timeout: float) -> list[str]:
        """The addresses to scatter to, sorted: the named ones, else every worker; waits
        up to ``timeout`` for a worker to be registered (as distributed does)."""
        deadline = time.monotonic() + timeout
        while True:
            registered = registered_workers(await self._aredis.hgetall(self.keys.workers))
            named = resolve_workers(registered, workers, self.keys.cluster)
            targets = sorted(registered if named is None else named)
            if targets:
                return targets
            if time.monotonic() > deadline:
                raise FuturesTimeoutError(
                    f"No valid workers found: no worker to scatter to in cluster "
                    f"{self.keys.cluster!r} within {timeout:g} s; start workers (or wait "
                    "for them: client.wait_for_workers) first"
                )
            await asyncio.sleep(0.05)  # waiting for a worker to register

    async def _put_data(self, by_worker: dict[str, dict[str, Any]]) -> None:
        for address, values in by_worker.items():
            keys = list(values)
            for i in range(0, len(keys), comm.MAX_KEYS_PER_MESSAGE):
                chunk = {k: values[k] for k in keys[i : i + comm.MAX_KEYS_PER_MESSAGE]}
                header, frames, errors = comm.serialize_dict(chunk)
                if errors:
                    raise TypeError(next(iter(errors.values())))
                reply, _ = await self._peers.rpc(address, {"op": "put-data", **header}, frames)
                if reply.get("status") != "OK":
                    raise RedisDaskError(f"worker {address} refused scattered data: {reply}")


def _item_key(name: Hashable | None, value: Any, hash: bool) -> str:
    if name is not None:
        return specs.check_key(name)
    tok = value_token(value) if hash else uuid.uuid4().hex
    return f"{type(value).__name__}-{tok}"


def value_token(value: Any) -> str:
    """A token of the whole value: ``dask.tokenize`` (deterministic for numpy, pandas and
    friends) with dask installed, else a hash over every pickled frame, out-of-band
    buffers included."""
    if specs.dask_installed():
        from dask.base import tokenize

        return tokenize(value, ensure_deterministic=False)
    return specs.token(*(bytes(frame) for frame in comm.serialize(value)))


def _sizeof(value: Any) -> int:
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    try:
        return len(cloudpickle.dumps(value, protocol=5))
    except Exception:
        return 0
