"""Why did my worker die?  The nanny's answer, from what it saw of the process's end.

``classify(WorkerExit)`` is pure: the exit status, what the nanny itself did (a kill for
memory or a hang), the last memory figures, the cgroup's OOM-kill count and the tail of
the worker's log go in; a kind and a sentence come out:

* ``graceful``  the worker closed itself (retired, SIGTERM, its lifetime ended): exit code
  0 *and* the reason it wrote as the last step of ``Worker.close`` (``exit_reason``), which
  a task cannot write; an exit 0 without it (a task's ``os._exit(0)``) is a death;
* ``memory``    killed by its nanny past ``worker.memory.terminate``, or by the kernel's
  OOM killer (the cgroup's ``oom_kill`` count rose, or SIGKILL near the limit);
* ``hung``      alive but silent and idle past ``worker.hang-timeout``: killed, restarted;
* ``signal``    killed by a signal (SIGKILL from someone else, SIGSEGV from a crash ...);
* ``exception`` exited with a Python traceback on its stderr (the traceback is kept);
* ``exit-code`` any other exit status, 0 included when the worker did not close itself.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

from redisdask.utils.sizes import format_bytes

NEAR_LIMIT = 0.9  # an unexplained SIGKILL at this fraction of the limit is taken for OOM


@dataclass(slots=True)
class WorkerExit:
    """What a nanny saw of one worker process's end."""

    returncode: int
    killed_for: str | None = None  # "memory" or "hung" when the nanny killed it
    rss: int | None = None  # the last process memory measured
    memory_limit: int = 0
    terminate: float | None = None  # the fraction the nanny kills at
    silent_for: float | None = None  # seconds without a heartbeat, for "hung"
    log_tail: list[str] = field(default_factory=list)
    exit_reason: str | None = None  # what the worker wrote as it closed itself (None: it
    # did not: whatever its exit code, it died)
    oom_kills_before: int | None = None
    oom_kills_after: int | None = None
    spill_error: str | None = None  # why its spills failed, from its last heartbeat


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _memory(ex: WorkerExit) -> str:
    if ex.rss is None:
        return "memory unknown"
    if not ex.memory_limit:
        return f"process memory {format_bytes(ex.rss)}"
    return (
        f"process memory {format_bytes(ex.rss)}, {100 * ex.rss / ex.memory_limit:.0f}% of "
        f"its {format_bytes(ex.memory_limit)} limit"
    )


def traceback_of(log_tail: list[str]) -> str | None:
    """The last Python traceback in the log tail, if any."""
    starts = [i for i, line in enumerate(log_tail) if line.startswith("Traceback (most recent")]
    if not starts:
        return None
    return "\n".join(log_tail[starts[-1] :])


def classify(ex: WorkerExit) -> tuple[str, str]:
    """``(kind, reason)``: see the module docstring.  A worker that died of memory while
    its spills failed says so: the full disk is the cause to fix, not the task."""
    kind, reason = _classify(ex)
    if kind == "memory" and ex.spill_error:
        reason += f"; could not spill: {ex.spill_error}"
    return kind, reason


def _classify(ex: WorkerExit) -> tuple[str, str]:
    if ex.killed_for == "memory":
        share = f"{100 * (ex.terminate or 0):.0f}%"
        return "memory", f"killed by its nanny: {_memory(ex)}, past the {share} terminate mark"
    if ex.killed_for == "hung":
        silent = f"{ex.silent_for:.1f} s" if ex.silent_for is not None else "too long"
        return "hung", f"hung: no heartbeat for {silent} while idle; killed by its nanny"
    if ex.returncode == 0 and ex.exit_reason:
        return "graceful", f"closed: {ex.exit_reason}"
    if ex.returncode < 0:
        name = signal_name(-ex.returncode)
        oom = (
            ex.oom_kills_before is not None
            and ex.oom_kills_after is not None
            and ex.oom_kills_after > ex.oom_kills_before
        )
        if -ex.returncode == signal.SIGKILL and oom:
            counts = f"{ex.oom_kills_before} -> {ex.oom_kills_after}"
            return "memory", (
                f"killed by the kernel's OOM killer (SIGKILL; the cgroup's oom_kill count "
                f"went {counts}); {_memory(ex)}"
            )
        near = ex.rss is not None and ex.memory_limit and ex.rss >= NEAR_LIMIT * ex.memory_limit
        if -ex.returncode == signal.SIGKILL and near:
            return "memory", (
                f"killed by SIGKILL at {_memory(ex)}: most likely the kernel's OOM killer"
            )
        description = signal.strsignal(-ex.returncode) or name
        return "signal", f"killed by {name} ({description.lower()}); {_memory(ex)}"
    tb = traceback_of(ex.log_tail)
    if tb is not None:
        last = tb.strip().splitlines()[-1]
        return "exception", f"exited with code {ex.returncode} after an exception: {last}"
    if ex.returncode == 0:
        return "exit-code", (
            "exited with code 0 without closing itself: a task (or a library it called) "
            f"ended the process, e.g. with os._exit(0); {_memory(ex)}"
        )
    return "exit-code", f"exited with code {ex.returncode}; {_memory(ex)}"


def evidence(ex: WorkerExit, kind: str, restarted: bool, last_heartbeat: dict[str, Any]) -> dict:
    """The ``evidence`` of a nanny's death report (kept in the death record)."""
    return {
        "kind": kind,
        "exit_code": ex.returncode if ex.returncode >= 0 else None,
        "signal": signal_name(-ex.returncode) if ex.returncode < 0 else None,
        "rss": ex.rss,
        "memory_limit": ex.memory_limit,
        "oom_kills": [ex.oom_kills_before, ex.oom_kills_after],
        "traceback": traceback_of(ex.log_tail) if kind == "exception" else None,
        "log_tail": list(ex.log_tail),
        "restarted": restarted,
        "last_heartbeat": last_heartbeat,
    }
