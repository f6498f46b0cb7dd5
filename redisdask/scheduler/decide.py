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
megabytes), a merge of two partitions, a cheap step after a load.  Such a task waits
for its preferred worker while that one is busy, as it does in Dask: its
``decide_worker`` considers only the holders of a task's dependencies, and its work
stealing counts a move as the bytes at ``BANDWIDTH`` plus ``LATENCY`` (100 ms,
``distributed.stealing.LATENCY``), moving a task whose run is shorter than that only
from a holder whose backlog is several times its cost.  Here a task is sticky when its
run (the prefix's duration estimate) is shorter than its move to a worker holding none
of its data (any idle worker may claim it, and most hold none); a task of unknown
duration with data to move is sticky too (the first tasks of a prefix are queued before
any of them finished).  A sticky task still waits ``PLACED_PATIENCE_MS`` at most once a
worker passed it over, and goes at once where its worker is paused, retiring or gone;
tasks that run longer than their move go at once to an idle worker.  Without this rule
an idle one-thread worker took every placed task from a holder running anything and
fetched all its data: ``bench/balance.py``'s dataframe at 8 workers moved 3.7 times the
bytes Dask moves.  (Weighing the holder's backlog as Dask's stealing does, at the moment
a task is queued, moved splits again: a backlog of tasks of unknown duration counts 0.5 s
each, and a claim decides at once where Dask's stealing looks every 100 ms at tasks
already assigned.)
"""

from __future__ import annotations

from collections.abc import Mapping

from redisdask.scheduler.stealing import BANDWIDTH
from redisdask.scheduler.tasks import TaskState, WorkerInfo

LATENCY = 0.1  # seconds a move costs besides its bytes (``distributed.stealing.LATENCY``)


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
    """Whether ``ts``, placed by data, waits for its worker while that one is busy: its
    run (``estimate``, seconds; None: unknown) is shorter than moving its data to a
    worker holding none of it (see the module docstring)."""
    total = sum(max(dep.nbytes, 0) for dep in ts.dependencies if not dep.inline)
    if total == 0:
        return False
    return estimate is None or total / BANDWIDTH + LATENCY > estimate


def occupancy(ws: WorkerInfo) -> float:
    """Claimed tasks per thread: how busy a worker is, as far as the scheduler knows."""
    nthreads = ws.info.get("nthreads")
    return len(ws.processing) / (nthreads if isinstance(nthreads, int) and nthreads > 0 else 1)
