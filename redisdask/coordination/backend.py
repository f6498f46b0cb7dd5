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
  (``schema.holder(kind, name)``) while the value is stored.  A getter's want of them
  is sent by the same script that hands the value over (see ``schema.py``), so the
  key is never unwanted in between.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
import redis

from redisdask import schema, spec
from redisdask.config import parse_duration
from redisdask.errors import ClientClosedError, ClusterConnectionError
from redisdask.futures import Future, _FutureState
from redisdask.schema import CoordinationScripts, Keys

if TYPE_CHECKING:
    from redisdask.client import Client

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

    @contextlib.contextmanager
    def sending(self) -> Iterator[None]:
        """Around a script that sends wants for the client (and the creation of the
        futures it hands over): no send of the client's own can interleave (a release of
        the same key popped before, landing after), and its reader task cannot hear of
        those keys before their futures exist."""
        self.client._flush()  # a graph just submitted is in Redis before its wants
        with self.client._send_lock, self.client._lock:
            yield


_backends_lock = threading.Lock()


def backend_of(client: Client | None, what: str) -> Backend:
    """The backend of ``client``, or of the default client (in a task: its worker's)."""
    if client is None:
        from redisdask.client import default_client

        try:
            client = default_client()
        except ValueError:
            raise ValueError(
                f"{what}: no Client is running here: create one with Client(...), or pass client="
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
    client late too, so a primitive unpickled in a task finds that task's cluster)."""

    kind = ""

    def __init__(self, name: str | None, client: Client | None) -> None:
        self.name = check_name(name, self.kind)
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
        from redisdask.client import default_client

        try:
            return default_client()
        except ValueError:
            return None

    def _what(self, op: str) -> str:
        return f"{type(self).__name__}({self.name!r}).{op}"

    @property
    def _holder(self) -> str:
        """Who keeps the futures in its values alive: ``holder:<kind>:<name>``."""
        return schema.holder(self.kind, self.name)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {self.name}>"


def check_name(name: Any, kind: str) -> str:
    if name is None:
        return f"{kind}-{uuid.uuid4().hex}"
    if not isinstance(name, str) or not name:
        raise TypeError(f"a {kind} is named by a non-empty str, got {name!r}")
    return name


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


def wait_until(
    backend: Backend, kind: str, name: str, what: str, timeout: float | None, attempt: Attempt
) -> tuple[bool, Any]:
    """Run ``attempt`` until it succeeds: ``(True, value)``; or, after ``timeout``
    seconds (0: one try), ``(False, None)``.  Between attempts, block on the signal
    stream (see the module docstring)."""
    waiter = uuid.uuid4().hex
    deadline = None if timeout is None else time.monotonic() + timeout
    signal = backend.keys.signal(kind, name)
    while True:
        backend.check(what)
        left = None if deadline is None else deadline - time.monotonic()
        block = WAIT_SLICE if left is None else min(WAIT_SLICE, max(left, 0.0))
        wait_ms = int((block + WORD_MARGIN) * 1000) if block > 0 else 0
        done, value, from_id, again = attempt(waiter, wait_ms)
        if done:
            return True, value
        if not wait_ms:
            return False, None
        if again is not None:
            block = min(block, again + 0.001)
        try:
            backend.redis.xread({signal: from_id}, block=max(1, int(block * 1000)))
        except ClusterConnectionError:
            backend.check(what)  # closed meanwhile: say that, not "connection lost"
            raise


# --------------------------------------------------------------------------- values


def encode(value: Any, what: str) -> tuple[bytes, list[str]]:
    """The pickled value and the keys of the futures inside it."""
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
            raise ValueError(
                f"{what}: future {future.key!r} was cancelled, so it has no value to share "
                "(its task is gone from the cluster); submit it again first"
            )
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


def decode(data: bytes, futures: dict[str, Future]) -> Any:
    return spec.loads_with_futures(data, futures)


def unpack_record(raw: bytes) -> list[Any]:
    """A record the scripts packed with cmsgpack (byte strings stay bytes): ``[epoch,
    keys, data, ...]``, keys decoded."""
    record = msgpack.unpackb(raw, raw=True)
    record[1] = [k.decode() for k in record[1]]
    return record


def script_error(exc: redis.ResponseError, word: str) -> bool:
    """Whether a script's error reply starts with ``word`` (its errors are codes)."""
    return str(exc).startswith(word)
