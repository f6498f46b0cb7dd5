"""``redisdask inspect``: read-only answers from Redis, while or after a cluster runs.

Every function here issues read commands only (XREVRANGE, HGETALL, ...), so the tools
work from any machine that can reach Redis and never change what they look at.

* ``deaths``: every recorded worker death (and, under nannies, every graceful exit),
  newest first, with its kind, reason, memory figures, the tasks it was running and the
  tail of its log: the direct answer to "why did my worker die?".
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from redisdask import schema
from redisdask.memory import format_bytes
from redisdask.schema import Keys

LOG_LINES = 15  # lines of a death's log tail shown (``--json`` gives all of them)


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
        try:
            record = schema.unpack(fields[b"m"])
        except (KeyError, ValueError, TypeError):
            continue  # not ours: a stranger's entry is no record
        if not isinstance(record, dict):
            continue
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
    newest = records[0]
    tail = (newest.get("evidence") or {}).get("log_tail") or []
    if tail:
        console.print(
            Panel(
                Text("\n".join(tail[-LOG_LINES:])),
                title=f"last {min(len(tail), LOG_LINES)} log lines of "
                f"{newest.get('name') or newest.get('worker')} (newest death)",
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
