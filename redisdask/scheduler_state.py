"""The scheduler's pure state machine: events in, instructions out, no I/O inside.

``SchedulerState.handle_stimulus(*events)`` applies events (client submissions, worker
claims and completions, ...) to an in-memory model of every task and returns instructions
for the driver (``redisdask.scheduler``), which turns them into one atomic, fenced Redis
write together with the acknowledgement of the batch that caused them.

Task states::

                 +---------------- erred <------------+-------------+
                 |                   ^                |             |
    released -> waiting ------> queued ------> processing ------> memory
        ^  \\                    (in Redis        (claimed by one
        |   `------------------> ready zset)      worker)
        |
     forgotten  (released, nobody wants it, no dependent left: its history is deleted)

* ``waiting``: some dependency is not in memory yet.
* ``queued``: every dependency is in memory; the key sits in the Redis ready set where
  workers claim it.  The scheduler never pushes: workers pull.
* ``processing``: a worker claimed it (the claim script told us which).
* ``memory``: a worker holds the result; ``who_has`` lists the holders.
* ``erred``: the function raised (after ``retries``), a dependency erred, or the scheduler
  refused to run it (its graph had a cycle).
* ``released``: nobody needs the result now, but a dependent may still need the task's
  graph history to recompute it, so the task (and its spec in Redis) is kept.
* ``no-worker``: ready, but restricted (``workers=``) to workers none of which is alive;
  queued as soon as one of them joins.  A restriction entry names a worker by its
  address, its name, or its host (the host of its address, or the hostname it reported),
  as in Dask; a queued restricted task sits in the own ready set of every live worker it
  matches, including one that joins while it waits.

Priorities: user ``priority=`` first (higher runs first), then submission order.  They
become the score of the Redis ready set, which a worker pops smallest-first.
"""

from __future__ import annotations

import logging
import re
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from redisdask.errors import ProtocolError

logger = logging.getLogger(__name__)

PRIORITY_SCALE = 2**40  # submission sequence numbers stay below this
NO_SCORE = float("nan")  # a report that does not say which run it answers
# states in which a task keeps its dependencies from being released
HOLDS_DEPENDENCIES = ("waiting", "queued", "processing", "no-worker")


_HEX8 = re.compile(r"^[0-9a-f]{8}$")


def key_prefix(key: str) -> str:
    """The group a task key belongs to, as Dask's ``key_split`` finds it: ``"inc"`` for
    ``"inc-5f3a9c..."``, ``"sum-chunk"`` for ``"sum-chunk-00ab12cd"``, ``"x"`` for the text
    of a tuple key ``"('x-1a2b', 0)"``.  The monitor's progress rows are per prefix."""
    words = key.split("-")
    head = words[0]
    if head.startswith("<"):  # "<lambda>", "<function f at 0x...>"
        head = (head.strip("<>").split() or [""])[0].split(".")[-1]
    elif head and not head[0].isalpha():
        head = head.split(",")[0].strip("_'()\" ")
    parts = [head]
    for word in words[1:]:
        if not word.isalpha() or _HEX8.match(word):
            break
        parts.append(word)
    return "-".join(parts) or "other"


def address_host(address: str) -> str:
    """The host of a worker address: ``"127.0.0.1"`` for ``"tcp://127.0.0.1:4242"``."""
    host = address.partition("://")[2].rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def priority_score(user_priority: int, seq: int) -> float:
    """Ready-set score: smaller runs first; exact in a double for |priority| < 2**12."""
    return float(-user_priority * PRIORITY_SCALE + seq)


# --------------------------------------------------------------------------- events


@dataclass(slots=True)
class Event:
    """A stimulus.  ``op`` names it on the wire; ``stimulus_id`` identifies it in stories."""

    op: ClassVar[str] = ""
    stimulus_id: str

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, **asdict(self)}

    @classmethod
    def from_dict(cls, msg: dict[str, Any], stimulus_id: str | None = None) -> Event:
        """Build an event from a decoded stream message, validating its fields."""
        op = msg.get("op")
        event_cls = EVENTS.get(op) if isinstance(op, str) else None
        if event_cls is None:
            raise ProtocolError(f"unknown op {msg.get('op')!r} in message {_preview(msg)}")
        kwargs: dict[str, Any] = {}
        for f in fields(event_cls):
            if f.name == "stimulus_id":
                kwargs[f.name] = stimulus_id or msg.get("stimulus_id") or "replay"
            elif f.name in msg:
                kwargs[f.name] = msg[f.name]
        try:
            event = event_cls(**kwargs)
            event.validate()
        except (TypeError, ValueError) as exc:
            raise ProtocolError(
                f"malformed {event_cls.op!r} message {_preview(msg)}: {exc}"
            ) from exc
        return event

    def validate(self) -> None:
        """Raise ValueError when a field has the wrong type (messages come from strangers)."""
        for f in fields(self):
            value = getattr(self, f.name)
            expected = _FIELD_TYPES.get(f.type if isinstance(f.type, str) else "")
            if expected is not None and not isinstance(value, expected):
                raise ValueError(f"field {f.name!r} should be {f.type}, got {type(value).__name__}")
            items_ok = _ITEM_CHECKS.get(f.type if isinstance(f.type, str) else "")
            if items_ok is not None and not items_ok(value):
                raise ValueError(f"field {f.name!r} should be {f.type}: {_preview(value)}")


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "str": str,
    "bool": bool,
    "int": int,
    "float": (int, float),
    "list[str]": list,
    "list[dict[str, Any]]": list,
    "dict[str, Any]": dict,
    "dict[str, int]": dict,
    "dict[str, list[str]]": dict,
    "bytes | None": (bytes, type(None)),
}


def _is_strs(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(x, str) for x in value)


_ITEM_CHECKS: dict[str, Any] = {
    "list[str]": _is_strs,
    "list[dict[str, Any]]": lambda v: all(isinstance(x, dict) for x in v),
    "dict[str, Any]": lambda v: all(isinstance(k, str) for k in v),
    "dict[str, int]": lambda v: all(
        isinstance(k, str) and isinstance(x, int) for k, x in v.items()
    ),
    "dict[str, list[str]]": lambda v: all(isinstance(k, str) and _is_strs(x) for k, x in v.items()),
}


def _stale(score: float, ts: TaskState) -> bool:
    """A report for another run of the key than the current one (scores are unique per
    submission: the run's position in submission order)."""
    return score == score and score != ts.score  # NaN (no score given) is never stale


def _cycles(roots: list[TaskState], within: set[TaskState]) -> list[list[TaskState]]:
    """The strongly connected components of the dependency graph restricted to
    ``within`` that hold a cycle (several tasks, or one depending on itself), reached from
    ``roots``: Tarjan's algorithm without recursion."""
    index: dict[TaskState, int] = {}
    low: dict[TaskState, int] = {}
    stack: list[TaskState] = []
    on_stack: set[TaskState] = set()
    found: list[list[TaskState]] = []
    for root in roots:
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(root.dependencies))]
        while work:
            ts, deps = work[-1]
            for dep in deps:
                if dep not in within:
                    continue
                if dep not in index:
                    index[dep] = low[dep] = len(index)
                    stack.append(dep)
                    on_stack.add(dep)
                    work.append((dep, iter(dep.dependencies)))
                    break
                if dep in on_stack:
                    low[ts] = min(low[ts], index[dep])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[ts])
                if low[ts] == index[ts]:
                    members = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        members.append(member)
                        if member is ts:
                            break
                    if len(members) > 1 or ts in ts.dependencies:
                        found.append(members)
    return found


def _cycle_text(members: list[TaskState]) -> str:
    """The error of the tasks on a cycle: one cycle through them, shortest first found."""
    inside = set(members)
    start = min(members, key=lambda t: t.key)
    parent: dict[TaskState, TaskState] = {}
    queue = deque([start])
    path: list[TaskState] = []
    while queue and not path:
        ts = queue.popleft()
        for dep in sorted(ts.dependencies & inside, key=lambda t: t.key):
            if dep is start:  # back round: start -> ... -> ts -> start
                path = [ts]
                while path[-1] is not start:
                    path.append(parent[path[-1]])
                path.reverse()
                break
            if dep not in parent:
                parent[dep] = ts
                queue.append(dep)
    others = len(members) - len(path)
    also = f", and {others} more tasks are on cycles with it" if others else ""
    if len(path) == 1:
        return (
            f"SchedulerRejectedError: task {start.key!r} depends on itself, so it can never "
            f"run{also}; fix its dependencies and submit it again"
        )
    names = [repr(t.key) for t in path] + [repr(start.key)]
    if len(names) > 12:
        names = [*names[:10], f"... ({len(names) - 11} more)", names[-1]]
    return (
        "SchedulerRejectedError: the graph has a cycle, so none of its tasks can run: "
        f"{' -> '.join(names)} (each depends on the next){also}; fix the dependencies and "
        "submit the graph again"
    )


