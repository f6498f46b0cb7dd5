"""The wire protocol: every message on every stream, one small class each.

Five channels carry messages (``docs/redis-schema.md``, "Streams", lists them), each
with its registry ``op -> class``:

* client -> scheduler, ``rd:{c}:stream:clients``: ``CLIENT_TO_SCHEDULER``
* worker -> scheduler, ``rd:{c}:stream:workers``: ``WORKER_TO_SCHEDULER``
* nanny -> scheduler, ``rd:{c}:stream:workers``: ``NANNY_TO_SCHEDULER``
* scheduler -> worker, ``rd:{c}:worker:<address>:inbox``: ``SCHEDULER_TO_WORKER``
* scheduler -> client, ``rd:{c}:client:<id>:events``: ``SCHEDULER_TO_CLIENT``

Every entry of those streams has one field ``m``: a msgpack list of maps, each with an
``op``.  A message class names its ``op`` (class-level), turns itself into that map with
``to_dict()`` and is rebuilt, with every field's type checked, by ``from_dict()``: every
sender builds one, every receiver parses one (``parse(msg, registry)``), so a field is
named in one place.  A malformed message raises ``ProtocolError`` naming the field; the
receiver decides what that means (the scheduler dead-letters the entry, a worker or a
client logs and skips the message).

The messages into the scheduler are its events (``Stimulus``): they carry a
``stimulus_id``, keyword-only and last (Dask's convention), which is **not** on the wire:
the scheduler names each message after its stream entry (``workers:<id>/<index>``).

Fields listed in a class's ``optional`` are left out of ``to_dict()`` while they hold
their default (a sender that has nothing to say does not say it), so the maps stay the
ones the streams always carried.  Plain slotted dataclasses, no per-message framework:
these run once per task on the hot path (a 10,000-task ``map`` is 10,000 ``task-finished``
and 10,000 ``key-in-memory`` messages).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from redisdask.errors import ProtocolError
from redisdask.placement import check_resources

NO_SCORE = float("nan")  # a report that does not say which run it answers

M = TypeVar("M", bound="Message")


# --------------------------------------------------------------------------- checks


def _is_strs(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(x, str) for x in value)


def _is_str_map(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) for k in value)


# the field annotations (text: ``from __future__ import annotations``) a message may use,
# and the check of each; an annotation missing here is a bug found at first use
_CHECKS: dict[str, Callable[[Any], bool]] = {
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "int": lambda v: isinstance(v, int),
    "int | None": lambda v: v is None or isinstance(v, int),
    "float": lambda v: isinstance(v, int | float),
    "bytes": lambda v: isinstance(v, bytes),
    "bytes | None": lambda v: v is None or isinstance(v, bytes),
    "list[str]": _is_strs,
    "list[str] | None": lambda v: v is None or _is_strs(v),
    "list[Any]": lambda v: isinstance(v, list),
    "list[dict[str, Any]]": lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v),
    "dict[str, Any]": _is_str_map,
    "dict[str, int]": lambda v: (
        isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, int) for k, x in v.items())
    ),
    "dict[str, float]": lambda v: (
        isinstance(v, dict)
        and all(isinstance(k, str) and isinstance(x, int | float) for k, x in v.items())
    ),
    "dict[str, list[str]]": lambda v: (
        isinstance(v, dict) and all(isinstance(k, str) and _is_strs(x) for k, x in v.items())
    ),
}


def _preview(msg: Any) -> str:
    text = repr(msg)
    return text if len(text) < 200 else text[:200] + "..."


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    annotation: str
    check: Callable[[Any], bool]
    required: bool
    optional: bool  # left out of to_dict() at its default
    default: Any


_SPECS: dict[type, tuple[_Field, ...]] = {}


def _spec(cls: type[Message]) -> tuple[_Field, ...]:
    """The wire fields of a message class (its dataclass fields but ``stimulus_id``)."""
    spec = _SPECS.get(cls)
    if spec is None:
        out = []
        for f in fields(cls):  # type: ignore[arg-type]
            if f.name == "stimulus_id":
                continue
            annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
            if f.default is not MISSING:
                default = f.default
            elif f.default_factory is not MISSING:
                default = f.default_factory()
            else:
                default = None
            required = f.default is MISSING and f.default_factory is MISSING
            optional = f.name in cls.optional
            out.append(_Field(f.name, annotation, _CHECKS[annotation], required, optional, default))
        spec = _SPECS[cls] = tuple(out)
    return spec


def _same(value: Any, default: Any) -> bool:
    if isinstance(value, float) and isinstance(default, float) and math.isnan(default):
        return math.isnan(value)
    return bool(value == default)


# --------------------------------------------------------------------------- base classes


@dataclass(slots=True)
class Message:
    """One message: ``op`` names it on the wire; ``to_dict()`` is its msgpack map."""

    op: ClassVar[str] = ""
    optional: ClassVar[frozenset[str]] = frozenset()  # omitted from to_dict() at default

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": self.op}
        for f in _spec(type(self)):
            value = getattr(self, f.name)
            if not (f.optional and _same(value, f.default)):
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls: type[M], msg: Any, stimulus_id: str | None = None) -> M:
        """Build the message from a decoded map, checking every field's type; a missing
        required field, a wrongly typed one or another ``op`` raise ``ProtocolError``
        naming it.  Fields the class does not know are ignored."""
        if not cls.op:  # a channel's base class: the class of the message's op
            return parse(msg, _CHANNEL_OF[cls], stimulus_id)
        if not isinstance(msg, dict):
            raise ProtocolError(f"a message should be a map, got {_preview(msg)}")
        if msg.get("op") != cls.op:
            raise ProtocolError(f"expected op {cls.op!r}, got {_preview(msg.get('op'))}")
        kwargs: dict[str, Any] = {}
        for f in _spec(cls):
            if f.name in msg:
                value = msg[f.name]
                if not f.check(value):
                    raise ProtocolError(
                        f"malformed {cls.op!r} message {_preview(msg)}: field {f.name!r} "
                        f"should be {f.annotation}, got {_preview(value)[:80]}"
                    )
                kwargs[f.name] = value
            elif f.required:
                raise ProtocolError(
                    f"malformed {cls.op!r} message {_preview(msg)}: field {f.name!r} is missing"
                )
        cls._with_stimulus(kwargs, msg, stimulus_id)
        message = cls(**kwargs)
        try:
            message._validate()
        except ValueError as exc:
            raise ProtocolError(f"malformed {cls.op!r} message {_preview(msg)}: {exc}") from exc
        return message

    @classmethod
    def _with_stimulus(cls, kwargs: dict[str, Any], msg: dict[str, Any], sid: str | None) -> None:
        """Events take a stimulus id; other messages have none."""

    def _validate(self) -> None:
        """Checks beyond each field's type (ValueError); the fields are checked already."""


