"""The worker state machine's events (what happened: a task was claimed, a run ended, a
peer answered) and instructions (run a task, fetch from a peer, let a seceded thread go
on): the vocabulary of ``WorkerState.handle_stimulus`` (``workers/state.py``), between
the state machine and its driver (``workers/worker.py``).  Slotted dataclasses,
msgpack-serialisable through ``to_dict()``, so a recorded sequence of events replays
(``WorkerState.stimulus_log``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from redisdask.protocol import (
    AddKeys,
    MissingData,
    ReleasedKeys,
    StolenKeys,
    TaskErred,
    TaskFinished,
)

_REGISTRY: dict[str, type[_Record]] = {}


def _plain(value: Any) -> Any:
    """Convert to msgpack-native types: tuples/sets -> lists, dict keys -> str."""
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


class _Record:
    """Base of events and instructions: ``to_dict``/``from_dict`` keyed on class name."""

    __slots__ = ()
    # fields whose values are not serialised (dicts keep their keys, values become None)
    _excluded: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _REGISTRY[cls.__name__] = cls  # the slotted class made by @dataclass wins

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": type(self).__name__}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.name in self._excluded:
                value = dict.fromkeys(value) if isinstance(value, dict) else None
            out[f.name] = _plain(value)
        return out

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Any:
        cls = _REGISTRY[d["op"]]
        return cls(**cls._coerce({k: v for k, v in d.items() if k != "op"}))

    @classmethod
    def _coerce(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        return kwargs


class StateMachineEvent(_Record):
    __slots__ = ()
    stimulus_id: str


class Instruction(_Record):
    __slots__ = ()
    stimulus_id: str


@dataclass(slots=True)
class ComputeTaskEvent(StateMachineEvent):
    """The driver claimed ``key``; ``dependencies`` maps dep key -> (who_has, nbytes), and
    ``runs`` dep key -> the submission (or scatter) its value is of: its record's score,
    which a value here must be of to serve (None: a record without one)."""

    key: str
    run_spec: bytes
    priority: tuple[Any, ...]
    dependencies: dict[str, tuple[list[str], int]]
    stimulus_id: str
    resources: dict[str, float] = field(default_factory=dict)  # what a run holds here
    estimate: float | None = None  # its prefix's duration average (None: none yet)
    claim: tuple[int, int] | None = None  # the claim's workers stream entry (see FreeKeys)
    runs: dict[str, float | None] = field(default_factory=dict)

    @classmethod
    def _coerce(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs["priority"] = tuple(kwargs["priority"])
        kwargs["dependencies"] = {
            k: (list(who), int(nb)) for k, (who, nb) in kwargs["dependencies"].items()
        }
        return kwargs


@dataclass(slots=True)
class ExecuteSuccessEvent(StateMachineEvent):
    key: str
    value: object
    nbytes: int
    type: str
    start: float
    stop: float
    stimulus_id: str
    inline: bytes | None = None  # the value pickled, when small enough to travel in Redis
    _excluded: ClassVar[tuple[str, ...]] = ("value", "inline")


@dataclass(slots=True)
class ExecuteFailureEvent(StateMachineEvent):
    key: str
    exception: bytes
    traceback: bytes | None
    exception_text: str
    traceback_text: str
    start: float
    stop: float
    stimulus_id: str


@dataclass(slots=True)
class GatherDepSuccessEvent(StateMachineEvent):
    """A peer answered; requested keys absent from ``data`` were not there."""

    worker: str
    data: dict[str, object]
    nbytes: dict[str, int]
    stimulus_id: str
    _excluded: ClassVar[tuple[str, ...]] = ("data",)


@dataclass(slots=True)
class GatherDepNetworkFailureEvent(StateMachineEvent):
    worker: str
    keys: list[str]
    reason: str
    stimulus_id: str


@dataclass(slots=True)
class UpdateWhoHasEvent(StateMachineEvent):
    """The scheduler's (authoritative) holders for keys, typically missing ones."""

    who_has: dict[str, list[str]]
    stimulus_id: str


@dataclass(slots=True)
class FreeKeysEvent(StateMachineEvent):
    """Drop ``keys``; ``force`` (a cluster restart) drops also copies put here that the
    scheduler has not recorded yet.  ``seen``: the workers stream entry up to which the
    scheduler had read every claim when it decided; a key claimed here in a later entry
    is kept (the scheduler answers that claim when it reads it).  ``run``: only a copy
    of that run goes (a stale claim's)."""

    keys: list[str]
    stimulus_id: str
    force: bool = False
    seen: tuple[int, int] | None = None
    run: float | None = None  # only a copy of this run (a score) goes


