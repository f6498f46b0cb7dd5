"""The scheduler's model of every task, worker and client it knows, and every legal move
of a task between states (``SchedulerTransitions``): the half of the pure state machine that
knows no event.  ``SchedulerState`` (``scheduler/state.py``) says what each event means
in these moves, as distributed's ``Scheduler`` does with its ``SchedulerState``.

Task states::

                 +---------------- erred <------------+-------------+
                 |                   ^                |             |
    released -> waiting ------> queued ------> processing ------> memory
        ^  \\                    (in Redis        (claimed by one
        |   `------------------> ready zset)      worker)
        |
     forgotten  (released, nobody wants it, no dependent left: its history is deleted)

* ``waiting``: some dependency is not in memory yet.
* ``queued``: every dependency is in memory; the key sits in the Redis ready set where
  workers claim it, or, a root task submitted while a worker has a free thread, in that
  worker's inbox (``Push``, ``scheduler/push.py``).
* ``processing``: a worker claimed it (the claim script told us which).
* ``memory``: a worker holds the result; ``who_has`` lists the holders.
* ``erred``: the function raised (after ``retries``), a dependency erred, or the scheduler
  refused to run it (its graph had a cycle).
* ``released``: nobody needs the result now, but a dependent may still need the task's
  graph history to recompute it, so the task (and its spec in Redis) is kept.
* ``no-worker``: ready, but restricted (``workers=``) to workers none of which is alive,
  or needing resources no live worker has (``redisdask.placement``); queued as soon as one
  that may run it joins.  A restriction entry names a worker by its address, its name, or
  its host (of its address, or the hostname it reported), as in Dask.  A queued task sits
  in the own ready set of every live worker it may run on (its ``constrained`` set, for a
  task with resources), including one that joins while it waits.

Priorities: user ``priority=`` first (higher runs first), then submission order.  They
become the score of the Redis ready set, which a worker pops smallest-first.

The legal moves are one table (``_TRANSITIONS``); the machine's parts (``moves``,
``stealing``, ``chains``) own their own state and change tasks through the methods
without a leading underscore (``emit``, ``transition``, ``set_state``, ``free``, ...).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from redisdask.durations import Durations
from redisdask.placement import Placement
from redisdask.protocol import (
    NO_SCORE,
    ComputeTask,
    FreeKeys,
    KeyErred,
    KeyInMemory,
)
from redisdask.scheduler.chain import Chains
from redisdask.scheduler.decide import decide_worker, sticky
from redisdask.scheduler.instructions import (
    ClaimAccepted,
    ClientMsg,
    Dequeue,
    Enqueue,
    Forget,
    ForgetClient,
    Instruction,
    Push,
    SetState,
    SetWants,
    Unclaim,
    WorkerMsg,
)
from redisdask.scheduler.moves import DataMoves, RebalanceConfig
from redisdask.scheduler.push import push_target, pushable
from redisdask.scheduler.stealing import WorkStealing
from redisdask.scheduler.tasks import (
    EMPTY,
    StoryEntry,
    StreamPosition,
    TaskState,
    WorkerInfo,
    added,
    discarded,
    worker_stream_position,
)
from redisdask.state_machine import InvalidTransition
from redisdask.store import codecs, keyspace

# states in which a task keeps its dependencies from being released
HOLDS_DEPENDENCIES = ("waiting", "queued", "processing", "no-worker")


class SchedulerTransitions:
    """Every task, worker and client the scheduler knows, and the legal moves of a task
    between states (see the module docstring)."""

    def __init__(
        self,
        validate: bool = False,
        seq: int = 0,
        allowed_failures: int = 3,
        story_limit: int = 100_000,
        rebalance: RebalanceConfig | None = None,
    ) -> None:
        self.allowed_failures = allowed_failures
        self.tasks: dict[str, TaskState] = {}
        self.workers: dict[str, WorkerInfo] = {}
        self.clients: dict[str, set[TaskState]] = {}  # client id -> tasks it wants
        self.generations: dict[str, int] = {}  # client id -> its last graph's generation
        self.unrunnable: set[TaskState] = set()  # state no-worker
        self.seq = seq
        self.validate = validate
        self._instructions: list[Instruction] = []
        self._candidates: deque[TaskState] = deque()
        self._pushing = False  # root tasks queued now may go to a free thread (scheduler/push.py)
        # the newest workers stream entry handled, and the one up to which a reload's
        # records hold every claim (``_seen``)
        self._read: StreamPosition | None = None
        self.seen_floor: StreamPosition | None = None
        self._seen_text = ""  # (``_seen``, made when first asked after a change)
        self.holders_changed = False  # something a retirement or a rebalance waits for
        # its parts, each owning its own state; they read and change the tasks and
        # workers here and emit through the public methods below
        self.moves = DataMoves(self, rebalance)  # replicate and rebalance
        self.stealing = WorkStealing(self)  # claims moved from busy workers to idle ones
        self.chains = Chains(self)  # dependents claimed with the results they wait on
        self.placement = Placement(lambda: {a: ws.info for a, ws in self.workers.items()})
        self.durations = Durations()  # per task prefix, from the results accepted
        # results that came in and tasks that erred, since this state was built (metrics
        # for the summary the monitor shows)
        self.n_finished = 0
        self.n_erred = 0
        # the last transitions, newest last, for InvalidTransition (the scheduler writes
        # its transitions to Redis from the instructions: see Translator.story)
        self.story: deque[StoryEntry] = deque(maxlen=story_limit)

    def stories(self, *keys: str) -> list[StoryEntry]:
        """The story entries about ``keys``: ``(key, start, finish, stimulus_id)``."""
        wanted = set(keys)
        return [entry for entry in self.story if entry[0] in wanted]

    def emit(self, instruction: Instruction) -> None:
        if isinstance(instruction, ClientMsg):
            # news of a key says which of the client's graphs had been read (``seen``);
            # not a rejected graph's, whose generation is unknown
            msg = instruction.msg
            if isinstance(msg, KeyInMemory) or (isinstance(msg, KeyErred) and not msg.rejected):
                msg.seen = self.generations.get(instruction.client)
        self._instructions.append(instruction)

    # ------------------------------------------------------------------ what clients want

    def _release_wants(self, client: str, keys: Iterable[str], *, stimulus_id: str) -> list[str]:
        wanted = self.clients.get(client, set())
        removed = []
        for key in keys:
            ts = self.tasks.get(key)
            if ts is None or client not in ts.who_wants:
                continue
            ts.who_wants.discard(client)
            wanted.discard(ts)
            removed.append(key)
            self._maybe_release(ts)
        if removed:
            self.emit(SetWants(stimulus_id, client, remove=removed))
            if not wanted and keyspace.is_holder(client):
                del self.clients[client]  # a holder exists only while it wants something
                self.emit(ForgetClient(stimulus_id, client))
        return removed

    def _fired_done(self, ts: TaskState, *, stimulus_id: str) -> None:
        """``fire_and_forget`` wanted ``ts`` until it ran (memory or erred), as in Dask:
        its result is released after, unless somebody else wants it."""
        if keyspace.FIRE_AND_FORGET in ts.who_wants:
            self._release_wants(keyspace.FIRE_AND_FORGET, [ts.key], stimulus_id=stimulus_id)

    # ------------------------------------------------------------------ transitions

    def transition(self, ts: TaskState, finish: str, *, stimulus_id: str, **kwargs: Any) -> None:
        """Move ``ts`` to ``finish`` along its edge in ``_TRANSITIONS``; a move that is
        not there raises ``InvalidTransition`` with the key's story."""
        start = ts.state
        if start == finish:
            return
        func = self._TRANSITIONS.get((start, finish))
        if func is None:
            story = self.stories(ts.key)
            raise InvalidTransition(ts.key, start, finish, stimulus_id, story)
        func(self, ts, stimulus_id=stimulus_id, **kwargs)
        if finish not in ("processing", "memory") and ts.dependents:
            self.chains.unchain(ts, stimulus_id=stimulus_id)  # (scheduler/chain.py)

    def set_state(self, ts: TaskState, finish: str, *, stimulus_id: str) -> None:
        """Every change of a task's state goes through here, which tells its story."""
        self.story.append((ts.key, ts.state, finish, stimulus_id))
        ts.state = finish

    def _transition_released_waiting(self, ts: TaskState, *, stimulus_id: str) -> None:
        self.set_state(ts, "waiting", stimulus_id=stimulus_id)
        ts.waiting_on = {d for d in ts.dependencies if d.state != "memory"} or EMPTY
        for dep in ts.dependencies:
            dep.waiters = added(dep.waiters, ts)
        erred = next((d for d in ts.dependencies if d.state == "erred"), None)
        if erred is not None:
            self.inherit_error(ts, erred)
            self.transition(ts, "erred", stimulus_id=stimulus_id)
            return
        if ts.waiting_on:
            self.emit(SetState(stimulus_id, ts.key, "waiting"))
            self.chains.mark(ts, stimulus_id=stimulus_id)
        else:
            self.transition(ts, "queued", stimulus_id=stimulus_id)

    def _transition_waiting_queued(self, ts: TaskState, *, stimulus_id: str) -> None:
        if (ts.restrict or ts.resources) and self.targets(ts) is None:
            self._transition_waiting_no_worker(ts, stimulus_id=stimulus_id)
            return
        self.set_state(ts, "queued", stimulus_id=stimulus_id)
        self.emit(SetState(stimulus_id, ts.key, "queued"))
        if self._pushing and pushable(ts) and self._push(ts, stimulus_id=stimulus_id):
            return
        self.enqueue(ts, stimulus_id=stimulus_id)

    def _push(self, ts: TaskState, *, stimulus_id: str) -> bool:
        """Give a root task of a submission to a worker with a free thread
        (``redisdask.scheduler.push``); False when none has one (nor will, in this batch)."""
        ws = push_target(self.workers)
        if ws is None:
            self._pushing = False  # (the rest of the submission is queued: no scan each)
            return False
        self.set_state(ts, "processing", stimulus_id=stimulus_id)
        ts.queued_on, ts.dequeued = (), False
        # the worker reads the push after its next holding report, perhaps: not before
        # the one after that may a report's silence about it count (``_handle_holding``)
        ts.claimed_before, ts.unlisted, ts.claimed_at = ws.holding_reports + 1, 0, None
        ts.processing_on = ws.address
        ws.processing.add(ts)
        estimate = self.durations.averages.get(ts.prefix, -1.0)
        started = float(ws.info["started"])
        msg = ComputeTask(ts.key, ts.score, started, estimate, bool(ts.chain))
        notify = {c: self.generations.get(c, 0) for c in ts.who_wants if not keyspace.is_holder(c)}
        ts.notified, ts.told = notify, False
        self.emit(Push(stimulus_id, ws.address, msg, notify))
        return True

    def enqueue(self, ts: TaskState, *, stimulus_id: str) -> None:
        """Into the own ready (``constrained``, for a task with resources) sets of the live
        workers it may run on, the one of the worker holding most of its data (a
        ``preferred`` one, ``redisdask.scheduler.decide``), or the shared ready set."""
        placed = bool(ts.restrict or ts.resources)
        best = None if placed else decide_worker(ts, self.workers)
        ts.sticky = (
            best is not None
            and best != ts.missed_by
            and sticky(ts, self.durations.averages.get(ts.prefix))
        )
        ts.missed_by = None
        ts.queued_on = (self.targets(ts) or ()) if placed else (best,) if best else ()
        self.emit(Enqueue(stimulus_id, ts.key, ts.score, ts.queued_on, ts.queued_on,
                           constrained=bool(ts.resources), placed=placed or bool(best),
                           preferred=bool(best), sticky=ts.sticky))  # fmt: skip

    def _dequeue(self, ts: TaskState, *, stimulus_id: str) -> None:
        self.emit(Dequeue(stimulus_id, ts.key, ts.queued_on, constrained=bool(ts.resources)))
        ts.queued_on = ()
        ts.sticky = False
        ts.dequeued = True

    def targets(self, ts: TaskState) -> tuple[str, ...] | None:
        """The live workers whose own sets a task goes into (``()``: the shared set;
        ``None``: none may run it, ``no-worker``)."""
        return self.placement.targets(ts.restrict, ts.resources, ts.loose)

    def _transition_waiting_no_worker(self, ts: TaskState, *, stimulus_id: str) -> None:
        self.set_state(ts, "no-worker", stimulus_id=stimulus_id)
        self.unrunnable.add(ts)
        self.emit(SetState(stimulus_id, ts.key, "no-worker"))

    def _transition_no_worker_queued(self, ts: TaskState, *, stimulus_id: str) -> None:
        self.unrunnable.discard(ts)
        self._transition_waiting_queued(ts, stimulus_id=stimulus_id)

    def _transition_queued_no_worker(self, ts: TaskState, *, stimulus_id: str) -> None:
        self._dequeue(ts, stimulus_id=stimulus_id)
        self._transition_waiting_no_worker(ts, stimulus_id=stimulus_id)

    def _transition_no_worker_released(self, ts: TaskState, *, stimulus_id: str) -> None:
        self.unrunnable.discard(ts)
        self._transition_waiting_released(ts, stimulus_id=stimulus_id)

    def _transition_queued_waiting(self, ts: TaskState, *, stimulus_id: str) -> None:
        """A dependency of a queued task lost its data: wait for it again."""
        self._dequeue(ts, stimulus_id=stimulus_id)
        self._wait_again(ts, stimulus_id=stimulus_id)

    def _transition_processing_waiting(self, ts: TaskState, *, stimulus_id: str) -> None:
        """A dependency lost its data while a worker held the task: take it back."""
        self._take_back(ts, stimulus_id=stimulus_id)
        self._wait_again(ts, stimulus_id=stimulus_id)

    def _take_back(self, ts: TaskState, *, stimulus_id: str) -> None:
        """Withdraw a processing task from its worker (which drops it, if still there)."""
        worker = ts.processing_on
        if worker is not None:
            ws = self.workers.get(worker)
            if ws is not None:
                ws.processing.discard(ts)
            self.emit(Unclaim(stimulus_id, worker, ts.key))
            self.free(worker, ts.key, stimulus_id=stimulus_id)
        ts.processing_on = None

    def _transition_no_worker_waiting(self, ts: TaskState, *, stimulus_id: str) -> None:
        self.unrunnable.discard(ts)
        self._wait_again(ts, stimulus_id=stimulus_id)

    def _wait_again(self, ts: TaskState, *, stimulus_id: str) -> None:
        self.set_state(ts, "waiting", stimulus_id=stimulus_id)
        ts.waiting_on = {d for d in ts.dependencies if d.state != "memory"} or EMPTY
        self.emit(SetState(stimulus_id, ts.key, "waiting"))
        self.chains.mark(ts, stimulus_id=stimulus_id)

    def _transition_processing_queued(self, ts: TaskState, *, stimulus_id: str) -> None:
        if ts.processing_on is not None:
            ws = self.workers.get(ts.processing_on)
            if ws is not None:
                ws.processing.discard(ts)
            ts.processing_on = None
        if any(d.state != "memory" for d in ts.dependencies):  # chained on a task not done
            self._wait_again(ts, stimulus_id=stimulus_id)
            return
        self._transition_waiting_queued(ts, stimulus_id=stimulus_id)

    def _transition_queued_processing(
        self, ts: TaskState, worker: WorkerInfo, *, stimulus_id: str
    ) -> None:
        self.set_state(ts, "processing", stimulus_id=stimulus_id)
        ts.queued_on = ()  # the claim took it out of every ready set
        ts.sticky = False
        ts.claimed_before, ts.unlisted = worker.holding_reports, 0
        ts.claimed_at = worker_stream_position(stimulus_id)
        ts.processing_on = worker.address
        worker.processing.add(ts)  # the claim script wrote it, unless written over since
        self.emit(ClaimAccepted(stimulus_id, ts.key, worker.address, rewrite=ts.dequeued))
        ts.dequeued = False

    def _transition_waiting_processing(
        self, ts: TaskState, worker: WorkerInfo, *, stimulus_id: str
    ) -> None:
        """A chained claim (``scheduler/chain.py``): ``ts`` runs on ``worker`` after the
        results it waits on, which the same entry reports next (``waiting_on`` empties as
        they are read)."""
        self.set_state(ts, "processing", stimulus_id=stimulus_id)
        ts.claimed_before, ts.unlisted = worker.holding_reports, 0
        ts.claimed_at = worker_stream_position(stimulus_id)
        ts.processing_on = worker.address
        worker.processing.add(ts)  # (the FINISH script wrote it)
        self.emit(ClaimAccepted(stimulus_id, ts.key, worker.address))

    def _transition_processing_memory(
        self, ts: TaskState, worker: WorkerInfo, value: bytes | None = None, *, stimulus_id: str
    ) -> None:
        """The result of the claim holder, ``worker`` (the only one accepted); ``value``,
        a small result itself, goes into the record and to the clients that want it."""
        worker.processing.discard(ts)
        self.emit(Unclaim(stimulus_id, worker.address, ts.key))
        ts.processing_on = None
        self.set_state(ts, "memory", stimulus_id=stimulus_id)
        self.n_finished += 1
        self._add_replica(ts, worker.address)
        if worker.retiring:  # finished while its worker retires: to be copied elsewhere
            worker.to_move.add(ts)
            self.holders_changed = True
        ts.inline = value is not None
        fields = self.memory_fields(ts)
        if value is not None:
            fields["value"] = value
        self.emit(SetState(stimulus_id, ts.key, "memory", fields))
        told = ts.notified if ts.told else {}
        ts.told = False
        for client in ts.who_wants:
            # FINISH told those its push named, unless one of them sent a graph since
            # (the key again, perhaps: its client then takes news only as new as that)
            if told.get(client, -1) != self.generations.get(client, 0):
                self.emit(ClientMsg(stimulus_id, client, self._memory_msg(ts, value)))
        self._fired_done(ts, stimulus_id=stimulus_id)
        self._wake_waiters(ts, stimulus_id=stimulus_id)
        for dep in ts.dependencies:
            discarded(dep.waiters, ts)
            self._maybe_release(dep)
        self._maybe_release(ts)

    def free(self, worker: str, key: str, *, stimulus_id: str, run: float = NO_SCORE) -> None:
        """Tell a worker to drop what it holds of ``key`` (a result, a failed run; with
        ``run``, only a copy of that run)."""
        free = FreeKeys([key], seen=self._seen(), run=run)
        self.emit(WorkerMsg(stimulus_id, worker, free))

    def _seen(self) -> str:
        """The workers stream entry up to which this state has read every claim: a
        ``free-keys`` says so, and its worker keeps a copy it claimed after that entry
        (this state decided without knowing that claim, and answers it when it reads
        it).  Without it a worker that claimed a key again before reading a
        ``free-keys`` about its older copy answered the claim from that copy, then
        dropped it, and the record named a holder that held nothing."""
        if not self._seen_text:
            seen = max((p for p in (self._read, self.seen_floor) if p is not None), default=None)
            self._seen_text = "" if seen is None else f"{seen[0]}-{seen[1]}"
        return self._seen_text

    def _wake_waiters(self, ts: TaskState, *, stimulus_id: str) -> None:
        for dependent in sorted(ts.waiters, key=lambda t: t.score):
            discarded(dependent.waiting_on, ts)
            if dependent.state == "waiting" and not dependent.waiting_on:
                self.transition(dependent, "queued", stimulus_id=stimulus_id)
            elif dependent.state == "waiting":
                self.chains.mark(dependent, stimulus_id=stimulus_id)

    def _add_replica(self, ts: TaskState, worker: str) -> None:
        ts.who_has.add(worker)
        ws = self.workers.get(worker)
        if ws is not None:
            ws.has_what.add(ts)
        self.moves.new_holder(ts)  # (a rebalance may wait for it)

    def _transition_processing_erred(self, ts: TaskState, *, stimulus_id: str) -> None:
        if ts.processing_on is not None:
            ws = self.workers.get(ts.processing_on)
            if ws is not None:
                ws.processing.discard(ts)
            ts.processing_on = None
        self._transition_waiting_erred(ts, stimulus_id=stimulus_id)

    def _transition_waiting_erred(self, root: TaskState, *, stimulus_id: str) -> None:
        """Err ``root`` and, iteratively, every dependent waiting on it."""
        todo = [root]
        while todo:
            ts = todo.pop()
            self.set_state(ts, "erred", stimulus_id=stimulus_id)
            self.n_erred += 1
            ts.waiting_on = EMPTY
            self.emit(SetState(stimulus_id, ts.key, "erred", self._erred_fields(ts)))
            for client in ts.who_wants:
                self.emit(ClientMsg(stimulus_id, client, self._erred_msg(ts)))
            self._fired_done(ts, stimulus_id=stimulus_id)
            for dependent in sorted(ts.waiters, key=lambda t: -t.score):
                if dependent.state == "waiting":
                    self.inherit_error(dependent, ts)
                    todo.append(dependent)
            ts.waiters = EMPTY
            for dep in ts.dependencies:
                discarded(dep.waiters, ts)
                self._maybe_release(dep)

    def _transition_released_erred(self, ts: TaskState, *, stimulus_id: str) -> None:
        """A task that cannot run, its error set by the caller: its data is lost and
        nothing can recompute it (``_err_lost``), or the scheduler refused it (a cycle)."""
        self._transition_waiting_erred(ts, stimulus_id=stimulus_id)

    def inherit_error(self, ts: TaskState, source: TaskState) -> None:
        ts.exception, ts.traceback = source.exception, source.traceback
        ts.exception_text, ts.traceback_text = source.exception_text, source.traceback_text
        ts.exception_blame = source.exception_blame or source.key
        ts.erred_on = source.erred_on
        ts.killed = source.killed
        ts.rejected = source.rejected

    def _transition_waiting_released(self, ts: TaskState, *, stimulus_id: str) -> None:
        self.set_state(ts, "released", stimulus_id=stimulus_id)
        ts.waiting_on = EMPTY
        self.emit(SetState(stimulus_id, ts.key, "released"))
        self._release_dependencies(ts)

    def _transition_queued_released(self, ts: TaskState, *, stimulus_id: str) -> None:
        self._dequeue(ts, stimulus_id=stimulus_id)
        self._transition_waiting_released(ts, stimulus_id=stimulus_id)

    def _transition_processing_released(self, ts: TaskState, *, stimulus_id: str) -> None:
        self._take_back(ts, stimulus_id=stimulus_id)
        self._transition_waiting_released(ts, stimulus_id=stimulus_id)

    def _transition_memory_released(self, ts: TaskState, *, stimulus_id: str) -> None:
        for worker in ts.replicating - ts.who_has:  # fetching a copy nobody needs now
            self.free(worker, ts.key, stimulus_id=stimulus_id)
        ts.replicating = EMPTY
        self.moves.cancel(ts, stimulus_id=stimulus_id)
        for worker in ts.who_has:
            ws = self.workers.get(worker)
            if ws is not None:
                ws.has_what.discard(ts)
            self.free(worker, ts.key, stimulus_id=stimulus_id)
        ts.who_has.clear()
        self.set_state(ts, "released", stimulus_id=stimulus_id)
        released: dict[str, Any] = {"who_has": []}
        if ts.inline:
            ts.inline, released["value"] = False, None
        self.emit(SetState(stimulus_id, ts.key, "released", released))
        self._release_dependencies(ts)
        self._maybe_release(ts)

    def _transition_erred_released(self, ts: TaskState, *, stimulus_id: str) -> None:
        if ts.exception_blame is None and ts.killed is None and ts.erred_on in self.workers:
            # it raised there: the worker keeps the error
            self.free(ts.erred_on, ts.key, stimulus_id=stimulus_id)
        self.set_state(ts, "released", stimulus_id=stimulus_id)
        ts.exception = ts.traceback = None
        ts.exception_text = ts.traceback_text = ""
        ts.exception_blame = ts.erred_on = ts.killed = None
        ts.suspicious, ts.deaths, ts.rejected = 0, (), False
        self.emit(
            SetState(
                stimulus_id,
                ts.key,
                "released",
                {
                    "exception": b"",
                    "traceback": b"",
                    "exception_text": "",
                    "traceback_text": "",
                    "erred_on": "",
                    "exception_blame": "",
                    "killed": b"",
                    "rejected": False,
                    "suspicious": 0,
                    "deaths": [],
                },
            )
        )
        self._release_dependencies(ts)
        self._maybe_release(ts)

    def _transition_released_forgotten(self, ts: TaskState, *, stimulus_id: str) -> None:
        self.set_state(ts, "forgotten", stimulus_id=stimulus_id)
        del self.tasks[ts.key]
        self.emit(Forget(stimulus_id, ts.key))
        for dep in ts.dependencies:
            discarded(dep.dependents, ts)
            discarded(dep.waiters, ts)
            if dep.state == "released":
                self._maybe_release(dep)
        for dependent in ts.dependents:
            discarded(dependent.dependencies, ts)

    # Every legal move.  Two more state changes bypass the table, on purpose: a lost last
    # copy goes memory -> released without freeing anything or releasing its dependencies
    # (``_lost_data``: it is recomputed if still needed), and scattered data
    # (``_handle_update_data``) sets a released task to memory.
    _TRANSITIONS: ClassVar[dict[tuple[str, str], Callable[..., None]]] = {
        ("released", "waiting"): _transition_released_waiting,
        ("released", "erred"): _transition_released_erred,
        ("released", "forgotten"): _transition_released_forgotten,
        ("waiting", "queued"): _transition_waiting_queued,
        ("waiting", "no-worker"): _transition_waiting_no_worker,
        ("waiting", "erred"): _transition_waiting_erred,
        ("waiting", "released"): _transition_waiting_released,
        ("waiting", "processing"): _transition_waiting_processing,
        ("queued", "processing"): _transition_queued_processing,
        ("queued", "waiting"): _transition_queued_waiting,
        ("queued", "no-worker"): _transition_queued_no_worker,
        ("queued", "released"): _transition_queued_released,
        ("no-worker", "queued"): _transition_no_worker_queued,
        ("no-worker", "waiting"): _transition_no_worker_waiting,
        ("no-worker", "released"): _transition_no_worker_released,
        ("processing", "memory"): _transition_processing_memory,
        ("processing", "queued"): _transition_processing_queued,
        ("processing", "waiting"): _transition_processing_waiting,
        ("processing", "erred"): _transition_processing_erred,
        ("processing", "released"): _transition_processing_released,
        ("memory", "released"): _transition_memory_released,
        ("erred", "released"): _transition_erred_released,
    }

    # ------------------------------------------------------------------ release rules

    def _release_dependencies(self, ts: TaskState) -> None:
        for dep in ts.dependencies:
            discarded(dep.waiters, ts)
            self._maybe_release(dep)
        self._maybe_release(ts)

    def _maybe_release(self, ts: TaskState) -> None:
        """Release a task nobody needs any more (no client wants it, no dependent waits).

        Releases and forgets go through a worklist drained by ``_drain`` instead of
        recursing, so cancelling a 100,000-task chain cannot hit the recursion limit."""
        self._candidates.append(ts)

    def _drain(self, *, stimulus_id: str) -> None:
        while self._candidates:
            ts = self._candidates.popleft()
            if ts.who_wants or ts.waiters or ts.state == "forgotten":
                continue
            if ts.state != "released":
                self.transition(ts, "released", stimulus_id=stimulus_id)
            elif all(d.state == "forgotten" for d in ts.dependents):
                self.transition(ts, "forgotten", stimulus_id=stimulus_id)

    # ------------------------------------------------------------------ messages

    def memory_fields(self, ts: TaskState) -> dict[str, Any]:
        return {"who_has": ts.holders(), "nbytes": ts.nbytes, "type": ts.type}

    def _memory_msg(self, ts: TaskState, value: bytes | None = None) -> KeyInMemory:
        return KeyInMemory(ts.key, ts.holders(), nbytes=ts.nbytes, type=ts.type, value=value)

    def _erred_fields(self, ts: TaskState) -> dict[str, Any]:
        fields = {
            "exception": ts.exception or b"",
            "traceback": ts.traceback or b"",
            "exception_text": ts.exception_text,
            "traceback_text": ts.traceback_text,
            "erred_on": ts.erred_on or "",
            "exception_blame": ts.exception_blame or "",
        }
        if ts.killed:
            fields["killed"] = ts.killed
            fields["suspicious"] = ts.suspicious
            fields["deaths"] = list(ts.deaths)
        if ts.rejected:
            fields["rejected"] = 1
        return fields

    def _erred_msg(self, ts: TaskState) -> KeyErred:
        msg = KeyErred(
            ts.key,
            exception=ts.exception or b"",
            traceback=ts.traceback or b"",
            exception_text=ts.exception_text,
            traceback_text=ts.traceback_text,
            erred_on=ts.erred_on or "",
            exception_blame=ts.exception_blame or "",
            rejected=ts.rejected,
        )
        if ts.killed:
            msg.killed, msg.suspicious = ts.killed, ts.suspicious
            msg.deaths = codecs.pack(ts.deaths)
        return msg

    # ------------------------------------------------------------------ validation

    def validate_state(self) -> None:
        for key, ts in self.tasks.items():
            assert ts.key == key
            assert ts.state != "forgotten", ts
            for dep in ts.dependencies:
                assert ts in dep.dependents, (ts, dep)
                assert dep.key in self.tasks, (ts, dep)
            for dependent in ts.dependents:
                assert ts in dependent.dependencies, (ts, dependent)
            if ts.state == "memory":
                assert ts.who_has or ts.inline, ts
                assert ts.processing_on is None, ts
            if ts.state == "processing":
                assert ts.processing_on is not None, ts
                ws = self.workers.get(ts.processing_on)
                assert ws is not None and ts in ws.processing, ts
            if ts.state == "queued":
                assert all(d.state == "memory" for d in ts.dependencies), ts
                assert ts.processing_on is None, ts
            if ts.state == "waiting":
                assert ts.waiting_on == {d for d in ts.dependencies if d.state != "memory"}, ts
                assert ts.waiting_on, ts
            if ts.state in ("queued", "no-worker"):
                assert all(d.state == "memory" for d in ts.dependencies), ts
            # a queued restricted or resourced task sits in the sets of live workers only,
            # one placed by data in one worker's set (and the placed set)
            if ts.queued_on:
                assert ts.state == "queued" and (ts.restrict or ts.resources or
                                                 len(ts.queued_on) == 1), ts  # fmt: skip
            elif ts.state == "queued":  # in the shared set: no resources, no strict restriction
                assert not ts.resources and (ts.loose or not ts.restrict), ts
            assert all(w in self.workers for w in ts.queued_on), (ts, ts.queued_on)
            if ts.state in HOLDS_DEPENDENCIES:
                for dep in ts.dependencies:
                    assert ts in dep.waiters, (ts, dep)
            for client in ts.who_wants:
                assert ts in self.clients.get(client, set()), (ts, client)
        for ws in self.workers.values():
            assert ws.retiring or not (ws.told_to_close or ws.retire_heard), ws.address
            for ts in ws.processing:
                assert ts.processing_on == ws.address, (ts, ws.address)
            for ts in ws.has_what:
                assert ws.address in ts.who_has, (ts, ws.address)
        self.moves.validate()
        for client, wanted in self.clients.items():
            assert wanted or not keyspace.is_holder(client), client  # gone when it wants nothing
            for ts in wanted:
                assert client in ts.who_wants, (client, ts)
                assert self.tasks.get(ts.key) is ts, (client, ts)
