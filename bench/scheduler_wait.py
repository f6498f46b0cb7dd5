"""Where the scheduler waits on a big cluster of no-ops: redisdask vs Dask ``distributed``
(not a test; issue 24, "a scheduler that does not cap a big cluster").

Each of ``--repeats`` runs, ALTERNATING between the systems, starts a fresh cluster of
``--workers`` bare worker processes x 1 thread (no nannies; redisdask: ``LocalCluster``
with its own Redis; Dask: a ``dask scheduler`` process and ``dask worker --no-nanny``
processes, as ``bench/balance.py`` starts them), warms it up with a ``map`` of 2,000
no-ops, and times ``client.map(noop, range(--tasks), pure=False)`` + ``wait``.
Per run it records:

* tasks/s (both systems);
* the client's CPU per task and its share of the wall time, and the workers' (their sum
  per task, and the median worker's share: how busy a worker was kept);
* redisdask: Redis commands per task (``INFO commandstats``, every command including
  those inside scripts, the idle background included), ``EVALSHA`` and ``XREADGROUP``
  calls per task (the scheduler's writes and reads, and the workers' claims), Redis's own
  CPU per task and its share of the wall time (``INFO cpu``), the scheduler process's CPU
  per task and share (``psutil``);
* with ``--py-spy`` (redisdask, first run): ``py-spy record --idle`` of the scheduler's
  main thread during the map, its samples split into where the time went: waiting for a
  Redis reply, sending, reading the streams (blocked XREADGROUP), the state machine,
  translating instructions into commands, encoding the script's arguments, decoding
  entries, other.

    python bench/scheduler_wait.py [--workers 8] [--tasks 20000] [--repeats 3]
                                   [--only redisdask|dask] [--py-spy] [--json out.json]

``bench/scale_14.sh`` runs the issue's figure (14 workers x 20,000 no-ops, both systems)
with one command on a machine with 16 cores.  Numbers are noisy on a shared machine:
compare ratios and medians, and note the load.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _tasks
import psutil
from balance import dask_bare_cluster
from throughput import Results, _commandstats, _diff, _quiet_logs, _say, _stop_leftovers, _table

SYSTEMS = ("redisdask", "dask")
WARMUP = 2_000

# (label, frames that mark it, innermost match wins): the scheduler's main thread
PARTS: list[tuple[str, tuple[str, ...]]] = [
    ("waiting for a write's reply", ("read_response", "read_from_socket", "_read_from_socket")),
    ("sending commands", ("send_packed_command", "sendall")),
    ("state machine", ("handle_stimulus",)),
    ("translating instructions", ("to_commands", "story (redisdask/scheduler/translator")),
    ("encoding the script's arguments", ("pack_for_lua",)),
    ("decoding entries", ("decode_reply",)),
    ("looking for the dead", ("look_for_the_dead", "look_at_redis_memory")),
]
READ_FRAMES = ("xreadgroup",)  # a wait inside one is a read, not a write's reply


def _usec(r: Any) -> dict[str, int]:
    """Redis's own microseconds per command name (``INFO commandstats``)."""
    stats = r.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["usec"]) for k, v in stats.items()}


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _redis_cpu(r: Any) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


