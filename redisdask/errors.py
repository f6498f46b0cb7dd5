"""The exceptions redisdask raises, in one tree (httpx style)::

    RedisDaskError
    ├── ClusterConnectionError (also ConnectionError)  Redis cannot be reached; the
    │                                                  client raises it for every lost
    │                                                  connection or timeout (connection)
    │   └── RedisRefusedError                          Redis refused the client's writes
    │                                                  (full: OOM; MISCONF; READONLY) for
    │                                                  longer than redis.down-deadline
    ├── ClusterNotRunningError (also TimeoutError)     no scheduler leads the cluster, or
    │                                                  no worker is registered, for longer
    │                                                  than client.no-scheduler-timeout
    ├── ConfigError (also ValueError)                  an invalid setting (redisdask.config)
    │   └── TLSSetupError                              a TLS file is missing, unreadable or
    │                                                  wrong (redisdask.security)
    ├── RedisServerNotFound (also FileNotFoundError)   no redis-server binary to embed
    ├── EmbeddedRedisError (also RuntimeError)         the embedded redis-server failed
    ├── ClusterRunningError (also RuntimeError)        a LocalCluster asked to start a
    │                                                  cluster that already runs there
    ├── SchemaError                                    the cluster in Redis is incompatible
    ├── EvictingRedisError                             Redis may evict the cluster's keys
    │                                                  (maxmemory-policy: redis_memory)
    ├── FencedError                                    a scheduler lost its lease
    ├── ProtocolError                                  a malformed stream entry or frame
    │   └── RecordError                                a malformed record in Redis (a task
    │                                                  hash, a workers entry): skipped,
    │                                                  dead-lettered, its futures err
    ├── CommError                                      peer-to-peer transport (redisdask.comm)
    │   ├── FramingError (also a ProtocolError)        a malformed frame from a peer
    │   ├── AuthenticationError                        the HMAC handshake failed
    │   ├── CommClosedError (also ConnectionError)     a peer cannot be reached
    │   │   ├── SecurityMismatchError                  one side wants TLS, the other not
    │   │   └── PeerTimeoutError                       a peer moved no byte for too long
    │   │                                              (comm.timeouts.tcp)
    │   └── SerializationError                         a value could not be (un)pickled
    ├── FutureCancelledError (also CancelledError)     the future's key was cancelled
    ├── FuturesCancelledError (also CancelledError)    wait() found cancelled futures
    ├── ClientClosedError (also RuntimeError)          a Lock, Queue, Variable, ... used
    │                                                  through a client that is closed
    ├── LeaseNotHeldError (also RuntimeError)          a Lock or Semaphore released by an
    │                                                  instance that holds no lease of it
    ├── DataUnavailableError                           no worker holds the data any more
    ├── TaskInterrupted                                a task raised a BaseException that
    │                                                  is no Exception (SystemExit, ...)
    ├── SchedulerRejectedError                         the scheduler refused to run a task
    │                                                  (a malformed submission, a cycle)
    ├── VersionMismatchError                           versions that cannot share pickles
    │                                                  (redisdask.versions)
    ├── KilledWorker                                   a task took too many workers down
    ├── WorkerUnresponsiveError                        workers that client.run (or a plugin
    │                                                  or upload) called did not answer in
    │                                                  its timeout, or could not be reached
    ├── WorkerStartTimeoutError (also TimeoutError)    wait_for_workers: fewer workers
    │                                                  arrived than asked for in its timeout
    ├── InvalidTransition (also RuntimeError)          a bug: a state machine was asked for
    │                                                  a move its table lacks; carries the
    │                                                  key's story (redisdask.state_machine)
    └── InvalidTaskState (also AssertionError)         a bug: the worker's state machine
                                                       broke an invariant (validate=True)

The classes defined elsewhere are importable from where the tree names them; those
defined here also from the modules that raise them (``redisdask.config.ConfigError``,
``EmbeddedRedisError`` and ``RedisServerNotFound`` from ``redisdask.deploy.embedded``).

``TypeError`` is raised as-is for an unpicklable function or argument at ``submit`` (and
``client.run``), and a task's own exception is re-raised as its original type by
``Future.result()`` (a function's by ``client.run``, with a note naming the worker).

Every message names the cause, the evidence and the next step.
"""

from __future__ import annotations

from concurrent.futures import CancelledError
from typing import Any


class RedisDaskError(Exception):
    """Base class of every error redisdask raises on its own account."""


class ClusterConnectionError(RedisDaskError, ConnectionError):
    """Redis could not be reached within the configured timeout."""


class RedisRefusedError(ClusterConnectionError):
    """Redis answers but refused a client's write for longer than ``redis.down-deadline``:
    it is full (``OOM``: used memory above ``maxmemory``), cannot persist (``MISCONF``),
    or is a replica (``READONLY``).  The message says which, and the fix."""


class ClusterNotRunningError(RedisDaskError, TimeoutError):
    """A client waited on a cluster that has had no leading scheduler, or no registered
    worker, for longer than ``client.no-scheduler-timeout``; its futures are kept."""


class ConfigError(RedisDaskError, ValueError):
    """An invalid setting; the message names the dotted key, the value and its source."""

    def __init__(self, message: str, key: str = "", value: Any = None, source: str = "") -> None:
        super().__init__(message)
        self.key, self.value, self.source = key, value, source