@dataclass(slots=True)
class Stimulus(Message):
    """A message into the scheduler: a stimulus of its state machine (``scheduler.state``).
    ``stimulus_id`` identifies it in the stories; it is not part of the wire message."""

    stimulus_id: str = field(default="", kw_only=True)

    @classmethod
    def _with_stimulus(cls, kwargs: dict[str, Any], msg: dict[str, Any], sid: str | None) -> None:
        given = msg.get("stimulus_id")
        if given is not None and not isinstance(given, str):
            raise ProtocolError(
                f"malformed {cls.op!r} message {_preview(msg)}: field 'stimulus_id' should "
                f"be str, got {_preview(given)[:80]}"
            )
        kwargs["stimulus_id"] = sid or given or "replay"


def registry(*classes: type[M]) -> dict[str, type[M]]:
    """The ``op -> class`` map of one channel."""
    return {cls.op: cls for cls in classes}


def parse(msg: Any, channel: dict[str, type[M]], stimulus_id: str | None = None) -> M:
    """The message ``msg`` (a decoded map) on ``channel`` (a registry); ``ProtocolError``
    when its op is not one of the channel's or it is malformed."""
    op = msg.get("op") if isinstance(msg, dict) else None
    cls = channel.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ProtocolError(f"unknown op {_preview(op)} in message {_preview(msg)}")
    return cls.from_dict(msg, stimulus_id)


