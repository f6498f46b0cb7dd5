"""The redisdask worker: task state machine, executor, data store and peer data server."""

from redisdask.context import get_worker
from redisdask.workers.worker import Worker

__all__ = ["Worker", "get_worker"]
