"""The scheduler's mapping onto Redis: instructions in, Redis commands out, and back.

* ``Translator.to_commands``: the state machine's instructions of one batch as the Redis
  commands of its ``APPLY_FENCED`` write, coalesced per task, worker and client (one
  short method per instruction type, chosen by type; the coalescing state of the batch
  is a ``_Batch``).  ``Translator.story`` adds the batch's task transitions.
* ``load_state``: the inverse, the state rebuilt from what those commands wrote.
* ``decode_entry`` and ``rejected_graphs``: stream entries into events.
* ``Summary``: the ``summary`` hash that ``status`` and ``monitor`` read.

Task hashes go through the one codec of ``redisdask/store/task_record.py``.  Nothing here
talks to Redis except the two readers (``load_state``, ``Summary.resumed``); the driver
(``scheduler/driver.py``) owns the loop, the lease and the writes.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import redis

from redisdask.config import RetentionConfig
from redisdask.durations import Durations
from redisdask.errors import ProtocolError, RecordError
from redisdask.protocol import (
    NO_SCORE,
    SCHEDULER_EVENTS,
    AddWorker,
    ComputeTask,
    FreeKeys,
    Stimulus,
    parse,
)
from redisdask.scheduler.instructions import (
    ClaimAccepted,
    ClientMsg,
    Dequeue,
    Enqueue,
    Forget,
    ForgetClient,
    ForgetWorker,
    Instruction,
    LogEvent,
    MarkChain,
    Push,
    RecordDeath,
    RecordRebalance,
    ResetCluster,
    SetDurations,
    SetState,
    SetWants,
    StoreTask,
    Unclaim,
    WorkerMsg,
)
from redisdask.scheduler.moves import RebalanceConfig
from redisdask.scheduler.quarantine import REBALANCE_RECORD_TTL_MS, Quarantined, record_copy
from redisdask.scheduler.state import SchedulerState
from redisdask.scheduler.tasks import (
    EMPTY,
    RejectedGraph,
    StreamPosition,
    TaskState,
    added,
    stream_position,
)
from redisdask.scheduler.transitions import HOLDS_DEPENDENCIES
from redisdask.store import codecs, keyspace, scripts
from redisdask.store.codecs import RebalanceRecord, evidence
from redisdask.store.eventlog import death_fields, event_command
from redisdask.store.keyspace import Keys
from redisdask.store.task_record import TaskRecord
from redisdask.utils.heap import no_collections

logger = logging.getLogger("redisdask.scheduler")

MAX_ARGS = 2000  # Lua's unpack() limit is ~8000 arguments per command
# the states of a task whose news a client may wait for (given to a client whose wants
# set was malformed, when nobody else wants them)
WAITED_ON = frozenset({"waiting", "queued", "processing", "no-worker", "memory", "erred"})
LOAD_PAGE = 2000  # task records per LOAD_TASKS call (a few milliseconds of Redis's time)
SUMMARY_INTERVAL = 0.5  # seconds between writes of the summary hash while tasks change
SUMMARY_SHARE = 0.05  # the most of the scheduler's time the summary's passes may take
THROUGHPUT_WINDOW = 60  # seconds of finished-task counts the summary keeps
MAX_PREFIXES = 100  # task prefixes counted apart in the summary; the rest are "other"
MAX_NO_WORKER = 5  # kinds of no-worker tasks (by what they ask for) the summary explains


# --------------------------------------------------------------------------- translation


@dataclass(slots=True)
class _Batch:
    """What one batch writes, coalesced until ``commands``: the fields per task hash
    (last write wins), the ready-set changes, the messages per worker and client."""

    cmds: list[list[Any]] = field(default_factory=list)  # in order, before the coalesced
    task_fields: dict[str, dict[str, Any]] = field(default_factory=dict)
    enqueue: dict[str, float] = field(default_factory=dict)
    enqueue_on: dict[tuple[str, str], float] = field(default_factory=dict)  # (zset, key)
    dequeue: list[str] = field(default_factory=list)
    dequeue_on: defaultdict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    client_msgs: defaultdict[str, list[Any]] = field(default_factory=lambda: defaultdict(list))
    worker_msgs: defaultdict[str, list[Any]] = field(default_factory=lambda: defaultdict(list))
    # worker -> {(seen, run): keys}: a worker's free-keys of one batch, one message each
    free_keys: defaultdict[str, dict[tuple[str, float | None], list[str]]] = field(
        default_factory=lambda: defaultdict(dict)
    )
    unclaims: defaultdict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    pushes: defaultdict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    exists: dict[str, bool] = field(default_factory=dict)  # stored (True) or forgotten, last wins
    forgotten: list[str] = field(default_factory=list)
    # per rebalance record: field -> value (None: deleted), last wins; and whether it is done
    rebalances: dict[str, dict[str, Any]] = field(default_factory=dict)
    rebalances_done: dict[str, bool] = field(default_factory=dict)

    def fields(self, key: str) -> dict[str, Any]:
        return self.task_fields.setdefault(key, {})

    def reset_tasks(self) -> None:
        """Drop what the batch was to write about tasks: they are all gone now."""
        for pending in (self.task_fields, self.enqueue, self.enqueue_on, self.dequeue_on,
                        self.exists, self.unclaims, self.free_keys, self.pushes):  # fmt: skip
            pending.clear()
        self.dequeue.clear()
        self.forgotten.clear()

    def commands(self, k: Keys) -> list[list[Any]]:
        """The batch's commands: the ordered ones, then the coalesced ones.  Task hashes
        are deleted before they are written (a key forgotten and submitted again in one
        batch), the inboxes are written before the ready sets (a worker's claim returns
        its inbox first), and the ready sets last, followed by one ready-signal."""
        cmds = self.cmds
        cmds.extend(["DEL", k.task(key)] for key in self.forgotten)
        gone = [key for key, stored in self.exists.items() if not stored]
        if gone:
            cmds.extend(_chunked(["SREM", k.tasks], gone))
        stored = [key for key, stored in self.exists.items() if stored]
        if stored:
            cmds.extend(_chunked(["SADD", k.tasks], stored))
        for key, fields in self.task_fields.items():
            if fields.get("state", "processing") != "processing":
                fields["worker"] = ""  # only a claim names the worker of a processing task
            cmds.append(["HSET", k.task(key), *chain.from_iterable(fields.items())])
        if self.dequeue:
            cmds.extend(_chunked(["ZREM", k.ready], self.dequeue))
        for zset, keys in self.dequeue_on.items():
            cmds.extend(_chunked(["ZREM", zset], keys))
        for worker, keys in self.unclaims.items():
            cmds.extend(_chunked(["SREM", k.worker_processing(worker)], keys))
        for worker, by_seen in self.free_keys.items():
            self.worker_msgs[worker].extend(_frees(by_seen))
        for worker, keys in self.pushes.items():
            cmds.extend(_chunked(["SADD", k.worker_processing(worker)], keys))
        for worker, msgs in self.worker_msgs.items():
            entry = [k.worker_inbox(worker), "*", "m", codecs.pack(msgs)]
            pushed = {m["key"] for m in msgs if m["op"] == ComputeTask.op}
            if pushed:  # each task's spec beside it, copied from its record (APPLY_FENCED)
                specs = [x for key in pushed for x in (keyspace.push_spec_field(key), k.task(key))]
                cmds.append([keyspace.XADD_WITH_SPECS, *entry, *specs])
            else:
                cmds.append(["XADD", *entry])
        for client, msgs in self.client_msgs.items():
            cmds.append(["XADD", k.client_events(client), "*", "m", codecs.pack(msgs)])
        per_zset: dict[str, list[Any]] = defaultdict(list)
        for (zset, key), score in self.enqueue_on.items():
            per_zset[zset] += [score, key]
        for zset, zset_pairs in per_zset.items():
            cmds.extend(_chunked(["ZADD", zset], zset_pairs, step=2))
        if self.enqueue:
            pairs = [x for key, score in self.enqueue.items() for x in (score, key)]
            cmds.extend(_chunked(["ZADD", k.ready], pairs, step=2))
        if self.enqueue or self.enqueue_on:
            n = len(self.enqueue) + sum(zset != k.placed for zset, _ in self.enqueue_on)
            signal = ["XADD", k.ready_signal, "MAXLEN", "~", keyspace.READY_SIGNAL_MAXLEN, "*"]
            cmds.append([*signal, "n", n])
        for request, changes in self.rebalances.items():
            record = k.rebalance(request)
            dropped = [name for name, value in changes.items() if value is None]
            pairs = [x for name, value in changes.items() if value is not None
                     for x in (name, value)]  # fmt: skip
            if dropped:
                cmds.extend(_chunked(["HDEL", record], dropped))
            if pairs:
                cmds.extend(_chunked(["HSET", record], pairs, step=2))
            if self.rebalances_done[request]:
                cmds += [["SREM", k.rebalances, request],
                         ["PEXPIRE", record, REBALANCE_RECORD_TTL_MS]]  # fmt: skip
            else:
                cmds.append(["SADD", k.rebalances, request])
        return cmds


class Translator:
    """Instructions into Redis commands, for one cluster's keys and retention."""

    def __init__(self, keys: Keys, retention: RetentionConfig | None = None) -> None:
        self.keys = keys
        self.retention = retention or RetentionConfig()

    def to_commands(self, instructions: list[Instruction]) -> list[list[Any]]:
        """Turn instructions into Redis commands, coalescing per key, client and worker."""
        batch = _Batch()
        for ins in instructions:
            translate = _TRANSLATIONS.get(type(ins))
            if translate is None:  # a new instruction without a translation is a bug
                raise TypeError(f"no Redis translation for {ins!r}")
            translate(self, ins, batch)
        return batch.commands(self.keys)

    def _store_task(self, ins: StoreTask, b: _Batch) -> None:
        stored = {"state": ins.state, "deps": ins.deps, "score": ins.score,
                  "retries": ins.retries, "workers": ins.restrict}  # fmt: skip
        if ins.spec is not None:  # absent stays absent: a key scattered, never submitted
            stored["spec"] = ins.spec
        if ins.resources:  # (absent: none; most tasks need none)
            stored["resources"] = ins.resources
        if ins.loose:
            stored["loose"] = True
        b.fields(ins.key).update(TaskRecord.encode(stored))
        b.exists[ins.key] = True

    def _set_state(self, ins: SetState, b: _Batch) -> None:
        fields = b.fields(ins.key)
        fields["state"] = ins.state
        fields.update(TaskRecord.encode(ins.fields))

    def _forget(self, ins: Forget, b: _Batch) -> None:
        b.task_fields.pop(ins.key, None)
        b.forgotten.append(ins.key)
        b.exists[ins.key] = False

    def _worker_set(self, worker: str, constrained: bool) -> str:
        k = self.keys
        return k.worker_constrained(worker) if constrained else k.worker_ready(worker)

    def _enqueue(self, ins: Enqueue, b: _Batch) -> None:
        # for CLAIM: the other ready sets to take it out of; written even when empty, since
        # a task queued again may have been placed before (on the worker that missed it)
        b.fields(ins.key).update(TaskRecord.encode({"queued_on": ins.queued_on}))
        if ins.workers:
            for worker in ins.workers:
                b.enqueue_on[self._worker_set(worker, ins.constrained), ins.key] = ins.score
            if ins.preferred:  # where other workers find it (see CLAIM), unless sticky
                b.enqueue_on[self.keys.placed, ins.key] = ins.score
                b.fields(ins.key).update(TaskRecord.encode({"sticky": ins.sticky}))
        else:
            b.enqueue[ins.key] = ins.score

    def _dequeue(self, ins: Dequeue, b: _Batch) -> None:
        # removals are written before additions, so a later Enqueue of the same key in
        # this batch wins and an earlier one is cancelled here
        b.enqueue.pop(ins.key, None)
        b.dequeue.append(ins.key)
        b.enqueue_on.pop((self.keys.placed, ins.key), None)  # (placed by data, or not)
        b.dequeue_on[self.keys.placed].append(ins.key)
        if ins.queued_on is not None:  # (a new process at the address may not match)
            b.fields(ins.key).update(TaskRecord.encode({"queued_on": ins.queued_on}))
        for worker in ins.workers:
            zset = self._worker_set(worker, ins.constrained)
            b.enqueue_on.pop((zset, ins.key), None)
            b.dequeue_on[zset].append(ins.key)

    def _unclaim(self, ins: Unclaim, b: _Batch) -> None:
        pushed = b.pushes.get(ins.worker)
        if pushed and ins.key in pushed:  # pushed in this batch: into the set no more
            pushed.remove(ins.key)  # (the SADDs of pushes follow the SREMs)
        else:
            b.unclaims[ins.worker].append(ins.key)

    def _claim_accepted(self, ins: ClaimAccepted, b: _Batch) -> None:
        if ins.rewrite:  # written over since the claim script wrote it (see ClaimAccepted)
            # (and ``claim``: the entry of this claim, which a later one may have written over)
            entry = ins.stimulus_id.partition(":")[2].partition("/")[0]
            b.fields(ins.key).update(state="processing", worker=ins.worker, claim=entry)

    def _mark_chain(self, ins: MarkChain, b: _Batch) -> None:
        b.fields(ins.key).update(TaskRecord.encode({"chain": ins.chain}))

    def _client_msg(self, ins: ClientMsg, b: _Batch) -> None:
        if not keyspace.is_holder(ins.client):  # a holder is no process: nobody would read it
            b.client_msgs[ins.client].append(ins.msg.to_dict())

    def _worker_msg(self, ins: WorkerMsg, b: _Batch) -> None:
        if isinstance(ins.msg, FreeKeys):
            run = ins.msg.run if ins.msg.run == ins.msg.run else None  # (NaN: any run)
            b.free_keys[ins.worker].setdefault((ins.msg.seen, run), []).extend(ins.msg.keys)
            return
        # the worker reads its messages in the order they were made: free-keys made
        # before this one go before it (keys-recorded must follow them)
        merged = b.free_keys.pop(ins.worker, None)
        if merged:
            b.worker_msgs[ins.worker].extend(_frees(merged))
        b.worker_msgs[ins.worker].append(ins.msg.to_dict())

    def _push(self, ins: Push, b: _Batch) -> None:
        fields = {"state": "processing", "worker": ins.worker, "notify": ins.notify}
        b.fields(ins.msg.key).update(TaskRecord.encode(fields))
        self._worker_msg(WorkerMsg(ins.stimulus_id, ins.worker, ins.msg), b)
        b.pushes[ins.worker].append(ins.msg.key)

    def _set_wants(self, ins: SetWants, b: _Batch) -> None:
        wants = self.keys.client_wants(ins.client)
        if ins.add:
            b.cmds.extend(_chunked(["SADD", wants], ins.add))
            if keyspace.is_holder(ins.client):  # what load_state restores holders from
                b.cmds.append(["SADD", self.keys.holders, ins.client])
        if ins.remove:
            b.cmds.extend(_chunked(["SREM", wants], ins.remove))

    def _forget_client(self, ins: ForgetClient, b: _Batch) -> None:
        k = self.keys
        b.cmds.append(
            ["DEL", k.client_wants(ins.client), k.client_events(ins.client),
             k.client_written(ins.client)]
        )  # fmt: skip
        if keyspace.is_holder(ins.client):
            b.cmds.append(["SREM", k.holders, ins.client])
        else:
            b.cmds.append(["HDEL", k.clients, ins.client])

    def _forget_worker(self, ins: ForgetWorker, b: _Batch) -> None:
        k, w = self.keys, ins.worker
        story_ttl_ms = int(self.retention.worker_story_ttl * 1000)
        b.cmds += [
            [
                "DEL",
                k.worker_processing(w),
                k.worker_inbox(w),
                k.worker_ready(w),
                k.worker_constrained(w),
            ],
            ["HDEL", k.workers, w],
            ["HDEL", k.heartbeats, w],
            ["PEXPIRE", k.worker_story(w), story_ttl_ms],  # "what was it doing?" a while
        ]

    def _reset_cluster(self, ins: ResetCluster, b: _Batch) -> None:
        k = self.keys
        b.reset_tasks()  # what this batch wrote so far was about tasks that are gone now
        b.cmds.append(["DEL", k.ready, k.placed, k.tasks])
        b.cmds.extend(["DEL", k.task(key)] for key in ins.task_keys)
        b.cmds.extend(
            ["DEL", k.worker_processing(w), k.worker_ready(w), k.worker_constrained(w)]
            for w in ins.workers
        )
        b.cmds.extend(["DEL", k.client_wants(c)] for c in ins.clients)
        b.cmds.append(["DEL", k.holders])
        # the futures a dataset, variable or queue recorded before now are gone
        b.cmds.append(["HINCRBY", k.meta, "restarts", 1])

    def _record_rebalance(self, ins: RecordRebalance, b: _Batch) -> None:
        changes = b.rebalances.setdefault(ins.request, {})
        for name in ins.drop:
            changes[name] = None
        changes.update(ins.fields)
        b.rebalances_done[ins.request] = b.rebalances_done.get(ins.request, False) or ins.done

    def _record_death(self, ins: RecordDeath, b: _Batch) -> None:
        now = time.time()
        record = codecs.pack({"time": now, **ins.record})
        b.cmds.append(["XADD", self.keys.deaths, "MAXLEN", self.retention.deaths, "*", "m", record])
        b.cmds.append(self.event_command("worker-died", now, **death_fields(ins.record)))

    def _set_durations(self, ins: SetDurations, b: _Batch) -> None:
        items = ins.averages.items()
        pairs = [x for prefix, avg in items if avg is not None for x in (prefix, repr(avg))]
        b.cmds.extend(_chunked(["HSET", self.keys.durations], pairs, step=2))
        forgotten = [prefix for prefix, avg in items if avg is None]
        b.cmds.extend(_chunked(["HDEL", self.keys.durations], forgotten))

    def _log_event(self, ins: LogEvent, b: _Batch) -> None:
        b.cmds.append(self.event_command(ins.kind, time.time(), **ins.fields))

    def event_command(self, kind: str, now: float, **fields: Any) -> list[Any]:
        return event_command(self.keys.events, self.retention.events, kind, now, **fields)

    def story(self, events: list[Stimulus], instructions: list[Instruction]) -> list[list[Any]]:
        """The batch's task transitions for ``rd:{c}:story``: ``[key, state, stimulus_id]``
        each, with what caused each stimulus (``[op, origin]``), in entries of at most
        ``STORY_CHUNK`` transitions.  ``redisdask inspect task`` reads a task's story here."""
        transitions: list[list[str]] = []
        causes: dict[str, list[str]] = {}
        for ins in instructions:
            kind = type(ins)  # (by type, not isinstance: a map's batch has 100,000 of them)
            if kind is SetState or kind is StoreTask:
                transitions.append([ins.key, ins.state, ins.stimulus_id])
            elif kind is ClaimAccepted:
                transitions.append([ins.key, "processing", ins.stimulus_id])
            elif kind is Push:  # its own cause: the worker it went to
                pushed = f"{ins.stimulus_id}/push-{ins.worker}"
                transitions.append([ins.msg.key, "processing", pushed])
                causes[pushed] = ["pushed", ins.worker]
            elif kind is Forget:
                transitions.append([ins.key, "forgotten", ins.stimulus_id])
        if not transitions:
            return []
        causes.update({ev.stimulus_id: [ev.op, _origin(ev)] for ev in events})
        now = time.time()
        cmds = []
        for i in range(0, len(transitions), keyspace.STORY_CHUNK):
            chunk = transitions[i : i + keyspace.STORY_CHUNK]
            used = {sid: causes[sid] for _, _, sid in chunk if sid in causes}
            entry = codecs.pack({"time": now, "transitions": chunk, "causes": used})
            cmds.append(["XADD", self.keys.story, "MAXLEN", self.retention.story, "*", "m", entry])
        return cmds


