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

from collections.abc import Iterable
from typing import Any

import redis

from redisdask.store import codecs
from redisdask.store.keyspace import Keys

_RUNNING = ("executing", "long-running")


def read_task_stream(
    r: redis.Redis,
    keys: Keys,
    start: float | None = None,
    stop: float | None = None,
    count: int | None = None,
    workers: Iterable[str] | None = None,
    entries: int | None = None,
) -> list[dict[str, Any]]:
    """The tasks that finished running between ``start`` and ``stop`` (epoch seconds;
    None: unbounded), oldest first, at most the last ``count``.  Each is a dict as in
    distributed: ``key``, ``worker``, ``status`` (``"OK"`` or ``"error"``) and
    ``startstops``, a tuple of ``{"action": "compute" | "transfer", "start", "stop"}``.
    ``workers``: only theirs (one round trip), else every story Redis holds (a SCAN);
    ``entries``: only the newest that many story entries of each (100 rows each, at most),
    so that the read stays small however fast the workers go."""
    low = "-" if start is None else str(int(start * 1000))
    if workers is None:
        workers = _story_owners(r, keys)
    pipe = r.pipeline(transaction=False)
    for worker in workers:
        if entries is None:
            pipe.xrange(keys.worker_story(worker), min=low)
        else:
            pipe.xrevrange(keys.worker_story(worker), min=low, count=entries)
    tasks: list[dict[str, Any]] = []
    for worker, story in zip(workers, pipe.execute(), strict=True):
        tasks.extend(_runs(worker, [row for _id, fields in story for row in _rows(fields)]))
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


def _story_owners(r: redis.Redis, keys: Keys) -> list[str]:
    """The addresses of the workers whose stories Redis holds, dead ones included."""
    head, tail = keys.worker_story("\0").split("\0")  # around the worker's address
    names = (
        k.decode() if isinstance(k, bytes) else k
        for k in r.scan_iter(match=keys.worker_story("*"), count=1000)
    )
    return [name[len(head) : -len(tail)] for name in names]


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
