"""Work stealing: a worker with nothing to run takes tasks another worker claimed and has
not started (Dask's ``distributed/stealing.py``, much reduced).  ``WorkStealing`` is a
mixin of ``SchedulerState`` (pure: events in, instructions out), as ``DataMoves`` is; it
declares the attributes it uses and no stub of the machine's methods (``_emit``,
``_transition``, ``_set_state``, ``_targets``).

Workers claim ahead only what they expect to start within the claim horizon
(``redisdask.durations``), but estimates can be wrong (a straggler of a prefix whose
runs are short, a prefix whose tasks vary): tasks then wait behind a long run on one
worker while another has nothing to do.  The balance, every ``CHECK_INTERVAL`` of the
driver (a ``StealTick``, 200 ms; Dask's is 100 ms):

1. ``plan_steals`` (pure) finds the **thieves**: workers with fewer claimed tasks than
   threads (counting the steals already asked for them), not retiring, for which no
   queued task is waiting that they could claim themselves; and the **victims**: workers
   holding more claimed tasks than threads (the surplus: claimed, not started, as far as
   the scheduler can tell).  Each thief asks the victim with the largest surplus for its
   share of its claims, so that both then hold as many claims per thread (half of them
   between workers of as many threads; one at least, never one it runs): the tasks the
   victim would start last (the largest scores: lowest priority, submitted last), only
   those the thief may run (``workers=``, ``resources=``: ``Placement.targets``) and
   whose data is worth moving (its dependencies' bytes not on the thief, at
   ``BANDWIDTH``, take at most ``COST_RATIO`` times the task's duration estimate;
   ``UNKNOWN_DURATION`` without one, as Dask's ``unknown-task-duration``).
2. The victim gets a ``steal-request`` (keys, thief) in its inbox.  Only the victim knows
   whether a run started, so only it decides: the claims not started (``waiting``,
   ``ready``) it gives up at once in its state machine (they will never run there) and
   answers ``stolen-keys`` on the workers stream, naming the others as ``refused``.
3. The scheduler reads ``stolen-keys``: each key still processing on the victim (the same
   run) is unclaimed and queued for the thief as a task placed by data is (the thief's
   own ready set and the cluster's ``placed`` set, ``queued_on`` = the thief), so the
   thief, woken by the ready-signal, claims it first, and if it died or got busy
   meanwhile any other worker takes it (``CLAIM``'s rules for placed tasks).  A
   restricted or resourced task is queued as any other, for every worker its restriction
   allows.  The task's story says ``queued`` by ``stolen-keys`` from the victim, then
   ``processing`` by the thief's claim; the event log gets a ``stolen`` event.

A request not answered within ``STEAL_TIMEOUT`` (its victim died, or a scheduler that
took over never knew of it) is forgotten, and the key may be asked for again; a refused
one is kept while the task is processing on the victim (it started there: it is not
asked for again, and counts as running, not as surplus).  Nothing in
the plan is stored: a scheduler that takes over starts with none in flight and still
applies every ``stolen-keys`` it reads (the handler needs no record of the request).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from redisdask.durations import Durations
from redisdask.placement import Placement
from redisdask.protocol import Event, StealRequest, StolenKeys
from redisdask.scheduler_instructions import Enqueue, LogEvent, SetState, Unclaim, WorkerMsg
from redisdask.scheduler_tasks import other_run

if TYPE_CHECKING:
    from redisdask.scheduler_tasks import TaskState, WorkerInfo

STEAL_TIMEOUT = 2.0  # seconds a steal request may go unanswered before it is asked again
BANDWIDTH = 100e6  # bytes/s assumed between workers (Dask's ``scheduler.bandwidth``)
UNKNOWN_DURATION = 0.5  # seconds, a task without an estimate (Dask's default)
COST_RATIO = 1.0  # moving a task's data may take at most this times its run's estimate
LOGGED_KEYS = 20  # keys named in one ``stolen`` event at most


@dataclass(slots=True)
class StealTick(Event):
    """The driver's periodic prompt to balance (its look for dead workers); ``now`` is
    its monotonic clock, so the state machine reads no clock.  Made by the driver only,
    never read from a stream (so it is in no ``protocol`` registry)."""

    op: ClassVar[str] = "steal-tick"
    now: float = 0.0


@dataclass(slots=True)
class Asked:
    """A steal request in flight for one task, or refused: the victim started it (it is
    not asked for again while it is processing there, and counts as running)."""

    victim: str
    thief: str
    at: float  # the StealTick's ``now`` when it was asked
    refused: bool = False


def nthreads(ws: WorkerInfo) -> int:
    n = ws.info.get("nthreads")
    return n if isinstance(n, int) and n > 0 else 1


def plan_steals(
    workers: Mapping[str, WorkerInfo],
    in_flight: Mapping[TaskState, Asked],
    may_run: Callable[[TaskState, str], bool],
    has_queued_for: Callable[[str], bool],
) -> list[tuple[str, str, list[TaskState]]]:
    """The steal requests to make now: ``(victim, thief, tasks)`` each (see the module
    docstring).  ``may_run(ts, thief)``: the thief may run ``ts`` and its data is worth
    moving; ``has_queued_for(thief)``: a queued task waits that the thief may claim
    itself (then it steals nothing)."""
    asked_from: dict[str, int] = {}
    asked_for: dict[str, int] = {}
    for asked in in_flight.values():
        asked_from[asked.victim] = asked_from.get(asked.victim, 0) + 1
        if not asked.refused:
            asked_for[asked.thief] = asked_for.get(asked.thief, 0) + 1
    surplus: dict[str, int] = {}
    free: dict[str, int] = {}
    for address, ws in workers.items():
        n, held = nthreads(ws), len(ws.processing)
        extra = held - n - asked_from.get(address, 0)
        room = n - held - asked_for.get(address, 0)
        if extra > 0:
            surplus[address] = extra
        elif room > 0 and not (ws.retiring or ws.retire_heard or ws.told_to_close):
            free[address] = room
    if not surplus or not free:
        return []
    plans: list[tuple[str, str, list[TaskState]]] = []
    taken: set[TaskState] = set()  # asked for by this plan already
    for thief in sorted(free, key=lambda a: (-free[a], a)):
        if has_queued_for(thief):
            continue
        for victim in sorted(surplus, key=lambda a: (-surplus[a], a)):
            if surplus[victim] <= 0:
                break
            share = _share(workers[victim], surplus[victim], workers[thief], free[thief])
            chosen = _choose(workers[victim], share, thief, in_flight, taken, may_run)
            if chosen:  # (else the next victim: this one's surplus may not run there)
                plans.append((victim, thief, chosen))
                surplus[victim] -= len(chosen)
                taken.update(chosen)
                break
    return plans


def _share(victim: WorkerInfo, surplus: int, thief: WorkerInfo, free: int) -> int:
    """How many of the victim's surplus claims the thief takes: so that both then hold
    as many claims per thread (half of them between one-thread workers), one at least;
    ``surplus`` and ``free`` count the requests in flight already."""
    vn, tn = nthreads(victim), nthreads(thief)
    held_v, held_t = surplus + vn, tn - free
    return min(surplus, max(1, (held_v + held_t) * tn // (vn + tn) - held_t))


def _choose(
    victim: WorkerInfo,
    n: int,
    thief: str,
    in_flight: Mapping[TaskState, Asked],
    taken: set[TaskState],
    may_run: Callable[[TaskState, str], bool],
) -> list[TaskState]:
    """Up to ``n`` of the tasks the victim would start last that the thief may run and
    nobody asked for yet."""
    chosen: list[TaskState] = []
    for ts in sorted(victim.processing, key=lambda t: -t.score):
        if len(chosen) >= n:
            break
        if ts not in in_flight and ts not in taken and may_run(ts, thief):
            chosen.append(ts)
    return chosen


def transfer_seconds(ts: TaskState, thief: str) -> float:
    """How long the thief would fetch the task's dependencies (those it lacks; results
    kept in Redis come with the claim), at ``BANDWIDTH``."""
    missing = sum(
        max(dep.nbytes, 0) for dep in ts.dependencies if not dep.inline and thief not in dep.who_has
    )
    return missing / BANDWIDTH


class WorkStealing:
    """``SchedulerState``'s work stealing (see the module docstring); the attributes
    below are the machine's."""

    tasks: dict[str, TaskState]
    workers: dict[str, WorkerInfo]
    durations: Durations
    placement: Placement
    steals: dict[TaskState, Asked]  # steal requests in flight, per task

    def _init_stealing(self) -> None:
        self.steals = {}

    def _handle_steal_tick(self, ev: StealTick) -> None:
        for ts, asked in list(self.steals.items()):
            timed_out = not asked.refused and ev.now - asked.at > STEAL_TIMEOUT
            if timed_out or ts.processing_on != asked.victim:
                del self.steals[ts]
        plans = plan_steals(self.workers, self.steals, self._may_steal, self._queued_for())
        for victim, thief, tasks in plans:
            for ts in tasks:
                self.steals[ts] = Asked(victim, thief, ev.now)
            request = StealRequest([ts.key for ts in tasks], thief)
            self._emit(WorkerMsg(ev.stimulus_id, victim, request))

    def _may_steal(self, ts: TaskState, thief: str) -> bool:
        """The thief may run ``ts`` (its restriction, its resources) and moving its data
        there costs less than ``COST_RATIO`` times its run."""
        targets = self._targets(ts)
        if targets is None or (targets and thief not in targets):
            return False
        if ts.waiting_on or any(d.state == "processing" and ts in d.waiting_on
                                for d in ts.dependents):  # fmt: skip
            return False  # a chain claimed together runs together (scheduler_chain.py)
        estimate = self.durations.averages.get(ts.prefix, UNKNOWN_DURATION)
        return transfer_seconds(ts, thief) <= COST_RATIO * estimate

    def _queued_for(self) -> Callable[[str], bool]:
        """Whether a queued task waits that a given worker may claim itself: any task
        that may run anywhere (the shared set, or placed by data: ``CLAIM`` lets others
        take it), or a restricted or sticky one (``decide.sticky``: the others leave it
        to its worker) queued for that worker.  One pass over the tasks, at the first
        question (a plan asks only when a thief and a victim exist)."""
        known: list[Callable[[str], bool]] = []

        def queued_for(thief: str) -> bool:
            if not known:
                known.append(self._scan_queued())
            return known[0](thief)

        return queued_for

    def _scan_queued(self) -> Callable[[str], bool]:
        restricted: set[str] = set()
        for ts in self.tasks.values():
            if ts.state == "queued":
                if not (ts.restrict or ts.resources or ts.sticky):
                    return lambda thief: True
                restricted.update(ts.queued_on)
        return restricted.__contains__

    def _handle_stolen_keys(self, ev: StolenKeys) -> None:
        """The victim gave these claims up (they will not run there): queue each for the
        thief.  A key no longer processing there (the victim died and its tasks were
        queued again, or another run of the key) is left as it is."""
        victim = self.workers.get(ev.worker)
        for key in ev.refused:  # (started: not to be asked for again while it runs there)
            ts = self.tasks.get(key)
            asked = self.steals.get(ts) if ts is not None else None
            if asked is not None:
                asked.refused = True
        scores = list(ev.scores) + [float("nan")] * (len(ev.keys) - len(ev.scores))
        moved = []
        for key, score in zip(ev.keys, scores, strict=False):
            ts = self.tasks.get(key)
            if ts is None:
                continue
            self.steals.pop(ts, None)
            if victim is None or ts not in victim.processing or other_run(score, ts):
                continue
            victim.processing.discard(ts)
            self._emit(Unclaim(ev.stimulus_id, victim.address, key))
            if ts.state == "processing":
                ts.processing_on = None
                self._queue_for(ts, ev.thief, stimulus_id=ev.stimulus_id)
                moved.append(key)
        if moved:
            fields = {"victim": ev.worker, "thief": ev.thief, "n": len(moved),
                      "keys": moved[:LOGGED_KEYS]}  # fmt: skip
            self._emit(LogEvent(ev.stimulus_id, "stolen", fields))

    def _queue_for(self, ts: TaskState, thief: str, *, stimulus_id: str) -> None:
        """Queue a stolen task (processing on nobody now) first for ``thief``, as a task
        placed by data: others take it if the thief is busy, paused or gone.  A
        restricted or resourced one, or one whose thief left or retires: as any other."""
        ws = self.workers.get(thief)
        unfit = ws is None or ws.retiring or ws.retire_heard or ws.told_to_close
        if ts.restrict or ts.resources or unfit:
            self._transition(ts, "queued", stimulus_id=stimulus_id)
            return
        self._set_state(ts, "queued", stimulus_id=stimulus_id)
        ts.queued_on = (thief,)
        self._emit(SetState(stimulus_id, ts.key, "queued"))
        on = ts.queued_on
        self._emit(Enqueue(stimulus_id, ts.key, ts.score, on, on, placed=True, preferred=True))

    _STEAL_HANDLERS: ClassVar[dict[type[Event], Callable[[Any, Any], None]]] = {
        StealTick: _handle_steal_tick,
        StolenKeys: _handle_stolen_keys,
    }
