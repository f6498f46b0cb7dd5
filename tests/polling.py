"""Waiting for a condition with a deadline: the tests' only way to synchronise."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def poll(condition: Callable[[], object], timeout: float = 15.0) -> None:
    """Return once ``condition()`` is true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"condition not met within {timeout} s"
        threading.Event().wait(0.005)
