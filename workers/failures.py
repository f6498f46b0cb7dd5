"""How a task's error leaves its worker: as distributed's ``error_message`` makes it.

* The traceback starts where the user's code is: the frames of the machinery that called
  it (the worker, ``run_spec``, the thread pool, asyncio) are dropped from its head, as
  distributed's ``get_traceback`` drops its worker's, so ``future.traceback()`` and the
  traceback ``result()`` or ``gather()`` re-raise hold the task function's frames.
* A function pickled by value (defined in ``__main__``, a notebook, a module registered
  with ``cloudpickle.register_pickle_by_value``) runs on the worker as code whose file is
  ``<dynamic-code>``; its frames are named by the file of the module it came from
  (``__file__`` of the globals cloudpickle carries), so a traceback shows its lines.
* An exception whose message is longer than ``admin.max-error-length`` (distributed's
  ``distributed.admin.max-error-length``, 10,000 characters) is replaced by one of the
  same type holding ``"Long error message"`` and the first that many characters
  (distributed's ``truncate_exception``), and a pickled traceback longer than that is not
  sent (the client then has none, as in distributed).
* A ``BaseException`` that is no ``Exception`` (``sys.exit()`` in a task) becomes
  ``TaskInterrupted``: see docs/dask-differences.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import traceback as tb_module
from types import TracebackType
from typing import Any

import cloudpickle

import redisdask
from redisdask.errors import TaskInterrupted
from redisdask.workers.events import ExecuteFailureEvent

MAX_ERROR_LENGTH = 10_000  # distributed.admin.max-error-length's default

_DYNAMIC = "<dynamic-code>"  # cloudpickle's co_filename for code pickled by value
# the frames at the head of a task's traceback that are not the user's: asyncio's task
# steps and the pool thread's future, the worker and run_spec (redisdask/workers, which
# is workers/ in a source checkout; redisdask/spec.py), an async task's wrapper
# (context.py), dask's scheduler in a task and its graph's nodes (client/)
_PACKAGE = os.path.dirname(redisdask.__file__)
_MACHINERY = (
    os.path.join(os.path.dirname(asyncio.__file__), ""),
    os.path.join(os.path.dirname(concurrent.futures.__file__), ""),
    os.path.join(os.path.dirname(__file__), ""),
    os.path.join(_PACKAGE, "spec.py"),
    os.path.join(_PACKAGE, "context.py"),
    os.path.join(_PACKAGE, "client", "worker_client.py"),
    os.path.join(_PACKAGE, "client", "dask_graph.py"),
)
_TASK_SPEC = os.path.join("dask", "_task_spec")  # dask's node calling the function


def _machinery(filename: str) -> bool:
    return filename.startswith(_MACHINERY) or _TASK_SPEC in filename


def user_traceback(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` from its first frame that is not the machinery's that ran the task (all
    of ``tb`` if every frame is: the failure was the machinery's, unpickling say)."""
    head = tb
    while head is not None and _machinery(head.tb_frame.f_code.co_filename):
        head = head.tb_next
    return head or tb


def truncate_exception(exc: BaseException, limit: int = MAX_ERROR_LENGTH) -> BaseException:
    """``exc`` if its message is at most ``limit`` characters; else one of its type with
    ``"Long error message"`` and the message's first ``limit`` characters (distributed's
    ``truncate_exception``), keeping the traceback."""
    text = str(exc)
    if len(text) <= limit:
        return exc
    try:
        short: BaseException = type(exc)("Long error message", text[:limit])
    except Exception:  # a constructor that takes other arguments
        short = Exception("Long error message", type(exc), text[:limit])
    return short.with_traceback(exc.__traceback__)


