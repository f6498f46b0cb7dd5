"""Redis refusing commands for a while: wait it out, never fail on it.

Redis refuses a command it will take again later, without executing it:

* ``BUSY``: a Lua script (or a function, or a module's command) runs past Redis's
  ``busy-reply-threshold`` (``lua-time-limit``; 5 s by default); every other command is
  refused until it ends (``SCRIPT KILL`` ends a runaway one).
* ``OOM``: used memory is above ``maxmemory`` under ``noeviction``; commands that may add
  memory (``denyoom``: SET, XADD, HSET...) are refused, those that free it (DEL, XACK,
  PEXPIRE...) are not.  The writes that must get through a full Redis, so that it can
  ever empty again, open their script with a write that is not ``denyoom`` (see
  docs/design.md, "A full Redis").
* ``MISCONF``: Redis cannot persist: a failed RDB save (with
  ``stop-writes-on-bgsave-error yes``, until a save succeeds) or a failed AOF write or
  fsync (until one succeeds: Redis tries again every second): every write.
* ``READONLY``: the server is a replica (a demoted primary): every write.

A refused command was **not executed**, so sending it again later is always safe; every
redisdask process (scheduler, workers, nannies, clients) does, with backoff, however long
it lasts, logging what Redis said and the fix once per episode (and again every
``WARN_EVERY``), and when it ends.  Code that must not wait (a client's send, with its
``redis.down-deadline``; the scheduler's MULTI of a big write, which a full Redis refuses
whole) asks for the refusal instead: ``with raised(): ...``.

* A single command (and a script call) is sent again as it was.
* A transaction (MULTI/EXEC) with a refused command is discarded whole by Redis
  (``EXECABORT``): it is sent again whole.  One that WATCHed keys raises ``WatchError``
  instead, so that ``Redis.transaction`` reads the watched keys again and rebuilds it.
* A new connection's handshake (``CLIENT SETNAME``, which Redis 6.2 refuses too) is
  tried again before any command is sent on it.
* A plain pipeline may have some commands executed and some refused (the script began or
  ended while Redis read it): the refused ones are sent again, in their order, and their
  replies take their places.  Such commands may then run after commands that followed them
  in the pipeline; a pipeline whose order matters must be a transaction.

``connect`` and ``connect_async`` (``redisdask/store/connection.py``) return these classes.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.client
import redis.client

from redisdask.utils.backoff import Backoff

logger = logging.getLogger("redisdask.redis")

WARN_EVERY = 30.0  # seconds between the log lines of one long wait
# what Redis says, first in a command's error, after "caused error: " (or "caused
# error: ('") in a pipeline's, after "discarded because of: " in a transaction's, inside a
# script's; BUSY: Valkey names itself.  redis-py takes "OOM " and "READONLY " off the
# errors it raises as OutOfMemoryError and ReadOnlyError: their texts are matched without
_REFUSED = re.compile(
    r"(?:^|[\s('\"-])(?:(BUSY) \w+ is busy|(?:OOM )?(command not allowed when used memory)|"
    r"(MISCONF) |(?:READONLY )?(You can't write against a read only)|"
    r"(UNBLOCKED) force unblock from blocking operation, instance state changed)"
)
# of the groups of _REFUSED, in order; UNBLOCKED: a blocking read that the server's
# demotion to a replica ended (it returned nothing: reading again is safe)
_KINDS = ("BUSY", "OOM", "MISCONF", "READONLY", "READONLY")
# what each refusal means, and what makes it end
WHY = {
    "BUSY": "is busy running a script (SCRIPT KILL stops a script that never ends)",
    "OOM": "is full: used memory is above maxmemory under noeviction (release results: "
    "del futures, client.cancel; or raise maxmemory: CONFIG SET maxmemory)",
    "MISCONF": "refuses writes because it cannot persist: an RDB save or an AOF write "
    "failed (its log says which and why: often a full or unwritable disk under its dir); "
    "once the disk is fixed, a failed AOF write ends by itself, a failed save with the "
    "next save that succeeds (BGSAVE; or CONFIG SET stop-writes-on-bgsave-error no)",
    "READONLY": "is a read-only replica (a demoted primary): point redis.url at the "
    "primary, or use a redis+sentinel:// URL",
}
_WAITED = contextvars.ContextVar("refusals_waited", default=frozenset(WHY))
# (host, port, kind) -> [when it began, when it was last logged]: one line per episode
# (and every WARN_EVERY) for all the waits of a process, whatever thread they run in
_episodes: dict[tuple[Any, Any, str], list[float]] = {}
_episodes_lock = threading.Lock()


def refusal(exc: object) -> str | None:
    """Which refusal ``exc`` (an exception or a pipeline's reply) is: ``"BUSY"``,
    ``"OOM"``, ``"MISCONF"``, ``"READONLY"``, or None for any other error."""
    if not isinstance(exc, redis.ResponseError):
        return None
    found = _REFUSED.search(str(exc.args[0]) if exc.args else "")
    if found is None:
        return None
    return next(kind for kind, text in zip(_KINDS, found.groups(), strict=True) if text)


def is_busy(exc: object) -> bool:
    """Whether ``exc`` is a refusal this context waits out (see ``raised``)."""
    kind = refusal(exc)
    return kind is not None and kind in _WAITED.get()


@contextlib.contextmanager
def raised(*kinds: str) -> Iterator[None]:
    """Within the block (this thread, or this asyncio task), the refusals ``kinds`` (all
    but BUSY if none are named) raise ``ResponseError`` instead of being waited out."""
    token = _WAITED.set(_WAITED.get() - set(kinds or ("OOM", "MISCONF", "READONLY")))
    try:
        yield
    finally:
        _WAITED.reset(token)


class _Wait:
    """The backoff and the log lines of one wait for a refusing Redis."""

    def __init__(self, client: Any, what: Any) -> None:
        self.client, self.what = client, what
        self.backoff = Backoff(base=0.02, cap=0.5)
        self.started = time.monotonic()
        self.kind = ""

    def next(self, exc: BaseException) -> float:
        now = time.monotonic()
        kwargs = self.client.connection_pool.connection_kwargs
        self.kind = refusal(exc) or "BUSY"
        episode = (kwargs.get("host", "?"), kwargs.get("port", "?"), self.kind)
        with _episodes_lock:
            times = _episodes.setdefault(episode, [now, -math.inf])
            began, due = times[0], now - times[1] >= WARN_EVERY
            if due:
                times[1] = now
        if due:
            logger.warning(
                "Redis at %s:%s %s; it said: %s; waiting to send %s again (for %.1f s now)",
                *episode[:2],
                WHY[self.kind],
                str(exc)[:120],
                self.what,
                now - began,
            )
        return self.backoff.next()

    def done(self) -> None:
        """The command went through: the episode (if this wait saw one) ended."""
        kwargs = self.client.connection_pool.connection_kwargs
        episode = (kwargs.get("host", "?"), kwargs.get("port", "?"), self.kind)
        with _episodes_lock:
            times = _episodes.pop(episode, None)
        if times is not None:
            logger.warning(
                "Redis at %s:%s takes %s again after %.1f s",
                *episode[:2],
                self.what,
                time.monotonic() - times[0],
            )


def _done(wait: _Wait | None, value: Any) -> Any:
    if wait is not None:
        wait.done()
    return value


class Redis(redis.Redis):
    """A redis-py client that waits out refusals (see the module's docstring)."""

    def execute_command(self, *args: Any, **options: Any) -> Any:
        wait: _Wait | None = None
        while True:
            try:
                return _done(wait, super().execute_command(*args, **options))
            except redis.ResponseError as exc:
                if not is_busy(exc):
                    raise
                wait = wait or _Wait(self, args[0] if args else "a command")
                time.sleep(wait.next(exc))  # Redis runs a script: nothing to do but wait

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Any:
        return Pipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)


class Pipeline(redis.client.Pipeline):
    def immediate_execute_command(self, *args: Any, **options: Any) -> Any:
        wait: _Wait | None = None
        while True:
            try:
                return _done(wait, super().immediate_execute_command(*args, **options))
            except redis.ResponseError as exc:
                if not is_busy(exc):
                    raise
                wait = wait or _Wait(self, args[0] if args else "a command")
                time.sleep(wait.next(exc))

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        stack, scripts = list(self.command_stack), set(self.scripts)
        explicit, watching = self.explicit_transaction, self.watching
        transaction = self.transaction or explicit
        wait: _Wait | None = None
        while transaction:
            try:
                return _done(wait, super().execute(raise_on_error))
            except redis.ResponseError as exc:
                if not is_busy(exc):
                    raise
                wait = wait or _Wait(self, "a transaction")
                time.sleep(wait.next(exc))
                if watching:  # the watch ended with it: read again, build again
                    raise redis.WatchError("Redis was busy running a script") from exc
                self.command_stack, self.scripts = list(stack), set(scripts)
                self.explicit_transaction = explicit
        replies = self._send(stack, scripts)
        while refused := [i for i, reply in enumerate(replies) if is_busy(reply)]:
            wait = wait or _Wait(self, f"{len(refused)} commands of a pipeline")
            time.sleep(wait.next(replies[refused[0]]))
            again = self._send([stack[i] for i in refused], scripts)
            for i, reply in zip(refused, again, strict=True):
                replies[i] = reply
        _done(wait, None)
        if raise_on_error:
            self.raise_first_error(stack, replies)
        return replies

    def _send(self, stack: list[Any], scripts: set[Any]) -> list[Any]:
        """``stack`` as a plain pipeline, errors in their replies' places.  A BUSY raised
        rather than replied refused a new connection's handshake, before anything was
        sent (Redis 6.2 refuses ``CLIENT SETNAME``): it is waited out."""
        wait: _Wait | None = None
        while True:
            self.command_stack, self.scripts = list(stack), set(scripts)
            try:
                return _done(wait, super().execute(raise_on_error=False))
            except redis.ResponseError as exc:
                if not is_busy(exc):
                    raise
                wait = wait or _Wait(self, "a pipeline on a new connection")
                time.sleep(wait.next(exc))


class AsyncRedis(redis.asyncio.Redis):
    """``Redis`` for redis-py's asyncio client."""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        wait: _Wait | None = None
        while True:
            try:
                return _done(wait, await super().execute_command(*args, **options))
            except redis.ResponseError as exc:
                if not is_busy(exc):
                    raise
                wait = wait or _Wait(self, args[0] if args else "a command")
                await asyncio.sleep(wait.next(exc))

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Any:
        return AsyncPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)