_TRANSLATIONS: dict[type[Instruction], Callable[[Translator, Any, _Batch], None]] = {
    StoreTask: Translator._store_task,
    SetState: Translator._set_state,
    Forget: Translator._forget,
    Enqueue: Translator._enqueue,
    Dequeue: Translator._dequeue,
    Unclaim: Translator._unclaim,
    ClaimAccepted: Translator._claim_accepted,
    Push: Translator._push,
    MarkChain: Translator._mark_chain,
    ClientMsg: Translator._client_msg,
    WorkerMsg: Translator._worker_msg,
    SetWants: Translator._set_wants,
    ForgetClient: Translator._forget_client,
    ForgetWorker: Translator._forget_worker,
    ResetCluster: Translator._reset_cluster,
    RecordDeath: Translator._record_death,
    RecordRebalance: Translator._record_rebalance,
    LogEvent: Translator._log_event,
    SetDurations: Translator._set_durations,
}


def _origin(ev: Stimulus) -> str:
    """The process a stimulus came from: a worker, a client, or the scheduler itself."""
    return getattr(ev, "worker", "") or getattr(ev, "client", "") or "scheduler"


def _chunked(head: list[Any], items: list[Any], step: int = 1) -> list[list[Any]]:
    size = MAX_ARGS - MAX_ARGS % step
    return [head + items[i : i + size] for i in range(0, len(items), size)]


