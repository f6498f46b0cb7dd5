"""One backoff for every retry loop: exponential from ``base`` to ``cap``, with jitter.

Every process that waits for Redis (the scheduler, a worker, a nanny, the client), and the
nanny restarting a worker that keeps dying, retry with a delay that doubles from ``base``
up to ``cap``.  Jitter keeps processes that lost Redis at the same instant from retrying in
lock step when it comes back: each delay is drawn from ``[d/2, d]`` around the doubling
delay ``d`` (redis-py's ``EqualJitterBackoff``), so a loop never waits less than half of
what it waited before this helper, and never longer.

    backoff = Backoff(base=0.05, cap=2.0)
    while not done():
        time.sleep(backoff.next())  # backoff while Redis is away
    backoff.reset()  # after a success: the next failure starts from ``base`` again
"""

from __future__ import annotations

import math

from redis.backoff import AbstractBackoff, EqualJitterBackoff


class Backoff:
    """The delays of one retry loop; ``next()`` counts a failure, ``reset()`` forgets them."""

    def __init__(self, base: float, cap: float) -> None:
        if not 0 < base <= cap:
            raise ValueError(f"a backoff needs 0 < base <= cap, got base={base}, cap={cap}")
        self.base, self.cap = base, cap
        self.failures = 0
        self._policy: AbstractBackoff = EqualJitterBackoff(cap=cap, base=base)
        # past this many failures the delay is at its cap; counting further would only
        # make 2**failures overflow a float in a loop that waits for hours
        self._at_cap = math.ceil(math.log2(cap / base))

    def next(self) -> float:
        """The delay in seconds before the next attempt (in ``[d/2, d]``, where ``d`` is
        ``base`` doubled once per failure before this one, at most ``cap``)."""
        delay = float(self._policy.compute(min(self.failures, self._at_cap)))
        self.failures += 1
        return delay

    def reset(self) -> None:
        """Start again from ``base`` (after a success)."""
        self.failures = 0
        self._policy.reset()


def redis_away() -> Backoff:
    """The reconnection loop of a process that lost Redis (the scheduler, a worker): a
    PING at most every half second, so that a Sentinel's promotion of a replica (or a
    restart) is followed within ~0.5 s, at the cost of two PINGs a second per process
    while Redis is away."""
    return Backoff(base=0.05, cap=0.5)
