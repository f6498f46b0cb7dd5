"""Redis busy running a script: wait it out, never fail on it.

While a Lua script (or a function, or a module's command) runs past Redis's
``busy-reply-threshold`` (``lua-time-limit``; 5 s by default), Redis answers every other
command with ``BUSY Redis is busy running a script...`` until it ends.  A refused command
was **not executed**, so sending it again later is always safe; every redisdask process
(scheduler, workers, nannies, clients) does, with backoff, however long the script runs
(``SCRIPT KILL`` ends a runaway one), logging what it waits for.

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

``connect`` and ``connect_async`` (``redisdask/connection.py``) return these classes.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.client
import redis.client

from redisdask.backoff import Backoff

logger = logging.getLogger("redisdask.redis")

WARN_EVERY = 10.0  # seconds between the log lines of one long wait
# "BUSY Redis is busy running a script..." (Valkey names itself), first in a command's
# error, after "caused error: " (or "caused error: ('") in a pipeline's, after
# "discarded because of: " in a transaction's
_BUSY = re.compile(r"(?:^|[\s('\"])BUSY \w+ is busy")


def is_busy(exc: object) -> bool:
    """Whether ``exc`` (an exception or a pipeline's reply) is Redis's BUSY refusal, as a
    command's error, a pipeline's annotated one or a discarded transaction's."""
    if not isinstance(exc, redis.ResponseError):
        return False
    return _BUSY.search(str(exc.args[0]) if exc.args else "") is not None


class _Wait:
    """The backoff and the log lines of one wait for a busy Redis."""

    def __init__(self, client: Any, what: Any) -> None:
        self.client, self.what = client, what
        self.backoff = Backoff(base=0.02, cap=0.5)
        self.started = time.monotonic()
        self.warned_at = 0.0

    def next(self, exc: BaseException) -> float:
        now = time.monotonic()
        if now - self.warned_at >= WARN_EVERY:
            self.warned_at = now
            kwargs = self.client.connection_pool.connection_kwargs
            logger.warning(
                "Redis at %s:%s is busy running a script (%s); waiting to send %s again "
                "(for %.1f s now; SCRIPT KILL stops a script that never ends)",
                kwargs.get("host", "?"),
                kwargs.get("port", "?"),
                str(exc).rpartition("BUSY ")[2][:80],
                self.what,
                now - self.started,
            )
        return self.backoff.next()


class Redis(redis.Redis):
    """A redis-py client that waits out BUSY (see the module's docstring)."""

    def execute_command(self, *args: Any, **options: Any) -> Any:
        wait: _Wait | None = None
        while True:
            try:
                return super().execute_command(*args, **options)
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
                return super().immediate_execute_command(*args, **options)
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
                return super().execute(raise_on_error)
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
                return super().execute(raise_on_error=False)
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
                return await super().execute_command(*args, **options)
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
                return await super().immediate_execute_command(*args, **options)
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
                return await super().execute(raise_on_error)
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
        if raise_on_error:
            self.raise_first_error(stack, replies)
        return replies

    async def _send(self, stack: list[Any], scripts: set[Any]) -> list[Any]:
        """``Pipeline._send``."""
        wait: _Wait | None = None
        while True:
            self.command_stack, self.scripts = list(stack), set(scripts)
            try:
                return await super().execute(raise_on_error=False)
            except redis.ResponseError as exc:
                if not is_busy(exc):
                    raise
                wait = wait or _Wait(self, "a pipeline on a new connection")
                await asyncio.sleep(wait.next(exc))