# --------------------------------------------------------------------------- stream entries


def decode_entry(entry_id: bytes, fields: dict[bytes, bytes], stream: str = "") -> list[Stimulus]:
    """Decode one stream entry into events; ProtocolError when it is malformed.  The
    stimulus ids name the stream, the entry and the message: ``workers:1700000000000-0/2``
    (entry ids are unique per stream only)."""
    raw = fields.get(b"m")
    if raw is None:
        raise ProtocolError(f"entry has no 'm' field (fields: {sorted(fields)[:5]})")
    try:
        msgs = codecs.unpack(raw)
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
        msgs = codecs.unpack(fields.get(b"m") or b"")
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


# --------------------------------------------------------------------------- summary


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
        return cls(*(int(v) if v and v.isdigit() else 0 for v in totals))  # (a bad one: 0)

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
            "prefixes": codecs.pack({p: dict(c) for p, c in by_prefix.items()}),
            "finished": codecs.pack(sorted(self.per_second.items())),
            "finished_total": self.finished_total,
            "erred_total": self.erred_total,
            "clients": sum(not keyspace.is_holder(c) for c in state.clients),
            "no_worker": codecs.pack(no_worker_reasons(state)),
        }
        spent = time.monotonic() - started
        self.next_write = time.monotonic() + max(SUMMARY_INTERVAL, spent / SUMMARY_SHARE)
        return ["HSET", keys.summary, *[x for kv in fields.items() for x in kv]]


