"""Pickle fast, fall back to cloudpickle only where it is needed.

The C pickler is several times faster than cloudpickle's, which matters when every task
result and every task spec is pickled.  Plain pickle stores functions and classes by
reference, which is wrong for those defined in ``__main__`` or in modules registered to
travel by value (``cloudpickle.register_pickle_by_value``): the other process cannot
import them.  So, as Dask does, pickle first and use cloudpickle when that fails or when
the bytes name such a module.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import cloudpickle

PROTOCOL = 5


def dumps(obj: Any, buffer_callback: Callable[[pickle.PickleBuffer], Any] | None = None) -> bytes:
    buffers: list[pickle.PickleBuffer] = []
    try:
        result = pickle.dumps(
            obj, protocol=PROTOCOL, buffer_callback=buffers.append if buffer_callback else None
        )
    except Exception:
        result = None
    if result is None or _needs_cloudpickle(result):
        buffers = []
        result = cloudpickle.dumps(
            obj, protocol=PROTOCOL, buffer_callback=buffers.append if buffer_callback else None
        )
    if buffer_callback is not None:
        for buffer in buffers:
            buffer_callback(buffer)
    return result


class _TooBig(Exception):
    pass


def dumps_within(obj: Any, limit: int) -> bytes | None:
    """``obj`` pickled in one piece (its buffers in band), or None as soon as its buffers
    add up to more than ``limit`` bytes: a large array is never copied to find out."""
    total = 0

    def in_band(buffer: pickle.PickleBuffer) -> bool:
        nonlocal total
        total += buffer.raw().nbytes
        if total > limit:
            raise _TooBig
        return True  # (serialized in band)

    try:
        try:
            result = pickle.dumps(obj, protocol=PROTOCOL, buffer_callback=in_band)
        except _TooBig:
            raise
        except Exception:
            result = None
        if result is None or _needs_cloudpickle(result):
            total = 0
            result = cloudpickle.dumps(obj, protocol=PROTOCOL, buffer_callback=in_band)
    except _TooBig:
        return None
    return result


def _needs_cloudpickle(data: bytes) -> bool:
    if b"__main__" in data:
        return True
    return any(name.encode() in data for name in cloudpickle.list_registry_pickle_by_value())


loads = pickle.loads
