"""The worker's model of its tasks and every legal move of a task between states
(``WorkerTransitions``): the half of its pure state machine that knows no event.
``WorkerState`` (``workers/state.py``) says what each event means in these moves.

Task states and the transitions implemented here::

    claimed here (ComputeTaskEvent):

        released ──► waiting ──► ready ──► executing ──► memory
            │         (deps)     ▲ (heap)    │   │
            └────────────────────┘           │   └──► error
                                             ▼
                       cancelled ──► released | memory | executing | fetch | missing

    only fetched (a dependency of a claimed task):

        released ──► fetch ──► flight ──► memory
            │        ▲   │       │  │
            │        │   ▼       │  └──► cancelled ──► released | memory | flight | fetch
            └──────► missing ◄───┘

    seceded (SecedeEvent, RejoinEvent: ``redisdask.secede``/``rejoin``, ``worker_client``):

        executing ──► long-running ──► memory | error | cancelled
            ▲              │
            └──────────────┘ rejoin: once a slot is free (the ``Rejoin`` instruction)

    ComputeTaskEvent of a key in error (a retry or a new submission: a new run):
        error ──► waiting | ready;  of a dependent, for a dependency in error here:
        error ──► fetch | missing (its result is elsewhere).  A failed run is never
        answered again: the scheduler queues a key only when it wants it run.
    PutDataEvent: released | waiting | ready | fetch | flight | missing | error ──► memory
    FreeKeysEvent: any resting state ──► released (then forgotten); running ──► cancelled
                   (not a copy put here that the scheduler has not recorded yet, below)
    StealRequestEvent: a claim not started, waiting | ready ──► released (given back for
                   another worker, ``StolenKeys``); any other is refused, and runs here
    RunsOverdueEvent: every thread runs a task past any expectation: the claims held
                   ready behind them but the next per thread, ready ──► released
                   (``ReleasedKeys``)

* ``released`` is transient: a task that is neither *wanted* (claimed by / pushed to this
  worker, so the scheduler expects it here) nor needed by a dependent is forgotten at
  once (removed from ``tasks`` and its value from ``data``).
* ``cancelled``: the scheduler freed a task whose computation (or fetch) is still under
  way.  It keeps its thread (or peer) until the result arrives; the result is then
  dropped (``ReleasedKeys`` for a computation) unless the task was wanted again.  A
  claim of the same run (the same score) resumes it; a claim of another run of the key
  (released, then submitted again, perhaps as another computation under the same key)
  waits in ``deferred`` until the thread returns, and the old run's outcome is dropped.
  Likewise a result in ``memory`` from another run is not the answer to a claim: the key
  is computed anew.
* ``missing``: no known holder; ``MissingData`` asks the scheduler, whose answer comes
  back as ``UpdateWhoHasEvent``.
* Scattered data (``PutDataEvent``) comes straight from a client over TCP, while
  ``free-keys`` come from the scheduler through the inbox, so a ``free-keys`` sent for an
  earlier copy of the same key (released by the client, then scattered again) can be read
  after the new copy arrived.  Each copy put here stays until the scheduler has recorded
  it (``KeysRecordedEvent``, its answer to the client's ``update-data``); a
  ``FreeKeysEvent`` read before that was sent for an older copy and leaves it alone.
* ``long-running``: the task's thread left the pool (``secede()``): it waits on other
  tasks (``worker_client``), and no longer counts against ``nthreads``, so another task
  may run and the driver may claim more (its executor grows beyond ``nthreads``: this
  machine, not the pool's size, bounds how many tasks compute).  ``rejoin()`` blocks the
  thread until a slot is free (``Rejoin``; rejoining tasks go before ready ones); the
  task then counts again.  A task finishes, errs or is freed from ``long-running`` as
  from ``executing``; its run time then says nothing of its cost, so it is left out of
  the average task duration that sizes claims.
* **Resources** (``--resources GPU=2``): a claimed computation holds what its claim says
  it needs (``TaskState.held``, counted out of ``available_resources``) from the claim
  until it leaves: ``memory``, ``error``, released, handed back (a seceded run keeps
  them: its thread may still use them, as in distributed); a cancelled run until
  its thread returns, and a claim deferred behind a transfer while it waits.  The driver
  claims only within what is available (the ``CLAIM`` script counts it down), so no task
  waits here for resources, and Dask's ``constrained`` state is not needed; a claim
  that does not fit all the same is handed back (``ReleasedKeys``), never run.
* ``constrained`` and ``rescheduled`` are declared for later
  issues; no event reaches them yet.

Fetched dependencies are private replicas: they are not announced to the scheduler and
are released once no task here needs them (a task stops needing its dependencies when it
finishes) and the worker's next claim brought none that does (``lingers``, until
``ClaimsHandledEvent``).  Tasks that share a dependency are placed together, but a
one-thread worker claims the second only when the first has finished: ``(x + x.T)``'s
task on blocks (j, i) and (i, j) came to the worker that had just fetched (i, j) for
its sibling and dropped it, and fetched it again.
"""

