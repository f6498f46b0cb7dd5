"""The copies and moves of results that clients ask for: ``replicate`` (keep ``n`` copies
of a key) and ``rebalance`` (even out the bytes the workers hold).  ``DataMoves`` is a
part of ``SchedulerState`` (``state.moves``, pure: events in, instructions out) that owns
the moves and rebalances under way.

**Rebalancing**, as distributed's ``Scheduler.rebalance``:

1. ``find_moves`` (pure) weighs each worker by the bytes of the results it holds (Dask's
   *managed* memory: the sizes the workers reported, spilled ones included) and pairs
   senders with recipients around the mean, within the limits of
   ``worker.memory.rebalance`` (below).  Only keys in memory, only those the client named
   (if it named any), only among the workers it named (if any); retiring workers take no
   part; a recipient never gets a key it holds already, so no copy is lost.
2. Each recipient is asked for a copy (``acquire-replicas``, naming the sender); it
   fetches it peer to peer and answers ``add-keys``, which records it as a holder.  If
   its fetch from the sender fails (``missing-data`` naming the sender), the move is
   abandoned and the sender stays a holder: unlike other failed fetches, this one does
   not count as the sender's copy lost.
3. Only then, in the batch after which the recipient is a recorded holder, the sender's
   copy is dropped: the sender leaves ``who_has`` (written in the same atomic write) and
   gets ``free-keys``.  A move whose key leaves memory, or whose recipient leaves or
   starts retiring, before that is abandoned: the sender keeps its copy (the recipient
   is told to drop what it may be fetching).  A sender's copy is kept too when dropping
   it would leave fewer copies than ``replicate`` asked for.  So no result is ever lost.

The plan and the moves in flight are written to ``rd:{c}:rebalance:<request>`` (and the
request to the ``rd:{c}:rebalances`` set) in the same atomic writes, so a restarted
scheduler reloads them (``restore_rebalance``) and finishes them; the client reads the
record's ``status`` to know when its call is done.  One move per key at a time: a second
rebalance leaves keys being moved alone, and counts the bytes in flight as moved.

``worker.memory.rebalance`` (fractions of each worker's memory limit; a worker without a
limit has none of them): ``sender-min`` (0.30) a worker holding less gives nothing,
``recipient-max`` (0.60) a worker holding more takes nothing, ``sender-recipient-gap``
(0.10) the band around the mean where a worker neither gives nor takes.  As in Dask, the
defaults move nothing while every worker is below 30% of its limit.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from redisdask.config import RebalanceConfig
from redisdask.protocol import AcquireReplicas, Rebalance, Replicate
from redisdask.scheduler.instructions import LogEvent, RecordRebalance, SetState, WorkerMsg
from redisdask.scheduler.tasks import added
from redisdask.store import codecs
from redisdask.store.codecs import MOVE_FIELD, RebalanceRecord

if TYPE_CHECKING:
    from redisdask.scheduler.tasks import TaskState, WorkerInfo
    from redisdask.scheduler.transitions import SchedulerTransitions


@dataclass(slots=True, eq=False)
class Move:
    """One key on its way from ``sender`` to ``recipient``, for rebalance ``request``;
    ``to``: the recipient as it was asked (a new process at its address is not it)."""

    ts: TaskState
    sender: str
    recipient: str
    request: str
    to: WorkerInfo | None


@dataclass(slots=True)
class RebalanceRequest:
    """A client's rebalance under way: how many moves it planned and how they ended."""

    client: str
    planned: int
    moved: int = 0
    failed: list[str] = field(default_factory=list)  # keys not moved
    pending: set[str] = field(default_factory=set)  # keys of its moves in flight
    stale: list[str] = field(default_factory=list)  # reloaded moves of tasks gone: to end


def held_bytes(ws: WorkerInfo) -> int:
    """What a worker holds, as the scheduler knows it: its results' sizes."""
    return sum(ts.nbytes for ts in ws.has_what)


