"""Rich renderables of a ``Snapshot``: the pieces ``redisdask status`` prints once and
``redisdask monitor`` redraws twice a second.

Everything recorded in Redis (names, reasons, keys) is shown as ``Text``, never parsed
as markup: a task key like ``"[red]x"`` is shown as written.  Widths are explicit so
that a narrow terminal drops columns instead of wrapping every row.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from redisdask.observe.snapshot import PrefixView, Snapshot, WorkerView
from redisdask.store import redis_memory
from redisdask.store.eventlog import describe, spill_failed
from redisdask.utils.sizes import format_bytes

NARROW = 100  # columns below which the tables drop their less vital columns
SPARKS = " ▁▂▃▄▅▆▇█"
MARKS = {"target": ("┆", "yellow"), "spill": ("┊", "dark_orange"), "pause": ("╏", "red"),
         "terminate": ("║", "bold red")}  # fmt: skip
EVENT_STYLES = {
    "worker-died": "red",
    "killed-worker": "bold red",
    "worker-joined": "green",
    "worker-left": "yellow",
    "scheduler-start": "cyan",
    "redis-reconnected": "magenta",
    "spill-failed": "bold red",
}


def clock(t: Any, millis: bool = False) -> str:
    """``HH:MM:SS`` (``.mmm``) of a recorded time; a stranger's non-number shows dashes."""
    if not isinstance(t, int | float) or isinstance(t, bool) or not t:
        return "--:--:--"
    try:
        text = time.strftime("%H:%M:%S", time.localtime(t))
    except (OverflowError, OSError, ValueError):  # a time no clock shows (1e18, nan)
        return "--:--:--"
    return text + f".{int(t * 1000) % 1000:03d}" if millis else text


