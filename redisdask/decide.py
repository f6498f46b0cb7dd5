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

Busy is no reason to move a task whose data costs more to move than the task costs to
run (``sticky``): a shuffle's split (a ``getitem`` of a millisecond on a group of
megabytes), or a cheap step after a load.  Such a task waits for its preferred worker
while that one is busy, as it does in Dask (``decide_worker`` places a task on a holder of
its dependencies only, and stealing leaves a task whose transfer outweighs its run):
a worker holding none of its data would fetch bytes that take longer, at
``BANDWIDTH``, than ``COST_RATIO`` times the task's duration estimate (work stealing's
rule, ``stealing.transfer_seconds``).  A task of unknown duration is sticky too: the first
tasks of a prefix are queued before any of them finished (a wave of loads' dependents),
and a busy holder is not the saturated one Dask's stealing moves work from.  A sticky
task still waits ``PLACED_PATIENCE_MS`` at most once a worker passed it over, and goes at
once where its worker is paused, retiring or gone.  Without this rule an idle one-thread
worker took every such task from a holder running anything and fetched its whole
dependency: ``bench/balance.py``'s dataframe at 8 workers moved 3.7 times the bytes Dask
moves.
"""

from __future__ import annotations

from collections.abc import Mapping

from redisdask.scheduler_tasks import TaskState, WorkerInfo
from redisdask.stealing import BANDWIDTH, COST_RATIO


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


def sticky(ts: TaskState, estimate: float | None) -> bool:
    """Whether ``ts``, placed by data, waits for its worker while that one is busy: a
    worker holding none of its dependencies would take longer to fetch them than
    ``COST_RATIO`` times its run (``estimate``, seconds; None, unknown: any bytes).  (Any
    idle worker may claim it, and most hold none of it.)"""
    missing = sum(max(dep.nbytes, 0) for dep in ts.dependencies if not dep.inline)
    return missing / BANDWIDTH > COST_RATIO * (estimate or 0.0)


def occupancy(ws: WorkerInfo) -> float:
    """Claimed tasks per thread: how busy a worker is, as far as the scheduler knows."""
    nthreads = ws.info.get("nthreads")
    return len(ws.processing) / (nthreads if isinstance(nthreads, int) and nthreads > 0 else 1)