def no_worker_reasons(state: SchedulerState) -> list[dict[str, Any]]:
    """Why the ``no-worker`` tasks wait, for the monitor: ``{reason, count, key}`` per kind
    of ask (restriction, resources), the most common first; a task in each as example."""
    kinds: dict[tuple[Any, ...], list[Any]] = {}
    for ts in state.unrunnable:
        kind = (ts.restrict, tuple(sorted((ts.resources or {}).items())), ts.loose)
        seen = kinds.setdefault(kind, [0, ts])
        seen[0] += 1
        if ts.score < seen[1].score:
            seen[1] = ts
    ranked = sorted(kinds.items(), key=lambda item: (-item[1][0], item[1][1].score))
    return [
        {
            "reason": state.placement.why_not(ts.restrict, ts.resources, ts.loose),
            "count": count,
            "key": ts.key,
        }
        for _, (count, ts) in ranked[:MAX_NO_WORKER]
    ]


# --------------------------------------------------------------------------- recovery


def _frees(made: dict[tuple[str, float | None], list[str]]) -> list[dict[str, Any]]:
    """One worker's free-keys of a batch, one message per ``seen`` and ``run`` (in the
    order made: what the state read grows within a batch)."""
    return [
        FreeKeys(keys, seen=seen, run=NO_SCORE if run is None else run).to_dict()
        for (seen, run), keys in made.items()
    ]


