"""What the scheduler's state machine knows of one task and of one worker
(``TaskState``, ``WorkerInfo``), the stimuli only its driver makes (``RejectedGraph``,
``BadRecord``), and how a task is ranked (``priority_score``).
Kept apart from ``scheduler.state`` so that the readers of these records (the Redis
translator, data moves, diagnostics) need not import the machine.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from redisdask.protocol import Stimulus
from redisdask.spec import key_prefix
from redisdask.store import keyspace

PRIORITY_SCALE = 2**40  # submission sequence numbers stay below this

T = TypeVar("T")
StreamPosition = tuple[int, int]  # a workers stream entry id, ``<ms>-<seq>``, as numbers


def stream_position(entry_id: str) -> StreamPosition | None:
    """The entry id ``"1700000000000-3"`` as ``(1700000000000, 3)``, to be compared with
    another of the same stream; None for anything else."""
    ms, sep, seq = entry_id.partition("-")
    if not (sep and ms.isdigit() and seq.isdigit()):
        return None
    return int(ms), int(seq)


def worker_stream_position(stimulus_id: str) -> StreamPosition | None:
    """Where on the workers stream the message a stimulus id names was written
    (``workers:<entry id>/<i>``, see ``scheduler.translator.decode_entry``); None for a
    stimulus of any other origin (the clients stream, a load, the driver's own)."""
    stream, sep, rest = stimulus_id.partition(":")
    if stream != "workers" or not sep:
        return None
    return stream_position(rest.partition("/")[0])


def other_run(score: Any, ts: TaskState) -> bool:
    """A report or claim about another run of the key than the current one (scores are
    unique per submission: the run's position in submission order).  No score given (NaN,
    or none that reads as a number) is the current run."""
    try:
        value = float(score)
    except (TypeError, ValueError):
        return False
    return value == value and value != ts.score


def priority_score(user_priority: int, seq: int) -> float:
    """Ready-set score: smaller runs first; exact in a double for |priority| < 2**12."""
    return float(-user_priority * PRIORITY_SCALE + seq)


# --------------------------------------------------------------------------- events
# The events that travel (the client, worker and nanny messages) are the message classes
# of ``redisdask.protocol``; only the scheduler's own stimuli are defined here.


@dataclass(slots=True)
class RejectedGraph(Stimulus):
    """The driver refused a client's message (it failed validation and was
    dead-lettered, ``reason`` says why): the client is told that the keys it named will
    not run, instead of waiting forever.  Made by the driver only, never read from a
    stream (so it is in no ``protocol`` registry)."""

    op: ClassVar[str] = "rejected-graph"
    client: str
    keys: list[str] = field(default_factory=list)
    reason: str = ""


@dataclass(slots=True)
class BadRecord(Stimulus):
    """The task record of ``key`` in Redis was malformed (``reason`` says how): the
    driver moved it to the dead-letter stream, and ``load_state`` left a ``released``
    task without a spec in its place.  The task errs (``SchedulerRejectedError``, with
    ``reason``) and so do its dependents that are not done, so that no future waits for
    a task nothing will run.  Made by the driver only, never read from a stream."""

    op: ClassVar[str] = "bad-record"
    key: str
    reason: str = ""


# --------------------------------------------------------------------------- state


EMPTY: frozenset[Any] = frozenset()  # the one empty set of every task that has none


def added(items: AbstractSet[T], item: T) -> set[T]:
    """``items`` with ``item``: the same set, or a new one in place of ``EMPTY``
    (``ts.waiters = added(ts.waiters, dependent)``)."""
    if isinstance(items, set):
        items.add(item)
        return items
    return {*items, item}


def discarded(items: AbstractSet[T], item: T) -> None:
    """Take ``item`` out of ``items`` (``EMPTY`` holds none)."""
    if isinstance(items, set):
        items.discard(item)


@dataclass(slots=True, eq=False)
class TaskState:
    key: str
    state: str = "released"
    prefix: str = field(init=False)  # key_prefix(key): its row in the monitor
    score: float = 0.0
    has_spec: bool = True
    # the sets most tasks leave empty start as the shared ``EMPTY`` (grown by ``added``):
    # fewer objects for the garbage collector to walk, which is most of what it costs
    dependencies: AbstractSet[TaskState] = EMPTY
    dependents: AbstractSet[TaskState] = EMPTY
    waiting_on: AbstractSet[TaskState] = EMPTY  # deps not yet in memory
    waiters: AbstractSet[TaskState] = EMPTY  # dependents that still need us
    who_wants: set[str] = field(default_factory=set)
    who_has: set[str] = field(default_factory=set)
    inline: bool = False  # memory: the result is in its record too (outlives every worker)
    processing_on: str | None = None
    claimed_before: int = 0  # processing: its worker's holding reports read before the claim
    # processing: where its claim's entry is on the workers stream (the record's ``claim``):
    # a worker's word written before it cannot know of the claim
    claimed_at: StreamPosition | None = None
    unlisted: int = 0  # processing: holding reports in a row since then that lacked it
    nbytes: int = 0
    type: str = ""
    retries: int = 0
    restrict: tuple[str, ...] = ()  # worker addresses, names or hosts it may run on
    loose: bool = False  # allow_other_workers: the restriction is a preference
    resources: dict[str, float] | None = None  # what one run holds of a worker's resources
    queued_on: tuple[str, ...] = ()  # queued and placed: the workers whose sets hold it
    sticky: bool = False  # queued, placed by data: waits while its worker is busy (decide)
    chain: tuple[str, ...] = ()  # dependents its worker may claim as it reports it (MarkChain)
    notified: dict[str, int] = field(default_factory=dict)  # pushed: its record's ``notify``
    told: bool = False  # processing: FINISH sent those clients its result (``ClientsTold``)
    # taken out of the ready sets since its last accepted claim: a claim made before that
    # may still be on its way, and what was written since has overwritten it in Redis
    dequeued: bool = False
    suspicious: int = 0  # workers that died while it was processing there
    deaths: tuple[dict[str, Any], ...] = ()  # their death records
    lost_on: str | None = None  # the worker whose death lost its only copy
    # lost because this worker could not fetch it (``missing-data``: the holder may be
    # alive behind a network cut): its recompute is offered there first (not persisted)
    missed_by: str | None = None
    killed: bytes | None = None  # msgpack {task, deaths} when erred with KilledWorker
    replicas: int = 1  # copies wanted on distinct workers (client.replicate)
    replicating: AbstractSet[str] = EMPTY  # workers asked for a copy
    exception: bytes | None = None
    traceback: bytes | None = None
    exception_text: str = ""
    traceback_text: str = ""
    erred_on: str | None = None
    exception_blame: str | None = None  # the task whose error this one inherited
    rejected: bool = False  # erred because the scheduler refused to run it (a cycle)

    def __post_init__(self) -> None:
        self.prefix = key_prefix(self.key)

    def __repr__(self) -> str:
        return f"<TaskState {self.key!r} {self.state}>"

    def holders(self) -> list[str]:
        """Where the result is: its workers and, for a small one, Redis (``REDIS_COPY``)."""
        return [*sorted(self.who_has), keyspace.REDIS_COPY] if self.inline else sorted(self.who_has)

    def __hash__(self) -> int:
        return id(self)


StoryEntry = tuple[str, str, str, str]  # key, start, finish, stimulus_id


@dataclass(slots=True)
class WorkerInfo:
    address: str
    info: dict[str, Any] = field(default_factory=dict)
    processing: set[TaskState] = field(default_factory=set)
    has_what: set[TaskState] = field(default_factory=set)
    retiring: bool = False  # handing its data to others before it closes
    retire_heard: bool = False  # it said itself that it retires: it claims no more
    to_move: set[TaskState] = field(default_factory=set)  # results to copy elsewhere
    retire_clients: set[str] = field(default_factory=set)  # who asked: told if it is stopped
    told_to_close: bool = False  # retired: its data is safe elsewhere
    announced: bool = False  # its worker-joined event was logged
    holding_reports: int = 0  # its holding reports read (since this scheduler loaded)
    no_push: bool = (
        False  # gave a pushed task back since it last claimed (``redisdask.scheduler.push``)
    )