from __future__ import annotations

import heapq
import random
from collections import defaultdict, deque
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from redisdask.errors import RedisDaskError
from redisdask.placement import EPSILON
from redisdask.protocol import (
    NO_SCORE,
    AddKeys,
    TaskErred,
    TaskFinished,
)
from redisdask.state_machine import InvalidTransition
from redisdask.typenames import type_name
from redisdask.workers.events import (
    ComputeTaskEvent,
    Execute,
    ExecuteFailureEvent,
    Instruction,
    Rejoin,
    Report,
    StateMachineEvent,
)

STATES: frozenset[str] = frozenset(
    {
        "released", "waiting", "fetch", "flight", "missing", "ready", "constrained",
        "executing", "long-running", "memory", "error", "rescheduled", "cancelled",
    }
)  # fmt: skip

DEFAULT_TRANSFER_BATCH_BYTES = 200_000_000
DEFAULT_TRANSFER_BATCH_KEYS = 1000  # the worker gives the wire's: comm.MAX_KEYS_PER_MESSAGE
DEFAULT_TRANSFER_CONCURRENCY = 4
RUNNING = ("executing", "long-running")  # a thread computes the task


class InvalidTaskState(RedisDaskError, AssertionError):
    """``validate_state`` found a broken invariant."""


# ---------------------------------------------------------------------------------------
# Task state
# ---------------------------------------------------------------------------------------


@dataclass(slots=True, eq=False, repr=False)
class TaskState:
    key: str
    state: str = "released"
    run_spec: bytes | None = None
    priority: tuple[Any, ...] | None = None  # (a dependent here may lend it a better one)
    run: float | None = None  # the score of its claim here: which run of the key it is
    wanted: bool = False  # claimed by / pushed to this worker: the scheduler expects it here
    dependencies: set[TaskState] = field(default_factory=set)
    dependents: set[TaskState] = field(default_factory=set)
    waiting_for_data: set[TaskState] = field(default_factory=set)
    who_has: set[str] = field(default_factory=set)
    coming_from: str | None = None  # peer of the GatherDep in flight
    previous: str | None = None  # state before `cancelled`: executing, long-running or flight
    nbytes: int | None = None
    type: str | None = None  # the result's type name
    start: float | None = None
    stop: float | None = None
    error: ExecuteFailureEvent | None = None
    # claimed while in flight, or (another run of the key) while a cancelled run ran
    deferred: ComputeTaskEvent | None = None
    replica: bool = False  # fetched to be kept as a copy, reported with AddKeys
    unrecorded: int = 0  # copies put here (scatter) that the scheduler has not recorded yet
    seceded: bool = False  # this run left the pool: its duration is no compute time
    estimate: float | None = None  # expected run time, from its claim (None: unknown)
    began: float | None = None  # when its run took a thread (the driver's clock)
    resources: dict[str, float] | None = None  # what a run needs (from its claim)
    held: dict[str, float] | None = None  # what it holds of this worker's resources now
    claim: tuple[int, int] | None = None  # the workers stream entry of its latest claim
    fetched: bool = False  # its value came from a peer, for tasks here (a private replica)
    # fetched, its last task here ended: kept for the next claim (``ClaimsHandledEvent``)
    lingers: bool = False
    # the submission its value is of, where known: its run's score, if computed here; the
    # word of the claims that need it, if fetched for them or put here (scattered: the
    # first one says which scatter) (``ComputeTaskEvent.runs``)
    value_run: float | None = None

    def __repr__(self) -> str:
        return f"<TaskState {self.key!r} {self.state}>"


def run_score(ts: TaskState) -> float:
    """Which run of its key a report answers: the score of the claim that ran
    (``TaskState.run``), for the scheduler to tell a late result."""
    return NO_SCORE if ts.run is None else ts.run


def _check(cond: object, msg: str) -> None:
    """An invariant of ``validate_state``."""
    if not cond:
        raise InvalidTaskState(msg)


def host_of(address: str) -> str:
    rest = address.split("://", 1)[-1]
    return rest.rsplit(":", 1)[0] if ":" in rest else rest


StoryEntry = tuple[str, str, str, str, float | None]


