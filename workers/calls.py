"""What a client asks of a worker directly, over the worker's authenticated TCP server
(``redisdask.comm``), besides data: ``run`` a function (``client.run``) and
``sync-plugins`` (``register_plugin``, ``unregister_worker_plugin``, ``upload_file``:
the worker re-reads the cluster's plugins and uploads from Redis and applies what
changed).  The client side is ``redisdask/client/worker_calls.py``.

Replies are ``{"status": "OK"}`` (for ``run`` with the pickled result as frames) or
``{"status": "error", "exception_text", "traceback_text"}`` with two frames: the
cloudpickled exception and its cloudpickled tblib traceback (empty when it would not
pickle), which the client re-raises.

User code runs off the event loop where it may block: a plain function in a daemon thread
of its own (the worker keeps heartbeating and serving; a function that never returns
does not keep the process from exiting), an ``async def`` one on the worker's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import threading
import traceback as tb_module
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from redisdask import comm
from redisdask.errors import TaskInterrupted
from redisdask.typenames import function_name
from redisdask.workers.failures import exception_blobs

if TYPE_CHECKING:
    from redisdask.workers.worker import Worker

logger = logging.getLogger("redisdask.worker")

OPS = ("run", "sync-plugins")
_ASYNCIO = os.path.dirname(asyncio.__file__)
Reply = tuple[dict[str, Any], list[Any]]


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the first frame that is neither this module's nor asyncio's:
    where the user's code raised, without the machinery that called it."""
    while tb is not None and (
        tb.tb_frame.f_code.co_filename == __file__
        or tb.tb_frame.f_code.co_filename.startswith(_ASYNCIO)
    ):
        tb = tb.tb_next
    return tb


def error_reply(exc: BaseException) -> Reply:
    exc = exc.with_traceback(_user_frames(exc.__traceback__) or exc.__traceback__)
    text = "".join(tb_module.format_exception_only(type(exc), exc)).strip()
    tb_text = "".join(tb_module.format_exception(type(exc), exc, exc.__traceback__))
    exc_blob, tb_blob = exception_blobs(exc, text)
    header = {"status": "error", "exception_text": text, "traceback_text": tb_text}
    return header, [exc_blob, tb_blob or b""]


def _not_interrupting(exc: BaseException, what: str) -> BaseException:
    """``SystemExit`` and the other ``BaseException``s that are no ``Exception`` would end
    the worker (or the client's program, where re-raised): carried as an error instead."""
    if isinstance(exc, Exception):
        return exc
    return TaskInterrupted(
        f"{what} raised {exc!r}, which is no Exception: it was caught on the worker; raise "
        "an Exception instead"
    ).with_traceback(exc.__traceback__)


async def in_thread(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` in a daemon thread of its own; its result or error."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # the awaiting side was cancelled
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def target() -> None:
        try:
            result, error = function(*args, **kwargs), None
        except BaseException as exc:
            result, error = None, _not_interrupting(exc, function_name(function))
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=target, daemon=True, name=f"rd-call-{function_name(function)}").start()
    return await future


async def call_user(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call user code: an ``async def`` on this loop, anything else in a thread (what it
    returns is awaited here if it is awaitable)."""
    try:
        if inspect.iscoroutinefunction(function):
            return await function(*args, **kwargs)
        result = await in_thread(function, *args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        raise _not_interrupting(exc, function_name(function)) from None


def _takes(function: Any, name: str) -> bool:
    """Whether ``function`` has a parameter called ``name`` (distributed's ``has_arg``)."""
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False
    param = params.get(name)
    return param is not None and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)


async def handle(worker: Worker, op: str, header: dict[str, Any], frames: list[Any]) -> Reply:
    if op == "run":
        return await _run(worker, header, frames)
    errors = await worker.plugin_host.sync(worker)
    failed = errors.get((str(header.get("kind")), str(header.get("name"))))
    return error_reply(failed) if failed is not None else ({"status": "OK"}, [])


async def _run(worker: Worker, header: dict[str, Any], frames: list[Any]) -> Reply:
    try:
        function, args, kwargs = comm.deserialize(frames)
    except Exception as exc:  # e.g. it names a module this worker cannot import
        return error_reply(exc)
    kwargs = dict(kwargs)
    if _takes(function, "dask_worker"):
        kwargs["dask_worker"] = worker
    name = function_name(function)
    logger.info("Run out-of-band function %r", name)
    call = call_user(function, *args, **kwargs)
    if not header.get("wait", True):
        worker.plugin_host.in_background(call, name)
        return {"status": "OK"}, []
    try:
        result = await call
    except Exception as exc:
        logger.warning("client.run of %s failed on this worker", name, exc_info=True)
        return error_reply(exc)
    try:
        return {"status": "OK"}, comm.serialize(result)
    except comm.SerializationError as exc:
        return error_reply(
            TypeError(
                f"the result of {name} on worker {worker.address} ({type(result).__qualname__}) "
                f"cannot be pickled, so it cannot reach the client ({exc}); return picklable "
                "data"
            )
        )
