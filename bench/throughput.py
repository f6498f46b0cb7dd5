"""Task throughput, latency and data transfer: redisdask vs Dask ``distributed`` vs Ray
(not a test).

The three systems run on the same machine, each with 2 worker processes x 1 thread (Ray:
``ray.init(num_cpus=2)``, which runs 2 worker processes), in ``--repeats`` runs that
ALTERNATE: run r starts a fresh cluster of each system in turn, in an order that rotates
(redisdask, dask, ray; then dask, ray, redisdask; ...), measures every workload once after
a warm-up and shuts the cluster down, so that the machine's noise hits the three alike.
Each figure is the median of the runs:

1. tasks/s of ``client.map(noop, range(10_000))`` + ``client.gather`` (``pure=False`` so
   nothing is cached; Ray: ``ray.get([noop.remote(i) for i in ...])``);
2. round trip of 200 sequential ``client.submit(inc, i).result()`` (Ray:
   ``ray.get(inc.remote(i))``), median and p90 of the run;
3. a 1,000-task dependency chain (``x = submit(inc, x)``; Ray: ``inc.remote(x)`` of the
   previous ObjectRef), seconds;
4. a 4,096-leaf binary tree: 4,096 ``noop(i)`` leaves submitted one by one, then
   ``submit(add, a, b)`` pairwise up to the root (8,191 tasks), seconds;
5. a 100 MB numpy array (median of 3 in the run): ``client.gather`` from the worker
   holding it (client <- worker, peer to peer), and worker -> worker: produced on one
   worker, consumed on the other (``workers=``), timed from the consumer's submit to its
   result.  Ray on one node keeps the array in its shared-memory object store, which the
   driver and the consumer map without copying it: no byte moves between processes, so
   its figure is not a transfer rate; the table shows "—" and a note gives what Ray
   measured;
6. redisdask only, first run only: Redis commands per task from ``INFO commandstats``
   around one extra 10,000-task map.

    python bench/throughput.py [--repeats 3] [--only redisdask|dask|ray] [--json out.json]
        [--redis-url redis://host:6379/0] [--wait-replicas 1]

Needs ``pip install -e '.[bench]'``; a system that is not installed shows "not
installed" and the others run.  Numbers are noisy on a shared machine: compare ratios,
rerun before trusting one.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _tasks
import psutil

N_MAP = 10_000
N_SEQ = 200
N_CHAIN = 1_000
N_LEAVES = 4_096
ARRAY_BYTES = 100_000_000
ARRAY_REPEATS = 3
MB = 1e6
SYSTEMS = ("redisdask", "dask", "ray")
MODULES = {"redisdask": "redisdask", "dask": "distributed", "ray": "ray"}

TARGETS: dict[str, tuple[str, float]] = {  # metric -> (">=" or "<=", issue 13's target)
    "map_tasks_per_s": (">=", 8_000.0),
    "seq_roundtrip_ms": ("<=", 1.0),
    "chain_1000_s": ("<=", 0.7),
    "tree_4096_s": ("<=", 2.0),
    "array_w2w_MBps": (">=", 3_500.0),
}

# metric, label, kind ("rate": higher is better; "time": lower is better), format
ROWS: list[tuple[str, str, str, str]] = [
    ("map_tasks_per_s", "map+gather {n_map:,} no-ops, tasks/s", "rate", "{:,.0f}"),
    ("seq_roundtrip_ms", f"sequential submit().result() x{N_SEQ}, median ms", "time", "{:.2f}"),
    ("seq_roundtrip_p90_ms", "  same, p90 ms", "time", "{:.2f}"),
    ("chain_1000_s", f"{N_CHAIN:,}-task chain, s", "time", "{:.3f}"),
    ("tree_4096_s", f"{N_LEAVES:,}-leaf binary tree ({2 * N_LEAVES - 1:,} tasks), s", "time",
     "{:.3f}"),
    ("array_gather_MBps", "100 MB gather client<-worker, MB/s", "rate", "{:,.0f}"),
    ("array_w2w_MBps", "100 MB worker->worker, MB/s", "rate", "{:,.0f}"),
    ("redis_cmds_per_task", "Redis commands/task (all, incl. in scripts)", "info", "{:.2f}"),
]  # fmt: skip

# Ray's 100 MB figures, kept apart from the comparable ones (see the module's docstring)
RAY_SHM_NOTES = {
    "ray_shm_get_MBps": "ray.get of a 100 MB array held in the node's shared-memory store",
    "ray_shm_w2w_MBps": "100 MB array task -> consumer task through that store",
}

log = logging.getLogger("bench")


def _p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1] if len(xs) >= 2 else xs[0]


def _say(name: str, text: str) -> None:
    print(f"[{name}] {text}", file=sys.stderr, flush=True)


class Results:
    """One system's figures: a sample per run for each metric, and what went wrong."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.samples: dict[str, list[float]] = {}
        self.errors: dict[str, str] = {}
        self.notes: list[str] = []
        self.extra: dict[str, Any] = {}
        self.missing = importlib.util.find_spec(MODULES[name]) is None

    def add(self, metric: str, value: float) -> None:
        self.samples.setdefault(metric, []).append(value)

    def median(self, metric: str) -> float | None:
        xs = self.samples.get(metric)
        return statistics.median(xs) if xs else None

    def step(self, run: int, name: str, fn: Callable[[], None]) -> None:
        """Run one measurement; a failure is reported and the next one runs."""
        _say(self.name, f"run {run}: {name} ...")
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:
            self.errors[f"run {run}: {name}"] = f"{type(exc).__name__}: {exc}"
            _say(self.name, f"run {run}: {name} FAILED: {type(exc).__name__}: {exc}")
        _say(self.name, f"run {run}: {name} done in {time.perf_counter() - t0:.1f} s")


