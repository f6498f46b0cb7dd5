"""The scheduler driver: a thin loop around ``SchedulerState``.

::

    XREADGROUP (clients + workers streams, BLOCK)  ->  decode  ->  handle_stimulus
        ->  instructions  ->  Redis commands + XACK/XDEL of the batch
        ->  one EVALSHA of APPLY_FENCED (checks our lease token, renews it)

Delivery semantics: a batch's effects and its acknowledgement land in one atomic script,
so a crash before the write leaves the batch pending for the next scheduler (it re-reads
pending entries first), and a crash after it leaves it applied.  A write refused because
the lease moved on (``FencedError``) stops this scheduler: a standby owns the cluster now.
Any other failed write discards the in-memory state and reloads it from Redis, which is
the source of truth.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import uuid
from collections import Counter, defaultdict
from typing import Any

import redis

from redisdask import schema
from redisdask.backoff import Backoff
from redisdask.config import RetentionConfig
from redisdask.connection import connect, redact
from redisdask.errors import FencedError, ProtocolError
from redisdask.events import death_fields, event_command
from redisdask.protocol import SCHEDULER_EVENTS, FreeKeys, parse
from redisdask.scheduler_state import (
    HOLDS_DEPENDENCIES,
    AddWorker,
    ClaimAccepted,
    ClientMsg,
    CloseClient,
    Dequeue,
    Enqueue,
    Event,
    Forget,
    ForgetClient,
    ForgetWorker,
    Instruction,
    LogEvent,
    RecordDeath,
    RejectedGraph,
    RemoveWorker,
    ResetCluster,
    SchedulerState,
    SetState,
    SetWants,
    StoreTask,
    TaskState,
    Unclaim,
    WorkerMsg,
)
from redisdask.schema import Keys
from redisdask.versions import versions

logger = logging.getLogger("redisdask.scheduler")

MAX_ARGS = 2000  # Lua's unpack() limit is ~8000 arguments per command
CHECK_INTERVAL = 0.2  # seconds between looks for dead workers (CLIENT LIST, heartbeats)
NANNY_GRACE_LOOKS = 8  # looks without connections before a nanny's worker is dead (~1.5 s)
MAX_BATCH_BYTES = 64 << 20  # one atomic write stays far below Redis's 512 MB per argument
DEAD_LETTER_SAMPLE = 4096  # bytes of each field kept of a dead-lettered entry
SUMMARY_INTERVAL = 0.5  # seconds between writes of the summary hash while tasks change
SUMMARY_SHARE = 0.05  # the most of the scheduler's time the summary's passes may take
THROUGHPUT_WINDOW = 60  # seconds of finished-task counts the summary keeps
MAX_PREFIXES = 100  # task prefixes counted apart in the summary; the rest are "other"


class Scheduler:
    def __init__(
        self,
        redis_url: str,
        cluster: str = "default",
        *,
        lease_ttl: float = 5.0,
        batch_size: int = 1000,
        validate: bool = False,
        connect_timeout: float = 5.0,
        allowed_failures: int = 3,
        worker_ttl: float = 3.0,
        client_ttl: float = 30.0,
        retention: RetentionConfig | None = None,
    ) -> None:
        self.keys = Keys(cluster)
        self.retention = retention or RetentionConfig()
        self.redis_url = redis_url
        self.redis = connect(redis_url, timeout=connect_timeout, name=f"rd-scheduler-{cluster}")
        self.scripts = schema.Scripts(self.redis)
        self.lease_ttl_ms = int(lease_ttl * 1000)
        self.batch_size = batch_size
        self.validate = validate
        self.id = f"scheduler-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.token: str | None = None
        self.allowed_failures = allowed_failures
        self.state = SchedulerState(validate=validate, allowed_failures=allowed_failures)
        self.worker_ttl = worker_ttl
        self.client_ttl = client_ttl
        self.watch = WorkerWatch(self.keys, worker_ttl)
        self.trust_clients_at = 0.0
        self._stopping = False
        self.previous: str | None = None  # the lease holder before us
        self.redis_away: float | None = None  # seconds Redis was away before this lead
        self.summary = Summary()

    # ------------------------------------------------------------------ lease

    def acquire_lease(self, standby: bool = True) -> str:
        """Block until this scheduler holds the lease; returns the fencing token.

        Without ``standby``, give up (``FencedError``) if a live scheduler keeps renewing it."""
        announced = False
        # a dead predecessor's lease expires within one TTL; a live one keeps renewing it
        give_up_at = time.monotonic() + 2 * self.lease_ttl_ms / 1000
        while not self._stopping:
            token = self.scripts.acquire_lease(
                keys=[self.keys.lease, self.keys.lease_token],
                args=[self.token or "", self.lease_ttl_ms],  # ours still: renewed
            )
            if token is not None:
                self.token = token.decode()
                holder = self.redis.hget(self.keys.scheduler, "id")
                self.previous = holder.decode() if holder and holder.decode() != self.id else None
                self.redis.hset(
                    self.keys.scheduler,
                    mapping={
                        "id": self.id,
                        "host": socket.gethostname(),
                        "pid": os.getpid(),
                        "since": time.time(),
                        "token": self.token,
                        "versions": schema.pack(versions()),
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
            if not announced:
                holder = self.redis.hget(self.keys.scheduler, "id")
                logger.info(
                    "standing by: the lease is held by %s", holder.decode() if holder else "?"
                )
                announced = True
            time.sleep(self.lease_ttl_ms / 3000)  # lease expiry is time-based by nature
        raise FencedError("stopped while waiting for the lease")

    def release_lease(self) -> None:
        """Hand the cluster over at once (a standby need not wait for the lease to expire)."""
        if self.token is None:
            return
        try:
            self.apply([["DEL", self.keys.lease]])
            logger.info("scheduler %s released the lease (token %s)", self.id, self.token)
        except (FencedError, redis.RedisError) as exc:
            logger.warning("could not release the lease: %s", exc)
        self.token = None

    def renew_lease(self) -> None:
        token = self.scripts.acquire_lease(
            keys=[self.keys.lease, self.keys.lease_token], args=[self.token, self.lease_ttl_ms]
        )
        if token is None or token.decode() != self.token:
            raise FencedError(f"scheduler {self.id} lost its lease (token {self.token})")

    # ------------------------------------------------------------------ main loop

    def run(self, standby: bool = False) -> None:
        """Lead the cluster until stopped.  A lost Redis is waited for (with backoff) and
        then the lease, the state and the pending entries are taken up again."""
        while not self._stopping:
            try:
                # again after Redis was away: one that came back empty needs it all anew
                schema.ensure_cluster(self.redis, self.keys)
                self.acquire_lease(standby or self.token is not None)
                self.state = self._load()
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
        backoff = Backoff(base=0.05, cap=2.0)
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
        block_ms = max(1, min(self.lease_ttl_ms // 3, int(CHECK_INTERVAL * 1000)))
        next_check = 0.0
        while not self._stopping:
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + CHECK_INTERVAL
                self.look_for_the_dead()
                # every entry is acknowledged by the write that applies it, so anything
                # pending now was read by a stale scheduler before it found itself fenced
                pending = True
            streams = {
                self.keys.worker_stream: "0" if pending else ">",
                self.keys.client_stream: "0" if pending else ">",
            }
            reply = self.redis.xreadgroup(
                schema.SCHEDULER_GROUP,
                schema.SCHEDULER_CONSUMER,
                streams,
                count=self.batch_size,
                block=None if pending else block_ms,
            )
            entries = [
                (s.decode(), eid, fields) for s, items in reply or [] for eid, fields in items
            ]
            if pending and not entries:
                pending = False
                continue
            if not entries:
                if self.summary.due():
                    self.apply([self.summary.command(self.keys, self.state, self.id)])
                else:
                    self.renew_lease()
                continue
            for batch in _by_size(entries, MAX_BATCH_BYTES):
                self.process(batch)

    def look_for_the_dead(self) -> None:
        """Remove the workers and clients that are gone.  A process that leaves says
        goodbye on its stream before its connections and its ``alive`` key go, so the
        entries waiting now are applied first: one that left is not also recorded dead."""
        dead = self.watch.check(self.redis, self.state.workers) + self._gone_clients()
        if not dead:
            return
        reply = self.redis.xreadgroup(
            schema.SCHEDULER_GROUP,
            schema.SCHEDULER_CONSUMER,
            {self.keys.worker_stream: ">", self.keys.client_stream: ">"},
            count=self.batch_size,
        )
        entries = [(s.decode(), eid, fields) for s, items in reply or [] for eid, fields in items]
        *first, last = _by_size(entries, MAX_BATCH_BYTES)
        for batch in first:
            self.process(batch)
        self.process(last, dead)

    def _gone_clients(self) -> list[Event]:
        """Clients whose heartbeat key expired: their keys are released as if they had
        closed (a crashed notebook must not pin results in the cluster forever)."""
        if time.monotonic() < self.trust_clients_at or not self.state.clients:
            return []
        clients = list(self.state.clients)
        pipe = self.redis.pipeline(transaction=False)
        for client in clients:
            pipe.exists(self.keys.client_alive(client))
        gone = [c for c, alive in zip(clients, pipe.execute(), strict=True) if not alive]
        for client in gone:
            logger.warning(
                "client %s stopped heartbeating for %g s: releasing its keys",
                client,
                self.client_ttl,
            )
        return [CloseClient(client=client, stimulus_id=f"client-ttl-{client}") for client in gone]

    def _load(self) -> SchedulerState:
        return load_state(self.redis, self.keys, self.validate, self.allowed_failures)

    def stop(self) -> None:
        self._stopping = True

    def process(
        self, entries: list[tuple[str, bytes, dict[bytes, bytes]]], events: list[Event] = ()
    ) -> None:
        """Apply one batch of stream entries: decode, transition, write atomically.

        If the state machine raises on a batch (a bug, or a message that passed validation
        but makes no sense), the state is reloaded from Redis and the entries are retried
        one by one; the entry that still fails is dead-lettered, so one bad message can
        never stop the cluster or crash every scheduler that reads it after a restart."""
        try:
            self._process(entries, list(events))
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
            stream, entry_id, fields = entries[0]
            self.apply(
                [
                    self._dead_letter(stream, entry_id, fields, f"state machine failed: {exc!r}"),
                    ["XACK", stream, schema.SCHEDULER_GROUP, entry_id],
                    ["XDEL", stream, entry_id],
                ]
            )

    def _process(
        self, entries: list[tuple[str, bytes, dict[bytes, bytes]]], events: list[Event]
    ) -> None:
        commands: list[list[Any]] = []
        acks: dict[str, list[bytes]] = defaultdict(list)
        received: list[Event] = []
        for stream, entry_id, fields in entries:
            acks[stream].append(entry_id)
            try:
                received.extend(decode_entry(entry_id, fields, stream.rsplit(":", 1)[-1]))
            except ProtocolError as exc:
                commands.append(self._dead_letter(stream, entry_id, fields, str(exc)))
                if stream == self.keys.client_stream:  # its client must not wait forever
                    received.extend(rejected_graphs(entry_id, fields, str(exc), "clients"))
        events = received + events  # what the processes said, then the scheduler's verdicts
        instructions = self.state.handle_stimulus(*events)
        commands = self.to_commands(instructions) + commands
        commands += self._story(events, instructions)
        self.summary.count(self.state, changed=bool(instructions))
        if self.summary.due():
            commands.append(self.summary.command(self.keys, self.state, self.id))
        for stream, ids in acks.items():
            commands.append(["XACK", stream, schema.SCHEDULER_GROUP, *ids])
            commands.append(["XDEL", stream, *ids])
        commands.append(["HSET", self.keys.meta, "seq", self.state.seq])
        self.apply(commands)

    def _dead_letter(
        self, stream: str, entry_id: bytes, fields: dict[bytes, bytes], error: str
    ) -> list[Any]:
        logger.warning("dead-lettered entry %s of %s: %s", entry_id.decode(), stream, error)
        # a bounded copy: a stranger's entry may have any number of fields of any size
        sample = schema.pack({k: v[:DEAD_LETTER_SAMPLE] for k, v in list(fields.items())[:16]})
        return [
            "XADD",
            self.keys.dead_letter,
            "MAXLEN",
            "~",
            10_000,
            "*",
            "stream",
            stream,
            "id",
            entry_id,
            "error",
            error[:DEAD_LETTER_SAMPLE],
            "nfields",
            len(fields),
            "sample",
            sample,
        ]

    def apply(self, commands: list[list[Any]]) -> None:
        try:
            self.scripts.apply_fenced(
                keys=[self.keys.lease],
                args=[self.token, schema.pack_for_lua(commands), self.lease_ttl_ms],
            )
        except redis.ResponseError as exc:
            if "FENCED" in str(exc):
                raise FencedError(f"scheduler {self.id}: {exc}") from exc
            logger.exception("applying a batch failed; reloading state from Redis")
            self.state = self._load()
            raise

    # ------------------------------------------------------------------ translation

    def to_commands(self, instructions: list[Instruction]) -> list[list[Any]]:
        """Turn instructions into Redis commands, coalescing per key, client and worker."""
        k = self.keys
        cmds: list[list[Any]] = []
        task_fields: dict[str, dict[str, Any]] = {}
        enqueue: dict[str, float] = {}
        enqueue_on: dict[tuple[str, str], float] = {}  # (worker, key) -> score
        dequeue: list[str] = []
        dequeue_on: dict[str, list[str]] = defaultdict(list)  # worker -> keys
        client_msgs: dict[str, list[dict[str, Any]]] = defaultdict(list)
        worker_msgs: dict[str, list[dict[str, Any]]] = defaultdict(list)
        free_keys: dict[str, list[str]] = defaultdict(list)
        unclaims: dict[str, list[str]] = defaultdict(list)
        exists: dict[str, bool] = {}  # task key -> stored (True) or forgotten (False), last wins
        forgotten: list[str] = []
        for ins in instructions:
            if isinstance(ins, SetState):
                f = task_fields.setdefault(ins.key, {})
                f["state"] = ins.state
                f.update(ins.fields)
            elif isinstance(ins, StoreTask):
                f = task_fields.setdefault(ins.key, {})
                f.update(
                    state=ins.state,
                    deps=schema.pack(ins.deps),
                    score=ins.score,
                    retries=ins.retries,
                    workers=" ".join(ins.restrict),
                )
                if ins.spec is not None:
                    f["spec"] = ins.spec
                exists[ins.key] = True
            elif isinstance(ins, Enqueue):
                if ins.queued_on:  # for CLAIM: the other ready sets to take it out of
                    task_fields.setdefault(ins.key, {})["queued_on"] = " ".join(ins.queued_on)
                if ins.workers:
                    for worker in ins.workers:
                        enqueue_on[worker, ins.key] = ins.score
                else:
                    enqueue[ins.key] = ins.score
            elif isinstance(ins, Dequeue):
                # removals are written before additions, so a later Enqueue of the same
                # key in this batch wins and an earlier one is cancelled here
                enqueue.pop(ins.key, None)
                dequeue.append(ins.key)
                for worker in ins.workers:
                    enqueue_on.pop((worker, ins.key), None)
                    dequeue_on[worker].append(ins.key)
            elif isinstance(ins, Unclaim):
                unclaims[ins.worker].append(ins.key)
            elif isinstance(ins, ClientMsg):
                client_msgs[ins.client].append(ins.msg.to_dict())
            elif isinstance(ins, WorkerMsg):
                if isinstance(ins.msg, FreeKeys):
                    free_keys[ins.worker].extend(ins.msg.keys)
                else:
                    # the worker reads its messages in the order they were made: free-keys
                    # made before this one go before it (keys-recorded must follow them)
                    merged = free_keys.pop(ins.worker, None)
                    if merged:
                        worker_msgs[ins.worker].append(FreeKeys(merged).to_dict())
                    worker_msgs[ins.worker].append(ins.msg.to_dict())
            elif isinstance(ins, Forget):
                task_fields.pop(ins.key, None)
                forgotten.append(ins.key)
                exists[ins.key] = False
            elif isinstance(ins, SetWants):
                if ins.add:
                    cmds.extend(_chunked(["SADD", k.client_wants(ins.client)], ins.add))
                if ins.remove:
                    cmds.extend(_chunked(["SREM", k.client_wants(ins.client)], ins.remove))
            elif isinstance(ins, ForgetClient):
                cmds += [
                    ["DEL", k.client_wants(ins.client), k.client_events(ins.client)],
                    ["HDEL", k.clients, ins.client],
                ]
            elif isinstance(ins, RecordDeath):
                now = time.time()
                cmds.append(
                    [
                        "XADD",
                        k.deaths,
                        "MAXLEN",
                        self.retention.deaths,
                        "*",
                        "m",
                        schema.pack({"time": now, **ins.record}),
                    ]
                )
                fields = death_fields(ins.record)
                cmds.append(self._event_command("worker-died", now, **fields))
            elif isinstance(ins, LogEvent):
                cmds.append(self._event_command(ins.kind, time.time(), **ins.fields))
            elif isinstance(ins, ClaimAccepted):
                pass  # the claim script wrote it; the story tells it
            elif isinstance(ins, ResetCluster):
                # what this batch wrote so far was about tasks that are gone now
                for pending in (
                    task_fields,
                    enqueue,
                    enqueue_on,
                    dequeue_on,
                    exists,
                    unclaims,
                    free_keys,
                ):
                    pending.clear()
                dequeue.clear()
                forgotten.clear()
                cmds.append(["DEL", k.ready, k.tasks])
                cmds.extend(["DEL", k.task(key)] for key in ins.task_keys)
                cmds.extend(["DEL", k.worker_processing(w), k.worker_ready(w)] for w in ins.workers)
                cmds.extend(["DEL", k.client_wants(c)] for c in ins.clients)
            elif isinstance(ins, ForgetWorker):
                story_ttl_ms = int(self.retention.worker_story_ttl * 1000)
                cmds += [
                    [
                        "DEL",
                        k.worker_processing(ins.worker),
                        k.worker_inbox(ins.worker),
                        k.worker_ready(ins.worker),
                    ],
                    ["HDEL", k.workers, ins.worker],
                    ["HDEL", k.heartbeats, ins.worker],
                    # its story outlives it a while: "what was it doing?"
                    ["PEXPIRE", k.worker_story(ins.worker), story_ttl_ms],
                ]
            else:  # pragma: no cover - a new instruction without a translation is a bug
                raise TypeError(f"no Redis translation for {ins!r}")
        # a key forgotten and submitted again in one batch: delete first, then write afresh
        cmds.extend(["DEL", k.task(key)] for key in forgotten)
        gone = [key for key, stored in exists.items() if not stored]
        if gone:
            cmds.extend(_chunked(["SREM", k.tasks], gone))
        stored = [key for key, stored in exists.items() if stored]
        if stored:
            cmds.extend(_chunked(["SADD", k.tasks], stored))
        for key, fields in task_fields.items():
            if fields.get("state", "processing") != "processing":
                fields["worker"] = ""  # only a claim names the worker of a processing task
            cmds.append(["HSET", k.task(key), *[x for kv in fields.items() for x in kv]])
        if dequeue:
            cmds.extend(_chunked(["ZREM", k.ready], dequeue))
        for worker, keys in dequeue_on.items():
            cmds.extend(_chunked(["ZREM", k.worker_ready(worker)], keys))
        for worker, keys in unclaims.items():
            cmds.extend(_chunked(["SREM", k.worker_processing(worker)], keys))
        for worker, keys in free_keys.items():
            worker_msgs[worker].append(FreeKeys(keys).to_dict())
        for worker, msgs in worker_msgs.items():
            cmds.append(["XADD", k.worker_inbox(worker), "*", "m", schema.pack(msgs)])
        for client, msgs in client_msgs.items():
            cmds.append(["XADD", k.client_events(client), "*", "m", schema.pack(msgs)])
        per_worker: dict[str, list[Any]] = defaultdict(list)
        for (worker, key), score in enqueue_on.items():
            per_worker[worker] += [score, key]
        for worker, worker_pairs in per_worker.items():
            cmds.extend(_chunked(["ZADD", k.worker_ready(worker)], worker_pairs, step=2))
        if enqueue:
            pairs = [x for key, score in enqueue.items() for x in (score, key)]
            cmds.extend(_chunked(["ZADD", k.ready], pairs, step=2))
        if enqueue or enqueue_on:
            cmds.append(
                [
                    "XADD",
                    k.ready_signal,
                    "MAXLEN",
                    "~",
                    schema.READY_SIGNAL_MAXLEN,
                    "*",
                    "n",
                    len(enqueue) + len(enqueue_on),
                ]
            )
        return cmds

    def _event_command(self, kind: str, now: float, **fields: Any) -> list[Any]:
        return event_command(self.keys.events, self.retention.events, kind, now, **fields)

    def _event(self, kind: str, **fields: Any) -> None:
        self.redis.execute_command(*self._event_command(kind, time.time(), **fields))

    def _story(self, events: list[Event], instructions: list[Instruction]) -> list[list[Any]]:
        """The batch's task transitions for ``rd:{c}:story``: ``[key, state, stimulus_id]``
        each, with what caused each stimulus (``[op, origin]``), in entries of at most
        ``STORY_CHUNK`` transitions.  ``redisdask inspect task`` reads a task's story here."""
        transitions: list[list[str]] = []
        for ins in instructions:
            if isinstance(ins, ClaimAccepted):
                transitions.append([ins.key, "processing", ins.stimulus_id])
            elif isinstance(ins, SetState | StoreTask):
                transitions.append([ins.key, ins.state, ins.stimulus_id])
            elif isinstance(ins, Forget):
                transitions.append([ins.key, "forgotten", ins.stimulus_id])
        if not transitions:
            return []
        causes = {ev.stimulus_id: [ev.op, _origin(ev)] for ev in events}
        now = time.time()
        cmds = []
        for i in range(0, len(transitions), schema.STORY_CHUNK):
            chunk = transitions[i : i + schema.STORY_CHUNK]
            used = {sid: causes[sid] for _, _, sid in chunk if sid in causes}
            entry = schema.pack({"time": now, "transitions": chunk, "causes": used})
            cmds.append(["XADD", self.keys.story, "MAXLEN", self.retention.story, "*", "m", entry])
        return cmds


