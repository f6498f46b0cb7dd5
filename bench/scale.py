"""How redisdask and Dask ``distributed`` scale with the size of a graph (not a test).

For each size of the curve (1,000 -> 10,000 -> 100,000 -> 1,000,000 tasks by default),
``--repeats`` runs that ALTERNATE between the systems (the order rotates each run), each
on a fresh cluster of 2 worker processes x 1 thread (redisdask: ``LocalCluster`` with its
own Redis; Dask: ``distributed.LocalCluster``, processes), measure one graph:

* ``map`` (the default): ``client.map(inc, range(n), pure=False)``;
* ``graph``: a dict graph through ``client.get(dsk, keys, sync=False)``: ``n/2`` tasks
  ``x-i = (inc, i)`` and ``n/2`` tasks ``y-i = (add, x-i, x-(i+1))``, the ``y`` wanted.

Each figure is the median of the runs:

* submit, s: until ``map``/``get`` returned its futures (both send in the background);
* total, s: until every future is done (``wait``), from the submit;
* Redis bytes/task while the graph lives: Redis's ``used_memory`` when it is done, less
  before (records, ready sets, wants, small results kept in the records, history
  streams), per task; after release: the same once the client dropped its futures and
  the scheduler forgot every task, and what of it is not the history streams, which
  ``retention`` bounds (a leak would show there);
* scheduler RSS, MB: its peak (``VmHWM``).  Dask's ``LocalCluster`` runs its scheduler in
  the client's process: its figure is that process's, futures included;
* reload, s (redisdask): ``load_state`` over the cluster's Redis with the graph done and
  held, what a restarted or standby scheduler does before it leads.

    python bench/scale.py [--sizes 1000,10000,100000,1000000] [--repeats 3]
                          [--workload map|graph] [--only redisdask|dask]
                          [--dask-max 100000] [--once-from 1000000] [--json out.json]

Dask above ``--dask-max`` tasks is skipped (at about 600 tasks/s here, 1,000,000 take
half an hour a run), and sizes from ``--once-from`` run once: the output says so.  Numbers
are noisy on a shared machine: compare ratios, rerun before trusting one.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _tasks
import psutil
from throughput import Results, _quiet_logs, _say, _stop_leftovers, _table, _versions

SYSTEMS = ("redisdask", "dask")
SIZES = (1_000, 10_000, 100_000, 1_000_000)
MB = 1e6
HISTORY = (":story", ":events", ":deaths", ":dead-letter", ":ready-signal")

# metric, label, format; per size and system
ROWS: list[tuple[str, str, str]] = [
    ("submit_s", "submit, s", "{:.2f}"),
    ("total_s", "total, s", "{:.2f}"),
    ("tasks_per_s", "tasks/s", "{:,.0f}"),
    ("redis_bytes_per_task", "Redis bytes/task, live", "{:,.0f}"),
    ("redis_bytes_per_task_released", "Redis bytes/task, released", "{:,.1f}"),
    ("redis_state_bytes_released", "  of which not history, bytes", "{:,.0f}"),
    ("scheduler_rss_mb", "scheduler peak RSS, MB", "{:,.0f}"),
    ("reload_s", "reload, s", "{:.2f}"),
]


def peak_rss(pid: int) -> float:
    """A process's peak resident set (``VmHWM``), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / MB
    return psutil.Process(pid).memory_info().rss / MB


