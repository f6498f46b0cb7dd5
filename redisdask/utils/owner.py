"""The processes a ``LocalCluster`` starts end with the process that started them.

A LocalCluster belongs to its process, as distributed's does.  When that process exits
without closing it, its exit handlers close it (``deploy/cluster.py``); when it is killed,
nothing runs in it, so each process it started watches for that instead: it holds the
read end of a pipe whose write end only the owner holds (``OWNER_FD_ENV``), and the read
returns when the kernel closes that end at the owner's death (distributed's
``_immediate_exit_when_closed`` does the same).  The process then kills what it started
(a nanny, its worker), stops the owner's embedded Redis if told of one (the scheduler:
``OWNED_REDIS_ENV``), and exits.  Without this they ran on, orphans, for good.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

import psutil

logger = logging.getLogger("redisdask.owner")

OWNER_FD_ENV = "REDISDASK_OWNER_FD"  # the pipe's read end, inherited (``pass_fds``)
# the owner's embedded redis-server: "<pid> <create time>" (a pid alone may name another
# process by then; one restarted since is not known to the scheduler, and is left)
OWNED_REDIS_ENV = "REDISDASK_OWNED_REDIS"


def owned_redis(pid: int) -> dict[str, str]:
    """The environment that tells a scheduler to stop redis-server ``pid`` with it."""
    return {OWNED_REDIS_ENV: f"{pid} {psutil.Process(pid).create_time()!r}"}


class Ownership:
    """The owner's side: the pipe its processes watch (``pass_fds=(ownership.fd,)``)."""

    def __init__(self) -> None:
        self.fd, self._write = os.pipe()  # (neither inheritable: pass_fds hands ``fd`` on)

    def environment(self) -> dict[str, str]:
        return {OWNER_FD_ENV: str(self.fd)}

    def close(self) -> None:
        """Once the processes are stopped (closing the write end tells them to go)."""
        for fd in (self._write, self.fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fd = self._write = -1


def watch_owner() -> None:
    """In a process a LocalCluster started: end with its owner (see the module).  The
    variable is taken out of this process's environment, so that the processes it starts
    (a nanny's worker, which has the fd closed) do not read a number that names nothing,
    or another file."""
    text = os.environ.pop(OWNER_FD_ENV, "")
    if not text.isdigit():
        return
    try:
        os.set_inheritable(int(text), False)  # (not to a task's subprocess)
    except OSError as exc:  # (a variable copied into an environment, not inherited)
        logger.warning("%s=%s names no open file here (%s): not watched", OWNER_FD_ENV, text, exc)
        return
    threading.Thread(target=_wait, args=(int(text),), daemon=True, name="owner-watch").start()


def _wait(fd: int) -> None:
    try:
        while os.read(fd, 1):  # nothing is written: b"" once the owner's end is closed
            pass
    except OSError as exc:
        logger.warning("cannot watch the process that started this one (fd %d): %s", fd, exc)
        return
    logger.error("the process that started this one (its LocalCluster's) is gone, or closed "
                 "that cluster without stopping this process: stopping")  # fmt: skip
    _end()


def _end() -> None:
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()
    pid, _, created = os.environ.get(OWNED_REDIS_ENV, "").partition(" ")
    if pid.isdigit():
        with contextlib.suppress(psutil.Error, ValueError):
            server = psutil.Process(int(pid))
            if server.create_time() == float(created):  # (that process, not its pid's heir)
                server.terminate()
    os._exit(1)
