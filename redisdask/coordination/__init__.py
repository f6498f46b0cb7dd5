"""Coordination primitives on Redis, with distributed's names and semantics: ``Lock``,
``MultiLock``, ``Semaphore``, ``Event``, ``Variable``, ``Queue``, published datasets and
``fire_and_forget``.

Their state lives in Redis (``store/keyspace.py`` lists the keys; ``docs/redis-schema.md``
documents them), changed by Lua scripts, so they work without a scheduler, survive a
scheduler's restart by construction, and are usable from inside tasks.  Futures they
hold are kept alive by holders: client ids that are no client (``holder:<kind>:<name>``,
``holder:fire-and-forget``), which the scheduler restores after a restart.  Each
primitive's keys are deleted when it is unused (released, cleared, emptied, deleted).
"""

from redisdask.coordination.datasets import DatasetMethods, Datasets
from redisdask.coordination.event import Event
from redisdask.coordination.holders import fire_and_forget, futures_of
from redisdask.coordination.lock import Lock
from redisdask.coordination.multi_lock import MultiLock
from redisdask.coordination.queues import Queue
from redisdask.coordination.semaphore import Semaphore
from redisdask.coordination.variable import Variable

__all__ = [
    "DatasetMethods",
    "Datasets",
    "Event",
    "Lock",
    "MultiLock",
    "Queue",
    "Semaphore",
    "Variable",
    "fire_and_forget",
    "futures_of",
]