def dicts(messages: Iterable[Message]) -> list[dict[str, Any]]:
    """The maps of ``messages``, for ``codecs.entry``."""
    return [m.to_dict() for m in messages]


# --------------------------------------------------------------------------- client -> scheduler


@dataclass(slots=True)
class UpdateGraph(Stimulus):
    """A client submits tasks.  Each task: {key, spec: bytes|None, deps: [keys],
    priority: int, retries: int, workers?: [address, name or host],
    allow_other_workers?: bool, resources?: {name: amount}}.  ``wanted`` are the keys the
    client holds futures for; ``generation`` the client's submission counter, echoed as
    ``seen`` in the news of its keys."""

    op: ClassVar[str] = "update-graph"
    client: str
    tasks: list[dict[str, Any]] = field(default_factory=list)
    wanted: list[str] = field(default_factory=list)
    generation: int = 0

    def _validate(self) -> None:
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
            if not isinstance(t.get("allow_other_workers", False), bool):
                raise ValueError(f"task {t['key']!r}: 'allow_other_workers' should be bool")
            try:
                check_resources(t.get("resources") or {}, f"task {t['key']!r}: 'resources'")
            except TypeError as exc:
                raise ValueError(str(exc)) from None


@dataclass(slots=True)
class ClientDesiresKeys(Stimulus):
    op: ClassVar[str] = "client-desires-keys"
    client: str
    keys: list[str] = field(default_factory=list)


@dataclass(slots=True)
class ClientReleasesKeys(Stimulus):
    op: ClassVar[str] = "client-releases-keys"
    client: str
    keys: list[str] = field(default_factory=list)


@dataclass(slots=True)
class CancelKeys(Stimulus):
    op: ClassVar[str] = "cancel-keys"
    client: str
    keys: list[str] = field(default_factory=list)
    generation: int = 0  # the client's submission counter, echoed in cancelled-keys


@dataclass(slots=True)
class RetryKeys(Stimulus):
    """Run erred tasks again (``client.retry``), with the erred tasks they depend on."""

    op: ClassVar[str] = "retry-keys"
    client: str
    keys: list[str] = field(default_factory=list)


@dataclass(slots=True)
class CloseClient(Stimulus):
    op: ClassVar[str] = "close-client"
    client: str


@dataclass(slots=True)
class UpdateData(Stimulus):
    """A client scattered data straight to workers: who_has {key: [worker]}."""

    op: ClassVar[str] = "update-data"
    client: str
    who_has: dict[str, list[str]] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    types: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class ClientMissingData(Stimulus):
    """A client could fetch none of ``keys`` from the holders the scheduler named: for
    each key, the holders whose request failed (a peer deadline or a connection error).
    The scheduler drops those it still counts, as for a worker's ``missing-data``."""

    op: ClassVar[str] = "client-missing-data"
    client: str
    who_failed: dict[str, list[str]] = field(default_factory=dict)


@dataclass(slots=True)
class Restart(Stimulus):
    """A client restarts the cluster: every task is forgotten, every future cancelled,
    every worker drops what it holds.  ``connected``: the clients connected when the
    scheduler took it up (``rd:{c}:clients``), filled in by the scheduler: each hears of
    the restart, whether it submitted anything or not (as distributed tells every client)."""

    op: ClassVar[str] = "restart"
    client: str
    connected: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Replicate(Stimulus):
    """A client asks for ``n`` copies of each of ``keys`` on distinct workers, kept after
    a loss while a copy survives."""

    op: ClassVar[str] = "replicate"
    client: str
    keys: list[str] = field(default_factory=list)
    n: int = 2


