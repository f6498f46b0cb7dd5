"""The client side: what a user's program runs.  ``Client`` (``client.py``) talks to the
scheduler through Redis streams (``channel.py``), holds ``Future``s (``futures.py``),
administers the cluster (``admin.py``), fetches results from the workers that hold them
(``fetch.py``), calls workers directly (``worker_calls.py``, ``scatter.py``), turns dask
collections into tasks (``dask_graph.py``, ``annotations.py``) and runs its I/O on one
event loop (``loop.py``); ``as_completed``, ``progress``, ``get_task_stream`` and
``performance_report`` are built on it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from redisdask.utils import lazy

if TYPE_CHECKING:
    from redisdask.client.client import Client
    from redisdask.client.completed import as_completed
    from redisdask.client.futures import DoneAndNotDoneFutures, Future, futures_of, wait
    from redisdask.context import default_client

__all__ = [
    "Client",
    "DoneAndNotDoneFutures",
    "Future",
    "as_completed",
    "default_client",
    "futures_of",
    "wait",
]

# imported at their first use (``utils/lazy.py``): importing one module of the client
# (``client.loop``, ``client.fetch``) does not import the others
__getattr__, __dir__ = lazy.exports(
    __name__,
    {
        "Client": "redisdask.client.client",
        "as_completed": "redisdask.client.completed",
        "DoneAndNotDoneFutures": "redisdask.client.futures",
        "Future": "redisdask.client.futures",
        "futures_of": "redisdask.client.futures",
        "wait": "redisdask.client.futures",
        "default_client": "redisdask.context",
    },
)
