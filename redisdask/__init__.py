"""redisdask: a distributed task scheduler for Python whose memory is Redis."""

from __future__ import annotations

import importlib.metadata

# one source: pyproject.toml's [project] version, as installed
__version__ = importlib.metadata.version("redisdask")

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