def _last_entry(r: redis.Redis, stream: str) -> StreamPosition | None:
    """The id of the last entry ever added to ``stream`` (deleted or not), or None."""
    try:
        info = r.xinfo_stream(stream)
    except redis.ResponseError:  # (no such stream yet)
        return None
    last = info.get("last-generated-id")
    return stream_position(last.decode() if isinstance(last, bytes) else str(last))


def load_state(
    r: redis.Redis,
    keys: Keys,
    validate: bool = False,
    allowed_failures: int = 3,
    rebalance: RebalanceConfig | None = None,
    quarantined: list[Quarantined] | None = None,
) -> SchedulerState:
    """Rebuild the scheduler's state from Redis (start-up, and after a failed write):
    the inverse of ``Translator.to_commands``.  What the task hash does not carry (see
    ``docs/redis-schema.md``) starts afresh: a retirement, replicas being made, holding
    report counts.  The rebalances under way are reloaded with their moves in flight.

    A malformed record is skipped and logged, never raised (``redisdask/scheduler/quarantine.py``):
    it is appended to ``quarantined`` for the driver to dead-letter and repair; a task's
    stands in the state as a ``released`` task without a spec, so that ``BadRecord`` can
    err it and its dependents."""
    bad: list[Quarantined] = [] if quarantined is None else quarantined
    seq = r.hget(keys.meta, "seq")
    try:
        first_seq = int(seq or 0)
    except ValueError:
        logger.warning(
            "the sequence counter of %s is no integer (found %s): counting from 0 again "
            "(it orders the priorities of new submissions only)",
            keys.meta, evidence(seq),
        )  # fmt: skip
        first_seq = 0
    # first: every claim written up to this entry is in the records read below (a claim
    # writes its record and its entry in one script)
    floor = _last_entry(r, keys.worker_stream)
    state = SchedulerState(
        validate=validate,
        seq=first_seq,
        allowed_failures=allowed_failures,
        rebalance=rebalance,
    )
    state.seen_floor = floor
    for raw_address, raw_info in r.hgetall(keys.workers).items():
        address, info = _worker_entry(keys, raw_address, raw_info, bad)
        if address is not None:
            state.handle_stimulus(AddWorker(worker=address, info=info, stimulus_id="load"))
    with no_collections():  # every object made here is kept: nothing to collect
        _load_tasks(r, keys, state, bad)
        _load_wants(r, keys, state, bad)
    state.durations = _load_durations(r, keys)
    for member in sorted(r.smembers(keys.rebalances)):
        name = keys.rebalance(member.decode(errors="replace"))
        try:
            raw = r.hgetall(name)
        except redis.ResponseError:  # (WRONGTYPE: no hash)
            raw = record_copy(r, name)
            error = RecordError(name, "type", evidence(raw[b"type"]), "is no hash")
            bad.append(Quarantined("rebalance", name, member, error, raw))
            continue
        try:
            request = member.decode()
            record = RebalanceRecord.from_hash(raw)
        except (ValueError, TypeError) as exc:
            error = RecordError(name, "?", evidence(raw), f"is malformed ({exc})")
            bad.append(Quarantined("rebalance", name, member, error, raw))
            continue
        state.moves.restore_rebalance(request, record)
    for one in bad:
        one.log(keys)
    logger.info(
        "loaded %d tasks, %d workers, %d clients from Redis%s",
        len(state.tasks),
        len(state.workers),
        len(state.clients),
        f" ({len(bad)} malformed records skipped)" if bad else "",
    )
    return state


