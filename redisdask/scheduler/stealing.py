"""Work stealing: a worker with nothing to run takes tasks another worker claimed and has
not started (Dask's ``distributed/stealing.py``, much reduced).  ``WorkStealing`` is a
part of ``SchedulerState`` (``state.stealing``, pure: events in, instructions out) that
owns the steal requests in flight, as Dask's ``WorkStealing`` extension owns its
``in_flight``.

Workers claim ahead only what they expect to start within the claim horizon
(``redisdask.durations``), and a worker whose every thread runs a task past any
expectation hands back what it holds (``workers/state.py``, ``RunsOverdueEvent``); but
estimates can be wrong in ways that leave claims waiting on one worker while another
has nothing to do (a run not yet twice its estimate, a worker with a free thread among
stuck ones, a long claim horizon, a worker that joins).  The balance, every
``STEAL_INTERVAL`` of the driver (a ``StealTick``, 100 ms, as Dask's
``work-stealing-interval``):

1. ``plan_steals`` (pure) finds the **thieves**: workers with fewer claimed tasks than
   threads, not retiring, for which no queued task is waiting that they could claim
   themselves; and the **victims**: workers holding more claimed tasks than threads
   (the surplus: claimed, not started, as far as the scheduler can tell).  It levels
   the expected work per thread (each claim counts for its prefix's duration estimate,
   ``UNKNOWN_DURATION`` without one, as Dask's ``unknown-task-duration``, and at least
   ``MIN_COST``), as distributed's ``balance`` does: from the most loaded victim first,
   each of its claims that it would start last (the largest scores: lowest priority,
   submitted last) goes to the least loaded thief while that leaves the thief less
   loaded than the victim (``occ_thief + cost <= occ_victim - cost / 2``, per thread),
   never more than the victim's surplus, never one it runs.  Requests in flight count
   on their thief already.  Only tasks the thief may run (``workers=``, ``resources=``:
   ``Placement.targets``) and whose data is worth moving (its dependencies' bytes not
   on the thief, at ``BANDWIDTH``, take at most ``COST_RATIO`` times the task's
   estimate) are asked for.
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

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from redisdask.protocol import StealRequest, Stimulus, StolenKeys
from redisdask.scheduler.instructions import Enqueue, LogEvent, SetState, Unclaim, WorkerMsg
from redisdask.scheduler.tasks import other_run

if TYPE_CHECKING:
    from redisdask.scheduler.tasks import TaskState, WorkerInfo
    from redisdask.scheduler.transitions import SchedulerTransitions

STEAL_TIMEOUT = 2.0  # seconds a steal request may go unanswered before it is asked again
BANDWIDTH = 100e6  # bytes/s assumed between workers (Dask's ``scheduler.bandwidth``)
UNKNOWN_DURATION = 0.5  # seconds, a task without an estimate (Dask's default)
COST_RATIO = 1.0  # moving a task's data may take at most this times its run's estimate
LOGGED_KEYS = 20  # keys named in one ``stolen`` event at most
MIN_COST = 0.001  # seconds a task counts for in the balance, whatever its estimate


@dataclass(slots=True)
class StealTick(Stimulus):
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
    estimate: Callable[[TaskState], float] = lambda ts: UNKNOWN_DURATION,
) -> list[tuple[str, str, list[TaskState]]]:
    """The steal requests to make now: ``(victim, thief, tasks)`` each (see the module
    docstring).  ``may_run(ts, thief)``: the thief may run ``ts`` and its data is worth
    moving; ``has_queued_for(thief)``: a queued task waits that the thief may claim
    itself (then it steals nothing); ``estimate(ts)``: the seconds ``ts`` is expected
    to run (its prefix's average)."""
    asked_from: dict[str, int] = {}
    load: dict[str, float] = {}  # expected seconds of claimed work per thread, as planned
    for ts, asked in in_flight.items():
        asked_from[asked.victim] = asked_from.get(asked.victim, 0) + 1
        if not asked.refused:  # (on its way to the thief: counted there)
            d = _cost(ts, estimate)
            load[asked.victim] = load.get(asked.victim, 0.0) - d / _threads(workers, asked.victim)
            load[asked.thief] = load.get(asked.thief, 0.0) + d / _threads(workers, asked.thief)
    surplus: dict[str, int] = {}  # claims the victim holds beyond its threads, not asked
    thieves: list[str] = []
    for address, ws in workers.items():
        n = nthreads(ws)
        extra = len(ws.processing) - n - asked_from.get(address, 0)
        if extra > 0:
            surplus[address] = extra
        elif len(ws.processing) < n and not (ws.retiring or ws.retire_heard or ws.told_to_close):
            thieves.append(address)
    if not surplus or not thieves:
        return []  # (before the loads: every claim of a busy cluster would be summed)
    for address, ws in workers.items():
        total = sum(_cost(ts, estimate) for ts in ws.processing)
        load[address] = load.get(address, 0.0) + total / nthreads(ws)
    thieves = [t for t in thieves if not has_queued_for(t)]
    plans: dict[tuple[str, str], list[TaskState]] = {}
    for victim in sorted(surplus, key=lambda a: (-load[a], a)):
        for ts, thief in _moves(workers[victim], surplus[victim], thieves, load, in_flight,
                                may_run, estimate, workers):  # fmt: skip
            plans.setdefault((victim, thief), []).append(ts)
    return [(victim, thief, tasks) for (victim, thief), tasks in plans.items()]


def _moves(
    victim: WorkerInfo,
    surplus: int,
    thieves: list[str],
    load: dict[str, float],
    in_flight: Mapping[TaskState, Asked],
    may_run: Callable[[TaskState, str], bool],
    estimate: Callable[[TaskState], float],
    workers: Mapping[str, WorkerInfo],
) -> Iterator[tuple[TaskState, str]]:
    """Of the victim's claims, those it would start last first, each to the least
    loaded thief that may run it, while that leaves the thief less loaded than the
    victim (distributed's ``balance``: ``occ_thief + cost <= occ_victim - cost / 2``, per
    thread); at most ``surplus`` of them.  Updates ``load`` as it goes."""
    v, vn = victim.address, nthreads(victim)
    last = sorted(victim.processing, key=lambda t: -t.score)[: len(victim.processing) - vn]
    for ts in last:  # (the others it runs, or starts first, as far as we can tell)
        if surplus <= 0:
            return
        if ts in in_flight:
            continue
        d = _cost(ts, estimate)
        for thief in sorted(thieves, key=lambda a: (load[a], a)):
            tn = _threads(workers, thief)
            if load[thief] + d / tn <= load[v] - d / (2 * vn) and may_run(ts, thief):
                load[thief] += d / tn
                load[v] -= d / vn
                surplus -= 1
                yield ts, thief
                break


def _cost(ts: TaskState, estimate: Callable[[TaskState], float]) -> float:
    """What moving ``ts`` moves: its estimate, at least ``MIN_COST`` (a task's claim and
    report cost that much whatever it runs, and an estimate of 0 would move everything)."""
    return max(estimate(ts), MIN_COST)


def _threads(workers: Mapping[str, WorkerInfo], address: str) -> int:
    ws = workers.get(address)
    return nthreads(ws) if ws is not None else 1


def transfer_seconds(ts: TaskState, thief: str) -> float:
    """How long the thief would fetch the task's dependencies (those it lacks; results
    kept in Redis come with the claim), at ``BANDWIDTH``."""
    missing = sum(
        max(dep.nbytes, 0) for dep in ts.dependencies if not dep.inline and thief not in dep.who_has
    )
    return missing / BANDWIDTH


class WorkStealing:
    """The state machine's work stealing (see the module docstring)."""

    def __init__(self, machine: SchedulerTransitions) -> None:
        self.machine = machine
        self.steals: dict[TaskState, Asked] = {}  # steal requests in flight, per task

    def handle_steal_tick(self, ev: StealTick) -> None:
        for ts, asked in list(self.steals.items()):
            timed_out = not asked.refused and ev.now - asked.at > STEAL_TIMEOUT
            if timed_out or ts.processing_on != asked.victim:
                del self.steals[ts]
        m = self.machine
        plans = plan_steals(
            m.workers, self.steals, self.may_steal, self._queued_for(), self.estimate
        )
        for victim, thief, tasks in plans:
            for ts in tasks:
                self.steals[ts] = Asked(victim, thief, ev.now)
            request = StealRequest([ts.key for ts in tasks], thief)
            m.emit(WorkerMsg(ev.stimulus_id, victim, request))

    def estimate(self, ts: TaskState) -> float:
        return self.machine.durations.averages.get(ts.prefix, UNKNOWN_DURATION)

    def may_steal(self, ts: TaskState, thief: str) -> bool:
        """The thief may run ``ts`` (its restriction, its resources) and moving its data
        there costs less than ``COST_RATIO`` times its run."""
        targets = self.machine.targets(ts)
        if targets is None or (targets and thief not in targets):
            return False
        if ts.waiting_on or any(d.state == "processing" and ts in d.waiting_on
                                for d in ts.dependents):  # fmt: skip
            return False  # a chain claimed together runs together (scheduler/chain.py)
        return transfer_seconds(ts, thief) <= COST_RATIO * self.estimate(ts)

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
        for ts in self.machine.tasks.values():
            if ts.state == "queued":
                if not (ts.restrict or ts.resources or ts.sticky):
                    return lambda thief: True
                restricted.update(ts.queued_on)
        return restricted.__contains__

    def handle_stolen_keys(self, ev: StolenKeys) -> None:
        """The victim gave these claims up (they will not run there): queue each for the
        thief.  A key no longer processing there (the victim died and its tasks were
        queued again, or another run of the key) is left as it is."""
        m = self.machine
        victim = m.workers.get(ev.worker)
        for key in ev.refused:  # (started: not to be asked for again while it runs there)
            ts = m.tasks.get(key)
            asked = self.steals.get(ts) if ts is not None else None
            if asked is not None:
                asked.refused = True
        scores = list(ev.scores) + [float("nan")] * (len(ev.keys) - len(ev.scores))
        moved = []
        for key, score in zip(ev.keys, scores, strict=False):
            ts = m.tasks.get(key)
            if ts is None:
                continue
            self.steals.pop(ts, None)
            if victim is None or ts not in victim.processing or other_run(score, ts):
                continue
            victim.processing.discard(ts)
            m.emit(Unclaim(ev.stimulus_id, victim.address, key))
            if ts.state == "processing":
                ts.processing_on = None
                self._queue_for(ts, ev.thief, stimulus_id=ev.stimulus_id)
                moved.append(key)
        if moved:
            fields = {"victim": ev.worker, "thief": ev.thief, "n": len(moved),
                      "keys": moved[:LOGGED_KEYS]}  # fmt: skip
            m.emit(LogEvent(ev.stimulus_id, "stolen", fields))

    def _queue_for(self, ts: TaskState, thief: str, *, stimulus_id: str) -> None:
        """Queue a stolen task (processing on nobody now) first for ``thief``, as a task
        placed by data: others take it if the thief is busy, paused or gone.  A
        restricted or resourced one, or one whose thief left or retires: as any other."""
        m = self.machine
        ws = m.workers.get(thief)
        unfit = ws is None or ws.retiring or ws.retire_heard or ws.told_to_close
        if ts.restrict or ts.resources or unfit:
            m.transition(ts, "queued", stimulus_id=stimulus_id)
            return
        m.set_state(ts, "queued", stimulus_id=stimulus_id)
        ts.queued_on = (thief,)
        m.emit(SetState(stimulus_id, ts.key, "queued"))
        on = ts.queued_on
        m.emit(Enqueue(stimulus_id, ts.key, ts.score, on, on, placed=True, preferred=True))