def _origin(ev: Event) -> str:
    """The process a stimulus came from: a worker, a client, or the scheduler itself."""
    return getattr(ev, "worker", "") or getattr(ev, "client", "") or "scheduler"


class Summary:
    """Task counts per prefix and state and finished tasks per second, written to
    ``rd:{c}:summary`` while anything changes, so that ``status`` and ``monitor`` read one
    hash instead of every task.  Counting is a pass over the tasks in memory, so the
    interval between writes grows with what a pass costs: at least ``SUMMARY_INTERVAL``,
    and the passes never take more than ``SUMMARY_SHARE`` of the scheduler's time."""

    def __init__(self, finished_total: int = 0, erred_total: int = 0) -> None:
        self.finished_total = finished_total
        self.erred_total = erred_total
        self.per_second: Counter[int] = Counter()
        self.dirty = True
        self.next_write = 0.0
        self._state: SchedulerState | None = None  # whose counters were last read
        self._seen = (0, 0)  # its (n_finished, n_erred) then

    @classmethod
    def resumed(cls, r: redis.Redis, keys: Keys) -> Summary:
        """Carry the totals on from the summary of the scheduler before us."""
        totals = r.hmget(keys.summary, "finished_total", "erred_total")
        return cls(*(int(v or 0) for v in totals))

    def count(self, state: SchedulerState, changed: bool) -> None:
        """Take in what the last batch did: results in and tasks erred (whatever made them
        err: their own exception, a dependency's, ``KilledWorker``)."""
        if state is not self._state:  # a reloaded state counts from zero again
            self._state, self._seen = state, (0, 0)
        finished = state.n_finished - self._seen[0]
        self.erred_total += state.n_erred - self._seen[1]
        self._seen = (state.n_finished, state.n_erred)
        if finished:
            self.finished_total += finished
            self.per_second[int(time.time())] += finished
        self.dirty = self.dirty or changed

    def due(self) -> bool:
        return self.dirty and time.monotonic() >= self.next_write

    def command(self, keys: Keys, state: SchedulerState, scheduler_id: str) -> list[Any]:
        started = time.monotonic()
        self.dirty = False
        now = time.time()
        oldest = int(now) - THROUGHPUT_WINDOW
        for second in [s for s in self.per_second if s < oldest]:
            del self.per_second[second]
        by_prefix: dict[str, Counter[str]] = defaultdict(Counter)
        for ts in state.tasks.values():
            by_prefix[ts.prefix][ts.state] += 1
        if len(by_prefix) > MAX_PREFIXES:  # keys with no hash in them: each its own prefix
            ranked = sorted(by_prefix, key=lambda p: -sum(by_prefix[p].values()))
            other: Counter[str] = Counter()
            for prefix in ranked[MAX_PREFIXES - 1 :]:
                other.update(by_prefix.pop(prefix))
            by_prefix["other"] = other
        fields = {
            "time": now,
            "scheduler": scheduler_id,
            "prefixes": schema.pack({p: dict(c) for p, c in by_prefix.items()}),
            "finished": schema.pack(sorted(self.per_second.items())),
            "finished_total": self.finished_total,
            "erred_total": self.erred_total,
            "clients": len(state.clients),
        }
        spent = time.monotonic() - started
        self.next_write = time.monotonic() + max(SUMMARY_INTERVAL, spent / SUMMARY_SHARE)
        return ["HSET", keys.summary, *[x for kv in fields.items() for x in kv]]


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
        # just (re)started, or back after Redis was away: heartbeats that lapsed meanwhile
        # say nothing yet; every live worker renews its own within one TTL
        self.trust_heartbeats_at = time.monotonic() + worker_ttl
        self.missing: dict[str, int] = {}  # worker -> consecutive looks without connections
        self.seen_on: dict[str, str] = {}  # worker -> Redis run_id when last seen connected
        self.run_id = ""  # of the Redis server at the previous look
        self.warned = False

    def check(self, r: redis.Redis, workers: dict[str, Any]) -> list[Event]:
        if not workers:
            return []
        addresses = list(workers)
        pipe = r.pipeline(transaction=False)
        pipe.client_list(_type="normal")
        pipe.info("server")
        for address in addresses:
            pipe.exists(self.keys.worker_alive(address))
        connections, server, *alive = pipe.execute(raise_on_error=False)
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
        if not dead:
            return []
        pipe = r.pipeline(transaction=False)
        for address in dead:
            pipe.hget(self.keys.heartbeats, address)
        beats = pipe.execute()
        events: list[Event] = []
        for (address, (how, reason)), beat in zip(dead.items(), beats, strict=True):
            self.missing.pop(address, None)
            self.seen_on.pop(address, None)
            last = schema.unpack(beat) if beat else {}
            age = f"; last heartbeat {time.time() - last['time']:.1f} s ago" if last else ""
            events.append(
                RemoveWorker(
                    worker=address,
                    reason=reason + age,
                    how=how,
                    evidence={"last_heartbeat": last},
                    stimulus_id=f"watch-{how}-{time.time():.6f}",
                )
            )
            logger.warning("worker %s is dead (%s): %s%s", address, how, reason, age)
        return events