class AsyncPipeline(redis.asyncio.client.Pipeline):
    async def immediate_execute_command(self, *args: Any, **options: Any) -> Any:
        wait: _Wait | None = None
        while True:
            try:
                return _done(wait, await super().immediate_execute_command(*args, **options))
            except redis.ResponseError as exc:
                if not is_busy(exc):
                    raise
                wait = wait or _Wait(self, args[0] if args else "a command")
                await asyncio.sleep(wait.next(exc))

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        stack, scripts = list(self.command_stack), set(self.scripts)
        explicit, watching = self.explicit_transaction, self.watching
        transaction = self.is_transaction or explicit
        wait: _Wait | None = None
        while transaction:
            try:
                return _done(wait, await super().execute(raise_on_error))
            except redis.ResponseError as exc:
                if not is_busy(exc):
                    raise
                wait = wait or _Wait(self, "a transaction")
                await asyncio.sleep(wait.next(exc))
                if watching:
                    raise redis.WatchError("Redis was busy running a script") from exc
                self.command_stack, self.scripts = list(stack), set(scripts)
                self.explicit_transaction = explicit
        replies = await self._send(stack, scripts)
        while refused := [i for i, reply in enumerate(replies) if is_busy(reply)]:
            wait = wait or _Wait(self, f"{len(refused)} commands of a pipeline")
            await asyncio.sleep(wait.next(replies[refused[0]]))
            again = await self._send([stack[i] for i in refused], scripts)
            for i, reply in zip(refused, again, strict=True):
                replies[i] = reply
        _done(wait, None)
        if raise_on_error:
            self.raise_first_error(stack, replies)
        return replies

    async def _send(self, stack: list[Any], scripts: set[Any]) -> list[Any]:
        """``Pipeline._send``."""
        wait: _Wait | None = None
        while True:
            self.command_stack, self.scripts = list(stack), set(scripts)
            try:
                return _done(wait, await super().execute(raise_on_error=False))
            except redis.ResponseError as exc:
                if not is_busy(exc):
                    raise
                wait = wait or _Wait(self, "a pipeline on a new connection")
                await asyncio.sleep(wait.next(exc))
