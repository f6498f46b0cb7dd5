"""Task throughput, latency and data transfer: redisdask vs Dask ``distributed`` (not a test).

Both systems run here one after the other, on the same machine, each with 2 worker
processes x 1 thread:

1. tasks/s of ``client.map(noop, range(10_000))`` + ``client.gather`` (median of
   ``--repeats`` after one warm-up run; ``pure=False`` so nothing is cached);
2. median round trip of 200 sequential ``client.submit(inc, i).result()``;
3. a 1,000-task dependency chain (``x = submit(inc, x)``), seconds;
4. a 100 MB numpy array: ``client.gather`` from the worker holding it (client <- worker,
   peer to peer), and worker -> worker: produced on one worker, consumed on the other
   (``workers=``), timed from the consumer's submit to its result;
5. redisdask only: Redis commands per task from ``INFO commandstats`` around one extra
   10,000-task map.

    python bench/throughput.py [--repeats 3] [--only redisdask|dask] [--json out.json]

Numbers are noisy on a shared machine: compare ratios, rerun before trusting one.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _tasks
import psutil

N_MAP = 10_000
N_SEQ = 200
N_CHAIN = 1_000
ARRAY_BYTES = 100_000_000
MB = 1e6

TARGETS: dict[str, tuple[str, float]] = {  # metric -> (">=" or "<=", redisdask target)
    "map_tasks_per_s": (">=", 5_000.0),
    "seq_roundtrip_ms": ("<=", 1.5),
    "chain_1000_s": ("<=", 1.0),
    "array_gather_MBps": (">=", 2_400.0),
}

# metric, label, kind ("rate": higher is better; "time": lower is better), format
ROWS: list[tuple[str, str, str, str]] = [
    ("map_tasks_per_s", "map+gather {n_map:,} no-ops, tasks/s", "rate", "{:,.0f}"),
    ("seq_roundtrip_ms", f"sequential submit().result() x{N_SEQ}, median ms", "time", "{:.2f}"),
    ("seq_roundtrip_p90_ms", "  same, p90 ms", "time", "{:.2f}"),
    ("chain_1000_s", f"{N_CHAIN:,}-task chain, s", "time", "{:.3f}"),
    ("array_gather_MBps", "100 MB gather client<-worker, MB/s", "rate", "{:,.0f}"),
    ("array_w2w_MBps", "100 MB worker->worker (workers=), MB/s", "rate", "{:,.0f}"),
    ("redis_cmds_per_task", "Redis commands/task (all, incl. in scripts)", "info", "{:.2f}"),
]

log = logging.getLogger("bench")


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1] if len(xs) >= 2 else xs[0]


class Bench:
    """The measurements, written once against the API both clients share."""

    def __init__(
        self,
        name: str,
        client: Any,
        wait: Callable[..., Any],
        repeats: int,
        timeout: float,
        n_map: int,
    ) -> None:
        self.name = name
        self.client = client
        self.wait = wait
        self.repeats = repeats
        self.timeout = timeout
        self.n_map = n_map
        self.results: dict[str, Any] = {}
        self.errors: dict[str, str] = {}
        self.notes: list[str] = []

    def run(self, name: str, fn: Callable[[], None]) -> None:
        print(f"[{self.name}] {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # a bench keeps going: report, then the next metric
            self.errors[name] = f"{type(exc).__name__}: {exc}"
            print(f"[{self.name}] {name} FAILED: {self.errors[name]}", file=sys.stderr)
        print(
            f"[{self.name}] {name} done in {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
            flush=True,
        )

    # ---------------------------------------------------------------- 1. map + gather

    def _one_map(self, offset: int) -> float:
        n = self.n_map
        t0 = time.perf_counter()
        futures = self.client.map(_tasks.noop, range(offset, offset + n), pure=False)
        self.wait(futures, timeout=self.timeout)  # a hang becomes an error, not a stall
        values = self.client.gather(futures)
        dt = time.perf_counter() - t0
        if values != list(range(offset, offset + n)):
            raise AssertionError(f"map returned wrong values (offset {offset})")
        del futures, values
        return dt

    def map_throughput(self) -> None:
        self._one_map(0)  # warm-up
        times = [self._one_map((r + 1) * self.n_map) for r in range(self.repeats)]
        self.results["map_tasks_per_s"] = self.n_map / _median(times)
        self.results["map_s_all"] = times

    # ---------------------------------------------------------------- 2. round trip

    def roundtrip(self) -> None:
        submit = self.client.submit
        for i in range(10):  # warm-up
            submit(_tasks.inc, i, pure=False).result(timeout=self.timeout)
        times = []
        for i in range(N_SEQ):
            t0 = time.perf_counter()
            value = submit(_tasks.inc, i, pure=False).result(timeout=self.timeout)
            times.append(time.perf_counter() - t0)
            if value != i + 1:
                raise AssertionError(f"inc({i}) returned {value!r}")
        self.results["seq_roundtrip_ms"] = _median(times) * 1e3
        self.results["seq_roundtrip_p90_ms"] = _p90(times) * 1e3

    # ---------------------------------------------------------------- 3. chain

    def _one_chain(self, n: int) -> float:
        submit = self.client.submit
        t0 = time.perf_counter()
        x = submit(_tasks.inc, 0, pure=False)
        for _ in range(n - 1):
            x = submit(_tasks.inc, x, pure=False)
        value = x.result(timeout=self.timeout)
        dt = time.perf_counter() - t0
        if value != n:
            raise AssertionError(f"chain of {n} returned {value!r}")
        return dt

    def chain(self) -> None:
        self._one_chain(50)  # warm-up
        times = [self._one_chain(N_CHAIN) for _ in range(self.repeats)]
        self.results["chain_1000_s"] = _median(times)
        self.results["chain_s_all"] = times

    # ---------------------------------------------------------------- 4. 100 MB array

    def array_gather(self) -> None:
        a = self.client.submit(_tasks.make_array, ARRAY_BYTES, pure=False)
        self.wait([a], timeout=self.timeout)
        times = []
        for r in range(self.repeats + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            (value,) = self.client.gather([a])
            dt = time.perf_counter() - t0
            if value.nbytes != ARRAY_BYTES // 8 * 8:
                raise AssertionError(f"gathered {value.nbytes} bytes")
            del value
            gc.collect()
            if r:
                times.append(dt)
        self.results["array_gather_MBps"] = ARRAY_BYTES / MB / _median(times)
        self.results["array_gather_s_all"] = times
        del a

    def array_worker_to_worker(self, workers: list[str]) -> None:
        """Produce on workers[0], consume on workers[1]; time the consumer."""
        times = []
        for r in range(self.repeats + 1):
            a = self.client.submit(_tasks.make_array, ARRAY_BYTES, workers=[workers[0]], pure=False)
            self.wait([a], timeout=self.timeout)
            t0 = time.perf_counter()
            b = self.client.submit(_tasks.consume, a, workers=[workers[1]], pure=False)
            nbytes = b.result(timeout=self.timeout)
            dt = time.perf_counter() - t0
            if nbytes != ARRAY_BYTES // 8 * 8:
                raise AssertionError(f"consumer saw {nbytes} bytes")
            del a, b
            time.sleep(0.2)  # let both workers drop their copies
            if r:
                times.append(dt)
        self.results["array_w2w_MBps"] = ARRAY_BYTES / MB / _median(times)
        self.results["array_w2w_s_all"] = times


# ------------------------------------------------------------------------ Redis stats


def _commandstats(r: Any) -> dict[str, int]:
    stats = r.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


def _diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    d = {k: v - before.get(k, 0) for k, v in after.items()}
    return {k: v for k, v in d.items() if v}


def redis_commands_per_task(bench: Bench, redis_url: str) -> None:
    """INFO commandstats around one extra 10,000-task map (plus the release messages that
    follow it), minus the idle background rate over the same wall time."""
    import redis

    r = redis.Redis.from_url(redis_url)
    try:
        # Does this Redis count the commands a script runs in commandstats?
        before = _commandstats(r)
        r.eval("redis.call('PING'); redis.call('PING'); return 1", 0)
        probe = _diff(_commandstats(r), before)
        inner_counted = probe.get("ping", 0) == 2
        version = r.info("server")["redis_version"]

        settle = 2.5  # releases and heartbeats after gather
        gc.collect()
        time.sleep(settle)  # let the releases of earlier maps finish before "idle"
        before = _commandstats(r)
        time.sleep(settle)
        idle = _diff(_commandstats(r), before)

        before = _commandstats(r)
        t0 = time.perf_counter()
        bench._one_map(10 * bench.n_map)
        gc.collect()
        time.sleep(settle)
        elapsed = time.perf_counter() - t0
        delta = _diff(_commandstats(r), before)
    finally:
        r.close()

    idle_per_s = sum(idle.values()) / settle
    n = bench.n_map
    total = sum(delta.values())
    scripts = delta.get("evalsha", 0) + delta.get("eval", 0)
    top = sorted(delta.items(), key=lambda kv: -kv[1])[:12]
    bench.results["redis_cmds_per_task"] = (total - idle_per_s * elapsed) / n
    bench.results["redis"] = {
        "version": version,
        "script_inner_commands_counted": inner_counted,
        "probe_eval_2_pings": probe,
        "window_s": elapsed,
        "calls_total": total,
        "calls_idle_per_s": idle_per_s,
        "calls_per_task_raw": total / n,
        "evalsha_per_task": scripts / n,
        "top_calls": dict(top),
        "idle_calls": idle,
        "idle_window_s": settle,
        "top_calls_per_task": {k: v / n for k, v in top},
    }


# ------------------------------------------------------------------------ systems


def run_redisdask(args: argparse.Namespace, logdir: Path) -> Bench:
    from redisdask import Client, LocalCluster, wait

    t0 = time.perf_counter()
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, log_directory=logdir) as cluster,
        Client(cluster) as client,
    ):
        print(f"[redisdask] cluster up in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        bench = Bench("redisdask", client, wait, args.repeats, args.timeout, args.tasks)
        bench.run("map", bench.map_throughput)
        bench.run("commandstats", lambda: redis_commands_per_task(bench, cluster.redis_url))
        bench.run("roundtrip", bench.roundtrip)
        bench.run("chain", bench.chain)
        bench.run("array gather", bench.array_gather)
        workers = sorted(client.scheduler_info()["workers"])
        bench.run("array worker->worker", lambda: bench.array_worker_to_worker(workers))
    return bench


def run_dask(args: argparse.Namespace) -> Bench:
    import distributed

    t0 = time.perf_counter()
    with (
        _tasks.dask_local_cluster() as cluster,
        distributed.Client(cluster) as client,
    ):
        print(f"[dask] cluster up in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        bench = Bench("dask", client, distributed.wait, args.repeats, args.timeout, args.tasks)
        bench.run("map", bench.map_throughput)
        bench.run("roundtrip", bench.roundtrip)
        bench.run("chain", bench.chain)
        bench.run("array gather", bench.array_gather)
        workers = sorted(client.scheduler_info()["workers"])
        bench.run("array worker->worker", lambda: bench.array_worker_to_worker(workers))
    return bench


# ------------------------------------------------------------------------ report


def _fmt(fmt: str, value: Any) -> str:
    return "-" if value is None else fmt.format(value)


def report(benches: dict[str, Bench], n_map: int) -> str:
    rd = benches.get("redisdask")
    dk = benches.get("dask")
    header = ("metric", "redisdask", "dask", "ratio", "target (redisdask)", "met?")
    rows = [header]
    for metric, label, kind, fmt in ROWS:
        a = rd.results.get(metric) if rd else None
        b = dk.results.get(metric) if dk else None
        ratio = None
        if a and b:
            ratio = a / b if kind == "rate" else b / a if kind == "time" else None
        target, met = "", ""
        if metric in TARGETS:
            op, value = TARGETS[metric]
            target = f"{op} {value:,g}"
            if a is not None:
                met = "yes" if (a >= value if op == ">=" else a <= value) else "NO"
        rows.append(
            (
                label.format(n_map=n_map),
                _fmt(fmt, a),
                _fmt(fmt, b),
                _fmt("{:.2f}x", ratio),
                target,
                met,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for i, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    lines.append(
        "ratio: dask/redisdask for times, redisdask/dask for rates (> 1: redisdask is faster)"
    )
    if rd and "redis" in rd.results:
        s = rd.results["redis"]
        lines.append(
            f"Redis {s['version']}: commands run inside Lua scripts "
            f"{'ARE' if s['script_inner_commands_counted'] else 'are NOT'} counted in "
            f"commandstats (probe: EVAL of 2 PINGs -> {s['probe_eval_2_pings']}); so "
            "'all' = client-sent commands + EVALSHA calls + the commands the scripts ran"
        )
        lines.append(
            f"  raw {s['calls_per_task_raw']:.2f} calls/task over {s['window_s']:.1f} s, "
            f"minus idle {s['calls_idle_per_s']:.0f} calls/s -> "
            f"{rd.results['redis_cmds_per_task']:.2f}; EVALSHA+EVAL {s['evalsha_per_task']:.3f}"
            "/task"
        )
        top = ", ".join(f"{k} {v:.3f}" for k, v in s["top_calls_per_task"].items())
        lines.append(f"  top commands, calls/task: {top}")
        idle = ", ".join(
            f"{k} {v / s['idle_window_s']:.0f}"
            for k, v in sorted(s["idle_calls"].items(), key=lambda kv: -kv[1])
        )
        lines.append(f"  idle cluster (no tasks), calls/s: {idle}")
    for bench in benches.values():
        lines.extend(f"note: {n}" for n in bench.notes)
        lines.extend(f"ERROR [{bench.name}] {k}: {v}" for k, v in bench.errors.items())
    return "\n".join(lines)


def _leftover_children() -> list[psutil.Process]:
    """Our own descendants still alive (multiprocessing's resource tracker excepted)."""
    alive = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.is_running() and "resource_tracker" not in " ".join(p.cmdline()):
                alive.append(p)
    return alive


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median)")
    parser.add_argument("--only", choices=["redisdask", "dask"], help="run one system")
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    parser.add_argument("--timeout", type=float, default=120.0, help="per-step timeout, s")
    parser.add_argument("--tasks", type=int, default=N_MAP, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.WARNING)
    import distributed  # configures its loggers on import: quiet them after

    for name in list(logging.root.manager.loggerDict):
        if name.split(".")[0] in ("distributed", "dask", "tornado", "asyncio", "bokeh"):
            logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="distributed")

    logdir = Path(tempfile.mkdtemp(prefix="redisdask-bench-logs-"))
    benches: dict[str, Bench] = {}
    failed = False
    try:
        if args.only in (None, "redisdask"):
            benches["redisdask"] = run_redisdask(args, logdir)
        if args.only in (None, "dask"):
            benches["dask"] = run_dask(args)
    finally:
        time.sleep(0.5)
        left = _leftover_children()
        if left:
            print(f"warning: leftover processes {[p.pid for p in left]}; stopping them")
            for p in left:
                with contextlib.suppress(psutil.Error):
                    p.terminate()
            psutil.wait_procs(left, timeout=5)

    print()
    print(report(benches, args.tasks))
    failed = any(b.errors for b in benches.values())
    if failed:
        print(f"redisdask cluster logs kept in {logdir}")
    else:
        shutil.rmtree(logdir, ignore_errors=True)
    if args.json:
        import distributed
        import numpy as np

        import redisdask

        out = {
            "config": {
                "repeats": args.repeats,
                "n_map": args.tasks,
                "n_seq": N_SEQ,
                "n_chain": N_CHAIN,
                "array_bytes": ARRAY_BYTES,
                "workers": 2,
                "threads_per_worker": 1,
            },
            "env": {
                "python": platform.python_version(),
                "redisdask": redisdask.__version__,
                "distributed": distributed.__version__,
                "numpy": np.__version__,
                "cpus": os.cpu_count(),
                "loadavg": os.getloadavg(),
            },
            "targets": {k: {"op": op, "value": v} for k, (op, v) in TARGETS.items()},
            **{
                name: {"results": b.results, "errors": b.errors, "notes": b.notes}
                for name, b in benches.items()
            },
        }
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
        print(f"results written to {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
