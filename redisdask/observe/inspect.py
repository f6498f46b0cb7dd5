"""``redisdask inspect``: read-only answers from Redis, while or after a cluster runs.

Every function here issues read commands only (XREVRANGE, HGETALL, ...), so the tools
work from any machine that can reach Redis and never change what they look at.

* ``deaths``: every recorded worker death (and, under nannies, every graceful exit),
  newest first, with its kind, reason, memory figures, the tasks it was running and the
  tail of its log: the direct answer to "why did my worker die?".
* ``task KEY``: its record, dependencies and dependents, where it ran or is held, its
  error, and its story: every transition the scheduler and the workers logged, with the
  time and the process that caused it.
* ``worker W``: a live or dead worker's info, last heartbeat, story and data.
* ``keys``: the cluster's keys in Redis by kind, counted, with ``MEMORY USAGE`` sampled.
* ``events [--follow]``: the cluster event log, ``tail -f`` style.

Nothing is ever unpickled: a task's exception is shown from the text the worker recorded
next to the pickle.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import redis
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from redisdask.observe.views import clock
from redisdask.placement import Placement, format_resources, worker_resources
from redisdask.store import codecs, keyspace, logship
from redisdask.store.eventlog import describe
from redisdask.store.holdings import workers_only
from redisdask.store.keyspace import REDIS_COPY, Keys
from redisdask.store.task_record import TaskRecord
from redisdask.utils.sizes import format_bytes

LOG_LINES = 15  # lines of a death's log tail shown (``--json`` gives all of them)
SCAN_LIMIT = 200_000  # tasks read to find dependents or a worker's data (else: skipped)
PAGE = 1000  # entries or keys per read
MEMORY_SAMPLES = 20  # keys per kind whose MEMORY USAGE is asked (the rest extrapolated)
TEXT_FIELDS = ("worker", "type", "exception_text", "traceback_text", "erred_on",
               "exception_blame")  # fmt: skip
NUMBER_FIELDS = ("score", "retries", "nbytes", "suspicious")


def read_deaths(
    r: redis.Redis,
    keys: Keys,
    *,
    worker: str | None = None,
    since: float | None = None,
    limit: int = 1000,
) -> list[dict[str, Any]]:
    """Death records, newest first; ``worker`` matches an address or a name, ``since`` is
    a number of seconds back from now."""
    low = f"{int((time.time() - since) * 1000)}-0" if since is not None else "-"
    records = []
    for entry_id, fields in r.xrevrange(keys.deaths, "+", low, count=limit):
        record = codecs.unpack_or(fields.get(b"m"), None, dict)
        if record is None:
            continue  # not ours: a stranger's entry is no record
        if worker is not None and worker not in (record.get("worker"), record.get("name")):
            continue
        record["id"] = entry_id.decode()
        records.append(record)
    return records


def render_deaths(records: list[dict[str, Any]], console: Console) -> None:
    if not records:
        console.print("No worker deaths recorded.")
        return
    table = Table(title=f"{len(records)} worker deaths, newest first", expand=True)
    for column in ("when", "worker", "kind", "reason", "memory", "running"):
        table.add_column(column, overflow="fold")
    for d in records:
        evidence = d.get("evidence") or {}
        beat = evidence.get("last_heartbeat") or {}
        rss = evidence.get("rss") or beat.get("rss")
        limit = evidence.get("memory_limit") or beat.get("memory_limit")
        memory = "-" if not rss else format_bytes(rss)
        if rss and limit:
            memory += f" / {format_bytes(limit)}"
        running = d.get("executing") or d.get("processing") or []
        cells = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.get("time", 0))),
            f"{d.get('name') or d.get('worker')}\n{d.get('worker')} pid {d.get('pid')}",
            str(d.get("kind") or d.get("how")),
            str(d.get("reason", "")),
            memory,
            "\n".join(running[:5]) + (f"\n(+{len(running) - 5})" if len(running) > 5 else ""),
        )
        table.add_row(*(Text(c) for c in cells))  # recorded text is never markup
    console.print(table)
    # the log of the newest real death: a graceful exit's log rarely says much
    newest = next((d for d in records if d.get("kind") != "graceful"), records[0])
    tail = (newest.get("evidence") or {}).get("log_tail") or []
    if tail:
        console.print(
            Panel(
                Text("\n".join(tail[-LOG_LINES:])),
                title=f"last {min(len(tail), LOG_LINES)} log lines of "
                f"{newest.get('name') or newest.get('worker')} "
                f"({newest.get('kind') or newest.get('how')}, {clock(newest.get('time'))})",
            )
        )


def deaths_command(
    r: redis.Redis,
    keys: Keys,
    *,
    worker: str | None,
    since: float | None,
    as_json: bool,
    console: Console,
) -> None:
    records = read_deaths(r, keys, worker=worker, since=since)
    if as_json:
        console.print_json(json.dumps(records, default=_plain))
    else:
        render_deaths(records, console)


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


def print_json(console: Console, data: Any) -> None:
    console.print_json(json.dumps(data, default=_plain))


# --------------------------------------------------------------------------- stories


def _read_stream_matching(
    r: redis.Redis, stream: str, needle: bytes, newest: int | None = None
) -> Iterator[Any]:
    """The unpacked entries of ``stream`` (oldest first) whose payload contains ``needle``:
    a substring test on the raw bytes skips most entries without unpacking them.
    ``newest``: search only the newest that many entries (one read)."""
    if newest is not None:
        for _, fields in reversed(r.xrevrange(stream, count=newest)):
            raw = fields.get(b"m", b"")
            if needle in raw and (entry := codecs.unpack_or(raw, None)) is not None:
                yield entry
        return
    low = "-"
    while True:
        entries = r.xrange(stream, low, "+", count=PAGE)
        for _, fields in entries:
            raw = fields.get(b"m", b"")
            if needle in raw and (entry := codecs.unpack_or(raw, None)) is not None:
                yield entry
        if len(entries) < PAGE:
            return
        low = "(" + entries[-1][0].decode()


def task_story(
    r: redis.Redis, keys: Keys, key: str, newest: int | None = None
) -> list[dict[str, Any]]:
    """The scheduler's transitions of ``key``, oldest first: time, state, the stimulus and
    what caused it (op and origin: a worker address, a client id, or the scheduler);
    ``newest``: from the newest that many entries of the story only."""
    story = []
    for entry in _read_stream_matching(r, keys.story, key.encode(), newest):
        if not isinstance(entry, dict):
            continue  # not the scheduler's: a stranger's entry is skipped
        causes = entry.get("causes") if isinstance(entry.get("causes"), dict) else {}
        transitions = entry.get("transitions")
        for row in transitions if isinstance(transitions, list) else []:
            if isinstance(row, list) and len(row) == 3 and row[0] == key:
                cause = causes.get(row[2]) if isinstance(row[2], str) else None
                op, origin = cause if isinstance(cause, list) and len(cause) == 2 else ["?", "?"]
                story.append(
                    {
                        "time": entry.get("time"),
                        "state": row[1],
                        "stimulus_id": row[2],
                        "cause": op,
                        "origin": origin,
                    }
                )
    return story


def worker_story(
    r: redis.Redis,
    keys: Keys,
    address: str,
    key: str | None = None,
    limit: int = 200,
    newest: int | None = None,
) -> list[dict[str, Any]]:
    """A worker's own story (``key``: only about that task, searched in the ``newest``
    entries only, if given), oldest first."""
    rows: list[dict[str, Any]] = []
    stream = keys.worker_story(address)
    if key is not None:
        entries = list(_read_stream_matching(r, stream, key.encode(), newest))
    else:
        newest_first = r.xrevrange(stream, count=limit)
        entries = [codecs.unpack_or(f.get(b"m"), None) for _, f in reversed(newest_first)]
    for entry in entries:
        for row in entry if isinstance(entry, list) else []:
            if not isinstance(row, list) or len(row) != 5 or (key is not None and row[1] != key):
                continue
            when, task, start, finish, sid = row
            rows.append(
                {
                    "time": when,
                    "worker": address,
                    "key": task,
                    "start": start,
                    "finish": finish,
                    "stimulus_id": sid,
                }
            )
    return rows[-limit:]


# --------------------------------------------------------------------------- tasks


def _scan_tasks(r: redis.Redis, keys: Keys, *fields: str) -> Iterator[tuple[str, list[Any]]]:
    """``(key, [field values])`` of every task (up to ``SCAN_LIMIT``), read in pipelines."""
    batch: list[str] = []

    def flush() -> Iterator[tuple[str, list[Any]]]:
        pipe = r.pipeline(transaction=False)
        for key in batch:
            pipe.hmget(keys.task(key), *fields)
        yield from zip(batch, pipe.execute(), strict=True)
        batch.clear()

    for seen, raw in enumerate(r.sscan_iter(keys.tasks, count=PAGE), 1):
        batch.append(raw.decode(errors="replace"))
        if len(batch) >= PAGE:
            yield from flush()
        if seen >= SCAN_LIMIT:
            break
    if batch:
        yield from flush()


def read_task(
    r: redis.Redis, keys: Keys, key: str, *, dependents: bool = True, newest: int | None = None
) -> dict[str, Any]:
    """Everything Redis knows of a task; ``state`` is ``unknown`` if it has no record
    (never submitted, or forgotten: its story may still tell what became of it).
    Its dependents are found by reading every task's dependencies: ``dependents=False``
    (the dashboard) skips that, so the cost does not grow with the graph; ``newest``
    bounds the stories and logs searched to their newest that many entries."""
    raw = r.hgetall(keys.task(key))
    record = TaskRecord.from_hash(raw)
    task: dict[str, Any] = {"key": key, "state": record.state or "unknown"}
    for name in TEXT_FIELDS:  # shown as stored, when stored
        if name.encode() in raw:
            task[name] = getattr(record, name)
    for name in NUMBER_FIELDS:
        if raw.get(name.encode()) not in (None, b""):
            task[name] = getattr(record, name)
    # where the result lives: the workers holding it, and (a small result) its record
    task["who_has"] = workers_only(record.who_has)
    task["in_redis"] = REDIS_COPY in record.who_has
    task["restricted_to"] = record.workers
    task["allow_other_workers"] = record.loose
    task["resources"] = record.resources
    if record.state == "no-worker":  # why: what it asks for, what the workers have
        infos = {
            a.decode(errors="replace"): codecs.worker_info_or_empty(i)
            for a, i in r.hgetall(keys.workers).items()
        }
        placement = Placement(lambda: infos)
        task["waits_because"] = placement.why_not(record.workers, record.resources, record.loose)
    task["dependencies"] = record.deps
    task["deaths"] = record.deaths
    task["spec_bytes"] = len(record.spec or b"")
    if dependents:
        task["dependents"], task["dependents_complete"] = _dependents(r, keys, key)
    task["story"] = task_story(r, keys, key, newest)
    holders = {task.get("worker"), task.get("erred_on"), *task["who_has"]}
    holders |= {str(row["origin"]) for row in task["story"] if str(row["origin"]).startswith("tcp")}
    workers = sorted(h for h in holders if h)
    task["worker_story"] = sorted(
        (row for w in workers for row in worker_story(r, keys, w, key, newest=newest)),
        key=lambda row: row["time"] or 0,
    )
    task["logs"] = run_logs(r, keys, workers, key, newest)
    return task


def _dependents(r: redis.Redis, keys: Keys, key: str) -> tuple[list[str], bool]:
    """The tasks that depend on ``key``, and whether every task was read to find them."""
    found, scanned = [], 0
    for other, values in _scan_tasks(r, keys, "deps"):
        scanned += 1
        deps = values[0]  # (cheap first: most tasks do not name the key)
        if deps and key.encode() in deps and key in TaskRecord.from_hmget(["deps"], values).deps:
            found.append(other)
    return sorted(found), scanned < SCAN_LIMIT


def run_logs(
    r: redis.Redis, keys: Keys, workers: list[str], key: str, newest: int | None = None
) -> list[dict[str, Any]]:
    """The log records that the runs of ``key`` emitted (from the thread that ran it) on
    ``workers``, oldest first, as far as their log streams (their ``newest`` records, if
    given) still hold them."""
    found = [
        asdict(record)
        for worker in workers
        for record in logship.read(r, keys.worker_logs(worker), n=newest)
        if record.task == key
    ]
    return sorted(found, key=lambda record: record["time"])


def render_task(task: dict[str, Any], console: Console) -> None:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    rows = [
        ("key", task["key"]),
        ("state", task["state"]),
        ("running on", task.get("worker") or "-"),
        ("held by", ", ".join(task["who_has"]) or "-"),
        ("in Redis", _in_redis(task)),
        ("size", format_bytes(task["nbytes"]) if task.get("nbytes") else "-"),
        ("type", task.get("type") or "-"),
        ("restricted to", _restriction(task)),
        ("resources", format_resources(task["resources"]) or "-"),
        ("retries left", str(task.get("retries", 0))),
        ("suspicious", str(task.get("suspicious", 0))),
        ("dependencies", ", ".join(task["dependencies"]) or "-"),
        ("dependents", ", ".join(task["dependents"]) or "-"),
    ]
    if task.get("waits_because"):
        rows.insert(2, ("waits because", task["waits_because"]))
    for name, value in rows:
        grid.add_row(name, Text(str(value)))
    console.print(Panel(grid, title=f"task {task['key']}", title_align="left"))
    if task.get("exception_text"):
        text = task["exception_text"] + "\n" + (task.get("traceback_text") or "")
        console.print(Panel(Text(text.strip()), title="error", border_style="red"))
    story = Table(title="story (scheduler)", title_justify="left", expand=True)
    for column in ("time", "state", "cause", "from", "stimulus"):
        story.add_column(column, overflow="fold")
    for row in task["story"]:
        story.add_row(
            clock(row["time"], millis=True), row["state"], row["cause"], Text(row["origin"]),
            Text(row["stimulus_id"], style="dim"),
        )  # fmt: skip
    if not task["story"]:
        story.add_row("", Text("no transitions kept (older than retention.story?)", style="dim"))
    console.print(story)
    if task["worker_story"]:
        console.print(_worker_story_table(task["worker_story"], "story (workers)"))
    if task["logs"]:
        lines = "\n".join(logship.LogRecord(**record).line for record in task["logs"])
        console.print(Panel(Text(lines), title="logged by its runs", title_align="left"))


def _in_redis(task: dict[str, Any]) -> str:
    """Whether the result lives in Redis too (no worker is needed to read it)."""
    if task.get("in_redis"):
        return "yes: a small result, kept in the task's record (outlives its workers)"
    return "no" if task["state"] == "memory" else "-"


def _restriction(task: dict[str, Any]) -> str:
    if not task["restricted_to"]:
        return "any worker"
    named = ", ".join(task["restricted_to"])
    return f"{named} (preferred: allow_other_workers)" if task["allow_other_workers"] else named


def _worker_story_table(rows: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title, title_justify="left", expand=True)
    for column in ("time", "worker", "key", "transition", "stimulus"):
        table.add_column(column, overflow="fold")
    for row in rows:
        move = f"{row['start']} -> {row['finish']}" if row["key"] else row["start"]
        detail = row["stimulus_id"] if row["key"] else row["finish"]
        table.add_row(
            clock(row["time"], millis=True), Text(row["worker"]), Text(row["key"] or "-"), move,
            Text(str(detail), style="dim"),
        )  # fmt: skip
    return table


# --------------------------------------------------------------------------- workers


def read_worker(
    r: redis.Redis,
    keys: Keys,
    who: str,
    story: int = 200,
    *,
    data: bool = True,
    deaths: int = 100_000,
) -> dict[str, Any] | None:
    """A live worker by address or name; else the newest death record of one, among the
    newest ``deaths`` records.  The results it holds are found by reading every task:
    ``data=False`` (the dashboard) skips that."""
    workers = {
        a.decode(errors="replace"): codecs.worker_info_or_empty(i)
        for a, i in r.hgetall(keys.workers).items()
    }
    address = next((a for a, i in workers.items() if who in (a, i.get("name"))), None)
    death = None
    if address is None:
        found = read_deaths(r, keys, worker=who, limit=deaths)
        if not found:
            return None
        death = found[0]
        address = str(death.get("worker"))
    beat = codecs.unpack_or(r.hget(keys.heartbeats, address), {}, dict)
    if death is not None:  # (a stranger's record may hold anything)
        evidence = death.get("evidence")
        beat = evidence.get("last_heartbeat") if isinstance(evidence, dict) else None
        beat = beat if isinstance(beat, dict) else {}
    return {
        "address": address,
        "alive": death is None,
        "info": workers.get(address) or {k: (death or {}).get(k) for k in ("name", "host", "pid")},
        "last_heartbeat": beat,
        "processing": sorted(m.decode() for m in r.smembers(keys.worker_processing(address))),
        "data": _held_by(r, keys, address) if data else [],
        "death": death,
        "story": worker_story(r, keys, address, limit=story),
    }


def _held_by(r: redis.Redis, keys: Keys, address: str) -> list[dict[str, Any]]:
    """The results ``address`` holds, the largest first."""
    data = []
    needle, names = address.encode(), ("who_has", "nbytes", "type")
    for key, values in _scan_tasks(r, keys, *names):
        if values[0] and needle in values[0]:  # (cheap: most tasks are elsewhere)
            record = TaskRecord.from_hmget(names, values)
            if address in record.who_has:
                data.append({"key": key, "nbytes": record.nbytes, "type": record.type})
    return sorted(data, key=lambda d: -d["nbytes"])


def render_worker(worker: dict[str, Any], console: Console) -> None:
    info, beat = worker["info"], worker["last_heartbeat"]
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    status = beat.get("status", "?") if worker["alive"] else "dead"
    rows = [
        ("address", worker["address"]),
        ("name", info.get("name")),
        ("host / pid", f"{info.get('host')} / {info.get('pid')}"),
        ("status", status),
        ("threads", info.get("nthreads")),
        ("resources", format_resources(worker_resources(info)) or "-"),
        ("restarts", info.get("restarts", 0)),
        ("memory", _memory_line(beat)),
        ("executing", ", ".join(beat.get("executing") or []) or "-"),
        ("processing", ", ".join(worker["processing"]) or "-"),
    ]
    if worker["death"]:
        rows.append(("died", f"{worker['death'].get('kind')}: {worker['death'].get('reason')}"))
    for name, value in rows:
        grid.add_row(name, Text(str(value)))
    console.print(Panel(grid, title=f"worker {info.get('name') or worker['address']}"))
    data = Table(title=f"{len(worker['data'])} results held", title_justify="left", expand=True)
    for column in ("key", "size", "type"):
        data.add_column(column, overflow="fold")
    for d in worker["data"][:50]:
        data.add_row(Text(d["key"]), format_bytes(d["nbytes"]), Text(d["type"]))
    console.print(data)
    console.print(_worker_story_table(worker["story"], "story (newest last)"))


def _memory_line(beat: dict[str, Any]) -> str:
    if not beat:
        return "-"
    line = f"{format_bytes(beat.get('rss') or 0)} process"
    if beat.get("memory_limit"):
        line += f" of {format_bytes(beat['memory_limit'])} limit"
    line += f"; managed {format_bytes(beat.get('managed') or 0)}"
    if beat.get("spilled"):
        line += f", spilled {format_bytes(beat['spilled'])}"
    return line


# --------------------------------------------------------------------------- keys


def read_keys(r: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    """The cluster's keys by kind (``task:*``, ``worker:*:story``, ...): count, Redis type
    and memory, ``MEMORY USAGE`` of up to ``MEMORY_SAMPLES`` keys per kind extrapolated."""
    kinds: dict[str, list[bytes]] = {}
    prefix = keys.prefix.encode()
    # (cluster names are letters, digits and "._-": nothing in the prefix is a glob)
    for raw in r.scan_iter(match=keys.prefix + "*", count=PAGE):
        kinds.setdefault(_kind(raw[len(prefix) :].decode(errors="replace")), []).append(raw)
    rows = []
    for kind, names in sorted(kinds.items()):
        sample = names[:MEMORY_SAMPLES]
        pipe = r.pipeline(transaction=False)
        pipe.type(sample[0])
        for name in sample:
            pipe.memory_usage(name, samples=5)
        # a key the user may not read (the ``monitor`` role and ``secret``): counted, no type
        redis_type, *usages = pipe.execute(raise_on_error=False)
        if isinstance(redis_type, redis.ResponseError):
            redis_type = b"(not readable)"
        measured = [u for u in usages if isinstance(u, int)]
        mean = sum(measured) / len(measured) if measured else 0
        rows.append(
            {
                "kind": kind,
                "count": len(names),
                "type": redis_type.decode(),
                "sampled": len(measured),
                "bytes": int(mean * len(names)),
            }
        )
    return sorted(rows, key=lambda row: -row["bytes"])


def _kind(name: str) -> str:
    """``task:inc-1`` -> ``task:*``; ``worker:tcp://h:1:story`` -> ``worker:*:story``;
    ``lock:x`` -> ``lock:*``; ``waiters:queue:q`` -> ``waiters:queue:*``."""
    head, _, rest = name.partition(":")
    if head in ("task", "queue-refs", "rebalance", *keyspace.COORDINATION_KINDS):
        return f"{head}:*"
    if head in ("waiters", "signal") and rest:
        return f"{head}:{rest.partition(':')[0]}:*"
    if head in ("worker", "client") and rest:
        return f"{head}:*:{rest.rsplit(':', 1)[-1]}"
    return name


def render_keys(rows: list[dict[str, Any]], keys: Keys, console: Console) -> None:
    total = sum(row["bytes"] for row in rows)
    table = Table(
        title=f"keys of cluster {keys.cluster} ({keys.prefix}*): about {format_bytes(total)}",
        title_justify="left",
    )
    for column in ("kind", "type", "count", "memory", "sampled"):
        table.add_column(column, justify="right" if column in ("count", "memory") else "left")
    for row in rows:
        table.add_row(
            Text(row["kind"]), row["type"], f"{row['count']:,}", format_bytes(row["bytes"]),
            f"{row['sampled']}",
        )  # fmt: skip
    console.print(table)


# --------------------------------------------------------------------------- events


def read_events(r: redis.Redis, keys: Keys, count: int = 50) -> list[dict[str, Any]]:
    """The newest ``count`` events, oldest first."""
    entries = reversed(r.xrevrange(keys.events, count=count))
    return [e for e in (_event(i, f) for i, f in entries) if e]


def _event(entry_id: bytes, fields: dict[bytes, bytes]) -> dict[str, Any] | None:
    event = codecs.unpack_or(fields.get(b"m"), None, dict)
    if event is not None:
        event["id"] = entry_id.decode()
    return event


def follow_events(r: redis.Redis, keys: Keys, after: str = "$") -> Iterator[dict[str, Any]]:
    """Events as they are appended (XREAD BLOCK), forever."""
    last = after
    while True:
        reply = r.xread({keys.events: last}, block=1000, count=PAGE)
        for _, entries in reply or []:
            for entry_id, fields in entries:
                last = entry_id.decode()
                event = _event(entry_id, fields)
                if event:
                    yield event


def events_command(
    r: redis.Redis, keys: Keys, *, count: int, follow: bool, as_json: bool, console: Console
) -> None:
    events = read_events(r, keys, count)
    if as_json and not follow:
        print_json(console, events)
        return
    last = events[-1]["id"] if events else "$"  # (-n 0: from now on)
    try:
        for event in events:
            _print_event(event, as_json, console)
        if follow:
            for event in follow_events(r, keys, last):
                _print_event(event, as_json, console)
    except KeyboardInterrupt:
        return


def _print_event(event: dict[str, Any], as_json: bool, console: Console) -> None:
    if as_json:  # one object per line: a stream a script can read line by line
        console.out(json.dumps(event, default=_plain), highlight=False)
        return
    line = Text(clock(event.get("time"), millis=True) + "  ", style="dim")
    line.append(describe(event))
    console.print(line)
