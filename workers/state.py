"""The worker's task state machine: pure, synchronous, sans-I/O.

``WorkerState.handle_stimulus(*events) -> list[Instruction | Report]`` is the only entry
point that changes state.  It never touches a socket, Redis, a thread or a clock: the
async driver feeds it *events* (something happened: a task was claimed, a computation
finished, a peer answered) and carries out the *instructions* it returns (run a task,
fetch data from a peer) and sends the *reports* (``redisdask.protocol`` messages to the
scheduler: a task finished or erred, data missing, keys added or released).  Every
timestamp comes from an event, so a recorded sequence of events replays to the same
instructions, and the whole machine can be unit-tested in microseconds.  Modelled on Dask's
``distributed/worker_state_machine.py``, much reduced, and written in the idiom it shares
with the scheduler's machine (``redisdask.state_machine``): handlers chosen by event type
(``_HANDLERS``), the legal moves in one table (``_TRANSITIONS``), ``stimulus_id``
keyword-only and last in every transition, and a story of every state change.

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
import itertools
import random
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from redisdask.durations import claim_delay, misleads, remaining, start_times, stuck_in
from redisdask.errors import RedisDaskError
from redisdask.placement import EPSILON, fits
from redisdask.protocol import (
    NO_SCORE,
    AddKeys,
    MissingData,
    ReleasedKeys,
    StolenKeys,
    TaskErred,
    TaskFinished,
)
from redisdask.spec import key_prefix
from redisdask.state_machine import InvalidTransition
from redisdask.store.keyspace import REDIS_COPY
from redisdask.typenames import type_name
from redisdask.workers.events import (
    AcquireReplicasEvent,
    ClaimsHandledEvent,
    ComputeTaskEvent,
    Execute,
    ExecuteFailureEvent,
    ExecuteSuccessEvent,
    FreeKeysEvent,
    GatherDep,
    GatherDepNetworkFailureEvent,
    GatherDepSuccessEvent,
    Instruction,
    KeysRecordedEvent,
    PauseEvent,
    PutDataEvent,
    Rejoin,
    RejoinEvent,
    Report,
    RetireAbortedEvent,
    RetireEvent,
    RunsOverdueEvent,
    SecedeEvent,
    StateMachineEvent,
    StealRequestEvent,
    UnpauseEvent,
    UpdateWhoHasEvent,
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
MAX_CLAIM = 1000
_RUNNING = ("executing", "long-running")  # a thread computes the task


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
    priority: tuple[Any, ...] | None = None
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

    def __repr__(self) -> str:
        return f"<TaskState {self.key!r} {self.state}>"


def _claimed_after(ts: TaskState, ev: FreeKeysEvent) -> bool:
    """Whether ``ts`` was claimed here after what the scheduler had read when it sent
    ``ev``: a claim made before the worker read a free-keys about the copy it held (a
    claim answered from that copy, or run anew) must not lose its answer to it."""
    return ts.claim is not None and ev.seen is not None and ts.claim > ev.seen


def _run_score(ts: TaskState) -> float:
    """Which run of its key a report answers: the score of the claim that ran (the first
    item of the priority the claim gave), for the scheduler to tell a late result."""
    return float(ts.priority[0]) if ts.priority else NO_SCORE


def _movable(ts: TaskState) -> bool:
    """A claim held here (waiting or ready) that may run elsewhere instead: still
    wanted, no claimed task here depends on it, no claim deferred behind it."""
    return ts.wanted and not ts.dependents and ts.deferred is None


def _elapsed(ts: TaskState, now: float | None) -> float:
    """How long ``ts`` has run, by the driver's clock (0 when either time is unknown)."""
    return 0.0 if now is None or ts.began is None else max(now - ts.began, 0.0)


def _check(cond: object, msg: str) -> None:
    """An invariant of ``validate_state``."""
    if not cond:
        raise InvalidTaskState(msg)


def _host(address: str) -> str:
    rest = address.split("://", 1)[-1]
    return rest.rsplit(":", 1)[0] if ":" in rest else rest


StoryEntry = tuple[str, str, str, str, float | None]


# ---------------------------------------------------------------------------------------
# The state machine
# ---------------------------------------------------------------------------------------