def _load_durations(r: redis.Redis, keys: Keys) -> Durations:
    """The duration averages the scheduler wrote; an entry that is no finite number of
    seconds is left out (logged): its prefix has no estimate until its next result."""
    averages = {}
    for raw_prefix, raw in r.hgetall(keys.durations).items():
        prefix = raw_prefix.decode(errors="replace")
        try:
            average = float(raw)
        except ValueError:
            average = math.nan
        if math.isfinite(average) and average >= 0:
            averages[prefix] = average
        else:
            logger.warning("%s: %s holds %s, no duration: ignored until its next result",
                           keys.durations, prefix, evidence(raw))  # fmt: skip
    return Durations(averages)


def _worker_entry(
    keys: Keys, raw_address: bytes, raw_info: bytes, bad: list[Quarantined]
) -> tuple[str | None, dict[str, Any]]:
    """A workers entry: the address and its info; ``{}`` for info that is malformed,
    ``None`` for an address that is no text (both noted in ``bad``)."""
    address = raw_address.decode(errors="replace")
    record = f"{keys.workers}/{address}"
    try:
        address = raw_address.decode()
    except UnicodeDecodeError:
        error = RecordError(record, "address", evidence(raw_address), "is no UTF-8 text")
        bad.append(Quarantined("worker", keys.workers, raw_address, error, {raw_address: raw_info}))
        return None, {}
    try:
        return address, codecs.worker_info(record, raw_info)
    except RecordError as error:
        fields = {raw_address: raw_info}
        bad.append(Quarantined("worker", keys.workers, raw_address, error, fields, address))
        return address, {}


