"""Does the cluster keep every worker busy, and how much data does it move: redisdask vs
Dask ``distributed`` (not a test; issue 24).

For each size of ``--workers`` (2 and 8 by default; any list, e.g. ``2,8,14,64``),
``--repeats`` runs that ALTERNATE between the systems (the order rotates each run) start a
fresh cluster of bare workers, that many processes x 1 thread, no nannies (redisdask:
``LocalCluster(nanny=False)`` with its own Redis; Dask: a ``dask scheduler`` process and
``dask worker --no-nanny`` processes), and measure in turn:

1. warm-up: ``map`` of 2,000 no-ops (after which a worker that learns one average of all
   its tasks' durations believes every task is instant);
2. ``10 ms``: N x 200 tasks of 10 ms (``time.sleep``); ideal: 2 s;
3. ``straggler``: one 2 s task submitted first, then 100 tasks of 20 ms; ideal: 2 s (the
   short ones run on the other workers while the straggler runs);
4. ``mis-estimated``: 200 runs of the same function as no-ops (its prefix's estimate
   then says next to nothing), then N x 50 of it taking 40 ms each; ideal: 2 s (a
   worker claims a horizon's worth of what it believes instant, most of the batch:
   only work stealing moves the claims back);
5. ``array``: dask.array ``(x + x.T).mean()``, x 6,000 x 6,000 random with 1,000 x 1,000
   chunks of 8 MB, made on the workers;
6. ``dataframe``: dask.dataframe groupby after a merge: two frames of 1,000,000 rows in
   20 partitions, made on the workers, merged on ``id`` (a task-based shuffle, on both
   systems), then ``groupby("key").other.mean()``.

Each row prints the wall time (median of the runs), the efficiency (ideal / wall) and the
tasks each worker ran (from ``who_has``: where each result lives): the least and the most
(their ratio: 1 is a perfect balance) and the list of the median run.  The data-heavy
rows print the bytes moved between workers: redisdask's ``transfer_incoming_bytes_total``
summed over its workers' heartbeats (``scheduler_info()["workers"][a]["metrics"]``), plus
apart what its workers read from Redis (small results, ``worker.inline-result-bytes``);
Dask's, the bytes its workers received from peers (the sum of each ``transfer_incoming_log``
entry's ``total``: Dask counts no received bytes in a counter).  Both size values with
their own ``sizeof``.

    python bench/balance.py [--workers 2,8] [--repeats 3] [--only redisdask|dask]
                            [--workloads dataframe,array] [--json out.json]

``--workloads`` runs only those (the warm-up always runs first).

Numbers are noisy on a shared machine: compare ratios, rerun before trusting one.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _tasks
import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
from throughput import Results, _quiet_logs, _say, _stop_leftovers, _table, _versions

SYSTEMS = ("redisdask", "dask")
WORKERS = (2, 8)
WARMUP = 2_000
PER_WORKER, SHORT_S = 200, 0.01
STRAGGLER_S, N_SHORT, SHORT2_S = 2.0, 100, 0.02
MIS_WARM, MIS_PER_WORKER, MIS_S = 200, 50, 0.04
ARRAY_SIDE, CHUNK = 6_000, 1_000  # 1,000 x 1,000 float64: 8 MB chunks
ROWS, PARTITIONS = 1_000_000, 20
DASK_LOG = 10_000_000  # distributed.admin.low-level-log-length: keep every transfer's entry
MB = 1e6

# workload, label, ideal seconds at n workers (None: no ideal)
WORKLOADS: list[tuple[str, str, Callable[[int], float] | None]] = [
    ("10ms", "{tasks:,} x 10 ms after warm-up", lambda n: PER_WORKER * SHORT_S),
    ("straggler", "2 s straggler, then 100 x 20 ms",
     lambda n: max(STRAGGLER_S, (STRAGGLER_S + N_SHORT * SHORT2_S) / n)),
    ("misestimated", "{mis:,} x 40 ms, estimate from no-ops",
     lambda n: MIS_PER_WORKER * MIS_S),
    ("array", f"array (x + x.T).mean() {ARRAY_SIDE:,}^2/{CHUNK:,}", None),
    ("dataframe", f"dataframe merge+groupby {ROWS // 1_000_000}M rows x2/{PARTITIONS}", None),
]  # fmt: skip


# ------------------------------------------------------------------------ data workloads


def make_left(i: int) -> pd.DataFrame:
    rng = np.random.default_rng(i)
    n = ROWS // PARTITIONS
    return pd.DataFrame(
        {"id": rng.integers(0, ROWS, n), "key": rng.integers(0, 20, n), "value": rng.random(n)}
    )


def make_right(i: int) -> pd.DataFrame:
    rng = np.random.default_rng(1_000 + i)
    n = ROWS // PARTITIONS
    return pd.DataFrame({"id": np.arange(i * n, (i + 1) * n), "other": rng.random(n)})


def array_workload() -> Any:
    x = da.random.default_rng(0).random((ARRAY_SIDE, ARRAY_SIDE), chunks=CHUNK)
    return (x + x.T).mean()


def dataframe_workload() -> Any:
    left = dd.from_map(make_left, range(PARTITIONS), meta=make_left(0).iloc[:0])
    right = dd.from_map(make_right, range(PARTITIONS), meta=make_right(0).iloc[:0])
    return left.merge(right, on="id").groupby("key").other.mean()


COLLECTIONS = {"array": array_workload, "dataframe": dataframe_workload}
# a shuffle moves its pieces as tasks on both systems (Dask's p2p shuffle would move them
# outside of its task transfers, where no counter sees them)
SHUFFLE = {"dataframe.shuffle.method": "tasks"}


def expected_results(workloads: list[str]) -> dict[str, Any]:
    """What dask's synchronous scheduler computes, before any cluster exists."""
    with dask.config.set(SHUFFLE):
        return {
            name: make().compute(scheduler="sync")
            for name, make in COLLECTIONS.items()
            if name in workloads
        }


