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
"""

from __future__ import annotations

from collections.abc import Mapping

from redisdask.scheduler_tasks import TaskState, WorkerInfo


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


def occupancy(ws: WorkerInfo) -> float:
    """Claimed tasks per thread: how busy a worker is, as far as the scheduler knows."""
    nthreads = ws.info.get("nthreads")
    return len(ws.processing) / (nthreads if isinstance(nthreads, int) and nthreads > 0 else 1)
