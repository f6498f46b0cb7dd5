"""How many bytes a value holds, cheaply: fast paths for the common big types.

Used for the ``nbytes`` reported to the scheduler and for transfer batching; the memory
manager of a later issue refines it.
"""

from __future__ import annotations

import sys
from typing import Any


def sizeof(value: Any, _depth: int = 0) -> int:
    if isinstance(value, bytes | bytearray | memoryview):
        return len(value)
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
            return sys.getsizeof(value) + sum(sizeof(x, _depth + 1) for x in sample) * len(
                items
            ) // len(sample)
        return sys.getsizeof(value) + sum(sizeof(x, _depth + 1) for x in items)
    if isinstance(value, dict) and _depth < 2:
        return sys.getsizeof(value) + sum(
            sizeof(k, _depth + 1) + sizeof(v, _depth + 1) for k, v in list(value.items())[:100]
        )
    try:
        return sys.getsizeof(value)
    except Exception:
        return 64