def _by_size(
    entries: list[tuple[str, bytes, dict[bytes, bytes]]], limit: int
) -> list[list[tuple[str, bytes, dict[bytes, bytes]]]]:
    """Split a read into batches of at most ``limit`` payload bytes (one entry at least)."""
    batches: list[list[tuple[str, bytes, dict[bytes, bytes]]]] = [[]]
    size = 0
    for item in entries:
        n = sum(len(k) + len(v) for k, v in item[2].items())
        if batches[-1] and size + n > limit:
            batches.append([])
            size = 0
        batches[-1].append(item)
        size += n
    return batches


def _chunked(head: list[Any], items: list[Any], step: int = 1) -> list[list[Any]]:
    size = MAX_ARGS - MAX_ARGS % step
    return [head + items[i : i + size] for i in range(0, len(items), size)]


def decode_entry(entry_id: bytes, fields: dict[bytes, bytes], stream: str = "") -> list[Event]:
    """Decode one stream entry into events; ProtocolError when it is malformed.  The
    stimulus ids name the stream, the entry and the message: ``workers:1700000000000-0/2``
    (entry ids are unique per stream only)."""
    raw = fields.get(b"m")
    if raw is None:
        raise ProtocolError(f"entry has no 'm' field (fields: {sorted(fields)[:5]})")
    try:
        msgs = schema.unpack(raw)
    except Exception as exc:
        raise ProtocolError(f"field 'm' is not msgpack: {exc}") from exc
    if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
        raise ProtocolError(f"field 'm' should be a list of maps, got {type(msgs).__name__}")
    sid = f"{stream}:{entry_id.decode()}" if stream else entry_id.decode()
    return [parse(m, SCHEDULER_EVENTS, f"{sid}/{i}") for i, m in enumerate(msgs)]


