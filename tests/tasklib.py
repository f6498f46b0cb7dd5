"""Task functions that several test modules submit.  Workers cannot import test code, so
``conftest.py`` has cloudpickle ship this module's functions by value."""

from __future__ import annotations

import os
import threading
import time


def allocate_forever(step: int, start: str | None = None) -> None:
    """Leak ``step`` bytes every 20 ms, as a leaky task would; once the file ``start``
    exists, if one is given."""
    while start is not None and not os.path.exists(start):
        threading.Event().wait(0.01)
    blocks = []
    while True:
        blocks.append(b"\x01" * step)
        threading.Event().wait(0.02)  # the leak's pace, not a synchronisation


def wait_for_file(path: str) -> str:
    """Stay ``processing`` until the test creates ``path`` (at most a minute)."""
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        threading.Event().wait(0.02)
    return path


def recorded(i: int, runs: str, delay: float = 0.0) -> int:
    """Append ``i`` to the file ``runs`` (one small O_APPEND write), then work ``delay``
    seconds: the test counts each task's runs there, outside Redis."""
    fd = os.open(runs, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, f"{i}\n".encode())
    finally:
        os.close(fd)
    threading.Event().wait(delay)  # stands for the work
    return i