@dataclass(slots=True)
class Rebalance(Stimulus):
    """A client asks to even out the bytes its workers hold (``Client.rebalance``):
    ``keys`` only those (None: any key), among ``workers`` only (None: every worker).
    The scheduler records its plan and progress under ``request`` (the client's id for
    this call), where the client reads when the moves are done."""

    op: ClassVar[str] = "rebalance"
    optional: ClassVar[frozenset[str]] = frozenset({"keys", "workers"})
    client: str
    request: str
    keys: list[str] | None = None
    workers: list[str] | None = None

    def _validate(self) -> None:
        if not self.request:
            raise ValueError("'request' is empty")


@dataclass(slots=True)
class RetireWorkers(Stimulus):
    """Workers leave gracefully (on both input streams).  They stop claiming, hand back
    the tasks they claimed but did not start, finish the ones running, and stay until
    every result that only they hold has a copy on a worker that stays; then the
    scheduler tells them to close.

    A client's request (``client`` set) that would lose data because no worker would stay
    is refused (``retire-refused``).  A retiring worker repeats the request about itself
    every second until it is told to close (``client`` empty): that says it claims no
    more (every claim it made is ahead of it on the workers stream), re-asks for copies
    nobody delivered, and lets a restarted scheduler resume.  ``force`` (its lifetime
    ended, it got SIGTERM): it leaves anyway, so with no worker staying it is told to
    close at once (what it held is then recomputed from the graph history); otherwise
    it waits for a worker to join."""

    op: ClassVar[str] = "retire-workers"
    optional: ClassVar[frozenset[str]] = frozenset({"client", "force"})
    client: str = ""
    workers: list[str] = field(default_factory=list)
    force: bool = False


# --------------------------------------------------------------------------- worker -> scheduler


@dataclass(slots=True)
class AddWorker(Stimulus):
    """A worker (re)joins.  After losing Redis it sends ``resync``: the keys it holds
    ``{"keys": {key: nbytes}}`` and the claimed tasks it still has
    ``{"processing": [key]}``, so the scheduler can reconcile what Redis forgot."""

    op: ClassVar[str] = "add-worker"
    optional: ClassVar[frozenset[str]] = frozenset({"resync"})
    worker: str
    info: dict[str, Any] = field(default_factory=dict)
    resync: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RemoveWorker(Stimulus):
    """A worker is gone.  ``how``: ``goodbye`` (it left on its own: nothing is blamed),
    ``connection`` (its Redis connections closed), ``heartbeat`` (its heartbeat expired) or
    ``nanny`` (its nanny saw it die) or ``replaced`` (a new process registered at its
    address before its death was noticed).  ``evidence``: what is known of its last
    moments (the last heartbeat; a nanny adds exit code, signal, memory, log tail).
    Workers send it (goodbye), so do nannies (``how="nanny"``)."""

    op: ClassVar[str] = "remove-worker"
    optional: ClassVar[frozenset[str]] = frozenset({"how", "evidence"})
    worker: str
    reason: str = ""
    how: str = "goodbye"
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class TaskClaimed(Stimulus):
    """Written by the CLAIM script; ``scores`` say which run of each key was popped.
    ``chained``: written by the FINISH script, which claimed ``keys`` while they were
    still waiting, on tasks processing on ``worker`` whose results the same entry
    reports next (docs/design.md, "Chains")."""

    op: ClassVar[str] = "claimed"
    optional: ClassVar[frozenset[str]] = frozenset({"chained"})
    worker: str
    keys: list[str] = field(default_factory=list)
    scores: list[Any] = field(default_factory=list)
    chained: bool = False


@dataclass(slots=True)
class ClientsTold(Stimulus):
    """Written by the FINISH script: it sent the ``key-in-memory`` of these pushed tasks'
    results (``scores``: which run) to the clients named in their records' ``notify``,
    whose results the same entry reports next (docs/design.md, "Push")."""

    op: ClassVar[str] = "told"
    worker: str
    keys: list[str] = field(default_factory=list)
    scores: list[Any] = field(default_factory=list)


