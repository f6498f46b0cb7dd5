"""Placement by data: which worker a ready task is queued first for (Dask's
``decide_worker``, ``_decide_worker_non_rootish``), as a pure function of the scheduler's
state.

A task that runs anywhere (no ``workers=``, no ``resources=``) and whose dependencies sit
on workers goes first to the worker that holds the most bytes of them, so that the
fewest bytes move; ties go to the least occupied worker (claimed tasks per thread), then
to the smallest address (the same answer on every reload).  Dependencies whose results
live in Redis too (``TaskState.inline``, at most ``worker.inline-result-bytes``) count for
nothing: every worker gets them in its claim's reply, from no peer.  A task with no such
dependency (a root task, or one fed only small results) has no preferred worker: it goes
to the shared ready set, where free threads pull it, which spreads root tasks over the
workers as Dask's root-ish queueing does.  One exception: a task recomputed because a
worker could not fetch its result (``missing-data``, ``TaskState.missed_by``) goes first
to that worker, which needs it: else, with the holder alive behind a network cut, the
holder may claim the recompute again and the fetch fail again, round after round (Dask
places it by its dependencies alone).

The preference is a first refusal, not a restriction: the task waits in the preferred
worker's own ready set and in the cluster's ``placed`` set, and the ``CLAIM`` script lets
any other worker with room take it when the preferred one is busy (as many claimed tasks
as threads), paused or gone (docs/design.md, "Claim").  Retiring workers get nothing new.

Busy is no reason to move a task whose data costs more to move than waiting costs
(``sticky``): a shuffle's split (a ``getitem`` of a millisecond on a group of
megabytes), a merge of two partitions whose holder runs one task, a cheap step after a
load.  Such a task waits for its preferred worker while that one is busy, as it does in
Dask, whose ``decide_worker`` places a task on a holder of its dependencies only and
whose work stealing moves it elsewhere only if, for an idle thief, ``thief's transfer +
run <= holder's backlog - (holder's transfer + run) / 2`` (``stealing.py``'s
``balance``): a task moves at once from a busy holder only where that holds.  Here the
thief is any idle worker (most hold none of its data: it fetches every byte), the
holder's backlog is the estimates of its claims per thread plus the task's own, and
transfers go at ``BANDWIDTH``.  A task of unknown duration is sticky if it has data to
move: the first tasks of a prefix are queued before any of them finished (a wave of
loads' dependents).  A sticky task still waits ``PLACED_PATIENCE_MS`` at most once a
worker passed it over, and goes at once where its worker is paused, retiring or gone.
Without this rule an idle one-thread worker took every placed task from a holder
running anything and fetched all its data: ``bench/balance.py``'s dataframe at 8
workers moved 3.7 times the bytes Dask moves.
"""

from __future__ import annotations

from collections.abc import Mapping

from redisdask.scheduler_tasks import TaskState, WorkerInfo
from redisdask.stealing import BANDWIDTH, UNKNOWN_DURATION


def decide_worker(ts: TaskState, workers: Mapping[str, WorkerInfo]) -> str | None:
    """The address of the worker ``ts`` is queued first for, or None (the shared set)."""
    if ts.restrict or ts.resources:
        return None  # ``Placement`` decides where those may run
    missed = workers.get(ts.missed_by) if ts.missed_by is not None else None
    if missed is not None and not (missed.retiring or missed.retire_heard):
        return missed.address
    held: dict[str, int] = {}
    for dep in ts.dependencies:
        if dep.inline:
            continue
        for address in dep.who_has:
            held[address] = held.get(address, 0) + max(dep.nbytes, 1)
    best: tuple[int, float, str] | None = None
    for address, nbytes in held.items():
        ws = workers.get(address)
        if ws is None or ws.retiring or ws.retire_heard:
            continue
        rank = (-nbytes, occupancy(ws), address)
        if best is None or rank < best:
            best = rank
    return None if best is None else best[2]


def sticky(ts: TaskState, holder: WorkerInfo, estimates: Mapping[str, float]) -> bool:
    """Whether ``ts``, placed on ``holder``, waits for it while it is busy (see the
    module docstring): unless Dask's stealing would move it from ``holder`` to an idle
    worker holding none of its data.  ``estimates``: duration averages per prefix."""
    total = held = 0
    for dep in ts.dependencies:
        if not dep.inline:
            total += max(dep.nbytes, 0)
            held += max(dep.nbytes, 0) if holder.address in dep.who_has else 0
    run = estimates.get(ts.prefix)
    if run is None:
        return total > 0
    # thief's transfer + run <= backlog - (holder's transfer + run) / 2, backlog >= run
    needed = total / BANDWIDTH + 1.5 * run + (total - held) / BANDWIDTH / 2 - run
    return not _backlog_reaches(holder, estimates, needed)


def _backlog_reaches(ws: WorkerInfo, estimates: Mapping[str, float], seconds: float) -> bool:
    """Whether the estimates of ``ws``'s claims, per thread, add up to ``seconds`` (a
    claim of unknown duration counts as ``UNKNOWN_DURATION``; the sum stops there)."""
    if seconds <= 0:
        return True
    nthreads = ws.info.get("nthreads")
    budget = seconds * (nthreads if isinstance(nthreads, int) and nthreads > 0 else 1)
    for claimed in ws.processing:
        budget -= estimates.get(claimed.prefix, UNKNOWN_DURATION)
        if budget <= 0:
            return True
    return False


def occupancy(ws: WorkerInfo) -> float:
    """Claimed tasks per thread: how busy a worker is, as far as the scheduler knows."""
    nthreads = ws.info.get("nthreads")
    return len(ws.processing) / (nthreads if isinstance(nthreads, int) and nthreads > 0 else 1)
