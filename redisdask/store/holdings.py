"""Which workers hold which results, read from the task records in Redis: what
``Client.who_has()`` and ``Client.has_what()`` report for the whole cluster (as
distributed's scheduler answers them from its task states).

A record's ``who_has`` may name ``keyspace.REDIS_COPY``: the result is small and lives in
the record itself too.  That is no worker, so these answers never name it (code that
iterates ``who_has`` takes every name for a worker address, as in Dask);
``redisdask inspect task`` says where a result lives, Redis included.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from redisdask.store.keyspace import REDIS_COPY, Keys
from redisdask.store.task_record import TaskRecord

PAGE = 1000  # task keys read per SSCAN page and per pipeline


def workers_only(who_has: list[str]) -> list[str]:
    """The workers of a record's ``who_has`` (not ``REDIS_COPY``)."""
    return [w for w in who_has if w != REDIS_COPY]


async def scan_who_has(r: Any, keys: Keys) -> AsyncIterator[tuple[str, list[str]]]:
    """``(task key, [worker addresses])`` of every task the scheduler has a record of
    (an empty list for one that is not in memory), a page at a time."""
    cursor: int | bytes = 0
    fields = ("who_has",)
    while True:
        cursor, members = await r.sscan(keys.tasks, cursor, count=PAGE)
        names = [m.decode(errors="replace") for m in members]
        if names:
            pipe = r.pipeline(transaction=False)
            for name in names:
                pipe.hmget(keys.task(name), fields)
            for name, values in zip(names, await pipe.execute(), strict=True):
                if any(v is not None for v in values):  # (forgotten since the scan)
                    yield name, workers_only(TaskRecord.from_hmget(fields, values).who_has)
        if not int(cursor):
            return


async def who_has_all(r: Any, keys: Keys) -> dict[str, list[str]]:
    """``{task key: [worker addresses]}`` of every task (``Client.who_has()``)."""
    return {key: holders async for key, holders in scan_who_has(r, keys)}


def has_what(who_has: dict[str, list[str]], workers: list[str]) -> dict[str, list[str]]:
    """``{worker address: [keys it holds]}`` for each of ``workers``, from ``who_has``."""
    out: dict[str, list[str]] = {w: [] for w in workers}
    for key, holders in who_has.items():
        for worker in holders:
            if worker in out:
                out[worker].append(key)
    return out
