"""What a nanny and the worker process it starts agree on, so neither imports the other.

The nanny passes four environment variables to its worker (``worker_environment``); the
worker takes them out of its environment at start (``take_from_environment``), so the
processes its tasks start do not believe they have a nanny.  The exit-reason file is the
worker's word that it closed itself: written as the last step of ``Worker.close``, never by
a task, so an exit without it (a task's ``os._exit(0)``) is a death whatever its exit
code, and the nanny counts it and starts a new worker.  ``GRACEFUL_TIMEOUT`` is how
long a worker stopped by SIGTERM may spend moving its data: the worker closes after it,
and the nanny kills a worker still running a little later.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

GRACEFUL_TIMEOUT = 20.0  # seconds a worker stopped by SIGTERM may spend moving its data

NANNY_PID_ENV = "REDISDASK_NANNY_PID"  # the nanny's pid: a worker whose nanny died leaves
EXIT_REASON_ENV = "REDISDASK_EXIT_REASON_FILE"  # where the worker writes why it closed
ADDRESS_FILE_ENV = "REDISDASK_ADDRESS_FILE"  # where the worker writes its address
RESTARTS_ENV = "REDISDASK_RESTARTS"  # how many workers its nanny started before this one


@dataclass(frozen=True, slots=True)
class NannyLink:
    """What a worker knows of its nanny; all None (and 0) for a worker without one."""

    nanny_pid: int | None = None
    exit_reason_file: str | None = None
    address_file: str | None = None
    restarts: int = 0


def worker_environment(
    nanny_pid: int, exit_reason_file: Path, address_file: Path, restarts: int
) -> dict[str, str]:
    """The variables a nanny adds to the environment of the worker it starts."""
    return {
        NANNY_PID_ENV: str(nanny_pid),
        EXIT_REASON_ENV: str(exit_reason_file),
        ADDRESS_FILE_ENV: str(address_file),
        RESTARTS_ENV: str(restarts),
    }


def spill_directory_file(address_file: str | Path) -> Path:
    """Where the worker writes the path of its spill directory, next to its address file:
    its nanny removes that directory when the process dies (a worker that closes itself
    removes it on its own), so the next worker does not start on a disk it filled."""
    return Path(address_file).with_name("spill-directory")


def take_from_environment(environ: MutableMapping[str, str] | None = None) -> NannyLink:
    """Remove the nanny's variables from ``environ`` (``os.environ``) and return them."""
    env = os.environ if environ is None else environ
    pid = env.pop(NANNY_PID_ENV, "")
    restarts = env.pop(RESTARTS_ENV, "")
    return NannyLink(
        nanny_pid=int(pid) if pid.isdigit() else None,
        exit_reason_file=env.pop(EXIT_REASON_ENV, None),
        address_file=env.pop(ADDRESS_FILE_ENV, None),
        restarts=int(restarts) if restarts.isdigit() else 0,
    )
