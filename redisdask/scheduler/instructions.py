"""The scheduler's side effects: the instructions ``SchedulerState.handle_stimulus`` returns.

The state machine (``redisdask.scheduler.state``) does no I/O; each change it wants made
outside its own memory is one of these records.  The driver hands a batch's instructions
to ``scheduler.translator.Translator``, which turns each type into Redis commands (one short
method per type) written atomically, fenced, with the acknowledgement of the batch that
caused them.  Every instruction carries the ``stimulus_id`` of the event behind it, so
the task's story can say why it changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from redisdask.protocol import ClientEvent, ComputeTask, InboxMessage


@dataclass(slots=True)
class Instruction:
    stimulus_id: str


@dataclass(slots=True)
class StoreTask(Instruction):
    """Write a new task's graph history: spec, dependencies, priority score."""

    key: str
    spec: bytes | None
    deps: list[str]
    score: float
    state: str
    retries: int = 0
    restrict: tuple[str, ...] = ()
    resources: dict[str, float] | None = None
    loose: bool = False  # allow_other_workers: the restriction is a preference


@dataclass(slots=True)
class SetState(Instruction):
    """Record a task's new state (and any extra fields) in its Redis hash."""

    key: str
    state: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Enqueue(Instruction):
    """Put a task in the ready set, or in the listed workers' own ready sets (their
    ``constrained`` sets for a task with resources).  ``queued_on``: every worker whose
    set holds it after this one (those listed and those it was in already), for the task
    hash, where the CLAIM script reads it; written when the task is ``placed`` (restricted
    or resourced) even when empty (a preference nobody can honour: the shared set).
    ``preferred``: placed by data (``redisdask.scheduler.decide``) on the one worker listed, which
    has the first refusal: the task goes into the cluster's ``placed`` set too, where
    ``CLAIM`` lets another worker take it while that one is busy, unless it is
    ``sticky`` (its data costs more to move than its run: ``decide.sticky``)."""

    key: str
    score: float
    workers: tuple[str, ...] = ()
    queued_on: tuple[str, ...] = ()
    constrained: bool = False
    placed: bool = False
    preferred: bool = False
    sticky: bool = False


@dataclass(slots=True)
class Dequeue(Instruction):
    key: str
    workers: tuple[str, ...] = ()
    constrained: bool = False  # out of the workers' constrained sets, not their ready sets
    queued_on: tuple[str, ...] | None = None  # still queued on these: written to the hash


@dataclass(slots=True)
class Unclaim(Instruction):
    """Drop a task from a worker's processing set."""

    worker: str
    key: str


@dataclass(slots=True)
class Forget(Instruction):
    key: str


@dataclass(slots=True)
class SetWants(Instruction):
    client: str
    add: list[str] = field(default_factory=list)
    remove: list[str] = field(default_factory=list)


@dataclass(slots=True)
class ClientMsg(Instruction):
    """Send ``msg`` to ``client``'s events stream."""

    client: str
    msg: ClientEvent


@dataclass(slots=True)
class WorkerMsg(Instruction):
    """Send ``msg`` to ``worker``'s inbox."""

    worker: str
    msg: InboxMessage


@dataclass(slots=True)
class Push(Instruction):
    """Give task ``msg.key`` to ``worker``'s free thread: ``processing`` there in its
    record, into the worker's processing set, and its ``compute-task`` (with the spec,
    copied from the task's record in the same script) into the worker's inbox; and
    ``notify``, the clients its worker's report tells of a small result at once."""

    worker: str
    msg: ComputeTask
    notify: dict[str, int] = field(default_factory=dict)  # the record's (client: seen)


@dataclass(slots=True)
class ForgetClient(Instruction):
    client: str


@dataclass(slots=True)
class ForgetWorker(Instruction):
    worker: str


@dataclass(slots=True)
class ResetCluster(Instruction):
    """Delete every task's record and queue, and the clients' wanted sets."""

    task_keys: list[str]
    workers: list[str]
    clients: list[str]


@dataclass(slots=True)
class ClaimAccepted(Instruction):
    """A worker's claim of a queued task stands.  The claim script wrote it to Redis
    already, so this is a line of the task's story; with ``rewrite``, the task was taken
    out of the ready sets and queued again (the same run, the same score) while the
    claim's message was on its way, which wrote ``queued`` over the claim: write it again,
    or the record says queued and the ready set offers the task a second time."""

    key: str
    worker: str
    rewrite: bool = False


@dataclass(slots=True)
class MarkChain(Instruction):
    """Write the ``chain`` of task ``key``: the dependents that wait on it alone, which
    the worker that finishes it may claim in the same step (``redisdask/scheduler/chain.py``)."""

    key: str
    chain: list[str]


@dataclass(slots=True)
class SetDurations(Instruction):
    """Write the duration averages of these task prefixes (``redisdask/durations.py``),
    which the CLAIM script reads to size claims; None: the prefix's is forgotten."""

    averages: dict[str, float | None]


@dataclass(slots=True)
class LogEvent(Instruction):
    """Append to the cluster's event log (what ``redisdask monitor`` and ``inspect events``
    show): ``worker-joined``, ``worker-left``, ``killed-worker``, ..."""

    kind: str
    fields: dict[str, Any]


@dataclass(slots=True)
class RecordDeath(Instruction):
    """Append a worker's death record (the answer to "why did my worker die?")."""

    record: dict[str, Any]


@dataclass(slots=True)
class RecordRebalance(Instruction):
    """Write to a rebalance's record (``rd:{c}:rebalance:<request>``, see
    ``scheduler.moves``): set ``fields`` (values as stored: str, int or bytes), delete the
    fields in ``drop``; ``done``: the rebalance is over (it leaves the running set and its
    record expires a while after, once its client had time to read it)."""

    request: str
    fields: dict[str, Any] = field(default_factory=dict)
    drop: list[str] = field(default_factory=list)
    done: bool = False
