"""``performance_report``: what ran inside a ``with`` block, as a plain-text summary.

distributed's ``performance_report`` saves its dashboard's plots as HTML.  Here the same
context manager writes text (``dask-report.txt`` by default), built from what is already
in Redis: the task stream read back from the workers' stories (``task_stream.py``) and
the death records.  It says what a Dask user opens that report for: which tasks took the
time, how busy the workers were, what moved between them, and which workers died while
it ran, and why.

The workers write their stories with each heartbeat, so on leaving the block the report
waits two worker heartbeat intervals (1 s by default) before it reads them; what a worker
killed with -9 ran since its last heartbeat is not in its story, nor in the report.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redisdask.context import default_client
from redisdask.observe.inspect import read_deaths
from redisdask.observe.task_stream import read_task_stream
from redisdask.spec import key_prefix
from redisdask.store.urls import redact

if TYPE_CHECKING:
    from redisdask.client.client import Client

TOP_PREFIXES = 20


class performance_report:
    """Write a text report of what ran inside the block (``with`` or ``async with``)::

        with performance_report(filename="report.txt"):
            x.compute()

    ``stacklevel``, ``mode`` and ``storage_options`` are accepted for distributed's
    sake (there is no HTML and no code to capture here)."""

    def __init__(
        self,
        filename: str | Path = "dask-report.txt",
        stacklevel: int = 1,
        mode: str | None = None,
        storage_options: dict[str, Any] | None = None,
        client: Client | None = None,
    ) -> None:
        self.filename = Path(filename)
        self._client = client
        self.start = 0.0
        self.text = ""

    def _the_client(self) -> Client:
        if self._client is None:
            self._client = default_client()
        return self._client

    def __enter__(self) -> performance_report:
        self._the_client()
        self.start = time.time()
        return self

    def __exit__(self, *exc: object) -> None:
        stop = time.time()
        client = self._the_client()
        time.sleep(2 * client.config.worker.heartbeat_interval)  # the last stories
        self._write(client, stop)

    async def __aenter__(self) -> performance_report:
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        stop = time.time()
        client = self._the_client()
        await asyncio.sleep(2 * client.config.worker.heartbeat_interval)  # the last stories
        await asyncio.get_running_loop().run_in_executor(None, self._write, client, stop)

    def _write(self, client: Client, stop: float) -> None:
        tasks = read_task_stream(client.redis, client.keys, self.start, stop + 1.0)
        workers = client._cluster_info()["workers"]
        deaths = [
            d
            for d in read_deaths(client.redis, client.keys, since=time.time() - self.start + 1)
            if d.get("time", 0) >= self.start
        ]
        title = f"cluster {client.keys.cluster!r} on {redact(client.redis_url)}"
        self.text = report_text(title, tasks, workers, deaths, self.start, stop)
        self.filename.write_text(self.text)


def report_text(
    title: str,
    tasks: list[dict[str, Any]],
    workers: dict[str, dict[str, Any]],
    deaths: list[dict[str, Any]],
    start: float,
    stop: float,
) -> str:
    """The report: a summary, the task prefixes by compute time, the workers, the deaths."""
    wall = max(stop - start, 1e-9)
    computes = [(t, s) for t in tasks for s in t["startstops"] if s["action"] == "compute"]
    transfers = [(t, s) for t in tasks for s in t["startstops"] if s["action"] == "transfer"]
    threads = sum(int(w.get("nthreads") or 0) for w in workers.values()) or 1
    busy = sum(s["stop"] - s["start"] for _t, s in computes)
    errors = sum(t["status"] == "error" for t, _s in computes)
    lines = [
        "redisdask performance report",
        f"{title}",
        f"from {_clock(start)} to {_clock(stop)} ({wall:.2f} s)",
        f"{len(workers)} workers, {threads} threads",
        "",
        f"tasks computed: {len(computes)} ({errors} erred); compute time {busy:.2f} s; "
        f"thread utilisation {100 * busy / (wall * threads):.0f}%",
        f"transfers between workers: {len(transfers)}, "
        f"{sum(s['stop'] - s['start'] for _t, s in transfers):.2f} s",
        "",
        "task prefixes by compute time:",
        _table(
            ("prefix", "tasks", "erred", "total s", "mean ms", "max ms"),
            _by_prefix(computes),
        ),
        "",
        "workers:",
        _table(
            ("worker", "tasks", "compute s", "busy", "transfers"),
            _by_worker(computes, transfers, workers, wall),
        ),
        "",
    ]
    if deaths:
        lines.append(f"worker deaths while it ran: {len(deaths)}")
        rows = [
            (
                _clock(d.get("time", 0)),
                str(d.get("name") or d.get("worker")),
                str(d.get("kind") or d.get("how")),
                str(d.get("reason", "")),
                ", ".join((d.get("executing") or d.get("processing") or [])[:3]),
            )
            for d in deaths
        ]
        lines.append(_table(("when", "worker", "kind", "reason", "running"), rows))
    else:
        lines.append("worker deaths while it ran: none")
    return "\n".join(lines) + "\n"


def _by_prefix(computes: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[tuple[str, ...]]:
    durations: dict[str, list[float]] = defaultdict(list)
    erred: Counter[str] = Counter()
    for task, span in computes:
        prefix = key_prefix(task["key"])
        durations[prefix].append(span["stop"] - span["start"])
        erred[prefix] += task["status"] == "error"
    ranked = sorted(durations.items(), key=lambda item: -sum(item[1]))[:TOP_PREFIXES]
    return [
        (
            prefix,
            str(len(spans)),
            str(erred[prefix]),
            f"{sum(spans):.3f}",
            f"{1000 * sum(spans) / len(spans):.2f}",
            f"{1000 * max(spans):.2f}",
        )
        for prefix, spans in ranked
    ]


def _by_worker(
    computes: list[tuple[dict[str, Any], dict[str, Any]]],
    transfers: list[tuple[dict[str, Any], dict[str, Any]]],
    workers: dict[str, dict[str, Any]],
    wall: float,
) -> list[tuple[str, ...]]:
    count: Counter[str] = Counter()
    busy: Counter[str] = Counter()
    moved: Counter[str] = Counter()
    for task, span in computes:
        count[task["worker"]] += 1
        busy[task["worker"]] += span["stop"] - span["start"]
    for task, _span in transfers:
        moved[task["worker"]] += 1
    rows = []
    for address in sorted(set(workers) | set(count)):
        threads = int(workers.get(address, {}).get("nthreads") or 1)
        share = f"{100 * busy[address] / (wall * threads):.0f}%"
        gone = "" if address in workers else " (gone)"
        cells = (str(count[address]), f"{busy[address]:.2f}", share, str(moved[address]))
        rows.append((address + gone, *cells))
    return rows


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    if not rows:
        return "  (none)"
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    out = []
    for row in (header, *rows):
        out.append("  " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))
    return "\n".join(line.rstrip() for line in out)


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