def dask_received_bytes(dask_worker: Any) -> tuple[int, int]:
    """Bytes a Dask worker received from peers (its transfer log), and the log's length."""
    log = dask_worker.transfer_incoming_log
    return sum(entry["total"] for entry in log), len(log)


# ------------------------------------------------------------------------ the bench


class Balance:
    """The workloads, written once against the futures API both systems share; each adds
    its figures to ``out`` under ``<n>:<workload>:<metric>``."""

    def __init__(self, out: Results, client: Any, wait: Any, n: int, args: Any) -> None:
        self.out, self.client, self.wait, self.n = out, client, wait, n
        self.timeout = args.timeout
        self.expected: dict[str, Any] = args.expected
        self.per_worker: dict[str, list[list[int]]] = out.extra.setdefault("per_worker", {})

    def _add(self, workload: str, metric: str, value: float) -> None:
        self.out.add(f"{self.n}:{workload}:{metric}", value)

    def _timed(self, workload: str, futures: list[Any], t0: float) -> None:
        self.wait(futures, timeout=self.timeout)
        wall = time.perf_counter() - t0
        ideal = dict((w, f) for w, _, f in WORKLOADS)[workload]
        self._add(workload, "wall_s", wall)
        if ideal is not None:
            self._add(workload, "efficiency", ideal(self.n) / wall)

    def _ran(self, workload: str, futures: list[Any], first: str | None = None) -> list[int]:
        """Tasks per worker, from where each result lives (a worker that ran none
        counts): ``first``'s count, then the others', most first; kept for the report."""
        counts = dict.fromkeys(self.client.scheduler_info()["workers"], 0)
        for holders in self.client.who_has(futures).values():
            if holders:
                where = sorted(holders)[0]
                counts[where] = counts.get(where, 0) + 1
        head = [counts.pop(first, 0)] if first is not None else []
        ran = head + sorted(counts.values(), reverse=True)
        if sum(ran) != len(futures):
            raise AssertionError(f"{workload}: {sum(ran)} results held of {len(futures)}")
        self.per_worker.setdefault(f"{self.n}:{workload}", []).append(ran)
        return ran

    def warm_up(self) -> None:
        futures = self.client.map(_tasks.noop, range(WARMUP), pure=False)
        self.wait(futures, timeout=self.timeout)
        if self.client.gather(futures) != list(range(WARMUP)):
            raise AssertionError("the warm-up returned wrong values")

    def ten_ms(self) -> None:
        n_tasks = PER_WORKER * self.n
        t0 = time.perf_counter()
        futures = self.client.map(_tasks.sleep_inc, range(n_tasks), delay=SHORT_S, pure=False)
        self._timed("10ms", futures, t0)
        ran = self._ran("10ms", futures)
        self._add("10ms", "balance", ran[-1] / ran[0] if ran[0] else 0.0)

    def straggler(self) -> None:
        t0 = time.perf_counter()
        long = self.client.submit(_tasks.sleep_inc, -1, delay=STRAGGLER_S, pure=False)
        short = self.client.map(_tasks.sleep_inc, range(N_SHORT), delay=SHORT2_S, pure=False)
        self._timed("straggler", [long, *short], t0)
        holder = sorted(self.client.who_has([long])[long.key])[0]
        self._add("straggler", "short_beside_straggler", self._ran("straggler", short, holder)[0])

    def misestimated(self) -> None:
        warm = self.client.map(_tasks.sleep_inc, range(-MIS_WARM, 0), delay=0.0, pure=False)
        self.wait(warm, timeout=self.timeout)  # (untimed: what the estimate is learnt from)
        t0 = time.perf_counter()
        n_tasks = MIS_PER_WORKER * self.n
        futures = self.client.map(_tasks.sleep_inc, range(n_tasks), delay=MIS_S, pure=False)
        self._timed("misestimated", futures, t0)
        ran = self._ran("misestimated", futures)
        self._add("misestimated", "balance", ran[-1] / ran[0] if ran[0] else 0.0)

    def collection(self, name: str) -> None:
        with dask.config.set(SHUFFLE):
            collection = COLLECTIONS[name]()
            before = self.moved()
            t0 = time.perf_counter()
            got = self.client.compute(collection).result(timeout=self.timeout)
            self._add(name, "wall_s", time.perf_counter() - t0)
        after = self.moved()
        for metric, value in after.items():
            self._add(name, metric, value - before[metric])
        expected = self.expected[name]
        if isinstance(got, pd.Series):  # (the groupby's order is the partitions')
            got, expected = got.sort_index(), expected.sort_index()
        if not np.allclose(np.asarray(got), np.asarray(expected)):
            raise AssertionError(f"{name}: wrong result")

    def moved(self) -> dict[str, float]:
        raise NotImplementedError

    def all(self, run: int, workloads: list[str]) -> None:
        for workload, name, fn in [
            ("warm-up", "warm-up", self.warm_up),
            ("10ms", "10 ms", self.ten_ms),
            ("straggler", "straggler", self.straggler),
            ("misestimated", "mis-estimated", self.misestimated),
            ("array", "array", lambda: self.collection("array")),
            ("dataframe", "dataframe", lambda: self.collection("dataframe")),
        ]:
            if workload == "warm-up" or workload in workloads:
                self.out.step(run, f"{self.n} workers: {name}", fn)
                gc.collect()