def make_graph(n: int) -> tuple[dict[str, Any], list[str]]:
    half = max(n // 2, 1)
    dsk: dict[str, Any] = {f"x-{i}": (_tasks.inc, i) for i in range(half)}
    for i in range(half):
        dsk[f"y-{i}"] = (_tasks.add, f"x-{i}", f"x-{(i + 1) % half}")
    return dsk, [f"y-{i}" for i in range(half)]


def submit(client: Any, workload: str, n: int) -> tuple[list[Any], Callable[[list[Any]], None]]:
    """The futures of the workload, and a check of their values."""
    if workload == "map":
        futures = client.map(_tasks.inc, range(n), pure=False)

        def check(values: list[Any]) -> None:
            _check(values, [1, 2, n])

    else:
        dsk, keys = make_graph(n)
        futures = client.get(dsk, keys, sync=False)
        half = max(n // 2, 1)

        def check(values: list[Any]) -> None:
            _check(values, [1 + 2, 2 + 3, half + 1])  # y-0, y-1, y-(half-1)

    return futures, check


def _check(values: list[Any], expected: list[Any]) -> None:
    if values != expected:
        raise AssertionError(f"wrong values: {values!r}, expected {expected!r}")


def _sample(futures: list[Any]) -> list[Any]:
    return [futures[0], futures[1], futures[-1]]


# ------------------------------------------------------------------------ systems


@contextlib.contextmanager
def _run(out: Results, label: str) -> Iterator[None]:
    t0 = time.perf_counter()
    _say(out.name, f"{label} ...")
    try:
        yield
    except Exception as exc:
        out.errors[label] = f"{type(exc).__name__}: {exc}"
        _say(out.name, f"{label} FAILED: {type(exc).__name__}: {exc}")
    _say(out.name, f"{label} done in {time.perf_counter() - t0:.1f} s, cluster included")


def run_redisdask(out: Results, n: int, args: argparse.Namespace, label: str) -> None:
    import redis

    from redisdask import Client, LocalCluster, wait
    from redisdask.scheduler.translator import load_state

    with (
        _run(out, label),
        LocalCluster(n_workers=2, threads_per_worker=1) as cluster,
        Client(cluster) as client,
    ):
        r = redis.Redis.from_url(cluster.redis_url)
        keys = cluster.keys
        warm = client.map(_tasks.inc, range(10), pure=False)
        client.gather(warm)
        del warm
        _until(lambda: r.scard(keys.tasks) == 0, args.timeout, "the warm-up's release")
        base, base_state = r.info("memory")["used_memory"], _state_bytes(r, keys)

        t0 = time.perf_counter()
        futures, check = submit(client, args.workload, n)
        submitted = time.perf_counter() - t0
        wait(futures, timeout=args.timeout)
        total = time.perf_counter() - t0
        m = len(futures)
        out.add(f"{n}:submit_s", submitted)
        out.add(f"{n}:total_s", total)
        out.add(f"{n}:tasks_per_s", n / total)
        out.add(f"{n}:redis_bytes_per_task", (r.info("memory")["used_memory"] - base) / n)
        out.add(f"{n}:scheduler_rss_mb", peak_rss(cluster.scheduler_process.pid))
        t1 = time.perf_counter()
        loaded = load_state(r, keys)
        out.add(f"{n}:reload_s", time.perf_counter() - t1)
        if len(loaded.tasks) < n:
            raise AssertionError(f"reloaded {len(loaded.tasks):,} tasks of {n:,}")
        del loaded
        check(client.gather(_sample(futures)))

        del futures
        gc.collect()
        _until(lambda: r.scard(keys.tasks) == 0, args.timeout, "the release")
        # what the client and the workers trim at their heartbeats (inboxes, events)
        _until(lambda: _state_bytes(r, keys) <= base_state + 64_000, 30.0, None)
        out.add(f"{n}:redis_bytes_per_task_released", (r.info("memory")["used_memory"] - base) / n)
        out.add(f"{n}:redis_state_bytes_released", _state_bytes(r, keys) - base_state)
        if m != (n if args.workload == "map" else max(n // 2, 1)):
            raise AssertionError(f"{m} futures for {n} tasks")


def _state_bytes(r: Any, keys: Any) -> int:
    """The cluster's keys but the history streams (which ``retention`` bounds), bytes."""
    return sum(
        r.memory_usage(name, samples=0) or 0
        for name in r.scan_iter(match=f"{keys.prefix}*", count=1000)
        if not name.decode().endswith(HISTORY)
    )


def _until(condition: Callable[[], bool], timeout: float, what: str | None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            if what is None:
                return  # measured as it is
            raise TimeoutError(f"{what} not done within {timeout} s")
        time.sleep(0.1)  # polling a figure of another process


def run_dask(out: Results, n: int, args: argparse.Namespace, label: str) -> None:
    import distributed

    with (
        _run(out, label),
        _tasks.dask_local_cluster() as cluster,
        distributed.Client(cluster) as client,
    ):
        client.gather(client.map(_tasks.inc, range(10), pure=False))
        t0 = time.perf_counter()
        futures, check = submit(client, args.workload, n)
        submitted = time.perf_counter() - t0
        distributed.wait(futures, timeout=args.timeout)
        total = time.perf_counter() - t0
        out.add(f"{n}:submit_s", submitted)
        out.add(f"{n}:total_s", total)
        out.add(f"{n}:tasks_per_s", n / total)
        out.add(f"{n}:scheduler_rss_mb", peak_rss(os.getpid()))  # its scheduler runs here
        check(client.gather(_sample(futures)))
        del futures


RUNNERS = {"redisdask": run_redisdask, "dask": run_dask}


# ------------------------------------------------------------------------ report


def report(results: dict[str, Results], sizes: list[int], notes: list[str]) -> str:
    rows = [("tasks", "metric", *SYSTEMS, "dask/redisdask")]
    for n in sizes:
        for metric, label, fmt in ROWS:
            cells = []
            for name in SYSTEMS:
                res = results.get(name)
                value = res.median(f"{n}:{metric}") if res else None
                cells.append("—" if value is None else fmt.format(value))
            ours = results["redisdask"].median(f"{n}:{metric}") if "redisdask" in results else None
            theirs = results["dask"].median(f"{n}:{metric}") if "dask" in results else None
            ratio = ""
            if ours and theirs and metric in ("submit_s", "total_s", "scheduler_rss_mb"):
                ratio = f"{theirs / ours:.2f}x"
            rows.append((f"{n:,}", label, *cells, ratio))
    lines = _table(rows)
    lines.append("")
    lines.append(
        "dask/redisdask > 1: redisdask is faster (or smaller); dask's scheduler RSS is its "
        "client's process (LocalCluster runs the scheduler there), futures included; "
        "'—': not measured or not applicable (Dask keeps no state in Redis)"
    )
    lines.extend(f"note: {note}" for note in notes)
    for res in results.values():
        lines.extend(f"ERROR [{res.name}] {k}: {v}" for k, v in res.errors.items())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="tasks, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs (median)")
    parser.add_argument("--workload", choices=("map", "graph"), default="map")
    parser.add_argument("--only", choices=SYSTEMS, help="run one system")
    parser.add_argument("--dask-max", type=int, default=100_000, help="skip Dask above this")
    parser.add_argument("--once-from", type=int, default=1_000_000, help="one run from here")
    parser.add_argument("--timeout", type=float, default=3600.0, help="per graph, s")
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    args = parser.parse_args(argv)
    _quiet_logs()
    sizes = sorted(int(s.replace("_", "")) for s in args.sizes.split(","))
    names = [args.only] if args.only else list(SYSTEMS)
    results = {name: Results(name) for name in names}
    present = [name for name in names if not results[name].missing]
    notes: list[str] = [f"workload: {args.workload}"]
    for name in names:
        if results[name].missing:
            notes.append(f"{name} is not installed: skipped")
    runs_done: dict[int, int] = {}
    try:
        for n in sizes:
            repeats = 1 if n >= args.once_from else args.repeats
            runs_done[n] = repeats
            systems = [s for s in present if not (s == "dask" and n > args.dask_max)]
            if "dask" in present and "dask" not in systems:
                notes.append(
                    f"dask skipped at {n:,} tasks (above --dask-max {args.dask_max:,}; "
                    f"pass --dask-max {n} to run it)"
                )
            for run in range(1, repeats + 1):
                k = (run - 1) % max(len(systems), 1)
                for name in systems[k:] + systems[:k]:
                    RUNNERS[name](results[name], n, args, f"{n:,} tasks, run {run}/{repeats}")
                    gc.collect()
                    _stop_leftovers()
    finally:
        _stop_leftovers()
    notes.append(
        "runs per size: "
        + ", ".join(f"{n:,}: {r}" for n, r in runs_done.items())
        + f" (medians; sizes from --once-from {args.once_from:,} run once)"
    )
    print()
    print(report(results, sizes, notes))
    print(f"load average at the end {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
    if args.json:
        out = {
            "config": {**vars(args), "sizes": sizes},
            "env": _versions(),
            **{
                name: {"medians": {m: res.median(m) for m in res.samples},
                       "samples": res.samples, "errors": res.errors}
                for name, res in results.items()
            },
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
        print(f"results written to {args.json}")
    return 1 if any(res.errors for res in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
