"""Push: which worker, if any, a root task goes to straight from its submission.

A worker learns of queued work from the ``ready-signal`` and then claims it (``CLAIM``):
one Redis round trip more than a scheduler that assigns, and every idle worker wakes and
claims for each task.  So a task submitted while a worker has a free thread goes straight
to that worker, in the scheduler's batch that reads the submission: ``processing`` there
in Redis, and a ``compute-task`` with its spec in the worker's inbox, which it already
blocks on (Dask's scheduler assigns every task this way; Ray's driver hands tasks to the
workers it leased).  Everything else is queued, for the claims to take, as before:

* only a **root task** (no dependencies: its placement is by nothing but free threads;
  a task with dependencies is placed by data, ``redisdask.scheduler.decide``), that runs anywhere
  (no ``workers=``, no ``resources=``), read from a **submission** (``update-graph``): a
  task queued again (its worker died, gave it back, was stolen from) goes to the ready set;
* to a worker with **fewer claimed tasks than threads**, as far as the scheduler knows
  (the least occupied, then the smallest address), that is not retiring and has not
  given a pushed task back since it last claimed (``WorkerInfo.no_push``: a paused
  worker gives back what it is handed, and the scheduler does not know it is paused).

The worker treats a pushed task as a claimed one (its holding reports list it, stealing
may take it back, its death queues it again).  A claim in flight that the scheduler has
not read yet may make a worker look free when it is not: the pushed task then waits
there behind the claim, as a claimed one would, until stealing moves it.
"""

from __future__ import annotations

from collections.abc import Mapping

from redisdask.scheduler.tasks import TaskState, WorkerInfo


def pushable(ts: TaskState) -> bool:
    """Whether ``ts`` may go straight to a free thread (see the module's docstring)."""
    return ts.has_spec and not (ts.dependencies or ts.restrict or ts.resources)


def push_target(workers: Mapping[str, WorkerInfo]) -> WorkerInfo | None:
    """The worker with a free thread a root task goes to, or None (queue it)."""
    best: tuple[float, str] | None = None
    chosen = None
    for ws in workers.values():
        if ws.retiring or ws.retire_heard or ws.no_push or ws.told_to_close:
            continue
        nthreads = ws.info.get("nthreads")
        started = ws.info.get("started")
        if not isinstance(nthreads, int) or nthreads < 1 or not isinstance(started, int | float):
            continue  # (an incomplete record: no process to name)
        if len(ws.processing) >= nthreads:
            continue
        rank = (len(ws.processing) / nthreads, ws.address)
        if best is None or rank < best:
            best, chosen = rank, ws
    return chosen