class RedisdaskBalance(Balance):
    def moved(self) -> dict[str, float]:
        """Bytes received from peers and from Redis, summed over the workers, from the
        first heartbeat of each worker made after now."""
        since = time.time()
        deadline = time.monotonic() + 30
        while True:
            beats = [w.get("metrics", {}) for w in self.client.scheduler_info()["workers"].values()]
            if all(float(m.get("time") or 0) > since for m in beats):
                break
            if time.monotonic() > deadline:
                raise TimeoutError("no heartbeat from every worker in 30 s")
            time.sleep(0.05)  # polling the heartbeats of other processes
        return {
            "peer_MB": sum(m["transfer_incoming_bytes_total"] for m in beats) / MB,
            "redis_MB": sum(m["transfer_incoming_redis_bytes_total"] for m in beats) / MB,
        }


class DaskBalance(Balance):
    def moved(self) -> dict[str, float]:
        received = self.client.run(dask_received_bytes)
        if any(length >= DASK_LOG for _, length in received.values()):
            raise AssertionError("a Dask worker's transfer log is full: its bytes are short")
        return {"peer_MB": sum(nbytes for nbytes, _ in received.values()) / MB}


# ------------------------------------------------------------------------ clusters


@contextlib.contextmanager
def _up(out: Results, label: str) -> Iterator[None]:
    t0 = time.perf_counter()
    _say(out.name, f"{label} ...")
    try:
        yield
    except Exception as exc:
        out.errors[f"{label}: cluster"] = f"{type(exc).__name__}: {exc}"
        _say(out.name, f"{label}: cluster FAILED: {type(exc).__name__}: {exc}")
    _say(out.name, f"{label} done in {time.perf_counter() - t0:.1f} s, cluster included")


