"""How a worker runs its tasks: the state machine's ``Execute`` instructions, each in a
thread of a pool, and each run's end back on the event loop.

A run unpickles its task (``spec.run_spec``, with the worker's cache of functions), runs
it (an ``async def`` task on the event loop), and checks what it returned: that it
pickles, and, when it is small enough, pickles it once, so that the result travels in
its report into the task's record in Redis (``worker.inline-result-bytes``) and a
dependent on another worker reads it from there instead of from this one.  Nothing is
inlined while Redis is past its budget (``note_redis_memory``, from each heartbeat).

The pool holds ``nthreads`` threads for the tasks that compute and more for the tasks that
secede (``redisdask.secede``, ``worker_client``): each keeps its thread while it waits,
and the state machine bounds how many compute.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from redisdask import comm, context
from redisdask.spec import FunctionCache, run_spec
from redisdask.store import redis_memory
from redisdask.typenames import type_name
from redisdask.utils import pickling
from redisdask.utils.sizes import format_bytes
from redisdask.workers.coroutines import run_coroutine
from redisdask.workers.events import ExecuteFailureEvent, ExecuteSuccessEvent, StateMachineEvent
from redisdask.workers.failures import failure_event
from redisdask.workers.sizeof import sizeof

if TYPE_CHECKING:
    from redisdask.workers.worker import Worker

logger = logging.getLogger("redisdask.worker")

# threads the pool may hold beyond nthreads for seceded tasks (each waits in its thread)
MAX_SECEDED = 10_000

_STIMULI = itertools.count()  # makes the runs' stimulus ids unique (thread-safe)


class TaskRunner:
    """Held by the worker as ``worker.runner``."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.functions = FunctionCache()
        self.executor = ThreadPoolExecutor(
            worker.nthreads + MAX_SECEDED,
            thread_name_prefix="rd-task",
            initializer=context.bind_thread,
            initargs=(worker,),
        )
        # key -> when a pool thread began running it, and the runs that ended there, not
        # yet heard of on the loop (written by those threads): a run's Execute, its
        # thread's start and end, and ``_ran`` are apart while the loop holds the GIL
        self.began: dict[str, float] = {}
        self.ended: set[str] = set()
        self.inline_allowed = True  # Redis within the budget (note_redis_memory)

    def execute(self, key: str) -> None:
        state = self.worker.state
        ts = state.tasks[key]
        deps = {d.key: state.data[d.key] for d in ts.dependencies}
        run = self.executor.submit(self._run, key, ts.run_spec, deps)
        run.add_done_callback(self._hand_back)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    def start_lag(self, now: float) -> float:
        """How much later than its ``Execute`` the most delayed run began in its thread
        (not begun yet, or ended already: all of the time since).  A task of 50 µs waits
        tens of ms for its thread, or for the loop to hear of its end, while the loop
        handles a claim of hundreds: counted as its run, it looked overdue and every
        claim behind it was handed back (a tenth of a tree's tasks of no-ops)."""
        lag = 0.0
        for ts in self.worker.state.executing:
            if ts.began is not None:
                began = now if ts.key in self.ended else self.began.get(ts.key, now)
                lag = max(lag, began - ts.began)
        return lag

    def _hand_back(self, run: Future[StateMachineEvent]) -> None:
        """In the pool thread, as a run ends: its end goes to the event loop, in the
        loop's next turn (``run_in_executor`` took two: the asyncio future's, then its
        callback's, a tenth of a round trip)."""
        with contextlib.suppress(RuntimeError):  # (a closed loop: the worker is gone)
            self.worker.loop.call_soon_threadsafe(self._ran, run)

    def _ran(self, run: Future[StateMachineEvent]) -> None:
        """A run's end, on the event loop.  A run that failed once this worker began to
        close is not reported: its goodbye hands the task back (it runs elsewhere, as
        distributed's ``Reschedule``), for the error may be the closing's own doing (its
        client closed, ``get_client()`` refused) and must never become the result."""
        if run.cancelled():
            return
        event = run.result()
        self.began.pop(event.key, None)
        self.ended.discard(event.key)
        w = self.worker
        if isinstance(event, ExecuteFailureEvent) and w.status != "running":
            logger.info(
                "task %r failed while worker %s closes (%s): handed back, not erred",
                event.key,
                w.address,
                event.exception_text,
            )
            return
        w.handle(event)

    def _run(self, key: str, spec: bytes, deps: dict[str, Any]) -> StateMachineEvent:
        """Runs in a pool thread: the task, then the checks its result must pass."""
        w = self.worker
        start = self.began[key] = time.time()
        sid = f"execute-{start:.6f}-{next(_STIMULI)}"  # new: no chain of every run before
        context.start_task(key)
        try:
            value = run_spec(spec, deps, self.functions)
            if inspect.iscoroutine(value):  # an async def task: on the event loop
                value = run_coroutine(value, key, w.loop, lambda: w.status == "running")
            nbytes = sizeof(value)
            try:
                inline = self._pickled(value, nbytes)
            except comm.SerializationError as exc:
                raise TypeError(
                    f"the result of task {key!r} ({type(value).__qualname__}) cannot be pickled, "
                    f"so it could never leave this worker ({exc}); return picklable data"
                ) from None
        except BaseException as exc:
            return failure_event(key, exc, start, time.time(), sid, w.max_error_length)
        finally:
            context.end_task()
            self.ended.add(key)
        return ExecuteSuccessEvent(
            key, value, nbytes, type_name(type(value)), start, time.time(), sid, inline=inline
        )

    def _pickled(self, value: object, nbytes: int) -> bytes | None:
        """Check that ``value`` pickles (``comm.SerializationError`` if not), pickling it
        once: in one piece while it may fit ``inline_result_bytes`` (``nbytes``, its
        sizeof, says whether it may), and then, if it fits, that pickle travels with its
        report into the task's record (``keyspace.REDIS_COPY``); otherwise with its
        buffers out of band, copying none.  Nothing is inlined while Redis is past its
        budget (``note_redis_memory``)."""
        limit = self.worker.inline_result_bytes
        if self.inline_allowed and nbytes <= 2 * limit:
            try:
                blob = pickling.dumps_within(value, limit)
            except Exception:
                blob = None  # (comm.serialize says why, as for any result)
            if blob is not None:
                return blob if len(blob) <= limit else None
        comm.serialize(value)
        return None

    def note_redis_memory(self, info: Any) -> None:
        """Whether results may be inlined, from the heartbeat's ``INFO memory``: not
        once Redis's ``used_memory`` passes ``inline_results_redis_fraction`` of its
        ``maxmemory`` or ``inline_results_redis_bytes`` (results then stay on the
        workers, peer-to-peer, and Redis keeps room for the cluster's own records).
        Where INFO is refused, as before: inlined."""
        if not isinstance(info, dict):
            self.inline_allowed = True
            return
        w = self.worker
        memory = redis_memory.from_info(info)
        over = (memory.maxmemory > 0 and memory.fraction > w.inline_results_redis_fraction) or (
            w.inline_results_redis_bytes is not None and memory.used > w.inline_results_redis_bytes
        )
        if over == self.inline_allowed:  # it changed: say so, once
            logger.warning(
                "Redis uses %s (maxmemory %s): results are %s inlined into Redis "
                "(worker.inline-results-redis-fraction %g, worker.inline-results-redis-bytes %s)",
                format_bytes(memory.used), format_bytes(memory.maxmemory),
                "no longer" if over else "again", w.inline_results_redis_fraction,
                w.inline_results_redis_bytes,
            )  # fmt: skip
        self.inline_allowed = not over