def rejected_graphs(
    entry_id: bytes, fields: dict[bytes, bytes], reason: str, stream: str = ""
) -> list[RejectedGraph]:
    """For a refused entry of the clients stream: one ``RejectedGraph`` per update-graph
    message in it that still names its client and some str keys (its ``wanted`` keys and
    its tasks' keys), so that client's futures err instead of waiting forever.  What
    cannot be read (not msgpack, no client, keys that are not str) is skipped: there is
    nobody or nothing to tell."""
    try:
        msgs = schema.unpack(fields.get(b"m") or b"")
    except Exception:
        return []
    if not isinstance(msgs, list):
        return []
    sid = f"{stream}:{entry_id.decode()}" if stream else entry_id.decode()
    rejected = []
    for i, msg in enumerate(msgs):
        if not isinstance(msg, dict) or msg.get("op") != "update-graph":
            continue
        client, wanted, tasks = msg.get("client"), msg.get("wanted"), msg.get("tasks")
        keys = [k for k in wanted if isinstance(k, str)] if isinstance(wanted, list) else []
        if isinstance(tasks, list):
            keys += [
                t["key"] for t in tasks if isinstance(t, dict) and isinstance(t.get("key"), str)
            ]
        if isinstance(client, str) and client and keys:
            rejected.append(
                RejectedGraph(
                    client=client,
                    keys=list(dict.fromkeys(keys)),
                    reason=reason,
                    stimulus_id=f"{sid}/{i}",
                )
            )
    return rejected


