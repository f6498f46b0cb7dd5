"""The scheduler's pure state machine: events in, instructions out, no I/O inside.

``SchedulerState.handle_stimulus(*events)`` applies events (client submissions, worker
claims and completions, ...) to an in-memory model of every task and returns instructions
(``redisdask.scheduler.instructions``) for the driver (``redisdask.scheduler``), which
turns them into one atomic, fenced Redis write together with the acknowledgement of the
batch that caused them.

What each event does is here (a handler per event type, ``_HANDLERS``); the tasks'
states, the moves between them and the model they change are in
``scheduler/transitions.py`` (``SchedulerTransitions``, which ``SchedulerState`` extends).

Written in the idiom both state machines share (``redisdask.state_machine``): handlers
chosen by event type (``_HANDLERS``), the legal moves in one table (``_TRANSITIONS``),
``stimulus_id`` passed keyword-only, and a story of every state change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from redisdask.protocol import (
    NO_SCORE,
    AcquireReplicas,
    AddKeys,
    AddWorker,
    CancelKeys,
    CancelledKeys,
    ClientDesiresKeys,
    ClientMissingData,
    ClientReleasesKeys,
    ClientsTold,
    CloseClient,
    CloseWorker,
    FreeKeys,
    Holding,
    KeyErred,
    KeysRecorded,
    MissingData,
    Rebalance,
    ReleasedKeys,
    RemoveWorker,
    Replicate,
    Restart,
    Restarted,
    RestartWorker,
    RetireAborted,
    RetireRefused,
    RetireWorker,
    RetireWorkers,
    RetryKeys,
    Stimulus,
    StolenKeys,
    TaskClaimed,
    TaskErred,
    TaskFinished,
    TaskRetried,
    UpdateData,
    UpdateGraph,
    WhoHas,
)
from redisdask.scheduler.cycles import cycle_text, find_cycles
from redisdask.scheduler.instructions import (
    ClientMsg,
    Dequeue,
    Enqueue,
    ForgetClient,
    ForgetWorker,
    Instruction,
    LogEvent,
    RecordDeath,
    ResetCluster,
    SetDurations,
    SetState,
    SetWants,
    StoreTask,
    Unclaim,
    WorkerMsg,
)
from redisdask.scheduler.stealing import StealTick
from redisdask.scheduler.tasks import (
    EMPTY,
    BadRecord,
    RejectedGraph,
    StreamPosition,
    TaskState,
    WorkerInfo,
    added,
    discarded,
    other_run,
    priority_score,
    worker_stream_position,
)
from redisdask.scheduler.transitions import HOLDS_DEPENDENCIES, SchedulerTransitions
from redisdask.store import codecs, keyspace


def _before_claim(ts: TaskState, written: StreamPosition | None) -> bool:
    """A worker's word (a holding report, a resync) ``written`` on the workers stream
    before the entry of the claim of ``ts``: it cannot know of the claim, so it is no
    evidence that the claim was lost.  Read in stream order this never happens; it does
    behind a reload, whose state has the claims made while no scheduler read the stream."""
    return written is not None and ts.claimed_at is not None and written < ts.claimed_at


def _pack_deaths(ts: TaskState) -> bytes:
    """The structured evidence of a KilledWorker, for ``exc.deaths`` in the client."""
    return codecs.pack({"task": ts.key, "deaths": ts.deaths})


class SchedulerState(SchedulerTransitions):
    """The pure state machine: ``handle_stimulus(*events) -> instructions``, each event
    applied by its handler in terms of ``SchedulerTransitions``'s moves."""

    # ------------------------------------------------------------------ entry point

    def handle_stimulus(self, *events: Stimulus) -> list[Instruction]:
        """Apply events in order; return the instructions for the driver to carry out."""
        stimulus_id, entry = "", None
        for event in events:
            stimulus_id = event.stimulus_id
            # (the messages of one entry share its id: ``workers:<entry id>/<i>``)
            if stimulus_id.startswith("workers:") and not (entry and stimulus_id.startswith(entry)):
                entry = stimulus_id.partition("/")[0] + "/"
                read = worker_stream_position(stimulus_id)
                if read is not None and (self._read is None or read > self._read):
                    self._read, self._seen_text = read, ""
            self._pushing = type(event) is UpdateGraph  # (redisdask.scheduler.push)
            self._HANDLERS[type(event)](self, event)
            self._drain(stimulus_id=stimulus_id)
        self._pushing = False
        if self.holders_changed:
            self.holders_changed = False
            self._move_retiring_data(stimulus_id=stimulus_id)
            self.moves.settle(stimulus_id=stimulus_id)
        if changed := self.durations.take_changed():
            self.emit(SetDurations(stimulus_id, changed))
        instructions, self._instructions = self._instructions, []
        if self.validate:
            self.validate_state()
        return instructions

    # ------------------------------------------------------------------ client events

    def _submitted(self, ts: TaskState, spec: dict[str, Any], sid: str) -> StoreTask:
        """``ts`` takes what its submission says (its run's score: the next in submission
        order); the write of its record, made once its dependencies are known."""
        self.seq += 1
        if not ts.has_spec:  # (a placeholder, or scattered data lost: what it was goes)
            ts.has_spec, ts.nbytes, ts.type, ts.lost_on = True, 0, "", None
        ts.score = priority_score(int(spec.get("priority", 0)), self.seq)
        ts.retries = int(spec.get("retries", 0))
        ts.restrict = tuple(spec.get("workers") or ())
        ts.loose = bool(spec.get("allow_other_workers")) and bool(ts.restrict)
        ts.resources = dict(spec.get("resources") or {}) or None
        deps = list(spec.get("deps", ()))
        return StoreTask(
            sid, ts.key, spec.get("spec"), deps, ts.score, "released", ts.retries,
            ts.restrict, ts.resources, ts.loose,
        )  # fmt: skip

    def _handle_update_graph(self, ev: UpdateGraph) -> None:
        self.clients.setdefault(ev.client, set())
        if ev.generation:
            self.generations[ev.client] = max(ev.generation, self.generations.get(ev.client, 0))
        new: list[TaskState] = []
        stores: dict[str, StoreTask] = {}  # new tasks' records, written once deps are known
        created: set[TaskState] = set()  # tasks this submission made
        deps_of: dict[str, list[str]] = {}
        for spec in ev.tasks:
            # (a key named twice in one message: its first entry counts, as for its record)
            deps_of.setdefault(spec["key"], list(spec.get("deps", ())))
            key = spec["key"]
            ts = self.tasks.get(key)
            if ts is None:
                ts = self.tasks[key] = TaskState(key)
                stores[key] = self._submitted(ts, spec, ev.stimulus_id)
                created.add(ts)
                new.append(ts)
            elif ts.state == "released" and not ts.who_has and spec.get("spec") is not None:
                if not ts.has_spec:  # named only as a dependency so far: a task now (with
                    # older dependents, so not among the ``created`` for the cycle search)
                    stores[key] = self._submitted(ts, spec, ev.stimulus_id)
                new.append(ts)  # resubmitted after release: recompute
        grown: list[TaskState] = []  # tasks given dependencies they did not have
        for ts in new:
            for dep_key in deps_of[ts.key]:
                dep = self.tasks.get(dep_key)
                if dep is None:
                    # a dependency nobody submitted: treat as lost data
                    dep = self.tasks[dep_key] = TaskState(dep_key, has_spec=False)
                    self.emit(StoreTask(ev.stimulus_id, dep_key, None, [], 0.0, "released"))
                if dep not in ts.dependencies:
                    if not grown or grown[-1] is not ts:
                        grown.append(ts)
                    ts.dependencies = added(ts.dependencies, dep)
                    dep.dependents = added(dep.dependents, ts)
        refused = self._cut_cycles(grown, created)
        for ts in refused:
            if ts.key in stores:
                stores[ts.key].deps = []  # what it kept: nothing
        for store in stores.values():
            self.emit(store)
        for ts in grown:  # an older task given dependencies it did not have: record them
            if ts.key not in stores:
                deps = sorted(d.key for d in ts.dependencies)
                self.emit(SetState(ev.stimulus_id, ts.key, ts.state, {"deps": deps}))
        for ts, text in refused.items():
            self._refuse(ts, text, stimulus_id=ev.stimulus_id)
        self._add_wants(ev.client, ev.wanted, stimulus_id=ev.stimulus_id)
        # a task runs if someone wants it or a wanted task needs it
        for key in ev.wanted:
            ts = self.tasks.get(key)
            if ts is not None:
                self._make_needed(ts, stimulus_id=ev.stimulus_id)
        for ts in new:  # submitted, but neither wanted nor needed by a wanted task
            self._maybe_release(ts)

    def _cut_cycles(self, grown: list[TaskState], fresh: set[TaskState]) -> dict[TaskState, str]:
        """Find the cycles that the dependencies added by a submission closed (a graph
        that reached the scheduler unchecked: the client refuses cycles) and cut them out:
        each task of the submission on a cycle loses its dependencies.  Returns those
        tasks, each with the text of its error, which names its cycle.

        Every new cycle passes through an added dependency, so the search covers only the
        submission's new tasks (``fresh``) and the older tasks that lead to an older one
        that gained dependencies (usually none).  Iterative: a 100,000-task chain is fine."""
        if not grown:
            return {}
        within = set(fresh)
        todo = [ts for ts in grown if ts not in fresh]
        while todo:  # an older task on a cycle leads (through dependents) to a grown one
            ts = todo.pop()
            if ts not in within:
                within.add(ts)
                todo.extend(ts.dependents)
        refused: dict[TaskState, str] = {}
        cut = set(grown)
        for members in find_cycles(grown, within):
            text = cycle_text(members)
            for ts in sorted(cut.intersection(members), key=lambda t: t.key):
                for dep in ts.dependencies:
                    discarded(dep.dependents, ts)
                ts.dependencies = EMPTY
                refused[ts] = text
        return refused

    def _refuse(self, ts: TaskState, text: str, *, stimulus_id: str) -> None:
        """Err a task the scheduler will not run; the client raises SchedulerRejectedError."""
        ts.exception = ts.traceback = None
        ts.exception_text, ts.traceback_text = text, ""
        ts.exception_blame = ts.erred_on = None
        ts.rejected = True
        self.transition(ts, "erred", stimulus_id=stimulus_id)

    def _handle_rejected_graph(self, ev: RejectedGraph) -> None:
        if keyspace.is_holder(ev.client):
            return  # (a stranger's message: a holder has no events stream to tell)
        wanted = self.clients.setdefault(ev.client, set())  # forgotten with the client
        for key in dict.fromkeys(ev.keys):
            ts = self.tasks.get(key)
            if ts is not None and ts in wanted:
                continue  # an earlier message of this client submitted it: it runs
            text = (
                f"SchedulerRejectedError: the scheduler refused the message that submitted "
                f"{key!r}, so nothing in it will run: {ev.reason}. The message is kept in "
                "the cluster's dead-letter stream; fix what wrote it and submit again"
            )
            msg = KeyErred(key, exception_text=text, rejected=True)
            self.emit(ClientMsg(ev.stimulus_id, ev.client, msg))

    def _handle_bad_record(self, ev: BadRecord) -> None:
        ts = self.tasks.get(ev.key)
        if ts is None or ts.state != "released":
            return  # (submitted again since: the new submission stands)
        for dependent in sorted(ts.dependents, key=lambda t: t.score):
            if dependent.state in ("queued", "processing", "no-worker"):
                # (the bad record was of a result: the dependent waits on it again, and errs)
                self.transition(dependent, "waiting", stimulus_id=ev.stimulus_id)
        text = (
            f"SchedulerRejectedError: the record of task {ev.key!r} in Redis was malformed "
            f"({ev.reason}), so the scheduler cannot run or recompute it. The record was "
            "copied to the cluster's dead-letter stream and dropped; find what wrote it "
            "(redisdask inspect dead-letter) and submit the task again"
        )
        self._refuse(ts, text, stimulus_id=ev.stimulus_id)
        self._maybe_release(ts)

    def _make_needed(self, root: TaskState, *, stimulus_id: str) -> None:
        """Bring ``root`` and every released dependency it needs towards memory."""
        # post-order walk: dependencies first, so their state is settled when a dependent
        # looks at them (iterative: a 1,000-task chain must not hit the recursion limit)
        order: list[TaskState] = []
        seen: set[TaskState] = {root}
        stack: list[tuple[TaskState, bool]] = [(root, False)]
        while stack:
            ts, expanded = stack.pop()
            if expanded:
                order.append(ts)
                continue
            stack.append((ts, True))
            if ts.state == "released":
                for dep in ts.dependencies:
                    if dep.state == "released" and dep not in seen:
                        seen.add(dep)
                        stack.append((dep, False))
        for ts in order:
            if ts.state == "released":
                if not ts.has_spec and not ts.who_has:
                    self._err_lost(ts, stimulus_id=stimulus_id)
                else:
                    self.transition(ts, "waiting", stimulus_id=stimulus_id)
            for dep in ts.dependencies:
                if ts.state in HOLDS_DEPENDENCIES:
                    dep.waiters = added(dep.waiters, ts)

    def _err_lost(self, ts: TaskState, *, stimulus_id: str) -> None:
        if ts.lost_on:
            ts.exception_text = (
                f"DataUnavailableError: {ts.key!r} was scattered data whose only copy was on "
                f"{ts.lost_on}, which died or could not be reached; scattered data has no "
                "task to recompute it. Keep copies on several workers with "
                "client.replicate(futures, n=2), or compute the data in a task instead of "
                "scattering it"
            )
        else:
            ts.exception_text = (
                f"DataUnavailableError: the data of {ts.key!r} is not on any worker and it "
                "has no task to recompute it (was it scattered by a client that is gone?)"
            )
        # like an error: tell who wants it, and err every dependent waiting on it
        self.transition(ts, "erred", stimulus_id=stimulus_id)

    def _lost_data(self, ts: TaskState, *, stimulus_id: str) -> None:
        """The last copy of a task in memory is gone: its dependents wait for it again,
        and it is recomputed (or, without a task to recompute it, errs) if still needed."""
        self.set_state(ts, "released", stimulus_id=stimulus_id)
        ts.replicating = EMPTY
        self.moves.cancel(ts, stimulus_id=stimulus_id)
        self.emit(SetState(stimulus_id, ts.key, "released", {"who_has": []}))
        for dependent in sorted(ts.waiters, key=lambda t: t.score):
            if dependent.state in ("queued", "processing", "no-worker"):
                # a worker that claimed it cannot get the data now: take the task back
                self.transition(dependent, "waiting", stimulus_id=stimulus_id)
            elif dependent.state == "waiting":
                dependent.waiting_on = added(dependent.waiting_on, ts)
        if ts.who_wants or ts.waiters:
            self._make_needed(ts, stimulus_id=stimulus_id)
        else:
            self._maybe_release(ts)

    def _add_wants(self, client: str, keys: Iterable[str], *, stimulus_id: str) -> None:
        added = []
        wanted = self.clients.setdefault(client, set())
        fired = client == keyspace.FIRE_AND_FORGET
        for key in keys:
            ts = self.tasks.get(key)
            if ts is None or client in ts.who_wants:
                if ts is not None:
                    self._report_to(client, ts, stimulus_id=stimulus_id)
                continue
            if fired and ts.state in ("memory", "erred"):
                continue  # it ran: fire_and_forget keeps no result
            ts.who_wants.add(client)
            wanted.add(ts)
            added.append(key)
            self._report_to(client, ts, stimulus_id=stimulus_id)
        if added:
            self.emit(SetWants(stimulus_id, client, add=added))
        elif not wanted and keyspace.is_holder(client):
            del self.clients[client]  # a holder exists only while it wants something

    def _report_to(self, client: str, ts: TaskState, *, stimulus_id: str) -> None:
        """Tell a client about a finished task it just asked for."""
        if ts.state == "memory":
            self.emit(ClientMsg(stimulus_id, client, self._memory_msg(ts)))
        elif ts.state == "erred":
            self.emit(ClientMsg(stimulus_id, client, self._erred_msg(ts)))

    def _handle_client_desires_keys(self, ev: ClientDesiresKeys) -> None:
        self._add_wants(ev.client, ev.keys, stimulus_id=ev.stimulus_id)
        for key in ev.keys:
            if key in self.tasks:
                self._make_needed(self.tasks[key], stimulus_id=ev.stimulus_id)
            elif not keyspace.is_holder(ev.client):  # a holder hears nothing
                # e.g. a future unpickled in a task after its submitter let it go
                text = (
                    f"task {key!r} is unknown to the scheduler: it was released (no client "
                    "wanted it) before this future asked for it; keep a future of it alive "
                    "in the client that submitted it while others use it"
                )
                self.emit(ClientMsg(ev.stimulus_id, ev.client, KeyErred(key, exception_text=text)))

    def _handle_client_releases_keys(self, ev: ClientReleasesKeys) -> None:
        self._release_wants(ev.client, ev.keys, stimulus_id=ev.stimulus_id)

    def _handle_cancel_keys(self, ev: CancelKeys) -> None:
        # cancelling a key cancels the client's dependents of it too, as in Dask
        wanted = self.clients.get(ev.client, set())
        todo = [self.tasks[k] for k in ev.keys if k in self.tasks]
        cancelled: dict[str, TaskState] = {}
        while todo:
            ts = todo.pop()
            if ts.key in cancelled:
                continue
            cancelled[ts.key] = ts
            todo.extend(d for d in ts.dependents if d in wanted)
        # release dependents first so dependencies lose their waiters before they are looked at
        keys = sorted(cancelled, key=lambda k: -cancelled[k].score)
        self._release_wants(ev.client, keys, stimulus_id=ev.stimulus_id)
        self.emit(
            ClientMsg(
                ev.stimulus_id,
                ev.client,
                CancelledKeys(keys, generation=ev.generation),
            )
        )

    def _handle_restart(self, ev: Restart) -> None:
        keys = list(self.tasks)
        # (a client that submitted nothing is known only from its heartbeat: it hears too)
        clients = list(dict.fromkeys([*self.clients, ev.client, *ev.connected]))
        self.emit(ResetCluster(ev.stimulus_id, keys, list(self.workers), clients))
        for ws in self.workers.values():
            ws.processing.clear()
            ws.has_what.clear()
            self.emit(WorkerMsg(ev.stimulus_id, ws.address, RestartWorker()))
        for client in clients:
            self.emit(ClientMsg(ev.stimulus_id, client, Restarted(by=ev.client)))
        self.tasks.clear()
        self.unrunnable.clear()
        self._candidates.clear()
        self.moves.forget(stimulus_id=ev.stimulus_id)
        # (the holders wanted only tasks: they go with them; a client that only heard
        # of the restart stays unknown until its first graph, as before it)
        self.clients = {c: set() for c in self.clients if not keyspace.is_holder(c)}

    def _handle_retry_keys(self, ev: RetryKeys) -> None:
        """Run erred tasks again, as distributed's ``stimulus_retry``: each erred key the
        client wants and the erred tasks it depends on (where its error came from) go
        back to released, and so does every erred task downstream of them or of the task
        that raised (which inherited the error: distributed's erred-to-released
        recommends those too); their clients hear ``task-retried``, and what is wanted
        is needed anew.  A task the scheduler refused stays erred."""
        wanted = self.clients.get(ev.client, set())
        up = [ts for key in dict.fromkeys(ev.keys) if (ts := self.tasks.get(key)) in wanted]
        retried: dict[TaskState, None] = {}  # erred tasks to run again, in the order found
        while up:
            ts = up.pop()
            if ts not in retried and ts.state == "erred" and not ts.rejected:
                retried[ts] = None
                up.extend(ts.dependencies)
        # the task that raised may be released (nobody wanted it): start below it too
        down = [*retried, *(self.tasks[t.exception_blame] for t in retried
                            if t.exception_blame in self.tasks)]  # fmt: skip
        while down:
            for dependent in down.pop().dependents:
                erred = dependent.state == "erred" and not dependent.rejected
                if erred and dependent not in retried:
                    retried[dependent] = None
                    down.append(dependent)
        for ts in retried:
            self.transition(ts, "released", stimulus_id=ev.stimulus_id)
            for client in ts.who_wants:
                self.emit(ClientMsg(ev.stimulus_id, client, TaskRetried(ts.key)))
        for ts in retried:
            if ts.who_wants:
                self._make_needed(ts, stimulus_id=ev.stimulus_id)

    def _handle_close_client(self, ev: CloseClient) -> None:
        wanted = [ts.key for ts in self.clients.get(ev.client, ())]
        self._release_wants(ev.client, wanted, stimulus_id=ev.stimulus_id)
        self.generations.pop(ev.client, None)
        if self.clients.pop(ev.client, None) is not None or not keyspace.is_holder(ev.client):
            self.emit(ForgetClient(ev.stimulus_id, ev.client))  # (a holder's went with its wants)

    def _handle_update_data(self, ev: UpdateData) -> None:
        recorded: dict[str, list[str]] = {}  # worker -> keys it now holds for us
        for key, holders in ev.who_has.items():
            ts = self.tasks.get(key)
            fields: dict[str, Any] = {}
            if ts is None:  # (its score names this scatter: workers tell copies apart by it)
                self.seq += 1
                score = priority_score(0, self.seq)
                ts = self.tasks[key] = TaskState(key, score=score, has_spec=False)
                self.emit(StoreTask(ev.stimulus_id, key, None, [], score, "released"))
            elif ts.state != "memory":  # the scattered data replaces the task's run, and
                # takes a score of its own
                if ts.erred_on in holders:  # the value put there replaced its failed run:
                    ts.erred_on = None  # no free-keys for it
                if ts.state != "released":
                    self.transition(ts, "released", stimulus_id=ev.stimulus_id)
                self.seq += 1
                ts.score = fields["score"] = priority_score(0, self.seq)
            ts.nbytes = int(ev.nbytes.get(key, 0))
            ts.type = str(ev.types.get(key, ""))
            for worker in holders:
                self._add_replica(ts, worker)
                if worker in self.workers:
                    recorded.setdefault(worker, []).append(key)
            # (also when it was in memory already: its new holders and size are recorded)
            fields.update(self.memory_fields(ts))
            self.emit(SetState(ev.stimulus_id, key, "memory", fields))
            if ts.state != "memory":
                self.set_state(ts, "memory", stimulus_id=ev.stimulus_id)
                self._wake_waiters(ts, stimulus_id=ev.stimulus_id)
                self._fired_done(ts, stimulus_id=ev.stimulus_id)
        # the data reached the workers over TCP, before this message; a free-keys this
        # scheduler sent them earlier (for a released copy of the same key) may reach them
        # after it: this tells them which free-keys are about the new copies
        for worker, keys in recorded.items():
            self.emit(WorkerMsg(ev.stimulus_id, worker, KeysRecorded(keys)))
        self._add_wants(ev.client, list(ev.who_has), stimulus_id=ev.stimulus_id)

    # ------------------------------------------------------------------ worker events

    def _handle_add_worker(self, ev: AddWorker) -> None:
        known = self.workers.get(ev.worker)
        started = ev.info.get("started")
        if known is not None and started and known.info.get("started") not in (None, started):
            # a new process at the address of one that is gone (its port was reused before
            # anyone noticed the death): what the old one held and ran is lost
            self._handle_remove_worker(
                RemoveWorker(
                    worker=ev.worker,
                    how="replaced",
                    reason="a new worker process registered at its address (port reused)",
                    stimulus_id=ev.stimulus_id,
                )
            )
        if ev.worker not in self.workers:
            self.workers[ev.worker] = WorkerInfo(ev.worker, dict(ev.info))
        else:
            self.workers[ev.worker].info.update(ev.info)
        self.placement.forget()  # its name, host or resources may be new
        ws = self.workers[ev.worker]
        if ev.stimulus_id != "load" and not ws.announced:
            # (a worker that registered before this scheduler loaded is announced when its
            # add-worker message is read)
            ws.announced = True
            shown = ("name", "host", "nthreads", "memory_limit", "restarts")
            fields = {k: ev.info[k] for k in shown if ev.info.get(k) is not None}
            self.emit(LogEvent(ev.stimulus_id, "worker-joined", {"worker": ev.worker, **fields}))
        self.holders_changed = True  # somewhere new to put a retiring worker's data
        if ev.resync:
            self._resync(self.workers[ev.worker], ev.resync, stimulus_id=ev.stimulus_id)
        for ts in sorted(self.unrunnable, key=lambda t: t.score):
            if ev.worker in (self.targets(ts) or ()):
                self.transition(ts, "queued", stimulus_id=ev.stimulus_id)
        for ts in self.tasks.values():  # queued for others it matches too: for it as well
            if ts.state != "queued" or not ts.queued_on or ev.worker in ts.queued_on:
                continue
            if ev.worker in (self.targets(ts) or ()):
                ts.queued_on += (ev.worker,)
                self.emit(Enqueue(ev.stimulus_id, ts.key, ts.score, (ev.worker,), ts.queued_on,
                                   constrained=bool(ts.resources), placed=True))  # fmt: skip

    def _resync(self, ws: WorkerInfo, report: dict[str, Any], *, stimulus_id: str) -> None:
        """Reconcile with what a worker says it holds and runs (after Redis lost writes:
        a report, a claim, a release).  The worker's word wins about itself."""
        held = {str(k): int(n) for k, n in dict(report.get("keys", {})).items()}
        running = {str(k) for k in report.get("processing", [])}
        written = worker_stream_position(stimulus_id)
        for ts in sorted(ws.processing, key=lambda t: t.score):
            if ts.key in held:  # it finished; the report was lost
                ts.nbytes = held[ts.key]
                self.transition(ts, "memory", worker=ws, stimulus_id=stimulus_id)
            elif ts.key not in running and not _before_claim(ts, written):
                self._queue_again(ws, ts, stimulus_id=stimulus_id)  # it does not know it
        stray = []
        for key in held:
            ts = self.tasks.get(key)
            if ts is not None and ts.state == "memory":
                if ws.address not in ts.who_has:
                    self._add_replica(ts, ws.address)
                    self.emit(SetState(stimulus_id, key, "memory", self.memory_fields(ts)))
            elif ts is None or ts.processing_on != ws.address:
                stray.append(key)
        for key in running:
            ts = self.tasks.get(key)
            if ts is None or ts.processing_on != ws.address:
                stray.append(key)  # claimed in a Redis that forgot it: someone else's now
        if stray:
            free = FreeKeys(sorted(set(stray)), seen=self._seen())
            self.emit(WorkerMsg(stimulus_id, ws.address, free))

    def _handle_holding(self, ev: Holding) -> None:
        ws = self.workers.get(ev.worker)
        if ws is None:
            return
        listed = set(ev.keys)
        read_before = ws.holding_reports
        ws.holding_reports += 1
        lost = []
        written = worker_stream_position(ev.stimulus_id)
        for ts in ws.processing:
            if ts.key in listed:
                ts.unlisted = 0
            elif _before_claim(ts, written):
                continue  # read behind a reload that has the claim: it cannot list it
            elif ts.claimed_before < read_before:  # claimed before the worker's previous
                ts.unlisted += 1  # report, so this one would list it if it had it
                if ts.unlisted >= 2:
                    lost.append(ts)
        for ts in sorted(lost, key=lambda t: t.score):
            self.emit(LogEvent(ev.stimulus_id, "lost-claim", {"key": ts.key, "worker": ws.address}))
            self._queue_again(ws, ts, stimulus_id=ev.stimulus_id)

    def _queue_again(self, ws: WorkerInfo, ts: TaskState, *, stimulus_id: str) -> None:
        """A task processing on a worker that does not know it: queue it again."""
        ts.processing_on = None
        ws.processing.discard(ts)
        self.emit(Unclaim(stimulus_id, ws.address, ts.key))
        self.transition(ts, "queued", stimulus_id=stimulus_id)

    def _handle_remove_worker(self, ev: RemoveWorker) -> None:
        ws = self.workers.pop(ev.worker, None)
        self.placement.forget()
        if ws is None:
            if ev.how == "nanny":  # removed already (say, its heartbeat expired first):
                # the nanny's word on why it ended is still the record worth keeping
                known = ("name", "host", "pid")
                gone = WorkerInfo(ev.worker, {k: ev.evidence.get(k) for k in known})
                self.emit(RecordDeath(ev.stimulus_id, self._death_record(ev, gone, [])))
            return
        self.holders_changed = True  # a copy it held or was fetching may be gone
        for other in self.workers.values():
            if other.retiring:
                other.to_move |= ws.has_what & other.has_what
        died = ev.how != "goodbye"
        processing = sorted(ws.processing, key=lambda t: t.score)
        if died:
            record = self._death_record(ev, ws, processing)
            self.emit(RecordDeath(ev.stimulus_id, record))
        else:
            fields = {"worker": ws.address, "name": ws.info.get("name"), "reason": ev.reason}
            self.emit(LogEvent(ev.stimulus_id, "worker-left", fields))
        for ts in processing:
            if ts.state != "processing":
                continue  # chained on one of them, and taken back with it (Chains.unchain)
            ts.processing_on = None
            self.emit(Unclaim(ev.stimulus_id, ws.address, ts.key))
            if died:
                ts.suspicious += 1
                ts.deaths = (*ts.deaths, record)
            if died and ts.suspicious > self.allowed_failures:
                self._kill(ts, stimulus_id=ev.stimulus_id)
            else:
                if died:
                    fields = {"suspicious": ts.suspicious, "deaths": list(ts.deaths)}
                    self.emit(SetState(ev.stimulus_id, ts.key, "processing", fields))
                self.transition(ts, "queued", stimulus_id=ev.stimulus_id)
        for ts in list(ws.has_what):
            ts.who_has.discard(ws.address)
            if not (ts.who_has or ts.inline) and ts.state == "memory":
                # lost its only copy: recompute if still needed
                ts.lost_on = ws.address
                self._lost_data(ts, stimulus_id=ev.stimulus_id)
            elif ts.state == "memory":
                self.emit(SetState(ev.stimulus_id, ts.key, "memory", self.memory_fields(ts)))
                if ts.replicas > 1:
                    # a copy survives: make up for the lost one
                    self.moves.ensure_replicas(ts, stimulus_id=ev.stimulus_id)
        for ts in list(self.tasks.values()):
            if ts.state == "queued" and ws.address in ts.queued_on:
                # out of its ready set (which a new process at the address would
                # inherit): the task goes there again only if that one matches too
                ts.queued_on = tuple(w for w in ts.queued_on if w != ws.address)
                self.emit(Dequeue(ev.stimulus_id, ts.key, (ws.address,), bool(ts.resources),
                                   ts.queued_on))  # fmt: skip
                if ts.queued_on:
                    continue
                if self.targets(ts) is None:
                    self.transition(ts, "no-worker", stimulus_id=ev.stimulus_id)
                else:  # a preference that no worker can honour now: anywhere it may run
                    self.enqueue(ts, stimulus_id=ev.stimulus_id)
        if ev.how != "replaced":  # else the keys are the new process's, at the same address
            self.emit(ForgetWorker(ev.stimulus_id, ws.address))

    def _death_record(
        self, ev: RemoveWorker, ws: WorkerInfo, processing: list[TaskState]
    ) -> dict[str, Any]:
        last = ev.evidence.get("last_heartbeat") or {}
        return {
            "worker": ws.address,
            "name": ws.info.get("name") or ws.address,
            "host": ws.info.get("host", ""),
            "pid": ws.info.get("pid"),
            "how": ev.how,
            "kind": ev.evidence.get("kind") or ev.how,
            "reason": ev.reason,
            "processing": [t.key for t in processing],
            "executing": list(last.get("executing", [])),
            "evidence": dict(ev.evidence),
            "stimulus_id": ev.stimulus_id,
        }

    def _kill(self, ts: TaskState, *, stimulus_id: str) -> None:
        """Err a task that was on ``allowed_failures + 1`` workers that died."""
        lines = [
            f"KilledWorker: task {ts.key!r} was running on {ts.suspicious} workers that died "
            f"(allowed-failures is {self.allowed_failures}); it is likely to be what killed "
            "them. The deaths:"
        ]
        for d in ts.deaths:
            others = [k for k in d["executing"] or d["processing"] if k != ts.key]
            lines.append(
                f"  - {d['name']} on {d['host'] or '?'} ({d['how']}): {d['reason']}; "
                + (
                    f"also running there: {', '.join(others[:5])}"
                    if others
                    else "nothing else was running there"
                )
            )
        ts.exception = ts.traceback = None
        ts.exception_text = "\n".join(lines)
        ts.traceback_text = ""
        ts.erred_on = ts.deaths[-1]["worker"] if ts.deaths else None
        ts.killed = _pack_deaths(ts)
        fields = {"key": ts.key, "workers": [d["worker"] for d in ts.deaths]}
        self.emit(LogEvent(stimulus_id, "killed-worker", fields))
        self.transition(ts, "erred", stimulus_id=stimulus_id)

    def _handle_claimed(self, ev: TaskClaimed) -> None:
        ws = self.workers.get(ev.worker)
        if ws is not None and not ev.chained:
            ws.no_push = False  # it claims: it runs what it is given (redisdask.scheduler.push)
        scores = list(ev.scores) + [NO_SCORE] * (len(ev.keys) - len(ev.scores))
        for key, score in zip(ev.keys, scores, strict=False):
            if ev.chained:  # claimed by FINISH while waiting (scheduler/chain.py)
                self.chains.claimed(key, score, ev.worker, stimulus_id=ev.stimulus_id)
                continue
            ts = self.tasks.get(key)
            try:
                stale = ts is not None and other_run(float(score), ts)
            except (TypeError, ValueError):
                stale = False
            if stale:
                # an earlier run of the key, popped just before it was cancelled: its
                # copy goes, not one of the current run the worker may have by the time
                # it reads the free-keys (which says the run)
                self.emit(Unclaim(ev.stimulus_id, ev.worker, key))
                self.free(ev.worker, key, stimulus_id=ev.stimulus_id, run=float(score))
                continue
            if ts is not None and ts.state == "processing" and ts.processing_on == ev.worker:
                # state reloaded from Redis after the claim: already known (and from
                # here on in the stream, its worker's holding reports account for it)
                if ws is not None:
                    ts.claimed_before = ws.holding_reports
                continue
            if ts is None or ts.state != "queued" or ws is None:
                # released while the claim was in flight: tell the worker to drop it,
                # unless its copy is on record (put there and recorded meanwhile)
                self.emit(Unclaim(ev.stimulus_id, ev.worker, key))
                if ts is None or ev.worker not in ts.who_has:
                    self.free(ev.worker, key, stimulus_id=ev.stimulus_id)
                if ts is not None and ts.state == "queued":
                    # claimed by a worker removed meanwhile: the claim popped it from the
                    # ready set and marked it processing in Redis; put it back
                    self.emit(SetState(ev.stimulus_id, key, "queued"))
                    self.enqueue(ts, stimulus_id=ev.stimulus_id)
                continue
            self.transition(ts, "processing", worker=ws, stimulus_id=ev.stimulus_id)

    def _handle_task_finished(self, ev: TaskFinished) -> None:
        ts = self.tasks.get(ev.key)
        ws = self.workers.get(ev.worker)
        if ts is not None and other_run(ev.score, ts):
            return  # a result of an earlier run of this key, reported late: not this run's
        if ts is None or ws is None or ts.state != "processing" or ts.processing_on != ws.address:
            # a result nobody asked this worker for: a run of an earlier incarnation of the
            # key (cancelled, released, submitted again) or of a claim taken back.  Counting
            # it would name a holder that is about to drop it; let it drop it now.
            if ts is None or ev.worker not in ts.who_has:
                self.free(ev.worker, ev.key, stimulus_id=ev.stimulus_id)
            return
        ts.nbytes, ts.type = int(ev.nbytes), ev.type
        if not ev.seceded:  # a seceded run mostly waited: its time is not its cost
            self.durations.add(ts.prefix, ev.start, ev.stop)  # (its key_prefix, made once)
        self.transition(ts, "memory", worker=ws, value=ev.value, stimulus_id=ev.stimulus_id)

    def _handle_task_erred(self, ev: TaskErred) -> None:
        ts = self.tasks.get(ev.key)
        if ts is None or ts.state != "processing" or ts.processing_on != ev.worker:
            return
        if other_run(ev.score, ts):
            return
        self.emit(Unclaim(ev.stimulus_id, ev.worker, ts.key))
        if ts.retries > 0:
            ts.retries -= 1
            self.emit(SetState(ev.stimulus_id, ts.key, ts.state, {"retries": ts.retries}))
            # the worker keeps the failed run until told: it must not answer the retry
            # with it (the free-keys reaches it before any claim of the retry)
            self.free(ev.worker, ts.key, stimulus_id=ev.stimulus_id)
            self.transition(ts, "queued", stimulus_id=ev.stimulus_id)
            return
        ts.exception, ts.traceback = ev.exception, ev.traceback
        ts.exception_text, ts.traceback_text = ev.exception_text, ev.traceback_text
        ts.erred_on = ev.worker
        self.transition(ts, "erred", stimulus_id=ev.stimulus_id)
        fields = {"key": ts.key, "worker": ev.worker, "exception": ev.exception_text[:500]}
        self.emit(LogEvent(ev.stimulus_id, "task-erred", fields))

    def _handle_missing_data(self, ev: MissingData) -> None:
        for key in ev.keys:
            ts = self.tasks.get(key)
            if ts is None:
                continue
            if ev.worker in ts.replicating:  # a copy that did not come: ask again
                discarded(ts.replicating, ev.worker)
                self.holders_changed = True
            errant = self.workers.get(ev.errant_worker)
            # a retiring holder is alive and keeps its data until it is told to close, and
            # a rebalance's sender until its recipient has the copy: a failed fetch from
            # either is taken for a passing network failure (that move is abandoned)
            trusted = errant is not None and errant.retiring
            trusted |= self.moves.move_failed(
                ts, ev.worker, ev.errant_worker, stimulus_id=ev.stimulus_id
            )
            if not trusted:
                self._drop_holder(ts, ev.errant_worker, stimulus_id=ev.stimulus_id)
            if ev.worker in ts.who_has:
                # it misses a key counted as held by itself: its copy is gone (answering
                # with its own address would leave its dependents waiting for ever)
                ts.who_has.discard(ev.worker)
                reporter = self.workers.get(ev.worker)
                if reporter is not None:
                    reporter.has_what.discard(ts)
            if ts.state == "memory" and (ts.who_has or ts.inline):
                self.emit(SetState(ev.stimulus_id, key, "memory", self.memory_fields(ts)))
                who_has = {key: ts.holders()}
                self.emit(WorkerMsg(ev.stimulus_id, ev.worker, WhoHas(who_has)))
            elif ts.state == "memory":
                ts.missed_by = ev.worker  # (decide_worker: the recompute goes there first)
                self._lost_data(ts, stimulus_id=ev.stimulus_id)

    def _drop_holder(self, ts: TaskState, address: str, *, stimulus_id: str) -> bool:
        """No longer count ``address`` (a recorded holder, or nothing is done) as holding
        ``ts``; it is told to drop its copy, which must not stay an orphan."""
        if address not in ts.who_has:
            return False
        ts.who_has.discard(address)
        ws = self.workers.get(address)
        if ws is not None:
            ws.has_what.discard(ts)
            self.free(ws.address, ts.key, stimulus_id=stimulus_id)
        return True

    def _handle_client_missing_data(self, ev: ClientMissingData) -> None:
        """A client could not fetch keys from the holders it names: a peer deadline or a
        connection error, though their heartbeats may go on (only a link is cut), or an
        answer without the key.  Only holders still recorded are dropped, so a late or
        repeated report of a copy already replaced costs nothing; a retiring holder
        keeps its copy until it hands it on."""
        for key, failed in ev.who_failed.items():
            ts = self.tasks.get(key)
            if ts is None or ts.state != "memory":
                continue
            dropped = [
                address
                for address in failed
                if not (address in self.workers and self.workers[address].retiring)
                and self._drop_holder(ts, address, stimulus_id=ev.stimulus_id)
            ]
            if not dropped:
                continue
            if ts.who_has or ts.inline:
                self.emit(SetState(ev.stimulus_id, key, "memory", self.memory_fields(ts)))
            else:
                ts.lost_on = ", ".join(dropped)
                self._lost_data(ts, stimulus_id=ev.stimulus_id)

    def _handle_add_keys(self, ev: AddKeys) -> None:
        self.holders_changed = True
        for key in ev.keys:
            ts = self.tasks.get(key)
            if ts is not None:
                discarded(ts.replicating, ev.worker)
            if ts is not None and ts.state == "memory" and ev.worker in self.workers:
                self._add_replica(ts, ev.worker)
                self.emit(SetState(ev.stimulus_id, key, "memory", self.memory_fields(ts)))

    def _handle_retire_workers(self, ev: RetireWorkers) -> None:
        leaving = [self.workers[a] for a in dict.fromkeys(ev.workers) if a in self.workers]
        staying = [a for a, ws in self.workers.items() if not ws.retiring and a not in ev.workers]
        if ev.client and not staying and any(ws.has_what or ws.processing for ws in leaving):
            held = len(set().union(*(ws.has_what | ws.processing for ws in leaving)))
            reason = (
                f"no worker would stay to take the {held} results they hold or compute; "
                "start more workers first, or retire fewer"
            )
            msg = RetireRefused([ws.address for ws in leaving], reason=reason)
            self.emit(ClientMsg(ev.stimulus_id, ev.client, msg))
            return
        self.holders_changed = True
        for ws in leaving:
            if not ws.retiring and ev.client:
                self.emit(WorkerMsg(ev.stimulus_id, ws.address, RetireWorker()))
            if not ws.retiring:
                ws.retiring = True
                ws.to_move = set(ws.has_what)
            if ev.client:
                ws.retire_clients.add(ev.client)
                continue
            # the worker's own word: it claims no more; repeated every second, it
            # re-asks for the copies that have not arrived and for the close it missed
            ws.retire_heard, ws.told_to_close = True, False
            for ts in ws.to_move:
                ts.replicating = EMPTY
            if ev.force and not staying:
                self._tell_to_close(
                    ws, "retired; no worker stayed to take its data", stimulus_id=ev.stimulus_id
                )

    def _move_retiring_data(self, *, stimulus_id: str) -> None:
        """Ask staying workers (least loaded first) for a copy of every result that only
        retiring workers hold; tell a retiring worker to close once it said it claims no
        more, runs nothing and holds nothing unique.  Runs after a batch in which
        something a retirement waits for happened (a copy arrived, a task finished there,
        a worker came or went)."""
        staying = {a for a, ws in self.workers.items() if not ws.retiring}
        load: dict[str, int] = {}
        requests: dict[str, dict[str, list[str]]] = {}
        sid = "retire-" + stimulus_id
        for ws in [w for w in self.workers.values() if w.retiring and not w.told_to_close]:
            ws.to_move = {
                ts
                for ts in ws.to_move
                if ts.state == "memory" and not (ts.inline or ts.who_has & staying)
            }
            if not ws.to_move and not ws.processing and ws.retire_heard:
                self._tell_to_close(ws, "retired", stimulus_id=stimulus_id)
                continue
            if ws.to_move and not staying:
                self._abort_retirement(ws, stimulus_id=stimulus_id)
                continue
            for ts in sorted(ws.to_move, key=lambda t: t.score):
                ts.replicating &= staying
                if ts.replicating or not staying:
                    continue
                if not load:
                    load = {a: sum(t.nbytes for t in self.workers[a].has_what) for a in staying}
                target = min(load, key=lambda a: (load[a], a))
                load[target] += ts.nbytes
                ts.replicating = added(ts.replicating, target)
                requests.setdefault(target, {})[ts.key] = sorted(ts.who_has)
        for target, who_has in requests.items():
            self.emit(WorkerMsg(sid, target, AcquireReplicas(who_has)))

    def _abort_retirement(self, ws: WorkerInfo, *, stimulus_id: str) -> None:
        """No worker stays to take what only ``ws`` holds (they left after it began to
        retire): it works on, as distributed keeps such a worker, and the clients that
        asked are told at once (they waited out their timeout, and the worker claimed
        nothing meanwhile: with no other worker, the cluster stood still)."""
        reason = (
            f"the workers that were to take its {len(ws.to_move)} results left; it keeps "
            "running: start more workers, then retire it again"
        )
        ws.retiring = ws.retire_heard = False
        ws.to_move = set()
        sid = "retire-" + stimulus_id
        self.emit(WorkerMsg(sid, ws.address, RetireAborted(reason)))
        for client in sorted(ws.retire_clients):
            self.emit(ClientMsg(sid, client, RetireRefused([ws.address], reason=reason)))
        ws.retire_clients.clear()

    def _tell_to_close(self, ws: WorkerInfo, reason: str, *, stimulus_id: str) -> None:
        ws.told_to_close = True
        self.emit(WorkerMsg("retire-" + stimulus_id, ws.address, CloseWorker(reason)))

    def _handle_told(self, ev: ClientsTold) -> None:
        """FINISH sent these pushed tasks' results to the clients in their ``notify``."""
        for key, score in zip(ev.keys, ev.scores, strict=False):
            ts = self.tasks.get(key)
            try:
                same_run = ts is not None and not other_run(float(score), ts)
            except (TypeError, ValueError):
                same_run = False
            if same_run and ts.state == "processing" and ts.processing_on == ev.worker:
                ts.told = True  # (what the report after it is accepted for, they have)

    def _handle_released_keys(self, ev: ReleasedKeys) -> None:
        ws = self.workers.get(ev.worker)
        for prefix, elapsed in ev.overdue.items():  # (claims handed back behind such runs)
            self.durations.add_exec_time(prefix, float(elapsed))
        scores = list(ev.scores) + [NO_SCORE] * (len(ev.keys) - len(ev.scores))
        for key, score in zip(ev.keys, scores, strict=False):
            ts = self.tasks.get(key)
            if ts is None or ws is None or other_run(float(score), ts):
                continue  # (stale: a run of the key before the current one)
            if ts in ws.processing:
                ws.processing.discard(ts)
                ws.no_push = True  # paused or retiring, perhaps: push it nothing more
                self.emit(Unclaim(ev.stimulus_id, ws.address, key))
                if ts.state == "processing":
                    ts.processing_on = None
                    self.transition(ts, "queued", stimulus_id=ev.stimulus_id)
            if ev.worker in ts.who_has:
                ts.who_has.discard(ev.worker)
                ws.has_what.discard(ts)
                if ts.state == "memory" and not (ts.who_has or ts.inline):
                    self._lost_data(ts, stimulus_id=ev.stimulus_id)
                elif ts.state == "memory":
                    self.emit(SetState(ev.stimulus_id, key, "memory", self.memory_fields(ts)))

    # (the parts' events: each part handles its own)
    def _handle_replicate(self, ev: Replicate) -> None:
        self.moves.handle_replicate(ev)

    def _handle_rebalance(self, ev: Rebalance) -> None:
        self.moves.handle_rebalance(ev)

    def _handle_steal_tick(self, ev: StealTick) -> None:
        self.stealing.handle_steal_tick(ev)

    def _handle_stolen_keys(self, ev: StolenKeys) -> None:
        self.stealing.handle_stolen_keys(ev)

    # the handler of each event type (``handle_stimulus`` looks it up by ``type(event)``)
    _HANDLERS: ClassVar[dict[type[Stimulus], Callable[[SchedulerState, Any], None]]] = {
        UpdateGraph: _handle_update_graph,
        RejectedGraph: _handle_rejected_graph,
        BadRecord: _handle_bad_record,
        ClientDesiresKeys: _handle_client_desires_keys,
        ClientReleasesKeys: _handle_client_releases_keys,
        CancelKeys: _handle_cancel_keys,
        CloseClient: _handle_close_client,
        UpdateData: _handle_update_data,
        Restart: _handle_restart,
        AddWorker: _handle_add_worker,
        RemoveWorker: _handle_remove_worker,
        TaskClaimed: _handle_claimed,
        Holding: _handle_holding,
        ClientsTold: _handle_told,
        TaskFinished: _handle_task_finished,
        TaskErred: _handle_task_erred,
        MissingData: _handle_missing_data,
        ClientMissingData: _handle_client_missing_data,
        AddKeys: _handle_add_keys,
        ReleasedKeys: _handle_released_keys,
        Replicate: _handle_replicate,
        Rebalance: _handle_rebalance,
        RetryKeys: _handle_retry_keys,
        RetireWorkers: _handle_retire_workers,
        StealTick: _handle_steal_tick,
        StolenKeys: _handle_stolen_keys,
    }