def _pack(obj: Any) -> bytes:
    import msgpack

    return msgpack.packb(obj, use_bin_type=True)


def _pack_deaths(ts: TaskState) -> bytes:
    """The structured evidence of a KilledWorker, for ``exc.deaths`` in the client."""
    return _pack({"task": ts.key, "deaths": ts.deaths})


def _preview(msg: Any) -> str:
    text = repr(msg)
    return text if len(text) < 200 else text[:200] + "..."


@dataclass(slots=True)
class UpdateGraph(Event):
    """A client submits tasks.  Each task: {key, spec: bytes|None, deps: [keys],
    priority: int, retries: int}.  ``wanted`` are the keys the client holds futures for."""

    op: ClassVar[str] = "update-graph"
    client: str = ""
    tasks: list[dict[str, Any]] = field(default_factory=list)
    wanted: list[str] = field(default_factory=list)

    def validate(self) -> None:
        Event.validate(self)  # (zero-argument super() does not work in slots dataclasses)
        for t in self.tasks:
            if not isinstance(t.get("key"), str):
                raise ValueError(f"task without a str 'key': {_preview(t)}")
            if not isinstance(t.get("spec"), bytes | None):
                raise ValueError(f"task {t['key']!r}: 'spec' should be bytes or None")
            if not _is_strs(t.get("deps", [])):
                raise ValueError(f"task {t['key']!r}: 'deps' should be a list of str")
            for name in ("priority", "retries"):
                if not isinstance(t.get(name, 0), int):
                    raise ValueError(f"task {t['key']!r}: {name!r} should be int")
            if not _is_strs(t.get("workers") or []):
                raise ValueError(f"task {t['key']!r}: 'workers' should be a list of str")


@dataclass(slots=True)
class RejectedGraph(Event):
    """The driver refused a client's message (it failed validation and was
    dead-lettered, ``reason`` says why): the client is told that the keys it named will
    not run, instead of waiting forever.  Made by the driver only, never read from a
    stream (so it is not in ``EVENTS``)."""

    op: ClassVar[str] = "rejected-graph"
    client: str = ""
    keys: list[str] = field(default_factory=list)
    reason: str = ""


@dataclass(slots=True)
class ClientDesiresKeys(Event):
    op: ClassVar[str] = "client-desires-keys"
    client: str = ""
    keys: list[str] = field(default_factory=list)


@dataclass(slots=True)
class ClientReleasesKeys(Event):
    op: ClassVar[str] = "client-releases-keys"
    client: str = ""
    keys: list[str] = field(default_factory=list)


@dataclass(slots=True)
class CancelKeys(Event):
    op: ClassVar[str] = "cancel-keys"
    client: str = ""
    keys: list[str] = field(default_factory=list)
    generation: int = 0  # the client's submission counter, echoed in cancelled-keys


@dataclass(slots=True)
class CloseClient(Event):
    op: ClassVar[str] = "close-client"
    client: str = ""


@dataclass(slots=True)
class UpdateData(Event):
    """A client scattered data straight to workers: who_has {key: [worker]}."""

    op: ClassVar[str] = "update-data"
    client: str = ""
    who_has: dict[str, list[str]] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    types: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class AddWorker(Event):
    """A worker (re)joins.  After losing Redis it sends ``resync``: the keys it holds
    ``{"keys": {key: nbytes}}`` and the claimed tasks it still has
    ``{"processing": [key]}``, so the scheduler can reconcile what Redis forgot."""

    op: ClassVar[str] = "add-worker"
    worker: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    resync: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RemoveWorker(Event):
    """A worker is gone.  ``how``: ``goodbye`` (it left on its own: nothing is blamed),
    ``connection`` (its Redis connections closed), ``heartbeat`` (its heartbeat expired) or
    ``nanny`` (its nanny saw it die) or ``replaced`` (a new process registered at its
    address before its death was noticed).  ``evidence``: what is known of its last moments (the
    last heartbeat; a nanny adds exit code, signal, memory, log tail)."""

    op: ClassVar[str] = "remove-worker"
    worker: str = ""
    reason: str = ""
    how: str = "goodbye"
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class TaskClaimed(Event):
    """Written by the CLAIM script; ``scores`` say which run of each key was popped."""

    op: ClassVar[str] = "claimed"
    worker: str = ""
    keys: list[str] = field(default_factory=list)
    scores: list[Any] = field(default_factory=list)


@dataclass(slots=True)
class Holding(Event):
    """A worker's periodic word on the claimed tasks it has not finished: ``keys``, of
    the tasks it claimed before its previous holding report (the workers stream orders
    the reports, claims and results exactly; see the worker's ``_report_holding``).  A
    task processing there that two reports in a row do not list is queued again: its
    claim's reply never reached the worker (Redis died in between)."""

    op: ClassVar[str] = "holding"
    worker: str = ""
    keys: list[str] = field(default_factory=list)


@dataclass(slots=True)
class TaskFinished(Event):
    op: ClassVar[str] = "task-finished"
    worker: str = ""
    key: str = ""
    nbytes: int = 0
    type: str = ""
    start: float = 0.0
    stop: float = 0.0
    score: float = NO_SCORE  # the run it answers (a task's score is new at each submission)


@dataclass(slots=True)
class TaskErred(Event):
    op: ClassVar[str] = "task-erred"
    worker: str = ""
    key: str = ""
    exception: bytes | None = None
    traceback: bytes | None = None
    exception_text: str = ""
    traceback_text: str = ""
    score: float = NO_SCORE


@dataclass(slots=True)
class MissingData(Event):
    """A worker could not get ``keys`` from ``errant_worker`` (or from anyone)."""

    op: ClassVar[str] = "missing-data"
    worker: str = ""
    keys: list[str] = field(default_factory=list)
    errant_worker: str = ""


@dataclass(slots=True)
class AddKeys(Event):
    op: ClassVar[str] = "add-keys"
    worker: str = ""
    keys: list[str] = field(default_factory=list)
    nbytes: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class ReleasedKeys(Event):
    """A worker dropped ``keys`` (e.g. a cancelled task's late result)."""

    op: ClassVar[str] = "released-keys"
    worker: str = ""
    keys: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Restart(Event):
    """A client restarts the cluster: every task is forgotten, every future cancelled,
    every worker drops what it holds."""

    op: ClassVar[str] = "restart"
    client: str = ""


@dataclass(slots=True)
class Replicate(Event):
    """A client asks for ``n`` copies of each of ``keys`` on distinct workers, kept after
    a loss while a copy survives."""

    op: ClassVar[str] = "replicate"
    client: str = ""
    keys: list[str] = field(default_factory=list)
    n: int = 2


@dataclass(slots=True)
class RetireWorkers(Event):
    """Workers leave gracefully.  They stop claiming, hand back the tasks they claimed but
    did not start, finish the ones running, and stay until every result that only they
    hold has a copy on a worker that stays; then the scheduler tells them to close.

    A client's request (``client`` set) that would lose data because no worker would stay
    is refused (``retire-refused``).  A retiring worker repeats the request about itself
    every second until it is told to close (``client`` empty): that says it claims no
    more (every claim it made is ahead of it on the workers stream), re-asks for copies
    nobody delivered, and lets a restarted scheduler resume.  ``force`` (its lifetime
    ended, it got SIGTERM): it leaves anyway, so with no worker staying it is told to
    close at once (what it held is then recomputed from the graph history); otherwise
    it waits for a worker to join."""

    op: ClassVar[str] = "retire-workers"
    client: str = ""
    workers: list[str] = field(default_factory=list)
    force: bool = False