class RedisServerNotFound(RedisDaskError, FileNotFoundError):
    """No usable ``redis-server`` binary could be located."""


class EmbeddedRedisError(RedisDaskError, RuntimeError):
    """The embedded ``redis-server`` failed to start or misbehaved."""


class ClusterRunningError(RedisDaskError, RuntimeError):
    """A ``LocalCluster`` (or ``Client()`` with no address, which starts one) was given
    the name of a cluster whose scheduler leads in that Redis: a second scheduler and
    more workers would join it unasked."""


class SchemaError(RedisDaskError):
    """The cluster's keys in Redis were written by an incompatible redisdask."""


class EvictingRedisError(RedisDaskError):
    """Redis runs with a ``maxmemory-policy`` that may evict the cluster's keys (the
    lease, the workers' records, task records): no process works with it."""


class FencedError(RedisDaskError):
    """This scheduler's lease was taken over; its writes are refused."""


class ProtocolError(RedisDaskError):
    """A message on a stream or a socket does not follow the protocol."""


class RecordError(ProtocolError):
    """A record in Redis (a task hash, an entry of the workers hash) that does not follow
    ``docs/redis-schema.md``: a field missing, or one that cannot be decoded.  ``record``
    names the Redis key (and the hash field, for an entry of a hash), ``field`` the
    record's field, ``evidence`` a bounded ``repr`` of what was found there."""

    def __init__(self, record: str, field: str, evidence: str, problem: str) -> None:
        super().__init__(f"record {record!r}: field {field!r} {problem} (found {evidence})")
        self.record, self.field, self.evidence, self.problem = record, field, evidence, problem


class FutureCancelledError(RedisDaskError, CancelledError):
    """The future was cancelled (by ``cancel()``, or because its client closed)."""

    def __init__(self, key: str, reason: str = "it was cancelled") -> None:
        super().__init__(f"task {key!r} has no result because {reason}")
        self.key = key
        self.reason = reason


class FuturesCancelledError(RedisDaskError, CancelledError):
    """``wait`` found cancelled futures among those it waited for (as distributed's
    ``wait`` raises); ``errors`` holds a ``FutureCancelledError`` for each."""

    def __init__(self, errors: list[FutureCancelledError]) -> None:
        by_reason: dict[str, list[str]] = {}
        for error in errors:
            by_reason.setdefault(error.reason, []).append(error.key)
        lines = [f"{len(errors)} Future{'s' if len(errors) > 1 else ''} cancelled:", "Reasons:"]
        for reason, keys in sorted(by_reason.items(), key=lambda item: -len(item[1])):
            lines.append(f"{len(keys)} cancelled because {reason}: {keys[:10]}")
        super().__init__("\n".join(lines))
        self.errors = errors

    def __reduce__(self) -> tuple[type, tuple[list[FutureCancelledError]]]:
        return type(self), (self.errors,)


class ClientClosedError(RedisDaskError, RuntimeError):
    """A coordination primitive (``Lock``, ``Queue``, ``Variable``, ...) was used through
    a client that is closed; nothing was written."""


class LeaseNotHeldError(RedisDaskError, RuntimeError):
    """A ``Lock`` or ``Semaphore`` was released by an instance that holds no lease of it
    (never acquired there, released already, or its lease expired and was taken);
    distributed raises ``RuntimeError`` here, which this is too."""


class DataUnavailableError(RedisDaskError):
    """No live worker holds a key's data any more."""


class TaskInterrupted(RedisDaskError):
    """A task raised ``SystemExit``, ``KeyboardInterrupt`` or another ``BaseException``
    that is no ``Exception``.  Re-raised as itself it would end the client's program, so
    the task fails with this instead; the message names the original."""


class SchedulerRejectedError(RedisDaskError):
    """The scheduler refused to run a task: the message that submitted it was malformed
    (it was dead-lettered), or its graph had a cycle.  The message says which and why."""


class KilledWorker(RedisDaskError):
    """A task was running on ``allowed-failures + 1`` workers that died."""

    def __init__(
        self, task: str, deaths: list[dict[str, Any]] | None = None, msg: str = ""
    ) -> None:
        super().__init__(msg or f"task {task!r} was running on workers that died")
        self.task = task
        self.deaths = deaths or []


class WorkerUnresponsiveError(RedisDaskError):
    """Workers that ``client.run`` (or ``register_plugin``, ``upload_file``) called did
    not answer within its timeout, or could not be reached (dead, or not listening).

    ``unanswered`` maps each such worker's address to what happened; ``results`` holds
    the answers of the workers that did answer (values, or exceptions their call raised)."""

    def __init__(
        self,
        message: str,
        unanswered: dict[str, str] | None = None,
        results: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.unanswered = unanswered or {}
        self.results = results or {}


class WorkerStartTimeoutError(RedisDaskError, TimeoutError):
    """``client.wait_for_workers(n, timeout)``: fewer than ``n`` workers were registered
    when the timeout passed (distributed's name and attributes)."""

    def __init__(
        self, available_workers: int, expected_workers: int, timeout: float, message: str = ""
    ) -> None:
        super().__init__(
            message
            or f"only {available_workers} of {expected_workers} workers arrived within "
            f"{timeout:g} s"
        )
        self.available_workers = available_workers
        self.expected_workers = expected_workers
        self.timeout = timeout
