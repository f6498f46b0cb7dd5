"""What every coordination primitive shares: the cluster it talks to, waiting, values.

* ``Backend``: a Redis connection, the cluster's keys and scripts, and the ``Client``
  whose futures a value may hold.  A primitive made with ``client=None`` takes
  ``redisdask.client.default_client()`` at its first use, which inside a task is the
  worker's client (``get_client()``).
* ``wait_until``: blocking without polling Redis hot.  Each attempt is one script that
  either succeeds or, atomically with its failure, records the caller as a waiter and
  returns the last id of the primitive's signal stream; the caller then blocks in
  ``XREAD BLOCK`` on that stream from that id.  Whatever changes the primitive (a
  release, a ``set``, a ``put``, a ``get`` that frees room) adds an entry there while
  anyone waits, so a waiter wakes within a round trip of the change and cannot miss
  it: the id it blocks from was read in the same atomic step as the state it found
  wanting.  Every waiter wakes (a broadcast: each one tries again, the losers go back to
  sleep), which costs one script call per waiter per change; fine for the tens of
  waiters these primitives see.  A block lasts at most ``WAIT_SLICE`` (2 s), and less
  when a lease lapses sooner, so a holder killed with -9 is noticed when its lease ends
  and a waiter whose process died is forgotten within ``WAIT_SLICE + WORD_MARGIN``.  Why
  not ``BLPOP``: a popped wake-up is consumed by one waiter, lost if nobody waits, and a
  list of pending wake-ups would outlive the primitive; why not polling: a waiter would
  either poll often (Redis load grows with waiters) or wake late.
* ``encode`` and ``decode``: values are pickled (any picklable object, a superset of
  distributed's msgpack-able data); a ``Future`` anywhere inside becomes a reference to
  its key, and those keys are held by the primitive's holder
  (``keyspace.holder(kind, name)``) while the value is stored.  A getter's want of them
  is sent by the same script that hands the value over (see ``store/scripts.py``), so the
  key is never unwanted in between.  The futures handed over carry their dask keys
  (``('x', 0)``, not its string form) and start with their task's state as its record
  says (``learn_states``): finished or erred at once, as distributed's do.
* Asynchronous use: on an asynchronous client's loop every method of a primitive
  returns an awaitable (``Bound._call``, ``Bound._waiting``), as distributed's do: the
  short Redis calls run in the loop's executor, and a wait blocks on the signal stream
  through the client's asyncio connection (``await_until``), so waiters hold no thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import pickle
import struct
import threading
import time
import uuid
from collections.abc import Callable, Generator, Hashable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
import redis

from redisdask import spec
from redisdask.client.futures import Future, _FutureState
from redisdask.client.loop import running_loop
from redisdask.config import parse_duration
from redisdask.context import default_client
from redisdask.coordination.scripts import CoordinationScripts
from redisdask.errors import ClientClosedError, ClusterConnectionError
from redisdask.store import keyspace
from redisdask.store.keyspace import Keys
from redisdask.store.task_record import TaskRecord

if TYPE_CHECKING:
    from redisdask.client.client import Client

logger = logging.getLogger("redisdask.coordination")

WAIT_SLICE = 2.0  # seconds: the longest single block on a signal stream
WORD_MARGIN = 1.0  # seconds a waiter's word outlives its block (it renews it each attempt)
MAX_VALUE_BYTES = 256 << 20  # a value travels through Redis: well below its 512 MB limit


@dataclass(eq=False)
class Backend:
    """Where a primitive lives: Redis, the cluster's keys and scripts, and the client
    whose futures its values may hold."""

    redis: redis.Redis
    keys: Keys
    scripts: CoordinationScripts
    client: Client
    lease_timeout: float  # scheduler.locks.lease-timeout, seconds

    @property
    def client_id(self) -> str:
        return self.client.id

    def check(self, what: str) -> None:
        """Raise ``ClientClosedError`` if the client is closed (or closing)."""
        client = self.client
        if client.status != "running":
            raise ClientClosedError(
                f"{what}: its client {client.id} is {client.status}; create a new Client "
                "and make the primitive with client= it (or after it, as the default client)"
            )


_backends_lock = threading.Lock()


def backend_of(client: Client | None, what: str) -> Backend:
    """The backend of ``client``, or of the default client (in a task: its worker's)."""
    if client is None:
        try:
            client = default_client()
        except ValueError:
            raise RuntimeError(  # (distributed's error: "... not properly initialized")
                f"{what}: no Client is running here, so the object is not properly "
                "initialized (as one unpickled outside a Client or a worker's task): create "
                "a Client(...) first, or pass client="
            ) from None
    backend: Backend | None = client._coordination  # (kept on the client: see DatasetMethods)
    if backend is None:
        with _backends_lock:
            backend = client._coordination
            if backend is None:
                backend = client._coordination = Backend(
                    client.redis,
                    client.keys,
                    CoordinationScripts(client.redis, client.keys),
                    client,
                    client.config.scheduler.locks.lease_timeout,
                )
    backend.check(what)
    return backend


class Bound:
    """A primitive's binding to its backend, made at first use (distributed binds its
    client late too, so a primitive unpickled in a task finds that task's cluster).

    ``name`` is kept as given (distributed's primitives are named by any dask-key-like
    value: ``Lock(1)``, ``Event(("a", 1))``); ``_name`` is its string form in Redis."""

    kind = ""

    def __init__(self, name: Any, client: Client | None) -> None:
        self.name, self._name = check_name(name, self.kind)
        self._client = client
        self._backend: Backend | None = None

    def _bind(self, what: str) -> Backend:
        backend = self._backend
        if backend is None:
            backend = self._backend = backend_of(self._client, self._what(what))
        else:
            backend.check(self._what(what))
        return backend

    @property
    def client(self) -> Client | None:
        """The client this primitive uses, or would use now (None when no client runs)."""
        if self._backend is not None:
            return self._backend.client
        if self._client is not None:
            return self._client
        try:
            return default_client()
        except ValueError:
            return None

    def _asynchronous(self, b: Backend) -> bool:
        """Whether the caller is on its asynchronous client's loop (then methods return
        awaitables, as distributed's ``client.sync`` makes them)."""
        client = b.client
        return bool(client.asynchronous) and running_loop() is client.loop

    def _call(self, op: str, run: Callable[[Backend], Any]) -> Any:
        """``run(backend)``: a short Redis call; an awaitable of it on an asynchronous
        client's loop (run in the loop's executor: the call blocks on Redis)."""
        b = self._bind(op)
        if self._asynchronous(b):
            return b.client.loop.run_in_executor(None, run, b)
        return run(b)

    def _waiting(
        self,
        op: str,
        timeout: float | None,
        attempt: Callable[[Backend], Attempt],
        then: Callable[[bool, Any], Any],
    ) -> Any:
        """``then(*wait_until(...))`` for ``attempt`` made for the backend; on an
        asynchronous client's loop, a coroutine of it waiting with ``await_until``."""
        b = self._bind(op)
        what = self._what(op)
        if self._asynchronous(b):

            async def waited() -> Any:
                found = await await_until(b, self.kind, self._name, what, timeout, attempt(b))
                return then(*found)

            return waited()
        return then(*wait_until(b, self.kind, self._name, what, timeout, attempt(b)))

    def __await__(self) -> Generator[Any, None, Any]:
        """``await Lock("x")`` (distributed's async constructor): nothing to wait for."""

        async def itself() -> Any:
            return self

        return itself().__await__()

    def _what(self, op: str) -> str:
        return f"{type(self).__name__}({self.name!r}).{op}"

    @property
    def _holder(self) -> str:
        """Who keeps the futures in its values alive: ``holder:<kind>:<name>``."""
        return keyspace.holder(self.kind, self._name)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {self.name}>"


def check_name(name: Any, kind: str) -> tuple[Any, str]:
    """``(name as given, its string form in Redis)``.  As in distributed, a primitive is
    named by a str, bytes, int, float or a tuple (or list: the same name) of those, and
    no name (or an empty one) gives it a random name.  The string form is the cluster's
    for dask keys (``spec.stringify``): ``("a", 1)`` is ``"('a', 1)"``."""
    if not name:
        name = f"{kind}-{uuid.uuid4().hex}"
        return name, name
    key = as_key(name)
    if key is None:
        raise TypeError(
            f"a {kind} is named by a str, bytes, int, float or a tuple of those (as a dask "
            f"key), got {type(name).__name__} {name!r}"
        )
    return name, spec.stringify(key)


def as_key(name: Any) -> Hashable | None:
    """``name`` as a dask key (lists become tuples), or None if it cannot be one."""
    if isinstance(name, str | bytes | int | float):
        return name
    if isinstance(name, list | tuple):
        parts = [as_key(part) for part in name]
        return None if any(p is None for p in parts) else tuple(parts)
    return None


def seconds(timeout: float | str | datetime.timedelta | None) -> float | None:
    """A timeout in seconds from a number, ``"200ms"``-style text or a timedelta, as
    distributed's ``parse_timedelta`` takes them; None is no timeout."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        value = timeout.total_seconds()
    else:
        try:
            value = parse_duration(timeout)
        except ValueError:
            raise ValueError(
                f"timeout={timeout!r}: give seconds, a duration such as '200ms', or None"
            ) from None
    return max(0.0, value)


# --------------------------------------------------------------------------- waiting

# an attempt: (waiter id, ms its word lasts, 0 to give up) -> (done, value, signal id to
# block from, seconds after which to try again anyway, or None)
Attempt = Callable[[str, int], tuple[bool, Any, str, float | None]]


class _Wait:
    """One caller's wait on a primitive: its waiter id, deadline and signal stream."""

    def __init__(
        self, backend: Backend, kind: str, name: str, what: str, timeout: float | None
    ) -> None:
        self.backend, self.what = backend, what
        self.waiter = uuid.uuid4().hex
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.signal = backend.keys.signal(kind, name)

    def slice(self) -> tuple[float, int]:
        """``(seconds the next block may last, ms the waiter's word lasts: 0 on the last
        attempt)``; ``ClientClosedError`` once the client closed."""
        self.backend.check(self.what)
        left = None if self.deadline is None else self.deadline - time.monotonic()
        block = WAIT_SLICE if left is None else min(WAIT_SLICE, max(left, 0.0))
        return block, int((block + WORD_MARGIN) * 1000) if block > 0 else 0

    @staticmethod
    def block_ms(block: float, again: float | None) -> int:
        if again is not None:
            block = min(block, again + 0.001)
        return max(1, int(block * 1000))

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        try:
            yield
        except ClusterConnectionError:
            self.backend.check(self.what)  # closed meanwhile: say that, not "connection lost"
            raise


def wait_until(
    backend: Backend, kind: str, name: str, what: str, timeout: float | None, attempt: Attempt
) -> tuple[bool, Any]:
    """Run ``attempt`` until it succeeds: ``(True, value)``; or, after ``timeout``
    seconds (0: one try), ``(False, None)``.  Between attempts, block on the signal
    stream (see the module docstring)."""
    w = _Wait(backend, kind, name, what, timeout)
    while True:
        block, wait_ms = w.slice()
        done, value, from_id, again = attempt(w.waiter, wait_ms)
        if done:
            return True, value
        if not wait_ms:
            return False, None
        with w.reading():
            backend.redis.xread({w.signal: from_id}, block=w.block_ms(block, again))


async def await_until(
    backend: Backend, kind: str, name: str, what: str, timeout: float | None, attempt: Attempt
) -> tuple[bool, Any]:
    """``wait_until`` on an asynchronous client's loop: each attempt (a script) runs in
    the loop's executor, each block is an ``XREAD BLOCK`` on the client's asyncio
    connection, so a waiter holds no thread while it waits."""
    loop = asyncio.get_running_loop()
    w = _Wait(backend, kind, name, what, timeout)
    while True:
        block, wait_ms = w.slice()
        done, value, from_id, again = await loop.run_in_executor(None, attempt, w.waiter, wait_ms)
        if done:
            return True, value
        if not wait_ms:
            return False, None
        with w.reading():
            await backend.client._aredis.xread({w.signal: from_id}, block=w.block_ms(block, again))


# --------------------------------------------------------------------------- values


_DASK_KEYS = b"RDK\x01"  # a value whose futures have dask keys other than their strings:
_LENGTH = struct.Struct(">I")  # _DASK_KEYS, the length and pickle of {key: dask key}, value


def encode(
    value: Any, what: str, cancelled: type[Exception] = ValueError
) -> tuple[bytes, list[str]]:
    """The pickled value and the keys of the futures inside it.  The dask keys of those
    futures (``('x', 0)``) travel before the value when they are no str, so the futures
    a getter receives carry them.  A cancelled future inside raises ``cancelled``
    (distributed: ``TimeoutError`` for a ``Variable`` or a ``Queue``)."""
    try:
        data, futures = spec.dumps_with_futures(value)
    except Exception as exc:
        raise TypeError(
            f"{what}: could not pickle the value ({type(value).__qualname__}): "
            f"{type(exc).__name__}: {exc}. Values travel through Redis pickled; share "
            "picklable objects, or scatter the data and share the future"
        ) from exc
    if len(data) > MAX_VALUE_BYTES:
        raise ValueError(
            f"{what}: the value pickles to {len(data):,} bytes, more than a value may carry "
            f"({MAX_VALUE_BYTES:,}: it travels through Redis). Scatter the data with "
            "client.scatter and share the future instead"
        )
    for future in futures:
        if future.cancelled():
            raise cancelled(
                f"{what}: Task {future.key!r} unknown to scheduler: its future was "
                "cancelled, so it has no value to share; submit it again first"
            )
    dask_keys = {f._key: f.key for f in futures if f.key != f._key}
    if dask_keys:
        names = pickle.dumps(dask_keys, protocol=5)
        data = b"".join((_DASK_KEYS, _LENGTH.pack(len(names)), names, data))
    return data, sorted({future._key for future in futures})


def hand_over(backend: Backend, keys: list[str], lost: bool) -> dict[str, Future]:
    """Futures of ``backend``'s client for ``keys`` (call it inside ``sending()``, where
    the script that sent their want ran).  ``lost``: recorded before a restart."""
    if not keys:
        return {}
    if not lost:
        return {key: Future(key, backend.client) for key in keys}
    reason = (
        "the cluster was restarted after it was stored (Client.restart forgets every task); "
        "store a new future"
    )
    futures = {}
    for key in keys:  # a state of its own: a live future of that key here stays live
        futures[key] = Future(key, backend.client, _state=_FutureState())
        futures[key]._state.cancel(reason)
    return futures


_RECORD_FIELDS = (
    "state", "who_has", "type", "value", "exception", "traceback", "exception_text",
    "traceback_text", "killed", "rejected",
)  # fmt: skip


def learn_states(backend: Backend, futures: list[Future]) -> None:
    """Start futures handed over with their tasks' states as the records say: finished
    (with its holders and a small result) or erred (with its exception) at once, as
    distributed's primitives hand them over, instead of pending until the scheduler's
    news arrives.  A state the client knows already (a live future of the key) stays."""
    pending = [f for f in futures if f._state.status == "pending"]
    if not pending:
        return
    from redisdask.client.channel import _load_error
    from redisdask.protocol import KeyErred

    pipe = backend.redis.pipeline(transaction=False)
    for future in pending:
        pipe.hmget(backend.keys.task(future._key), _RECORD_FIELDS)
    raws = pipe.execute()
    with backend.client._lock:  # as the client's reader applies news
        for future, raw in zip(pending, raws, strict=True):
            record, state = TaskRecord.from_hmget(_RECORD_FIELDS, raw), future._state
            if state.status != "pending":
                continue
            if record.state == "memory":
                state.finish(record.who_has, record.type, record.value)
            elif record.state == "erred":
                msg = KeyErred(
                    future._key, exception=record.exception or b"",
                    traceback=record.traceback or b"", exception_text=record.exception_text,
                    traceback_text=record.traceback_text, killed=record.killed,
                    rejected=record.rejected,
                )  # fmt: skip
                state.set_error(*_load_error(msg))


def decode(data: bytes, futures: dict[str, Future]) -> Any:
    """The value ``encode`` made, with ``futures`` (by key) in place of its futures,
    which take their dask keys."""
    if not data.startswith(_DASK_KEYS):
        return spec.loads_with_futures(data, futures)
    start = len(_DASK_KEYS) + _LENGTH.size
    (length,) = _LENGTH.unpack_from(data, len(_DASK_KEYS))
    dask_keys = pickle.loads(data[start : start + length])
    for key, future in futures.items():
        future.key = dask_keys.get(key, key)
    return spec.loads_with_futures(memoryview(data)[start + length :], futures)


def unpack_record(raw: bytes) -> list[Any]:
    """A record the scripts packed with cmsgpack (byte strings stay bytes): ``[epoch,
    keys, data, ...]``, keys decoded."""
    record = msgpack.unpackb(raw, raw=True)
    record[1] = [k.decode() for k in record[1]]
    return record


def script_error(exc: redis.ResponseError, word: str) -> bool:
    """Whether a script's error reply starts with ``word`` (its errors are codes)."""
    return str(exc).startswith(word)