EVENTS: dict[str, type[Event]] = {
    cls.op: cls
    for cls in (
        UpdateGraph, ClientDesiresKeys, ClientReleasesKeys, CancelKeys, CloseClient,
        UpdateData, AddWorker, RemoveWorker, TaskClaimed, TaskFinished, TaskErred,
        MissingData, AddKeys, ReleasedKeys, Replicate, Restart, RetireWorkers, Holding,
    )
}  # fmt: skip


# --------------------------------------------------------------------------- instructions


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


@dataclass(slots=True)
class SetState(Instruction):
    """Record a task's new state (and any extra fields) in its Redis hash."""

    key: str
    state: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Enqueue(Instruction):
    """Put a task in the ready set, or in the listed workers' own ready sets.
    ``queued_on``: every worker whose ready set holds it after this one (those listed and
    those it was in already), for the task hash, where the CLAIM script reads it."""

    key: str
    score: float
    workers: tuple[str, ...] = ()
    queued_on: tuple[str, ...] = ()


@dataclass(slots=True)
class Dequeue(Instruction):
    key: str
    workers: tuple[str, ...] = ()


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
    client: str
    msg: dict[str, Any]


@dataclass(slots=True)
class WorkerMsg(Instruction):
    worker: str
    msg: dict[str, Any]


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
    """A worker's claim of a queued task stands (the claim script already wrote it to
    Redis): nothing to write, a line of the task's story."""

    key: str
    worker: str


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


# --------------------------------------------------------------------------- state


@dataclass(slots=True, eq=False)
class TaskState:
    key: str
    state: str = "released"
    prefix: str = field(init=False)  # key_prefix(key): its row in the monitor
    score: float = 0.0
    has_spec: bool = True
    dependencies: set[TaskState] = field(default_factory=set)
    dependents: set[TaskState] = field(default_factory=set)
    waiting_on: set[TaskState] = field(default_factory=set)  # deps not yet in memory
    waiters: set[TaskState] = field(default_factory=set)  # dependents that still need us
    who_wants: set[str] = field(default_factory=set)
    who_has: set[str] = field(default_factory=set)
    processing_on: str | None = None
    claimed_before: int = 0  # processing: its worker's holding reports read before the claim
    unlisted: int = 0  # processing: holding reports in a row since then that lacked it
    nbytes: int = 0
    type: str = ""
    retries: int = 0
    restrict: tuple[str, ...] = ()  # worker addresses, names or hosts it may run on
    queued_on: tuple[str, ...] = ()  # queued and restricted: the workers whose sets hold it
    suspicious: int = 0  # workers that died while it was processing there
    deaths: list[dict[str, Any]] = field(default_factory=list)  # their death records
    lost_on: str | None = None  # the worker whose death lost its only copy
    killed: bytes | None = None  # msgpack {task, deaths} when erred with KilledWorker
    replicas: int = 1  # copies wanted on distinct workers (client.replicate)
    replicating: set[str] = field(default_factory=set)  # workers asked for a copy
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

    def __hash__(self) -> int:
        return id(self)


@dataclass(slots=True)
class WorkerInfo:
    address: str
    info: dict[str, Any] = field(default_factory=dict)
    processing: set[TaskState] = field(default_factory=set)
    has_what: set[TaskState] = field(default_factory=set)
    retiring: bool = False  # handing its data to others before it closes
    retire_heard: bool = False  # it said itself that it retires: it claims no more
    to_move: set[TaskState] = field(default_factory=set)  # results to copy elsewhere
    told_to_close: bool = False  # retired: its data is safe elsewhere
    announced: bool = False  # its worker-joined event was logged
    holding_reports: int = 0  # its holding reports read (since this scheduler loaded)


class InvalidTransition(RuntimeError):
    pass


