"""How many bytes a value holds, cheaply.

Used for the ``nbytes`` reported to the scheduler (placement by data weighs it), the
transfer counters and the spill buffer's managed memory.  Where the process has imported
dask (a task of a dask graph does, when its node is unpickled), values are sized by
``dask.sizeof.sizeof``, as a Dask worker sizes them: its rules per type are what Dask's
figures mean (bytes moved, managed memory), and they are cheap where a generic rule is
not: a DataFrame's deep ``memory_usage`` builds a Series of per-column sizes (about 1 ms
for a 3-column frame, five times dask's rule), and a shuffle's ``ShuffleGroupResult`` (a
dict of frames with its own ``__sizeof__``) was counted twice, once through
``__sizeof__`` and once item by item.  A process that never imported dask does not import
it here (its start-up cost, for workers that run plain functions), and uses the fast
paths below.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

_dask_sizeof: Callable[[Any], int] | None = None


def sizeof(value: Any) -> int:
    if isinstance(value, bytes | bytearray | memoryview):
        return len(value)
    if "dask" in sys.modules:
        return _by_dask(value)
    return _fallback(value)


def _by_dask(value: Any) -> int:
    global _dask_sizeof
    if _dask_sizeof is None:
        from dask.sizeof import sizeof as dask_sizeof

        _dask_sizeof = dask_sizeof
    try:
        return int(_dask_sizeof(value))
    except Exception:  # (dask's own ``safe_sizeof`` falls back the same way)
        return _fallback(value)


def _fallback(value: Any, _depth: int = 0) -> int:
    nbytes = getattr(value, "nbytes", None)  # numpy arrays, pandas objects (as a method)
    if isinstance(nbytes, int):
        return nbytes
    memory_usage = getattr(value, "memory_usage", None)
    if callable(memory_usage) and type(value).__module__.startswith("pandas"):
        try:
            usage = memory_usage(deep=True)
            return int(usage.sum()) if hasattr(usage, "sum") else int(usage)
        except Exception:
            pass
    if isinstance(value, list | tuple | set | frozenset) and _depth < 2:
        items = list(value)
        if len(items) > 100:  # sample large containers
            sample = items[:: len(items) // 100]
            return sys.getsizeof(value) + sum(_fallback(x, _depth + 1) for x in sample) * len(
                items
            ) // len(sample)
        return sys.getsizeof(value) + sum(_fallback(x, _depth + 1) for x in items)
    if isinstance(value, dict) and _depth < 2:
        items = list(value.items())[:100]
        # dict's own size, not a subclass's ``__sizeof__``: the items are counted here
        return dict.__sizeof__(value) + sum(
            _fallback(k, _depth + 1) + _fallback(v, _depth + 1) for k, v in items
        )
    try:
        return sys.getsizeof(value)
    except Exception:
        return 64