def ago(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


# --------------------------------------------------------------------------- header


def header(snap: Snapshot, url: str) -> Text:
    """Who leads, since when; the Redis server; task totals."""
    text = Text()
    text.append(f"cluster {snap.cluster}", style="bold")
    text.append(f"  on {url}\n", style="dim")
    sched = snap.scheduler
    if snap.has_scheduler:
        text.append("scheduler ", style="bold")
        text.append(sched.get("id", "?"))
        try:
            since: float | None = float(sched.get("since") or "nan")
        except ValueError:  # (a stranger's value)
            since = None
        since = since if since == since else None
        text.append(
            f"  leads since {clock(since)} ({ago(snap.time - since if since else None)}), "
            f"token {sched.get('token', '?')}, lease {snap.lease_ttl_ms / 1000:.1f}s left\n"
        )
    elif sched:
        text.append("no scheduler holds the lease", style="bold red")
        text.append(f" (the last was {sched.get('id', '?')})\n")
    elif not snap.exists:
        found = ", ".join(snap.other_clusters) or "none"
        text.append(f"waiting for a scheduler on {url}: ", style="bold yellow")
        text.append(f"no cluster named {snap.cluster!r} there yet", style="bold red")
        text.append(f" (clusters there: {found}); check --cluster\n")
    else:
        text.append(f"waiting for a scheduler on {url}\n", style="bold yellow")
    info = snap.redis
    if info:
        text.append("redis ", style="bold")
        text.append(
            f"{info.get('redis_version', '?')}  {format_bytes(int(info.get('used_memory') or 0))} "
            f"used  {int(info.get('instantaneous_ops_per_sec') or 0):,} ops/s  "
            f"{info.get('connected_clients', '?')} connections\n"
        )
        memory = redis_memory.from_info(info)
        for problem in (memory.policy_problem(), memory.full and redis_memory.full_text(memory)):
            if problem:
                text.append(f"{problem}\n", style="bold red")
    text.append("tasks ", style="bold")
    text.append_text(state_counts(snap.states))
    rate = snap.finished[-5:]
    per_second = sum(rate) / len(rate) if rate else 0.0
    text.append(
        f"   finished {snap.finished_total:,} ({per_second:,.0f}/s)  erred {snap.erred_total:,}"
        f"  clients {snap.clients}"
    )
    for waiting in snap.no_worker:  # tasks no worker may run: say what they ask for
        text.append(f"\n{waiting['count']} no-worker", style="yellow")
        text.append(f" (e.g. {waiting['key']}): ", style="dim")
        text.append(waiting["reason"])
    for w in snap.workers:  # a worker that cannot spill may wait for good: say why
        if w.spill_error:
            text.append("\n")
            text.append(spill_failed(_spill_figures(w)), style="bold red")
    return text


def _spill_figures(w: WorkerView) -> dict[str, Any]:
    """A worker's heartbeat figures in the fields of a ``spill-failed`` event."""
    return {
        "name": w.name,
        "worker": w.address,
        "error": w.spill_error,
        "managed": w.managed,
        "rss": w.rss,
        "memory_limit": w.memory_limit,
        "paused": w.status == "paused",
    }


def state_counts(states: dict[str, int]) -> Text:
    order = ("waiting", "no-worker", "queued", "processing", "memory", "erred", "released")
    styles = {"processing": "blue", "memory": "green", "erred": "red", "no-worker": "yellow"}
    text = Text()
    shown = [s for s in order if states.get(s)] + sorted(set(states) - set(order))
    for state in shown or ["no tasks"]:
        if state == "no tasks":
            text.append("none", style="dim")
            break
        text.append(f"{states[state]:,} ", style=styles.get(state, ""))
        text.append(f"{state}  ", style="dim")
    return text


# --------------------------------------------------------------------------- workers


def memory_bar(w: WorkerView, width: int) -> Text:
    """``width`` cells for the memory limit: managed (green), unmanaged (blue), the
    target/spill/pause/terminate marks; then the figures and what is spilled."""
    bar = Text()
    if not w.memory_limit:
        return bar.append(f"{format_bytes(w.rss)} (no limit)", style="dim")
    limit = w.memory_limit
    managed = min(width, round(width * w.managed / limit))
    unmanaged = min(width - managed, round(width * w.unmanaged / limit))
    cells: list[tuple[str, str]] = [("█", "green")] * managed + [("█", "blue")] * unmanaged
    cells += [("·", "grey37")] * (width - len(cells))
    for name, (char, style) in MARKS.items():
        fraction = w.fractions.get(name)
        if fraction and not isinstance(fraction, bool) and 0 < fraction <= 1:
            i = min(width - 1, int(width * fraction))
            if cells[i][0] == "·":
                cells[i] = (char, style)
            else:
                cells[i] = (cells[i][0], f"{cells[i][1]} on {style}")
    for char, style in cells:
        bar.append(char, style=style)
    used = w.managed + w.unmanaged
    bar.append(f" {format_bytes(used)}/{format_bytes(limit)}")
    if w.spilled:
        bar.append(f" +{format_bytes(w.spilled)} spilled", style="dark_orange")
    return bar


def workers_table(
    snap: Snapshot, width: int = 120, limit: int | None = None, legend: bool = True
) -> Table:
    narrow = width < NARROW
    shown = snap.workers if limit is None else snap.workers[: max(1, limit)]
    hidden = len(snap.workers) - len(shown)
    table = Table(
        title=f"{len(snap.workers)} workers" + (f" ({hidden} not shown)" if hidden else ""),
        title_justify="left",
        caption="memory: managed █ unmanaged █, marks: target ┆ spill ┊ pause ╏ kill ║"
        if legend
        else None,
        caption_justify="left",
        expand=True,
        padding=(0, 1),
    )
    table.add_column("worker", overflow="ellipsis", no_wrap=True, ratio=2, min_width=8)
    if not narrow:
        table.add_column("host", overflow="ellipsis", no_wrap=True, ratio=1)
        table.add_column("thr", justify="right")
    table.add_column("status", no_wrap=True)
    table.add_column("run/rdy", justify="right", no_wrap=True)
    # what the other columns, borders and the figures after the bar take
    bar_width = max(8, min(40, width - (60 if narrow else 100)))
    table.add_column("memory", no_wrap=True)
    if not narrow:
        table.add_column("cpu", justify="right")
        table.add_column("beat", justify="right")
        table.add_column("restarts", justify="right")
    if not snap.workers:
        table.add_row(Text("no workers registered", style="dim"))
    for w in shown:
        status_style = {"running": "green", "paused": "red", "retiring": "yellow"}.get(w.status, "")
        stale = w.heartbeat_age is not None and w.heartbeat_age > 3.0
        row: list[RenderableType] = [Text(w.name, style="bold" if w.name != w.address else "")]
        if not narrow:
            row += [Text(w.host), str(w.nthreads)]
        row += [
            Text(w.status, style=status_style),
            f"{w.executing}/{w.ready}",
            memory_bar(w, bar_width),
        ]
        if not narrow:
            row += [
                f"{w.cpu:.0f}%",
                Text(ago(w.heartbeat_age), style="red" if stale else ""),
                Text(str(w.restarts), style="yellow" if w.restarts else "dim"),
            ]
        table.add_row(*row)
    return table


# --------------------------------------------------------------------------- tasks


def progress_bar(p: PrefixView, width: int) -> Text:
    """Dask's progress bar: memory (green), erred (red), processing (blue), waiting
    (grey), released (dim) cells, in proportion to the prefix's tasks."""
    bar = Text()
    total = p.total or 1
    parts = [
        (p.memory, "green"),
        (p.erred, "red"),
        (p.processing, "blue"),
        (p.waiting, "grey50"),
        (p.released, "grey23"),
    ]
    used = 0
    for n, style in parts:
        cells = round(width * n / total) if n else 0
        cells = min(cells, width - used)
        bar.append("█" * cells, style=style)
        used += cells
    if used < width:
        bar.append("█" * (width - used), style="grey23")
    return bar


def progress_table(snap: Snapshot, width: int = 120, limit: int = 12) -> Table:
    narrow = width < NARROW
    prefixes = sorted(snap.prefixes, key=lambda p: (-(p.waiting + p.processing), p.prefix))
    shown = prefixes[: max(1, limit)]
    hidden = len(prefixes) - len(shown)
    title = "progress by task prefix" + (f" ({hidden} not shown)" if hidden else "")
    table = Table(title=title, title_justify="left", expand=True)
    table.add_column("prefix", overflow="ellipsis", no_wrap=True, ratio=1, min_width=8)
    table.add_column("bar", no_wrap=True)
    for column in ("waiting", "processing", "memory", "erred") + (() if narrow else ("released",)):
        table.add_column(column, justify="right")
    bar_width = max(6, min(50, width - (55 if narrow else 75)))
    for p in shown:
        row: list[RenderableType] = [
            Text(p.prefix),
            progress_bar(p, bar_width),
            f"{p.waiting:,}",
            f"{p.processing:,}",
            f"{p.memory:,}",
            Text(f"{p.erred:,}", style="red" if p.erred else ""),
        ]
        if not narrow:
            row.append(f"{p.released:,}")
        table.add_row(*row)
    if not prefixes:
        table.add_row(Text("no tasks", style="dim"))
    return table


def sparkline(values: Sequence[int], width: int) -> Text:
    """The newest ``width`` values as block characters, scaled to the largest."""
    values = list(values)[-width:]
    top = max(values, default=0)
    text = Text()
    for v in values:
        level = 0 if not v else max(1, round(v / top * (len(SPARKS) - 1)))
        text.append(SPARKS[level], style="green")
    return text


def throughput(snap: Snapshot, width: int = 120) -> Text:
    spark_width = max(10, min(len(snap.finished), width - 45))
    text = Text("finished/s ", style="bold")
    text.append_text(sparkline(snap.finished, spark_width))
    peak = max(snap.finished, default=0)
    text.append(f"  now {snap.finished[-1] if snap.finished else 0:,}  peak {peak:,}  (60 s)")
    return text


# --------------------------------------------------------------------------- events


def events_table(events: list[dict[str, Any]], limit: int = 10) -> Table:
    table = Table(title="recent events", title_justify="left", expand=True, show_header=False)
    table.add_column("time", no_wrap=True, style="dim")
    table.add_column("event", overflow="ellipsis", no_wrap=True, ratio=1)
    for event in events[:limit]:
        style = EVENT_STYLES.get(str(event.get("kind")), "")
        table.add_row(clock(event.get("time")), Text(describe(event), style=style))
    if not events:
        table.add_row("", Text("no events yet", style="dim"))
    return table


def deaths_table(deaths: list[dict[str, Any]]) -> Table:
    table = Table(title="recent worker deaths", title_justify="left", expand=True)
    for column in ("when", "worker", "kind", "reason"):
        table.add_column(column, overflow="fold")
    for d in deaths:
        table.add_row(
            clock(d.get("time")),
            Text(str(d.get("name") or d.get("worker"))),
            Text(str(d.get("kind") or d.get("how"))),
            Text(str(d.get("reason", ""))),
        )
    if not deaths:
        table.add_row("", Text("none recorded", style="dim"))
    return table


# --------------------------------------------------------------------------- screens


def status_view(snap: Snapshot, url: str, width: int = 120) -> Group:
    """``redisdask status``: who leads, the workers, counts per state, recent deaths."""
    return Group(
        header(snap, url),
        workers_table(snap, width),
        progress_table(snap, width),
        deaths_table(snap.deaths),
    )


def dashboard(snap: Snapshot, url: str, width: int = 120, height: int = 40) -> Group:
    """One frame of ``redisdask monitor``, fitted to ``height`` lines: the header and the
    workers first; prefixes, then events, get what is left."""
    # the header (and its no-worker lines); throughput and footer
    spare = height - (4 if width >= NARROW else 6) - len(snap.no_worker) - 2
    spare -= sum(1 for w in snap.workers if w.spill_error)
    legend = height >= 30
    worker_rows = min(max(1, len(snap.workers)), max(1, spare - 5 - 6 - legend))
    spare -= worker_rows + 5 + legend
    prefix_rows = max(1, min(12, max(1, len(snap.prefixes)), spare - 5))
    spare -= prefix_rows + 5
    parts: list[RenderableType] = [
        header(snap, url),
        workers_table(snap, width, limit=worker_rows, legend=legend),
        progress_table(snap, width, limit=prefix_rows),
        throughput(snap, width),
    ]
    if spare >= 4:
        parts.append(events_table(snap.events, limit=spare - 3))
    parts.append(Text("q or Ctrl-C quits", style="dim"))
    return Group(*parts)