def find_moves(
    workers: Iterable[WorkerInfo],
    limits: RebalanceConfig,
    movable: Callable[[TaskState], bool],
    in_flight: Mapping[str, int] | None = None,
) -> list[tuple[WorkerInfo, WorkerInfo, TaskState]]:
    """Which key to move from which worker to which, so that ``workers`` hold about the
    same bytes: ``[(sender, recipient, task), ...]``.  Pure; distributed's
    ``_rebalance_find_msgs`` in substance.

    The mean is taken over ``workers``, each weighed by ``held_bytes`` plus
    ``in_flight`` (bytes already on their way to it, negative for a sender).  A worker
    at least half a gap above the mean (and above ``sender-min``) sends, one at least half
    a gap below it (and below ``recipient-max``) receives.  Repeatedly, the sender
    farthest above the mean gives its oldest movable key (by submission order) that
    does not take it below the mean to the recipient farthest below the mean that has
    room for it and no copy of it, until every sender or every recipient is within half a
    gap of the mean.  A key is planned once, even when two senders hold it."""
    workers = list(workers)
    if not workers:
        return []
    in_flight = in_flight or {}
    memory = {ws.address: held_bytes(ws) + in_flight.get(ws.address, 0) for ws in workers}
    mean = sum(memory.values()) // len(workers)
    # heaps, smallest first: (bytes to go to the mean (<= 0), bytes to go to within half a
    # gap of it, address (ties), worker[, its movable keys, oldest first, lazily])
    senders: list[tuple[int, int, str, WorkerInfo, Iterator[TaskState]]] = []
    recipients: list[tuple[int, int, str, WorkerInfo]] = []
    for ws in workers:
        held = memory[ws.address]
        limit = int(ws.info.get("memory_limit") or 0)
        half_gap = int(limits.sender_recipient_gap * limit) // 2
        recipient_max = limits.recipient_max * limit if limit else math.inf
        if ws.has_what and held >= mean + half_gap and held >= limits.sender_min * limit:
            keys = (ts for ts in sorted(ws.has_what, key=lambda t: (t.score, t.key)) if movable(ts))
            senders.append((mean - held, mean - held + half_gap, ws.address, ws, keys))
        elif held < mean - half_gap and held < recipient_max:
            recipients.append((held - mean, held - mean + half_gap, ws.address, ws))
    heapq.heapify(senders)
    heapq.heapify(recipients)
    moves: list[tuple[WorkerInfo, WorkerInfo, TaskState]] = []
    planned: set[TaskState] = set()
    while senders and recipients:
        snd_max, snd_min, snd_address, snd, keys = senders[0]
        for ts in keys:
            if ts in planned or ts.nbytes + snd_max > 0:
                continue  # moved already, or it would take the sender below the mean
            chosen, skipped = None, []
            while recipients:
                if ts.nbytes + recipients[0][0] > 0:
                    break  # no room on the emptiest recipient: none has room
                candidate = heapq.heappop(recipients)
                if ts in candidate[3].has_what:
                    skipped.append(candidate)  # it holds a copy already
                else:
                    chosen = candidate
                    break
            for candidate in skipped:
                heapq.heappush(recipients, candidate)
            if chosen is None:
                continue  # nobody can take it: the next key of the same sender
            rec_max, rec_min, rec_address, rec = chosen
            moves.append((snd, rec, ts))
            planned.add(ts)
            nbytes = ts.nbytes
            if rec_min + nbytes < 0:
                heapq.heappush(recipients, (rec_max + nbytes, rec_min + nbytes, rec_address, rec))
            if snd_min + nbytes < 0:
                entry = (snd_max + nbytes, snd_min + nbytes, snd_address, snd, keys)
                heapq.heapreplace(senders, entry)
            else:
                heapq.heappop(senders)
            break  # the sender farthest from the mean next (maybe the same one)
        else:
            heapq.heappop(senders)  # nothing more it can give
    return moves