class WorkerState:
    """All the task state of one worker, advanced only by ``handle_stimulus``."""

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
        self.host = _host(address)
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

    # -- public API ------------------------------------------------------------------

    def handle_stimulus(self, *events: StateMachineEvent) -> list[Instruction | Report]:
        """Apply events in order; return the instructions for the driver to carry out."""
        self._instructions = out = []
        for ev in events:
            self.stimulus_log.append(ev)
            self._event_time = getattr(ev, "stop", None) or self.clock
            self._HANDLERS[type(ev)](self, ev)
            self._ensure_computing(ev.stimulus_id)
            self._ensure_communicating(ev.stimulus_id)
            if self._newly_missing:
                worker = getattr(ev, "worker", None)
                missing = sorted(self._newly_missing)
                self._emit(
                    MissingData(
                        self.address,
                        missing,
                        errant_worker=worker or "",
                        stimulus_id=ev.stimulus_id,
                    )
                )
                self._newly_missing = []
            if self.validate:
                self.validate_state()
        return out

    def resync_report(self) -> dict[str, Any]:
        """What this worker tells a scheduler after Redis was away (``AddWorker.resync``):
        the results it holds for the cluster (not a dependency fetched for a run here:
        no holder on record, it goes when its dependents here are done and the next claim
        brought none that needs it, and nobody is told)
        and the claims it still has."""
        tasks = self.tasks.values()
        return {
            "keys": {ts.key: ts.nbytes or 0 for ts in tasks if ts.state == "memory" and ts.wanted},
            "processing": [
                ts.key
                for ts in tasks
                if ts.wanted and ts.state not in ("memory", "released", "error")
            ],
        }

    def claim_budget(self, horizon: float = 0.02, now: float | None = None) -> list[float]:
        """When each thread may start a task claimed now, in seconds from ``now`` (the
        driver's clock), for the threads that start one within ``horizon``; empty: claim
        nothing (paused, retiring, or every thread busy for longer).

        The CLAIM script takes a task only for one of these threads, busy then for the
        task's estimate longer (``redisdask/durations.py``): what runs here counts for its
        expected remaining time (unknown, or twice overdue: for good), and what is held
        claimed and not started for its estimate, spread over the threads.  So
        tasks of unknown cost are claimed one per free thread, tiny ones in batches that
        keep the threads busy for ``horizon``, and nothing waits here behind a long run.
        """
        if self.paused or self.retiring:
            return []
        return start_times(self.nthreads, *self._loads(horizon, now), horizon)

    def claim_delay(self, horizon: float = 0.02, now: float | None = None) -> float | None:
        """Seconds from ``now`` until ``claim_budget`` gives a thread, by the estimates
        of what runs and is held here (``durations.claim_delay``); None: not by time
        alone (paused, retiring, every thread busy for an unknown time), or no need: a
        task is held for each thread already, so none goes idle when its run ends (the
        end wakes the claim loop, which claims then)."""
        if self.paused or self.retiring or self._held_count() >= self.nthreads:
            return None
        return claim_delay(self.nthreads, *self._loads(horizon, now), horizon)

    def _held_count(self) -> int:
        """How many tasks ``_loads`` counts as held (without sizing each)."""
        return len(self.by_state["waiting"]) + len(self.by_state["ready"]) + len(self.rejoining)

    def _loads(self, horizon: float, now: float | None) -> tuple[list[float], list[float | None]]:
        """The expected remaining time of each run, and the estimate of each task held
        claimed and not started (None: unknown)."""
        running = [remaining(ts.estimate, _elapsed(ts, now), horizon) for ts in self.executing]
        waiting, ready = self.by_state["waiting"], self.by_state["ready"]
        held = [ts.estimate for ts in waiting] + [ts.estimate for ts in ready]
        held += [None] * len(self.rejoining)  # seceded runs that take a slot back: no end
        return running, held

    def _tell(self, entry: StoryEntry) -> None:
        self.story.append(entry)
        self.story_total += 1

    def story_since(self, total: int) -> list[StoryEntry]:
        """The entries appended after the first ``total`` (as many as are still kept)."""
        new = min(self.story_total - total, len(self.story))
        return list(itertools.islice(reversed(self.story), new))[::-1]  # O(new), not O(len)

    def stories(self, *keys: str) -> list[StoryEntry]:
        """The story entries about ``keys``."""
        wanted = set(keys)
        return [entry for entry in self.story if entry[0] in wanted]

    # -- event handlers --------------------------------------------------------------

    def _handle_compute(self, ev: ComputeTaskEvent) -> None:
        sid = ev.stimulus_id
        known = self.tasks.get(ev.key)
        if known is not None and ev.priority[:1] != (known.priority or ())[:1]:
            if self._drop_other_run(known, ev):
                return  # deferred until its thread returns
            known = self.tasks.get(ev.key)
        leaving = (self.retiring or self.paused) and (
            known is None or known.state in ("fetch", "missing")
        )
        if leaving or not self._may_hold(known, ev.resources):
            # a claim that crossed the retirement or a pause, or one whose transfer here
            # failed, or (never: claims count what is free) one that does not fit what is
            # free: hand it back (what runs, is fetched or is held here is answered as usual)
            score = [float(ev.priority[0])] if ev.priority else []
            self._emit(ReleasedKeys(self.address, [ev.key], score, stimulus_id=sid))
            if known is not None:
                known.wanted = False
                self._release_if_unneeded(known, sid)
            return
        ts = self._ensure_task(ev.key)
        ts.wanted = True
        ts.run_spec, ts.priority, ts.estimate = ev.run_spec, ev.priority, ev.estimate
        ts.claim = ev.claim  # (none for a pushed task: it comes in order with free-keys)
        if ts.state == "memory":  # claimed again: repeat the answer
            self._emit_finished(ts, sid)
            return
        # error: a run here failed and the scheduler queued the key again (a retry, or a
        # new submission of it): the scheduler only queues what it wants run, so every
        # claim of a key in error is a new run, set up below like any claimed task
        if ts.state in ("waiting", "ready", "executing", "long-running"):
            return  # a duplicate claim
        if ts.state == "cancelled" and ts.previous == "flight":
            # freed in flight (its holder was declared dead: its dependent here was taken
            # back), now claimed to compute here: resumed in flight, with the claim
            # deferred as below.  Resumed without it, a failed transfer left the key
            # missing and its claim unanswered for ever (a SIGSTOPped holder, issue 22)
            self._transition(ts, "flight", stimulus_id=sid)
        if ts.state == "flight":
            ts.deferred = ev  # the transfer may still bring it; if it fails, compute it
            if ts.held is None:
                ts.resources = ev.resources or None
            self._sync_resources(ts)
            return
        # fetch or missing: its data was lost elsewhere and the scheduler asks this worker
        # to compute it: stop waiting for a transfer and set it up like any claimed task
        if ts.state == "cancelled":  # freed while running, now claimed again: resume
            self._transition(ts, ts.previous or "executing", stimulus_id=sid)
            return
        ts.resources = ev.resources or None  # held from here until the run leaves
        self._link_dependencies(ts, ev)
        self._transition(ts, "waiting" if ts.waiting_for_data else "ready", stimulus_id=sid)

    def _drop_other_run(self, known: TaskState, ev: ComputeTaskEvent) -> bool:
        """A claim of another run of the key than the one here (the key released, then
        submitted again: perhaps another computation under the same key; or the claim of
        this run taken back as stale): this run must not answer it.  Returns whether the
        claim waits for this run's thread to return (``_rerun`` sets it up then)."""
        sid = ev.stimulus_id
        if known.state in ("waiting", "ready", *_RUNNING):
            known.wanted = False  # dropped (a running one once its thread returns)
            self._release_if_unneeded(known, sid)
        if known.state == "cancelled" and known.previous in _RUNNING:
            known.deferred = ev
            return True
        if known.state == "memory" and not known.dependents:
            self._transition(known, "released", stimulus_id=sid)  # computed anew
        return False

    def _link_dependencies(self, ts: TaskState, ev: ComputeTaskEvent) -> None:
        """The claimed task's dependencies: each known, linked, and fetched unless here;
        those not here are what it waits for."""
        sid = ev.stimulus_id
        for dep_key, (who_has, nbytes) in ev.dependencies.items():
            dep = self._ensure_task(dep_key)
            ts.dependencies.add(dep)
            dep.dependents.add(ts)
            if dep.priority is None or ev.priority < dep.priority:
                dep.priority = ev.priority
                if dep.state == "fetch":  # (the heaps hold the priority it had)
                    for worker in dep.who_has:
                        self._need_from(dep, worker)
            if dep.nbytes is None:
                dep.nbytes = nbytes
            if dep.state == "error":
                # a failed run of it here is not the result the scheduler has in memory
                # elsewhere: that result is fetched, and the failed run is not reported
                dep.wanted = False
            if dep.state != "memory":
                self._add_who_has(dep, who_has)
            if dep.state in ("released", "error"):
                self._transition(dep, "fetch" if dep.who_has else "missing", stimulus_id=sid)
            elif dep.state == "missing" and dep.who_has:
                self._transition(dep, "fetch", stimulus_id=sid)
            elif dep.state == "cancelled" and dep.previous == "flight":
                self._transition(dep, "flight", stimulus_id=sid)
            if dep.state != "memory":
                ts.waiting_for_data.add(dep)

    def _handle_execute_success(self, ev: ExecuteSuccessEvent) -> None:
        ts = self._finished_execution(ev.key, ev.start, ev.stop, "memory", ev.stimulus_id)
        if ts is None or self._rerun(ts, ev.stimulus_id):
            return
        ts.type, ts.start, ts.stop = ev.type, ev.start, ev.stop
        if ts.state in ("executing", "long-running") or ts.dependents or ts.replica:
            inline = {"inline": ev.inline} if ts.state != "cancelled" else {}
            self._transition(
                ts, "memory", value=ev.value, nbytes=ev.nbytes, stimulus_id=ev.stimulus_id, **inline
            )
        else:  # cancelled and nobody wants it: drop the result
            self._dropped(ts, ev.stimulus_id)

    def _handle_execute_failure(self, ev: ExecuteFailureEvent) -> None:
        ts = self._finished_execution(ev.key, ev.start, ev.stop, "error", ev.stimulus_id)
        if ts is None or self._rerun(ts, ev.stimulus_id):
            return
        ts.start, ts.stop = ev.start, ev.stop
        if ts.state in ("executing", "long-running"):
            self._transition(ts, "error", error=ev, stimulus_id=ev.stimulus_id)
        elif ts.dependents:  # cancelled, but needed here: fetch it from elsewhere
            self._after_failed_fetch(ts, ev.stimulus_id)
        else:
            self._dropped(ts, ev.stimulus_id)

    def _dropped(self, ts: TaskState, sid: str) -> None:
        """A cancelled run's outcome, that nobody wants: dropped, and the scheduler told
        which run it was (a claim of a newer run of the key may be under way here)."""
        score = _run_score(ts)
        self._transition(ts, "released", stimulus_id=sid)
        self._emit(ReleasedKeys(self.address, [ts.key], [score], stimulus_id=sid))

    def _rerun(self, ts: TaskState, sid: str) -> bool:
        """A cancelled run's thread returned while another run of its key waits
        (``deferred``): drop this run's outcome and set that one up."""
        if ts.state != "cancelled" or ts.deferred is None:
            return False
        self._transition(ts, "fetch", stimulus_id=sid)  # (frees the thread; not for long)
        self._sync_resources(ts)  # what the old run held
        claim, ts.deferred = ts.deferred, None
        self._handle_compute(claim)
        return True

    def _finished_execution(
        self, key: str, start: float, stop: float, finish: str, sid: str
    ) -> TaskState | None:
        ts = self.tasks.get(key)
        if ts is None:  # unknown key: a stale message, nothing to do
            self._tell((key, "forgotten", finish, sid, self._event_time))
            return None
        if ts.state in _RUNNING or (ts.state == "cancelled" and ts.previous in _RUNNING):
            return ts
        raise InvalidTransition(key, ts.state, finish, sid, self.stories(key))

    def _handle_gather_success(self, ev: GatherDepSuccessEvent) -> None:
        sid = ev.stimulus_id
        for key in sorted(self.in_flight_workers.pop(ev.worker, ())):
            ts = self.tasks.get(key)
            if ts is None or ts.coming_from != ev.worker:
                continue  # arrived another way meanwhile (PutData) or forgotten
            if key not in ev.data:
                self._forget_holder(ts, ev.worker)
                self._after_failed_fetch(ts, sid)
            elif ts.state == "flight" or ts.dependents:
                nbytes = ev.nbytes.get(key, ts.nbytes or 0)
                self._transition(ts, "memory", value=ev.data[key], nbytes=nbytes, stimulus_id=sid)
            else:
                self._transition(ts, "released", stimulus_id=sid)

    def _handle_gather_network_failure(self, ev: GatherDepNetworkFailureEvent) -> None:
        sid = ev.stimulus_id
        in_flight = self.in_flight_workers.pop(ev.worker, set())
        held = sorted(self.has_what.pop(ev.worker, set()))
        for key in held:
            self.tasks[key].who_has.discard(ev.worker)
        for key in sorted(in_flight):
            ts = self.tasks.get(key)
            if ts is not None and ts.coming_from == ev.worker:
                self._after_failed_fetch(ts, sid)
        for key in held:
            ts = self.tasks.get(key)  # may have been released meanwhile
            if ts is not None and ts.state == "fetch" and not ts.who_has:
                self._transition(ts, "missing", stimulus_id=sid)

    def _handle_update_who_has(self, ev: UpdateWhoHasEvent) -> None:
        for key, workers in ev.who_has.items():
            ts = self.tasks.get(key)
            if ts is None or ts.state == "memory":
                continue
            for worker in ts.who_has - set(workers):
                self._forget_holder(ts, worker)
            self._add_who_has(ts, workers)
            if ts.state == "missing" and ts.who_has:
                self._transition(ts, "fetch", stimulus_id=ev.stimulus_id)
            elif ts.state == "fetch" and not ts.who_has:
                self._transition(ts, "missing", stimulus_id=ev.stimulus_id)

    def _handle_free_keys(self, ev: FreeKeysEvent) -> None:
        for key in ev.keys:
            ts = self.tasks.get(key)
            if ts is not None and ts.unrecorded and not ev.force:
                continue  # sent for an older copy: the scheduler has not recorded this one
            if ts is not None and _claimed_after(ts, ev):
                continue  # sent for an older copy: the scheduler had not read this claim
            if ts is not None and ev.run is not None and _run_score(ts) != ev.run:
                continue  # about another run's copy than this one
            if ts is not None:
                ts.unrecorded = 0
                ts.wanted = ts.replica = ts.fetched = False
                self._stop_lingering(ts)
                ts.deferred = None
                self._release_if_unneeded(ts, ev.stimulus_id)
                self._sync_resources(ts)  # a deferred claim gave its resources back

    def _handle_put_data(self, ev: PutDataEvent) -> None:
        accepted: dict[str, int] = {}
        for key, value in ev.data.items():
            ts = self._ensure_task(key)
            if ts.state in ("executing", "long-running", "cancelled"):
                continue  # the running computation will produce it
            nbytes = ev.nbytes.get(key, 0)
            if ts.state == "memory":
                ts.nbytes = nbytes
                self.data[key] = value
            else:
                ts.wanted = False  # no TaskFinished: AddKeys below says it all
                self._transition(
                    ts, "memory", value=value, nbytes=nbytes, stimulus_id=ev.stimulus_id
                )
            ts.wanted = True
            ts.unrecorded += 1  # until the scheduler's keys-recorded for this copy
            accepted[key] = nbytes
        if accepted:
            self._emit(
                AddKeys(self.address, sorted(accepted), accepted, stimulus_id=ev.stimulus_id)
            )

    def _handle_keys_recorded(self, ev: KeysRecordedEvent) -> None:
        for key in ev.keys:
            ts = self.tasks.get(key)
            if ts is not None and ts.unrecorded:
                ts.unrecorded -= 1

    def _handle_acquire_replicas(self, ev: AcquireReplicasEvent) -> None:
        held: dict[str, int] = {}
        for key, who_has in ev.who_has.items():
            ts = self._ensure_task(key)
            if ts.state == "memory":
                ts.wanted = True
                held[key] = ts.nbytes or 0
                continue
            if ts.state == "error":  # a failed run here, since run again elsewhere
                ts.wanted = False
            ts.replica = True
            self._add_who_has(ts, who_has)
            if ts.state in ("released", "error") or (ts.state == "missing" and ts.who_has):
                self._transition(
                    ts, "fetch" if ts.who_has else "missing", stimulus_id=ev.stimulus_id
                )
        if held:
            self._emit(AddKeys(self.address, sorted(held), held, stimulus_id=ev.stimulus_id))

    def _handle_retire(self, ev: RetireEvent) -> None:
        self.retiring = True
        self._hand_back_unstarted(ev.stimulus_id)

    def _handle_retire_aborted(self, ev: RetireAbortedEvent) -> None:
        self.retiring = False

    def _hand_back_unstarted(self, stimulus_id: str) -> None:
        """Give the scheduler back the tasks claimed here that have not started, so that
        other workers run them (queued again, without suspicion)."""
        unstarted = [
            ts for ts in self.tasks.values() if ts.wanted and ts.state in ("waiting", "ready")
        ]
        self._give_back(unstarted, stimulus_id)

    def _give_back(
        self, tasks: Iterable[TaskState], stimulus_id: str, overdue: dict[str, float] | None = None
    ) -> None:
        handed_back, scores = [], []
        for ts in sorted(tasks, key=lambda t: t.key):
            ts.wanted = False
            handed_back.append(ts.key)
            scores.append(_run_score(ts))
            self._release_if_unneeded(ts, stimulus_id)
        if handed_back:
            self._emit(ReleasedKeys(self.address, handed_back, scores, overdue=overdue or {},
                                    stimulus_id=stimulus_id))  # fmt: skip

    def _surplus_claims(self) -> list[TaskState]:
        """The claims that wait here for a thread alone (``ready``: their data is here),
        but the next one for each thread (those start as soon as a run ends, with no
        claim's round trip: a worker holds one task more than it runs, as distributed's
        does), that may run elsewhere instead (``_movable``).  Not the ``waiting`` ones:
        a link of a chain claimed behind a run here waits for that run (handed back, it
        would wait for a scheduler to queue it again), and a transfer is under way for
        the others."""
        ready = sorted(self.by_state["ready"], key=lambda t: (t.priority or (), t.key))
        return [ts for ts in ready[self.nthreads :] if _movable(ts)]

    def give_back_delay(self, horizon: float = 0.02, now: float | None = None) -> float | None:
        """Seconds from ``now`` until every thread runs a task past any expectation
        while claims wait ready behind them, more than one per thread (0: now;
        ``RunsOverdueEvent`` then hands those back); None: not by time alone (a thread
        is free, nothing held may go, or paused or retiring: those hand back everything
        anyway).  Whether anything held may go (``_surplus_claims``, a sort of every
        claim) is asked only once the time is up: the claim loop asks after every run,
        and that sort was a third of a worker's CPU in a ``map`` of no-ops; a delay so
        given while nothing may go only makes the loop look once more."""
        if self.paused or self.retiring or len(self.executing) < self.nthreads:
            return None
        if len(self.by_state["ready"]) <= self.nthreads:
            return None
        delay = max(stuck_in(ts.estimate, _elapsed(ts, now), horizon) for ts in self.executing)
        return delay if delay > 0 or self._surplus_claims() else None

    def _handle_runs_overdue(self, ev: RunsOverdueEvent) -> None:
        if self.give_back_delay(ev.horizon, ev.now) != 0:
            return
        overdue: dict[str, float] = {}  # per prefix, the longest run that belies its estimate
        for ts in self.executing:  # (not a rejoined run: its wait outside the pool is no
            # compute time, as its duration is kept out of the averages)
            if ts.estimate is not None and not ts.seceded and misleads(ts.estimate, ev.horizon):
                prefix, elapsed = key_prefix(ts.key), round(_elapsed(ts, ev.now), 6)
                overdue[prefix] = max(overdue.get(prefix, 0.0), elapsed)
        self._give_back(self._surplus_claims(), ev.stimulus_id, overdue)

    def _handle_steal_request(self, ev: StealRequestEvent) -> None:
        """Give back the asked-for claims that have not started, as ``_hand_back_unstarted``
        does: only this worker knows whether a run started, so a task is never run both
        here and by the thief.  Not one a claimed task here depends on, nor a claim
        deferred behind a run or a transfer of its key."""
        stolen, scores, refused = [], [], []
        for key in ev.keys:
            ts = self.tasks.get(key)
            if ts is None or ts.state not in ("waiting", "ready") or not _movable(ts):
                refused.append(key)
                continue
            ts.wanted = False
            stolen.append(key)
            scores.append(_run_score(ts))
            self._release_if_unneeded(ts, ev.stimulus_id)
        sid = ev.stimulus_id
        self._emit(StolenKeys(self.address, ev.thief, stolen, scores, refused, stimulus_id=sid))

    def lingering_keys(self) -> list[str]:
        """The keys kept for the next claim, as ``ClaimsHandledEvent`` names them."""
        return sorted(ts.key for ts in self.lingering)

    def _handle_claims_handled(self, ev: ClaimsHandledEvent) -> None:
        for key in ev.keys:
            ts = self.tasks.get(key)
            if ts is not None and ts.lingers:
                self._stop_lingering(ts)
                self._release_if_unneeded(ts, ev.stimulus_id)

    def _handle_secede(self, ev: SecedeEvent) -> None:
        ts = self.tasks.get(ev.key)
        if ts is None:  # a stale message (its run was dropped): nothing to do
            return
        if ts.state == "executing":
            self._transition(ts, "long-running", stimulus_id=ev.stimulus_id)
        elif ts.state == "cancelled" and ts.previous == "executing":
            self.executing.discard(ts)  # freed, still running: its slot is free now
            self.long_running.add(ts)
            ts.previous, ts.seceded = "long-running", True
        # long-running already (secede() twice): nothing to do

    def _handle_rejoin(self, ev: RejoinEvent) -> None:
        ts = self.tasks.get(ev.key)
        if ts is not None and ts in self.long_running:
            if ts not in self.rejoining:
                self.rejoining.append(ts)  # _ensure_computing grants a slot when one is free
        else:  # never seceded, or unknown: nothing to wait for
            self._emit(Rejoin(ev.key, ev.stimulus_id))

    def _handle_pause(self, ev: PauseEvent) -> None:
        """Start nothing more; what was claimed and not started runs elsewhere (a worker
        that cannot spill may stay paused for good)."""
        self.paused = True
        self._hand_back_unstarted(ev.stimulus_id)

    def _handle_unpause(self, ev: UnpauseEvent) -> None:
        self.paused = False

    # the handler of each event type (``handle_stimulus`` looks it up by ``type(event)``)
    _HANDLERS: ClassVar[dict[type[StateMachineEvent], Callable[[WorkerState, Any], None]]] = {
        ComputeTaskEvent: _handle_compute,
        ExecuteSuccessEvent: _handle_execute_success,
        ExecuteFailureEvent: _handle_execute_failure,
        GatherDepSuccessEvent: _handle_gather_success,
        GatherDepNetworkFailureEvent: _handle_gather_network_failure,
        UpdateWhoHasEvent: _handle_update_who_has,
        FreeKeysEvent: _handle_free_keys,
        KeysRecordedEvent: _handle_keys_recorded,
        PutDataEvent: _handle_put_data,
        AcquireReplicasEvent: _handle_acquire_replicas,
        PauseEvent: _handle_pause,
        UnpauseEvent: _handle_unpause,
        RetireEvent: _handle_retire,
        RetireAbortedEvent: _handle_retire_aborted,
        SecedeEvent: _handle_secede,
        RejoinEvent: _handle_rejoin,
        StealRequestEvent: _handle_steal_request,
        RunsOverdueEvent: _handle_runs_overdue,
        ClaimsHandledEvent: _handle_claims_handled,
    }

    # -- scheduling policies ---------------------------------------------------------

    def _ensure_computing(self, sid: str) -> None:
        """Fill free slots: seceded tasks that rejoin first (they started long ago and
        their thread is waiting; a pause does not hold them back), then ready tasks."""
        while self.rejoining and len(self.executing) < self.nthreads:
            ts = self.rejoining.popleft()
            if ts.state == "long-running":
                self._transition(ts, "executing", stimulus_id=sid)
            else:  # cancelled while seceded: it takes its slot back all the same
                self.long_running.discard(ts)
                self.executing.add(ts)
                ts.previous = "executing"
                self._emit(Rejoin(ts.key, sid))
        heap = self._ready_heap
        while not self.paused and heap and len(self.executing) < self.nthreads:
            ts = heapq.heappop(heap)[2]
            if ts.state == "ready":  # else a stale heap entry
                self._transition(ts, "executing", stimulus_id=sid)

    def _ensure_communicating(self, sid: str) -> None:
        """Start GatherDeps, batched per peer: the free peers ranked by the priority of
        the first task each holds (a copy kept in Redis first: one read, often answered
        already; then peers on this host; ties broken at random), each batch the holder's
        tasks in priority order.  Cost: the peers and the tasks batched, never every task
        in ``fetch`` (a sort of those at each stimulus stalled the event loop for seconds
        when 30,000 results were to be fetched from one peer)."""
        in_flight = self.in_flight_workers
        if not self.by_state["fetch"]:
            self._needed.clear()  # (only stale entries are left)
            return
        if len(in_flight) >= self.transfer_concurrency:
            return
        ranked = []
        for peer, heap in sorted(self._needed.items()):  # (sorted: the same draws each run)
            if peer in in_flight:
                continue
            while heap and not self._fetchable(heap[0][3], peer):
                heapq.heappop(heap)
            if not heap:
                del self._needed[peer]
                continue
            local = peer == REDIS_COPY or _host(peer) == self.host
            ranked.append((peer != REDIS_COPY, heap[0][:2], not local, self.rng.random(), peer))
        for *_, peer in sorted(ranked):
            if len(in_flight) >= self.transfer_concurrency:
                break
            batch, total = self._take_batch(peer)
            if not batch:  # (all taken by the batches of peers ranked before it)
                continue
            in_flight[peer] = set(batch)
            for ts in batch.values():
                self._transition(ts, "flight", worker=peer, stimulus_id=sid)
            self._emit(GatherDep(peer, set(batch), total, sid))

    def _take_batch(self, peer: str) -> tuple[dict[str, TaskState], int]:
        """The tasks to ask ``peer`` for, highest priority first, up to the batch's
        bytes and keys; popped from its heap."""
        heap = self._needed[peer]
        batch: dict[str, TaskState] = {}
        total = 0
        while heap:
            ts = heap[0][3]
            if not self._fetchable(ts, peer) or ts.key in batch:
                heapq.heappop(heap)
                continue
            nbytes = ts.nbytes or 0
            if batch and (
                total + nbytes > self.transfer_batch_bytes or len(batch) >= self.transfer_batch_keys
            ):
                break
            heapq.heappop(heap)
            batch[ts.key] = ts
            total += nbytes
        return batch, total

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

    # -- resources -------------------------------------------------------------------

    def free_resources(self) -> dict[str, float]:
        """What more tasks may be claimed for: each resource's amount nothing holds."""
        available = self.available_resources
        return {name: max(0.0, available.get(name, 0.0)) for name in self.total_resources}

    def _may_hold(self, known: TaskState | None, need: dict[str, float]) -> bool:
        """Whether a claim needing ``need`` may start here: it fits what is free, or its
        key holds what it needs already (a duplicate claim, a run resumed)."""
        if not need or (known is not None and known.held is not None):
            return True
        starts = (
            known is None
            or known.state in ("fetch", "missing", "error", "flight")
            or (known.state == "cancelled" and known.previous == "flight")  # (resumed)
        )
        return not starts or fits(need, self.available_resources)

    @staticmethod
    def _holds(ts: TaskState) -> bool:
        """Whether a task holds its resources now: a claimed run, from its claim until
        it leaves (a cancelled one until its thread returns)."""
        if not ts.resources:
            return False
        return (
            ts.state in ("waiting", "ready", "executing", "long-running")
            or (ts.state == "cancelled" and ts.previous in _RUNNING)
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
                score=_run_score(ts),
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
                score=_run_score(ts),
                stimulus_id=sid,
            )
        )

    def _ensure_task(self, key: str) -> TaskState:
        ts = self.tasks.get(key)
        if ts is None:
            ts = self.tasks[key] = TaskState(key)
        return ts

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

    def _add_who_has(self, ts: TaskState, workers: Iterable[str]) -> None:
        for worker in workers:
            if worker != self.address and worker not in ts.who_has:
                ts.who_has.add(worker)
                self.has_what[worker].add(ts.key)
                if ts.state == "fetch":
                    self._need_from(ts, worker)

    def _forget_holder(self, ts: TaskState, worker: str) -> None:
        ts.who_has.discard(worker)
        keys = self.has_what.get(worker)
        if keys is not None:
            keys.discard(ts.key)
            if not keys:
                del self.has_what[worker]

    def _after_failed_fetch(self, ts: TaskState, sid: str) -> None:
        """A fetch (or, for a cancelled task, a computation) did not produce the data."""
        if ts.state == "cancelled" and not ts.dependents:
            self._transition(ts, "released", stimulus_id=sid)
        elif ts.deferred is not None:  # claimed meanwhile: compute it here
            self._transition(ts, "missing", stimulus_id=sid)
            claim, ts.deferred = ts.deferred, None
            self._handle_compute(claim)
            if ts.state == "missing" and ts.who_has:  # handed back (retiring, paused)
                self._transition(ts, "fetch", stimulus_id=sid)
        else:
            self._transition(ts, "fetch" if ts.who_has else "missing", stimulus_id=sid)

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
