"""One log format for every redisdask process::

    2026-11-23 15:44:26,692 WARNING worker worker-0[8976] redisdask.worker: ...

time, level, the process's role (``scheduler``, ``nanny``, ``worker``, ``exporter``,
``client``, ``demo``) and name, its pid, the logger and the message.  With
``logging.format: json`` (``REDISDASK__LOGGING__FORMAT=json``) each record is instead one
JSON object on one line, for log shippers::

    {"time": "2026-11-23T15:44:26.692Z", "level": "WARNING", "logger": "redisdask.worker",
     "role": "worker", "name": "worker-0", "pid": 8976, "message": "...", "exception": "..."}

(``exception``: the traceback text, only on records that carry one.)  A worker learns its
name (its address, when none was given) only once it listens, so the name is a mutable
label that ``set_name`` updates; lines already written keep the label they had.  A nanny
writes its worker's lines into a rotating file
(``<local-directory>/redisdask-worker-space/<name>.log``) exactly as the worker wrote
them, and keeps their tail for the death record.  Messages never hold a Redis password:
every URL is logged through ``store.urls.redact``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Literal

FORMAT = "%(asctime)s %(levelname)-7s %(role)s[%(process)d] %(name)s: %(message)s"
LogFormat = Literal["text", "json"]

_label = {"role": "redisdask", "name": ""}
_configured: list[bool] = []  # setup() ran: this process is one of ours (scheduler, worker…)


class _RoleFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        name = _label["name"]
        record.role = f"{_label['role']} {name}" if name else _label["role"]
        record.role_name = _label["role"], name
        return True


class JsonFormatter(logging.Formatter):
    """A record as one line of JSON (UTC time to the millisecond, ISO 8601)."""

    def format(self, record: logging.LogRecord) -> str:
        role, name = getattr(record, "role_name", (_label["role"], _label["name"]))
        seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line: dict[str, object] = {
            "time": f"{seconds}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "role": role,
            "name": name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str)  # one line: json escapes the newlines


def _handler(log_format: LogFormat) -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(FORMAT))
    handler.addFilter(_RoleFilter())
    return handler


def setup(level: str, role: str, name: str | None = None, log_format: LogFormat = "text") -> None:
    """Log to stderr in ``FORMAT`` (or JSON) at ``level`` (the process's root logger)."""
    _label.update(role=role, name=name or "")
    _configured[:] = [True]
    root = logging.getLogger()
    root.handlers[:] = [_handler(log_format)]
    root.setLevel(level)
    # warnings.warn's text, too, as JSON lines (not bare lines among them); an uncaught
    # exception's traceback stays Python's text: a nanny reads it from its worker's output
    logging.captureWarnings(log_format == "json")


def setup_client(level: str, log_format: LogFormat) -> None:
    """In a program that uses a ``Client``, whose logging is its own: JSON lines for the
    ``redisdask`` loggers when ``logging.format`` is json (through a handler on the
    ``redisdask`` logger, leaving the root logger and its handlers to the program), unless
    the program already put a handler there, or this is a process of ours (a client made
    in a task runs in a worker, which logs as a worker).  Text changes nothing: the
    program's logging shows our records as it shows any library's."""
    ours = logging.getLogger("redisdask")
    if log_format != "json" or ours.handlers or _configured:
        return
    _label.update(role="client", name="")
    ours.addHandler(_handler(log_format))
    ours.setLevel(level)
    ours.propagate = False  # one line per record, not a second one from the root's handler


def set_name(name: str) -> None:
    """Name this process in every line from now on (a worker, once it has an address)."""
    _label["name"] = name
