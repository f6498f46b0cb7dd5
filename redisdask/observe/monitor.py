"""``redisdask monitor``: a full-screen dashboard of a cluster, redrawn twice a second.

Each frame is one ``read_snapshot`` (a pipeline of read-only commands) rendered by
``redisdask.observe.views.dashboard``; the monitor never writes to Redis, so any number of them
can watch a cluster, from any machine, without slowing it down.  ``q`` or Ctrl-C quits.
A Redis that goes away is shown on screen and retried; it does not end the monitor.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from collections.abc import Iterator

import redis
from rich.console import Console
from rich.live import Live
from rich.text import Text

from redisdask.observe.snapshot import read_snapshot
from redisdask.observe.views import dashboard
from redisdask.store.keyspace import Keys

QUIT_KEYS = {"q", "Q", "\x03", "\x04"}  # q, Ctrl-C (when the terminal passes it), Ctrl-D


@contextlib.contextmanager
def _keys_unbuffered() -> Iterator[bool]:
    """The terminal in cbreak mode (keys arrive at once, Ctrl-C still interrupts), reset
    on exit; yields False when stdin is not a terminal."""
    if not sys.stdin.isatty():
        yield False
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _wait_for_key(seconds: float, keys: bool) -> str:
    """Wait up to ``seconds`` for a key press; the keys pressed, or ''."""
    if not keys:
        time.sleep(seconds)  # the refresh interval is a timer by nature
        return ""
    ready, _, _ = select.select([sys.stdin], [], [], seconds)
    return os.read(sys.stdin.fileno(), 64).decode(errors="replace") if ready else ""


def run_monitor(
    r: redis.Redis,
    keys: Keys,
    url: str,
    *,
    interval: float = 0.5,
    console: Console | None = None,
) -> int:
    console = console or Console()
    try:
        with (
            _keys_unbuffered() as keys_ready,
            Live(console=console, screen=True, auto_refresh=False, transient=True) as live,
        ):
            while True:
                try:
                    snap = read_snapshot(r, keys)
                    frame = dashboard(snap, url, console.width, console.height)
                except redis.RedisError as exc:
                    frame = Text(
                        f"cannot read Redis at {url}: {exc}\nretrying every {interval:g} s "
                        "(q quits)",
                        style="bold red",
                    )
                except Exception as exc:  # a value no process of ours wrote: say, go on
                    frame = Text(f"cannot draw this frame: {exc!r} (q quits)", style="red")
                live.update(frame, refresh=True)
                if QUIT_KEYS & set(_wait_for_key(interval, keys_ready)):
                    return 0
    except KeyboardInterrupt:
        return 0
