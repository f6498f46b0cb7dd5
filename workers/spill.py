"""The worker's data store: results in memory, the least recently used spilled to disk.

``SpillBuffer`` is a ``zict.Buffer`` (the library Dask's own spill buffer is built on):
a ``dict`` of values in memory in front of files in the worker's local directory.  When
the managed size (the sum of ``sizeof`` of the values in memory) passes ``target``
bytes, the least recently used values are pickled to disk until it is below again; a
value read back is loaded transparently (and becomes the most recently used).  The
worker's memory monitor also spills on its own (``evict``) when the process's memory,
whatever ``sizeof`` says, passes ``worker.memory.spill``.

A value that cannot be written (disk full, a file system error) stays in memory, and what
the write left on disk is removed: losing data to a failed spill would be worse than
using memory.  ``failure`` says why until a spill succeeds again; the error is logged once
per such episode, and the memory manager tells the cluster (``workers/memory.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import zict

from redisdask import comm
from redisdask.workers.sizeof import sizeof

logger = logging.getLogger("redisdask.worker.spill")

_COUNT = struct.Struct("!I")
_LENGTH = struct.Struct("!Q")


def dump(value: Any) -> list[Any]:
    """Frames of ``value`` (pickle protocol 5, buffers out of band) behind their lengths."""
    frames = comm.serialize(value)
    lengths = [memoryview(f).nbytes for f in frames]
    return [_COUNT.pack(len(frames)) + b"".join(_LENGTH.pack(n) for n in lengths), *frames]


def load(blob: bytes | bytearray | memoryview) -> Any:
    view = memoryview(blob)
    (count,) = _COUNT.unpack_from(view)
    offset = _COUNT.size
    lengths = [_LENGTH.unpack_from(view, offset + i * _LENGTH.size)[0] for i in range(count)]
    offset += count * _LENGTH.size
    frames = []
    for n in lengths:
        frames.append(view[offset : offset + n])
        offset += n
    return pickle.loads(frames[0], buffers=frames[1:])


class _SpillFailed(Exception):
    pass


class _SizedDisk(zict.Func[str, Any, Any]):
    """The files, knowing the size of each value they hold (however zict deletes one)."""

    def __init__(self, directory: Path, weight: Callable[[str, Any], int]) -> None:
        super().__init__(dump, load, zict.File(directory))
        self.weight = weight
        self.sizes: dict[str, int] = {}
        self.total = 0

    def __setitem__(self, key: str, value: Any) -> None:
        try:
            super().__setitem__(key, value)
        except OSError:
            self._remove_partial(key)  # a full disk gets back what the write took
            raise
        size = self.weight(key, value)
        self.total += size - self.sizes.get(key, 0)
        self.sizes[key] = size

    def _remove_partial(self, key: str) -> None:
        """Remove the file a failed write of ``key`` left (``zict.File`` names a key's
        files ``<quoted key>#<n>`` and records one only once it is written)."""
        files: zict.File = self.d  # type: ignore[assignment]
        prefix = quote(key, safe="") + "#"
        with contextlib.suppress(OSError), os.scandir(files.directory) as entries:
            for entry in entries:
                if entry.name.startswith(prefix) and entry.name not in files.filenames.values():
                    os.remove(entry.path)

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self.total -= self.sizes.pop(key, 0)


class SpillBuffer(zict.Buffer[str, Any]):
    """Results in memory up to ``target`` bytes, the rest on disk in ``directory``.

    ``known(key)`` is the size the worker already measured for the value it stores under
    ``key`` (its state machine's ``nbytes``, or None): a value is weighed by ``sizeof``
    only when nobody did, since sizing a DataFrame costs as much as a small task."""

    def __init__(self, directory: str | Path, target: float) -> None:
        self.directory = Path(directory)
        self.known: Callable[[str], int | None] = lambda key: None
        self.disk = _SizedDisk(self.directory, self._weight)
        super().__init__(fast={}, slow=self.disk, n=target, weight=self._weight)
        self.spill_count = 0
        self.spill_seconds = 0.0
        self.unspill_count = 0
        self.unspill_seconds = 0.0
        self.failure: str | None = None  # why the last spill failed, until one succeeds

    @property
    def managed_in_memory(self) -> int:
        return int(self.fast.total_weight)

    @property
    def spilled_bytes(self) -> int:
        """sizeof of the values on disk now."""
        return self.disk.total

    def fast_to_slow(self, key: str, value: Any) -> None:
        start = time.perf_counter()
        try:
            super().fast_to_slow(key, value)
        except Exception as exc:
            if self.failure is None:
                logger.error(
                    "could not spill %r to %s (%s); keeping it in memory. Free disk space "
                    "or give the worker another --local-directory",
                    key,
                    self.directory,
                    exc,
                )
            self.failure = _reason(exc)
            raise _SpillFailed(str(exc)) from exc
        self.failure = None
        self.spill_seconds += time.perf_counter() - start
        self.spill_count += 1

    def slow_to_fast(self, key: str) -> Any:
        start = time.perf_counter()
        try:
            value = super().slow_to_fast(key)
        except _SpillFailed:  # loaded, but what it was to push out stays in memory too
            value = self.fast[key]
        self.unspill_seconds += time.perf_counter() - start
        self.unspill_count += 1
        return value

    def __setitem__(self, key: str, value: Any) -> None:
        with contextlib.suppress(_SpillFailed):  # what failed to spill stays in memory
            super().__setitem__(key, value)

    def _weight(self, key: str, value: Any) -> int:
        known = self.known(key)
        return max(1, known if known is not None else sizeof(value))

    def evict(self) -> int:
        """Spill the least recently used value in memory; its size, or 0 if none could be."""
        try:
            _key, _value, weight = self.fast.evict()
        except (KeyError, _SpillFailed):
            return 0
        return int(weight)


def _reason(exc: Exception) -> str:
    """``No space left on device`` (an OS error's own words), or the exception."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return f"{type(exc).__name__}: {exc}"
