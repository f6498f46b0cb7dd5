"""Tasks that submit tasks: ``get_client`` and ``worker_client``, with distributed's
names, arguments and behaviour (``get_worker``, ``secede`` and ``rejoin``, which make no
client, are the kernel's: ``redisdask/context.py``).

* ``get_client()`` inside a task: the worker's client, connected to the worker's
  cluster; outside a task the default client, else ``ValueError``, as in distributed.
* ``worker_client()`` secedes for its duration and rejoins at its end, so tasks waiting
  on the tasks they submitted never hold every thread of a cluster.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from redisdask.client.client import Client
from redisdask.config import parse_duration
from redisdask.context import (
    current_host,
    default_client,
    rejoin,
    running_task,
    secede,
    seceded,
    thread_key,
)


def get_client(
    address: str | None = None, timeout: float | str | None = None, resolve_address: bool = True
) -> Client:
    """A client while within a task (``distributed.get_client``): the worker's own,
    connected to the worker's cluster.  Outside a task, the default client; with an
    ``address`` (a Redis URL) of another cluster, a new client of it.  ``timeout``:
    for connecting (seconds, or a string such as ``"10s"``).  ``resolve_address`` is
    accepted for distributed's sake (a Redis URL needs no resolving)."""
    seconds = None if timeout is None else parse_duration(timeout)
    host = current_host()
    if host is not None and (not address or address == host.redis_url):
        return host.task_client(seconds)
    try:
        client: Client | None = default_client()
    except ValueError:
        client = None
    if client is not None and (not address or client.redis_url == address):
        return client
    if address:
        return Client(address, timeout=seconds)
    raise ValueError(
        "No global client found and no address provided: get_client() was called outside "
        "of a task with no Client running; create one with Client(...) first, or pass "
        "the cluster's Redis URL"
    )


@contextlib.contextmanager
def worker_client(
    timeout: float | str | None = None, separate_thread: bool = True
) -> Iterator[Client]:
    """The worker's client, for a task to submit tasks and wait for them
    (``distributed.worker_client``)::

        def total(paths):
            with worker_client() as client:
                return sum(client.gather(client.map(load, paths)))

    With ``separate_thread`` (the default) the task secedes for the duration of the
    block (unless it already had) and rejoins at its end, so tasks waiting on the tasks
    they submitted never hold every thread of a cluster: recursion cannot deadlock."""
    running_task("worker_client")
    client = get_client(timeout=timeout)
    leave = separate_thread and not seceded()
    if leave:
        secede()
    try:
        yield client
    finally:
        if leave:
            rejoin()


def dask_get(dsk: Any, keys: Any, **kwargs: Any) -> Any:
    """dask's scheduler in a worker's own process (``Worker.install_dask_scheduler``):
    inside a task, the cluster, through the worker's client (what distributed's
    ``get_client()`` gives dask there); elsewhere, dask's threads."""
    if thread_key() is None:
        import dask.threaded

        return dask.threaded.get(dsk, keys, **kwargs)
    return get_client().get(dsk, keys, **kwargs)
