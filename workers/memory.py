"""The worker's memory manager (Dask's ``distributed/worker_memory.py``).

It owns what the worker does about its own memory: the data store (a ``dict``, or with a
memory limit a ``SpillBuffer`` spilling past ``target`` into a directory of its own), the
monitor loop (spill past ``spill`` of the process memory, pause the thread pool past
``pause``), and the memory figures a heartbeat carries.  It talks back to the worker
through callbacks only (``on_pause``, ``on_unpause``, ``on_spill_failed``, ``note``,
``in_memory_bytes``), so it never imports the worker driver and can be read and tested on
its own.

A worker whose spills fail (a full disk) can neither free memory nor, once paused, do any
work: left alone it would wait forever, and so would its clients.  So the manager says so
(``on_spill_failed``, which the worker turns into a ``spill-failed`` cluster event that
clients log as a warning): when the failures start, when the worker pauses while they last,
and every ``SPILL_FAILED_REPEAT`` seconds while it stays paused; the heartbeat carries the
error (``spill_error``) for ``redisdask status`` and for the nanny's death record.

Sizes and limits (``"4GB"``, ``auto``) and the cgroup's OOM kill count are read by
``redisdask.utils.sizes``, which knows nothing of workers.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any, Literal

import psutil

from redisdask import comm
from redisdask.utils.sizes import format_bytes
from redisdask.workers.spill import SpillBuffer

logger = logging.getLogger("redisdask.worker")

Fraction = float | Literal[False]

SPILL_FAILED_REPEAT = 30.0  # seconds between the reminders of a paused worker that cannot spill
M_TRIM_THRESHOLD = -1  # mallopt's parameter number (glibc's malloc.h)


def keep_large_blocks_apart() -> None:
    """Make this process's freed results go back to the system, as Dask's nanny does by
    starting its workers with ``MALLOC_TRIM_THRESHOLD_=65536`` (``distributed.yaml``'s
    ``nanny.pre-spawn-environ``).

    glibc's malloc raises its mmap threshold the first time a large block (a result of a
    few MB) is freed, and from then on makes such blocks on its heaps, where freeing them
    does not give the memory back: a worker that spilled or released its results kept
    their memory, and one past its pause mark stayed paused for good.  Setting the trim
    threshold (``mallopt``) turns that off.  A ``MALLOC_TRIM_THRESHOLD_`` in the
    environment is the user's choice, and stands; other C libraries are left alone.
    """
    if "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS)
        return
    mallopt(M_TRIM_THRESHOLD, 65536)


class WorkerMemoryManager:
    """Memory limits of one worker: its data store, spilling, pausing and metrics.

    ``on_pause(detail)`` / ``on_unpause(detail)`` are called when process memory crosses
    ``pause`` x limit (the worker stops or resumes starting tasks); ``on_spill_failed(news)``
    when the cluster should hear that spills fail (``news``: error, directory, managed,
    spilled, rss, memory_limit, paused); ``note(kind, detail)`` adds a line to the worker's
    story (``spill``); ``in_memory_bytes()`` is the managed size when the store is a plain
    dict (no limit: the worker's own ``nbytes`` count).
    """

    def __init__(
        self,
        *,
        memory_limit: int,
        target: Fraction,
        spill: Fraction,
        pause: Fraction,
        monitor_interval: float,
        local_directory: Path,
        label: str,
        on_pause: Callable[[str], None],
        on_unpause: Callable[[str], None],
        note: Callable[[str, str], None],
        in_memory_bytes: Callable[[], int],
        on_spill_failed: Callable[[dict[str, Any]], None] = lambda news: None,
    ) -> None:
        self.memory_limit = memory_limit
        self.target, self.spill, self.pause = target, spill, pause
        self.monitor_interval = monitor_interval
        self.label = label  # the worker's address, for log lines
        self.on_pause, self.on_unpause, self.note = on_pause, on_unpause, note
        self.in_memory_bytes = in_memory_bytes
        self.on_spill_failed = on_spill_failed
        self.paused = False
        # (paused, monotonic time) when the cluster was last told that spills fail
        self._told: tuple[bool, float] | None = None
        self.spill_directory: Path | None = None
        self.data = self._data_store(local_directory)
        self._process = psutil.Process()
        self._next_gc = 0.0  # garbage is collected at most once a second

    def _data_store(self, local_directory: Path) -> MutableMapping[str, Any]:
        """A dict, or with a memory limit a ``SpillBuffer`` that spills past ``target``
        into a directory of its own under the local directory (removed at close)."""
        if not self.memory_limit or not (self.target or self.spill):
            return {}
        local_directory.mkdir(parents=True, exist_ok=True)
        self.spill_directory = Path(tempfile.mkdtemp(prefix="worker-", dir=local_directory))
        target = self.memory_limit * self.target if self.target else math.inf
        return SpillBuffer(self.spill_directory, target)

    @property
    def monitoring(self) -> bool:
        """Whether ``monitor()`` has anything to do (a limit, and spill or pause on)."""
        return bool(self.memory_limit and (self.spill or self.pause))

    def close(self) -> None:
        """Close the store and remove the spill directory."""
        if isinstance(self.data, SpillBuffer):
            self.data.close()
        if self.spill_directory is not None:
            shutil.rmtree(self.spill_directory, ignore_errors=True)

    # ------------------------------------------------------------------ metrics

    def metrics(self) -> dict[str, int]:
        """Bytes: ``managed`` (results in memory, by sizeof), ``spilled`` (on disk),
        ``rss`` (the process), ``unmanaged`` (rss - managed), ``memory_limit``."""
        rss = self._process.memory_info().rss
        if isinstance(self.data, SpillBuffer):
            managed, spilled = self.data.managed_in_memory, self.data.spilled_bytes
        else:
            managed, spilled = self.in_memory_bytes(), 0
        return {
            "managed": managed,
            "spilled": spilled,
            "rss": rss,
            "unmanaged": max(0, rss - managed),
            "memory_limit": self.memory_limit,
            "spill_error": self.spill_failure,
        }

    @property
    def spill_failure(self) -> str | None:
        """Why spilling fails (``No space left on device``), until a spill succeeds."""
        return self.data.failure if isinstance(self.data, SpillBuffer) else None

    # ------------------------------------------------------------------ monitor

    async def monitor(self) -> None:
        """Every ``monitor_interval``: above ``spill`` x limit of process memory, spill
        the least recently used results until below ``target``; above ``pause``, pause
        (transfers go on) until below it again.  Runs until cancelled."""
        while True:
            await self.check()
            await asyncio.sleep(self.monitor_interval)  # a monitor is a timer by nature

    async def check(self) -> None:
        """One round of the monitor."""
        limit = self.memory_limit
        rss = self._process.memory_info().rss
        if self.spill and rss > self.spill * limit:
            await self._spill_until_below_target(rss)
            if time.monotonic() > self._next_gc:
                # freed values may sit in reference cycles, and idle receive buffers
                # are memory the worker can give back
                self._next_gc = time.monotonic() + 1.0
                await asyncio.to_thread(gc.collect)
                comm.BUFFER_CACHE.clear()
            rss = self._process.memory_info().rss
        paused = bool(self.pause) and rss > self.pause * limit
        failure = self.spill_failure
        if paused != self.paused:
            self.paused = paused
            logger.warning(
                "Worker %s is at %s of its %s memory limit (%.0f%%): %s%s",
                self.label,
                format_bytes(rss),
                format_bytes(limit),
                100 * rss / limit,
                "pausing its thread pool" if paused else "resuming",
                f"; it cannot spill: {failure}" if paused and failure else "",
            )
            detail = f"process memory {format_bytes(rss)} of {format_bytes(limit)}"
            (self.on_pause if paused else self.on_unpause)(detail)
        self._tell_spill_failure(failure, rss)

    def _tell_spill_failure(self, failure: str | None, rss: int) -> None:
        """Call ``on_spill_failed`` when spills start failing, when the worker pauses while
        they do, and every ``SPILL_FAILED_REPEAT`` s while it stays paused."""
        now = time.monotonic()
        told = self._told
        if failure is None:
            if told is not None:
                logger.warning("Worker %s can spill to disk again", self.label)
                self.note("spill", "spilling works again")
            self._told = None
            return
        if told is not None and (
            not self.paused or (told[0] and now - told[1] < SPILL_FAILED_REPEAT)
        ):
            return
        self._told = (self.paused, now)
        metrics = self.metrics()
        self.note("spill-failed", f"{failure}; {format_bytes(metrics['managed'])} in memory")
        self.on_spill_failed(
            {
                "error": failure,
                "directory": str(self.spill_directory),
                "managed": metrics["managed"],
                "spilled": metrics["spilled"],
                "rss": rss,
                "memory_limit": self.memory_limit,
                "paused": self.paused,
            }
        )

    async def _spill_until_below_target(self, rss: int) -> None:
        if not isinstance(self.data, SpillBuffer):
            return
        target = (self.target or self.spill or 1.0) * self.memory_limit
        freed = count = 0
        while rss - freed > target:
            spilled = self.data.evict()
            if not spilled:
                break
            freed += spilled
            count += 1
            if count % 10 == 0:
                await asyncio.sleep(0)  # let transfers and reports through
        if count:
            self.note("spill", f"{count} results ({format_bytes(freed)}) to disk")
            logger.info(
                "Worker %s: process memory %s is above %.0f%% of its limit: spilled %d "
                "results (%s) to disk",
                self.label,
                format_bytes(rss),
                100 * (self.spill or 0),
                count,
                format_bytes(freed),
            )
