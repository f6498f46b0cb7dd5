"""The scheduler driver: a thin loop around ``SchedulerState``.

::

    XREADGROUP (clients + workers streams, BLOCK)  ->  decode  ->  batches (bounded)
        ->  per batch: handle_stimulus  ->  instructions  ->  Redis commands + XACK/XDEL
        ->  one EVALSHA of APPLY_FENCED (checks our lease token, renews it; a big write
            goes as several, in one MULTI/EXEC), sent without waiting for its reply, with
            a non-blocking XREADGROUP behind it: the next batch is computed while Redis
            writes this one; with nothing left to compute, the blocking XREADGROUP goes
            behind it instead (``scheduler/pipe.py``; docs/design.md, "Writes in flight")

Delivery semantics: a batch's effects and its acknowledgement land in one atomic script,
so a crash before the write leaves the batch pending for the next scheduler (it re-reads
pending entries first), and a crash after it leaves it applied.  A write refused because
the lease moved on (``FencedError``) stops this scheduler: a standby owns the cluster now.
Any other failed write discards the in-memory state and reloads it from Redis, which is
the source of truth.

This module keeps the loop, the dead-letter path and the watch for dead workers; the
lease (its renewal, a standby's takeover) is ``lease.py``; what the instructions become
in Redis, and how the state is read back, is ``scheduler/translator.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import signal
import socket
import time
import uuid
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

import redis

from redisdask.config import RebalanceConfig, RetentionConfig
from redisdask.errors import EvictingRedisError, FencedError, ProtocolError
from redisdask.scheduler.pipe import WritePipe
from redisdask.scheduler.quarantine import (
    Quarantined,
    cluster_key_repairs,
    dead_letter_command,
    misfits,
)
from redisdask.scheduler.state import CloseClient, RemoveWorker, Restart, SchedulerState, Stimulus
from redisdask.scheduler.stealing import StealTick
from redisdask.scheduler.translator import (
    Summary,
    Translator,
    decode_entry,
    load_state,
    rejected_graphs,
)
from redisdask.store import bootstrap, busy, codecs, keyspace, redis_memory, scripts
from redisdask.store.connection import connect
from redisdask.store.keyspace import Keys
from redisdask.store.lease import LOOK_INTERVAL, HolderWatch, Lease
from redisdask.store.urls import redact
from redisdask.utils.backoff import redis_away
from redisdask.utils.heap import Heap
from redisdask.versions import host_info, versions

logger = logging.getLogger("redisdask.scheduler")

CHECK_INTERVAL = 0.2  # seconds between looks for dead workers (CLIENT LIST, heartbeats)
STEAL_INTERVAL = 0.1  # seconds between balances (Dask's work-stealing-interval)
KEY_LOOK_INTERVAL = 5.0  # seconds between looks at the types of the cluster-wide keys
NANNY_GRACE_LOOKS = 8  # looks without connections before a nanny's worker is dead (~1.5 s)
DRAIN_READS = 100  # reads of waiting entries, at most, before deaths are applied
# Entries of at most this much payload, naming at most so many tasks and keys, are applied
# per write (one entry at least).  A batch's cost grows with the tasks and messages in it
# (20-50 us each, ten times that on a loaded machine); the lease is renewed while a batch
# runs (``Lease.kept``), and small batches let workers' reports through between the
# batches of a big submission.
MAX_BATCH_BYTES = 256 << 10
SLOW_BATCH = 0.2  # a batch longer than this share of the lease is logged, with its parts
MAX_BATCH_WEIGHT = 10_000  # tasks and keys named per batch (see _batches)
MAX_SCRIPT_COMMANDS = 5_000  # commands per APPLY_FENCED script (see Scheduler.apply)
# entries the last read returned, at least, for the scheduler to read ahead: one entry at a
# time (a sequential submit().result(), a chain) has nothing to overlap with, and a read
# ahead would only cost a command, and a wake-up of Redis, per batch
READ_AHEAD_ENTRIES = 2
UNREPLICATED_WARN_EVERY = 10.0  # seconds between warnings of writes no replica acknowledged


class Scheduler:
    def __init__(
        self,
        redis_url: str,
        cluster: str = "default",
        *,
        lease_ttl: float = 5.0,
        batch_size: int = 100,
        validate: bool = False,
        connect_timeout: float = 5.0,
        allowed_failures: int = 3,
        worker_ttl: float = 3.0,
        client_ttl: float = 30.0,
        retention: RetentionConfig | None = None,
        rebalance: RebalanceConfig | None = None,
        wait_replicas: int = 0,
        wait_timeout: float = 1.0,
        work_stealing: bool = True,
    ) -> None:
        self.keys = Keys(cluster)
        self.work_stealing = (
            work_stealing  # scheduler.work-stealing (redisdask/scheduler/stealing.py)
        )
        self.wait_replicas = wait_replicas  # redis.wait-replicas (see wait_for_replicas)
        self.wait_timeout_ms = max(1, int(wait_timeout * 1000))
        self.unreplicated = 0  # writes whose WAIT timed out since the last warning
        self.unreplicated_warned_at = 0.0
        self.retention = retention or RetentionConfig()
        self.redis_url = redis_url
        self.id = f"scheduler-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        name = self.keys.scheduler_connection(self.id)  # what standbys watch
        self.redis = connect(redis_url, timeout=connect_timeout, name=name)
        self.scripts = scripts.Scripts(self.redis, self.keys)
        self.batch_size = batch_size
        self.validate = validate
        self.lease = Lease(self.scripts, lease_ttl, self.id, name)
        self.allowed_failures = allowed_failures
        self.rebalance = rebalance  # worker.memory.rebalance: Client.rebalance's limits
        self.state = SchedulerState(
            validate=validate, allowed_failures=allowed_failures, rebalance=rebalance
        )
        self.worker_ttl = worker_ttl
        self.client_ttl = client_ttl
        self.watch = WorkerWatch(self.keys, worker_ttl)
        self.trust_clients_at = 0.0
        self.looked_at = time.monotonic()  # the last look for the dead
        self._stopping = False
        self._quarantining = False  # writing the repair of malformed records
        self.previous: str | None = None  # the lease holder before us
        self.redis_away: float | None = None  # seconds Redis was away before this lead
        self.redis_problem: str | None = None  # an evicting policy seen (look_at_redis_memory)
        self.redis_full = False
        self.summary = Summary()
        self.translator = Translator(self.keys, self.retention)
        self.heap = Heap()  # keeps full collections off the tasks (see redisdask/utils/heap.py)
        # a batch's write goes without waiting for its reply, a read of the next entries
        # behind it, while the batch read ahead is computed (redisdask/scheduler/pipe.py)
        self.pipe = WritePipe(self.redis, self.keys, batch_size)
        self.in_flight: tuple[list[list[Any]], float] | None = None  # (commands, sent at)
        self.ahead: deque[list[Entry]] = deque()  # batches read, not yet computed
        self.last_read = 0  # entries the last read returned (see READ_AHEAD_ENTRIES)

    # ------------------------------------------------------------------ lease

    @property
    def token(self) -> str | None:
        return self.lease.token

    def acquire_lease(self, standby: bool = True) -> str:
        """Block until this scheduler holds the lease; returns the fencing token.

        Without ``standby``, give up (``FencedError``) if a live scheduler keeps renewing it."""
        announced = False
        # a dead predecessor's lease expires within one TTL; a live one keeps renewing it
        give_up_at = time.monotonic() + 2 * self.lease.ttl_ms / 1000
        watch = HolderWatch(self.redis, self.keys)
        gone = ""  # the token of a holder whose connections closed
        while not self._stopping:
            # ours still (after Redis was away): renewed
            if self.lease.try_acquire(gone) is not None:
                holder = self.redis.hget(self.keys.scheduler, "id")
                self.previous = holder.decode() if holder and holder.decode() != self.id else None
                if gone:
                    logger.warning(
                        "took the lease over from %s (token %s): its Redis connections closed",
                        self.previous,
                        gone,
                    )
                self.redis.hset(
                    self.keys.scheduler,
                    mapping={
                        "id": self.id,
                        "host": socket.gethostname(),
                        "pid": os.getpid(),
                        "since": time.time(),
                        "token": self.token,
                        "versions": codecs.pack(versions()),
                        "host_info": codecs.pack(host_info()),
                    },
                )
                logger.info("scheduler %s holds the lease (token %s)", self.id, self.token)
                return self.token
            if not standby and time.monotonic() > give_up_at:
                holder = self.redis.hget(self.keys.scheduler, "id")
                raise FencedError(
                    f"another scheduler ({holder.decode() if holder else '?'}) holds and renews "
                    f"the lease of cluster {self.keys.cluster!r}; start this one with --standby "
                    "to take over when that one stops"
                )
            gone = watch.gone()
            if not announced:  # (after the first look: the watch has seen the holder)
                holder = self.redis.hget(self.keys.scheduler, "id")
                logger.info(
                    "standing by: the lease is held by %s", holder.decode() if holder else "?"
                )
                announced = True
            if not gone:  # lease expiry and a look at connections are time-based by nature
                time.sleep(self.lease.ttl_ms / 3000 if watch.refused else LOOK_INTERVAL)
        raise FencedError("stopped while waiting for the lease")

    def release_lease(self) -> None:
        """Hand the cluster over at once (a standby need not wait for the lease to expire)."""
        if self.token is None:
            return
        try:
            self.apply([["DEL", self.keys.lease], ["DEL", self.keys.leader]])
            logger.info("scheduler %s released the lease (token %s)", self.id, self.token)
        except (FencedError, redis.RedisError) as exc:
            logger.warning("could not release the lease: %s", exc)
        self.lease.token = None
        self.lease.close()
        self.pipe.close()

    # ------------------------------------------------------------------ main loop

    def run(self, standby: bool = False) -> None:
        """Lead the cluster until stopped.  A lost Redis is waited for (with backoff) and
        then the lease, the state and the pending entries are taken up again."""
        redis_memory.check_policy(redis_memory.read(self.redis), f"scheduler {self.id}")
        while not self._stopping:
            try:
                # again after Redis was away: one that came back empty needs it all anew
                bootstrap.ensure_cluster(self.redis, self.keys)
                self.acquire_lease(standby or self.token is not None)
                self.state = self._load()
                self.heap.settle()
                self.watch = WorkerWatch(self.keys, self.worker_ttl)
                self.trust_clients_at = time.monotonic() + self.client_ttl
                self._event(
                    "scheduler-start", scheduler=self.id, token=self.token, previous=self.previous
                )
                if self.redis_away is not None:
                    self._event("redis-reconnected", process=self.id, away=self.redis_away)
                    self.redis_away = None
                self.summary = Summary.resumed(self.redis, self.keys)
                self._lead()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                self._wait_for_redis(exc)

    def _wait_for_redis(self, exc: Exception) -> None:
        logger.warning(
            "lost Redis at %s (%s); reconnecting with backoff", redact(self.redis_url), exc
        )
        lost_at = time.monotonic()
        backoff = redis_away()
        while not self._stopping:
            time.sleep(backoff.next())  # backoff while Redis is away
            try:
                self.redis.ping()
            except (redis.ConnectionError, redis.TimeoutError):
                continue
            self.redis_away = round(time.monotonic() - lost_at, 3)
            logger.warning(
                "reconnected to Redis after %.1f s; reloading the state from it", self.redis_away
            )
            return

    def _lead(self) -> None:
        pending = True  # first re-read entries a dead predecessor read but never applied
        # idle wake-ups renew the lease, look for dead workers and notice a stop request
        interval = STEAL_INTERVAL if self.work_stealing else CHECK_INTERVAL
        block_ms = max(1, min(self.lease.ttl_ms // 3, int(interval * 1000)))
        next_check = next_balance = 0.0
        next_key_look = time.monotonic() + KEY_LOOK_INTERVAL
        self.ahead.clear()  # (after Redis was away: those entries are pending, re-read)
        while not self._stopping:
            if not self.ahead:
                waited = self.pipe.waiting
                self._collect()  # the write in flight, and the entries read behind it
                if waited and not self.ahead:  # nothing came while that read waited
                    self._idle()
                    continue
            if not self.ahead and time.monotonic() >= next_check:
                next_check = time.monotonic() + CHECK_INTERVAL
                self.look_at_redis_memory()
                self.look_for_the_dead()
                self._collect()
                if time.monotonic() >= next_key_look:
                    next_key_look = time.monotonic() + KEY_LOOK_INTERVAL
                    if misfits(self.redis, self.keys):  # (overwritten under us)
                        self.state = self._load()  # (which rebuilds them first)
                # every entry is acknowledged by the write that applies it, so anything
                # pending now was read by a stale scheduler before it found itself fenced
                # (entries read ahead are computed first: none is held now)
                pending = not self.ahead
            if not self.ahead and time.monotonic() >= next_balance:
                next_balance = time.monotonic() + STEAL_INTERVAL
                self.balance()
            if not self.ahead and not self._read(pending, block_ms):
                pending = False  # (none pending left, or idle)
                continue
            # a read of new entries while this batch runs, or behind its write, while
            # reads bring several entries, unless a look is due (it re-reads the pending
            # entries: none may be held then)
            ahead = (
                not pending
                and time.monotonic() < next_check
                and self.last_read >= READ_AHEAD_ENTRIES
            )
            if ahead and not self.pipe.in_flight:
                self._send(None, read=True)
            ahead = ahead and len(self.ahead) <= 1
            batch = self.ahead.popleft()
            # nothing more to compute and nothing due: the read that waits for the next
            # entries goes behind this batch's write (WritePipe: one packet, one wake-up)
            wait = not (ahead or self.ahead or pending) and time.monotonic() < min(
                next_check, next_balance
            )
            with self.lease.kept():
                self.process(batch, ahead=ahead, wait_ms=block_ms if wait else None)
        self._collect()  # (stopped: the last write lands before the lease is released)

    def _read(self, pending: bool, block_ms: int) -> bool:
        """Read entries (blocking up to ``block_ms`` unless ``pending``) into ``ahead``;
        whether any came.  Idle, renew the lease or write the summary when due."""
        streams = {
            self.keys.worker_stream: "0" if pending else ">",
            self.keys.client_stream: "0" if pending else ">",
        }
        reply = self.redis.xreadgroup(
            keyspace.SCHEDULER_GROUP,
            keyspace.SCHEDULER_CONSUMER,
            streams,
            count=self.batch_size,
            block=None if pending else block_ms,
        )
        self.last_read = sum(len(items) for _, items in reply or [])
        if self.last_read:
            self.ahead.extend(_batches(decode_reply(reply)))
            return True
        if not pending:
            self._idle()
        return False

    def _idle(self) -> None:
        """A read waited and nothing came: renew the lease or write the summary when due."""
        if self.summary.due():
            self.apply([self.summary.command(self.keys, self.state, self.id)])
        elif self.lease.due:
            self.lease.renew()
        else:
            self.heap.settle()  # (a full collection now and then, when idle)

    def _send(
        self, commands: list[list[Any]] | None, read: bool, block_ms: int | None = None
    ) -> None:
        """Send a batch's write (``commands``, fenced) and/or a read of the next entries
        (one that waits up to ``block_ms``, if given) without waiting (``WritePipe``),
        after collecting what was in flight.  A write waited for by replicas, or cut in
        parts, goes synchronously (``apply``)."""
        if commands is not None and (
            self.wait_replicas or len(commands) > MAX_SCRIPT_COMMANDS or self.token is None
        ):
            self.apply(commands)
            commands = None
        self._collect()
        if commands is None and not read:
            return
        write = None
        if commands is not None:
            if not self.pipe.script_loaded:  # (a new connection: maybe a new server too)
                self.scripts.load_apply_fenced()
                self.pipe.script_loaded = True
            write = self.scripts.apply_fenced_command(
                token=self.token, commands=commands, ttl_ms=self.lease.ttl_ms
            )
        try:
            self.pipe.send(write, read, block_ms)
        except redis.ResponseError:  # a new connection's handshake refused: nothing sent
            if commands is not None:
                self.apply(commands)
            return
        self.in_flight = (commands, time.monotonic()) if commands is not None else None

    def _collect(self) -> None:
        """Wait for the write in flight (and the read behind it: its entries go to
        ``ahead``).  A write fenced out stops this scheduler; one refused, or sent for a
        script Redis lost, ran nothing: it goes again through ``apply`` (which waits a
        refusal out), before any later write.  Any other failure reloads the state, which
        was advanced by batches computed meanwhile, and is raised, as ``apply`` does."""
        if not self.pipe.in_flight:
            return
        sent, self.in_flight = self.in_flight, None
        error, reply = self.pipe.collect()
        if self.pipe.read_sent:
            self.last_read = sum(len(items) for _, items in reply or [])
            if self.last_read:
                self.ahead.extend(_batches(decode_reply(reply)))
        if sent is None:
            return
        commands, started = sent
        if error is None:
            self.lease.wrote(started)
            return
        if str(error).startswith("FENCED"):
            self.ahead.clear()
            raise FencedError(f"scheduler {self.id}: {error}") from error
        if busy.refusal(error) or isinstance(error, redis.exceptions.NoScriptError):
            logger.info("a write in flight was not run (%s): writing it again", error)
            self.apply(commands)
            return
        logger.error("applying a batch failed (%s); reloading state from Redis", error)
        self.ahead.clear()
        self.state = self._load()
        raise error

    def look_for_the_dead(self) -> None:
        """Remove the workers and clients that are gone.  A process that leaves says
        goodbye on its stream before its connections and its ``alive`` key go, so the
        entries waiting now are applied first, all of them (a goodbye behind a batch's
        worth of others counts too): one that left is not also recorded dead."""
        self._blind_spell()
        dead = self.watch.check(self.redis, self.state.workers) + self._gone_clients()
        if not dead:
            return
        self._collect()
        with self.lease.kept():
            for _ in range(DRAIN_READS):  # (bounded: writers may go on meanwhile)
                reply = self.redis.xreadgroup(
                    keyspace.SCHEDULER_GROUP,
                    keyspace.SCHEDULER_CONSUMER,
                    {self.keys.worker_stream: ">", self.keys.client_stream: ">"},
                    count=self.batch_size,
                )
                if not any(items for _, items in reply or []):
                    break
                for batch in _batches(decode_reply(reply)):
                    self.process(batch)
            self.process([], self._still_gone(dead))

    def balance(self) -> None:
        """Ask busy workers to hand claims they have not started to idle ones
        (``redisdask.scheduler.stealing``); writes nothing when there is nothing to move."""
        if self.work_stealing and self.state.workers:
            now = time.monotonic()
            self.process([], [StealTick(now=now, stimulus_id=f"steal-{time.time():.3f}")])

    def look_at_redis_memory(self) -> None:
        """Report, once per change, a ``maxmemory-policy`` changed at run time to one that
        evicts (an ERROR, and a ``redis-evicting`` event that ``status`` shows), and a
        Redis that became full (``redis-full``) or has room again."""
        memory = redis_memory.read(self.redis)
        if memory is None:
            return
        problem = memory.policy_problem()
        if problem != self.redis_problem:
            self.redis_problem = problem
            if problem:
                logger.error("%s", problem)
                self._event("redis-evicting", policy=memory.policy, message=problem)
        if memory.full != self.redis_full:
            self.redis_full = memory.full
            if memory.full:
                logger.warning("%s", redis_memory.full_text(memory))
            self._event(
                "redis-full" if memory.full else "redis-has-room",
                used_memory=memory.used,
                maxmemory=memory.maxmemory,
            )

    def _blind_spell(self) -> None:
        """A heartbeat that lapsed while this scheduler could not look says nothing: what
        kept it from looking (Redis busy running a script, a long batch, a stalled
        machine) may have kept the heartbeats from being written too.  After a gap of
        half a TTL, each kind of heartbeat is trusted again one TTL later."""
        now = time.monotonic()
        gap, self.looked_at = now - self.looked_at, now
        self.watch.lapsed(gap, now)
        if gap > self.client_ttl / 2:
            self.trust_clients_at = max(self.trust_clients_at, now + self.client_ttl)

    def _gone_clients(self) -> list[Stimulus]:
        """Clients whose heartbeat key expired: their keys are released as if they had
        closed (a crashed notebook must not pin results in the cluster forever)."""
        if time.monotonic() < self.trust_clients_at or not self.state.clients:
            return []
        clients = [c for c in self.state.clients if not keyspace.is_holder(c)]  # never expire
        if not clients:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for client in clients:
            pipe.exists(self.keys.client_alive(client))
        alive = pipe.execute()
        self._blind_spell()  # (this look may have waited out a busy Redis: stale, then)
        if time.monotonic() < self.trust_clients_at:
            return []
        gone = [c for c, is_alive in zip(clients, alive, strict=True) if not is_alive]
        return [CloseClient(client=client, stimulus_id=f"client-ttl-{client}") for client in gone]

    def _still_gone(self, dead: list[Stimulus]) -> list[Stimulus]:
        """The deaths still to record once the waiting entries are applied: a worker or a
        client whose ``alive`` key went with its goodbye closed, it did not die (the
        goodbye was waiting on its stream when the watch looked), and is not logged as
        dead; the goodbye has done what the death would."""
        out: list[Stimulus] = []
        for event in dead:
            if isinstance(event, RemoveWorker):
                if event.worker not in self.state.workers:  # its goodbye was waiting
                    logger.info("worker %s left: it said goodbye", event.worker)
                    continue
                logger.warning("worker %s is dead (%s): %s", event.worker, event.how, event.reason)
            if isinstance(event, CloseClient):
                if event.client not in self.state.clients:
                    logger.info("client %s closed: it said goodbye", event.client)
                    continue
                logger.warning(
                    "client %s stopped heartbeating for %g s: releasing its keys",
                    event.client, self.client_ttl,
                )  # fmt: skip
            out.append(event)
        return out

    def _load(self) -> SchedulerState:
        self._collect()  # (what was in flight landed, or failed: it is in Redis or not)
        quarantined: list[Quarantined] = []
        with self.lease.kept():
            if not self._quarantining:
                self._repair_cluster_keys()
            state = load_state(
                self.redis, self.keys, self.validate, self.allowed_failures, self.rebalance,
                quarantined=None if self._quarantining else quarantined,
            )  # fmt: skip
            if quarantined:
                state = self._quarantine(state, quarantined)
        self.heap.settle()
        return state

    def _repair_cluster_keys(self) -> None:
        """Rebuild the cluster-wide keys of the wrong type before the load reads them
        (``quarantine.cluster_key_repairs``), in one fenced write.  One that fails is
        logged, and the load meets those keys as they are."""
        # (a running scheduler knows its workers' info, which an empty entry would lose)
        known = {address: ws.info for address, ws in self.state.workers.items()}
        commands = cluster_key_repairs(self.redis, self.keys, known)
        if not commands:
            return
        self._quarantining = True  # (a failed write reloads: without repairing again)
        try:
            self.apply(commands)
        except redis.ResponseError as exc:
            logger.error("could not rebuild the cluster's keys: %s", exc)
        finally:
            self._quarantining = False

    def _quarantine(self, state: SchedulerState, quarantined: list[Quarantined]) -> SchedulerState:
        """Dead-letter and repair the malformed records ``load_state`` skipped and err
        their tasks, in one fenced write (``redisdask/scheduler/quarantine.py``); the state to go on
        with.  A write that fails leaves them to the next reload, which skips them again
        (never a loop), and the state is the one ``apply`` reloaded, in which nothing
        erred that Redis and the clients do not know of."""
        commands = [c for q in quarantined for c in q.commands(self.keys)]
        events: list[Stimulus] = [e for q in quarantined for e in q.events()]
        if events:
            instructions = state.handle_stimulus(*events)
            commands += self.translator.to_commands(instructions)
            commands += self.translator.story(events, instructions)
        commands.append(["HSET", self.keys.meta, "seq", state.seq])
        self._quarantining = True  # (a failed write reloads: without quarantining again)
        try:
            self.apply(commands)
        except redis.ResponseError as exc:
            logger.error(
                "could not quarantine %d malformed records (%s): they stay, and are skipped "
                "again at the next reload", len(quarantined), exc,
            )  # fmt: skip
            return self.state
        finally:
            self._quarantining = False
        return state

    def stop(self) -> None:
        self._stopping = True

    def process(
        self,
        entries: list[Entry],
        events: list[Stimulus] = (),
        *,
        ahead: bool | None = None,
        wait_ms: int | None = None,
    ) -> None:
        """Apply one batch of decoded stream entries: transition, write atomically.  The
        lead loop passes ``ahead``: the write is then left in flight, with a read of the
        next entries behind it if ``ahead`` is true, or one that waits up to ``wait_ms``
        for them if that is given (see ``_send``); without either, the write has landed
        when this returns.

        If the state machine raises on a batch (a bug, or a message that passed validation
        but makes no sense), the state is reloaded from Redis and the entries are retried
        one by one; the entry that still fails is dead-lettered, so one bad message can
        never stop the cluster or crash every scheduler that reads it after a restart."""
        try:
            with self.lease.kept():
                self._process(entries, list(events), bool(ahead), wait_ms)
                if ahead is None:
                    self._collect()
            self.heap.settle()
        except (FencedError, redis.RedisError):
            raise
        except Exception as exc:
            logger.exception("the state machine failed on a batch of %d entries", len(entries))
            self.state = self._load()
            if events:  # our own events: a bug to fix, but never a reason to stop
                logger.error("dropped %d events of the scheduler itself", len(events))
                self.process(entries)
                return
            if len(entries) > 1:
                for one in entries:
                    self.process([one])
                return
            one = dataclasses.replace(entries[0], error=f"state machine failed: {exc!r}")
            try:  # dead-lettered as a malformed entry is: its client is told (no hang)
                with self.lease.kept():
                    self._process([one], [])
                return
            except (FencedError, redis.RedisError):
                raise
            except Exception:
                logger.exception("telling the client of a dead-lettered entry failed too")
                self.state = self._load()
            self.apply(
                [
                    self._dead_letter(one.stream, one.id, one.fields, one.error or ""),
                    ["XACK", one.stream, keyspace.SCHEDULER_GROUP, one.id],
                    ["XDEL", one.stream, one.id],
                ]
            )

    def _process(
        self,
        entries: list[Entry],
        events: list[Stimulus],
        ahead: bool = False,
        wait_ms: int | None = None,
    ) -> None:
        commands: list[list[Any]] = []
        acks: dict[str, list[bytes]] = defaultdict(list)
        received: list[Stimulus] = []
        for e in entries:
            acks[e.stream].append(e.id)
            if e.error is None:
                received.extend(e.events)
                continue
            commands.append(self._dead_letter(e.stream, e.id, e.fields, e.error))
            if e.stream == self.keys.client_stream:  # its client must not wait forever
                received.extend(rejected_graphs(e.id, e.fields, e.error, "clients"))
        events = received + events  # what the processes said, then the scheduler's verdicts
        self._tell_restart_to_all(events)
        times = [time.monotonic()]
        instructions = self.state.handle_stimulus(*events)
        if not (entries or instructions):
            return  # (the scheduler's own prompt that changed nothing: nothing to write)
        times.append(time.monotonic())
        commands = self.translator.to_commands(instructions) + commands
        commands += self.translator.story(events, instructions)
        self.summary.count(self.state, changed=bool(instructions))
        if self.summary.due():
            commands.append(self.summary.command(self.keys, self.state, self.id))
        for stream, ids in acks.items():
            commands.append(["XACK", stream, keyspace.SCHEDULER_GROUP, *ids])
            commands.append(["XDEL", stream, *ids])
        commands.append(["HSET", self.keys.meta, "seq", self.state.seq])
        times.append(time.monotonic())
        self._send(commands, read=ahead or wait_ms is not None, block_ms=wait_ms)
        times.append(time.monotonic())
        if times[-1] - times[0] > SLOW_BATCH * self.lease.ttl_ms / 1000:
            logger.warning(
                "a batch of %d entries (%d events, %d instructions, %d commands) took "
                "%.2f s: state machine %.2f s, translation %.2f s, the write before it and "
                "sending its own %.2f s; the lease "
                "is %.1f s",
                len(entries), len(events), len(instructions), len(commands),
                times[-1] - times[0], times[1] - times[0], times[2] - times[1],
                times[3] - times[2], self.lease.ttl_ms / 1000,
            )  # fmt: skip

    def _tell_restart_to_all(self, events: list[Stimulus]) -> None:
        """Give each ``Restart`` the clients connected now: the state knows a client
        from its first graph, but every connected client hears of a restart (as in
        distributed), the one that asked among them."""
        restarts = [e for e in events if isinstance(e, Restart)]
        if restarts:
            self._collect()  # (a client registered by the write in flight is connected)
            connected = [c.decode(errors="replace") for c in self.redis.hkeys(self.keys.clients)]
            for event in restarts:
                event.connected = connected

    def _dead_letter(
        self, stream: str, entry_id: bytes, fields: dict[bytes, bytes], error: str
    ) -> list[Any]:
        logger.warning("dead-lettered entry %s of %s: %s", entry_id.decode(), stream, error)
        return dead_letter_command(self.keys, stream, entry_id, fields, error)

    def apply(self, commands: list[list[Any]]) -> None:
        """Write ``commands`` atomically, fenced by our token.  A big write goes as
        several scripts of at most ``MAX_SCRIPT_COMMANDS`` commands in one MULTI/EXEC
        (see ``scripts.APPLY_FENCED``): no script runs long enough for Redis to answer
        the other processes BUSY, and the write stays all-or-nothing for them.  Every
        part opens with a write that a full Redis allows, so batches get through one
        (see ``_refused``); other refusals are waited out by the connection.  The write
        in flight, if any, lands first."""
        self._collect()
        started = time.monotonic()
        parts = [commands[i : i + MAX_SCRIPT_COMMANDS]
                 for i in range(0, len(commands), MAX_SCRIPT_COMMANDS)] or [[]]  # fmt: skip
        fenced = functools.partial(
            self.scripts.apply_fenced, token=self.token, ttl_ms=self.lease.ttl_ms
        )
        try:
            if len(parts) == 1:
                fenced(commands=commands)
            else:
                pipe = self.redis.pipeline(transaction=True)
                for i, part in enumerate(parts, 1):
                    fenced(commands=part, part=(i, len(parts)), client=pipe)
                try:
                    with busy.raised():
                        replies = pipe.execute(raise_on_error=False)
                except redis.ResponseError as exc:  # EXECABORT: nothing was applied
                    if not busy.refusal(exc):
                        raise
                    replies = [exc] * len(parts)
                # the first part's error says why; the later parts only that they followed
                errors = [(i, r) for i, r in enumerate(replies) if isinstance(r, Exception)]
                if errors:
                    self._refused(parts, *errors[0])
        except redis.ResponseError as exc:
            if str(exc).startswith("FENCED"):
                raise FencedError(f"scheduler {self.id}: {exc}") from exc
            logger.exception("applying a batch failed; reloading state from Redis")
            self.state = self._load()
            raise
        self.lease.wrote(started)
        if self.wait_replicas:
            self.wait_for_replicas()

    def _refused(self, parts: list[list[list[Any]]], first: int, exc: Exception) -> None:
        """Part ``first`` (from 0) of a write cut in ``parts`` failed with ``exc`` in its
        MULTI/EXEC; the parts before it were applied (``applying`` holds their count).
        A refusal (a full Redis refuses every command queued in a MULTI; MISCONF,
        READONLY) wrote nothing of that part: the rest of the write goes again as one
        script, which opens the way through a full Redis and which the connection sends
        again until Redis takes it.  It is longer than a part, for once, rather than never
        applied.  Any other error is raised."""
        if not busy.refusal(exc):
            raise exc
        logger.warning(
            "Redis refused parts %d..%d of a write in %d parts (%s); writing them again "
            "as one script", first + 1, len(parts), len(parts), exc,
        )  # fmt: skip
        rest = [command for part in parts[first:] for command in part]
        self.scripts.apply_fenced(
            token=self.token, ttl_ms=self.lease.ttl_ms, commands=rest, part=(first + 1,) * 2
        )

    def wait_for_replicas(self) -> None:
        """``WAIT redis.wait-replicas redis.wait-timeout`` after a write: a write that
        replicas hold survives a failover to one of them.  A WAIT that times out is
        counted and logged (at most every ``UNREPLICATED_WARN_EVERY`` s), and the
        scheduler goes on: the write is done on the primary and cannot be taken back,
        and stopping every batch while a replica is away would turn the loss of a
        replica into the loss of the cluster.  Each batch then waits up to the timeout."""
        try:
            acked = self.redis.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
        except redis.ResponseError as exc:  # e.g. an ACL user without +wait: unreplicated
            acked = f"none: {exc}"
        else:
            if acked >= self.wait_replicas:
                return
        self.unreplicated += 1
        now = time.monotonic()
        if now - self.unreplicated_warned_at >= UNREPLICATED_WARN_EVERY:
            logger.warning(
                "%d scheduler writes were not acknowledged by %d replicas within %d ms "
                "(redis.wait-replicas, redis.wait-timeout; the last by %s): a failover now "
                "may lose them, and their tasks are then computed again",
                self.unreplicated,
                self.wait_replicas,
                self.wait_timeout_ms,
                acked,
            )
            self.unreplicated, self.unreplicated_warned_at = 0, now

    def _event(self, kind: str, **fields: Any) -> None:
        # fenced, through a full Redis (an XADD alone would wait for room)
        self.apply([self.translator.event_command(kind, time.time(), **fields)])


class WorkerWatch:
    """Notices dead workers, from whichever sign comes first.

    * **Connections**: a killed process's sockets close at once, so its named connections
      (``Keys.worker_connection``) vanish from ``CLIENT LIST``.  Absent in two looks in a
      row counts as dead (``NANNY_GRACE_LOOKS`` for a worker with a nanny, whose report
      with the reason comes first), unless Redis restarted since the worker was last seen
      (its ``run_id`` changed): then everybody's connections were cut and reconnect.
    * **Heartbeat**: the worker's ``alive`` key (PX ``worker-ttl``) expired: the silent
      cases (a hung process, a partition).
    A worker's own goodbye and a nanny's report arrive as messages instead.
    """

    def __init__(self, keys: Keys, worker_ttl: float = 3.0) -> None:
        self.keys = keys
        self.worker_ttl = worker_ttl
        # just (re)started, or back after Redis was away: heartbeats that lapsed meanwhile
        # say nothing yet; every live worker renews its own within one TTL
        self.trust_heartbeats_at = time.monotonic() + worker_ttl
        self.missing: dict[str, int] = {}  # worker -> consecutive looks without connections
        self.seen_on: dict[str, str] = {}  # worker -> Redis run_id when last seen connected
        self.run_id = ""  # of the Redis server at the previous look
        self.warned = False

    def lapsed(self, gap: float, now: float) -> None:
        """Nobody could look, or a look's reads waited, for ``gap`` seconds until ``now``:
        after half a TTL the heartbeats that lapsed meanwhile say nothing until every
        live worker had a TTL to renew its own (``Scheduler._blind_spell``)."""
        if gap > self.worker_ttl / 2:
            self.trust_heartbeats_at = max(self.trust_heartbeats_at, now + self.worker_ttl)

    def check(self, r: redis.Redis, workers: dict[str, Any]) -> list[Stimulus]:
        if not workers:
            return []
        addresses = list(workers)
        pipe = r.pipeline(transaction=False)
        pipe.client_list(_type="normal")
        pipe.info("server")
        for address in addresses:
            pipe.exists(self.keys.worker_alive(address))
        asked = time.monotonic()
        connections, server, *alive = pipe.execute(raise_on_error=False)
        now = time.monotonic()
        # (these reads may have waited, for Redis busy running a script, and so did the
        # workers' heartbeats: a blind spell too)
        self.lapsed(now - asked, now)
        if isinstance(connections, Exception):  # e.g. an ACL without CLIENT: heartbeats only
            if not self.warned:
                logger.warning(
                    "CLIENT LIST refused (%s): dead workers are noticed by their "
                    "heartbeats only (scheduler.worker-ttl)",
                    connections,
                )
                self.warned = True
            connections = []
            self.seen_on.clear()
        if isinstance(server, Exception):
            server = {}
        names = {c.get("name", "") for c in connections}
        run_id = server.get("run_id", "")
        dead: dict[str, tuple[str, str]] = {}
        for address, is_alive in zip(addresses, alive, strict=True):
            if address not in self.seen_on and self.run_id:
                # new since the last look: it registered through a connection of the
                # server we looked at then (a restart in between makes the ids differ)
                self.seen_on[address] = self.run_id
            if self.keys.worker_connection(address) in names:
                self.missing.pop(address, None)
                self.seen_on[address] = run_id
            elif self.seen_on.get(address) == run_id:
                self.missing[address] = self.missing.get(address, 0) + 1
                # a nanny reports its worker's death at once, with the reason: give it
                # the time to, before saying less from the connections alone
                nanny = (getattr(workers[address], "info", None) or {}).get("nanny")
                if self.missing[address] >= (NANNY_GRACE_LOOKS if nanny else 2):
                    dead[address] = (
                        "connection",
                        "its Redis connections closed (the process exited or was killed)",
                    )
            if (
                not is_alive
                and address not in dead
                and time.monotonic() >= self.trust_heartbeats_at
            ):
                dead[address] = (
                    "heartbeat",
                    "no heartbeat within scheduler.worker-ttl (hung, "
                    "partitioned, or killed while Redis was away)",
                )
        self.run_id = run_id
        return self._removals(r, dead) if dead else []

    def _removals(self, r: redis.Redis, dead: dict[str, tuple[str, str]]) -> list[Stimulus]:
        """A ``RemoveWorker`` for each dead worker (address -> how, why), with its last
        heartbeat as the evidence."""
        pipe = r.pipeline(transaction=False)
        for address in dead:
            pipe.hget(self.keys.heartbeats, address)
        beats = pipe.execute()
        events: list[Stimulus] = []
        for (address, (how, reason)), beat in zip(dead.items(), beats, strict=True):
            self.missing.pop(address, None)
            self.seen_on.pop(address, None)
            last = codecs.unpack_or(beat, {}, dict)  # (a stranger's: no evidence, no crash)
            beat_time = last.get("time")
            age = (
                f"; last heartbeat {time.time() - beat_time:.1f} s ago"
                if isinstance(beat_time, int | float) and not isinstance(beat_time, bool)
                else ""
            )
            events.append(
                RemoveWorker(
                    worker=address,
                    reason=reason + age,
                    how=how,
                    evidence={"last_heartbeat": last},
                    stimulus_id=f"watch-{how}-{time.time():.6f}",
                )
            )
        return events


@dataclass(slots=True)
class Entry:
    """One entry of an input stream, decoded: its events, or why it cannot be."""

    stream: str
    id: bytes
    fields: dict[bytes, bytes]
    events: list[Stimulus]
    error: str | None  # the ProtocolError: the entry is dead-lettered
    size: int  # payload bytes
    weight: int  # what its events carry: tasks, keys (see _weight)


def decode_reply(reply: Any) -> list[Entry]:
    """The entries of an XREADGROUP reply, decoded."""
    out = []
    for name, items in reply:
        stream = name.decode()
        for entry_id, fields in items:
            size = sum(len(k) + len(v) for k, v in fields.items())
            try:
                events = decode_entry(entry_id, fields, stream.rsplit(":", 1)[-1])
            except ProtocolError as exc:
                out.append(Entry(stream, entry_id, fields, [], str(exc), size, 1))
                continue
            weight = sum(map(_weight, events))
            out.append(Entry(stream, entry_id, fields, events, None, size, weight))
    return out


def _weight(event: Stimulus) -> int:
    """What an event asks of a batch, roughly: one, plus one per task, key or worker that
    it names (the lengths of its list and map fields)."""
    sized = _SIZED.get(type(event))
    if sized is None:
        sized = _SIZED[type(event)] = tuple(
            f.name for f in dataclasses.fields(event) if re.search(r"\b(list|dict)\b", str(f.type))
        )
    return 1 + sum(len(getattr(event, name) or ()) for name in sized)


_SIZED: dict[type, tuple[str, ...]] = {}  # event class -> its list and map fields


def _batches(entries: list[Entry]) -> list[list[Entry]]:
    """Split a read into batches of at most ``MAX_BATCH_BYTES`` payload bytes and
    ``MAX_BATCH_WEIGHT`` (one entry at least), so that each batch's work and write stay
    short: a client's entries of 5,000 tasks each go one or two per batch."""
    batches: list[list[Entry]] = [[]]
    size = weight = 0
    for e in entries:
        full = size + e.size > MAX_BATCH_BYTES or weight + e.weight > MAX_BATCH_WEIGHT
        if batches[-1] and full:
            batches.append([])
            size = weight = 0
        batches[-1].append(e)
        size += e.size
        weight += e.weight
    return batches


def main(redis_url: str, cluster: str, *, standby: bool = False, **options: Any) -> None:
    scheduler = Scheduler(redis_url, cluster, **options)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: scheduler.stop())
    try:
        scheduler.run(standby=standby)
    except EvictingRedisError as exc:
        logger.error("%s", exc)
        raise SystemExit(1) from exc
    except FencedError as exc:
        if scheduler._stopping:  # a standby asked to stop before it ever led
            return
        logger.error("stopping: %s", exc)
        raise SystemExit(1) from exc
    scheduler.release_lease()