class SchedulerState:
    """Every task, worker and client the scheduler knows, and the rules between them."""

    def __init__(self, validate: bool = False, seq: int = 0, allowed_failures: int = 3) -> None:
        self.allowed_failures = allowed_failures
        self.tasks: dict[str, TaskState] = {}
        self.workers: dict[str, WorkerInfo] = {}
        self.clients: dict[str, set[TaskState]] = {}  # client id -> tasks it wants
        self.unrunnable: set[TaskState] = set()  # state no-worker
        self.seq = seq
        self.validate = validate
        self._instructions: list[Instruction] = []
        self._candidates: deque[TaskState] = deque()
        self._stimulus_id = ""
        self._retirement_changed = False  # something a retirement waits for happened
        self._aliases: dict[str, set[str]] | None = None  # address/name/host -> addresses
        # results that came in and tasks that erred, since this state was built (metrics
        # for the summary the monitor shows)
        self.n_finished = 0
        self.n_erred = 0
        self._transitions = {
            ("released", "waiting"): self._transition_released_waiting,
            ("waiting", "queued"): self._transition_waiting_queued,
            ("queued", "waiting"): self._transition_queued_waiting,
            ("processing", "waiting"): self._transition_processing_waiting,
            ("no-worker", "waiting"): self._transition_no_worker_waiting,
            ("no-worker", "queued"): self._transition_no_worker_queued,
            ("queued", "no-worker"): self._transition_queued_no_worker,
            ("no-worker", "released"): self._transition_no_worker_released,
            ("queued", "processing"): self._transition_queued_processing,
            ("queued", "memory"): self._transition_processing_memory,
            ("processing", "memory"): self._transition_processing_memory,
            ("processing", "queued"): self._transition_processing_queued,
            ("processing", "erred"): self._transition_processing_erred,
            ("waiting", "erred"): self._transition_waiting_erred,
            ("waiting", "released"): self._transition_waiting_released,
            ("queued", "released"): self._transition_queued_released,
            ("processing", "released"): self._transition_processing_released,
            ("memory", "released"): self._transition_memory_released,
            ("erred", "released"): self._transition_erred_released,
            ("released", "forgotten"): self._transition_released_forgotten,
        }

    # ------------------------------------------------------------------ entry point

    def handle_stimulus(self, *events: Event) -> list[Instruction]:
        for event in events:
            self._stimulus_id = event.stimulus_id
            handler = getattr(self, "_handle_" + event.op.replace("-", "_"))
            handler(event)
            self._drain()
        if self._retirement_changed:
            self._retirement_changed = False
            self._move_retiring_data()
        instructions, self._instructions = self._instructions, []
        if self.validate:
            self.validate_state()
        return instructions

    def _emit(self, instruction: Instruction) -> None:
        self._instructions.append(instruction)

    # ------------------------------------------------------------------ client events

    def _handle_update_graph(self, ev: UpdateGraph) -> None:
        self.clients.setdefault(ev.client, set())
        new: list[TaskState] = []
        stores: dict[str, StoreTask] = {}  # new tasks' records, written once deps are known
        deps_of: dict[str, list[str]] = {}
        for spec in ev.tasks:
            # (a key named twice in one message: its first entry counts, as for its record)
            deps_of.setdefault(spec["key"], list(spec.get("deps", ())))
            key = spec["key"]
            ts = self.tasks.get(key)
            if ts is None:
                self.seq += 1
                ts = TaskState(
                    key,
                    score=priority_score(int(spec.get("priority", 0)), self.seq),
                    retries=int(spec.get("retries", 0)),
                    restrict=tuple(spec.get("workers") or ()),
                )
                self.tasks[key] = ts
                new.append(ts)
                stores[key] = StoreTask(
                    ev.stimulus_id,
                    key,
                    spec.get("spec"),
                    list(spec.get("deps", ())),
                    ts.score,
                    "released",
                    ts.retries,
                    ts.restrict,
                )
            elif ts.state == "released" and not ts.who_has and spec.get("spec") is not None:
                new.append(ts)  # resubmitted after release: recompute
        grown: list[TaskState] = []  # tasks given dependencies they did not have
        for ts in new:
            for dep_key in deps_of[ts.key]:
                dep = self.tasks.get(dep_key)
                if dep is None:
                    # a dependency nobody submitted: treat as lost data
                    dep = self.tasks[dep_key] = TaskState(dep_key, has_spec=False)
                    self._emit(StoreTask(ev.stimulus_id, dep_key, None, [], 0.0, "released"))
                if dep not in ts.dependencies:
                    if not grown or grown[-1] is not ts:
                        grown.append(ts)
                    ts.dependencies.add(dep)
                    dep.dependents.add(ts)
        refused = self._cut_cycles(grown, {self.tasks[key] for key in stores})
        for ts in refused:
            if ts.key in stores:
                stores[ts.key].deps = []  # what it kept: nothing
        for store in stores.values():
            self._emit(store)
        for ts in grown:  # an older task given dependencies it did not have: record them
            if ts.key not in stores:
                deps = sorted(d.key for d in ts.dependencies)
                self._emit(SetState(ev.stimulus_id, ts.key, ts.state, {"deps": deps}))
        for ts, text in refused.items():
            self._refuse(ts, text)
        self._add_wants(ev.client, ev.wanted)
        # a task runs if someone wants it or a wanted task needs it
        for key in ev.wanted:
            ts = self.tasks.get(key)
            if ts is not None:
                self._make_needed(ts)
        for ts in new:  # submitted, but neither wanted nor needed by a wanted task
            self._maybe_forget(ts)

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
        for members in _cycles(grown, within):
            text = _cycle_text(members)
            for ts in sorted(cut.intersection(members), key=lambda t: t.key):
                for dep in ts.dependencies:
                    dep.dependents.discard(ts)
                ts.dependencies.clear()
                refused[ts] = text
        return refused

    def _refuse(self, ts: TaskState, text: str) -> None:
        """Err a task the scheduler will not run; the client raises SchedulerRejectedError."""
        ts.exception = ts.traceback = None
        ts.exception_text, ts.traceback_text = text, ""
        ts.exception_blame = ts.erred_on = None
        ts.rejected = True
        self._transition_waiting_erred(ts)

    def _handle_rejected_graph(self, ev: RejectedGraph) -> None:
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
            msg = {"op": "task-erred", "key": key, "exception_text": text, "rejected": True}
            self._emit(ClientMsg(ev.stimulus_id, ev.client, msg))

    def _make_needed(self, root: TaskState) -> None:
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
                    self._err_lost(ts)
                else:
                    self._transition(ts, "waiting")
            for dep in ts.dependencies:
                if ts.state in HOLDS_DEPENDENCIES:
                    dep.waiters.add(ts)

    def _err_lost(self, ts: TaskState) -> None:
        if ts.lost_on:
            ts.exception_text = (
                f"DataUnavailableError: {ts.key!r} was scattered data whose only copy was on "
                f"{ts.lost_on}, which died; scattered data has no task to recompute it. Keep "
                "copies on several workers with client.replicate(futures, n=2), or compute "
                "the data in a task instead of scattering it"
            )
        else:
            ts.exception_text = (
                f"DataUnavailableError: the data of {ts.key!r} is not on any worker and it "
                "has no task to recompute it (was it scattered by a client that is gone?)"
            )
        # like an error: tell who wants it, and err every dependent waiting on it
        self._transition_waiting_erred(ts)

    def _lost_data(self, ts: TaskState) -> None:
        """The last copy of a task in memory is gone: its dependents wait for it again,
        and it is recomputed (or, without a task to recompute it, errs) if still needed."""
        ts.state = "released"
        ts.replicating.clear()
        self._emit(SetState(self._stimulus_id, ts.key, "released", {"who_has": b""}))
        for dependent in sorted(ts.waiters, key=lambda t: t.score):
            if dependent.state in ("queued", "processing", "no-worker"):
                # a worker that claimed it cannot get the data now: take the task back
                self._transition(dependent, "waiting")
            elif dependent.state == "waiting":
                dependent.waiting_on.add(ts)
        if ts.who_wants or ts.waiters:
            self._make_needed(ts)
        else:
            self._maybe_forget(ts)

    def _add_wants(self, client: str, keys: Iterable[str]) -> None:
        added = []
        wanted = self.clients.setdefault(client, set())
        for key in keys:
            ts = self.tasks.get(key)
            if ts is None or client in ts.who_wants:
                if ts is not None:
                    self._report_to(client, ts)
                continue
            ts.who_wants.add(client)
            wanted.add(ts)
            added.append(key)
            self._report_to(client, ts)
        if added:
            self._emit(SetWants(self._stimulus_id, client, add=added))

    def _report_to(self, client: str, ts: TaskState) -> None:
        """Tell a client about a finished task it just asked for."""
        if ts.state == "memory":
            self._emit(ClientMsg(self._stimulus_id, client, self._memory_msg(ts)))
        elif ts.state == "erred":
            self._emit(ClientMsg(self._stimulus_id, client, self._erred_msg(ts)))

    def _handle_client_desires_keys(self, ev: ClientDesiresKeys) -> None:
        self._add_wants(ev.client, ev.keys)
        for key in ev.keys:
            if key in self.tasks:
                self._make_needed(self.tasks[key])

    def _handle_client_releases_keys(self, ev: ClientReleasesKeys) -> None:
        self._release_wants(ev.client, ev.keys)

    def _release_wants(self, client: str, keys: Iterable[str]) -> list[str]:
        wanted = self.clients.get(client, set())
        removed = []
        for key in keys:
            ts = self.tasks.get(key)
            if ts is None or client not in ts.who_wants:
                continue
            ts.who_wants.discard(client)
            wanted.discard(ts)
            removed.append(key)
            self._maybe_release(ts)
        if removed:
            self._emit(SetWants(self._stimulus_id, client, remove=removed))
        return removed

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
        self._release_wants(ev.client, keys)
        self._emit(
            ClientMsg(
                self._stimulus_id,
                ev.client,
                {"op": "cancelled-keys", "keys": keys, "generation": ev.generation},
            )
        )

    def _handle_restart(self, ev: Restart) -> None:
        keys = list(self.tasks)
        clients = list(self.clients)
        self._emit(ResetCluster(ev.stimulus_id, keys, list(self.workers), clients))
        for ws in self.workers.values():
            ws.processing.clear()
            ws.has_what.clear()
            self._emit(WorkerMsg(ev.stimulus_id, ws.address, {"op": "restart"}))
        for client in clients:
            self._emit(ClientMsg(ev.stimulus_id, client, {"op": "restarted", "by": ev.client}))
        self.tasks.clear()
        self.unrunnable.clear()
        self._candidates.clear()
        self.clients = {client: set() for client in clients}

    def _handle_close_client(self, ev: CloseClient) -> None:
        self._release_wants(ev.client, [ts.key for ts in self.clients.get(ev.client, ())])
        self.clients.pop(ev.client, None)
        self._emit(ForgetClient(ev.stimulus_id, ev.client))

    def _handle_update_data(self, ev: UpdateData) -> None:
        recorded: dict[str, list[str]] = {}  # worker -> keys it now holds for us
        for key, holders in ev.who_has.items():
            ts = self.tasks.get(key)
            if ts is None:
                self.seq += 1
                ts = self.tasks[key] = TaskState(key, has_spec=False)
                self._emit(StoreTask(ev.stimulus_id, key, None, [], 0.0, "released"))
            elif ts.state in ("waiting", "queued", "processing", "no-worker", "erred"):
                if ts.erred_on in holders:  # the value put there replaced its failed run:
                    ts.erred_on = None  # no free-keys for it
                self._transition(ts, "released")  # the scattered data replaces the task's run
            ts.nbytes = int(ev.nbytes.get(key, 0))
            ts.type = str(ev.types.get(key, ""))
            for worker in holders:
                self._add_replica(ts, worker)
                if worker in self.workers:
                    recorded.setdefault(worker, []).append(key)
            # (also when it was in memory already: its new holders and size are recorded)
            self._emit(SetState(ev.stimulus_id, key, "memory", self._memory_fields(ts)))
            if ts.state != "memory":
                ts.state = "memory"
                self._wake_waiters(ts)
        # the data reached the workers over TCP, before this message; a free-keys this
        # scheduler sent them earlier (for a released copy of the same key) may reach them
        # after it: this tells them which free-keys are about the new copies
        for worker, keys in recorded.items():
            self._emit(WorkerMsg(ev.stimulus_id, worker, {"op": "keys-recorded", "keys": keys}))
        self._add_wants(ev.client, list(ev.who_has))

    # ------------------------------------------------------------------ worker events

    def _handle_add_worker(self, ev: AddWorker) -> None:
        known = self.workers.get(ev.worker)
        started = ev.info.get("started")
        if known is not None and started and known.info.get("started") not in (None, started):
            # a new process at the address of one that is gone (its port was reused before
            # anyone noticed the death): what the old one held and ran is lost
            self._handle_remove_worker(
                RemoveWorker(
                    ev.stimulus_id,
                    worker=ev.worker,
                    how="replaced",
                    reason="a new worker process registered at its address (port reused)",
                )
            )
        if ev.worker not in self.workers:
            self.workers[ev.worker] = WorkerInfo(ev.worker, dict(ev.info))
        else:
            self.workers[ev.worker].info.update(ev.info)
        self._aliases = None  # its name or host may be new
        ws = self.workers[ev.worker]
        if ev.stimulus_id != "load" and not ws.announced:
            # (a worker that registered before this scheduler loaded is announced when its
            # add-worker message is read)
            ws.announced = True
            shown = ("name", "host", "nthreads", "memory_limit", "restarts")
            fields = {k: ev.info[k] for k in shown if ev.info.get(k) is not None}
            self._emit(LogEvent(ev.stimulus_id, "worker-joined", {"worker": ev.worker, **fields}))
        self._retirement_changed = True  # somewhere new to put a retiring worker's data
        if ev.resync:
            self._resync(self.workers[ev.worker], ev.resync)
        for ts in sorted(self.unrunnable, key=lambda t: t.score):
            if ev.worker in self._allowed(ts):
                self._transition(ts, "queued")
        for ts in self.tasks.values():  # queued for others it matches too: for it as well
            if ts.state != "queued" or not ts.restrict or ev.worker in ts.queued_on:
                continue
            if ev.worker in self._allowed(ts):
                ts.queued_on += (ev.worker,)
                enqueue = Enqueue(ev.stimulus_id, ts.key, ts.score, (ev.worker,), ts.queued_on)
                self._emit(enqueue)

    def _resync(self, ws: WorkerInfo, report: dict[str, Any]) -> None:
        """Reconcile with what a worker says it holds and runs (after Redis lost writes:
        a report, a claim, a release).  The worker's word wins about itself."""
        held = {str(k): int(n) for k, n in dict(report.get("keys", {})).items()}
        running = {str(k) for k in report.get("processing", [])}
        for ts in sorted(ws.processing, key=lambda t: t.score):
            if ts.key in held:  # it finished; the report was lost
                ts.nbytes = held[ts.key]
                self._transition(ts, "memory", worker=ws)
            elif ts.key not in running:  # it does not know the task: queue it again
                self._queue_again(ws, ts)
        stray = []
        for key in held:
            ts = self.tasks.get(key)
            if ts is not None and ts.state == "memory":
                if ws.address not in ts.who_has:
                    self._add_replica(ts, ws.address)
                    self._emit(SetState(self._stimulus_id, key, "memory", self._memory_fields(ts)))
            elif ts is None or ts.processing_on != ws.address:
                stray.append(key)
        for key in running:
            ts = self.tasks.get(key)
            if ts is None or ts.processing_on != ws.address:
                stray.append(key)  # claimed in a Redis that forgot it: someone else's now
        if stray:
            self._emit(
                WorkerMsg(
                    self._stimulus_id, ws.address, {"op": "free-keys", "keys": sorted(set(stray))}
                )
            )

    def _handle_holding(self, ev: Holding) -> None:
        ws = self.workers.get(ev.worker)
        if ws is None:
            return
        listed = set(ev.keys)
        read_before = ws.holding_reports
        ws.holding_reports += 1
        lost = []
        for ts in ws.processing:
            if ts.key in listed:
                ts.unlisted = 0
            elif ts.claimed_before < read_before:  # claimed before the worker's previous
                ts.unlisted += 1  # report, so this one would list it if it had it
                if ts.unlisted >= 2:
                    lost.append(ts)
        for ts in sorted(lost, key=lambda t: t.score):
            self._emit(
                LogEvent(ev.stimulus_id, "lost-claim", {"key": ts.key, "worker": ws.address})
            )
            self._queue_again(ws, ts)

    def _queue_again(self, ws: WorkerInfo, ts: TaskState) -> None:
        """A task processing on a worker that does not know it: queue it again."""
        ts.processing_on = None
        ws.processing.discard(ts)
        self._emit(Unclaim(self._stimulus_id, ws.address, ts.key))
        self._transition(ts, "queued")

    def _handle_remove_worker(self, ev: RemoveWorker) -> None:
        ws = self.workers.pop(ev.worker, None)
        self._aliases = None
        if ws is None:
            if ev.how == "nanny":  # removed already (say, its heartbeat expired first):
                # the nanny's word on why it ended is still the record worth keeping
                known = ("name", "host", "pid")
                gone = WorkerInfo(ev.worker, {k: ev.evidence.get(k) for k in known})
                self._emit(RecordDeath(ev.stimulus_id, self._death_record(ev, gone, [])))
            return
        self._retirement_changed = True  # a copy it held or was fetching may be gone
        for other in self.workers.values():
            if other.retiring:
                other.to_move |= ws.has_what & other.has_what
        died = ev.how != "goodbye"
        processing = sorted(ws.processing, key=lambda t: t.score)
        if died:
            record = self._death_record(ev, ws, processing)
            self._emit(RecordDeath(ev.stimulus_id, record))
        else:
            fields = {"worker": ws.address, "name": ws.info.get("name"), "reason": ev.reason}
            self._emit(LogEvent(ev.stimulus_id, "worker-left", fields))
        for ts in processing:
            ts.processing_on = None
            self._emit(Unclaim(ev.stimulus_id, ws.address, ts.key))
            if died:
                ts.suspicious += 1
                ts.deaths.append(record)
            if died and ts.suspicious > self.allowed_failures:
                self._kill(ts)
            else:
                if died:
                    fields = {"suspicious": ts.suspicious, "deaths": _pack(ts.deaths)}
                    self._emit(SetState(ev.stimulus_id, ts.key, "processing", fields))
                self._transition(ts, "queued")
        for ts in list(ws.has_what):
            ts.who_has.discard(ws.address)
            if not ts.who_has and ts.state == "memory":
                # lost its only copy: recompute if still needed
                ts.lost_on = ws.address
                self._lost_data(ts)
            elif ts.state == "memory":
                self._emit(SetState(ev.stimulus_id, ts.key, "memory", self._memory_fields(ts)))
                if ts.replicas > 1:
                    self._ensure_replicas(ts)  # a copy survives: make up for the lost one
        for ts in list(self.tasks.values()):
            if ts.state == "queued" and ws.address in ts.queued_on:
                # out of its ready set (which a new process at the address would
                # inherit): the task goes there again only if that one matches too
                self._emit(Dequeue(ev.stimulus_id, ts.key, (ws.address,)))
                ts.queued_on = tuple(w for w in ts.queued_on if w != ws.address)
                if not self._allowed(ts):
                    self._transition(ts, "no-worker")
        if ev.how != "replaced":  # else the keys are the new process's, at the same address
            self._emit(ForgetWorker(ev.stimulus_id, ws.address))

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

    def _kill(self, ts: TaskState) -> None:
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
        self._emit(LogEvent(self._stimulus_id, "killed-worker", fields))
        ts.state = "processing"  # funnel through the one erred transition
        self._transition_waiting_erred(ts)

    def _handle_claimed(self, ev: TaskClaimed) -> None:
        ws = self.workers.get(ev.worker)
        scores = list(ev.scores) + [NO_SCORE] * (len(ev.keys) - len(ev.scores))
        for key, score in zip(ev.keys, scores, strict=False):
            ts = self.tasks.get(key)
            try:
                stale = ts is not None and _stale(float(score), ts)
            except (TypeError, ValueError):
                stale = False
            if stale:
                # an earlier run of the key, popped just before it was cancelled.  No
                # free-keys: the worker may hold or run the current run of the key by the
                # time it reads it, and a free-keys cannot say which run it means
                self._emit(Unclaim(ev.stimulus_id, ev.worker, key))
                continue
            if ts is not None and ts.state == "processing" and ts.processing_on == ev.worker:
                # state reloaded from Redis after the claim: already known (and from
                # here on in the stream, its worker's holding reports account for it)
                if ws is not None:
                    ts.claimed_before = ws.holding_reports
                continue
            if ts is None or ts.state != "queued" or ws is None:
                # released while the claim was in flight: tell the worker to drop it
                self._emit(Unclaim(ev.stimulus_id, ev.worker, key))
                self._free(ev.worker, key)
                if ts is not None and ts.state == "queued":
                    # claimed by a worker removed meanwhile: the claim popped it from the
                    # ready set and marked it processing in Redis; put it back
                    self._emit(SetState(ev.stimulus_id, key, "queued"))
                    self._enqueue(ts)
                continue
            self._transition(ts, "processing", worker=ws)

    def _handle_task_finished(self, ev: TaskFinished) -> None:
        ts = self.tasks.get(ev.key)
        ws = self.workers.get(ev.worker)
        if ts is not None and _stale(ev.score, ts):
            return  # a result of an earlier run of this key, reported late: not this run's
        if ts is None or ws is None or ts.state != "processing" or ts.processing_on != ws.address:
            # a result nobody asked this worker for: a run of an earlier incarnation of the
            # key (cancelled, released, submitted again) or of a claim taken back.  Counting
            # it would name a holder that is about to drop it; let it drop it now.
            if ts is None or ev.worker not in ts.who_has:
                self._free(ev.worker, ev.key)
            return
        ts.nbytes, ts.type = int(ev.nbytes), ev.type
        self._transition(ts, "memory", worker=ws)

    def _handle_task_erred(self, ev: TaskErred) -> None:
        ts = self.tasks.get(ev.key)
        if ts is None or ts.state != "processing" or ts.processing_on != ev.worker:
            return
        if _stale(ev.score, ts):
            return
        self._emit(Unclaim(ev.stimulus_id, ev.worker, ts.key))
        if ts.retries > 0:
            ts.retries -= 1
            self._emit(SetState(ev.stimulus_id, ts.key, ts.state, {"retries": ts.retries}))
            # the worker keeps the failed run until told: it must not answer the retry
            # with it (the free-keys reaches it before any claim of the retry)
            self._free(ev.worker, ts.key)
            self._transition(ts, "queued")
            return
        ts.exception, ts.traceback = ev.exception, ev.traceback
        ts.exception_text, ts.traceback_text = ev.exception_text, ev.traceback_text
        ts.erred_on = ev.worker
        self._transition(ts, "erred")

    def _handle_missing_data(self, ev: MissingData) -> None:
        for key in ev.keys:
            ts = self.tasks.get(key)
            if ts is None:
                continue
            if ev.worker in ts.replicating:  # a copy that did not come: ask again
                ts.replicating.discard(ev.worker)
                self._retirement_changed = True
            errant = self.workers.get(ev.errant_worker)
            # a retiring holder is alive and keeps its data until it is told to close: a
            # failed fetch from it is taken for a passing network failure
            trusted = errant is not None and errant.retiring
            if ev.errant_worker in ts.who_has and not trusted:
                ts.who_has.discard(ev.errant_worker)
                ws = self.workers.get(ev.errant_worker)
                if ws is not None:
                    # no longer counted as a holder: it must not keep an orphan copy
                    ws.has_what.discard(ts)
                    self._free(ws.address, key)
            if ev.worker in ts.who_has:
                # it misses a key counted as held by itself: its copy is gone (answering
                # with its own address would leave its dependents waiting for ever)
                ts.who_has.discard(ev.worker)
                reporter = self.workers.get(ev.worker)
                if reporter is not None:
                    reporter.has_what.discard(ts)
            if ts.state == "memory" and ts.who_has:
                self._emit(SetState(ev.stimulus_id, key, "memory", self._memory_fields(ts)))
                self._emit(
                    WorkerMsg(
                        ev.stimulus_id,
                        ev.worker,
                        {"op": "who-has", "who_has": {key: sorted(ts.who_has)}},
                    )
                )
            elif ts.state == "memory":
                self._lost_data(ts)

    def _handle_add_keys(self, ev: AddKeys) -> None:
        self._retirement_changed = True
        for key in ev.keys:
            ts = self.tasks.get(key)
            if ts is not None:
                ts.replicating.discard(ev.worker)
            if ts is not None and ts.state == "memory" and ev.worker in self.workers:
                self._add_replica(ts, ev.worker)
                self._emit(SetState(ev.stimulus_id, key, "memory", self._memory_fields(ts)))

    def _handle_replicate(self, ev: Replicate) -> None:
        for key in ev.keys:
            ts = self.tasks.get(key)
            if ts is None or ts.state != "memory":
                continue
            ts.replicas = max(1, int(ev.n))
            self._emit(SetState(ev.stimulus_id, key, "memory", {"replicas": ts.replicas}))
            self._ensure_replicas(ts)

    def _handle_retire_workers(self, ev: RetireWorkers) -> None:
        leaving = [self.workers[a] for a in dict.fromkeys(ev.workers) if a in self.workers]
        staying = [a for a, ws in self.workers.items() if not ws.retiring and a not in ev.workers]
        if ev.client and not staying and any(ws.has_what or ws.processing for ws in leaving):
            held = len(set().union(*(ws.has_what | ws.processing for ws in leaving)))
            reason = (
                f"no worker would stay to take the {held} results they hold or compute; "
                "start more workers first, or retire fewer"
            )
            msg = {"op": "retire-refused", "workers": [ws.address for ws in leaving]}
            self._emit(ClientMsg(ev.stimulus_id, ev.client, {**msg, "reason": reason}))
            return
        self._retirement_changed = True
        for ws in leaving:
            if not ws.retiring and ev.client:
                self._emit(WorkerMsg(ev.stimulus_id, ws.address, {"op": "retire"}))
            if not ws.retiring:
                ws.retiring = True
                ws.to_move = set(ws.has_what)
            if ev.client:
                continue
            # the worker's own word: it claims no more; repeated every second, it
            # re-asks for the copies that have not arrived and for the close it missed
            ws.retire_heard, ws.told_to_close = True, False
            for ts in ws.to_move:
                ts.replicating.clear()
            if ev.force and not staying:
                self._tell_to_close(ws, "retired; no worker stayed to take its data")

    def _move_retiring_data(self) -> None:
        """Ask staying workers (least loaded first) for a copy of every result that only
        retiring workers hold; tell a retiring worker to close once it said it claims no
        more, runs nothing and holds nothing unique.  Runs after a batch in which
        something a retirement waits for happened (a copy arrived, a task finished there,
        a worker came or went)."""
        staying = {a for a, ws in self.workers.items() if not ws.retiring}
        load: dict[str, int] = {}
        requests: dict[str, dict[str, list[str]]] = {}
        sid = "retire-" + self._stimulus_id
        for ws in [w for w in self.workers.values() if w.retiring and not w.told_to_close]:
            ws.to_move = {
                ts for ts in ws.to_move if ts.state == "memory" and not (ts.who_has & staying)
            }
            if not ws.to_move and not ws.processing and ws.retire_heard:
                self._tell_to_close(ws, "retired")
                continue
            for ts in sorted(ws.to_move, key=lambda t: t.score):
                ts.replicating &= staying
                if ts.replicating or not staying:
                    continue
                if not load:
                    load = {a: sum(t.nbytes for t in self.workers[a].has_what) for a in staying}
                target = min(load, key=lambda a: (load[a], a))
                load[target] += ts.nbytes
                ts.replicating.add(target)
                requests.setdefault(target, {})[ts.key] = sorted(ts.who_has)
        for target, who_has in requests.items():
            self._emit(WorkerMsg(sid, target, {"op": "acquire-replicas", "who_has": who_has}))

    def _tell_to_close(self, ws: WorkerInfo, reason: str) -> None:
        ws.told_to_close = True
        msg = {"op": "close", "reason": reason}
        self._emit(WorkerMsg("retire-" + self._stimulus_id, ws.address, msg))

    def _ensure_replicas(self, ts: TaskState) -> None:
        """Ask workers without a copy to fetch one, until ``ts.replicas`` are (or will be)
        held; the least loaded workers first."""
        ts.replicating &= set(self.workers)
        missing = ts.replicas - len(ts.who_has) - len(ts.replicating)
        if missing <= 0 or not ts.who_has:
            return
        candidates = sorted(
            (
                ws
                for a, ws in self.workers.items()
                if a not in ts.who_has and a not in ts.replicating and not ws.retiring
            ),
            key=lambda ws: (len(ws.has_what), ws.address),
        )
        for ws in candidates[:missing]:
            ts.replicating.add(ws.address)
            self._emit(
                WorkerMsg(
                    self._stimulus_id,
                    ws.address,
                    {"op": "acquire-replicas", "who_has": {ts.key: sorted(ts.who_has)}},
                )
            )

    def _handle_released_keys(self, ev: ReleasedKeys) -> None:
        ws = self.workers.get(ev.worker)
        for key in ev.keys:
            ts = self.tasks.get(key)
            if ts is None or ws is None:
                continue
            if ts in ws.processing:
                ws.processing.discard(ts)
                self._emit(Unclaim(ev.stimulus_id, ws.address, key))
                if ts.state == "processing":
                    ts.processing_on = None
                    self._transition(ts, "queued")
            if ev.worker in ts.who_has:
                ts.who_has.discard(ev.worker)
                ws.has_what.discard(ts)
                if ts.state == "memory" and not ts.who_has:
                    self._lost_data(ts)
                elif ts.state == "memory":
                    self._emit(SetState(ev.stimulus_id, key, "memory", self._memory_fields(ts)))

    # ------------------------------------------------------------------ transitions

    def _transition(self, ts: TaskState, finish: str, **kwargs: Any) -> None:
        start = ts.state
        if start == finish:
            return
        func = self._transitions.get((start, finish))
        if func is None:
            raise InvalidTransition(
                f"task {ts.key!r}: no transition {start} -> {finish} (stimulus {self._stimulus_id})"
            )
        func(ts, **kwargs)

    def _transition_released_waiting(self, ts: TaskState) -> None:
        ts.state = "waiting"
        ts.waiting_on = {d for d in ts.dependencies if d.state != "memory"}
        for dep in ts.dependencies:
            dep.waiters.add(ts)
        erred = next((d for d in ts.dependencies if d.state == "erred"), None)
        if erred is not None:
            self._inherit_error(ts, erred)
            self._transition(ts, "erred")
            return
        if ts.waiting_on:
            self._emit(SetState(self._stimulus_id, ts.key, "waiting"))
        else:
            self._transition(ts, "queued")

    def _transition_waiting_queued(self, ts: TaskState) -> None:
        if ts.restrict and not self._allowed(ts):
            self._transition_waiting_no_worker(ts)
            return
        ts.state = "queued"
        self._emit(SetState(self._stimulus_id, ts.key, "queued"))
        self._enqueue(ts)

    def _enqueue(self, ts: TaskState) -> None:
        """Into the shared ready set, or the own ready sets of its live allowed workers."""
        ts.queued_on = self._allowed(ts) if ts.restrict else ()
        self._emit(Enqueue(self._stimulus_id, ts.key, ts.score, ts.queued_on, ts.queued_on))

    def _dequeue(self, ts: TaskState) -> None:
        self._emit(Dequeue(self._stimulus_id, ts.key, ts.queued_on))
        ts.queued_on = ()

    def _allowed(self, ts: TaskState) -> tuple[str, ...]:
        """The live workers a restricted task may run on: each entry of its restriction
        matches the workers with that address, name, or host."""
        if self._aliases is None:
            aliases: dict[str, set[str]] = {}
            for address, ws in self.workers.items():
                names = (address, ws.info.get("name"), address_host(address), ws.info.get("host"))
                for name in names:
                    if isinstance(name, str) and name:
                        aliases.setdefault(name, set()).add(address)
            self._aliases = aliases
        return tuple(sorted({a for entry in ts.restrict for a in self._aliases.get(entry, ())}))

    def _transition_waiting_no_worker(self, ts: TaskState) -> None:
        ts.state = "no-worker"
        self.unrunnable.add(ts)
        self._emit(SetState(self._stimulus_id, ts.key, "no-worker"))

    def _transition_no_worker_queued(self, ts: TaskState) -> None:
        self.unrunnable.discard(ts)
        self._transition_waiting_queued(ts)

    def _transition_queued_no_worker(self, ts: TaskState) -> None:
        self._dequeue(ts)
        self._transition_waiting_no_worker(ts)

    def _transition_no_worker_released(self, ts: TaskState) -> None:
        self.unrunnable.discard(ts)
        self._transition_waiting_released(ts)

    def _transition_queued_waiting(self, ts: TaskState) -> None:
        """A dependency of a queued task lost its data: wait for it again."""
        self._dequeue(ts)
        self._wait_again(ts)

    def _transition_processing_waiting(self, ts: TaskState) -> None:
        """A dependency lost its data while a worker held the task: take it back."""
        self._take_back(ts)
        self._wait_again(ts)

    def _take_back(self, ts: TaskState) -> None:
        """Withdraw a processing task from its worker (which drops it, if still there)."""
        worker = ts.processing_on
        if worker is not None:
            ws = self.workers.get(worker)
            if ws is not None:
                ws.processing.discard(ts)
            self._emit(Unclaim(self._stimulus_id, worker, ts.key))
            self._free(worker, ts.key)
        ts.processing_on = None

    def _transition_no_worker_waiting(self, ts: TaskState) -> None:
        self.unrunnable.discard(ts)
        self._wait_again(ts)

    def _wait_again(self, ts: TaskState) -> None:
        ts.state = "waiting"
        ts.waiting_on = {d for d in ts.dependencies if d.state != "memory"}
        self._emit(SetState(self._stimulus_id, ts.key, "waiting"))

    def _transition_processing_queued(self, ts: TaskState) -> None:
        if ts.processing_on is not None:
            ws = self.workers.get(ts.processing_on)
            if ws is not None:
                ws.processing.discard(ts)
            ts.processing_on = None
        self._transition_waiting_queued(ts)

    def _transition_queued_processing(self, ts: TaskState, worker: WorkerInfo) -> None:
        ts.state = "processing"
        ts.queued_on = ()  # the claim took it out of every ready set
        ts.claimed_before, ts.unlisted = worker.holding_reports, 0
        ts.processing_on = worker.address
        worker.processing.add(ts)  # Redis already says so: the claim script wrote it
        self._emit(ClaimAccepted(self._stimulus_id, ts.key, worker.address))

    def _transition_processing_memory(self, ts: TaskState, worker: WorkerInfo) -> None:
        if ts.state == "queued":  # a late result (its worker was removed): leave the ready set
            self._dequeue(ts)
        elif ts.processing_on is not None and ts.processing_on != worker.address:
            other = self.workers.get(ts.processing_on)  # racing another worker's run of it
            if other is not None:
                other.processing.discard(ts)
            self._emit(Unclaim(self._stimulus_id, ts.processing_on, ts.key))
        worker.processing.discard(ts)
        self._emit(Unclaim(self._stimulus_id, worker.address, ts.key))
        ts.processing_on = None
        ts.state = "memory"
        self.n_finished += 1
        self._add_replica(ts, worker.address)
        if worker.retiring:  # finished while its worker retires: to be copied elsewhere
            worker.to_move.add(ts)
            self._retirement_changed = True
        self._emit(SetState(self._stimulus_id, ts.key, "memory", self._memory_fields(ts)))
        for client in ts.who_wants:
            self._emit(ClientMsg(self._stimulus_id, client, self._memory_msg(ts)))
        self._wake_waiters(ts)
        for dep in ts.dependencies:
            dep.waiters.discard(ts)
            self._maybe_release(dep)
        self._maybe_release(ts)

    def _free(self, worker: str, key: str) -> None:
        """Tell a worker to drop what it holds of ``key`` (a result, a failed run)."""
        self._emit(WorkerMsg(self._stimulus_id, worker, {"op": "free-keys", "keys": [key]}))

    def _wake_waiters(self, ts: TaskState) -> None:
        for dependent in sorted(ts.waiters, key=lambda t: t.score):
            dependent.waiting_on.discard(ts)
            if dependent.state == "waiting" and not dependent.waiting_on:
                self._transition(dependent, "queued")

    def _add_replica(self, ts: TaskState, worker: str) -> None:
        ts.who_has.add(worker)
        ws = self.workers.get(worker)
        if ws is not None:
            ws.has_what.add(ts)

    def _transition_processing_erred(self, ts: TaskState) -> None:
        if ts.processing_on is not None:
            ws = self.workers.get(ts.processing_on)
            if ws is not None:
                ws.processing.discard(ts)
            ts.processing_on = None
        self._transition_waiting_erred(ts)

    def _transition_waiting_erred(self, root: TaskState) -> None:
        """Err ``root`` and, iteratively, every dependent waiting on it."""
        todo = [root]
        while todo:
            ts = todo.pop()
            ts.state = "erred"
            self.n_erred += 1
            ts.waiting_on.clear()
            self._emit(SetState(self._stimulus_id, ts.key, "erred", self._erred_fields(ts)))
            for client in ts.who_wants:
                self._emit(ClientMsg(self._stimulus_id, client, self._erred_msg(ts)))
            for dependent in sorted(ts.waiters, key=lambda t: -t.score):
                if dependent.state == "waiting":
                    self._inherit_error(dependent, ts)
                    todo.append(dependent)
            ts.waiters.clear()
            for dep in ts.dependencies:
                dep.waiters.discard(ts)
                self._maybe_release(dep)

    def _inherit_error(self, ts: TaskState, source: TaskState) -> None:
        ts.exception, ts.traceback = source.exception, source.traceback
        ts.exception_text, ts.traceback_text = source.exception_text, source.traceback_text
        ts.exception_blame = source.exception_blame or source.key
        ts.erred_on = source.erred_on
        ts.killed = source.killed
        ts.rejected = source.rejected

    def _transition_waiting_released(self, ts: TaskState) -> None:
        ts.state = "released"
        ts.waiting_on.clear()
        self._emit(SetState(self._stimulus_id, ts.key, "released"))
        self._release_dependencies(ts)

    def _transition_queued_released(self, ts: TaskState) -> None:
        self._dequeue(ts)
        self._transition_waiting_released(ts)

    def _transition_processing_released(self, ts: TaskState) -> None:
        self._take_back(ts)
        self._transition_waiting_released(ts)

    def _transition_memory_released(self, ts: TaskState) -> None:
        for worker in ts.replicating - ts.who_has:  # fetching a copy nobody needs now
            self._free(worker, ts.key)
        ts.replicating.clear()
        for worker in ts.who_has:
            ws = self.workers.get(worker)
            if ws is not None:
                ws.has_what.discard(ts)
            self._free(worker, ts.key)
        ts.who_has.clear()
        ts.state = "released"
        self._emit(SetState(self._stimulus_id, ts.key, "released", {"who_has": b""}))
        self._release_dependencies(ts)
        self._maybe_forget(ts)

    def _transition_erred_released(self, ts: TaskState) -> None:
        if ts.exception_blame is None and ts.killed is None and ts.erred_on in self.workers:
            self._free(ts.erred_on, ts.key)  # it raised there: the worker keeps the error
        ts.state = "released"
        ts.exception = ts.traceback = None
        ts.exception_text = ts.traceback_text = ""
        ts.exception_blame = ts.erred_on = ts.killed = None
        ts.suspicious, ts.deaths, ts.rejected = 0, [], False
        self._emit(
            SetState(
                self._stimulus_id,
                ts.key,
                "released",
                {
                    "exception": b"",
                    "traceback": b"",
                    "exception_text": "",
                    "traceback_text": "",
                    "erred_on": "",
                    "exception_blame": "",
                    "killed": b"",
                    "rejected": b"",
                    "suspicious": 0,
                    "deaths": b"",
                },
            )
        )
        self._release_dependencies(ts)
        self._maybe_forget(ts)

    def _transition_released_forgotten(self, ts: TaskState) -> None:
        ts.state = "forgotten"
        del self.tasks[ts.key]
        self._emit(Forget(self._stimulus_id, ts.key))
        for dep in ts.dependencies:
            dep.dependents.discard(ts)
            dep.waiters.discard(ts)
            if dep.state == "released":
                self._maybe_forget(dep)
        for dependent in ts.dependents:
            dependent.dependencies.discard(ts)

    # ------------------------------------------------------------------ release rules

    def _release_dependencies(self, ts: TaskState) -> None:
        for dep in ts.dependencies:
            dep.waiters.discard(ts)
            self._maybe_release(dep)
        self._maybe_forget(ts)

    def _maybe_release(self, ts: TaskState) -> None:
        """Release a task nobody needs any more (no client wants it, no dependent waits).

        Releases and forgets go through a worklist drained by ``_drain`` instead of
        recursing, so cancelling a 100,000-task chain cannot hit the recursion limit."""
        self._candidates.append(ts)

    _maybe_forget = _maybe_release

    def _drain(self) -> None:
        while self._candidates:
            ts = self._candidates.popleft()
            if ts.who_wants or ts.waiters or ts.state == "forgotten":
                continue
            if ts.state != "released":
                self._transition(ts, "released")
            elif all(d.state == "forgotten" for d in ts.dependents):
                self._transition(ts, "forgotten")

    # ------------------------------------------------------------------ messages

    def _memory_fields(self, ts: TaskState) -> dict[str, Any]:
        return {"who_has": " ".join(sorted(ts.who_has)), "nbytes": ts.nbytes, "type": ts.type}

    def _memory_msg(self, ts: TaskState) -> dict[str, Any]:
        return {
            "op": "key-in-memory",
            "key": ts.key,
            "who_has": sorted(ts.who_has),
            "nbytes": ts.nbytes,
            "type": ts.type,
        }

    def _erred_fields(self, ts: TaskState) -> dict[str, Any]:
        fields = {
            "exception": ts.exception or b"",
            "traceback": ts.traceback or b"",
            "exception_text": ts.exception_text,
            "traceback_text": ts.traceback_text,
            "erred_on": ts.erred_on or "",
            "exception_blame": ts.exception_blame or "",
        }
        if ts.killed:
            fields["killed"] = ts.killed
            fields["suspicious"] = ts.suspicious
            fields["deaths"] = _pack(ts.deaths)
        if ts.rejected:
            fields["rejected"] = 1
        return fields

    def _erred_msg(self, ts: TaskState) -> dict[str, Any]:
        msg = {"op": "task-erred", "key": ts.key, **self._erred_fields(ts)}
        if ts.rejected:
            msg["rejected"] = True
        return msg

    # ------------------------------------------------------------------ validation

    def validate_state(self) -> None:
        for key, ts in self.tasks.items():
            assert ts.key == key
            assert ts.state != "forgotten", ts
            for dep in ts.dependencies:
                assert ts in dep.dependents, (ts, dep)
                assert dep.key in self.tasks, (ts, dep)
            for dependent in ts.dependents:
                assert ts in dependent.dependencies, (ts, dependent)
            if ts.state == "memory":
                assert ts.who_has, ts
                assert ts.processing_on is None, ts
            if ts.state == "processing":
                assert ts.processing_on is not None, ts
                ws = self.workers.get(ts.processing_on)
                assert ws is not None and ts in ws.processing, ts
            if ts.state == "queued":
                assert all(d.state == "memory" for d in ts.dependencies), ts
                assert ts.processing_on is None, ts
            if ts.state == "waiting":
                assert ts.waiting_on == {d for d in ts.dependencies if d.state != "memory"}, ts
                assert ts.waiting_on, ts
            if ts.state in ("queued", "no-worker"):
                assert all(d.state == "memory" for d in ts.dependencies), ts
            # a queued restricted task sits in the ready sets of live workers only
            assert bool(ts.queued_on) == (ts.state == "queued" and bool(ts.restrict)), ts
            assert all(w in self.workers for w in ts.queued_on), (ts, ts.queued_on)
            if ts.state in HOLDS_DEPENDENCIES:
                for dep in ts.dependencies:
                    assert ts in dep.waiters, (ts, dep)
            for client in ts.who_wants:
                assert ts in self.clients.get(client, set()), (ts, client)
        for ws in self.workers.values():
            assert ws.retiring or not (ws.told_to_close or ws.retire_heard), ws.address
            for ts in ws.processing:
                assert ts.processing_on == ws.address, (ts, ws.address)
            for ts in ws.has_what:
                assert ws.address in ts.who_has, (ts, ws.address)
        for client, wanted in self.clients.items():
            for ts in wanted:
                assert client in ts.who_wants, (client, ts)
                assert self.tasks.get(ts.key) is ts, (client, ts)
