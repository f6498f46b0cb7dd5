"""What each part of the dashboard shows, read from Redis: one function per fragment.

Every function here issues read commands only, a bounded number of them: none reads
every task (the counts per task prefix come from the scheduler's ``summary`` hash, a
worker's page does not look for the results it holds, a task's page does not look for its
dependents), so a page costs Redis the same with ten tasks or a million.  Each returns
the context of its template (``templates/fragments/<name>.html``); nothing is rendered
here, and nothing is ever unpickled: a task's error is the text its worker recorded.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import redis

from redisdask.observe import inspect
from redisdask.observe.snapshot import Snapshot, read_snapshot
from redisdask.observe.task_stream import read_task_stream
from redisdask.spec import key_prefix
from redisdask.store import codecs, logship
from redisdask.store.eventlog import describe
from redisdask.store.keyspace import Keys

Params = dict[str, str]
TASK_STREAM_WINDOW = 60.0  # seconds of runs on the task stream
TASK_STREAM_RUNS = 2000  # the newest runs drawn, at most
STORY_ENTRIES = 20  # story entries read per worker for it (<= 100 rows each)
LOG_LINES = 200  # records on a logs fragment (the stream keeps up to retention.logs)
STORY_ROWS = 100  # rows of a worker's story on its page
DEATHS = 100  # death records on the deaths page
EVENTS = 200  # events on the events page
STORY_SCAN = 1000  # newest entries of the scheduler's story searched for a task's page
DEATH_SCAN = 1000  # newest death records searched for a dead worker's page
MALFORMED_EVENT = (TypeError, ValueError, KeyError, AttributeError, OverflowError)


def status(r: redis.Redis, keys: Keys, params: Params) -> dict[str, Any]:
    """Workers with their memory, CPU and processing bars; progress per task prefix;
    tasks finished per second over the last minute (``read_snapshot``: 9 commands)."""
    snap = read_snapshot(r, keys, events=1, deaths=1, others=False)
    return {"snap": snap, "rate": _rate(snap.finished)}


def _rate(per_second: list[int], seconds: int = 10) -> float:
    """Tasks finished per second over the last ``seconds``."""
    recent = per_second[-seconds:]
    return sum(recent) / len(recent) if recent else 0.0


def task_stream(r: redis.Redis, keys: Keys, params: Params) -> dict[str, Any]:
    """Which worker ran what, when, over the last minute: one row per worker, one bar per
    run (from the workers' stories: one pipeline of an XRANGE per registered worker)."""
    now = time.time()
    start = now - TASK_STREAM_WINDOW
    names = {
        a.decode(errors="replace"): str(codecs.worker_info_or_empty(i).get("name") or "")
        for a, i in r.hgetall(keys.workers).items()
    }
    workers = sorted(names, key=lambda a: (names[a], a))
    runs = read_task_stream(
        r, keys, start=start, workers=workers, count=TASK_STREAM_RUNS, entries=STORY_ENTRIES
    )
    lanes = {w: i for i, w in enumerate(workers)}
    bars = []
    for run in runs:
        for span in run["startstops"]:
            lane = lanes.setdefault(run["worker"], len(lanes))
            begin, end = max(span["start"], start), span["stop"]
            bars.append(
                {
                    "key": run["key"],
                    "prefix": key_prefix(run["key"]),
                    "hue": zlib.crc32(key_prefix(run["key"]).encode()) % 360,
                    "worker": run["worker"],
                    "lane": lane,
                    "x": (begin - start) / TASK_STREAM_WINDOW * 1000,
                    "width": max((end - begin) / TASK_STREAM_WINDOW * 1000, 0.5),
                    "action": span["action"],
                    "status": run["status"],
                    "seconds": span["stop"] - span["start"],
                }
            )
    labels = [(a, names.get(a) or a) for a in lanes]
    return {"lanes": labels, "bars": bars, "window": TASK_STREAM_WINDOW}


def workers(r: redis.Redis, keys: Keys, params: Params) -> dict[str, Any]:
    """The registered workers, and the recent deaths."""
    snap = read_snapshot(r, keys, events=1, deaths=20, others=False)
    return {"snap": snap}


def worker(r: redis.Redis, keys: Keys, params: Params) -> dict[str, Any]:
    """One worker, alive or dead (by address or name): its info, last heartbeat, the
    tasks it was running, its story and, for a dead one, its death record."""
    who = params.get("w", "")
    found = inspect.read_worker(r, keys, who, story=STORY_ROWS, data=False, deaths=DEATH_SCAN)
    if found is not None:
        found["death"] = _death(found["death"]) if found["death"] else None
        found["last_heartbeat"] = _shaped(found["last_heartbeat"], BEAT)
        found["info"] = found["info"] if isinstance(found["info"], dict) else {}
    return {"who": who, "worker": found}


def logs(r: redis.Redis, keys: Keys, params: Params) -> dict[str, Any]:
    """The newest records of a process: ``w`` is ``scheduler`` or a worker's address or
    name (alive or dead); ``nanny`` set: its nanny's records."""
    who = params.get("w", "scheduler")
    nanny = params.get("nanny") == "1"
    if who == "scheduler":
        stream = keys.scheduler_logs
    else:
        address = logship.find_worker(logship.known_workers(r, keys), who)
        if address is None:
            return {"who": who, "records": None, "nanny": nanny}
        stream = keys.worker_logs(address)
        if nanny:
            stream = logship.nanny_stream(r, keys, address)
    records = logship.read(r, stream, n=LOG_LINES) if stream else []
    return {"who": who, "records": records, "nanny": nanny}


def deaths(r: redis.Redis, keys: Keys, params: Params) -> dict[str, Any]:
    """The newest death records, with their reasons, memory and running tasks."""
    return {"deaths": [_death(d) for d in inspect.read_deaths(r, keys, limit=DEATHS)]}


def events(r: redis.Redis, keys: Keys, params: Params) -> dict[str, Any]:
    """The cluster's event log, newest first, one line each."""
    newest_first = reversed(inspect.read_events(r, keys, count=EVENTS))
    return {"events": [(event, _describe(event)) for event in newest_first]}


def _describe(event: dict[str, Any]) -> str:
    try:
        return describe(event)
    except MALFORMED_EVENT as exc:  # one stranger's event, not the whole list
        return f"(an event this version cannot describe: {exc!r})"


def task(r: redis.Redis, keys: Keys, params: Params) -> dict[str, Any]:
    """One task: state, error and traceback, dependencies, story, its runs' log lines."""
    key = params.get("key", "")
    if not key:
        return {"task": None}
    return {"task": inspect.read_task(r, keys, key, dependents=False, newest=STORY_SCAN)}


# the fields a page shows of a death record and of a heartbeat, and their types: a value
# of another type (a stranger's record, another version's) is shown as missing
Number = (int, float)
DEATH = {"time": Number, "worker": str, "name": str, "how": str, "kind": str, "reason": str,
         "executing": list, "processing": list, "evidence": dict}  # fmt: skip
EVIDENCE = {"rss": Number, "memory_limit": Number, "exit_code": int, "signal": str,
            "traceback": str, "log_tail": list, "last_heartbeat": dict}  # fmt: skip
BEAT = {"time": Number, "status": str, "executing": list, "n_executing": int, "ready": int,
        "in_memory": int, "rss": Number, "managed": Number, "unmanaged": Number,
        "spilled": Number, "memory_limit": Number}  # fmt: skip


def _shaped(record: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """``record`` (a dict, else empty) without the listed fields of the wrong type."""
    if not isinstance(record, dict):
        return {}
    return {
        k: v
        for k, v in record.items()
        if k not in fields or (isinstance(v, fields[k]) and not isinstance(v, bool))
    }


def _death(record: dict[str, Any]) -> dict[str, Any]:
    death = _shaped(record, DEATH)
    death["evidence"] = evidence = _shaped(death.get("evidence"), EVIDENCE)
    evidence["last_heartbeat"] = _shaped(evidence.get("last_heartbeat"), BEAT)
    return death


FRAGMENTS: dict[str, Callable[[redis.Redis, Keys, Params], dict[str, Any]]] = {
    "status": status,
    "task-stream": task_stream,
    "workers": workers,
    "worker": worker,
    "logs": logs,
    "deaths": deaths,
    "events": events,
    "task": task,
}


def as_json(context: dict[str, Any]) -> Any:
    """A fragment's context as plain data (for ``/api/<fragment>``)."""

    def plain(value: Any) -> Any:
        if isinstance(value, Snapshot):
            return plain(value.to_dict())
        if isinstance(value, logship.LogRecord):
            return asdict(value)
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        if isinstance(value, bytes):
            return value.decode(errors="replace")
        if isinstance(value, float) and not math.isfinite(value):
            return None  # (JSON has no nan nor infinity)
        if value is None or isinstance(value, str | int | float):
            return value
        return str(value)  # what msgpack decodes to besides (a Timestamp, ...)

    return plain(context)
