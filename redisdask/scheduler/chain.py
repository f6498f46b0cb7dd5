"""Chains: a dependent that waits on one task alone runs on the worker that finishes that
task, claimed in the same atomic step that reports the result (docs/design.md, "Chains").

Without this, each link of a chain ``x = submit(inc, x)`` pays the scheduler's hop (read
the result, queue the dependent, signal) and the claim's (wake, run ``CLAIM``) before it
runs.  Here the scheduler marks, ahead of time, which dependents could follow a task:
when a waiting task ``y`` waits on one task ``x`` alone and may run anywhere (no
``workers=``, no ``resources=``), ``y`` joins ``x``'s ``chain`` (at most ``CHAIN_MAX``
dependents, written to ``x``'s record, ``MarkChain``).  The worker that finishes ``x``
sends its report through the ``FINISH`` script (``store/scripts.py``), which claims for it any
dependent in ``x``'s chain that Redis still says is ``waiting`` and whose other
dependencies it can have (in memory inline, or held by it), exactly as ``CLAIM`` claims
(processing, the processing set, ``claim``), and writes the claim and the results in one
entry of the workers stream, the claim first.

The scheduler remains the authority: ``SchedulerState`` reads the chained claim before
the results it follows and accepts it (``waiting -> processing``) only if every
dependency the task waits on is processing on the claiming worker (whose results the
same entry reports next) and the task may still run there; otherwise it takes the claim
back (the worker drops the task) and writes the task's own state over what the script
wrote.  A chained claim is recorded and announced in one atomic step like any claim, so
a scheduler killed at any point reloads it from Redis (``processing`` there) and reads
its entry again: nothing runs twice, nothing is lost.

A mixin of ``SchedulerState`` (pure: events in, instructions out), kept apart so that the
state machine's own module stays readable; it declares the attributes it uses.
"""

from __future__ import annotations

from typing import Any

from redisdask.scheduler.instructions import ClaimAccepted, MarkChain, SetState, Unclaim
from redisdask.scheduler.tasks import TaskState, WorkerInfo, other_run, worker_stream_position

# dependents named in one task's chain at most (a fan-out needs no more: the first ones
# follow on its worker, the others are queued as usual when the scheduler reads the result)
CHAIN_MAX = 4


class Chains:
    """``SchedulerState``'s marking and acceptance of chained claims (see the module
    docstring); the attributes below are the machine's."""

    tasks: dict[str, TaskState]
    workers: dict[str, WorkerInfo]

    def _mark_chain(self, ts: TaskState, *, stimulus_id: str) -> None:
        """``ts`` now waits: if on one task alone, and it may run anywhere, name it in
        that task's chain, so the worker that finishes it may claim ``ts`` at once."""
        if len(ts.waiting_on) != 1 or ts.restrict or ts.resources:
            return
        (dep,) = ts.waiting_on
        if ts.key in dep.chain:
            return
        # (the dependents that no longer wait make room: a task run again, a fan-out)
        live = [k for k in dep.chain if getattr(self.tasks.get(k), "state", "") == "waiting"]
        if len(live) >= CHAIN_MAX:
            return
        dep.chain = (*live, ts.key)
        self._emit(MarkChain(stimulus_id, dep.key, list(dep.chain)))  # type: ignore[attr-defined]

    def _may_chain(self, ts: TaskState, ws: WorkerInfo) -> bool:
        """Whether ``ws`` may take waiting ``ts`` on the results it is about to report:
        every dependency ``ts`` waits on is processing there."""
        return (
            ts.state == "waiting"
            and not (ts.restrict or ts.resources or ws.retiring or ws.retire_heard)
            and bool(ts.waiting_on)
            and all(
                d.state == "processing" and d.processing_on == ws.address for d in ts.waiting_on
            )
        )

    def _chained_claim(self, key: str, score: Any, worker: str, *, stimulus_id: str) -> None:
        """One key of a chained claim (``TaskClaimed.chained``) by ``worker``: accepted,
        already known (state reloaded after it), or taken back, with the task's own state
        written over the script's ``processing``."""
        ts = self.tasks.get(key)
        ws = self.workers.get(worker)
        if ts is not None and ws is not None and not other_run(score, ts):
            if ts.state == "processing" and ts.processing_on == worker:
                ts.claimed_before = ws.holding_reports  # reloaded after the claim
                return
            if self._may_chain(ts, ws):
                self._transition(ts, "processing", worker=ws, stimulus_id=stimulus_id)  # type: ignore[attr-defined]
                return
        self._emit(Unclaim(stimulus_id, worker, key))  # type: ignore[attr-defined]
        if ts is None:
            return  # forgotten: the scheduler's DEL of its record wins
        if not other_run(score, ts):
            self._free(worker, key, stimulus_id=stimulus_id)  # type: ignore[attr-defined]
        else:  # (only that run's copy: the worker may have the current one by then)
            self._free(worker, key, stimulus_id=stimulus_id, run=float(score))  # type: ignore[attr-defined]
        if ts.state == "processing":
            fields = {"worker": ts.processing_on or ""}
            self._emit(SetState(stimulus_id, key, "processing", fields))  # type: ignore[attr-defined]
            return
        self._emit(SetState(stimulus_id, key, ts.state))  # type: ignore[attr-defined]
        if ts.state == "queued":  # back into its ready sets (the claim took it out of none)
            self._enqueue(ts, stimulus_id=stimulus_id)  # type: ignore[attr-defined]

    def _unchain(self, ts: TaskState, *, stimulus_id: str) -> None:
        """``ts`` left ``processing`` for another state than ``memory``: its result will not
        come from where it was claimed.  The dependents chained on it (claimed by
        ``FINISH`` on its worker, waiting there for it) are taken back to ``waiting``, and
        err with it if it erred; theirs follow them (this runs for each move)."""
        for d in sorted(ts.dependents, key=lambda t: t.score):
            if d.state != "processing" or ts not in d.waiting_on:
                continue
            if d.processing_on not in self.workers:  # removed: nobody to tell
                d.processing_on = None
            self._transition(d, "waiting", stimulus_id=stimulus_id)  # type: ignore[attr-defined]
            if ts.state == "erred" and d.state == "waiting":
                self._inherit_error(d, ts)  # type: ignore[attr-defined]
                self._transition(d, "erred", stimulus_id=stimulus_id)  # type: ignore[attr-defined]

    def _transition_waiting_processing(
        self, ts: TaskState, worker: WorkerInfo, *, stimulus_id: str
    ) -> None:
        """A chained claim: ``ts`` runs on ``worker`` after the results it waits on, which
        the same entry reports next (``waiting_on`` empties as they are read)."""
        self._set_state(ts, "processing", stimulus_id=stimulus_id)  # type: ignore[attr-defined]
        ts.claimed_before, ts.unlisted = worker.holding_reports, 0
        ts.claimed_at = worker_stream_position(stimulus_id)
        ts.processing_on = worker.address
        worker.processing.add(ts)  # (the FINISH script wrote it)
        self._emit(ClaimAccepted(stimulus_id, ts.key, worker.address))  # type: ignore[attr-defined]
