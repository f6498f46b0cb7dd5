"""The worker process: a thin asyncio driver around the pure ``WorkerState``.

What it does, and the Redis or TCP call behind each:

* registers itself (``workers`` hash, ``alive`` key, an ``add-worker`` message) and
  heartbeats every ``heartbeat-interval`` (``heartbeat.py``: ``alive`` with a TTL,
  metrics in ``heartbeats``);
* **pulls** work: when ``WorkerState.claim_budget()`` says it has room it runs the CLAIM
  script, which pops ready tasks, records them as processing on this worker and tells the
  scheduler, atomically.  When the ready set is empty it waits on the ``ready-signal``
  stream (XREAD BLOCK, no polling); the claim script returns that stream's last id, so a
  signal written after an empty claim always wakes us (no lost wake-ups).  Tasks with
  resources are claimed only within what this worker has free; a claim that left some
  for lack of resources is tried again once a run gives resources back.  A task pushed to
  it (a root task while it had a free thread) comes in its inbox instead;
* runs tasks in a pool of threads (``runner.py``) and keeps results in
  ``WorkerState.data``; a task that secedes (``redisdask.secede``, ``worker_client``)
  keeps its thread but frees its slot; its tasks reach the cluster through the worker's
  own client (``task_client``, made on first use, closed with the worker);
* fetches dependencies from peers and serves its own data over authenticated TCP
  (``peers.py``); results never pass through Redis, except small ones, in their records;
* reports completions, errors and missing data in batches on the workers stream: a report
  goes out at once when no write is in flight, otherwise with the next write.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import tempfile
import threading
import time
import typing
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any, Literal

import redis

from redisdask import comm, context, nanny_contract
from redisdask.errors import ProtocolError
from redisdask.nanny_contract import GRACEFUL_TIMEOUT
from redisdask.placement import format_resources, parse_resources, split_resources
from redisdask.protocol import (
    AddWorker,
    CloseWorker,
    Holding,
    Message,
    RemoveWorker,
    RestartWorker,
    RetireAborted,
    RetireWorker,
    RetireWorkers,
)
from redisdask.security import Security
from redisdask.store import bootstrap, codecs, keyspace, redis_memory, scripts, topics
from redisdask.store.connection import connect, connect_async
from redisdask.store.eventlog import event_command
from redisdask.store.keyspace import Keys
from redisdask.store.scripts import CLAIM_BLOCKED, CLAIM_FULL, CLAIM_PASSED, PLACED_PATIENCE_MS
from redisdask.store.task_record import split_words
from redisdask.utils.backoff import redis_away
from redisdask.utils.threads import in_thread
from redisdask.versions import VersionMismatchError, pickle_breaking, versions
from redisdask.workers.events import (
    ClaimsHandledEvent,
    ComputeTaskEvent,
    Execute,
    FreeKeysEvent,
    GatherDep,
    PauseEvent,
    Rejoin,
    RejoinEvent,
    Report,
    RetireAbortedEvent,
    RetireEvent,
    RunsOverdueEvent,
    SecedeEvent,
    StateMachineEvent,
    UnpauseEvent,
)
from redisdask.workers.failures import MAX_ERROR_LENGTH
from redisdask.workers.heartbeat import Heartbeat
from redisdask.workers.inbox import (
    Command,
    Pushed,
    early_news,
    inbox_events,
    parse_id,
    script_entries,
)
from redisdask.workers.memory import WorkerMemoryManager
from redisdask.workers.peers import Peers
from redisdask.workers.plugins import PluginHost
from redisdask.workers.runner import TaskRunner
from redisdask.workers.spill import SpillBuffer
from redisdask.workers.state import WorkerState

logger = logging.getLogger("redisdask.worker")

MAX_CLAIM = 1000  # tasks one claim takes at most
REPORT_BATCH = 100  # reports per XADD at most while threads are busy
CLAIM_DELAY_SLACK = 0.001  # seconds added to a timed claim (a timer may fire a bit early)
REPORT_LINGER = 0.002  # seconds a report may wait for companions while threads are busy
CHAIN_LOOKUPS = 8  # finished tasks per free thread whose chains a report looks up at most
CHAIN_DEPTH = 16  # links a report may claim beyond the dependents of its results
CHAINED_KEPT = 100_000  # claimed keys with a chain remembered at most
CLOSE_TIMEOUT = 2.0  # seconds background tasks get to stop when the worker closes
RETIRE_REPEAT = 1.0  # seconds between a retiring worker's requests to be retired
WRONG_TYPE_WAIT = 0.5  # seconds a loop waits before it tries a key of the wrong type again
WRONG_TYPE_REPEAT = 30.0  # seconds between the worker's lines about such a key


_STIMULI = itertools.count()  # makes the worker's own stimulus ids unique (thread-safe)


class Worker:
    def __init__(
        self,
        redis_url: str,
        cluster: str = "default",
        *,
        nthreads: int = 1,
        name: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        memory_limit: int = 0,
        heartbeat_interval: float = 0.5,
        worker_ttl: float = 3.0,
        hang_timeout: float = 10.0,
        claim_horizon: float = 0.02,
        connection_limit: int = 50,
        peer_timeout: float = comm.DEFAULT_DEAD_AFTER,
        peer_connect_timeout: float = comm.DEFAULT_TIMEOUT,
        idle_timeout: float = comm.DEFAULT_IDLE_TIMEOUT,
        max_connections: int = comm.DEFAULT_MAX_CONNECTIONS,
        security: Security | None = None,
        transfer_batch_bytes: int = 200_000_000,
        inline_result_bytes: int = 65_536,
        inline_results_redis_fraction: float = 0.5,
        inline_results_redis_bytes: int | None = None,
        connect_timeout: float = 5.0,
        local_directory: str | None = None,
        memory_target: float | Literal[False] = 0.60,
        memory_spill: float | Literal[False] = 0.70,
        memory_pause: float | Literal[False] = 0.80,
        memory_monitor_interval: float = 0.2,
        memory_terminate: float | Literal[False] = 0.95,
        lifetime: float | None = None,
        story_maxlen: int = 500,
        events_maxlen: int = 10_000,
        validate: bool = False,
        preload: str | Sequence[str] | None = None,
        resources: dict[str, float] | str | None = None,
        max_error_length: int = MAX_ERROR_LENGTH,  # admin.max-error-length
    ) -> None:
        self.redis_url = redis_url
        self.max_error_length = max_error_length
        # Dask's worker resources ("GPU=2,MEM=10e9" or a dict); a mistake fails here
        self.resources = parse_resources(resources, "worker resources")
        self.keys = Keys(cluster)
        self.nthreads = nthreads
        self.name = name
        self.host, self.port = host, port
        self.memory_limit = memory_limit
        self.heartbeat_interval = heartbeat_interval
        self.worker_ttl = worker_ttl
        self.hang_timeout = hang_timeout
        self.claim_horizon = claim_horizon
        self.connection_limit = connection_limit
        self.security = security or Security()  # TLS between peers (redisdask/security.py)
        self.transfer_batch_bytes = transfer_batch_bytes
        self.inline_result_bytes = inline_result_bytes
        self.inline_results_redis_fraction = inline_results_redis_fraction
        self.inline_results_redis_bytes = inline_results_redis_bytes
        self.connect_timeout = connect_timeout
        # comm.timeouts.tcp, .connect, .idle, comm.max-connections
        self.peer_timeout, self.idle_timeout = peer_timeout, idle_timeout
        self.peer_connect_timeout = peer_connect_timeout
        self.max_connections = max_connections
        self.validate = validate
        self.local_directory = Path(local_directory or tempfile.gettempdir()) / (
            "redisdask-worker-space"
        )
        # preloads are imported now: one that cannot be stops the worker before it starts
        self.plugin_host = PluginHost(preload, self.local_directory)
        self.plugins = self.plugin_host.plugins  # name -> plugin, as distributed's
        self.memory_target, self.memory_spill = memory_target, memory_spill
        self.memory_pause = memory_pause
        self.memory_monitor_interval = memory_monitor_interval
        self.memory_terminate = memory_terminate
        self.lifetime = lifetime
        self.story_maxlen = story_maxlen
        self.events_maxlen = events_maxlen
        self._init_driver_state()

    def _init_driver_state(self) -> None:
        """The driver's parts (its task runner, heartbeat and peers), its own bookkeeping
        (its task client, reports and claims in flight, its loops' signals), and what its
        nanny told it (through the environment)."""
        self.address = ""
        self.status = "init"
        self.runner = TaskRunner(self)  # the pool of task threads, and their runs
        self.heartbeat = Heartbeat(self)
        self.peers = Peers(self)  # the data server, fetches from peers and their counts
        # small results of dependencies that came with a claim, for its GatherDeps
        self._claimed_values: dict[str, bytes] = {}
        self._client: Any = None  # redisdask.Client for its tasks (task_client)
        self._client_lock = threading.Lock()
        self._rejoin_waiters: dict[str, threading.Event] = {}  # rejoin() waits per key
        self._outbox: list[dict[str, Any]] = []
        self._flush_lock = asyncio.Lock()  # report batches land in the order they were made
        # held from a claim to the state machine applying its reply, and from making a
        # holding report to its landing: so the workers stream orders them exactly
        self._claim_lock = asyncio.Lock()
        self._holding_reports = 0  # holding reports made so far
        self._chained: set[str] = set()  # claimed tasks whose records name a chain
        self._pushed: set[str] = set()  # pushed tasks not reported yet (early news)
        self._claimed_before: dict[str, int] = {}  # claimed key -> holding reports before it
        self._wake = asyncio.Event()
        self._wake_timer: asyncio.TimerHandle | None = None  # (``_wake_in``)
        self._stopped = asyncio.Event()
        self._flush_wanted = asyncio.Event()
        self._linger: asyncio.TimerHandle | None = None
        self._latest_signal = (0, 0)
        self._empty_at: tuple[int, int] | None = None
        self._blocked_at: int | None = None  # resources_freed when a claim lacked resources
        self._background: set[asyncio.Task[Any]] = set()
        self.inbox_id = "0-0"
        self.started = time.time()
        self.failure: BaseException | None = None
        self._closing: asyncio.Future[None] | None = None
        self._reconnecting: asyncio.Future[None] | None = None
        self._wrong_type_said = 0.0  # (monotonic) when a key of the wrong type may be said again
        self._exit_reason: str | None = None  # what the nanny is told, if not close()'s
        self._retire_force = False
        # taken out of the environment: processes that tasks start have no nanny
        nanny = nanny_contract.take_from_environment()
        self.nanny_pid, self.restarts = nanny.nanny_pid, nanny.restarts
        self._exit_reason_file, self._address_file = nanny.exit_reason_file, nanny.address_file

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> Worker:
        self.loop = asyncio.get_running_loop()
        context.bind_thread(self)  # a future unpickled here binds to task_client
        secret = await asyncio.to_thread(self._ensure_cluster)
        self.address = await self.peers.start(secret)
        self.name = self.name or self.address
        # every connection carries the worker's address in its name: the scheduler sees in
        # CLIENT LIST at once when a killed worker's connections are gone
        name = self.keys.worker_connection(self.address)
        self.redis = connect_async(self.redis_url, timeout=self.connect_timeout, name=name)
        self.blocking_redis = connect_async(self.redis_url, timeout=self.connect_timeout, name=name)
        self._start_memory()
        self.state = WorkerState(
            address=self.address,
            nthreads=self.nthreads,
            data=self.data,
            validate=self.validate,
            transfer_batch_bytes=self.transfer_batch_bytes,
            transfer_batch_keys=comm.MAX_KEYS_PER_MESSAGE,
            resources=self.resources,
        )
        if isinstance(self.data, SpillBuffer):  # weigh what is stored by the size measured
            self.data.known = self._known_nbytes
        self.scripts = scripts.Scripts(self.redis, self.keys)  # type: ignore[arg-type]
        self.heartbeat.watch.name = self.name or self.address
        await self.plugin_host.start(self)  # preloads, uploads, plugins: before any claim
        if self._address_file:  # for its nanny: which worker.  Before registering: a death
            # after the registration, and the nanny could not name it to the scheduler,
            # which would go on giving work to a dead worker until its watch noticed
            Path(self._address_file).write_text(self.address)
        await self._register()
        self.heartbeat.run_id = (await self.redis.info("server")).get("run_id")  # see removed
        await self.plugin_host.sync(self)  # those registered while this one registered
        self.status = "running"
        self._start_loops()
        logger.info(
            "Start worker %s (name %s) with %d threads on cluster %r",
            self.address,
            self.name,
            self.nthreads,
            self.keys.cluster,
        )
        return self

    def _start_memory(self) -> None:
        """The memory manager and the store it spills from (``self.data``)."""
        self.memory = WorkerMemoryManager(
            memory_limit=self.memory_limit,
            target=self.memory_target,
            spill=self.memory_spill,
            pause=self.memory_pause,
            monitor_interval=self.memory_monitor_interval,
            local_directory=self.local_directory,
            label=self.address,
            on_pause=self._on_pause,
            on_unpause=self._on_unpause,
            note=self.heartbeat.note,
            in_memory_bytes=self._bytes_in_memory,
            on_spill_failed=self._on_spill_failed,
        )
        self.data = self.memory.data
        if self._address_file and self.memory.spill_directory is not None:
            # for its nanny, which removes it if this process dies
            where = nanny_contract.spill_directory_file(self._address_file)
            try:
                where.write_text(str(self.memory.spill_directory))
            except OSError as exc:
                logger.warning("could not tell the nanny where this worker spills: %s", exc)

    def _start_loops(self) -> None:
        """The worker's loops, each restarted if it fails (``_keep_running``), and the
        thread that keeps the heartbeat through a stalled loop."""
        loops = [self._claim_loop, self._listen_loop, self.heartbeat.loop, self._flush_loop]
        loops += [self._holding_loop, self.heartbeat.watch.tick]
        if self.memory.monitoring:
            loops.append(self.memory.monitor)
        if self.lifetime is not None:
            loops.append(self._lifetime_loop)
        for loop in loops:
            self._spawn(self._keep_running(loop))
        self.heartbeat.watch.start()

    def _ensure_cluster(self) -> bytes:
        """Create or join the cluster; refuse to join one whose pickles we cannot read."""
        client = connect(self.redis_url, timeout=self.connect_timeout)
        try:
            redis_memory.check_policy(redis_memory.read(client), "this worker")
            ours = versions()
            client.hsetnx(self.keys.meta, "versions", codecs.pack(ours))
            theirs = codecs.unpack(client.hget(self.keys.meta, "versions"))
            problems = pickle_breaking(ours, theirs)
            if problems:
                raise VersionMismatchError(
                    f"this worker cannot join cluster {self.keys.cluster!r}: "
                    + "; ".join(problems)
                    + ". Tasks and results are pickled: run the same Python (minor version) "
                    "and cloudpickle (major version) everywhere"
                )
        finally:
            client.close()
        client = connect(self.redis_url, timeout=self.connect_timeout)
        try:
            return bootstrap.ensure_cluster(client, self.keys)
        finally:
            client.close()

    async def _register(self, resync: bool = False) -> None:
        info = {
            "address": self.address,
            "name": self.name,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "nthreads": self.nthreads,
            "memory_limit": self.memory_limit,
            "versions": versions(),
            "started": self.started,
            "nanny": self.nanny_pid,
            "restarts": self.restarts,
            "local_directory": str(self.local_directory),
            "resources": self.resources,
            # the marks of its memory bar in the monitor (terminate: its nanny's, if any)
            "memory_fractions": {
                "target": self.memory_target,
                "spill": self.memory_spill,
                "pause": self.memory_pause,
                "terminate": self.memory_terminate if self.nanny_pid else False,
            },
        }
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.workers, self.address, codecs.pack(info))
        pipe.persist(self.keys.worker_story(self.address))  # a predecessor's had a TTL
        pipe.set(self.keys.worker_alive(self.address), 1, px=int(self.worker_ttl * 1000))
        pipe.hset(self.keys.heartbeats, self.address, codecs.pack(self.heartbeat.metrics()))
        message = AddWorker(self.address, info=info)
        # made and landed under the claim lock, like a holding report: a claim lands
        # either before the message and is in its resync, or after it (a claim that the
        # claim loop ran meanwhile was missing from it, and the scheduler took it back)
        async with self._claim_lock:
            if resync:  # what Redis may have forgotten: the scheduler reconciles with it
                message.resync = self.state.resync_report()
            pipe.xadd(self.keys.worker_stream, codecs.entry([message.to_dict()]))
            await pipe.execute()

    async def _keep_running(self, loop: Any) -> None:
        """Run one of the worker's loops; when Redis goes away, wait for it to come back
        (one shared reconnection) and run the loop again.  A key of the cluster of the
        wrong type (written by something other than redisdask) is waited out too: the
        scheduler rebuilds it (``scheduler.quarantine``), and a worker that left would
        lose what it holds."""
        retried = False  # (a WRONGTYPE whose key was rebuilt since: the loop once more)
        while self.status == "running":
            try:
                await loop()
                return
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                retried = False
                if self._reconnecting is None or self._reconnecting.done():
                    self._reconnecting = asyncio.ensure_future(self._reconnect(exc))
                await asyncio.shield(self._reconnecting)
            except redis.ResponseError as exc:
                if "WRONGTYPE" not in str(exc):
                    raise
                misfits = await self._misfits()
                if misfits is None:  # (Redis away: the next try reconnects)
                    continue
                if not misfits:
                    if retried:  # (not a key the scheduler rebuilds: this worker leaves)
                        raise
                    retried = True
                    continue
                retried = False
                if time.monotonic() >= self._wrong_type_said:
                    self._wrong_type_said = time.monotonic() + WRONG_TYPE_REPEAT
                    logger.error("%s; waiting for the scheduler to rebuild it", "; ".join(misfits))
                await asyncio.sleep(WRONG_TYPE_WAIT)  # (a timer by nature: nothing says when)

    async def _misfits(self) -> list[str] | None:
        """The cluster-wide keys of the wrong type, said (``keyspace.CLUSTER_KEY_TYPES``);
        None while Redis is away (the loop's next try meets that, and reconnects)."""
        pipe = self.redis.pipeline(transaction=False)
        for name in keyspace.CLUSTER_KEY_TYPES:
            pipe.type(getattr(self.keys, name))
        try:
            found_types = await pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError):
            return None
        types = keyspace.CLUSTER_KEY_TYPES.items()
        return [
            f"{getattr(self.keys, name)} is a {found.decode()}, not a {expected.decode()}"
            for (name, expected), found in zip(types, found_types, strict=True)
            if found not in (expected, b"none")
        ]

    async def _reconnect(self, exc: Exception) -> None:
        logger.warning("lost Redis (%s); reconnecting with backoff", exc)
        lost_at = time.monotonic()
        backoff = redis_away()
        while self.status == "running":
            await asyncio.sleep(backoff.next())  # backoff while Redis is away
            try:
                if await self.heartbeat.removed():  # (stopped or cut off while it was removed)
                    self.leave_removed(None)
                    return
                await self._register(resync=True)
            except (redis.ConnectionError, redis.TimeoutError):
                continue
            logger.warning(
                "reconnected to Redis after %.1f s; re-registered and re-reported %d keys",
                time.monotonic() - lost_at,
                len(self.state.by_state.get("memory", ())),
            )
            self._empty_at = None  # whatever was queued meanwhile: look again
            self._wake.set()
            return

    async def run(self) -> None:
        """Run until ``close()`` (or a signal, see ``main``)."""
        if self.status == "init":
            await self.start()
        await self._stopped.wait()

    async def close(self, reason: str = "worker-close") -> None:
        if self.status in ("closing", "closed"):
            return
        self.status = "closing"
        logger.info("Closing worker %s (%s)", self.address, reason)
        await self.heartbeat.stop()  # before the goodbye: see LoopWatch (at exit too)
        for task in list(self._background):
            task.cancel()
        if self._background:
            _done, stuck = await asyncio.wait(self._background, timeout=CLOSE_TIMEOUT)
            for task in stuck:  # a library swallowed the cancellation: do not hang on it
                logger.warning("background task %s ignored cancellation", task.get_coro())
        await self.plugin_host.close(self)  # plugins' teardown, preloads' dask_teardown
        try:  # first: the tasks still running are handed back (see TaskRunner._ran)
            self.report(RemoveWorker(self.address, reason=reason))
            await self._flush()
            await self.redis.delete(self.keys.worker_alive(self.address))
        except redis.RedisError as exc:
            logger.warning("worker %s could not say goodbye to Redis: %s", self.address, exc)
        await self._close_task_client()
        await self.peers.close()
        self.runner.shutdown()
        await self.redis.aclose()
        await self.blocking_redis.aclose()
        self.memory.close()
        self._write_exit_reason(reason)
        self.status = "closed"
        logger.info("End worker %s (%s)", self.address, reason)
        self._stopped.set()

    async def close_gracefully(self, reason: str, timeout: float = GRACEFUL_TIMEOUT) -> None:
        """Retire (hand this worker's data to others), then close; close anyway after
        ``timeout`` (no scheduler, or nowhere to put the data)."""
        self._exit_reason = self._exit_reason or reason
        self.retire(force=True)
        try:
            await asyncio.wait_for(asyncio.shield(self._stopped.wait()), timeout)
        except TimeoutError:
            await self.close(f"{reason}; its data could not be moved within {timeout} s")

    def _write_exit_reason(self, reason: str) -> None:
        if self._exit_reason_file:
            try:
                Path(self._exit_reason_file).write_text(self._exit_reason or reason)
            except OSError as exc:
                logger.warning("could not tell the nanny why this worker closed: %s", exc)

    def close_soon(self, reason: str) -> None:
        """Close in a task of its own (from a callback, or from one of the loops that
        ``close`` cancels)."""
        self._closing = asyncio.ensure_future(self.close(reason))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._background.discard(t)
            if t.cancelled() or t.exception() is None:
                return
            logger.error("worker task %s failed", t.get_coro(), exc_info=t.exception())
            if self.status == "running":
                # a worker that cannot claim, report or listen any more must not linger as
                # a registered zombie: leave (the process exits 1)
                self.failure = t.exception()
                self.close_soon(f"internal failure: {t.exception()!r}")

        task.add_done_callback(done)

    # ------------------------------------------------------------------ state machine

    def handle(self, *events: StateMachineEvent) -> None:
        self.state.clock = time.time()  # when, in the story
        instructions = self.state.handle_stimulus(*events)
        self.plugin_host.transitions(self.state)
        for ins in instructions:
            _CARRY_OUT[type(ins)](self, ins)
        self._wake.set()
        if self._outbox:
            self._schedule_flush()

    def _gather_dep(self, ins: GatherDep) -> None:
        if ins.worker == keyspace.REDIS_COPY:  # small results, from their records
            came = self._claimed_values
            claimed = {k: came[k] for k in ins.keys if k in came}
            self._spawn(self.peers.gather_from_redis(sorted(ins.keys), claimed))
        else:
            self._spawn(self.peers.gather(ins.worker, sorted(ins.keys)))

    def _schedule_flush(self) -> None:
        """Send reports at once when this worker has nothing else running (a dependent may
        wait for them); while its threads stay busy, let up to REPORT_BATCH reports or
        REPORT_LINGER seconds accumulate, so a stream of tiny tasks costs one XADD per
        batch instead of one per task."""
        if not self.state.executing or len(self._outbox) >= REPORT_BATCH:
            self._flush_wanted.set()
        elif self._linger is None:
            self._linger = asyncio.get_running_loop().call_later(
                REPORT_LINGER, self._flush_wanted.set
            )

    def report(self, msg: Message) -> None:
        """Queue a message for the workers stream; every one names this worker (a
        ``retire-workers`` too, whose class is shared with the clients' stream)."""
        message = msg.to_dict()
        message["worker"] = self.address
        self._outbox.append(message)

    # ------------------------------------------------------------------ tasks in tasks

    def task_client(self, timeout: float | None = None) -> Any:
        """The client this worker's tasks submit with (``redisdask.get_client`` in a
        task): one per worker, made on first use with the worker's Redis URL and
        cluster name, closed with the worker.  Not the process's default client: in a
        worker's threads ``default_client()`` answers it anyway."""
        with self._client_lock:
            if self._client is None or self._client.status != "running":
                if self.status != "running":
                    raise RuntimeError(f"worker {self.address} is {self.status}: no new client")
                from redisdask.client.client import Client

                self._client = Client(
                    self.redis_url,
                    self.keys.cluster,
                    timeout=self.connect_timeout if timeout is None else timeout,
                    set_as_default=False,
                )
                logger.info("worker %s made client %s for its tasks", self.address, self._client.id)
            return self._client

    async def _close_task_client(self) -> None:
        """Close the tasks' client (a task waiting on it gets ``FutureCancelledError``)
        and let go of every thread waiting to rejoin."""

        def close() -> None:
            with self._client_lock:  # (a task may be making it right now)
                client, self._client = self._client, None
            if client is not None:
                client.close()

        await in_thread(close)  # (not the default executor: closed at exit)
        for waiter in list(self._rejoin_waiters.values()):
            waiter.set()

    def get_current_task(self) -> Hashable:
        """The key of the task calling this (distributed's ``Worker.get_current_task``)."""
        return context.current_task()

    def log_event(self, topic: str | list[str], msg: Any) -> None:
        """Log ``msg`` (plain data) under ``topic`` (or each of a list), as distributed's
        ``Worker.log_event``; written with the next heartbeat (within
        ``heartbeat-interval``).  Callable from a task's thread."""
        writes = topics.commands(self.keys, topic, msg, self.events_maxlen)  # (checks msg)
        self.loop.call_soon_threadsafe(self.heartbeat.events.extend, writes)  # (the loop's list)

    def secede_task(self, key: str) -> None:
        """Called in ``key``'s thread by ``secede()``: it no longer counts (returns at
        once; the event reaches the state machine before the task's result can)."""
        sid = f"secede-{time.time():.6f}-{next(_STIMULI)}"
        self.loop.call_soon_threadsafe(self.handle, SecedeEvent(key, sid))

    def rejoin_task(self, key: str) -> None:
        """Called in ``key``'s thread by ``rejoin()``: block until the state machine
        grants it a slot (``Rejoin``), or the worker closes."""
        granted = self._rejoin_waiters[key] = threading.Event()
        sid = f"rejoin-{time.time():.6f}-{next(_STIMULI)}"
        try:
            self.loop.call_soon_threadsafe(self.handle, RejoinEvent(key, sid))
        except RuntimeError:  # the event loop is closed: the worker is gone
            granted.set()
        while not granted.wait(1.0) and self.status in ("init", "running", "closing"):
            pass  # (woken by the grant, or by close() letting every waiter go)
        self._rejoin_waiters.pop(key, None)

    def _rejoined(self, key: str) -> None:
        waiter = self._rejoin_waiters.get(key)
        if waiter is not None:
            waiter.set()

    # ------------------------------------------------------------------ claiming work

    def _may_have_work(self) -> bool:
        if self._blocked_at is not None and self.state.resources_freed > self._blocked_at:
            return True  # tasks were left for lack of resources, and some came free
        return self._empty_at is None or self._latest_signal > self._empty_at

    async def _claim_loop(self) -> None:
        while self.status == "running":
            now = time.time()
            ran = now - self.runner.start_lag(now)  # "now" for the runs, by their threads' clocks
            give_back = self.state.give_back_delay(self.claim_horizon, ran)
            if give_back == 0:
                self.handle(RunsOverdueEvent(self.claim_horizon, ran, f"overdue-{now:.3f}"))
                give_back = self.state.give_back_delay(self.claim_horizon, ran)
            starts = self.state.claim_budget(self.claim_horizon, now)
            if starts and self._may_have_work():
                async with self._claim_lock:
                    kept = self.state.lingering_keys()  # (see ClaimsHandledEvent)
                    try:
                        claimed, last_id, inbox, flags, claim = await self._claim(starts)
                    except redis.ResponseError as exc:
                        if "UNKNOWN_WORKER" not in str(exc):
                            raise
                        self.leave_removed(exc)
                        return
                    dry = len(claimed) < MAX_CLAIM and not flags & CLAIM_FULL
                    self._empty_at = parse_id(last_id) if dry else None
                    blocked = flags & CLAIM_BLOCKED
                    self._blocked_at = self.state.resources_freed if blocked else None
                    if flags & CLAIM_PASSED:  # look again once their worker's turn is over
                        asyncio.get_running_loop().call_later(
                            PLACED_PATIENCE_MS / 1000, self._claim_again
                        )
                    self._handle_inbox(script_entries(inbox))
                    self._note_chains(claimed)
                    events: list[StateMachineEvent] = [
                        self._compute_event(c, self._claimed_values, claim) for c in claimed
                    ]
                    for ev in events:
                        self._claimed_before[ev.key] = self._holding_reports
                    if kept:  # what was kept for these claims, and none of them needs, goes
                        events.append(ClaimsHandledEvent(kept, f"claimed-{time.time():.3f}"))
                    if events:
                        self.handle(*events)
                    self._claimed_values.clear()  # (those not fetched were not needed)
                continue
            if self.state.lingering:  # no claim now: nothing waits for those
                kept = self.state.lingering_keys()
                self.handle(ClaimsHandledEvent(kept, f"no-claim-{now:.3f}"))
            self._wake.clear()
            # look again when a thread comes within the horizon of its end (claim its next
            # task then), or when every thread's run is past any expectation (hand back
            # what waits behind them), whichever comes first, unless woken before
            delays = [give_back]
            if not starts:
                delays.append(self.state.claim_delay(self.claim_horizon, now))
            timed = [d for d in delays if d is not None]
            if timed:
                self._wake_in(min(timed) + CLAIM_DELAY_SLACK)
            await self._wake.wait()

    def _wake_in(self, delay: float) -> None:
        """Set ``_wake`` in ``delay`` seconds, unless a timer already does it sooner (one
        timer at most: a later one is cancelled; a timer that fires early only makes
        the claim loop look once more)."""
        loop = asyncio.get_running_loop()
        when = loop.time() + delay
        timer = self._wake_timer
        if timer is not None and loop.time() < timer.when() <= when + CLAIM_DELAY_SLACK:
            return  # (within the slack: the same moment, by another clock reading)
        if timer is not None:
            timer.cancel()
        self._wake_timer = loop.call_at(when, self._wake.set)

    def _claim_again(self) -> None:
        """Claim again, though no ready-signal came: placed tasks this worker passed over
        may be overdue for their own worker (``scripts.CLAIM``)."""
        self._empty_at = None
        self._wake.set()

    async def _claim(self, starts: list[float]) -> Any:
        free = format_resources(self.state.free_resources()) if self.resources else ""
        return await self.scripts.claim(
            worker=self.address,
            count=MAX_CLAIM,
            last_inbox_id=self.inbox_id,
            free=free,
            horizon=self.claim_horizon,
            starts=starts,
        )

    @staticmethod
    def _compute_event(
        claimed: list[Any], values: dict[str, bytes], claim: bytes | str
    ) -> ComputeTaskEvent:
        """A claimed task (``claim``: its claim's entry on the workers stream); the small
        results of its dependencies that came with it go into ``values``."""
        key, spec, score, deps, needs, estimate, *_ = claimed
        key = key.decode()
        dependencies, runs = {}, {}
        for dep, who, nb, run, *value in deps:
            dependencies[dep.decode()] = (split_words(who), int(nb or 0))
            runs[dep.decode()] = float(run) if run else None
            if value:
                values[dep.decode()] = value[0]
        return ComputeTaskEvent(
            key,
            spec,
            (float(score),),
            dependencies,
            f"claim-{key}",
            split_resources(needs),
            float(estimate) if estimate else None,
            parse_id(claim) if claim else None,
            runs,
        )

    async def _listen_loop(self) -> None:
        """Wait on the ready-signal stream and this worker's inbox (one XREAD BLOCK)."""
        signal_id = "0-0"
        inbox = self.keys.worker_inbox(self.address)
        while self.status == "running":
            reply = await self.blocking_redis.xread(
                {self.keys.ready_signal: signal_id, inbox: self.inbox_id}, block=1000, count=1000
            )
            for stream, items in reply or []:
                if not items:
                    continue
                last = items[-1][0]
                if stream.decode() == self.keys.ready_signal:
                    signal_id = last.decode()
                    self._latest_signal = max(self._latest_signal, parse_id(last))
                    self._wake.set()
                else:
                    self._handle_inbox(items)

    def _handle_inbox(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        """Apply scheduler messages, each entry once (the listener and the claim script
        both deliver them), in order; a malformed message is logged and skipped."""
        items: list[StateMachineEvent | Command] = []
        for entry_id, fields in entries:
            if parse_id(entry_id) <= parse_id(self.inbox_id):
                continue
            self.inbox_id = entry_id.decode()
            try:
                items.extend(inbox_events(entry_id.decode(), fields, self.started))
            except (ProtocolError, KeyError, TypeError, ValueError) as exc:
                logger.warning("ignoring malformed inbox entry %s: %s", entry_id.decode(), exc)
        batch: list[StateMachineEvent] = []
        for item in items:
            if isinstance(item, Pushed):
                self._note_pushed(item)
                batch.append(item.event)
            elif isinstance(item, Command):
                if batch:
                    self.handle(*batch)
                    batch = []
                self._command(item)
            else:
                batch.append(item)
        if batch:
            self.handle(*batch)

    def _note_pushed(self, item: Pushed) -> None:
        """A pushed task is a claimed one, as far as this worker's reports go; its report
        carries its client's news (``early_news``)."""
        key = item.event.key
        self._claimed_before[key] = self._holding_reports
        if len(self._pushed) > CHAINED_KEPT:  # (tasks pushed and never reported)
            self._pushed.clear()
        self._pushed.add(key)
        if item.chain:
            self._chained.add(key)

    def _command(self, command: Command) -> None:
        _COMMANDS[command.op](self, command)

    def _restart(self, command: Command) -> None:
        """Drop everything held or running, as it is now; under a nanny, exit for it to
        start a fresh process."""
        self.handle(FreeKeysEvent(list(self.state.tasks), command.stimulus_id, force=True))
        if self.nanny_pid is not None and self.status == "running":
            self._exit_reason = "restart"  # its nanny starts a fresh process
            self.close_soon("restart")

    def _close_command(self, command: Command) -> None:
        if self.status == "running":
            self.close_soon(command.reason)

    def _retire_aborted(self, command: Command) -> None:
        """The scheduler stopped the retirement (``RetireAborted``): work on."""
        if not self.state.retiring or self._retire_force:  # (a forced one always leaves)
            return
        logger.warning("Worker %s is not retiring any more: %s", self.address, command.reason)
        self.handle(RetireAbortedEvent(command.stimulus_id))
        self._claim_again()

    def retire(self, force: bool = False) -> None:
        """Leave gracefully: claim nothing more, hand back the tasks claimed but not
        started, finish the running ones, and close when the scheduler says that every
        result only this worker held has a copy elsewhere (``client.retire_workers``).
        ``force``: this worker leaves anyway (SIGTERM, lifetime): with no worker to take
        its data, it is told to close at once."""
        self._retire_force = self._retire_force or force
        if self.state.retiring or self.status != "running":
            return
        logger.info("Retiring worker %s: moving its data to other workers", self.address)
        self.handle(RetireEvent(f"retire-{time.time()}"))
        self._spawn(self._keep_running(self._retire_loop))

    async def _retire_loop(self) -> None:
        """Ask the scheduler to retire this worker until it answers ``close`` (or stops
        the retirement: ``RetireAborted``).  Asking again re-asks for copies that did not
        come, and tells a scheduler restarted meanwhile."""
        while self.status == "running" and self.state.retiring:
            self.report(RetireWorkers(workers=[self.address], force=self._retire_force))
            self._flush_wanted.set()
            await asyncio.sleep(RETIRE_REPEAT)

    # ------------------------------------------------------------------ reporting

    async def _flush_loop(self) -> None:
        while self.status == "running":
            await self._flush_wanted.wait()
            self._flush_wanted.clear()
            await self._flush()

    async def _flush(self) -> None:
        async with self._flush_lock:
            if self._linger is not None:
                self._linger.cancel()
                self._linger = None
            if not self._outbox:
                return
            batch, self._outbox = self._outbox, []
            try:  # through a full Redis: reports move admitted work forward
                await self._send_reports(batch)
            except BaseException:
                self._outbox[:0] = batch  # not sent: keep the reports for the next attempt
                raise

    async def _send_reports(self, batch: list[dict[str, Any]]) -> None:
        """One entry of the workers stream (``FINISH``, which gets through a full Redis),
        which also claims the dependents that the finished tasks free, when this worker
        has room: each link of a chain then costs this one round trip, not the
        scheduler's and a claim's (docs/design.md, "Chains").  Not with a holding report
        (the claim would land in the middle of the exchange it closes).  Only the
        finished tasks whose claims said they have a chain are looked up, the last
        ``CHAIN_LOOKUPS`` per free thread (a map's reports look nothing up)."""
        chained = self._chained
        finished = [
            m["key"] for m in batch if m.get("op") == "task-finished" and m["key"] in chained
        ]
        chained.difference_update(finished)
        room = 0
        if (
            finished
            and self.status == "running"
            and not any(m.get("op") == "holding" for m in batch)
        ):
            room = len(self.state.claim_budget(self.claim_horizon, time.time()))
        holding_before, inbox_id = self._holding_reports, self.inbox_id
        early = early_news(batch, self._pushed, self.address)
        tasks, inbox, claim = await self.scripts.finish(
            worker=self.address,
            ttl_ms=int(self.worker_ttl * 1000),
            reports=[codecs.pack(m) for m in batch],
            # (the latest few: a batch of many tiny results costs no lookup per task)
            finished=finished[-CHAIN_LOOKUPS * room :] if room else (),
            chain=room,
            last_inbox_id=inbox_id,
            deeper=CHAIN_DEPTH if room else 0,
            horizon=self.claim_horizon,
            early=early,
        )
        if not tasks:
            return
        self._handle_inbox(script_entries(inbox))  # (older than the claim: first)
        self._note_chains(tasks)
        events = [self._compute_event(c, self._claimed_values, claim) for c in tasks]
        for ev in events:
            self._claimed_before[ev.key] = holding_before
        self.handle(*events)
        self._claimed_values.clear()

    def _note_chains(self, claimed: list[Any]) -> None:
        """Remember which claimed tasks have dependents chained on them (their records'
        ``chain``, as the claim read it): only their reports look the chain up."""
        if len(self._chained) > CHAINED_KEPT:  # (tasks claimed and never reported)
            self._chained.clear()
        self._chained.update(c[0].decode() for c in claimed if len(c) > 6 and c[6])

    async def _report_holding(self) -> None:
        """Tell the scheduler which of its claims this worker still has (claimed, not
        finished nor handed back): those claimed before its previous holding report.

        A claim whose reply never reached this worker (Redis died between running the
        claim script and answering) leaves a task the scheduler counts as processing
        here; the scheduler queues it again when two reports in a row do not list it.
        No claim is made or applied from making the list until it lands, and it goes
        after every report made before it: so the scheduler, reading the workers stream
        in order, knows exactly which claims and which results the list has seen."""
        async with self._claim_lock:
            tasks = self.state.tasks
            keys = []
            for key, before in list(self._claimed_before.items()):
                ts = tasks.get(key)
                if ts is None or not ts.wanted or ts.state in ("memory", "error", "cancelled"):
                    del self._claimed_before[key]  # finished, handed back or freed
                elif before < self._holding_reports:
                    keys.append(key)
            self._holding_reports += 1
            self.report(Holding(self.address, sorted(keys)))
            await self._flush()

    async def _holding_loop(self) -> None:
        """A holding report after each heartbeat, apart from the heartbeat loop: a report
        waits for the claim lock, which a claim refused by a full Redis holds while it
        waits the refusal out, and the heartbeats, which get through a full Redis, must
        not wait with it (behind it, a refusal longer than ``scheduler.worker-ttl`` had
        every worker declared dead: they left, and their tasks ran again)."""
        while self.status == "running":
            await self.heartbeat.landed.wait()
            self.heartbeat.landed.clear()
            await self._report_holding()

    def leave_removed(self, exc: BaseException | None) -> None:
        """Close, as distributed's worker does when the scheduler removed it (declared
        dead: say, stopped or cut off longer than the TTL): its tasks and its data went
        to others, so it does not come back with them; the process exits 1, and a nanny
        starts a fresh one."""
        logger.error(
            "this worker was removed from the cluster (no heartbeat for scheduler.worker-ttl:"
            " stopped or cut off?); leaving"
        )
        self.failure = exc or RuntimeError(f"worker {self.address} was removed by the scheduler")
        self.close_soon("removed by the scheduler")

    # ------------------------------------------------------------------ memory

    def _on_pause(self, detail: str) -> None:
        """The memory manager found the process past ``pause``: start no new task."""
        self.heartbeat.note("pause", detail)
        self.handle(PauseEvent(f"pause-{time.time()}"))

    def _on_unpause(self, detail: str) -> None:
        self.heartbeat.note("unpause", detail)
        self.handle(UnpauseEvent(f"unpause-{time.time()}"))

    def _on_spill_failed(self, news: dict[str, Any]) -> None:
        """Spills fail: the next heartbeat writes a ``spill-failed`` cluster event, which
        clients log as a warning (``redisdask.store.eventlog``)."""
        fields = {"worker": self.address, "name": self.name, **news}
        event = event_command(
            self.keys.events, self.events_maxlen, "spill-failed", time.time(), **fields
        )
        self.heartbeat.events.append(event)

    def _bytes_in_memory(self) -> int:
        """The managed size without a spill buffer: the sizeof of every result held."""
        return sum(ts.nbytes or 0 for ts in self.state.by_state.get("memory", ()))

    # ------------------------------------------------------------------ lifetime

    async def _lifetime_loop(self) -> None:
        assert self.lifetime is not None
        await asyncio.sleep(self.lifetime)  # the lifetime is a timer by nature
        logger.info("Worker %s reached its lifetime: retiring", self.address)
        self._exit_reason = "lifetime"
        self.retire(force=True)

    def _known_nbytes(self, key: str) -> int | None:
        """The size this worker measured for the value it holds under ``key``."""
        ts = self.state.tasks.get(key)
        return ts.nbytes if ts is not None and ts.nbytes else None

    def state_summary(self, limit: int = 1000) -> dict[str, Any]:
        st = self.state
        return {
            "tasks": {ts.key: ts.state for ts in list(st.tasks.values())[:limit]},
            "in_flight": {w: sorted(keys)[:limit] for w, keys in st.in_flight_workers.items()},
            "rejoining": [ts.key for ts in st.rejoining][:limit],  # seceded, waiting for a slot
            "who_has": {
                ts.key: sorted(ts.who_has)
                for ts in list(st.tasks.values())[:limit]
                if ts.state in ("fetch", "flight", "missing")
            },
            "story": [list(map(str, s)) for s in list(st.story)[-50:]],
            "resources": {"total": st.total_resources, "available": st.free_resources()},
        }


# how the driver carries out each instruction of its state machine
_CARRY_OUT: dict[type, Callable[[Worker, Any], None]] = {
    Execute: lambda worker, ins: worker.runner.execute(ins.key),
    GatherDep: Worker._gather_dep,
    **dict.fromkeys(typing.get_args(Report), Worker.report),
    Rejoin: lambda worker, ins: worker._rejoined(ins.key),
}

# what the driver does with each command of its inbox (``RestartWorker``, ``RetireWorker``,
# ``RetireAborted``, ``CloseWorker``, by their op)
_COMMANDS: dict[str, Callable[[Worker, Command], None]] = {
    RestartWorker.op: Worker._restart,
    RetireWorker.op: lambda worker, command: worker.retire(),
    RetireAborted.op: Worker._retire_aborted,
    CloseWorker.op: Worker._close_command,
}
