"""redisdask: a distributed task scheduler for Python whose memory is Redis."""

from __future__ import annotations

import importlib.metadata

# one source: pyproject.toml's [project] version, as installed
__version__ = importlib.metadata.version("redisdask")

from redisdask.client import Client, Future, as_completed, default_client, wait
from redisdask.cluster import LocalCluster
from redisdask.diagnostics import progress
from redisdask.errors import (
    ClusterConnectionError,
    FutureCancelledError,
    KilledWorker,
    RedisDaskError,
    SchedulerRejectedError,
    TaskInterrupted,
)
from redisdask.task_stream import get_task_stream

__all__ = [
    "Client",
    "ClusterConnectionError",
    "Future",
    "FutureCancelledError",
    "KilledWorker",
    "LocalCluster",
    "RedisDaskError",
    "SchedulerRejectedError",
    "TaskInterrupted",
    "__version__",
    "as_completed",
    "default_client",
    "get_task_stream",
    "progress",
    "wait",
]
