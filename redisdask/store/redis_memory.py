"""Redis's memory, as every process reads it from ``INFO memory`` (no CONFIG right needed).

* **The eviction policy.**  redisdask keeps state in Redis that nothing else holds: the
  lease, the workers' records, task records, the graph history.  A Redis that may evict
  keys when full (``allkeys-*``; ``volatile-*`` too, which evicts keys with a TTL: the
  lease, the ``alive`` keys, the leader key) destroys that state silently, so the
  scheduler, the workers and the clients refuse to start on one (``check_policy``), and
  the scheduler looks again periodically (a policy changed at run time is logged as an
  ERROR, written to the events stream and shown by ``redisdask status``).  Only
  ``noeviction`` works: a full Redis then refuses writes instead, which every process
  waits out (``redisdask/store/busy.py``).  A Redis where INFO is refused (an ACL without
  ``+info``) is not refused: the process warns once and goes on.
* **How full it is**: ``used_memory`` against ``maxmemory`` (0: no limit), for the
  messages that say why the cluster is stuck (``full_text``) and for the workers' inline
  result budget (``worker.inline-results-redis-fraction``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import redis

from redisdask.errors import EvictingRedisError
from redisdask.utils.sizes import format_bytes

logger = logging.getLogger("redisdask.redis")

SAFE_POLICIES = frozenset({"noeviction"})
FIX = (
    "set it to noeviction (`redis-cli CONFIG SET maxmemory-policy noeviction`, and "
    "`maxmemory-policy noeviction` in redis.conf to keep it)"
)


@dataclass(frozen=True, slots=True)
class RedisMemory:
    """What ``INFO memory`` says of Redis's memory."""

    used: int
    maxmemory: int  # 0: no limit
    policy: str

    @property
    def fraction(self) -> float:
        """``used_memory`` as a share of ``maxmemory`` (0 where there is no limit)."""
        return self.used / self.maxmemory if self.maxmemory else 0.0

    @property
    def full(self) -> bool:
        return bool(self.maxmemory) and self.used >= self.maxmemory

    def policy_problem(self) -> str | None:
        """Why this policy cannot hold a cluster, and the fix; None for noeviction."""
        if self.policy in SAFE_POLICIES or not self.policy:
            return None
        what = "any key" if self.policy.startswith("allkeys") else "keys with a TTL"
        return (
            f"Redis runs with maxmemory-policy {self.policy}: when full it evicts {what}, "
            "and the cluster's state (the scheduler's lease, the workers' alive keys and "
            f"records, task records) would vanish silently; {FIX}"
        )


def from_info(info: dict[str, Any]) -> RedisMemory:
    return RedisMemory(
        used=int(info.get("used_memory", 0) or 0),
        maxmemory=int(info.get("maxmemory", 0) or 0),
        policy=str(info.get("maxmemory_policy", "") or ""),
    )


def read(r: redis.Redis) -> RedisMemory | None:
    """Redis's memory now; None where INFO is refused (an ACL without +info)."""
    try:
        return from_info(r.info("memory"))
    except redis.ResponseError:
        return None


async def aread(r: Any) -> RedisMemory | None:
    """``read`` for an asyncio client."""
    try:
        return from_info(await r.info("memory"))
    except redis.ResponseError:
        return None


def full_text(memory: RedisMemory | None) -> str:
    """What to tell a user whose cluster is stuck on a full Redis."""
    if memory is None or not memory.maxmemory:
        return "Redis is full (it refuses writes: OOM); release results or raise maxmemory"
    return (
        f"Redis is full: used_memory {format_bytes(memory.used)} of maxmemory "
        f"{format_bytes(memory.maxmemory)}; release results (del futures, "
        "client.cancel) or raise maxmemory (CONFIG SET maxmemory)"
    )


def check_policy(memory: RedisMemory | None, who: str) -> None:
    """At a process's start: ``EvictingRedisError`` for an evicting Redis; a warning
    where INFO was refused (``memory`` None)."""
    if memory is None:
        logger.warning(
            "%s may not run INFO on Redis: it cannot check that maxmemory-policy is "
            "noeviction (an evicting Redis loses the cluster's state); give its Redis "
            "user +info (`redisdask acl`)",
            who,
        )
        return
    problem = memory.policy_problem()
    if problem:
        raise EvictingRedisError(f"{who} refuses to start: {problem}")
