"""redisdask: a distributed task scheduler for Python whose memory is Redis."""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING

from redisdask.utils import lazy

# one source: pyproject.toml's [project] version, as installed
__version__ = importlib.metadata.version("redisdask")

if TYPE_CHECKING:
    from redisdask.client import Client, Future, as_completed, default_client, futures_of, wait
    from redisdask.client.diagnostics import progress
    from redisdask.client.performance_report import performance_report
    from redisdask.client.task_stream import get_task_stream
    from redisdask.client.worker_client import get_client, worker_client
    from redisdask.context import get_worker, rejoin, secede
    from redisdask.coordination import (
        Event,
        Lock,
        MultiLock,
        Queue,
        Semaphore,
        Variable,
        fire_and_forget,
    )
    from redisdask.deploy.cluster import LocalCluster
    from redisdask.errors import (
        ClusterConnectionError,
        FutureCancelledError,
        FuturesCancelledError,
        KilledWorker,
        RedisDaskError,
        SchedulerRejectedError,
        TaskInterrupted,
        WorkerStartTimeoutError,
        WorkerUnresponsiveError,
    )
    from redisdask.plugins import WorkerPlugin
    from redisdask.security import Security

# where each public name lives, imported at its first use (``utils/lazy.py``): a
# worker, a nanny or a scheduler process runs ``python -m redisdask`` and needs none of
# the client's modules
_EXPORTS: dict[str, str] = {
    "Client": "redisdask.client",
    "Future": "redisdask.client",
    "as_completed": "redisdask.client",
    "default_client": "redisdask.client",
    "futures_of": "redisdask.client",
    "wait": "redisdask.client",
    "progress": "redisdask.client.diagnostics",
    "performance_report": "redisdask.client.performance_report",
    "get_task_stream": "redisdask.client.task_stream",
    "get_client": "redisdask.client.worker_client",
    "worker_client": "redisdask.client.worker_client",
    "get_worker": "redisdask.context",
    "rejoin": "redisdask.context",
    "secede": "redisdask.context",
    "Event": "redisdask.coordination",
    "Lock": "redisdask.coordination",
    "MultiLock": "redisdask.coordination",
    "Queue": "redisdask.coordination",
    "Semaphore": "redisdask.coordination",
    "Variable": "redisdask.coordination",
    "fire_and_forget": "redisdask.coordination",
    "LocalCluster": "redisdask.deploy.cluster",
    "ClusterConnectionError": "redisdask.errors",
    "FutureCancelledError": "redisdask.errors",
    "FuturesCancelledError": "redisdask.errors",
    "KilledWorker": "redisdask.errors",
    "RedisDaskError": "redisdask.errors",
    "SchedulerRejectedError": "redisdask.errors",
    "TaskInterrupted": "redisdask.errors",
    "WorkerStartTimeoutError": "redisdask.errors",
    "WorkerUnresponsiveError": "redisdask.errors",
    "WorkerPlugin": "redisdask.plugins",
    "Security": "redisdask.security",
}


__all__ = [
    "Client",
    "ClusterConnectionError",
    "Event",
    "Future",
    "FutureCancelledError",
    "FuturesCancelledError",
    "KilledWorker",
    "LocalCluster",
    "Lock",
    "MultiLock",
    "Queue",
    "RedisDaskError",
    "SchedulerRejectedError",
    "Security",
    "Semaphore",
    "TaskInterrupted",
    "Variable",
    "WorkerPlugin",
    "WorkerStartTimeoutError",
    "WorkerUnresponsiveError",
    "__version__",
    "as_completed",
    "default_client",
    "fire_and_forget",
    "futures_of",
    "get_client",
    "get_task_stream",
    "get_worker",
    "performance_report",
    "progress",
    "rejoin",
    "secede",
    "wait",
    "worker_client",
]

__getattr__, __dir__ = lazy.exports(__name__, _EXPORTS)