@dataclass(slots=True)
class KeysRecordedEvent(StateMachineEvent):
    """The scheduler recorded this worker as a holder of ``keys`` that a client scattered
    here: a later ``free-keys`` of them is about these copies."""

    keys: list[str]
    stimulus_id: str


@dataclass(slots=True)
class PutDataEvent(StateMachineEvent):
    data: dict[str, object]
    nbytes: dict[str, int]
    stimulus_id: str
    _excluded: ClassVar[tuple[str, ...]] = ("data",)


@dataclass(slots=True)
class AcquireReplicasEvent(StateMachineEvent):
    """The scheduler asks for a copy of keys held elsewhere (``client.replicate``)."""

    who_has: dict[str, list[str]]
    stimulus_id: str


@dataclass(slots=True)
class PauseEvent(StateMachineEvent):
    """Memory is past ``pause``: start no task, and hand back the claimed tasks that have
    not started (as a retiring worker does), so that other workers run them."""

    stimulus_id: str


@dataclass(slots=True)
class UnpauseEvent(StateMachineEvent):
    stimulus_id: str


@dataclass(slots=True)
class RetireAbortedEvent(StateMachineEvent):
    """The scheduler stopped this worker's retirement (no worker stayed to take its
    results): claim again."""

    stimulus_id: str


@dataclass(slots=True)
class RetireEvent(StateMachineEvent):
    """This worker is leaving gracefully: claim nothing more and hand back the claimed
    tasks that have not started; the running ones finish and their results stay here
    until the scheduler has copied them elsewhere."""

    stimulus_id: str


@dataclass(slots=True)
class StealRequestEvent(StateMachineEvent):
    """The scheduler asks for ``keys`` back, for ``thief`` (work stealing,
    ``redisdask.scheduler.stealing``): the claims of them that have not started here are given
    back (``StolenKeys``: they will not run here), the others refused."""

    keys: list[str]
    thief: str
    stimulus_id: str


@dataclass(slots=True)
class RunsOverdueEvent(StateMachineEvent):
    """The driver's prompt once ``give_back_delay`` says so: every thread runs a task past
    any expectation (``durations.stuck_in``: a straggler, or a prefix whose estimate
    said next to nothing), so the claims held ready here behind them would wait for an
    unknown time; they are handed back (``ReleasedKeys``) for other workers to run, but
    the next one for each thread.
    ``now`` is the driver's clock, ``horizon`` its claim horizon."""

    horizon: float
    now: float
    stimulus_id: str


@dataclass(slots=True)
class ClaimsHandledEvent(StateMachineEvent):
    """The driver handled the tasks its claim brought, or will not claim now: the
    fetched dependencies of ``keys``, those kept (``lingers``) when the claim was sent,
    go unless a task needs them (one kept since then waits for the next claim)."""

    keys: list[str]
    stimulus_id: str


@dataclass(slots=True)
class SecedeEvent(StateMachineEvent):
    """The thread running ``key`` left the pool (``secede()``, ``worker_client``): it
    waits on other tasks and no longer counts against ``nthreads``."""

    key: str
    stimulus_id: str


@dataclass(slots=True)
class RejoinEvent(StateMachineEvent):
    """The seceded thread of ``key`` wants to count again (``rejoin()``): it waits for
    a free slot, which ``Rejoin`` grants."""

    key: str
    stimulus_id: str


@dataclass(slots=True)
class Execute(Instruction):
    """Run ``tasks[key].run_spec`` in a thread; answer with ExecuteSuccess/FailureEvent."""

    key: str
    stimulus_id: str


@dataclass(slots=True)
class GatherDep(Instruction):
    """Fetch ``keys`` from ``worker``; answer with GatherDepSuccess/NetworkFailureEvent."""

    worker: str
    keys: set[str]
    total_nbytes: int
    stimulus_id: str

    @classmethod
    def _coerce(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs["keys"] = set(kwargs["keys"])
        return kwargs


@dataclass(slots=True)
class Rejoin(Instruction):
    """Let the thread of ``key``, blocked in ``rejoin()``, go on: it holds a slot again
    (or it never seceded, or its task is gone: it goes on at once)."""

    key: str
    stimulus_id: str


# What the machine tells the scheduler: the protocol's worker -> scheduler messages
# themselves, which the driver sends as they are (one definition of each field).
Report = TaskFinished | TaskErred | MissingData | AddKeys | ReleasedKeys | StolenKeys
