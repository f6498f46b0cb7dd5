"""The client's line to the scheduler through Redis: ``SchedulerChannel``, which a
``Client`` holds (``client._channel``).

Two tasks run on the client's loop (``redisdask.client.loop``).  The sender writes what
``send`` queued to the clients stream, in order, everything queued at a time in one
pipeline, with the releases of keys whose last future went placed where they belong
(``_with_releases``).  The reader reads the scheduler's messages on this client's events
stream, updates the futures' states, and heartbeats: the client's ``alive`` key and
``clients`` entry, and a look at whether a scheduler leads and a worker is registered.

Delivery (see docs/design.md, "Redis goes away"): a send retries with a backoff while
Redis is away and gives up after ``redis.down-deadline``; a retry after a lost reply is
found written (by the call's token) and not written twice.  A blocking caller waits
for its write and gets its error; a graph nobody waits for makes its futures err.

A graph Redis acknowledged can still be lost: a replica promoted before the entry
reached it, an AOF that lost its last second.  So the client numbers its entries: each
write is one ``WRITE_ENTRIES`` call that writes only if Redis holds as many of this
client's entries as the client wrote (``_written``), and the client keeps every send's
entries until its keys are settled, and a while after (``_kept``).  When Redis holds
fewer (found by the next write, or by a heartbeat), the lost entries are written again,
in their order, before anything else (``_lost_since``).  The news reader reads a new
server's stream from its start, less the news it read already (``_news_read``).
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import logging
import os
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import TYPE_CHECKING, Any

import cloudpickle
import redis

from redisdask.client.futures import _FutureState
from redisdask.client.loop import running_loop, wake
from redisdask.errors import (
    ClusterConnectionError,
    ClusterNotRunningError,
    DataUnavailableError,
    KilledWorker,
    ProtocolError,
    RedisDaskError,
    RedisRefusedError,
    TaskInterrupted,
)
from redisdask.protocol import (
    SCHEDULER_TO_CLIENT,
    CancelledKeys,
    ClientReleasesKeys,
    CloseClient,
    KeyErred,
    KeyInMemory,
    Restarted,
    RetireRefused,
    Stimulus,
    TaskRetried,
    dicts,
    parse,
)
from redisdask.store import busy, codecs, redis_memory, scripts
from redisdask.store.eventlog import WARN_CLIENTS, describe
from redisdask.store.urls import redact
from redisdask.utils.backoff import Backoff
from redisdask.utils.sizes import format_bytes
from redisdask.versions import versions

if TYPE_CHECKING:
    from redisdask.config import Config
    from redisdask.store.keyspace import Keys

logger = logging.getLogger("redisdask.client")

SEND_ATTEMPTS = 3  # writes refused while Redis answers PING before the client gives up
WRITE_BYTES = 16 << 20  # stream entries written per round trip (one entry may be more)
KEEP_WRITTEN = 10.0  # s a send is kept after it was written (and its keys settled)


class SchedulerChannel:
    """Sends the client's messages to the scheduler and reads its answers.

    The client owns its futures' book and passes it in: ``states`` (key -> the state its
    futures share), which news from the scheduler settles, and ``refcount`` (key -> live
    futures), which says whether a key whose last future went has futures again; both
    under ``lock``.  ``check_running`` is the client's: a send from a client that is not
    running raises its error; ``drain`` (under ``lock``) counts down the futures the
    garbage collector took, before the book is read for releases.  Everything else here
    is the channel's own."""

    def __init__(
        self,
        *,
        client_id: str,
        config: Config,
        keys: Keys,
        redis_url: str,
        aredis: Any,
        events_redis: Any,
        lock: threading.RLock,
        states: dict[str, _FutureState],
        refcount: dict[str, int],
        check_running: Callable[[], None],
        drain: Callable[[], None],
    ) -> None:
        self.id = client_id
        self.config = config
        self.keys = keys
        self.redis_url = redis_url
        self._aredis = aredis
        self._events_redis = events_redis  # (its own connection: the reader blocks on it)
        self._lock = lock
        self._states = states
        self._refcount = refcount
        self._check_running = check_running
        self._drain = drain
        self.loop = asyncio.get_running_loop()  # (made on the client's loop)
        self.closing = False  # the client closes: nothing more is read or sent from here
        self._write_entries = aredis.register_script(scripts.WRITE_ENTRIES)
        self._through = scripts.Scripts(aredis, keys).through
        # key whose last future went -> how many sends were queued by then: its release
        # goes after those (they may depend on it), with the next write
        self._pending_release: dict[str, int] = {}
        self._queued = 0  # sends ever queued: the next one's sequence number
        self._outbox: deque[_Outgoing] = deque()  # for the sender task, in order
        self._outbox_ready = asyncio.Event()
        self._writing = False  # the sender is writing what it took from the outbox
        # held by the sender from popping releases to writing them, and by coordination
        # scripts that send wants (``coordination.backend``): neither lands in the other
        # (reentrant: a primitive used on an asynchronous client's loop cannot deadlock)
        self.send_lock = threading.RLock()
        self.restarted = threading.Event()  # the scheduler said the cluster restarted
        self.retire_refused: dict[str, str] = {}  # worker -> why the scheduler refused
        self._versions = versions()
        self._down_since: float | None = None  # when Redis was found unreachable
        self._refused_since: float | None = None  # when Redis began refusing a send
        # since when (monotonic) each heartbeat found no leading scheduler / no worker
        self.missing_since: dict[str, float] = {}
        self._written = 0  # entries written to the clients stream that Redis holds
        self._kept: deque[_Outgoing] = deque()  # sends written, kept a while
        self._lost_seen = False  # a heartbeat found Redis holds fewer: write them again
        # lost entries, written again before the rest
        self._replay: deque[tuple[dict[str, bytes], _Outgoing]] = deque()
        self._run_id: str | None = ""  # of the Redis server (None: may not be known)
        self._read_ids: set[bytes] = set()  # news ids read since the last trim
        self._read_before: set[bytes] = set()  # ... and since the trim before it
        self._trimmed_at: bytes | str = "0-0"  # the last trim's id
        self._trimmed_below: bytes | str = "0-0"  # the one before: news below was read
        self._cluster_news_id: bytes | None = None  # the cluster event last read (None: not yet)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Start the reader and the sender, on the client's loop."""
        self._tasks = [
            asyncio.ensure_future(self._aevent_loop()),
            asyncio.ensure_future(self._asender()),
        ]

    def release_later(self, key: str) -> None:
        """The last future of ``key`` went: release it with a later write, after every
        send queued so far (under the client's lock)."""
        self._pending_release[key] = self._queued

    def forget_releases(self) -> None:
        """The cluster restarts: the releases due are moot."""
        self._pending_release.clear()

    async def close(self, timeout: float) -> None:
        """Say goodbye, then stop the reader and the sender.  The goodbye goes through
        a full Redis (the scheduler then frees this client's keys); a Redis refusing
        writes (MISCONF, READONLY) is not waited for: the scheduler notices this client
        gone when its alive key expires."""
        self.closing = True
        try:
            # (the scheduler deletes our events stream when it handles close-client)
            alive, goodbye = self.keys.client_alive(self.id), CloseClient(self.id).to_dict()
            with busy.raised():
                await self._through(
                    key=alive,
                    ttl_ms=int(self.config.scheduler.client_ttl * 1000),
                    commands=[
                        ["XADD", self.keys.client_stream, "*", "m", codecs.pack([goodbye])],
                        ["DEL", alive, self.keys.client_written(self.id)],
                    ],
                )
        except (redis.RedisError, ClusterConnectionError) as exc:
            logger.warning("client %s could not say goodbye to Redis: %s", self.id, exc)
        # the reader ends when its blocking read fails: cut its connection
        await self._events_redis.connection_pool.disconnect(inuse_connections=True)
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout)

    # ------------------------------------------------------------------ sending

    def send(
        self,
        *batches: list[Stimulus],
        resubmitted: Iterable[str] = (),
        wait: bool = True,
    ) -> Awaitable[None] | None:
        """Queue stream entries (each a batch of messages) for the sender task, which
        writes them in order.  From another thread, wait until they are written (raising
        what went wrong); on the client's loop, return an awaitable of the write.

        A graph (``wait=False``: ``submit``, ``map``, ``compute``…) is not waited for,
        as in distributed: the sender batches what is queued meanwhile, and a graph that
        cannot be written makes its futures err, whether anyone waits or not."""
        self._check_running()
        on_loop = running_loop() is self.loop
        waited = wait and not on_loop
        item = _Outgoing(batches, tuple(resubmitted), concurrent.futures.Future(), waited)
        with self._lock:
            item.seq = self._queued
            self._queued += 1
            self._outbox.append(item)
        wake(self.loop, self._outbox_ready)
        if waited:
            item.written.result()
            return None
        if not on_loop:
            return None
        awaitable = asyncio.wrap_future(item.written)
        # awaited or not: a failure reaches the futures and the log (``_send_failed``)
        awaitable.add_done_callback(_retrieved)
        return awaitable

    def flush(self) -> None:
        """Wait until everything queued so far is written: a barrier for writes made
        outside the sender (a coordination script sending wants of futures just made).
        Free when nothing is queued, being written or waiting to be written again (the
        outbox is read first: the sender marks itself writing before it empties it)."""
        busy = self._outbox or self._writing or self._replay or self._lost_seen
        if busy and running_loop() is not self.loop:
            self.send()

    async def asend(self, *batches: list[Stimulus], resubmitted: Iterable[str] = ()) -> None:
        """``send`` from a coroutine on the client's loop: waits until written."""
        await self.send(*batches, resubmitted=resubmitted)  # type: ignore[misc]

    async def _asender(self) -> None:
        """Write what ``send`` queued: everything queued at a time in one write, with
        the pending releases where ``_with_releases`` places them.  One writer orders
        every send of this client.  When a write of several sends fails, each is tried
        alone, so the error goes to the send that caused it."""
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready.clear()
            if self._lost_seen:  # a heartbeat found entries lost: write them again now
                self._lost_seen = False
                try:
                    await self._awrite_entries([])
                except Exception as exc:
                    logger.warning("client %s: writing lost graphs again failed: %s",
                                   self.id, exc)  # fmt: skip
            while self._outbox:
                self._writing = True
                items = [self._outbox.popleft() for _ in range(len(self._outbox))]
                try:
                    await self._awrite(items)
                except asyncio.CancelledError:
                    _fail(items, RedisDaskError(f"client {self.id} closed before sending"))
                    raise
                except Exception as exc:
                    if len(items) == 1:
                        self._send_failed(items[0], exc)
                        continue
                    for item in items:  # which one was it? each alone says
                        try:
                            await self._awrite([item])
                        except Exception as exc:
                            self._send_failed(item, exc)
                        else:
                            _written(item)
                else:
                    for item in items:
                        _written(item)
                finally:
                    self._writing = False

    def _send_failed(self, item: _Outgoing, exc: Exception) -> None:
        """Tell the waiter and, when nobody may be waiting (a graph, or a send from the
        loop), the futures of the graph that was not sent."""
        item.written.set_exception(exc)
        if any(owner is item for _, owner in self._replay):  # said unsent: not written later
            self._replay = deque(pair for pair in self._replay if pair[1] is not item)
        if item.waited:
            return
        logger.error("client %s could not send %d messages: %s", self.id, item.size, exc)
        unsent = _never_sent(exc)
        with self._lock:
            for key in item.resubmitted:
                state = self._states.get(key)
                if state is not None and not state.is_set():
                    state.set_error(unsent, None)
                    state.unsent = True  # submitted again, it is sent again

    async def _awrite(self, items: list[_Outgoing]) -> None:
        """Write the items' entries, with the releases due (retried while Redis is away,
        for up to ``redis.down-deadline``); the releases of a write that fails go with a
        later one.  What is written is kept a while (``_kept``), for a Redis that
        loses it."""
        with self.send_lock:
            for item in items:  # (a send of nothing carries releases alone, if any)
                item.frees = item.frees or not item.batches
            batches, owners, released = self._with_releases(items)
            alone = _Outgoing((), (), concurrent.futures.Future(), False, frees=True)
            written = [
                (codecs.entry(dicts(batch)), owner or alone)
                for batch, owner in zip(batches, owners, strict=True)
                if batch
            ]
            try:
                await self._awrite_entries(written)
            except BaseException:
                with self._lock:
                    for key, after in released.items():
                        self._pending_release.setdefault(key, after)
                raise
        with self._lock:
            self._kept.extend(item for item in (*items, alone) if item.entries)
        for item in items:
            item.batches = ()  # (written: ``item.entries`` holds them)

    async def _awrite_entries(self, entries: list[tuple[dict[str, bytes], _Outgoing]]) -> None:
        """XADD ``entries`` (each with the send it is of) in order, at most WRITE_BYTES
        per round trip, each round trip one ``WRITE_ENTRIES`` call numbered by this
        client's count of entries written (``_written``).  When Redis holds fewer, it
        lost some (a failover, an AOF's last second): they go to ``_replay``
        (``_lost_since``), which every write empties first, in order.  With no entries,
        it looks for lost ones and writes what ``_replay`` holds."""
        w = _Write(own=deque(entries), look=not entries)
        while self._replay or w.own or w.look:
            w.look = False
            chunk, replayed, size = self._next_chunk(w.own)
            expected = self._written
            w.token = w.token or secrets.token_hex(8)
            try:
                with busy.raised():  # (waited out here, up to redis.down-deadline)
                    held, wrote = await self._write_chunk(chunk, expected, w.token)
                w.refused = 0
                self._redis_back()
                self._refused_since = None
            except BaseException as exc:
                self._put_back(chunk, replayed, w.own)
                await self._after_failed_write(exc, w, size)  # (raises when it gives up)
                await asyncio.sleep(w.backoff.next())  # backoff while Redis is away
                continue
            w.token = ""
            if wrote:  # now, or by a try of this call whose reply was lost
                self._landed(chunk, expected, w.writing)
            else:
                self._put_back(chunk, replayed, w.own)
                self._recount(held, expected, w.writing)
            self._written = held

    def _next_chunk(
        self, own: deque[tuple[dict[str, bytes], _Outgoing]]
    ) -> tuple[list[tuple[dict[str, bytes], _Outgoing]], int, int]:
        """The next round trip's entries, lost ones first, at most WRITE_BYTES (but one):
        a 1,000,000-task graph is 175 MiB, which a busy Redis on a shared machine may
        take longer to read than the socket timeout; what was written is not written
        again.  Returns them, how many came from ``_replay``, and their bytes."""
        chunk: list[tuple[dict[str, bytes], _Outgoing]] = []
        replayed = size = 0
        for source in (self._replay, own):
            while source and not (size and size + len(source[0][0]["m"]) > WRITE_BYTES):
                chunk.append(source.popleft())
                size += len(chunk[-1][0]["m"])
            if source is self._replay:
                replayed = len(chunk)
        return chunk, replayed, size

    async def _write_chunk(
        self, chunk: list[tuple[dict[str, bytes], _Outgoing]], expected: int, token: str
    ) -> tuple[int, int]:
        """One ``WRITE_ENTRIES`` call: (entries Redis holds, whether these were written)."""
        keys = [self.keys.client_stream, self.keys.client_written(self.id)]
        if all(owner.frees for _, owner in chunk):  # through a full Redis
            keys.append(self.keys.client_stream)
        args = [expected, token, *(entry["m"] for entry, _ in chunk)]
        held, wrote = map(int, await self._write_entries(keys=keys, args=args))
        return held, wrote

    def _put_back(
        self,
        chunk: list[tuple[dict[str, bytes], _Outgoing]],
        replayed: int,
        own: deque[tuple[dict[str, bytes], _Outgoing]],
    ) -> None:
        """Not written: the chunk's entries go back where they came from (never dropped)."""
        self._replay.extendleft(reversed(chunk[:replayed]))
        own.extendleft(reversed(chunk[replayed:]))

    async def _after_failed_write(self, exc: BaseException, w: _Write, size: int) -> None:
        """A round trip failed: return to try again (Redis refusing or away), or raise
        what the sender reports (a write Redis will never take, or Redis gone too long)."""
        if busy.refusal(exc):
            await self._arefused(exc, size)
            return
        if isinstance(exc, redis.ResponseError):
            why = str(exc).rpartition("caused error: ")[2]  # (not the command's bytes)
            raise RedisDaskError(
                f"Redis at {redact(self.redis_url)} refused a write of "
                f"{format_bytes(size)} to the clients stream: {why}; a write that "
                "large may pass Redis's limits (proto-max-bulk-len, "
                "client-query-buffer-limit): send large data with client.scatter"
            ) from exc
        if not isinstance(exc, ClusterConnectionError):
            raise exc
        w.look = not (w.own or self._replay)
        if not await self._redis_answers():
            self._redis_lost(exc)
            await self._acheck_redis()
            return
        w.refused += 1
        if w.refused >= SEND_ATTEMPTS:
            raise ClusterConnectionError(
                f"Redis at {redact(self.redis_url)} answers but dropped the "
                f"connection on each of {w.refused} attempts to write "
                f"{format_bytes(size)} to the clients stream ({exc}); a "
                "write that large may pass Redis's limits "
                "(proto-max-bulk-len, client-query-buffer-limit): send large "
                "data with client.scatter"
            ) from exc

    def _landed(
        self, chunk: list[tuple[dict[str, bytes], _Outgoing]], first: int, writing: list[_Outgoing]
    ) -> None:
        """The chunk's entries were written, numbered from ``first``: each send keeps its
        own, for a Redis that loses them (``writing``: the sends of this write)."""
        now = time.monotonic()
        for number, (entry, owner) in enumerate(chunk, start=first):
            if not owner.entries:
                writing.append(owner)
            owner.entries.append(entry)
            owner.numbers.append(number)
            owner.written_at = now

    def _recount(self, held: int, expected: int, writing: list[_Outgoing]) -> None:
        """Redis holds ``held`` of this client's entries where it counted ``expected``:
        fewer, it lost some, to be written again first; more, a write it gave up on had
        landed, and counting goes on from there."""
        if held < expected:
            if self.closing:  # (the goodbye cleared the count)
                raise RedisDaskError(f"client {self.id} closed before sending")
            self._replay.extendleft(reversed(self._lost_since(held, writing)))
        elif held > expected:
            logger.warning(
                "client %s: Redis holds %d of its entries where it counted %d (a "
                "write it gave up on had landed); counting on from there",
                self.id, held, expected,
            )  # fmt: skip

    def _lost_since(
        self, held: int, writing: list[_Outgoing]
    ) -> list[tuple[dict[str, bytes], _Outgoing]]:
        """Redis holds only the first ``held`` entries this client wrote: take the
        others out of the sends that kept them (``_kept``, and ``writing``: those
        of the write under way), in the order they were first written."""
        lost: list[tuple[int, dict[str, bytes], _Outgoing]] = []
        with self._lock:
            for item in (*self._kept, *writing):
                cut = bisect.bisect_left(item.numbers, held)
                lost.extend(zip(item.numbers[cut:], item.entries[cut:], repeat(item)))
                del item.numbers[cut:], item.entries[cut:]
        if lost:
            logger.warning(
                "client %s: Redis at %s lost %d entries this client wrote (a failover, "
                "or a restart without its last writes): writing them again",
                self.id, redact(self.redis_url), len(lost),
            )  # fmt: skip
        lost.sort(key=lambda t: t[0])
        return [(entry, item) for _, entry, item in lost]

    async def _arefused(self, exc: Exception, size: int) -> None:
        """Redis refused a write (full, cannot persist, a replica): logged once, waited
        out, and raised as ``RedisRefusedError`` saying why once it has lasted longer
        than ``redis.down-deadline``."""
        now, deadline = time.monotonic(), self.config.redis.down_deadline
        kind = busy.refusal(exc) or ""
        if kind == "OOM":
            why = redis_memory.full_text(await redis_memory.aread(self._aredis))
        else:
            why = f"Redis {busy.WHY.get(kind, 'refuses writes')}"
        if self._refused_since is None:
            self._refused_since = now
            logger.warning(
                "client %s: %s; Redis at %s refused a write of %s to the clients stream "
                "(%s); trying again for up to %g s (redis.down-deadline)",
                self.id, why, redact(self.redis_url), format_bytes(size), exc, deadline,
            )  # fmt: skip
        elif now - self._refused_since > deadline:
            raise RedisRefusedError(
                f"{why}: Redis at {redact(self.redis_url)} refused this client's write of "
                f"{format_bytes(size)} to the clients stream for more than {deadline:g} s "
                f"(redis.down-deadline); it said: {exc}"
            ) from exc

    async def _redis_answers(self) -> bool:
        try:
            await self._aredis.ping()
        except ClusterConnectionError:
            return False
        return True

    def _redis_lost(self, exc: Exception) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            logger.warning(
                "client %s lost Redis at %s (%s); retrying with backoff",
                self.id,
                redact(self.redis_url),
                exc,
            )

    def _redis_back(self) -> None:
        if self._down_since is not None:
            logger.warning(
                "client %s reconnected to Redis after %.1f s",
                self.id,
                time.monotonic() - self._down_since,
            )
            self._down_since = None

    async def _acheck_redis(self) -> None:
        """Raise once Redis has been unreachable for longer than ``redis.down-deadline``."""
        since = self._down_since
        deadline = self.config.redis.down_deadline
        if since is not None and time.monotonic() - since > deadline:
            if await self._redis_answers():  # back meanwhile? (the reader may not know yet)
                self._redis_back()
                return
            raise ClusterConnectionError(
                f"Redis at {redact(self.redis_url)} has been unreachable for more than "
                f"{deadline:g} s (redis.down-deadline); nothing is lost: the futures are kept "
                "and work again once Redis is back"
            )

    def _with_releases(
        self, items: list[_Outgoing]
    ) -> tuple[list[list[Stimulus]], list[_Outgoing | None], dict[str, int]]:
        """The items' batches in order, with the release of every key whose last future
        went (``release_later``) placed after every send queued before it went (a graph queued
        earlier may depend on the key) and before the items queued after.  A release due
        after a send that is not among ``items`` (queued since they were taken) waits.

        A key that has futures again is released only before an item that submits it
        again: the scheduler then forgets the old run before it reads the new graph, so a
        key reused for another computation (``get({"y": ...}, "y")`` twice) is computed
        anew.  Otherwise it stays pending while it has futures.  Also returns the item
        each batch is of (``None``: releases alone) and the releases taken (key -> its
        place), to put back if the write fails."""
        batches: list[list[Stimulus]] = []
        owners: list[_Outgoing | None] = []
        released: dict[str, int] = {}
        with self._lock:
            self._drain()
            pending = self._pending_release
            for item in items:
                again = set(item.resubmitted)
                keys = [
                    k
                    for k, after in pending.items()
                    if after <= item.seq and (k not in self._refcount or k in again)
                ]
                if keys:
                    for key in keys:
                        released[key] = pending.pop(key)
                    *alone, last = self._releases(keys)
                    batches.extend(alone)
                    owners.extend([None] * len(alone))
                    _prepend(batches, item.batches, last)
                else:
                    batches.extend(item.batches)
                owners.extend([item] * (len(batches) - len(owners)))
            # the others wait for every send queued before they went: one queued while
            # these items were taken out of the outbox is not in this write
            last_seq = items[-1].seq if items else self._queued
            keys = [
                k
                for k, after in pending.items()
                if after <= last_seq + 1 and k not in self._refcount
            ]
            if keys:
                for key in keys:
                    released[key] = pending.pop(key)
                *alone, last = self._releases(keys)
                if batches and not alone:  # the same entry: one scheduler batch, not two
                    batches[-1] = [*batches[-1], last]
                else:
                    batches.extend([*alone, [last]])
                    owners.extend([None] * (len(alone) + 1))
        return batches, owners, released

    def _releases(self, keys: list[str]) -> list[Any]:
        """The release of ``keys``: entries of one message each but the last, which is a
        message alone (to share the entry of what follows).  Each names at most
        ``client.submit-batch`` keys, as a graph's entries do: the scheduler applies an
        entry in one batch, and releasing 1,000,000 keys in one would outlive its lease."""
        size = self.config.client.submit_batch
        msgs = [ClientReleasesKeys(self.id, keys[i : i + size]) for i in range(0, len(keys), size)]
        return [[msg] for msg in msgs[:-1]] + [msgs[-1]]

    # ------------------------------------------------------------------ lost writes

    async def _anew_server(self) -> bool:
        """Whether Redis is another server than at the previous look, or the same one
        restarted (``INFO server``'s ``run_id`` changed): then the news written to this
        client may have been lost, and new news may come with smaller ids.  A user whose
        ACL refuses INFO cannot tell (logged once)."""
        if self._run_id is None:
            return False
        try:
            run_id = (await self._aredis.info("server")).get("run_id", "")
        except redis.ResponseError as exc:  # (refused by an ACL, or renamed away)
            logger.warning(
                "client %s may not run INFO (%s): after a failover, news with smaller ids "
                "than what it read would be missed; give the client's Redis user +info "
                "(`redisdask acl client`)", self.id, exc,
            )  # fmt: skip
            self._run_id = None
            return False
        new, self._run_id = self._run_id not in ("", run_id), run_id
        return new

    def _prune_kept(self) -> None:
        """Forget the kept sends whose every key is settled (or no longer wanted) and
        that were written more than KEEP_WRITTEN ago: a failover loses the last instant
        of writes, news of their keys included."""
        states, old = self._states, time.monotonic() - KEEP_WRITTEN
        kept: deque[_Outgoing] = deque()
        for item in self._kept:
            keys = item.resubmitted
            while item.settled < len(keys):
                state = states.get(keys[item.settled])
                if state is not None and not state.is_set():
                    break
                item.settled += 1
            if item.settled < len(keys) or item.written_at > old:
                kept.append(item)
        self._kept = kept

    # ------------------------------------------------------------------ the reader task

    async def aheartbeat(self) -> bool:
        """Say this client is alive, look at the cluster and at what Redis holds of this
        client's writes (fewer than it wrote: the sender writes them again), and return
        whether Redis is a new server since the previous heartbeat (``_anew_server``)."""
        ttl_ms = int(self.config.scheduler.client_ttl * 1000)
        alive = self.keys.client_alive(self.id)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "last_seen": time.time(),
              "versions": self._versions}  # fmt: skip
        pipe = self._aredis.pipeline(transaction=False)
        # through a full Redis: a client that stopped heartbeating would lose its keys
        await self._through(
            key=alive,
            ttl_ms=ttl_ms,
            commands=[
                ["SET", alive, 1, "PX", ttl_ms],
                ["HSET", self.keys.clients, self.id, codecs.pack(me)],
            ],
            client=pipe,
        )
        pipe.get(self.keys.client_written(self.id))
        if self._cluster_news_id is None:  # the first look: where the news starts
            pipe.xrevrange(self.keys.events, count=1)
        else:
            pipe.xread({self.keys.events: self._cluster_news_id}, count=1000)
        _, held, news, *_ = await self._alook_for_cluster(pipe)
        self._warn_of_cluster_news(news)
        # (Redis never holds fewer than ``_written`` unless it lost some: it counts up
        # as the writes land, ``_written`` once their replies are read)
        if int((held or b"0").split()[0]) < self._written or self._replay:
            self._lost_seen = True
            self._outbox_ready.set()
        return await self._anew_server()

    def _warn_of_cluster_news(self, reply: Any) -> None:
        """Log as warnings the cluster events written since this client's first
        heartbeat that may explain why its futures wait (``eventlog.WARN_CLIENTS``: a worker
        that cannot spill)."""
        if self._cluster_news_id is None:
            self._cluster_news_id = reply[0][0] if reply else b"0-0"
            return
        for _stream, items in reply or []:
            for entry_id, fields in items:
                self._cluster_news_id = entry_id
                event = codecs.unpack_or(fields.get(b"m"), {}, dict)
                if event.get("kind") in WARN_CLIENTS:
                    logger.warning("%s", describe(event))

    async def _alook_for_cluster(self, pipe: Any) -> list[Any]:
        """Run ``pipe`` with a look at the lease and the workers; note what is missing.
        Returns the replies."""
        pipe.exists(self.keys.leader)  # not the lease: see Keys.leader
        pipe.hlen(self.keys.workers)
        replies = await pipe.execute()
        *_, leads, workers = replies
        now = time.monotonic()
        for what, present in (("scheduler", leads), ("workers", workers)):
            if present:
                self.missing_since.pop(what, None)
            else:
                self.missing_since.setdefault(what, now)
        return replies

    def missing_text(self, what: str, waited: float | None) -> str:
        """What a client found missing, for how long, and what to do about it."""
        url, name = redact(self.redis_url), self.keys.cluster
        if what == "scheduler":
            missing = f"no scheduler leads cluster {name!r} on {url}"
            start = f"start one with `redisdask scheduler {url} --cluster {name}`"
        else:
            missing = f"no worker is registered in cluster {name!r} on {url}"
            start = f"start one with `redisdask worker {url} --cluster {name}`"
        if waited is None:
            return f"{missing}: tasks will wait; {start}, or check the cluster name"
        limit = self.config.client.no_scheduler_timeout
        return (
            f"{missing}, for {waited:.0f} s (client.no-scheduler-timeout: {limit:g} s): "
            f"{start}, or check the cluster name; the futures are kept and go on once it runs"
        )

    async def acheck_waiting(self) -> None:
        """What every wait on this client's futures calls between its slices: raise once
        waiting longer is pointless (Redis away, or the cluster not running, too long)."""
        await self._acheck_redis()
        await self._acheck_cluster()

    async def _acheck_cluster(self) -> None:
        """Raise once the cluster has had no leading scheduler, or no worker, for longer
        than ``client.no-scheduler-timeout`` (each heartbeat looks)."""
        now, limit = time.monotonic(), self.config.client.no_scheduler_timeout
        if not any(now - since > limit for since in self.missing_since.values()):
            return
        await self._alook_for_cluster(self._aredis.pipeline(transaction=False))  # gone since?
        for what, since in dict(self.missing_since).items():
            if now - since > limit:
                raise ClusterNotRunningError(self.missing_text(what, waited=now - since))

    async def _aevent_loop(self) -> None:
        """Read the scheduler's messages to this client; heartbeat between reads."""
        stream = self.keys.client_events(self.id)
        last_id = "0"
        interval = self.config.client.heartbeat_interval
        next_beat = time.monotonic() + interval
        while not self.closing:
            try:
                block = max(1, int((next_beat - time.monotonic()) * 1000))
                reply = await self._events_redis.xread({stream: last_id}, block=block, count=1000)
                for _name, items in reply or []:
                    for entry_id, fields in items:
                        last_id = entry_id
                        if self._news_read(entry_id):
                            continue
                        self._read_ids.add(entry_id)
                        self._handle_entry(fields)
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + interval
                    if await self.aheartbeat():
                        # a new primary may hold news written after the failover with
                        # ids below what was read here (its clock behind the old one's):
                        # read its stream from the start, less the news read already
                        last_id = "0"
                    else:  # trimming what was read waits for the heartbeat (off the
                        # latency path); what it trims is remembered for a while
                        await self._events_redis.xtrim(stream, minid=last_id)
                        self._trimmed_below, self._trimmed_at = self._trimmed_at, last_id
                        self._read_before, self._read_ids = self._read_ids, {last_id}
                    with self._lock:
                        self._drain()  # (futures the garbage collector took)
                        self._prune_kept()
                    if self._pending_release and not self.closing:
                        self.send()
                self._redis_back()
            except Exception as exc:
                if self.closing:
                    return  # ``close`` cut the connection
                # (its own reads raise redis-py's errors, the heartbeat ours)
                if isinstance(
                    exc, redis.ConnectionError | redis.TimeoutError | ClusterConnectionError
                ):
                    self._redis_lost(exc)
                    await asyncio.sleep(0.2)
                elif isinstance(exc, redis.ResponseError) and "WRONGTYPE" in str(exc):
                    logger.error(
                        "client %s: a key of cluster %r in Redis holds a value of the wrong "
                        "type (%s); waiting for the scheduler to rebuild it",
                        self.id, self.keys.cluster, exc,
                    )  # fmt: skip
                else:
                    logger.exception("client %s: error handling scheduler messages", self.id)

    def _news_read(self, entry_id: bytes) -> bool:
        """Whether the news of this entry was read already (only a read from the start
        of the stream, after a failover, meets such entries): its id was read since the
        trim before last, or is below that trim's (a new primary whose clock is behind
        the old one's by more than two heartbeats could give new news such ids)."""
        return (
            entry_id in self._read_ids
            or entry_id in self._read_before
            or _entry_id(entry_id) < _entry_id(self._trimmed_below)
        )

    def _handle_entry(self, fields: dict[bytes, bytes]) -> None:
        messages = codecs.unpack_or(fields.get(b"m"), None, list)
        if messages is None:
            logger.warning(
                "client %s: ignoring an entry of its events stream that is no msgpack list "
                "of messages in field 'm' (fields %s)", self.id, sorted(fields)[:5],
            )  # fmt: skip
            return
        for raw in messages:
            try:
                msg = parse(raw, SCHEDULER_TO_CLIENT)
            except ProtocolError as exc:
                logger.warning("client %s: ignoring a scheduler message: %s", self.id, exc)
                continue
            with self._lock:
                _HANDLERS[type(msg)](self, msg)

    def _key_in_memory(self, msg: KeyInMemory) -> None:
        state = self._states.get(msg.key)
        if state is not None and _about_this_run(msg.seen, state):
            state.finish(msg.who_has, msg.type, msg.value)

    def _key_erred(self, msg: KeyErred) -> None:
        state = self._states.get(msg.key)
        if state is not None and _about_this_run(msg.seen, state):
            exc, tb = _load_error(msg)
            state.set_error(exc, tb)

    def _retire_was_refused(self, msg: RetireRefused) -> None:
        for address in msg.workers:
            self.retire_refused[address] = msg.reason

    def _was_restarted(self, msg: Restarted) -> None:
        for state in list(self._states.values()):
            state.cancel("the cluster was restarted")
        self.restarted.set()

    def _keys_cancelled(self, msg: CancelledKeys) -> None:
        for key in msg.keys:
            state = self._states.get(key)
            if state is not None and state.generation <= msg.generation:
                state.cancel()

    def _task_retried(self, msg: TaskRetried) -> None:
        state = self._states.get(msg.key)
        if state is not None and state.status == "error":
            state.reset()  # pending again: the task runs again


