"""Receive buffers for big frames, apart from the framing that fills them because their
concern is memory, not bytes on the wire: recycled anonymous mmaps (page faults cost
more than the copy they replace), and frames that grow as their bytes arrive, so that a
header announcing gigabytes that never come costs no gigabytes.
"""

from __future__ import annotations

import ctypes
import mmap
import weakref

MMAP_THRESHOLD = 1 << 20  # frames this big get an anonymous mmap (no memset)


class BufferCache:
    """Recycles big receive buffers: recv into warm pages is ~1.5x faster than into
    fresh ones (page faults dominate).  Each buffer is exposed through a ctypes array
    over a cached anonymous mmap and only returns to the cache once that exporter is
    garbage, i.e. once no memoryview or ndarray of it remains.  Lock-free (GC-safe).
    """

    def __init__(self, max_idle_bytes: int = 256 << 20) -> None:
        self.max_idle_bytes = max_idle_bytes
        self.idle_bytes = 0
        self._free: dict[int, list[mmap.mmap]] = {}

    @staticmethod
    def size_class(size: int) -> int:
        """Round up to 1 MiB, then to quarter steps of powers of two (<= 25% slack)."""
        step = max(MMAP_THRESHOLD, 1 << max(size.bit_length() - 3, 0))
        return -(-size // step) * step

    def allocate(self, size: int) -> memoryview:
        capacity = self.size_class(size)
        return self.export(self._take(capacity) or mmap.mmap(-1, capacity), size)

    def export(self, area: mmap.mmap, size: int) -> memoryview:
        """The first ``size`` bytes of ``area`` (its length a size class), which returns
        to the cache once nothing refers to them."""
        exporter = (ctypes.c_char * len(area)).from_buffer(area)
        weakref.finalize(exporter, self._release, area)
        return memoryview(exporter).cast("B")[:size]

    def _take(self, capacity: int) -> mmap.mmap | None:
        try:
            area = self._free.get(capacity, []).pop()
        except IndexError:
            return None
        self.idle_bytes -= len(area)
        return area

    def clear(self) -> int:
        """Give the idle buffers back to the OS (under memory pressure); bytes freed."""
        freed, self.idle_bytes = self.idle_bytes, 0
        areas, self._free = self._free, {}
        for group in areas.values():
            for area in group:
                area.close()
        return freed

    def _release(self, area: mmap.mmap) -> None:
        if self.idle_bytes + len(area) <= self.max_idle_bytes:
            self.idle_bytes += len(area)
            self._free.setdefault(len(area), []).append(area)


BUFFER_CACHE = BufferCache()


def allocate(size: int) -> memoryview:
    if size >= MMAP_THRESHOLD:
        return BUFFER_CACHE.allocate(size)
    return memoryview(bytearray(size))


# a frame is given at most this much memory before its bytes arrive (then twice what
# has arrived): a header announcing 10 GB that sends nothing costs no 10 GB
FRAME_RESERVE = 64 << 20


def _growable(size: int) -> mmap.mmap:
    # private: a shared anonymous mapping is a shmem file of fixed size, and the pages
    # that mremap adds beyond it raise SIGBUS when touched
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)


class GrowingFrame:
    """The buffer of a frame bigger than ``FRAME_RESERVE``: ``FRAME_RESERVE`` at first,
    doubled each time it fills (``mremap``: the pages move, no byte is copied), up to
    the frame's size class.  An idle cached buffer of the full size is used at once."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.capacity = BufferCache.size_class(size)
        self.area = BUFFER_CACHE._take(self.capacity) or _growable(FRAME_RESERVE)

    def view(self) -> memoryview:
        return memoryview(self.area)[: min(len(self.area), self.size)]

    def grow(self, view: memoryview) -> memoryview:
        """``view`` is full: a view of the grown buffer (its start holds the same bytes)."""
        length = len(self.area)
        new = self.capacity if 2 * length >= self.size else 2 * length
        view.release()
        try:
            self.area.resize(new)
        except BufferError:  # a slice of it is still alive somewhere: copy instead
            bigger = _growable(new)
            bigger[:length] = self.area
            self.area = bigger
        return self.view()

    def finish(self, view: memoryview) -> memoryview:
        view.release()
        return BUFFER_CACHE.export(self.area, self.size)