@dataclass(slots=True)
class Holding(Stimulus):
    """A worker's periodic word on the claimed tasks it has not finished: ``keys``, of
    the tasks it claimed before its previous holding report (the workers stream orders
    the reports, claims and results exactly; see the worker's ``_report_holding``).  A
    task processing there that two reports in a row do not list is queued again: its
    claim's reply never reached the worker (Redis died in between)."""

    op: ClassVar[str] = "holding"
    worker: str
    keys: list[str] = field(default_factory=list)


@dataclass(slots=True)
class TaskFinished(Stimulus):
    """A claimed task's result is in the worker's memory (the worker state machine emits
    it).  ``score``: the run it answers (a task's score is new at each submission)."""

    op: ClassVar[str] = "task-finished"
    optional: ClassVar[frozenset[str]] = frozenset({"score", "value", "seceded"})
    worker: str
    key: str
    nbytes: int = 0
    type: str = ""  # the qualified type name of the result
    start: float = 0.0
    stop: float = 0.0
    score: float = NO_SCORE
    seceded: bool = False  # the run left the pool: start-stop is no measure of its cost
    # the result pickled, when it is at most ``worker.inline-result-bytes``: the scheduler
    # keeps it in the task's record, so it outlives the worker and needs no fetch
    value: bytes | None = None


@dataclass(slots=True)
class TaskErred(Stimulus):
    """The function raised (the worker state machine emits it): the exception and tblib
    traceback cloudpickled, and their text."""

    op: ClassVar[str] = "task-erred"
    optional: ClassVar[frozenset[str]] = frozenset({"score"})
    worker: str
    key: str
    exception: bytes | None = None
    traceback: bytes | None = None
    exception_text: str = ""
    traceback_text: str = ""
    score: float = NO_SCORE


@dataclass(slots=True)
class MissingData(Stimulus):
    """A worker could not get ``keys`` from ``errant_worker`` (or from anyone: ``""``)."""

    op: ClassVar[str] = "missing-data"
    worker: str
    keys: list[str] = field(default_factory=list)
    errant_worker: str = ""


@dataclass(slots=True)
class AddKeys(Stimulus):
    """A worker holds ``keys`` it did not compute (scattered to it, or a replica)."""

    op: ClassVar[str] = "add-keys"
    worker: str
    keys: list[str] = field(default_factory=list)
    nbytes: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class ReleasedKeys(Stimulus):
    """A worker dropped ``keys`` (e.g. a cancelled task's late result), or handed back
    its claims of them; ``scores`` say which run of each key (none: unknown).
    ``overdue``: it handed them back because every thread runs a task past twice its
    prefix's estimate; per prefix whose estimate misleads claims
    (``durations.misleads``), how long such a run has gone on (seconds)."""

    op: ClassVar[str] = "released-keys"
    optional: ClassVar[frozenset[str]] = frozenset({"scores", "overdue"})
    worker: str
    keys: list[str] = field(default_factory=list)
    scores: list[Any] = field(default_factory=list)
    overdue: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class StolenKeys(Stimulus):
    """The victim's answer to a ``steal-request``: it gave back its claims of ``keys``
    (not started here: they will not run here), to be queued for ``thief``
    (``redisdask.scheduler.stealing``); ``scores`` say which run of each key; ``refused``: the keys
    asked for that it keeps (started, or no longer here)."""

    op: ClassVar[str] = "stolen-keys"
    optional: ClassVar[frozenset[str]] = frozenset({"scores", "refused"})
    worker: str
    thief: str
    keys: list[str] = field(default_factory=list)
    scores: list[Any] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- scheduler -> worker


@dataclass(slots=True)
class InboxMessage(Message):
    """A message on a worker's inbox."""


@dataclass(slots=True)
class FreeKeys(InboxMessage):
    """The scheduler no longer needs ``keys`` on this worker.  ``seen``: the workers
    stream entry up to which it had read every claim when it decided (empty: unknown);
    a key this worker claimed in a later entry is kept (the scheduler answers that claim
    when it reads it).  ``run``: only a copy of that run (a score) goes."""

    op: ClassVar[str] = "free-keys"
    optional: ClassVar[frozenset[str]] = frozenset({"seen", "run"})
    keys: list[str]
    seen: str = ""
    run: float = NO_SCORE