# what the client does with each message of its events stream (``SCHEDULER_TO_CLIENT``),
# under its lock
_HANDLERS: dict[type, Callable[[SchedulerChannel, Any], None]] = {
    KeyInMemory: SchedulerChannel._key_in_memory,
    KeyErred: SchedulerChannel._key_erred,
    RetireRefused: SchedulerChannel._retire_was_refused,
    Restarted: SchedulerChannel._was_restarted,
    CancelledKeys: SchedulerChannel._keys_cancelled,
    TaskRetried: SchedulerChannel._task_retried,
}


# --------------------------------------------------------------------------- helpers


@dataclass(slots=True)
class _Outgoing:
    """Stream entries queued for the sender task, and who hears how the write went."""

    batches: tuple[list[Stimulus], ...]
    resubmitted: tuple[str, ...]  # the keys of a graph (a failed send errs their futures)
    written: concurrent.futures.Future[None]
    waited: bool  # a thread blocks on ``written`` (else a failure errs the futures)
    seq: int = 0  # its place among the client's sends (``_with_releases``)
    entries: list[dict[str, bytes]] = field(default_factory=list)  # as written (packed)
    numbers: list[int] = field(default_factory=list)  # theirs among the client's entries
    written_at: float = 0.0  # when its last entry was written (monotonic)
    settled: int = 0  # how many of its first keys are known settled (``_prune_kept``)
    frees: bool = False  # releases alone: written through a full Redis (WRITE_ENTRIES)

    @property
    def size(self) -> int:
        return sum(len(batch) for batch in self.batches)


