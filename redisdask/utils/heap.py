"""Keep CPython's cycle collector off a large, long-lived heap (the scheduler's tasks,
a worker's results).

A scheduler holding 1,000,000 tasks holds some 10,000,000 objects (a ``TaskState`` and
its sets each).  CPython runs a full (generation 2) collection, which scans every
tracked object, each time the heap has grown by a quarter: filling the state of a
1,000,000-task ``map`` made 34 of them, 42 s of 62 in all, the longest 5.8 s, so a
scheduler outlived its 5 s lease between two batches and was fenced out (a worker, its
heartbeat).  What survived a batch will mostly live on: ``Heap.settle`` after each batch
moves it into the permanent generation (``gc.freeze``, constant time), so collections
scan only what is newer.  The same fill then took 21 s, its longest batch 0.23 s.

Refcounting frees frozen objects as usual (a forgotten task is unlinked from the others);
only cyclic garbage waits, until a full collection: ``settle`` makes one when the frozen
heap is small enough to scan in a few tenths of a second and a minute has passed.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator

FULL_SCAN_OBJECTS = 1_000_000  # frozen objects a full collection may scan (~0.2 s)
FULL_SCAN_INTERVAL = 60.0  # seconds between full collections, at most one per interval


class Heap:
    """Call ``settle()`` between units of work (a batch, a heartbeat)."""

    def __init__(self) -> None:
        self.last_full = time.monotonic()

    def settle(self) -> None:
        gc.freeze()
        # (the time first: counting the frozen objects walks them)
        if time.monotonic() - self.last_full < FULL_SCAN_INTERVAL:
            return
        self.last_full = time.monotonic()
        if gc.get_freeze_count() < FULL_SCAN_OBJECTS:
            gc.unfreeze()
            gc.collect()
            gc.freeze()


@contextlib.contextmanager
def no_collections() -> Iterator[None]:
    """No automatic collection inside (building a large structure that is all kept:
    each collection would scan what was built so far, for nothing)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