@dataclass(slots=True)
class KeysRecorded(InboxMessage):
    """The scheduler counts this worker's scattered copy of ``keys`` (after update-data)."""

    op: ClassVar[str] = "keys-recorded"
    keys: list[str]


@dataclass(slots=True)
class WhoHas(InboxMessage):
    """The authoritative holders, in reply to missing-data."""

    op: ClassVar[str] = "who-has"
    who_has: dict[str, list[str]]


@dataclass(slots=True)
class AcquireReplicas(InboxMessage):
    """Fetch a copy of each key from those holders and keep it (``replicate``)."""

    op: ClassVar[str] = "acquire-replicas"
    who_has: dict[str, list[str]]


@dataclass(slots=True)
class RestartWorker(InboxMessage):
    """The cluster was restarted: drop every task held or running."""

    op: ClassVar[str] = "restart"


@dataclass(slots=True)
class RetireWorker(InboxMessage):
    """Leave gracefully (see ``RetireWorkers``)."""

    op: ClassVar[str] = "retire"


@dataclass(slots=True)
class RetireAborted(InboxMessage):
    """Stop retiring and work on: the workers that were to take this one's results left
    meanwhile (as distributed keeps a worker whose data has nowhere to go)."""

    op: ClassVar[str] = "retire-aborted"
    reason: str = ""


@dataclass(slots=True)
class CloseWorker(InboxMessage):
    """Close now (the data is safe elsewhere, or the whole cluster stops)."""

    op: ClassVar[str] = "close"
    reason: str = "close"


@dataclass(slots=True)
class StealRequest(InboxMessage):
    """Give back, for ``thief``, the claims of ``keys`` that have not started here
    (answered with ``stolen-keys``; see ``redisdask.scheduler.stealing``)."""

    op: ClassVar[str] = "steal-request"
    keys: list[str]
    thief: str


@dataclass(slots=True)
class ComputeTask(InboxMessage):
    """Run ``key``: the scheduler assigned it to this worker's free thread as it read the
    task's submission (a root task: no dependencies, no restriction), instead of queueing
    it for a claim (docs/design.md, "Push").  ``score``: its run, as a claim gives it;
    ``started``: the worker process it is meant for (another process at the same address
    ignores it: the scheduler gave the task to a worker that is gone); ``estimate``: its
    prefix's duration average (negative: none yet); ``chain``: its record has a chain
    (its report looks it up, as a claimed task's).  The spec comes beside the message in
    the inbox entry (``keyspace.push_spec_field``), copied from the task's record there."""

    op: ClassVar[str] = "compute-task"
    optional: ClassVar[frozenset[str]] = frozenset({"estimate", "chain"})
    key: str
    score: float
    started: float
    estimate: float = -1.0
    chain: bool = False


# --------------------------------------------------------------------------- scheduler -> client


@dataclass(slots=True)
class ClientEvent(Message):
    """A message on a client's events stream."""


@dataclass(slots=True)
class KeyInMemory(ClientEvent):
    """The future is finished: its value is on each of ``who_has`` (``keyspace.REDIS_COPY``:
    in the task's record) and, for a result small enough, in ``value`` (pickled).

    ``seen``, here and in ``task-erred``: the ``generation`` of the client's last
    ``update-graph`` the scheduler had read when it wrote this (none after a scheduler
    restart).  News with ``seen`` below the generation of the future's own submission is
    about an earlier run of the key (released and submitted again meanwhile, perhaps as
    another computation): the client ignores it, and hears of the new run later."""

    op: ClassVar[str] = "key-in-memory"
    optional: ClassVar[frozenset[str]] = frozenset({"value", "seen"})
    key: str
    who_has: list[str]
    nbytes: int = 0
    type: str = ""
    value: bytes | None = None
    seen: int | None = None