@contextlib.contextmanager
def _py_spy(pid: int, path: Path) -> Iterator[None]:
    """``py-spy record`` of ``pid`` while the block runs (raw, collapsed stacks)."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    proc = subprocess.Popen(
        [exe, "record", "--format", "raw", "--idle", "--threads", "-r", "250",
         "-o", str(path), "--pid", str(pid)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        time.sleep(1.0)  # (py-spy attaches; nothing to poll for)
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if proc.returncode not in (0, -signal.SIGINT) and not path.exists():
            _say("redisdask", f"py-spy failed: {err.decode(errors='replace')[-500:]}")


def split_profile(path: Path) -> tuple[dict[str, float], dict[str, float]]:
    """The main thread's samples in ``path`` (py-spy raw), as shares of ``PARTS``, and
    the functions of ours where they were (innermost frame under ``redisdask/``)."""
    counts: collections.Counter[str] = collections.Counter()
    ours: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or "lease.py" in stack or "_keep" in stack:
            continue  # the lease keeper's thread
        if (
            "_lead (redisdask/scheduler/driver.py" not in stack
            and "run (redisdask/sch" not in stack
        ):
            continue
        frames = stack.split(";")
        label = "other"
        for frame in reversed(frames):  # innermost first
            hit = next((lb for lb, marks in PARTS if any(m in frame for m in marks)), None)
            if hit is not None:
                label = hit
                break
        if label == "waiting for a write's reply" and any(
            m in f for f in frames for m in READ_FRAMES
        ):
            label = "reading the streams (XREADGROUP, blocked while idle)"
        counts[label] += int(n)
        own = [f for f in frames if "redisdask/" in f or "workers/" in f]
        if own and label not in ("reading the streams (XREADGROUP, blocked while idle)",):
            ours[own[-1].split(" (")[0] + " " + own[-1].split("/")[-1].split(":")[0]] += int(n)
    total = sum(counts.values()) or 1
    shares = {k: v / total for k, v in counts.most_common()}
    return shares, {k: v / total for k, v in ours.most_common(15)}


def run_redisdask(out: Results, run: int, args: argparse.Namespace) -> None:
    from redisdask import Client, LocalCluster, wait
    from redisdask.store.connection import connect

    with (
        LocalCluster(
            n_workers=args.workers, threads_per_worker=1, nanny=False,
            log_directory=args.logdir, start_timeout=120,
        ) as cluster,
        Client(cluster) as client,
    ):  # fmt: skip
        wait(client.map(_tasks.noop, range(WARMUP), pure=False), timeout=args.timeout)
        r = connect(cluster.redis_url)
        sched = psutil.Process(cluster.scheduler_process.pid)
        me = psutil.Process()
        workers = [
            p for p in me.children(recursive=True)
            if p.pid != sched.pid and "redis-server" not in " ".join(p.cmdline())
        ]  # fmt: skip
        spy = args.py_spy and run == 1
        prof = args.logdir / "scheduler.pyspy.txt"
        cm = _py_spy(sched.pid, prof) if spy else contextlib.nullcontext()
        with cm:
            stats0, usec0 = _commandstats(r), _usec(r)
            rcpu0, scpu0, ccpu0 = _redis_cpu(r), _cpu(sched), _cpu(me)
            wcpu0 = [_cpu(w) for w in workers]
            t0 = time.perf_counter()
            futures = client.map(_tasks.noop, range(WARMUP, WARMUP + args.tasks), pure=False)
            wait(futures, timeout=args.timeout)
            dt = time.perf_counter() - t0
            stats, usec = _diff(_commandstats(r), stats0), _diff(_usec(r), usec0)
            rcpu, scpu, ccpu = _redis_cpu(r) - rcpu0, _cpu(sched) - scpu0, _cpu(me) - ccpu0
            wcpu = [_cpu(w) - c for w, c in zip(workers, wcpu0, strict=True)]
        n = args.tasks
        out.add("tasks_per_s", n / dt)
        out.add("cmds_per_task", sum(stats.values()) / n)
        out.add("evalsha_per_task", (stats.get("evalsha", 0) + stats.get("eval", 0)) / n)
        out.add("xreadgroup_per_task", stats.get("xreadgroup", 0) / n)
        out.add("redis_cpu_us_per_task", rcpu / n * 1e6)
        out.add("redis_cpu_share", rcpu / dt)
        out.add("scheduler_cpu_us_per_task", scpu / n * 1e6)
        out.add("scheduler_cpu_share", scpu / dt)
        out.add("client_cpu_us_per_task", ccpu / n * 1e6)
        out.add("client_cpu_share", ccpu / dt)
        out.add("worker_cpu_us_per_task", sum(wcpu) / n * 1e6)
        out.add("worker_cpu_share", statistics.median(wcpu) / dt)
        if spy and prof.exists():
            out.extra["profile"], out.extra["functions"] = split_profile(prof)
            if args.keep_profile:
                shutil.copy(prof, args.keep_profile)
        if run == 1:
            top = sorted(stats.items(), key=lambda kv: -kv[1])[:10]
            out.extra["top_calls_per_task"] = {k: v / n for k, v in top}
            top = sorted(usec.items(), key=lambda kv: -kv[1])[:8]
            out.extra["top_usec_per_task"] = {k: v / n for k, v in top}
        r.close()
        client.cancel(futures)


def run_dask(out: Results, run: int, args: argparse.Namespace) -> None:
    import distributed

    with (
        dask_bare_cluster(args.workers, args.logdir) as address,
        distributed.Client(address, timeout=60) as client,
    ):
        client.wait_for_workers(args.workers, timeout=120)
        distributed.wait(client.map(_tasks.noop, range(WARMUP), pure=False), timeout=args.timeout)
        t0 = time.perf_counter()
        futures = client.map(_tasks.noop, range(WARMUP, WARMUP + args.tasks), pure=False)
        distributed.wait(futures, timeout=args.timeout)
        out.add("tasks_per_s", args.tasks / (time.perf_counter() - t0))
        client.cancel(futures)


RUNNERS = {"redisdask": run_redisdask, "dask": run_dask}
ROWS = [
    ("tasks_per_s", "tasks/s", "{:,.0f}"),
    ("cmds_per_task", "Redis commands/task (all)", "{:.2f}"),
    ("evalsha_per_task", "  EVALSHA/task", "{:.3f}"),
    ("xreadgroup_per_task", "  XREADGROUP/task", "{:.3f}"),
    ("redis_cpu_us_per_task", "Redis CPU/task, us", "{:.1f}"),
    ("redis_cpu_share", "Redis CPU / wall", "{:.2f}"),
    ("scheduler_cpu_us_per_task", "scheduler CPU/task, us", "{:.1f}"),
    ("scheduler_cpu_share", "scheduler CPU / wall", "{:.2f}"),
    ("client_cpu_us_per_task", "client CPU/task, us", "{:.1f}"),
    ("client_cpu_share", "client CPU / wall", "{:.2f}"),
    ("worker_cpu_us_per_task", "workers' CPU/task (all), us", "{:.1f}"),
    ("worker_cpu_share", "a worker's CPU / wall (median)", "{:.2f}"),
]


def report(results: dict[str, Results], args: argparse.Namespace) -> str:
    rows: list[tuple[str, ...]] = [("figure", *results, "vs Dask")]
    for metric, label, fmt in ROWS:
        meds = {name: res.median(metric) for name, res in results.items()}
        cells = [fmt.format(v) if v is not None else "—" for v in meds.values()]
        ours, theirs = meds.get("redisdask"), meds.get("dask")
        ratio = f"{ours / theirs:.2f}x" if metric == "tasks_per_s" and ours and theirs else ""
        rows.append((label, *cells, ratio))
    lines = [
        f"{args.workers} workers x 1 thread, map of {args.tasks:,} no-ops + wait, "
        f"medians of {args.repeats} alternating runs; {os.cpu_count()} CPUs, load "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}",
        *_table(rows),
    ]
    rd = results.get("redisdask")
    if rd is not None and "top_calls_per_task" in rd.extra:
        top = ", ".join(f"{k} {v:.3f}" for k, v in rd.extra["top_calls_per_task"].items())
        lines.append(f"top Redis commands per task (run 1): {top}")
        top = ", ".join(f"{k} {v:.1f}" for k, v in rd.extra["top_usec_per_task"].items())
        lines.append(f"  Redis's time in them, us per task (inner commands counted twice): {top}")
    if rd is not None and "profile" in rd.extra:
        lines.append("the scheduler's main thread during the map (py-spy, share of samples):")
        lines += [f"  {share:6.1%}  {label}" for label, share in rd.extra["profile"].items()]
        lines.append("  innermost function of ours, outside the reads (share of all samples):")
        lines += [f"  {share:6.1%}  {name}" for name, share in rd.extra["functions"].items()]
    for res in results.values():
        lines += [f"{res.name} ERROR {k}: {v}" for k, v in res.errors.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=SYSTEMS)
    parser.add_argument("--py-spy", action="store_true", help="profile the scheduler (run 1)")
    parser.add_argument("--keep-profile", metavar="PATH", help="copy py-spy's raw file here")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    _quiet_logs()
    systems = [args.only] if args.only else list(SYSTEMS)
    results = {name: Results(name) for name in systems}
    with tempfile.TemporaryDirectory(prefix="rd-wait-") as tmp:
        args.logdir = Path(tmp)
        for run in range(1, args.repeats + 1):
            k = (run - 1) % len(systems)
            for name in systems[k:] + systems[:k]:
                _say(name, f"run {run} ...")
                t0 = time.perf_counter()
                try:
                    RUNNERS[name](results[name], run, args)
                except Exception as exc:
                    results[name].errors[f"run {run}"] = f"{type(exc).__name__}: {exc}"
                _say(name, f"run {run} done in {time.perf_counter() - t0:.1f} s")
                _stop_leftovers()
    text = report(results, args)
    print(text)
    if args.json:
        dump = {n: {"samples": r.samples, "extra": r.extra, "errors": r.errors}
                for n, r in results.items()}  # fmt: skip
        Path(args.json).write_text(json.dumps(dump, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