class DataMoves:
    """The state machine's handling of ``replicate`` and ``rebalance`` (see the module
    docstring)."""

    def __init__(self, machine: SchedulerTransitions, limits: RebalanceConfig | None) -> None:
        self.machine = machine
        self.limits = limits or RebalanceConfig()
        self.moving: dict[str, Move] = {}  # task key -> its move in flight
        self.rebalances: dict[str, RebalanceRequest] = {}  # request -> the rebalance under way
        # keys being moved that got a new holder since the last settling
        self._arrived: set[str] = set()
        # the workers as the last settling saw them
        self._workers_seen: frozenset[tuple[str, int, bool]] | None = None

    def new_holder(self, ts: TaskState) -> None:
        """``ts`` has a new holder: if it is being moved, the move may be over."""
        if ts.key in self.moving:
            self._arrived.add(ts.key)
            self.machine.holders_changed = True

    # ------------------------------------------------------------------ replicate

    def handle_replicate(self, ev: Replicate) -> None:
        m = self.machine
        for key in ev.keys:
            ts = m.tasks.get(key)
            if ts is None or ts.state != "memory":
                continue
            ts.replicas = max(1, int(ev.n))
            m.emit(SetState(ev.stimulus_id, key, "memory", {"replicas": ts.replicas}))
            self._drop_surplus(ts, stimulus_id=ev.stimulus_id)
            self.ensure_replicas(ts, stimulus_id=ev.stimulus_id)

    def _drop_surplus(self, ts: TaskState, *, stimulus_id: str) -> None:
        """Fewer copies asked for than there are: the most loaded holders drop theirs (as
        distributed's ``replicate`` deletes the extra ones).  A key being moved keeps its
        copies until the move ends (the move drops the sender's)."""
        m = self.machine
        surplus = len(ts.who_has) - ts.replicas
        if surplus <= 0 or ts.key in self.moving:
            return
        load = {a: len(ws.has_what) for a, ws in m.workers.items()}
        for address in sorted(ts.who_has, key=lambda a: (-load.get(a, 0), a))[:surplus]:
            self._drop_copy(ts, address, stimulus_id=stimulus_id)

    def ensure_replicas(self, ts: TaskState, *, stimulus_id: str) -> None:
        """Ask workers without a copy to fetch one, until ``ts.replicas`` are (or will be)
        held; the least loaded workers first."""
        m = self.machine
        ts.replicating &= set(m.workers)
        missing = ts.replicas - len(ts.who_has) - len(ts.replicating)
        if missing <= 0 or not (ts.who_has or ts.inline):
            return
        candidates = sorted(
            (
                ws
                for a, ws in m.workers.items()
                if a not in ts.who_has and a not in ts.replicating and not ws.retiring
            ),
            key=lambda ws: (len(ws.has_what), ws.address),
        )
        for ws in candidates[:missing]:
            ts.replicating = added(ts.replicating, ws.address)
            who_has = {ts.key: ts.holders()}
            m.emit(WorkerMsg(stimulus_id, ws.address, AcquireReplicas(who_has)))

    # ------------------------------------------------------------------ rebalance

    def handle_rebalance(self, ev: Rebalance) -> None:
        m = self.machine
        sid = ev.stimulus_id
        if ev.request in self.rebalances:
            return  # (the same request twice: the first one is under way)
        keys = None if ev.keys is None else set(ev.keys)
        missing = sorted(k for k in keys or () if k not in m.tasks or m.tasks[k].state != "memory")
        plan: list[tuple[WorkerInfo, WorkerInfo, TaskState]] = []
        if not missing:  # (as in distributed: a key not in memory, and nothing moves)
            allowed = None if ev.workers is None else set(ev.workers)
            workers = [
                ws
                for a, ws in sorted(m.workers.items())
                if not ws.retiring and (allowed is None or a in allowed)
            ]

            def movable(ts: TaskState) -> bool:
                in_memory = ts.state == "memory" and ts.key not in self.moving
                return in_memory and (keys is None or ts.key in keys)

            plan = find_moves(workers, self.limits, movable, self._bytes_in_flight())
        fields: dict[str, Any] = {
            "client": ev.client,
            "status": "running" if plan else "done",
            "moves": len(plan),
            "moved": 0,
            "failed": codecs.pack(missing),
        }
        request = RebalanceRequest(ev.client, len(plan), failed=missing)
        asks: dict[str, dict[str, list[str]]] = {}
        for snd, rec, ts in plan:
            self.moving[ts.key] = Move(ts, snd.address, rec.address, ev.request, rec)
            request.pending.add(ts.key)
            fields[MOVE_FIELD + ts.key] = codecs.pack([snd.address, rec.address])
            asks.setdefault(rec.address, {})[ts.key] = [snd.address]
        if plan:
            self.rebalances[ev.request] = request
        m.emit(RecordRebalance(sid, ev.request, fields, done=not plan))
        for recipient, who_has in asks.items():
            m.emit(WorkerMsg(sid, recipient, AcquireReplicas(who_has)))
        logged = {"client": ev.client, "request": ev.request, "moves": len(plan),
                  "bytes": sum(ts.nbytes for _, _, ts in plan),
                  "senders": len({s.address for s, _, _ in plan}),
                  "recipients": len({r.address for _, r, _ in plan})}  # fmt: skip
        if missing:
            logged["missing"] = missing[:20]
        m.emit(LogEvent(sid, "rebalance", logged))

    def _bytes_in_flight(self) -> dict[str, int]:
        """Bytes on their way per worker (negative: leaving it), for a second rebalance."""
        flight: dict[str, int] = {}
        for move in self.moving.values():
            flight[move.sender] = flight.get(move.sender, 0) - move.ts.nbytes
            flight[move.recipient] = flight.get(move.recipient, 0) + move.ts.nbytes
        return flight

    def settle(self, *, stimulus_id: str) -> None:
        """End the moves that can end: drop the sender's copy of each key its recipient
        is now a recorded holder of; abandon those whose key left memory or whose
        recipient left, was replaced or retires (the sender keeps its copy).  Runs after
        a batch in which holders changed (a copy arrived, a worker came or went...): it
        looks at the keys that got a holder, and at every move only when the workers
        changed (so a batch costs what it changed, not every move in flight)."""
        m = self.machine
        for name, request in list(self.rebalances.items()):
            if request.stale or not request.pending:  # (as reloaded)
                request.failed += request.stale
                drop, request.stale = [MOVE_FIELD + k for k in request.stale], []
                fields = {"failed": codecs.pack(request.failed)}
                self._record(name, request, fields, drop, stimulus_id=stimulus_id)
        seen = frozenset((a, id(ws), ws.retiring) for a, ws in m.workers.items())
        if seen != self._workers_seen:  # (a Move keeps its recipient: ids stay unique)
            self._workers_seen, keys = seen, list(self.moving)
        else:
            keys = sorted(self._arrived)
        self._arrived.clear()
        for key in keys:
            move = self.moving.get(key)
            if move is None:
                continue
            ts = move.ts
            recipient = m.workers.get(move.recipient)
            gone = m.tasks.get(ts.key) is not ts or ts.state != "memory"
            if gone or recipient is None or recipient is not move.to or recipient.retiring:
                if not gone and recipient is not None and move.recipient not in ts.who_has:
                    m.free(move.recipient, key, stimulus_id=stimulus_id)  # (its fetch)
                self._end_move(move, moved=False, stimulus_id=stimulus_id)
            elif move.recipient in ts.who_has:
                # (never below the copies replicate asked for)
                if move.sender in ts.who_has and len(ts.who_has) > ts.replicas:
                    self._drop_copy(ts, move.sender, stimulus_id=stimulus_id)
                self._end_move(move, moved=True, stimulus_id=stimulus_id)

    def _drop_copy(self, ts: TaskState, worker: str, *, stimulus_id: str) -> None:
        """``worker`` holds ``ts`` no more (another holder has it): record it, tell it."""
        m = self.machine
        ts.who_has.discard(worker)
        ws = m.workers.get(worker)
        if ws is not None:
            ws.has_what.discard(ts)
        m.emit(SetState(stimulus_id, ts.key, "memory", m.memory_fields(ts)))
        m.free(worker, ts.key, stimulus_id=stimulus_id)

    def cancel(self, ts: TaskState, *, stimulus_id: str) -> None:
        """``ts`` leaves memory (released, or its last copy lost): its move is abandoned,
        and its recipient drops the copy it may be fetching."""
        m = self.machine
        move = self.moving.get(ts.key)
        if move is None or move.ts is not ts:
            return
        if move.recipient in m.workers and move.recipient not in ts.who_has:
            m.free(move.recipient, ts.key, stimulus_id=stimulus_id)
        self._end_move(move, moved=False, stimulus_id=stimulus_id)

    def move_failed(self, ts: TaskState, worker: str, errant: str, *, stimulus_id: str) -> bool:
        """``worker`` could not fetch ``ts`` from ``errant``: if that was a move's
        recipient failing to fetch from its sender (registered still), the move is
        abandoned, the recipient drops the fetch, and the sender is trusted to keep its
        copy (True); a failed fetch proves no loss, and a move must lose nothing."""
        m = self.machine
        move = self.moving.get(ts.key)
        if move is None or move.ts is not ts or (move.recipient, move.sender) != (worker, errant):
            return False
        if errant not in m.workers:
            return False  # gone: its removal said what it took with it
        m.free(worker, ts.key, stimulus_id=stimulus_id)
        self._end_move(move, moved=False, stimulus_id=stimulus_id)
        return True

    def _end_move(self, move: Move, *, moved: bool, stimulus_id: str) -> None:
        key = move.ts.key
        del self.moving[key]
        request = self.rebalances.get(move.request)
        if request is None:
            return
        request.pending.discard(key)
        fields: dict[str, Any] = {}
        if moved:
            request.moved += 1
            fields["moved"] = request.moved
        else:
            request.failed.append(key)
            fields["failed"] = codecs.pack(request.failed)
        self._record(move.request, request, fields, [MOVE_FIELD + key], stimulus_id=stimulus_id)

    def _record(
        self,
        name: str,
        request: RebalanceRequest,
        fields: dict[str, Any],
        drop: list[str],
        *,
        stimulus_id: str,
    ) -> None:
        """Write a rebalance's progress; once nothing of it is in flight, it is done."""
        m = self.machine
        done = not request.pending and not request.stale
        if done:
            fields["status"] = "done"
            del self.rebalances[name]
            summary = {"request": name, "moved": request.moved, "failed": len(request.failed)}
            m.emit(LogEvent(stimulus_id, "rebalanced", summary))
        m.emit(RecordRebalance(stimulus_id, name, fields, drop, done=done))

    def forget(self, *, stimulus_id: str) -> None:
        """The cluster restarted (every task is gone): every rebalance ends, unmoved."""
        for move in list(self.moving.values()):
            self._end_move(move, moved=False, stimulus_id=stimulus_id)

    def restore_rebalance(self, request: str, record: RebalanceRecord) -> None:
        """A rebalance under way as Redis recorded it (``load_state``); what the moves
        wait for is looked at again after the first batch."""
        m = self.machine
        restored = RebalanceRequest(record.client, record.moves, record.moved, record.failed)
        for key, (sender, recipient) in sorted(record.pending.items()):
            ts = m.tasks.get(key)
            if ts is None or key in self.moving:  # (only if Redis lost writes)
                restored.stale.append(key)
            else:
                self.moving[key] = Move(ts, sender, recipient, request, m.workers.get(recipient))
                restored.pending.add(key)
        self.rebalances[request] = restored
        self.machine.holders_changed = True
        self._workers_seen = None  # the first settling looks at every move

    def validate(self) -> None:
        m = self.machine
        for key, move in self.moving.items():
            # a key leaving memory ends its move in the same batch
            assert m.tasks.get(key) is move.ts and move.ts.state == "memory", (key, move)
            assert key in self.rebalances[move.request].pending, (key, move.request)
        for request, r in self.rebalances.items():
            assert r.pending and not r.stale, request  # one with nothing in flight is over
            assert all(self.moving[k].request == request for k in r.pending), request