@dataclass(slots=True)
class KeyErred(ClientEvent):
    """The future is in error (op ``task-erred`` on the client's stream).  ``killed``,
    ``suspicious`` and ``deaths`` are there only for a ``KilledWorker``, ``rejected`` only
    when the scheduler refused to run the task; the client rebuilds the exception from
    these (``client._load_error``)."""

    op: ClassVar[str] = "task-erred"
    optional: ClassVar[frozenset[str]] = frozenset(
        {"killed", "suspicious", "deaths", "rejected", "seen"}
    )
    key: str
    exception: bytes = b""
    traceback: bytes = b""
    exception_text: str = ""
    traceback_text: str = ""
    erred_on: str = ""
    exception_blame: str = ""
    killed: bytes | None = None  # msgpack {task, deaths}
    suspicious: int = 0
    deaths: bytes | None = None  # msgpack list of death records
    rejected: bool = False
    seen: int | None = None  # as in key-in-memory (none for a rejected graph: always news)


@dataclass(slots=True)
class CancelledKeys(ClientEvent):
    """A reply to cancel-keys, echoing its ``generation``."""

    op: ClassVar[str] = "cancelled-keys"
    keys: list[str]
    generation: int = 0


@dataclass(slots=True)
class TaskRetried(ClientEvent):
    """An erred task runs again (``client.retry``): its future is pending again."""

    op: ClassVar[str] = "task-retried"
    key: str


@dataclass(slots=True)
class Restarted(ClientEvent):
    """``Client.restart`` happened (``by`` the client that asked)."""

    op: ClassVar[str] = "restarted"
    by: str = ""


@dataclass(slots=True)
class RetireRefused(ClientEvent):
    """Retiring ``workers`` would have lost data: they keep running."""

    op: ClassVar[str] = "retire-refused"
    workers: list[str]
    reason: str = ""


# --------------------------------------------------------------------------- channels

CLIENT_TO_SCHEDULER: dict[str, type[Stimulus]] = registry(
    UpdateGraph, ClientDesiresKeys, ClientReleasesKeys, CancelKeys, RetryKeys, Replicate,
    Rebalance, Restart, RetireWorkers, UpdateData, CloseClient, ClientMissingData,
)  # fmt: skip
WORKER_TO_SCHEDULER: dict[str, type[Stimulus]] = registry(
    AddWorker, TaskClaimed, TaskFinished, TaskErred, MissingData, AddKeys, ReleasedKeys,
    Holding, RetireWorkers, RemoveWorker, StolenKeys, ClientsTold,
)  # fmt: skip
NANNY_TO_SCHEDULER: dict[str, type[Stimulus]] = registry(RemoveWorker)
# the scheduler accepts every one of its events on either input stream
SCHEDULER_EVENTS: dict[str, type[Stimulus]] = {**CLIENT_TO_SCHEDULER, **WORKER_TO_SCHEDULER}
SCHEDULER_TO_WORKER: dict[str, type[InboxMessage]] = registry(
    FreeKeys,
    KeysRecorded,
    WhoHas,
    AcquireReplicas,
    RestartWorker,
    RetireWorker,
    RetireAborted,
    CloseWorker,
    StealRequest,
    ComputeTask,
)
SCHEDULER_TO_CLIENT: dict[str, type[ClientEvent]] = registry(
    KeyInMemory, KeyErred, CancelledKeys, TaskRetried, Restarted, RetireRefused
)
CHANNELS: dict[str, dict[str, Any]] = {
    "client -> scheduler": CLIENT_TO_SCHEDULER,
    "worker -> scheduler": WORKER_TO_SCHEDULER,
    "nanny -> scheduler": NANNY_TO_SCHEDULER,
    "scheduler -> worker": SCHEDULER_TO_WORKER,
    "scheduler -> client": SCHEDULER_TO_CLIENT,
}
# ``Stimulus.from_dict(msg)``: any message into the scheduler, and so on
_CHANNEL_OF: dict[type[Message], dict[str, Any]] = {
    Stimulus: SCHEDULER_EVENTS,
    InboxMessage: SCHEDULER_TO_WORKER,
    ClientEvent: SCHEDULER_TO_CLIENT,
}
