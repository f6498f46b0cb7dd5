"""One log format for every redisdask process::

    2026-11-23 15:44:26,692 WARNING worker worker-0[8976] redisdask.worker: ...

time, level, the process's role (``scheduler``, ``nanny``, ``worker``, ``demo``) and name,
its pid, the logger and the message.  A worker learns its name (its address, when none was
given) only once it listens, so the role is a mutable label that ``set_name`` updates;
lines already written keep the label they had.  A nanny writes its worker's lines into a
rotating file (``<local-directory>/redisdask-worker-space/<name>.log``) exactly as the
worker wrote them, and keeps their tail for the death record.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)-7s %(role)s[%(process)d] %(name)s: %(message)s"

_label = {"role": "redisdask", "name": ""}


class _RoleFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        name = _label["name"]
        record.role = f"{_label['role']} {name}" if name else _label["role"]
        return True


def setup(level: str, role: str, name: str | None = None) -> None:
    """Log to stderr in ``FORMAT`` at ``level`` (the process's root logger)."""
    _label.update(role=role, name=name or "")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(_RoleFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def set_name(name: str) -> None:
    """Name this process in every line from now on (a worker, once it has an address)."""
    _label["name"] = name
