"""The task stream, as distributed's ``Client.get_task_stream``: when each task ran, where,
and how long its data took to move, read back from the workers' stories in Redis.

Each worker writes its task transitions to ``rd:{c}:worker:<addr>:story`` with every
heartbeat (``[time, key, start, finish, stimulus_id]`` rows), and the story of a worker
that died outlives it for ``retention.worker-story-ttl``.  A computation is a pair of
rows: ``… -> executing`` then ``executing -> memory`` (or ``-> error``); a transfer is
``… -> flight`` then ``flight -> memory``.  Nothing is recorded for the stream's sake:
what a worker has not yet written (at most one heartbeat's worth) is not there yet.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from redisdask.config import parse_duration
from redisdask.context import default_client
from redisdask.store import codecs

if TYPE_CHECKING:
    import redis

    from redisdask.client.client import Client
    from redisdask.store.keyspace import Keys

_RUNNING = ("executing", "long-running")


def read_task_stream(
    r: redis.Redis,
    keys: Keys,
    start: float | None = None,
    stop: float | None = None,
    count: int | None = None,
) -> list[dict[str, Any]]:
    """The tasks that finished running between ``start`` and ``stop`` (epoch seconds;
    None: unbounded), oldest first, at most the last ``count``.  Each is a dict as in
    distributed: ``key``, ``worker``, ``status`` (``"OK"`` or ``"error"``) and
    ``startstops``, a tuple of ``{"action": "compute" | "transfer", "start", "stop"}``."""
    low = "-" if start is None else str(int(start * 1000))
    tasks: list[dict[str, Any]] = []
    head, tail = keys.worker_story("\0").split("\0")  # around the worker's address
    for story_key in r.scan_iter(match=keys.worker_story("*"), count=1000):
        name = story_key.decode() if isinstance(story_key, bytes) else story_key
        worker = name[len(head) : -len(tail)]
        rows = [row for _id, fields in r.xrange(name, min=low) for row in _rows(fields)]
        tasks.extend(_runs(worker, rows))
    tasks = [
        t
        for t in tasks
        if (start is None or t["stop"] >= start) and (stop is None or t["stop"] <= stop)
    ]
    tasks.sort(key=lambda t: t["stop"])
    if count is not None:
        tasks = tasks[-count:] if count > 0 else []
    for t in tasks:
        del t["stop"]  # (only for sorting: the times are in startstops)
    return tasks


def _rows(fields: dict[bytes, bytes]) -> list[list[Any]]:
    """The task rows of one story entry; nothing from an entry that is not one."""
    rows = codecs.unpack_or(fields.get(b"m"), [], list)
    return [
        row
        for row in rows
        if isinstance(row, list)
        and len(row) == 5
        and isinstance(row[0], int | float)
        and isinstance(row[1], str)
        and row[1]
    ]


def _runs(worker: str, rows: list[list[Any]]) -> list[dict[str, Any]]:
    """Computations and transfers of one worker's story rows."""
    started: dict[tuple[str, str], float] = {}  # (key, action) -> when it began
    out: list[dict[str, Any]] = []
    for when, key, begin, finish, _sid in sorted(rows, key=lambda row: row[0]):
        if finish in _RUNNING and begin not in _RUNNING:
            started[(key, "compute")] = when
        elif finish == "flight":
            started[(key, "transfer")] = when
        elif begin in _RUNNING and finish in ("memory", "error"):
            since = started.pop((key, "compute"), None)
            if since is not None:
                status = "OK" if finish == "memory" else "error"
                out.append(_task(key, worker, status, "compute", since, when))
        elif begin == "flight" and finish == "memory":
            since = started.pop((key, "transfer"), None)
            if since is not None:
                out.append(_task(key, worker, "OK", "transfer", since, when))
    return out


def _task(key: str, worker: str, status: str, action: str, start: float, stop: float) -> dict:
    return {
        "key": key,
        "worker": worker,
        "status": status,
        "startstops": ({"action": action, "start": start, "stop": stop},),
        "stop": stop,
    }


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