def _load_wants(r: redis.Redis, keys: Keys, state: SchedulerState, bad: list[Quarantined]) -> None:
    """Who wants what: each client's and each holder's wants set (one pipeline).  A set
    of the wrong type is quarantined, and its client is given every task nobody else
    wants: which of them it waits for is unknown, and a future nobody is told about waits
    for ever (at worst they stay until it releases them or closes)."""
    holders = [h.decode() for h in r.smembers(keys.holders)]
    ids = [c.decode() for c in r.hkeys(keys.clients)] + holders
    pipe = r.pipeline(transaction=False)
    for cid in ids:
        pipe.smembers(keys.client_wants(cid))
    tasks = state.tasks
    malformed: list[tuple[str, Quarantined]] = []  # (the client, its record)
    for cid, members in zip(ids, pipe.execute(raise_on_error=False), strict=True):
        wanted = state.clients.setdefault(cid, set())
        if isinstance(members, redis.ResponseError):  # (WRONGTYPE: not a set)
            malformed.append((cid, _bad_wants(r, keys, cid)))
            continue
        for key in members:
            ts = tasks.get(key.decode())
            if ts is not None:
                ts.who_wants.add(cid)
                wanted.add(ts)
    orphans = [ts for ts in tasks.values() if not ts.who_wants and ts.state in WAITED_ON]
    for cid, one in malformed:
        for ts in orphans:
            ts.who_wants.add(cid)
        state.clients[cid].update(orphans)
        one.wanted = [ts.key for ts in orphans]
        bad.append(one)
    for cid in holders:
        if not state.clients[cid]:
            del state.clients[cid]  # (a holder exists only while it wants something)


def _bad_wants(r: redis.Redis, keys: Keys, cid: str) -> Quarantined:
    name = keys.client_wants(cid)
    fields = record_copy(r, name)
    error = RecordError(name, "type", evidence(fields[b"type"]), "is no set")
    return Quarantined("wants", name, cid.encode(), error, fields, cid)


def _pages(r: redis.Redis, keys: Keys) -> Iterator[list[list[bytes]]]:
    """The pages of ``LOAD_TASKS``, each read while the caller decodes the one before:
    Redis's time (a third of a reload) overlaps Python's."""
    lua = scripts.Scripts(r, keys)
    with ThreadPoolExecutor(1, thread_name_prefix="load-state") as reader:
        page = reader.submit(lua.load_tasks, cursor=0, count=LOAD_PAGE)
        while page is not None:
            cursor, rows = page.result()
            page = None
            if cursor not in (b"0", 0):
                page = reader.submit(lua.load_tasks, cursor=cursor, count=LOAD_PAGE)
            yield rows