class Bench:
    """The measurements, written once against the futures API redisdask and Dask share.
    Each method measures once (after its own warm-up) and adds the figure to ``out``."""

    def __init__(
        self, out: Results, client: Any, wait: Callable[..., Any], timeout: float, n_map: int
    ) -> None:
        self.out = out
        self.client = client
        self.wait = wait
        self.timeout = timeout
        self.n_map = n_map

    def _one_map(self, offset: int, n: int) -> float:
        t0 = time.perf_counter()
        futures = self.client.map(_tasks.noop, range(offset, offset + n), pure=False)
        self.wait(futures, timeout=self.timeout)  # a hang becomes an error, not a stall
        values = self.client.gather(futures)
        dt = time.perf_counter() - t0
        if values != list(range(offset, offset + n)):
            raise AssertionError(f"map returned wrong values (offset {offset})")
        return dt

    def map_throughput(self) -> None:
        self._one_map(0, max(self.n_map // 10, 1))  # warm-up
        self.out.add("map_tasks_per_s", self.n_map / self._one_map(self.n_map, self.n_map))

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
        self.out.add("seq_roundtrip_ms", statistics.median(times) * 1e3)
        self.out.add("seq_roundtrip_p90_ms", _p90(times) * 1e3)

    def _one_chain(self, n: int) -> float:
        submit = self.client.submit
        t0 = time.perf_counter()
        x = submit(_tasks.inc, 0, pure=False)
        for _ in range(n - 1):
            x = submit(_tasks.inc, x, pure=False)
        value = x.result(timeout=self.timeout)
        dt = time.perf_counter() - t0
        _check("chain", n, value, n)
        return dt

    def chain(self) -> None:
        self._one_chain(50)  # warm-up
        self.out.add("chain_1000_s", self._one_chain(N_CHAIN))

    def _one_tree(self, leaves: int) -> float:
        submit = self.client.submit
        t0 = time.perf_counter()
        level = [submit(_tasks.noop, i, pure=False) for i in range(leaves)]
        while len(level) > 1:
            level = [
                submit(_tasks.add, level[i], level[i + 1], pure=False)
                for i in range(0, len(level), 2)
            ]
        value = level[0].result(timeout=self.timeout)
        dt = time.perf_counter() - t0
        _check("tree", leaves, value, leaves * (leaves - 1) // 2)
        return dt

    def tree(self) -> None:
        self._one_tree(64)  # warm-up
        self.out.add("tree_4096_s", self._one_tree(N_LEAVES))

    # the 100 MB array, through what each system overrides: _pair, _made, _fetch, _consumed
    gather_metric, w2w_metric = "array_gather_MBps", "array_w2w_MBps"

    def _pair(self) -> tuple[Any, Any]:
        first, second = sorted(self.client.scheduler_info()["workers"])[:2]
        return [first], [second]

    def _made(self, where: Any = None) -> Any:
        a = self.client.submit(_tasks.make_array, ARRAY_BYTES, workers=where, pure=False)
        self.wait([a], timeout=self.timeout)
        return a

    def _fetch(self, a: Any) -> Any:
        return self.client.gather([a])[0]

    def _consumed(self, a: Any, where: Any) -> int:
        b = self.client.submit(_tasks.consume, a, workers=where, pure=False)
        return b.result(timeout=self.timeout)

    def _rate(self, metric: str, once: Callable[[], float]) -> None:
        times = [once() for _ in range(ARRAY_REPEATS + 1)][1:]  # the first is a warm-up
        self.out.add(metric, ARRAY_BYTES / MB / statistics.median(times))

    def array_gather(self) -> None:
        a = self._made()

        def once() -> float:
            t0 = time.perf_counter()
            value = self._fetch(a)
            dt = time.perf_counter() - t0
            _check("gather", 1, value.nbytes, ARRAY_BYTES // 8 * 8)
            del value
            gc.collect()
            return dt

        self._rate(self.gather_metric, once)

    def array_worker_to_worker(self) -> None:
        """Produce on one worker, consume on the other; time the consumer."""
        first, second = self._pair()

        def once() -> float:
            a = self._made(first)
            t0 = time.perf_counter()
            nbytes = self._consumed(a, second)
            dt = time.perf_counter() - t0
            _check("consume", 1, nbytes, ARRAY_BYTES // 8 * 8)
            del a
            time.sleep(0.2)  # let the workers drop their copies
            return dt

        self._rate(self.w2w_metric, once)

    def all(self, run: int) -> None:
        for name, fn in [
            ("map", self.map_throughput),
            ("roundtrip", self.roundtrip),
            ("chain", self.chain),
            ("tree", self.tree),
            ("array gather", self.array_gather),
            ("array worker->worker", self.array_worker_to_worker),
        ]:
            self.out.step(run, name, fn)


class RayBench(Bench):
    """The same workloads written for Ray's API: ``f.remote`` for submit, ObjectRefs for
    futures, ``ray.get`` for result and gather."""

    def __init__(self, out: Results, timeout: float, n_map: int) -> None:
        import ray

        super().__init__(out, ray, ray.wait, timeout, n_map)
        self.ray = ray
        self.noop, self.inc, self.add, self.make_array, self.consume = (
            ray.remote(f)
            for f in (_tasks.noop, _tasks.inc, _tasks.add, _tasks.make_array, _tasks.consume)
        )

    def get(self, refs: Any) -> Any:
        return self.ray.get(refs, timeout=self.timeout)

    def _one_map(self, offset: int, n: int) -> float:
        t0 = time.perf_counter()
        values = self.get([self.noop.remote(i) for i in range(offset, offset + n)])
        dt = time.perf_counter() - t0
        if values != list(range(offset, offset + n)):
            raise AssertionError(f"map returned wrong values (offset {offset})")
        return dt

    def roundtrip(self) -> None:
        for i in range(10):  # warm-up
            self.get(self.inc.remote(i))
        times = []
        for i in range(N_SEQ):
            t0 = time.perf_counter()
            value = self.get(self.inc.remote(i))
            times.append(time.perf_counter() - t0)
            _check("inc", i, value, i + 1)
        self.out.add("seq_roundtrip_ms", statistics.median(times) * 1e3)
        self.out.add("seq_roundtrip_p90_ms", _p90(times) * 1e3)

    def _one_chain(self, n: int) -> float:
        t0 = time.perf_counter()
        x = self.inc.remote(0)
        for _ in range(n - 1):
            x = self.inc.remote(x)
        value = self.get(x)
        dt = time.perf_counter() - t0
        _check("chain", n, value, n)
        return dt

    def _one_tree(self, leaves: int) -> float:
        t0 = time.perf_counter()
        level = [self.noop.remote(i) for i in range(leaves)]
        while len(level) > 1:
            level = [self.add.remote(level[i], level[i + 1]) for i in range(0, len(level), 2)]
        value = self.get(level[0])
        dt = time.perf_counter() - t0
        _check("tree", leaves, value, leaves * (leaves - 1) // 2)
        return dt

    gather_metric, w2w_metric = "ray_shm_get_MBps", "ray_shm_w2w_MBps"

    def _pair(self) -> tuple[Any, Any]:
        """Ray places tasks itself (no ``workers=``): the consumer may even run in the
        producer's process; either way it maps the array from the shared-memory store."""
        return None, None

    def _made(self, where: Any = None) -> Any:
        a = self.make_array.remote(ARRAY_BYTES)
        ready, _ = self.ray.wait([a], timeout=self.timeout, fetch_local=False)
        if not ready:
            raise TimeoutError(f"make_array not done in {self.timeout} s")
        return a

    def _fetch(self, a: Any) -> Any:
        return self.get(a)

    def _consumed(self, a: Any, where: Any) -> int:
        return self.get(self.consume.remote(a))


def _check(what: str, n: int, value: Any, expected: Any) -> None:
    if value != expected:
        raise AssertionError(f"{what} ({n}) returned {value!r}, expected {expected!r}")


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
    from redisdask.store.connection import connect

    r = connect(redis_url)  # (a redis+sentinel:// URL too)
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
        bench._one_map(10 * bench.n_map, bench.n_map)
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
    bench.out.add("redis_cmds_per_task", (total - idle_per_s * elapsed) / n)
    bench.out.extra["redis"] = {
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


@contextlib.contextmanager
def _up(out: Results, run: int) -> Iterator[None]:
    """One run of a system: a cluster that fails to start or stop is this run's error (the
    other systems and runs go on); says how long the run took."""
    t0 = time.perf_counter()
    try:
        yield
    except Exception as exc:
        out.errors[f"run {run}: cluster"] = f"{type(exc).__name__}: {exc}"
        _say(out.name, f"run {run}: cluster FAILED: {type(exc).__name__}: {exc}")
    _say(out.name, f"run {run}: done in {time.perf_counter() - t0:.1f} s, cluster included")


def run_redisdask(out: Results, run: int, args: argparse.Namespace, logdir: Path) -> None:
    from redisdask import Client, LocalCluster, wait

    with (
        _up(out, run),
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            log_directory=logdir,
            redis_url=args.redis_url,
            scheduler_options={"wait_replicas": args.wait_replicas},
        ) as cluster,
        Client(cluster) as client,
    ):
        bench = Bench(out, client, wait, args.timeout, args.tasks)
        if run == 1:
            out.step(run, "commandstats", lambda: redis_commands_per_task(bench, cluster.redis_url))
        bench.all(run)


def run_dask(out: Results, run: int, args: argparse.Namespace, logdir: Path) -> None:
    import distributed

    with (
        _up(out, run),
        _tasks.dask_local_cluster() as cluster,
        distributed.Client(cluster) as client,
    ):
        Bench(out, client, distributed.wait, args.timeout, args.tasks).all(run)


def run_ray(out: Results, run: int, args: argparse.Namespace, logdir: Path) -> None:
    import ray

    with _up(out, run):
        # the workers inherit PYTHONPATH (bench/, set by _tasks) from the raylet, which
        # inherits it from here; no dashboard, no usage report, no worker logs echoed
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            logging_level=logging.ERROR,
            log_to_driver=False,
        )
        try:
            RayBench(out, args.timeout, args.tasks).all(run)
        finally:
            ray.shutdown()


RUNNERS = {"redisdask": run_redisdask, "dask": run_dask, "ray": run_ray}


# ------------------------------------------------------------------------ report


def _fmt(fmt: str, value: Any) -> str:
    return "—" if value is None else fmt.format(value)


def _ratio(kind: str, ours: float | None, theirs: float | None) -> float | None:
    """> 1: redisdask is faster."""
    if not ours or not theirs or kind == "info":
        return None
    return ours / theirs if kind == "rate" else theirs / ours


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for i, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def report(results: dict[str, Results], n_map: int, repeats: int) -> str:
    def cell(name: str, metric: str, fmt: str) -> str:
        res = results.get(name)
        if res is None:
            return "not run"
        if res.missing:
            return "not installed"
        return _fmt(fmt, res.median(metric))

    def med(name: str, metric: str) -> float | None:
        res = results.get(name)
        return res.median(metric) if res else None

    rows = [("metric", *SYSTEMS, "vs dask", "vs ray", "target (redisdask)", "met?")]
    for metric, label, kind, fmt in ROWS:
        ours = med("redisdask", metric)
        target, met = "", ""
        if metric in TARGETS:
            op, value = TARGETS[metric]
            target = f"{op} {value:,g}"
            if ours is not None:
                met = "yes" if (ours >= value if op == ">=" else ours <= value) else "NO"
        rows.append(
            (
                label.format(n_map=n_map),
                *(cell(name, metric, fmt) for name in SYSTEMS),
                _fmt("{:.2f}x", _ratio(kind, ours, med("dask", metric))),
                _fmt("{:.2f}x", _ratio(kind, ours, med("ray", metric))),
                target,
                met,
            )
        )
    lines = _table(rows)
    lines.append("")
    lines.append(
        f"medians of {repeats} alternating runs (fresh clusters, order rotated each run); "
        "vs: redisdask's speed-up (dask/redisdask for times, redisdask/dask for rates; "
        "> 1: redisdask is faster)"
    )
    lines.append(
        "scheduler kill -9 with a standby -> work moving again (target <= 1.0 s): "
        "not measured here (bench/failures.py)"
    )
    ray = results.get("ray")
    if ray and not ray.missing:
        shm = ", ".join(
            f"{text}: {_fmt('{:,.0f}', ray.median(metric))} MB/s"
            for metric, text in RAY_SHM_NOTES.items()
        )
        lines.append(
            "ray's 100 MB rows are '—': on one node Ray keeps the array in its shared-memory "
            "object store and the reader maps it without a copy, so no byte moves between "
            f"processes and there is no transfer to compare. Measured anyway: {shm}"
        )
    rd = results.get("redisdask")
    if rd and "redis" in rd.extra:
        lines.extend(_redis_lines(rd))
    for res in results.values():
        lines.extend(f"note: {n}" for n in res.notes)
        lines.extend(f"ERROR [{res.name}] {k}: {v}" for k, v in res.errors.items())
    return "\n".join(lines)


def _redis_lines(rd: Results) -> list[str]:
    s = rd.extra["redis"]
    top = ", ".join(f"{k} {v:.3f}" for k, v in s["top_calls_per_task"].items())
    idle = ", ".join(
        f"{k} {v / s['idle_window_s']:.0f}"
        for k, v in sorted(s["idle_calls"].items(), key=lambda kv: -kv[1])
    )
    return [
        f"Redis {s['version']}: commands run inside Lua scripts "
        f"{'ARE' if s['script_inner_commands_counted'] else 'are NOT'} counted in "
        f"commandstats (probe: EVAL of 2 PINGs -> {s['probe_eval_2_pings']}); so "
        "'all' = client-sent commands + EVALSHA calls + the commands the scripts ran",
        f"  raw {s['calls_per_task_raw']:.2f} calls/task over {s['window_s']:.1f} s, "
        f"minus idle {s['calls_idle_per_s']:.0f} calls/s -> "
        f"{rd.median('redis_cmds_per_task'):.2f}; EVALSHA+EVAL {s['evalsha_per_task']:.3f}/task",
        f"  top commands, calls/task: {top}",
        f"  idle cluster (no tasks), calls/s: {idle}",
    ]


def _leftover_children() -> list[psutil.Process]:
    """Our own descendants still alive (multiprocessing's resource tracker excepted)."""
    alive = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.is_running() and "resource_tracker" not in " ".join(p.cmdline()):
                alive.append(p)
    return alive


def _stop_leftovers() -> None:
    time.sleep(0.5)  # a cluster's last processes are still exiting
    left = _leftover_children()
    if left:
        print(f"warning: leftover processes {[p.pid for p in left]}; stopping them")
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        psutil.wait_procs(left, timeout=5)


def _quiet_logs() -> None:
    logging.basicConfig(level=logging.WARNING)
    if importlib.util.find_spec("distributed") is not None:
        import distributed  # noqa: F401  (configures its loggers on import: quiet them after)
    for name in list(logging.root.manager.loggerDict):
        if name.split(".")[0] in ("distributed", "dask", "tornado", "asyncio", "bokeh", "ray"):
            logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="distributed")


def _versions() -> dict[str, Any]:
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
    }
    for module in ("redisdask", "distributed", "ray", "numpy"):
        if importlib.util.find_spec(module) is not None:
            out[module] = getattr(__import__(module), "__version__", "?")
    return out


def _shown(url: str | None) -> str | None:
    from redisdask.store.urls import redact

    return redact(url) if url else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs (median)")
    parser.add_argument("--only", choices=SYSTEMS, help="run one system")
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    parser.add_argument("--timeout", type=float, default=120.0, help="per-step timeout, s")
    parser.add_argument("--tasks", type=int, default=N_MAP, help=argparse.SUPPRESS)
    parser.add_argument(
        "--redis-url",
        help="redisdask: the Redis (redis:// or redis+sentinel://) its clusters use, each "
        "under a new cluster name (default: a new embedded Redis per run)",
    )
    parser.add_argument(
        "--wait-replicas",
        type=int,
        default=0,
        help="redisdask: the scheduler's redis.wait-replicas (WAIT for that many replicas "
        "after each write; needs --redis-url of a primary with replicas)",
    )
    args = parser.parse_args(argv)
    _quiet_logs()

    names = [args.only] if args.only else list(SYSTEMS)
    results = {name: Results(name) for name in names}
    for res in results.values():
        if res.missing:
            _say(res.name, f"not installed (no module {MODULES[res.name]!r}): skipped")
    present = [name for name in names if not results[name].missing]
    logdir = Path(tempfile.mkdtemp(prefix="redisdask-bench-logs-"))
    loadavg_start = os.getloadavg()
    order: list[list[str]] = []
    try:
        for run in range(1, args.repeats + 1):
            k = (run - 1) % max(len(present), 1)
            order.append(present[k:] + present[:k])
            for name in order[-1]:
                RUNNERS[name](results[name], run, args, logdir)
                gc.collect()
                _stop_leftovers()
    finally:
        _stop_leftovers()

    print()
    print(report(results, args.tasks, args.repeats))
    print(
        f"load average {loadavg_start[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the "
        f"end ({os.cpu_count()} CPUs); run order: {'; '.join(', '.join(o) for o in order)}"
    )
    failed = any(res.errors for res in results.values())
    if failed:
        print(f"redisdask cluster logs kept in {logdir}")
    else:
        shutil.rmtree(logdir, ignore_errors=True)
    if args.json:
        out = {
            "config": {
                "repeats": args.repeats,
                "order": order,
                "n_map": args.tasks,
                "n_seq": N_SEQ,
                "n_chain": N_CHAIN,
                "n_leaves": N_LEAVES,
                "array_bytes": ARRAY_BYTES,
                "workers": 2,
                "threads_per_worker": 1,
                "redis_url": _shown(args.redis_url),
                "wait_replicas": args.wait_replicas,
            },
            "env": {**_versions(), "loadavg_start": loadavg_start},
            "targets": {k: {"op": op, "value": v} for k, (op, v) in TARGETS.items()},
            **{
                name: {
                    "installed": not res.missing,
                    "medians": {m: res.median(m) for m in res.samples},
                    "samples": res.samples,
                    "errors": res.errors,
                    "notes": res.notes,
                    **res.extra,
                }
                for name, res in results.items()
            },
        }
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
        print(f"results written to {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