def run_redisdask(out: Results, n: int, run: int, args: argparse.Namespace) -> None:
    from redisdask import Client, LocalCluster, wait

    with (
        _up(out, f"{n} workers, run {run}"),
        LocalCluster(
            n_workers=n,
            threads_per_worker=1,
            nanny=False,
            log_directory=args.logdir,
            start_timeout=120,  # (8 workers starting on a loaded 2-core machine)
        ) as cluster,
        Client(cluster) as client,
    ):
        RedisdaskBalance(out, client, wait, n, args).all(run, args.workloads)


@contextlib.contextmanager
def dask_bare_cluster(n: int, logdir: Path) -> Iterator[str]:
    """A ``dask scheduler`` and ``n`` ``dask worker --no-nanny --nthreads 1`` processes;
    the scheduler's address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, DASK_DISTRIBUTED__ADMIN__LOW_LEVEL_LOG_LENGTH=str(DASK_LOG))
    address = f"tcp://127.0.0.1:{port}"
    processes: list[subprocess.Popen[bytes]] = []

    def spawn(command: str, *argv: str, log: str) -> None:
        with open(logdir / f"dask-{log}.log", "ab") as out:
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", f"distributed.cli.dask_{command}", *argv],
                    stdout=out, stderr=subprocess.STDOUT, env=env,
                )
            )  # fmt: skip

    try:
        spawn("scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard",
              log="scheduler")  # fmt: skip
        for i in range(n):
            spawn("worker", address, "--nthreads", "1", "--no-nanny", "--no-dashboard",
                  "--name", f"worker-{i}", log=f"worker-{i}")  # fmt: skip
        yield address
    finally:
        for p in processes:
            p.terminate()
        for p in processes:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def run_dask(out: Results, n: int, run: int, args: argparse.Namespace) -> None:
    import distributed

    with (
        _up(out, f"{n} workers, run {run}"),
        dask_bare_cluster(n, args.logdir) as address,
        distributed.Client(address, timeout=60) as client,
    ):
        client.wait_for_workers(n, timeout=120)
        DaskBalance(out, client, distributed.wait, n, args).all(run, args.workloads)


RUNNERS = {"redisdask": run_redisdask, "dask": run_dask}


# ------------------------------------------------------------------------ report


def _median_run(res: Results | None, n: int, workload: str) -> list[int] | None:
    """The tasks per worker of the run whose wall time is the median one."""
    if res is None:
        return None
    walls = res.samples.get(f"{n}:{workload}:wall_s") or []
    lists = res.extra.get("per_worker", {}).get(f"{n}:{workload}") or []
    if not walls or len(walls) != len(lists):
        return None
    order = sorted(range(len(walls)), key=walls.__getitem__)
    return lists[order[(len(order) - 1) // 2]]


def report(
    results: dict[str, Results], sizes: list[int], repeats: int, workloads: list[str]
) -> str:
    def med(name: str, key: str) -> float | None:
        res = results.get(name)
        return res.median(key) if res else None

    def fmt(value: float | None, pattern: str) -> str:
        return "—" if value is None else pattern.format(value)

    head = ("workers", "workload", "metric", *SYSTEMS, "dask/redisdask")
    rows: list[tuple[str, ...]] = [head]
    for n in sizes:
        for workload, label, ideal in WORKLOADS:
            if workload not in workloads:
                continue
            name = label.format(tasks=PER_WORKER * n, mis=MIS_PER_WORKER * n)
            metrics = [("wall_s", "wall, s", "{:.2f}")]
            if ideal is not None:
                metrics.append(("efficiency", f"efficiency (ideal {ideal(n):.1f} s)", "{:.0%}"))
            if workload in ("10ms", "misestimated"):
                metrics.append(("balance", "tasks/worker least/most", "{:.2f}"))
            if workload == "straggler":
                metrics.append(("short_beside_straggler", "short tasks on its worker", "{:.0f}"))
            if ideal is None:
                metrics += [("peer_MB", "MB moved worker->worker", "{:,.1f}"),
                            ("redis_MB", "  + MB read from Redis", "{:,.1f}")]  # fmt: skip
            for metric, text, pattern in metrics:
                key = f"{n}:{workload}:{metric}"
                ours, theirs = med("redisdask", key), med("dask", key)
                ratio = ""
                if metric == "wall_s" and ours and theirs:
                    ratio = f"{theirs / ours:.2f}x"
                rows.append((str(n), name, text, fmt(ours, pattern), fmt(theirs, pattern), ratio))
                name = ""
    lines = _table(rows)
    lines.append("")
    lines.append(
        f"medians of {repeats} alternating runs (fresh clusters of bare workers x 1 thread, "
        "order rotated each run); dask/redisdask > 1: redisdask is faster; efficiency = "
        "ideal / wall; least/most = the fewest tasks a worker ran / the most (1: even)"
    )
    for n in sizes:
        for workload in ("10ms", "straggler", "misestimated"):
            if workload not in workloads:
                continue
            parts = []
            for name in SYSTEMS:
                ran = _median_run(results.get(name), n, workload)
                parts.append(f"{name} {ran if ran is not None else '—'}")
            what = (
                "short tasks per worker, the straggler's first"
                if workload == "straggler"
                else "tasks per worker"
            )
            lines.append(f"{what}, {n} workers, {workload} (median run): " + "; ".join(parts))
    lines.append(
        "bytes moved: redisdask's transfer_incoming_bytes_total (from peers) and "
        "transfer_incoming_redis_bytes_total (small results read from Redis) summed over "
        "its workers; Dask's workers' transfer_incoming_log totals (from peers)"
    )
    for res in results.values():
        lines.extend(f"note: {x}" for x in res.notes)
        lines.extend(f"ERROR [{res.name}] {k}: {v}" for k, v in res.errors.items())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default=",".join(map(str, WORKERS)),
                        help="cluster sizes, comma-separated (default 2,8)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs (median)")
    parser.add_argument("--only", choices=SYSTEMS, help="run one system")
    parser.add_argument("--timeout", type=float, default=300.0, help="per workload, s")
    parser.add_argument("--workloads", default=",".join(w for w, _, _ in WORKLOADS),
                        help="which to run, comma-separated (default: all)")  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    args = parser.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = set(args.workloads) - {w for w, _, _ in WORKLOADS}
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}; known: {[w for w, _, _ in WORKLOADS]}")
    _quiet_logs()
    sizes = [int(s) for s in args.workers.split(",") if s.strip()]
    names = [args.only] if args.only else list(SYSTEMS)
    results = {name: Results(name) for name in names}
    present = [name for name in names if not results[name].missing]
    args.logdir = Path(tempfile.mkdtemp(prefix="redisdask-bench-balance-"))
    args.expected = expected_results(args.workloads)
    loadavg_start = os.getloadavg()
    try:
        for n in sizes:
            for run in range(1, args.repeats + 1):
                k = (run - 1) % max(len(present), 1)
                for name in present[k:] + present[:k]:
                    RUNNERS[name](results[name], n, run, args)
                    gc.collect()
                    _stop_leftovers()
    finally:
        _stop_leftovers()
    print()
    print(report(results, sizes, args.repeats, args.workloads))
    print(
        f"load average {loadavg_start[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the "
        f"end ({os.cpu_count()} CPUs)"
    )
    failed = any(res.errors for res in results.values())
    if failed:
        print(f"cluster logs kept in {args.logdir}")
    else:
        shutil.rmtree(args.logdir, ignore_errors=True)
    if args.json:
        out = {
            "config": {"workers": sizes, "repeats": args.repeats, "timeout": args.timeout,
                       "workloads": args.workloads},
            "env": {**_versions(), "loadavg_start": loadavg_start},
            **{
                name: {"medians": {m: res.median(m) for m in res.samples},
                       "samples": res.samples, "errors": res.errors, **res.extra}
                for name, res in results.items()
            },
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
        print(f"results written to {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
