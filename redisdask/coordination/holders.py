"""``fire_and_forget``: run tasks to the end even when nobody keeps their futures.

As in Dask, the futures' keys are wanted by a holder that is no client,
``holder:fire-and-forget`` (``keyspace.FIRE_AND_FORGET``): it never expires with a
client's heartbeat, and the scheduler drops its want when the task reaches ``memory`` or
``erred``, so the result is released after unless someone else wants it.  The want goes
on the clients stream through the future's own client, in order with that client's
other messages: a ``close()`` or a release right after it lands after it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from redisdask.client.futures import futures_of
from redisdask.errors import ClientClosedError
from redisdask.protocol import ClientDesiresKeys
from redisdask.store import keyspace

if TYPE_CHECKING:
    from redisdask.client.client import Client


def fire_and_forget(obj: Any) -> None:
    """Run the tasks of the futures in ``obj`` (a future, a collection of them, a
    persisted dask collection) at least once, even if their futures are released and
    their client closes; their results are not kept (use this for side effects)."""
    by_client: dict[Client, list[str]] = {}
    for future in futures_of(obj):
        by_client.setdefault(future.client, []).append(future._key)
    for client, keys in by_client.items():
        if client.status != "running":
            raise ClientClosedError(
                f"fire_and_forget(): the futures' client {client.id} is {client.status}, so "
                "its tasks were cancelled already; submit them with a running client"
            )
        client._channel.send(
            [ClientDesiresKeys(keyspace.FIRE_AND_FORGET, list(dict.fromkeys(keys)))]
        )
