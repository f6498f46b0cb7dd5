"""``get_task_stream``, as distributed's: the task stream of what runs inside a ``with``
block, read back from the workers' stories in Redis (``redisdask.observe.task_stream``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from redisdask.config import parse_duration
from redisdask.context import default_client
from redisdask.observe.task_stream import read_task_stream

if TYPE_CHECKING:
    from redisdask.client.client import Client

__all__ = ["get_task_stream", "read_task_stream", "when"]


def when(moment: float | str | None) -> float | None:
    """A moment as distributed takes it: epoch seconds, or a duration before now ("60s")."""
    if moment is None or isinstance(moment, int | float):
        return moment
    return time.time() - parse_duration(moment)


class get_task_stream:
    """Collect the task stream of what runs inside a ``with`` block, as distributed's::

        with get_task_stream() as ts:
            x.compute()
        ts.data  # list of dicts, see ``read_task_stream``

    ``data`` is read from Redis when asked for; the workers write their stories with
    each heartbeat, so read it a heartbeat after the block to see its last tasks."""

    def __init__(self, client: Client | None = None, plot: bool = False, **kwargs: Any) -> None:
        if plot:
            raise NotImplementedError(
                "get_task_stream(plot=True): redisdask draws no bokeh plots; use the data "
                "(ts.data) or `redisdask monitor`"
            )
        if client is None:
            client = default_client()
        self.client = client
        self.start: float | None = None
        self.stop: float | None = None

    def __enter__(self) -> get_task_stream:
        self.start = time.time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop = time.time()

    @property
    def data(self) -> list[dict[str, Any]]:
        return self.client.get_task_stream(start=self.start, stop=self.stop)