class WorkerTransitions:
    """The task state of one worker and the legal moves between states (see the module
    docstring); ``WorkerState`` adds the events that make them."""

    def __init__(
        self,
        *,
        address: str = "tcp://127.0.0.1:0",
        nthreads: int = 1,
        data: MutableMapping[str, object] | None = None,
        transfer_batch_bytes: int = DEFAULT_TRANSFER_BATCH_BYTES,
        transfer_batch_keys: int = DEFAULT_TRANSFER_BATCH_KEYS,
        transfer_concurrency: int = DEFAULT_TRANSFER_CONCURRENCY,
        rng: random.Random | None = None,
        validate: bool = False,
        story_limit: int = 100_000,
        record_stimuli: bool = False,
        resources: dict[str, float] | None = None,
    ) -> None:
        self.address = address
        self.host = host_of(address)
        self.nthreads = nthreads
        self.data: MutableMapping[str, object] = {} if data is None else data
        self.transfer_batch_bytes = transfer_batch_bytes
        self.transfer_batch_keys = transfer_batch_keys  # (the driver's: keys per message)
        self.transfer_concurrency = transfer_concurrency
        self.rng = rng if rng is not None else random.Random(0)
        self.validate = validate
        self.paused = False
        self.retiring = False
        self.total_resources: dict[str, float] = dict(resources or {})
        self.available_resources: dict[str, float] = dict(self.total_resources)
        self.resources_freed = 0  # runs that gave their resources back (claim again then)

        self.tasks: dict[str, TaskState] = {}
        self.by_state: defaultdict[str, set[TaskState]] = defaultdict(set)
        self.executing: set[TaskState] = set()  # tasks holding a slot (incl. cancelled)
        self.long_running: set[TaskState] = set()  # seceded: a thread, no slot (incl. cancelled)
        self.lingering: set[TaskState] = set()  # fetched, kept for the next claim (``lingers``)
        self.rejoining: deque[TaskState] = deque()  # seceded, waiting for a slot to rejoin
        self.in_flight_workers: dict[str, set[str]] = {}  # peer -> keys requested
        self.has_what: defaultdict[str, set[str]] = defaultdict(set)  # peer -> keys
        # peer -> heap of (priority, key, seq, task) to fetch from it; entries that are
        # no longer live (_fetchable) are dropped when they come up
        self._needed: defaultdict[str, list[tuple[Any, ...]]] = defaultdict(list)
        self.story: deque[StoryEntry] = deque(maxlen=story_limit)
        self.story_total = 0  # entries ever appended (the driver ships the new ones)
        # the events themselves, for replay (opt-in: they hold task results alive)
        self.stimulus_log: deque[StateMachineEvent] = deque(
            maxlen=story_limit if record_stimuli else 0
        )

        self._ready_heap: list[tuple[tuple[Any, ...], int, TaskState]] = []
        self._seq = 0
        self._instructions: list[Instruction | Report] = []
        self._newly_missing: list[str] = []
        self._event_time: float | None = None
        self.clock: float | None = None  # the driver's wall time of the current stimuli

        for key in list(self.data):  # pre-existing data (e.g. a persistent spill buffer)
            ts = self.tasks[key] = TaskState(key, state="memory", wanted=True)
            self.by_state["memory"].add(ts)

    def _tell(self, entry: StoryEntry) -> None:
        self.story.append(entry)
        self.story_total += 1

    def stories(self, *keys: str) -> list[StoryEntry]:
        """The story entries about ``keys``."""
        wanted = set(keys)
        return [entry for entry in self.story if entry[0] in wanted]

    # -- what to fetch from each peer ------------------------------------------------

    def _fetchable(self, ts: TaskState, peer: str) -> bool:
        """Whether a heap entry is live: the task is still to be fetched, and ``peer``
        still holds it (entries are left behind when either changes)."""
        return ts.state == "fetch" and peer in ts.who_has and self.tasks.get(ts.key) is ts

    def _need_from(self, ts: TaskState, peer: str) -> None:
        """``ts`` is to be fetched and ``peer`` holds it: an entry in its heap."""
        heap = self._needed[peer]
        if len(heap) > 2 * len(self.by_state["fetch"]) + 64:  # mostly stale: compact
            live = {e[1]: e for e in heap if self._fetchable(e[3], peer)}  # (one per key)
            heap[:] = live.values()
            heapq.heapify(heap)
        self._seq += 1
        heapq.heappush(heap, (ts.priority or (), ts.key, self._seq, ts))

    # -- transitions -----------------------------------------------------------------

    def _transition(self, ts: TaskState, finish: str, *, stimulus_id: str, **kwargs: Any) -> None:
        """Move ``ts`` to ``finish`` along its edge in ``_TRANSITIONS``; a move that is
        not there raises ``InvalidTransition`` with the key's story."""
        func = self._TRANSITIONS.get((ts.state, finish))
        if func is None:
            story = self.stories(ts.key)
            raise InvalidTransition(ts.key, ts.state, finish, stimulus_id, story)
        func(self, ts, stimulus_id=stimulus_id, **kwargs)

    def _set_state(self, ts: TaskState, finish: str, sid: str) -> None:
        self.by_state[ts.state].discard(ts)
        self._tell((ts.key, ts.state, finish, sid, self._event_time))
        ts.state = finish
        if finish != "released":
            self.by_state[finish].add(ts)
        if finish == "fetch":
            for worker in ts.who_has:
                self._need_from(ts, worker)
        if ts.lingers and finish != "memory":
            self._stop_lingering(ts)
        if ts.resources or ts.held is not None:
            self._sync_resources(ts)

    @staticmethod
    def _holds(ts: TaskState) -> bool:
        """Whether a task holds its resources now: a claimed run, from its claim until
        it leaves (a cancelled one until its thread returns)."""
        if not ts.resources:
            return False
        return (
            ts.state in ("waiting", "ready", "executing", "long-running")
            or (ts.state == "cancelled" and ts.previous in RUNNING)
            or (ts.state == "flight" and ts.deferred is not None)
        )

    def _sync_resources(self, ts: TaskState) -> None:
        """Take or give back a task's resources as its state says (``_holds``)."""
        available = self.available_resources
        if self._holds(ts):
            if ts.held is None:
                ts.held = dict(ts.resources or {})
                for name, amount in ts.held.items():
                    available[name] = available.get(name, 0.0) - amount
        elif ts.held is not None:
            for name, amount in ts.held.items():
                available[name] = available.get(name, 0.0) + amount
            ts.held = None
            self.resources_freed += 1

    def _transition_released_waiting(self, ts: TaskState, *, stimulus_id: str) -> None:
        self._set_state(ts, "waiting", stimulus_id)

    def _transition_released_ready(self, ts: TaskState, *, stimulus_id: str) -> None:
        self._set_state(ts, "ready", stimulus_id)
        self._push_ready(ts)

    def _transition_waiting_ready(self, ts: TaskState, *, stimulus_id: str) -> None:
        self._set_state(ts, "ready", stimulus_id)
        self._push_ready(ts)

    def _transition_ready_executing(self, ts: TaskState, *, stimulus_id: str) -> None:
        self._set_state(ts, "executing", stimulus_id)
        self.executing.add(ts)
        ts.seceded = False  # a new run
        ts.began = self._event_time
        self._emit(Execute(ts.key, stimulus_id))

    def _transition_executing_long_running(self, ts: TaskState, *, stimulus_id: str) -> None:
        self.executing.discard(ts)
        self.long_running.add(ts)
        ts.seceded = True
        self._set_state(ts, "long-running", stimulus_id)

    def _transition_long_running_executing(self, ts: TaskState, *, stimulus_id: str) -> None:
        self.long_running.discard(ts)
        self.executing.add(ts)
        self._set_state(ts, "executing", stimulus_id)
        self._emit(Rejoin(ts.key, stimulus_id))

    def _free_thread(self, ts: TaskState) -> None:
        """The computation of ``ts`` ended (or was never started): no slot, no thread."""
        self.executing.discard(ts)
        self.long_running.discard(ts)
        if self.rejoining and ts in self.rejoining:  # (a thread let go at shutdown)
            self.rejoining.remove(ts)

    def _transition_executing_memory(
        self,
        ts: TaskState,
        value: object,
        nbytes: int,
        inline: bytes | None = None,
        *,
        stimulus_id: str,
    ) -> None:
        self._free_thread(ts)
        self._store(ts, value, nbytes, stimulus_id)
        self._keep_for_siblings(ts)
        self._unlink_dependencies(ts, stimulus_id)
        if ts.wanted:
            self._emit_finished(ts, stimulus_id, inline)

    def _transition_executing_error(
        self, ts: TaskState, error: ExecuteFailureEvent, *, stimulus_id: str
    ) -> None:
        self._free_thread(ts)
        ts.error = error
        self._set_state(ts, "error", stimulus_id)
        self._keep_for_siblings(ts)
        self._unlink_dependencies(ts, stimulus_id)
        if ts.wanted:
            self._emit_erred(ts, stimulus_id)

    def _transition_executing_cancelled(self, ts: TaskState, *, stimulus_id: str) -> None:
        ts.previous = ts.state  # executing or long-running
        self._set_state(ts, "cancelled", stimulus_id)

    def _transition_flight_cancelled(self, ts: TaskState, *, stimulus_id: str) -> None:
        ts.previous = "flight"
        self._set_state(ts, "cancelled", stimulus_id)

    def _transition_cancelled_executing(self, ts: TaskState, *, stimulus_id: str) -> None:
        ts.previous = None  # (or long-running: the thread is where it was, in or out)
        self._set_state(ts, "executing" if ts in self.executing else "long-running", stimulus_id)

    def _transition_cancelled_flight(self, ts: TaskState, *, stimulus_id: str) -> None:
        ts.previous = None
        self._set_state(ts, "flight", stimulus_id)

    def _transition_cancelled_memory(
        self, ts: TaskState, value: object, nbytes: int, *, stimulus_id: str
    ) -> None:
        self._free_thread(ts)
        ts.previous = ts.coming_from = None
        self._store(ts, value, nbytes, stimulus_id)
        self._unlink_dependencies(ts, stimulus_id)
        if ts.replica:  # freed while running, then asked for as a copy: here it is
            ts.replica, ts.wanted = False, True
            self._emit(AddKeys(self.address, [ts.key], {ts.key: nbytes}, stimulus_id=stimulus_id))

    def _transition_cancelled_fetch(self, ts: TaskState, *, stimulus_id: str) -> None:
        self._free_thread(ts)
        ts.previous = ts.coming_from = None
        self._set_state(ts, "fetch", stimulus_id)

    def _transition_cancelled_missing(self, ts: TaskState, *, stimulus_id: str) -> None:
        self._free_thread(ts)
        ts.previous = ts.coming_from = None
        self._set_state(ts, "missing", stimulus_id)
        self._newly_missing.append(ts.key)

    def _transition_released_fetch(self, ts: TaskState, *, stimulus_id: str) -> None:
        self._set_state(ts, "fetch", stimulus_id)

    def _transition_released_missing(self, ts: TaskState, *, stimulus_id: str) -> None:
        self._set_state(ts, "missing", stimulus_id)
        self._newly_missing.append(ts.key)

    def _transition_fetch_flight(self, ts: TaskState, worker: str, *, stimulus_id: str) -> None:
        ts.coming_from = worker
        self._set_state(ts, "flight", stimulus_id)

    # Claimed for computation while waiting to be fetched (its data was lost elsewhere).
    def _transition_fetch_waiting(self, ts: TaskState, *, stimulus_id: str) -> None:
        self._stop_fetching(ts)
        self._set_state(ts, "waiting", stimulus_id)

    def _transition_fetch_ready(self, ts: TaskState, *, stimulus_id: str) -> None:
        self._stop_fetching(ts)
        self._set_state(ts, "ready", stimulus_id)
        self._push_ready(ts)

    def _stop_fetching(self, ts: TaskState) -> None:
        for worker in list(ts.who_has):
            self._forget_holder(ts, worker)

    def _transition_fetch_missing(self, ts: TaskState, *, stimulus_id: str) -> None:
        self._set_state(ts, "missing", stimulus_id)
        self._newly_missing.append(ts.key)

    def _transition_missing_fetch(self, ts: TaskState, *, stimulus_id: str) -> None:
        self._set_state(ts, "fetch", stimulus_id)

    def _transition_flight_fetch(self, ts: TaskState, *, stimulus_id: str) -> None:
        ts.coming_from = None
        self._set_state(ts, "fetch", stimulus_id)

    def _transition_flight_missing(self, ts: TaskState, *, stimulus_id: str) -> None:
        ts.coming_from = None
        self._set_state(ts, "missing", stimulus_id)
        self._newly_missing.append(ts.key)

    def _transition_flight_memory(
        self, ts: TaskState, value: object, nbytes: int, *, stimulus_id: str
    ) -> None:
        ts.coming_from = None
        ts.deferred = None
        self._store(ts, value, nbytes, stimulus_id)
        ts.fetched = not (ts.wanted or ts.replica)
        if ts.wanted:  # claimed while it was being fetched
            self._emit_finished(ts, stimulus_id)
        elif ts.replica:  # a copy asked for: keep it and say so
            ts.replica, ts.wanted = False, True
            self._emit(AddKeys(self.address, [ts.key], {ts.key: nbytes}, stimulus_id=stimulus_id))
        else:
            self._release_if_unneeded(ts, stimulus_id)  # e.g. a copy freed while in flight

    # Data pushed by the scheduler (PutDataEvent) short-cuts any state but a running one.
    def _transition_released_memory(
        self, ts: TaskState, value: object, nbytes: int, *, stimulus_id: str
    ) -> None:
        self._store(ts, value, nbytes, stimulus_id)

    def _transition_fetch_memory(
        self, ts: TaskState, value: object, nbytes: int, *, stimulus_id: str
    ) -> None:
        self._store(ts, value, nbytes, stimulus_id)

    def _transition_missing_memory(
        self, ts: TaskState, value: object, nbytes: int, *, stimulus_id: str
    ) -> None:
        self._store(ts, value, nbytes, stimulus_id)

    def _transition_waiting_memory(
        self, ts: TaskState, value: object, nbytes: int, *, stimulus_id: str
    ) -> None:
        self._store(ts, value, nbytes, stimulus_id)
        self._unlink_dependencies(ts, stimulus_id)

    def _transition_ready_memory(
        self, ts: TaskState, value: object, nbytes: int, *, stimulus_id: str
    ) -> None:
        self._store(ts, value, nbytes, stimulus_id)
        self._unlink_dependencies(ts, stimulus_id)

    def _transition_error_memory(
        self, ts: TaskState, value: object, nbytes: int, *, stimulus_id: str
    ) -> None:
        ts.error = None
        self._store(ts, value, nbytes, stimulus_id)

    # A key in error is claimed again (a new run), or needed here as a dependency whose
    # result another worker holds: the failed run is dropped, never answered again, and
    # the task goes on as a released one would.
    def _transition_error_waiting(self, ts: TaskState, *, stimulus_id: str) -> None:
        ts.error = None
        self._transition_released_waiting(ts, stimulus_id=stimulus_id)

    def _transition_error_ready(self, ts: TaskState, *, stimulus_id: str) -> None:
        ts.error = None
        self._transition_released_ready(ts, stimulus_id=stimulus_id)

    def _transition_error_fetch(self, ts: TaskState, *, stimulus_id: str) -> None:
        ts.error = None
        self._transition_released_fetch(ts, stimulus_id=stimulus_id)

    def _transition_error_missing(self, ts: TaskState, *, stimulus_id: str) -> None:
        ts.error = None
        self._transition_released_missing(ts, stimulus_id=stimulus_id)

    # Release: every resting state but the running ones (those go to `cancelled`).
    def _transition_waiting_released(self, ts: TaskState, *, stimulus_id: str) -> None:
        self._forget(ts, stimulus_id)

    def _transition_ready_released(self, ts: TaskState, *, stimulus_id: str) -> None:
        self._forget(ts, stimulus_id)

    def _transition_fetch_released(self, ts: TaskState, *, stimulus_id: str) -> None:
        self._forget(ts, stimulus_id)

    def _transition_missing_released(self, ts: TaskState, *, stimulus_id: str) -> None:
        self._forget(ts, stimulus_id)

    def _transition_memory_released(self, ts: TaskState, *, stimulus_id: str) -> None:
        del self.data[ts.key]
        self._forget(ts, stimulus_id)

    def _transition_error_released(self, ts: TaskState, *, stimulus_id: str) -> None:
        self._forget(ts, stimulus_id)

    def _transition_cancelled_released(self, ts: TaskState, *, stimulus_id: str) -> None:
        self._free_thread(ts)
        ts.previous = ts.coming_from = None
        self._forget(ts, stimulus_id)

    # Every legal move, by start state.  (``released`` is transient: a task enters it on
    # its way to being forgotten, or is created in it and moves on at once.)
    _TRANSITIONS: ClassVar[dict[tuple[str, str], Callable[..., None]]] = {
        ("released", "waiting"): _transition_released_waiting,
        ("released", "ready"): _transition_released_ready,
        ("released", "fetch"): _transition_released_fetch,
        ("released", "missing"): _transition_released_missing,
        ("released", "memory"): _transition_released_memory,
        ("waiting", "ready"): _transition_waiting_ready,
        ("waiting", "memory"): _transition_waiting_memory,
        ("waiting", "released"): _transition_waiting_released,
        ("ready", "executing"): _transition_ready_executing,
        ("ready", "memory"): _transition_ready_memory,
        ("ready", "released"): _transition_ready_released,
        ("executing", "memory"): _transition_executing_memory,
        ("executing", "error"): _transition_executing_error,
        ("executing", "cancelled"): _transition_executing_cancelled,
        ("executing", "long-running"): _transition_executing_long_running,
        ("long-running", "executing"): _transition_long_running_executing,
        ("long-running", "memory"): _transition_executing_memory,
        ("long-running", "error"): _transition_executing_error,
        ("long-running", "cancelled"): _transition_executing_cancelled,
        ("fetch", "flight"): _transition_fetch_flight,
        ("fetch", "missing"): _transition_fetch_missing,
        ("fetch", "waiting"): _transition_fetch_waiting,
        ("fetch", "ready"): _transition_fetch_ready,
        ("fetch", "memory"): _transition_fetch_memory,
        ("fetch", "released"): _transition_fetch_released,
        ("missing", "fetch"): _transition_missing_fetch,
        ("missing", "waiting"): _transition_fetch_waiting,
        ("missing", "ready"): _transition_fetch_ready,
        ("missing", "memory"): _transition_missing_memory,
        ("missing", "released"): _transition_missing_released,
        ("flight", "memory"): _transition_flight_memory,
        ("flight", "fetch"): _transition_flight_fetch,
        ("flight", "missing"): _transition_flight_missing,
        ("flight", "cancelled"): _transition_flight_cancelled,
        ("cancelled", "executing"): _transition_cancelled_executing,
        ("cancelled", "long-running"): _transition_cancelled_executing,
        ("cancelled", "flight"): _transition_cancelled_flight,
        ("cancelled", "memory"): _transition_cancelled_memory,
        ("cancelled", "fetch"): _transition_cancelled_fetch,
        ("cancelled", "missing"): _transition_cancelled_missing,
        ("cancelled", "released"): _transition_cancelled_released,
        ("memory", "released"): _transition_memory_released,
        ("error", "waiting"): _transition_error_waiting,
        ("error", "ready"): _transition_error_ready,
        ("error", "fetch"): _transition_error_fetch,
        ("error", "missing"): _transition_error_missing,
        ("error", "memory"): _transition_error_memory,
        ("error", "released"): _transition_error_released,
    }

    # -- helpers ---------------------------------------------------------------------

    def _emit(self, instruction: Instruction | Report) -> None:
        self._instructions.append(instruction)

    def _emit_finished(self, ts: TaskState, sid: str, inline: bytes | None = None) -> None:
        """Report the result; ``inline``, a small result pickled, travels with the report
        (the scheduler keeps it in Redis, where it outlives this worker)."""
        self._emit(
            TaskFinished(
                self.address,
                ts.key,
                nbytes=ts.nbytes or 0,
                type=ts.type or "",
                start=ts.start or 0.0,
                stop=ts.stop or 0.0,
                score=run_score(ts),
                value=inline,
                seceded=ts.seceded,
                stimulus_id=sid,
            )
        )

    def _emit_erred(self, ts: TaskState, sid: str) -> None:
        e = ts.error
        assert e is not None
        self._emit(
            TaskErred(
                self.address,
                ts.key,
                exception=e.exception,
                traceback=e.traceback,
                exception_text=e.exception_text,
                traceback_text=e.traceback_text,
                score=run_score(ts),
                stimulus_id=sid,
            )
        )

    def _push_ready(self, ts: TaskState) -> None:
        self._seq += 1
        heapq.heappush(self._ready_heap, (ts.priority or (), self._seq, ts))

    def _store(self, ts: TaskState, value: object, nbytes: int, sid: str) -> None:
        """Enter `memory`: keep the value and wake up the dependents waiting for it."""
        ts.nbytes = nbytes  # (first: the spill buffer weighs the value by it)
        self.data[ts.key] = value
        if ts.type is None:
            ts.type = type_name(type(value))
        self._set_state(ts, "memory", sid)
        for dependent in ts.dependents:
            dependent.waiting_for_data.discard(ts)
            if dependent.state == "waiting" and not dependent.waiting_for_data:
                self._transition(dependent, "ready", stimulus_id=sid)

    def _forget_holder(self, ts: TaskState, worker: str) -> None:
        ts.who_has.discard(worker)
        keys = self.has_what.get(worker)
        if keys is not None:
            keys.discard(ts.key)
            if not keys:
                del self.has_what[worker]

    def _release_if_unneeded(self, ts: TaskState, sid: str) -> None:
        if ts.wanted or ts.replica or ts.dependents or ts.lingers or ts.state == "cancelled":
            return
        if ts.state in ("executing", "long-running", "flight"):
            self._transition(ts, "cancelled", stimulus_id=sid)
        else:
            self._transition(ts, "released", stimulus_id=sid)

    def _unlink_dependencies(self, ts: TaskState, sid: str) -> None:
        """``ts`` no longer needs its dependencies; release those nobody else needs."""
        deps, ts.dependencies = ts.dependencies, set()
        ts.waiting_for_data.clear()
        for dep in sorted(deps, key=lambda t: t.key):
            dep.dependents.discard(ts)
            self._release_if_unneeded(dep, sid)

    def _keep_for_siblings(self, ts: TaskState) -> None:
        """``ts`` ran here: the fetched dependencies only it needed stay until the next
        claim is handled (``lingers``), for a sibling placed here with it."""
        for dep in ts.dependencies:
            needed = dep.wanted or dep.replica or dep.dependents != {ts}
            if dep.fetched and dep.state == "memory" and not needed:
                dep.lingers = True
                self.lingering.add(dep)

    def _stop_lingering(self, ts: TaskState) -> None:
        ts.lingers = False
        self.lingering.discard(ts)

    def _forget(self, ts: TaskState, sid: str) -> None:
        """Enter `released` and drop the task (released -> forgotten)."""
        self._set_state(ts, "released", sid)
        for worker in list(ts.who_has):
            self._forget_holder(ts, worker)
        del self.tasks[ts.key]
        self._tell((ts.key, "released", "forgotten", sid, self._event_time))
        self._unlink_dependencies(ts, sid)

    # -- invariants ------------------------------------------------------------------

    def validate_state(self) -> None:
        """Check every invariant; raise ``InvalidTaskState`` on the first broken one."""
        check = _check
        needed = {peer: {entry[3] for entry in heap} for peer, heap in self._needed.items()}
        for key, ts in self.tasks.items():
            check(ts.key == key, f"{ts} stored under {key!r}")
            self._validate_task(ts, needed)
        for state, members in self.by_state.items():
            for ts in members:
                check(self.tasks.get(ts.key) is ts and ts.state == state, f"{ts} in by_state")
        for key in self.data:
            check(key in self.tasks and self.tasks[key].state == "memory", f"{key!r} in data")
        for worker, keys in self.has_what.items():
            for key in keys:
                check(key in self.tasks and worker in self.tasks[key].who_has, f"has_what {key}")
        check(len(self.executing) <= self.nthreads, f"{len(self.executing)} executing")
        check(not self.executing & self.long_running, "executing and long-running at once")
        check(len(set(self.rejoining)) == len(self.rejoining), "a task rejoins twice")
        for ts in self.rejoining:
            check(ts in self.long_running, f"{ts} rejoins, not seceded")
            check(self.tasks.get(ts.key) is ts, f"{ts} rejoins, forgotten")
        check(
            not self.rejoining or len(self.executing) >= self.nthreads,
            "a task waits to rejoin while a slot is free",
        )
        used: dict[str, float] = {}
        for ts in self.tasks.values():
            check((ts.held is not None) == self._holds(ts), f"{ts} holds {ts.held}")
            for name, amount in (ts.held or {}).items():
                used[name] = used.get(name, 0.0) + amount
        for name in {*self.total_resources, *self.available_resources, *used}:
            total = self.total_resources.get(name, 0.0)
            free = self.available_resources.get(name, 0.0)
            slack = EPSILON * max(1.0, abs(total))
            check(abs(total - used.get(name, 0.0) - free) <= slack, f"{name}: {total} vs held")
            check(free >= -slack, f"{name}: {used.get(name)} held of {total}")
        check(len(self.in_flight_workers) <= self.transfer_concurrency, "too many GatherDeps")
        in_heap = {id(entry[2]) for entry in self._ready_heap}
        for ts in self.by_state["ready"]:
            check(id(ts) in in_heap, f"{ts} not in ready heap")

    def _validate_task(self, ts: TaskState, needed: dict[str, set[TaskState]]) -> None:
        """``validate_state``'s checks of one task (``needed``: each peer's fetch heap)."""
        check = _check
        check(ts.state in STATES and ts.state != "released", f"{ts} at rest")
        check(ts in self.by_state[ts.state], f"{ts} not indexed by state")
        check(
            ts.wanted or ts.replica or ts.dependents or ts.lingers or ts.state == "cancelled",
            f"{ts} unneeded",
        )
        check(ts.lingers == (ts in self.lingering), f"{ts} vs lingering")
        check(not ts.lingers or ts.state == "memory", f"{ts} lingers out of memory")
        for dep in ts.dependencies:
            check(ts in dep.dependents, f"{ts} -> {dep} not symmetric")
            check(self.tasks.get(dep.key) is dep, f"{dep} (dep of {ts}) forgotten")
        for dependent in ts.dependents:
            check(ts in dependent.dependencies, f"{dependent} -> {ts} not symmetric")
            check(self.tasks.get(dependent.key) is dependent, f"{dependent} forgotten")
        check(ts.waiting_for_data <= ts.dependencies, f"{ts} waits for a non-dependency")
        check((ts.key in self.data) == (ts.state == "memory"), f"{ts} vs data")
        check(self.address not in ts.who_has, f"{ts} fetched from self")
        for worker in ts.who_has:
            check(ts.key in self.has_what.get(worker, ()), f"{ts} not in has_what")
        check(
            ts.coming_from is None or ts.state in ("flight", "cancelled"),
            f"{ts} coming from {ts.coming_from}",
        )
        was = ts.previous if ts.state == "cancelled" else ts.state
        check((ts in self.executing) == (was == "executing"), f"{ts} vs executing")
        check((ts in self.long_running) == (was == "long-running"), f"{ts} vs long_running")
        if ts.state == "waiting":
            check(ts.waiting_for_data, f"{ts} waits for nothing")
            for dep in ts.waiting_for_data:
                check(dep.state != "memory", f"{ts} waits for {dep} in memory")
            for dep in ts.dependencies - ts.waiting_for_data:
                check(dep.state == "memory", f"{ts} does not wait for {dep}")
        elif ts.state in ("ready", "executing", "long-running"):
            for dep in ts.dependencies:
                check(dep.state == "memory", f"{ts} has {dep} not in memory")
        elif ts.state == "fetch":
            check(ts.who_has, f"{ts} without holders")
            for worker in ts.who_has:
                check(ts in needed.get(worker, ()), f"{ts} not in {worker}'s fetch heap")
        elif ts.state == "missing":
            check(not ts.who_has, f"{ts} has holders {ts.who_has}")
        elif ts.state == "error":
            check(ts.error is not None, f"{ts} without error")
        check(ts.unrecorded == 0 or ts.state == "memory", f"{ts} put, not in memory")
        if ts.state == "flight" or (ts.state == "cancelled" and ts.previous == "flight"):
            peer = ts.coming_from
            check(peer is not None, f"{ts} in flight from nowhere")
            check(ts.key in self.in_flight_workers.get(peer or "", ()), f"{ts} no peer record")
        if ts.state == "cancelled":
            check(
                ts.previous in ("executing", "long-running", "flight"),
                f"{ts} previous={ts.previous}",
            )
