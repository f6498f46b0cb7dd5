"""Structured events from the client, with distributed's names: ``log_event``,
``get_events``, ``subscribe_topic``, ``unsubscribe_topic`` (``redisdask.store.topics``
says where they live).  ``EventMethods`` is a mixin of ``Client`` whose only state, the
subscriptions and their reader, is a ``Subscriptions`` object the client holds."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from redisdask.client.loop import offloaded
from redisdask.store import topics
from redisdask.store.connection import connect_async

if TYPE_CHECKING:
    import redis

    from redisdask.config import Config
    from redisdask.store.keyspace import Keys

logger = logging.getLogger("redisdask.client")

BLOCK_MS = 1000  # the reader's longest wait for news before it looks at its topics again

Handler = Callable[[topics.Event], Any]


class Subscriptions:
    """The topics a client subscribed to, each with its handler and the id of its last
    event handed over, and the task (on the client's loop) that reads them, through a
    connection of its own (its reads block), while there is any."""

    def __init__(self, redis_url: str, keys: Keys, config: Config, timeout: float) -> None:
        self.redis_url, self.keys, self.config, self.timeout = redis_url, keys, config, timeout
        self.handlers: dict[str, Handler] = {}
        self.last: dict[str, str] = {}  # topic -> the id of the last event handed over
        self._task: asyncio.Task[None] | None = None
        self.failed_reads = 0  # in a row, while Redis is away (0: reading)
        self._redis: Any = None

    def add(self, topic: str, handler: Handler, last_id: str) -> None:
        """(On the client's loop) hand ``topic``'s events after ``last_id`` to
        ``handler``."""
        self.handlers[topic] = handler
        self.last[topic] = last_id
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._read())

    def remove(self, topic: str) -> None:
        self.handlers.pop(topic, None)
        self.last.pop(topic, None)

    async def close(self) -> None:
        self.handlers.clear()
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=self.timeout)
        if self._redis is not None:
            await self._redis.aclose()

    async def _read(self) -> None:
        if self._redis is None:
            self._redis = connect_async(
                self.redis_url, timeout=self.timeout, config=self.config.redis
            )
        while self.handlers:
            by_stream = {topics.stream(self.keys, t): t for t in self.handlers}
            ids = {s: self.last[t] for s, t in by_stream.items()}
            try:
                reply = await self._redis.xread(ids, block=BLOCK_MS, count=100)
            except Exception as exc:  # Redis away: say so once, wait, read on
                if not self.failed_reads:
                    logger.warning("reading the subscribed topics failed: %s; retrying", exc)
                self.failed_reads += 1
                await asyncio.sleep(0.5)
                continue
            if self.failed_reads:
                logger.info(
                    "reading the subscribed topics again, after %d failed reads",
                    self.failed_reads,
                )
                self.failed_reads = 0
            for name, entries in reply or []:
                topic = by_stream.get(name.decode() if isinstance(name, bytes) else name)
                if topic is None or topic not in self.handlers:
                    continue  # (unsubscribed meanwhile)
                last = entries[-1][0]
                self.last[topic] = last.decode() if isinstance(last, bytes) else last
                for event in topics.events(entries, topic):
                    await self._hand_over(topic, event)

    async def _hand_over(self, topic: str, event: topics.Event) -> None:
        handler = self.handlers.get(topic)
        if handler is None:
            return
        try:
            result = handler(event)
            if inspect.isawaitable(result):
                await result
        except Exception:
            logger.exception("the handler of topic %r raised", topic)


class EventMethods:
    """The event methods of ``Client`` (``self`` is the client)."""

    redis: redis.Redis
    keys: Keys
    config: Config
    loop: asyncio.AbstractEventLoop
    _subscriptions: Subscriptions

    @offloaded
    def log_event(self, topic: str | list[str], msg: Any) -> None:
        """Log ``msg`` (plain data: numbers, strings, bytes, lists, dicts) under
        ``topic``, or under each of a list of topics, with the time, for every client
        of the cluster (kept: the last ``retention.events`` of each topic)."""
        pipe = self.redis.pipeline(transaction=False)
        for command in topics.commands(self.keys, topic, msg, self.config.retention.events):
            pipe.execute_command(*command)
        pipe.execute()

    @offloaded
    def get_events(self, topic: str | None = None) -> Any:
        """The events of ``topic`` as a tuple of ``(time, msg)``, oldest first; of every
        topic (None) as ``{topic: (...)}``.  Topic ``"cluster"`` is the cluster's own
        event log (worker joined, removed, died with its reason, task erred, ...)."""
        if topic is not None:
            return tuple(topics.events(self.redis.xrange(topics.stream(self.keys, topic)), topic))
        names = sorted(n.decode(errors="replace") for n in self.redis.smembers(self.keys.topics))
        return {
            name: tuple(topics.events(self.redis.xrange(topics.stream(self.keys, name)), name))
            for name in [topics.CLUSTER, *names]
        }

    def subscribe_topic(self, topic: str, handler: Handler) -> None:
        """Call ``handler((time, msg))`` for each event logged under ``topic`` from now
        on, on the client's loop (a coroutine function is awaited there); a handler
        that raises is logged and called again for the next event."""
        stream = topics.stream(self.keys, topic)
        newest = self.redis.xrevrange(stream, count=1)
        last = newest[0][0].decode() if newest else "0-0"
        self.loop.call_soon_threadsafe(self._subscriptions.add, topic, handler, last)

    def unsubscribe_topic(self, topic: str) -> None:
        """Stop handing ``topic``'s events to its handler."""
        self.loop.call_soon_threadsafe(self._subscriptions.remove, topic)
