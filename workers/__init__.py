"""The redisdask worker: task state machine, executor, data store and peer data server."""

from redisdask.workers.worker import Worker, get_worker

__all__ = ["Worker", "get_worker"]
