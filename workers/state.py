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

What each event does is here (a handler per event type, ``_HANDLERS``), with the
policies that choose what to run and fetch next; the task states, the moves between
them and the model they change are in ``workers/transitions.py`` (``WorkerTransitions``,
which ``WorkerState`` extends).  The events and instructions are ``workers/events.py``'s.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from redisdask.durations import claim_delay, misleads, remaining, start_times, stuck_in
from redisdask.placement import fits
from redisdask.protocol import (
    AddKeys,
    MissingData,
    ReleasedKeys,
    StolenKeys,
)
from redisdask.spec import key_prefix
from redisdask.state_machine import InvalidTransition
from redisdask.store.keyspace import REDIS_COPY
from redisdask.workers.events import (
    AcquireReplicasEvent,
    ClaimsHandledEvent,
    ComputeTaskEvent,
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
from redisdask.workers.transitions import (
    RUNNING,
    StoryEntry,
    TaskState,
    WorkerTransitions,
    host_of,
    run_score,
)


def _claimed_after(ts: TaskState, ev: FreeKeysEvent) -> bool:
    """Whether ``ts`` was claimed here after what the scheduler had read when it sent
    ``ev``: a claim made before the worker read a free-keys about the copy it held (a
    claim answered from that copy, or run anew) must not lose its answer to it."""
    return ts.claim is not None and ev.seen is not None and ts.claim > ev.seen


def _movable(ts: TaskState) -> bool:
    """A claim held here (waiting or ready) that may run elsewhere instead: still
    wanted, no claimed task here depends on it, no claim deferred behind it."""
    return ts.wanted and not ts.dependents and ts.deferred is None


def _elapsed(ts: TaskState, now: float | None) -> float:
    """How long ``ts`` has run, by the driver's clock (0 when either time is unknown)."""
    return 0.0 if now is None or ts.began is None else max(now - ts.began, 0.0)


class WorkerState(WorkerTransitions):
    """All the task state of one worker, advanced only by ``handle_stimulus``."""

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

    def story_since(self, total: int) -> list[StoryEntry]:
        """The entries appended after the first ``total`` (as many as are still kept)."""
        new = min(self.story_total - total, len(self.story))
        return list(itertools.islice(reversed(self.story), new))[::-1]  # O(new), not O(len)

    # -- event handlers --------------------------------------------------------------

    def _handle_compute(self, ev: ComputeTaskEvent) -> None:
        sid = ev.stimulus_id
        known = self.tasks.get(ev.key)
        run = float(ev.priority[0]) if ev.priority else None
        if known is not None and run != known.run:
            if self._drop_other_run(known, ev):
                return  # deferred until its thread returns
            known = self.tasks.get(ev.key)
        leaving = (self.retiring or self.paused) and (
            known is None or known.state in ("fetch", "missing")
        )
        new = known is None or known.state in ("released", "fetch", "missing", "error")
        stale = (new and self._stale(ev)) or (
            known is not None and known.state == "memory" and known.value_run not in (None, run)
        )
        if leaving or not self._may_hold(known, ev.resources) or stale:
            # a claim that crossed the retirement or a pause, or one whose transfer here
            # failed, or (never: claims count what is free) one that does not fit what is
            # free, or one that needs another value of a key than the one here (a task
            # here still uses the old one): hand it back (what runs, is fetched or is held
            # here is answered as usual)
            score = [float(ev.priority[0])] if ev.priority else []
            self._emit(ReleasedKeys(self.address, [ev.key], score, stimulus_id=sid))
            if known is not None:
                known.wanted = False
                self._release_if_unneeded(known, sid)
            return
        ts = self._ensure_task(ev.key)
        ts.wanted = True
        ts.run_spec, ts.priority, ts.estimate = ev.run_spec, ev.priority, ev.estimate
        ts.run = run
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
        if known.state in ("waiting", "ready", *RUNNING):
            known.wanted = False  # dropped (a running one once its thread returns)
            self._release_if_unneeded(known, sid)
        if known.state == "cancelled" and known.previous in RUNNING:
            known.deferred = ev
            return True
        if known.state == "memory" and not known.dependents:
            self._transition(known, "released", stimulus_id=sid)  # computed anew
        return False

    def _stale(self, ev: ComputeTaskEvent) -> bool:
        """Whether a dependency of the claimed task is here as a copy of another
        submission of its key than the one the claim names (``ComputeTaskEvent.runs``):
        the key was released, forgotten and submitted again, as another computation
        perhaps, while this worker fetched or kept the old value (the scheduler does not
        know of a fetched copy, so no ``free-keys`` reaches it).  Such a copy that nothing
        here needs goes, and the new value is fetched; one that a task here still uses,
        or one on its way, cannot make room for it: the claim goes back."""
        stale = False
        for dep_key in ev.dependencies:
            run = ev.runs.get(dep_key)
            dep = self.tasks.get(dep_key)
            if dep is None or run is None or dep.value_run in (None, run):
                continue
            self._drop_kept_copy(dep, ev.stimulus_id)
            stale = stale or dep_key in self.tasks  # (a copy dropped is forgotten)
        return stale

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
                dep.value_run = ev.runs.get(dep_key)
            elif dep.value_run is None:  # (put here: the first claim says which scatter)
                dep.value_run = ev.runs.get(dep_key)
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
        ts.value_run = ts.run
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
        score = run_score(ts)
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
        if ts.state in RUNNING or (ts.state == "cancelled" and ts.previous in RUNNING):
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
            if ts is not None and ev.run is not None and run_score(ts) != ev.run:
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
            ts.value_run = None  # (put here: which submission, the scheduler alone knows)
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
            kept = self.tasks.get(key)
            if kept is not None and kept.lingers and not kept.dependents:
                self._drop_kept_copy(kept, ev.stimulus_id)  # (no claim vouched for it)
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
            scores.append(run_score(ts))
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
            scores.append(run_score(ts))
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
                self._drop_kept_copy(ts, ev.stimulus_id)

    def _drop_kept_copy(self, ts: TaskState, sid: str) -> None:
        """A fetched copy goes, unless a task here needs it or it is on its way.  A copy
        kept for the next claim (``lingers``) serves a claim only when the claim names
        the submission it is of (``_stale``), and never a request for a replica, which
        names none."""
        if ts.lingers:
            self._stop_lingering(ts)
        self._release_if_unneeded(ts, sid)

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
            local = peer == REDIS_COPY or host_of(peer) == self.host
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

    # -- helpers ---------------------------------------------------------------------

    def _ensure_task(self, key: str) -> TaskState:
        ts = self.tasks.get(key)
        if ts is None:
            ts = self.tasks[key] = TaskState(key)
        return ts

    def _add_who_has(self, ts: TaskState, workers: Iterable[str]) -> None:
        for worker in workers:
            if worker != self.address and worker not in ts.who_has:
                ts.who_has.add(worker)
                self.has_what[worker].add(ts.key)
                if ts.state == "fetch":
                    self._need_from(ts, worker)

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