def _load_tasks(r: redis.Redis, keys: Keys, state: SchedulerState, bad: list[Quarantined]) -> None:
    """Every task record into ``state``, linked: pages of ``LOAD_PAGE`` records, each one
    script call that leaves out what a scheduler never reads (specs, small results)."""
    deps: dict[str, list[str]] = {}
    placeholders: list[str] = []
    prefix = keys.task_prefix
    for rows in _pages(r, keys):
        for row in rows:
            if len(row) == 1:  # (no hash: a forgotten task's key, on its way out)
                continue
            fields = iter(row[1:])
            try:
                key = row[0].decode()
                if len(row) == 2:  # (a key of another type than hash: its type)
                    raise RecordError(prefix + key, "type", evidence(row[1]), "is no hash")
                record = TaskRecord.checked(prefix + key, zip(fields, fields, strict=False))
            except (RecordError, UnicodeDecodeError) as exc:
                placeholders += _bad_task(r, keys, row, exc, bad)
                continue
            deps[key] = record.deps
            state.tasks[key] = _task_state(key, record, state)
    for key in placeholders:  # (a bad record's task: its dependents wait on it, it errs)
        if key not in state.tasks:
            state.tasks[key] = TaskState(key, state="released", has_spec=False)
    tasks = state.tasks
    for key, dep_keys in deps.items():
        ts = tasks[key]
        for dep in filter(None, map(tasks.get, dep_keys)):
            ts.dependencies = added(ts.dependencies, dep)
            dep.dependents = added(dep.dependents, ts)
    for ts in tasks.values():
        if ts.state in HOLDS_DEPENDENCIES:
            ts.waiting_on = {d for d in ts.dependencies if d.state != "memory"} or EMPTY
            for dep in ts.dependencies:
                dep.waiters = added(dep.waiters, ts)
        if ts.processing_on and ts.processing_on in state.workers:
            state.workers[ts.processing_on].processing.add(ts)
        for w in ts.who_has:
            state.workers[w].has_what.add(ts)


def _bad_task(
    r: redis.Redis, keys: Keys, row: list[bytes], exc: Exception, bad: list[Quarantined]
) -> list[str]:
    """Note the malformed task record of ``row`` (read again whole, for its copy in the
    dead-letter stream: the page left out its spec); the key of its placeholder, if any."""
    member = row[0]
    name = member.decode(errors="replace")
    hash_key = keys.task_prefix.encode() + member
    try:
        fields = r.hgetall(hash_key)
    except redis.ResponseError:  # (WRONGTYPE: no hash)
        fields = record_copy(r, hash_key)
    if isinstance(exc, RecordError):
        bad.append(Quarantined("task", hash_key, member, exc, fields, name))
        return [name]
    error = RecordError(keys.task(name), "key", evidence(member), "is no UTF-8 text")
    bad.append(Quarantined("task", hash_key, member, error, fields))
    return []


def _task_state(key: str, rec: TaskRecord, state: SchedulerState) -> TaskState:
    """A task as its record describes it (links to other tasks come after)."""
    ts = TaskState(key, state=rec.state, score=rec.score, has_spec=rec.spec is not None)
    ts.nbytes, ts.type, ts.retries = rec.nbytes, rec.type, rec.retries
    ts.restrict = tuple(rec.workers)
    ts.resources, ts.loose = rec.resources or None, rec.loose
    if ts.state == "queued" and (ts.restrict or ts.resources):
        # (a record from before queued_on existed: its workers were addresses)
        queued_on = rec.workers if rec.queued_on is None else rec.queued_on
        ts.queued_on = tuple(w for w in queued_on if w in state.workers)
    elif ts.state == "queued" and rec.queued_on:  # placed by data (``redisdask.scheduler.decide``)
        ts.queued_on = tuple(w for w in rec.queued_on[:1] if w in state.workers)
        ts.sticky = rec.sticky and bool(ts.queued_on)
    # a claim made before this scheduler started may be on its way, over which the last
    # one may have written: the first accepted claim of a queued task is written again
    ts.dequeued = ts.state == "queued"
    ts.chain = tuple(rec.chain)  # (a hint: FINISH and the scheduler check each use)
    ts.erred_on = rec.erred_on or None
    ts.suspicious, ts.replicas = rec.suspicious, rec.replicas
    ts.deaths, ts.killed = tuple(rec.deaths), rec.killed
    ts.exception_blame = rec.exception_blame or None
    ts.rejected = rec.rejected
    if ts.state == "no-worker":
        state.unrunnable.add(ts)
    ts.who_has = {w for w in rec.who_has if w in state.workers}
    ts.inline = ts.state == "memory" and keyspace.REDIS_COPY in rec.who_has
    ts.exception, ts.traceback = rec.exception, rec.traceback
    ts.exception_text, ts.traceback_text = rec.exception_text, rec.traceback_text
    if ts.state == "processing":
        ts.processing_on = rec.worker
        ts.claimed_at = stream_position(rec.claim)  # (None: a record older than the field)
    return ts