# --------------------------------------------------------------------------- recovery


def load_state(
    r: redis.Redis, keys: Keys, validate: bool = False, allowed_failures: int = 3
) -> SchedulerState:
    """Rebuild the scheduler's state from Redis (start-up, and after a failed write)."""
    seq = r.hget(keys.meta, "seq")
    state = SchedulerState(validate=validate, seq=int(seq or 0), allowed_failures=allowed_failures)
    for address, info in r.hgetall(keys.workers).items():
        state.handle_stimulus(
            AddWorker(worker=address.decode(), info=schema.unpack(info), stimulus_id="load")
        )
    task_keys = [k.decode() for k in r.smembers(keys.tasks)]
    records: dict[str, dict[bytes, bytes]] = {}
    for i in range(0, len(task_keys), 1000):
        chunk = task_keys[i : i + 1000]
        pipe = r.pipeline(transaction=False)
        for key in chunk:
            pipe.hgetall(keys.task(key))
        records.update(zip(chunk, pipe.execute(), strict=True))
    for key, rec in records.items():
        if not rec:
            continue
        ts = state.tasks[key] = TaskState(
            key,
            state=rec[b"state"].decode(),
            score=float(rec.get(b"score", 0)),
            has_spec=b"spec" in rec,
        )
        ts.nbytes = int(rec.get(b"nbytes", 0) or 0)
        ts.type = rec.get(b"type", b"").decode()
        ts.retries = int(rec.get(b"retries", 0) or 0)
        ts.restrict = tuple(rec.get(b"workers", b"").decode().split())
        if ts.state == "queued" and ts.restrict:
            # (a record from before queued_on existed: its workers were addresses)
            queued_on = rec.get(b"queued_on", rec.get(b"workers", b"")).decode().split()
            ts.queued_on = tuple(w for w in queued_on if w in state.workers)
        ts.erred_on = rec.get(b"erred_on", b"").decode() or None
        ts.suspicious = int(rec.get(b"suspicious", 0) or 0)
        ts.replicas = int(rec.get(b"replicas", 1) or 1)
        ts.deaths = schema.unpack(rec[b"deaths"]) if rec.get(b"deaths") else []
        ts.killed = rec.get(b"killed") or None
        ts.exception_blame = rec.get(b"exception_blame", b"").decode() or None
        ts.rejected = bool(rec.get(b"rejected"))
        if ts.state == "no-worker":
            state.unrunnable.add(ts)
        ts.who_has = {w for w in rec.get(b"who_has", b"").decode().split() if w in state.workers}
        for field in ("exception", "traceback"):
            setattr(ts, field, rec.get(field.encode()) or None)
        for field in ("exception_text", "traceback_text"):
            setattr(ts, field, rec.get(field.encode(), b"").decode())
        if ts.state == "processing":
            ts.processing_on = rec.get(b"worker", b"").decode()
    for key, rec in records.items():
        ts = state.tasks.get(key)
        if ts is None:
            continue
        for dep_key in schema.unpack(rec[b"deps"]) if rec.get(b"deps") else []:
            dep = state.tasks.get(dep_key)
            if dep is not None:
                ts.dependencies.add(dep)
                dep.dependents.add(ts)
    for ts in state.tasks.values():
        if ts.state in HOLDS_DEPENDENCIES:
            ts.waiting_on = {d for d in ts.dependencies if d.state != "memory"}
            for dep in ts.dependencies:
                dep.waiters.add(ts)
        if ts.processing_on and ts.processing_on in state.workers:
            state.workers[ts.processing_on].processing.add(ts)
        for w in ts.who_has:
            state.workers[w].has_what.add(ts)
    for client_id in r.hkeys(keys.clients):
        cid = client_id.decode()
        wanted = state.clients.setdefault(cid, set())
        for key in r.smembers(keys.client_wants(cid)):
            ts = state.tasks.get(key.decode())
            if ts is not None:
                ts.who_wants.add(cid)
                wanted.add(ts)
    logger.info(
        "loaded %d tasks, %d workers, %d clients from Redis",
        len(state.tasks),
        len(state.workers),
        len(state.clients),
    )
    return state


def main(redis_url: str, cluster: str, *, standby: bool = False, **options: Any) -> None:
    scheduler = Scheduler(redis_url, cluster, **options)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: scheduler.stop())
    try:
        scheduler.run(standby=standby)
    except FencedError as exc:
        if scheduler._stopping:  # a standby asked to stop before it ever led
            return
        logger.error("stopping: %s", exc)
        raise SystemExit(1) from exc
    scheduler.release_lease()
