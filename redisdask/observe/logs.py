"""``redisdask logs``: a process's log records, read from Redis (``store.logship``): the
scheduler's, or a worker's, alive or dead, by address or name, or its nanny's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict

import redis

from redisdask.store import logship
from redisdask.store.keyspace import Keys

FOLLOW_BLOCK_MS = 1000


def stream_of(r: redis.Redis, keys: Keys, process: str, nanny: bool) -> str:
    """The stream of ``process`` ("scheduler", or a worker's address or name);
    ``LookupError`` saying which workers there are when none is named so."""
    if process == "scheduler":
        return keys.scheduler_logs
    known = logship.known_workers(r, keys)
    address = logship.find_worker(known, process)
    if address is None:
        raise LookupError(
            f"no worker with address or name {process!r} in cluster {keys.cluster!r}, "
            f"registered or among its recorded deaths; it knows of {sorted(known.values())}"
        )
    if not nanny:
        return keys.worker_logs(address)
    stream = logship.nanny_stream(r, keys, address)
    if stream is None:
        raise LookupError(f"worker {process!r} ran without a nanny")
    return stream


def logs_command(
    r: redis.Redis,
    stream: str,
    *,
    count: int,
    since: float | None,
    follow: bool,
    as_json: bool,
) -> None:
    """Print the last ``count`` records (0: every one kept) from ``since`` seconds back,
    then, with ``follow``, each new one as it comes, until interrupted."""
    start = None if since is None else _now(r) - since
    records = logship.read(r, stream, n=count or None, since=start)
    try:
        for record in records:
            _print(record, as_json)
        if follow:
            for record in _follow(r, stream, records[-1].id if records else "$"):
                _print(record, as_json)
    except KeyboardInterrupt:
        return


def _follow(r: redis.Redis, stream: str, last: str) -> Iterator[logship.LogRecord]:
    while True:
        reply = r.xread({stream: last}, block=FOLLOW_BLOCK_MS, count=1000)
        for _name, entries in reply or []:
            last = entries[-1][0]
            yield from logship.records(entries)


def _print(record: logship.LogRecord, as_json: bool) -> None:
    if as_json:  # one object per line: a stream a script can read line by line
        print(json.dumps(asdict(record)), flush=True)
    else:
        print(record.line, flush=True)


def _now(r: redis.Redis) -> float:
    seconds, micros = r.time()
    return seconds + micros / 1e6
