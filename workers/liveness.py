"""The worker's heartbeat through a stalled event loop.

The heartbeat loop renews the worker's ``alive`` key (PX ``scheduler.worker-ttl``, 3 s)
from the event loop.  A loop that stops running for longer than that (a long sort of
30,000 keys, a full collection of a large heap, a machine with more processes than cores)
had the worker declared dead while it was alive and working, and everything it held
recomputed elsewhere.  ``LoopWatch`` keeps the two questions apart:

* **Is the process alive?**  A thread renews ``alive`` whenever the loop has not run for
  half a heartbeat interval (it ticks four times an interval).  A killed, stopped
  (``SIGSTOP``) or cut-off process renews nothing, so those are noticed within the TTL
  as before.
* **Is the loop hung?**  The thread vouches for a stalled loop up to
  ``worker.hang-timeout`` (the bound a nanny gives a silent worker), then stops: the
  worker is declared dead one TTL later.  Each stall past ``worker-ttl`` is logged once,
  naming the line the loop is stuck on, as distributed warns "Event loop was
  unresponsive".

The thread does no work of the loop's and holds one Redis connection of its own, opened
at the first stall.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

logger = logging.getLogger("redisdask.worker")


class LoopWatch:
    """``await watch.tick()`` on the loop (a task of its own); ``start()`` the thread;
    ``stop()`` before the worker says goodbye (a renewal after it would undo it)."""

    def __init__(
        self,
        name: str,
        vouch: Callable[[], object],
        *,
        interval: float,
        warn_after: float,
        hang_timeout: float,
    ) -> None:
        self.name = name
        self.vouch = vouch  # renews ``alive``; called in the thread
        self.interval = interval
        self.warn_after = warn_after
        self.hang_timeout = hang_timeout
        self.ticked = time.monotonic()
        self.loop_thread: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"loop-watch-{name}", daemon=True)

    async def tick(self) -> None:
        self.loop_thread = threading.get_ident()
        while True:
            self.ticked = time.monotonic()
            await asyncio.sleep(self.interval / 4)  # a timer by nature

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread.ident != threading.get_ident():
            self._thread.join()

    def _watch(self) -> None:
        warned = given_up = False
        while not self._stop.wait(self.interval / 4):
            stalled = time.monotonic() - self.ticked
            if stalled < self.interval / 2:
                warned = given_up = False
                continue
            if stalled > self.hang_timeout:
                if not given_up:
                    logger.error(
                        "the event loop of worker %s has not run for %.1f s "
                        "(worker.hang-timeout): no longer keeping its heartbeat; %s",
                        self.name,
                        stalled,
                        self._where(),
                    )
                    given_up = True
                continue
            if stalled > self.warn_after and not warned:
                logger.warning(
                    "the event loop of worker %s has not run for %.1f s; a thread keeps "
                    "its heartbeat until worker.hang-timeout (%.0f s); %s",
                    self.name,
                    stalled,
                    self.hang_timeout,
                    self._where(),
                )
                warned = True
            self._renew()

    def _renew(self) -> None:
        try:
            self.vouch()
        except Exception as exc:  # (Redis away: the loop's own heartbeat says so)
            logger.debug("worker %s: keeping the heartbeat failed: %r", self.name, exc)

    def _where(self) -> str:
        """The innermost frames the loop's thread is in."""
        frame = sys._current_frames().get(self.loop_thread or -1)
        if frame is None:
            return "it is not running Python code"
        lines = traceback.format_stack(frame)[-3:]
        return "it is at:\n" + "".join(lines).rstrip()