def _traceback_dict(tb: TracebackType | None) -> dict[str, Any] | None:
    """tblib's picklable form of ``tb``, its by-value frames named by their module's file
    (None without a traceback, or where tblib fails: too deep a recursion)."""
    from tblib import Traceback

    try:
        tree = Traceback(tb).as_dict() if tb is not None else None
    except Exception:
        return None
    node = tree
    while node is not None:
        frame = node["tb_frame"]
        filename = frame["f_globals"].get("__file__")
        if frame["f_code"]["co_filename"] == _DYNAMIC and isinstance(filename, str):
            frame["f_code"]["co_filename"] = filename
        node = node["tb_next"]
    return tree


def _pickled_exception(exc: BaseException, text: str) -> bytes:
    """The cloudpickled exception with its ``__cause__`` and ``__context__`` (tblib's
    pickling, as distributed's ``error_message``; its own traceback travels apart), or a
    ``RuntimeError`` carrying ``text`` when it does not pickle, or does not unpickle."""
    from tblib import pickling_support

    tb, exc.__traceback__ = exc.__traceback__, None
    try:
        pickling_support.install(exc)  # (and the exceptions it chains)
        blob = cloudpickle.dumps(exc)
        cloudpickle.loads(blob)
    except Exception:
        blob = cloudpickle.dumps(
            RuntimeError(f"{text} (the original exception could not be pickled)")
        )
    finally:
        exc.__traceback__ = tb
    return blob


def _pickled_traceback(tree: dict[str, Any] | None, limit: int | None) -> bytes | None:
    """The cloudpickled tblib traceback; None without one, when it does not pickle (a
    frame's globals), or when it is longer than ``limit`` bytes."""
    try:
        blob = cloudpickle.dumps(tree) if tree is not None else None
    except Exception:
        return None
    return None if blob is None or (limit is not None and len(blob) > limit) else blob


def exception_blobs(exc: BaseException, text: str) -> tuple[bytes, bytes | None]:
    """The cloudpickled exception and its cloudpickled tblib traceback (None when that
    does not pickle): what the client re-raises."""
    return _pickled_exception(exc, text), _pickled_traceback(
        _traceback_dict(exc.__traceback__), None
    )


def _traceback_text(tree: dict[str, Any] | None, exc: BaseException) -> str:
    """The traceback's text as ``traceback.format_exception`` writes it, its lines read
    from the files the frames name (by-value frames: their module's)."""
    entries = []
    node = tree
    while node is not None:
        code = node["tb_frame"]["f_code"]
        entries.append(
            tb_module.FrameSummary(code["co_filename"], node["tb_lineno"], code["co_name"])
        )
        node = node["tb_next"]
    head = ["Traceback (most recent call last):\n"] if entries else []
    body = tb_module.StackSummary.from_list(entries).format()
    return "".join([*head, *body, *tb_module.format_exception_only(type(exc), exc)])


def failure_event(
    key: str,
    exc: BaseException,
    start: float,
    stop: float,
    sid: str,
    max_error_length: int = MAX_ERROR_LENGTH,
) -> ExecuteFailureEvent:
    """The failure of task ``key`` as its worker reports it: the exception (truncated) and
    its traceback (the user's frames) pickled so the client can re-raise both, and their
    text for Redis (``redisdask inspect task`` shows it)."""
    original = type(exc).__name__
    exc = truncate_exception(exc, max_error_length)
    exc = exc.with_traceback(user_traceback(exc.__traceback__))
    if not isinstance(exc, Exception):  # SystemExit & co must not end the client's program
        summary = "".join(tb_module.format_exception_only(type(exc), exc)).strip()
        exc = TaskInterrupted(
            f"task {key!r} raised {summary or original}, which is no Exception: it "
            "was caught on the worker and the task failed (sys.exit() or an interrupt in "
            "task code); raise an Exception to fail a task"
        ).with_traceback(exc.__traceback__)
    text = "".join(tb_module.format_exception_only(type(exc), exc)).strip()
    tree = _traceback_dict(exc.__traceback__)
    return ExecuteFailureEvent(
        key,
        _pickled_exception(exc, text),
        _pickled_traceback(tree, max_error_length),
        text,
        _traceback_text(tree, exc),
        start,
        stop,
        sid,
    )
