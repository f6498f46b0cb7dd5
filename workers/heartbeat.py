"""The worker's heartbeat: what it writes to Redis every ``heartbeat-interval``.

One script per beat (``scripts.through``: it gets through a full Redis, for a heartbeat
that lapsed would have the worker declared dead) renews ``alive`` (PX
``scheduler.worker-ttl``), writes the metrics to ``heartbeats`` (the last ones are the
evidence a death record cites), trims the inbox up to what was read, and writes what
gathered since the last beat: the cluster events of ``log_event`` and of failed spills,
and the worker's story (its state machine's transitions and the driver's own notes:
pauses, spills).  Its reply carries Redis's ``INFO memory``, which decides whether small
results may go on being inlined into their task records (``TaskRunner``).

A beat that finds the worker's registration gone from the server it registered with means
the scheduler removed it (declared dead: stopped or cut off); a new server (Redis
restarted or failed over) may have lost it, and the worker registers again there.  A
worker whose nanny died closes.  ``LoopWatch`` (``liveness.py``) keeps ``alive`` renewed
while the event loop is stalled, on a connection of its own.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import psutil
import redis

from redisdask.store import codecs, keyspace, scripts
from redisdask.store.connection import connect
from redisdask.utils.threads import in_thread
from redisdask.workers.inbox import parse_id
from redisdask.workers.liveness import LoopWatch

if TYPE_CHECKING:
    from redisdask.workers.worker import Worker

logger = logging.getLogger("redisdask.worker")

HEARTBEAT_KEYS = 20  # executing task keys named in a heartbeat, at most


class Heartbeat:
    """Held by the worker as ``worker.heartbeat``: ``loop`` and ``watch.tick`` run among
    the worker's loops; ``landed`` is set after each beat (a holding report is due)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.events: list[list[Any]] = []  # cluster events for the next beat to write
        self.notes: list[list[Any]] = []  # the driver's own story lines: pauses, spills
        self.story_sent = 0  # state.story_total when the story was last written
        self.run_id: str | None = None  # the Redis server's it registered with
        self.landed = asyncio.Event()
        self.watch = LoopWatch(
            worker.name or "",
            self.renew_alive,
            interval=worker.heartbeat_interval,
            warn_after=worker.worker_ttl,
            hang_timeout=worker.hang_timeout,
        )
        self._watch_redis: redis.Redis | None = None  # (the LoopWatch thread's)
        self._process = psutil.Process()

    async def stop(self) -> None:
        """Before the worker's goodbye: a renewal after it would undo it."""
        await in_thread(self.watch.stop)  # (not the default executor: closed at exit)
        if self._watch_redis is not None:
            self._watch_redis.close()

    async def loop(self) -> None:
        w = self.worker
        while w.status == "running":
            if w.nanny_pid is not None and os.getppid() != w.nanny_pid:
                logger.error("the nanny of worker %s died; closing", w.address)
                w.close_soon("its nanny died")
                return
            events, self.events = self.events, []
            try:
                registered, memory = await self._beat(events)
            except BaseException:
                self.events[:0] = events  # not written: the next beat tries again
                raise
            w.runner.note_redis_memory(memory)
            if not registered and await self.removed():
                w.leave_removed(None)
                return
            self.landed.set()
            await asyncio.sleep(w.heartbeat_interval)  # a heartbeat is a timer by nature

    async def _beat(self, events: list[list[Any]]) -> tuple[bool, Any]:
        """One beat: whether the worker is still registered, and Redis's INFO memory."""
        w = self.worker
        ttl = int(w.worker_ttl * 1000)
        alive = w.keys.worker_alive(w.address)
        # what the inbox listener read is trimmed here, off the task path: everything up
        # to and including the last entry read (MINID keeps the entry it names, which
        # kept a free-keys of 10,000 keys in Redis until the next message)
        ms, seq = parse_id(w.inbox_id)
        commands: list[list[Any]] = [
            ["SET", alive, 1, "PX", ttl],
            ["HSET", w.keys.heartbeats, w.address, codecs.pack(self.metrics())],
            ["XTRIM", w.keys.worker_inbox(w.address), "MINID", f"{ms}-{seq + 1}"],
            *events,
        ]
        for chunk in self._new_story():  # (bounded: story_maxlen)
            commands.append(["XADD", w.keys.worker_story(w.address), "MAXLEN",
                             w.story_maxlen, "*", "m", codecs.pack(chunk)])  # fmt: skip
        pipe = w.redis.pipeline(transaction=False)
        pipe.hexists(w.keys.workers, w.address)
        await w.scripts.through(key=alive, ttl_ms=ttl, commands=commands, client=pipe)
        pipe.info("memory")
        registered, beat, memory = await pipe.execute(raise_on_error=False)
        if isinstance(beat, Exception):  # (INFO may be refused: an ACL)
            raise beat
        return registered, memory

    def renew_alive(self) -> None:
        """(``LoopWatch``'s thread, while the loop is stalled) ``alive`` renewed, through
        a full Redis, on a connection of the thread's own."""
        w = self.worker
        if self._watch_redis is None:
            name = w.keys.worker_connection(w.address)
            self._watch_redis = connect(
                w.redis_url, timeout=w.connect_timeout, name=name, check=False
            )
        alive = w.keys.worker_alive(w.address)
        scripts.Scripts(self._watch_redis, w.keys).through(
            key=alive, ttl_ms=int(w.worker_ttl * 1000), commands=[]
        )

    async def removed(self) -> bool:
        """Whether the scheduler removed this worker: its entry is gone from the Redis
        server it registered with (a new server, restarted or failed over, may have lost
        it: the worker registers again there, with what it holds)."""
        w = self.worker
        pipe = w.redis.pipeline(transaction=False)
        pipe.hexists(w.keys.workers, w.address)
        pipe.info("server")
        registered, info = await pipe.execute()
        run_id, self.run_id = self.run_id, info.get("run_id")
        return not registered and run_id == self.run_id

    def note(self, kind: str, detail: str) -> None:
        """A line of this worker's story that no task transition tells (pause, spill)."""
        self.notes.append([time.time(), "", kind, detail, ""])

    def _new_story(self) -> list[list[list[Any]]]:
        """What happened since the last beat, for ``rd:{c}:worker:<addr>:story``: rows
        ``[time, key, start, finish, stimulus_id]`` (notes have no key), in chunks."""
        state = self.worker.state
        rows = [
            [t or 0.0, key, start, finish, sid]
            for key, start, finish, sid, t in state.story_since(self.story_sent)
        ]
        self.story_sent = state.story_total
        rows += self.notes
        self.notes = []
        rows.sort(key=lambda row: row[0])
        step = keyspace.STORY_CHUNK
        return [rows[i : i + step] for i in range(0, len(rows), step)]

    def metrics(self) -> dict[str, Any]:
        """What a beat carries; the last one is the evidence of a death record."""
        w = self.worker
        state = w.state
        by_state = state.by_state
        running = itertools.chain(state.executing, state.long_running)
        return {
            "time": time.time(),
            "executing": [ts.key for ts in itertools.islice(running, HEARTBEAT_KEYS)],
            "n_executing": len(state.executing),
            "n_long_running": len(state.long_running),
            "ready": len(by_state.get("ready", ())),
            "in_memory": len(by_state.get("memory", ())),
            "cpu": self._process.cpu_percent(),  # since the previous beat
            **w.memory.metrics(),
            **w.peers.transfers.metrics(),
            "status": ("retiring" if state.retiring else "paused" if state.paused else w.status),
        }
