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

``Chains`` is a part of ``SchedulerState`` (``state.chains``, pure: events in,
instructions out) with no state of its own: the chains are the tasks' (``TaskState.chain``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from redisdask.scheduler.instructions import MarkChain, SetState, Unclaim
from redisdask.scheduler.tasks import TaskState, WorkerInfo, other_run

if TYPE_CHECKING:
    from redisdask.scheduler.transitions import SchedulerTransitions

# dependents named in one task's chain at most (a fan-out needs no more: the first ones
# follow on its worker, the others are queued as usual when the scheduler reads the result)
CHAIN_MAX = 4


class Chains:
    """The state machine's marking and acceptance of chained claims (see the module
    docstring)."""

    def __init__(self, machine: SchedulerTransitions) -> None:
        self.machine = machine

    def mark(self, ts: TaskState, *, stimulus_id: str) -> None:
        """``ts`` now waits: if on one task alone, and it may run anywhere, name it in
        that task's chain, so the worker that finishes it may claim ``ts`` at once."""
        if len(ts.waiting_on) != 1 or ts.restrict or ts.resources:
            return
        m = self.machine
        (dep,) = ts.waiting_on
        if ts.key in dep.chain:
            return
        # (the dependents that no longer wait make room: a task run again, a fan-out)
        live = [k for k in dep.chain if getattr(m.tasks.get(k), "state", "") == "waiting"]
        if len(live) >= CHAIN_MAX:
            return
        dep.chain = (*live, ts.key)
        m.emit(MarkChain(stimulus_id, dep.key, list(dep.chain)))

    def may_chain(self, ts: TaskState, ws: WorkerInfo) -> bool:
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

    def claimed(self, key: str, score: Any, worker: str, *, stimulus_id: str) -> None:
        """One key of a chained claim (``TaskClaimed.chained``) by ``worker``: accepted,
        already known (state reloaded after it), or taken back, with the task's own state
        written over the script's ``processing``."""
        m = self.machine
        ts = m.tasks.get(key)
        ws = m.workers.get(worker)
        if ts is not None and ws is not None and not other_run(score, ts):
            if ts.state == "processing" and ts.processing_on == worker:
                ts.claimed_before = ws.holding_reports  # reloaded after the claim
                return
            if self.may_chain(ts, ws):
                m.transition(ts, "processing", worker=ws, stimulus_id=stimulus_id)
                return
        m.emit(Unclaim(stimulus_id, worker, key))
        if ts is None:
            return  # forgotten: the scheduler's DEL of its record wins
        if not other_run(score, ts):
            m.free(worker, key, stimulus_id=stimulus_id)
        else:  # (only that run's copy: the worker may have the current one by then)
            m.free(worker, key, stimulus_id=stimulus_id, run=float(score))
        if ts.state == "processing":
            fields = {"worker": ts.processing_on or ""}
            m.emit(SetState(stimulus_id, key, "processing", fields))
            return
        m.emit(SetState(stimulus_id, key, ts.state))
        if ts.state == "queued":  # back into its ready sets (the claim took it out of none)
            m.enqueue(ts, stimulus_id=stimulus_id)

    def unchain(self, ts: TaskState, *, stimulus_id: str) -> None:
        """``ts`` left ``processing`` for another state than ``memory``: its result will not
        come from where it was claimed.  The dependents chained on it (claimed by
        ``FINISH`` on its worker, waiting there for it) are taken back to ``waiting``, and
        err with it if it erred; theirs follow them (this runs for each move)."""
        m = self.machine
        for d in sorted(ts.dependents, key=lambda t: t.score):
            if d.state != "processing" or ts not in d.waiting_on:
                continue
            if d.processing_on not in m.workers:  # removed: nobody to tell
                d.processing_on = None
            m.transition(d, "waiting", stimulus_id=stimulus_id)
            if ts.state == "erred" and d.state == "waiting":
                m.inherit_error(d, ts)
                m.transition(d, "erred", stimulus_id=stimulus_id)