@dataclass(slots=True)
class _Write:
    """One ``_awrite_entries``: what is left of its own entries, and its tries."""

    own: deque[tuple[dict[str, bytes], _Outgoing]]
    look: bool  # look for lost entries (and write them) though none are queued
    writing: list[_Outgoing] = field(default_factory=list)  # its sends, as they land
    refused: int = 0  # failures while Redis itself answers: the write is the problem
    token: str = ""  # of a call tried again after a dropped connection: it may have landed
    backoff: Backoff = field(default_factory=lambda: Backoff(base=0.05, cap=1.0))


def _entry_id(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id, comparable: ``b"1700000000000-3"`` -> ``(1700000000000, 3)``."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _written(item: _Outgoing) -> None:
    if not item.written.done():
        item.written.set_result(None)


def _retrieved(future: asyncio.Future[None]) -> None:
    """Mark the exception of ``future`` seen (asyncio logs the unseen ones)."""
    if not future.cancelled():
        future.exception()


def _about_this_run(seen: int | None, state: _FutureState) -> bool:
    """Whether news of a key is about the run its future waits for: written after the
    scheduler read the future's submission (``KeyInMemory.seen``), and not cancelled
    since: a run that ended before the cancellation reached the scheduler sends its news
    all the same, which turned a cancelled future back into a finished one (a cancelled
    future is pending again only when submitted again, with a new generation)."""
    return state.status != "cancelled" and (seen is None or seen >= state.generation)


def _never_sent(exc: Exception) -> Exception:
    """The error of a future whose graph could not be written: of the same class as
    ``exc`` where it can be (``except ClusterConnectionError`` still catches it)."""
    text = (
        f"the graph of this future was never sent to the cluster: {exc}; submit it again "
        "(the same call) once that is mended"
    )
    try:
        unsent = type(exc)(text)
    except Exception:
        unsent = RedisDaskError(text)
    unsent.__cause__ = exc
    return unsent


def _fail(items: list[_Outgoing], exc: BaseException) -> None:
    for item in items:
        if not item.written.done():
            item.written.set_exception(exc)


def _prepend(
    batches: list[list[Stimulus]], following: Sequence[list[Stimulus]], msg: Stimulus
) -> None:
    """Append ``following`` to ``batches`` with ``msg`` first, in the same stream entry as
    the first of them: separate entries are read as separate scheduler batches, and a
    release written just before a submission would cost the submission a batch of its
    own in the scheduler."""
    if following:
        batches.append([msg, *following[0]])
        batches.extend(following[1:])
    else:
        batches.append([msg])


def _load_error(msg: KeyErred) -> tuple[BaseException, Any]:
    """Rebuild the original exception and traceback a worker pickled."""
    exc: BaseException
    try:
        exc = cloudpickle.loads(msg.exception) if msg.exception else None  # type: ignore[assignment]
    except Exception as err:
        exc = RedisDaskError(
            f"the task raised an exception that could not be unpickled here: {err}; "
            f"it was: {msg.exception_text}"
        )
    if exc is not None and not isinstance(exc, Exception):
        exc = TaskInterrupted(
            f"the task raised {exc!r}, which is no Exception (it would end this program if "
            "raised here)"
        )
    if exc is None and msg.killed:
        # (a record's bytes, passed on as they are: whatever they hold, the future errs)
        evidence = codecs.unpack_or(msg.killed, {}, dict)
        deaths = evidence.get("deaths")
        deaths = [d for d in deaths if isinstance(d, dict)] if isinstance(deaths, list) else []
        exc = KilledWorker(str(evidence.get("task") or msg.key), deaths, msg.exception_text)
    if exc is None and msg.rejected:
        from redisdask.errors import SchedulerRejectedError

        exc = SchedulerRejectedError(msg.exception_text or "the scheduler refused it")
    if exc is None:
        exc = DataUnavailableError(msg.exception_text or "task erred")
    tb = None
    if msg.traceback:
        try:
            from tblib import Traceback

            tb = Traceback.from_dict(cloudpickle.loads(msg.traceback)).as_traceback()
        except Exception:
            tb = None
    return exc, tb
