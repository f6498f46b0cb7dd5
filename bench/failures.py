"""Failures, measured: redisdask vs Dask ``distributed`` under the same faults (not a test).

Each system runs as separate processes on this machine (a scheduler and 2 workers x 1
thread, no nannies: redisdask's CLI processes through ``LocalCluster``, Dask's
``dask scheduler`` / ``dask worker --no-nanny``), so that each process can be killed
with SIGKILL on its own.  Every scenario starts a fresh cluster of each system and runs
200 tasks of 0.05 s (``client.map(sleep_inc, range(200))``):

1. ``baseline``: no fault; total seconds until every result is gathered;
2. ``worker-kill``: one worker is killed (SIGKILL) once 50 tasks are done and is not
   replaced; how long until the scheduler no longer lists it (polled every 5 ms), and
   the total;
3. ``scheduler-kill``: the scheduler is killed once 50 tasks are done and a new one is
   started at once (redisdask: ``redisdask scheduler``, which waits for the dead one's
   lease to expire; Dask: ``dask scheduler`` on the same port); the total, or what the
   client saw instead of the results;
4. ``killed-worker``: one task calls ``os._exit(1)``; the time from its submission
   until the client raises ``KilledWorker`` (default ``allowed-failures`` 3, so it has to
   kill 4 workers).  This bench stands in for a nanny for both systems: it starts a new
   worker process as soon as one died (polled every 20 ms);
5. ``killed-worker-nannies``: the same with each system's own nannies (``redisdask
   worker`` and ``dask worker`` with nannies) restarting the workers;
6. ``standby-takeover`` (redisdask only: Dask has no standby scheduler): a standby runs
   beside the scheduler (default ``scheduler.lease-ttl``, 5 s), the scheduler is killed
   (SIGKILL) once 50 tasks are done; how long until the standby holds the lease
   (``takeover_s``, polled every 5 ms) and until a task submitted right after the kill,
   with a priority above the queued ones, has its result (``new_task_s``: work moving
   again), and the total;
7. ``long-batch`` (redisdask only): ``client.map(inc, range(200_000))`` with a 2 s lease
   (``scheduler.lease-ttl``) and one scheduler: the total, and whether the scheduler kept
   its lease throughout (``kept_lease``: the same token, the scheduler still running; a
   batch that outlasted the lease used to fence it out, and the cluster was wedged).

    python bench/failures.py [--repeats 3] [--only redisdask|dask] [--scenario NAME ...]
                             [--json out.json]

Times are medians of ``--repeats`` (fresh clusters each time).  The machine is shared
and noisy: compare ratios, rerun before trusting one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _tasks

N_TASKS = 200
TASK_SECONDS = 0.05
KILL_AFTER = 50  # tasks done before the fault
TIMEOUT = 120.0  # a hang becomes a reported failure, not a stalled bench
LONG_BATCH_TASKS = 200_000
LONG_BATCH_LEASE_TTL = 2.0

log = logging.getLogger("bench.failures")


def poll_until(condition: Callable[[], bool], timeout: float, interval: float) -> float:
    """Seconds until ``condition()`` held; TimeoutError after ``timeout``."""
    t0 = time.perf_counter()
    while not condition():
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"condition not met within {timeout} s")
        time.sleep(interval)
    return time.perf_counter() - t0


def wait_done(futures: list[Any], n: int) -> None:
    poll_until(lambda: sum(f.done() for f in futures) >= n, TIMEOUT, 0.005)


class Respawner:
    """Starts a new worker whenever one of ``processes`` has died (a nanny stand-in)."""

    def __init__(self, processes: list[subprocess.Popen[bytes]], start: Callable[[], Any]):
        self.processes, self.start = processes, start
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for proc in list(self.processes):
                if proc.poll() is not None:
                    self.processes.remove(proc)
                    self.restarts += 1
                    self.start()

    def __enter__(self) -> Respawner:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# ------------------------------------------------------------------------ the systems


class System:
    """One cluster of one system, with the handles the scenarios need."""

    name = ""
    client: Any
    KilledWorker: type[BaseException]

    def worker_processes(self) -> list[subprocess.Popen[bytes]]:
        raise NotImplementedError

    def worker_pids(self) -> dict[str, int]:
        """Registered workers: address -> pid."""
        raise NotImplementedError

    def worker_addresses(self) -> set[str]:
        """The workers the scheduler lists now."""
        raise NotImplementedError

    def start_worker(self) -> Any:
        raise NotImplementedError

    def kill_scheduler_and_restart(self) -> None:
        raise NotImplementedError

    def start_standby(self) -> None:
        """Start a standby scheduler and return once it watches the scheduler."""
        raise NotImplementedError(f"{self.name} has no standby scheduler")

    def kill_scheduler(self) -> Callable[[], bool]:
        """SIGKILL the scheduler; returns whether another one has taken over now."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class RedisDask(System):
    name = "redisdask"

    def __init__(
        self, redis_url: str, logdir: Path, nanny: bool = False, lease_ttl: float | None = None
    ) -> None:
        import redis

        from redisdask import Client, KilledWorker, LocalCluster
        from redisdask.store.codecs import unpack
        from redisdask.store.keyspace import Keys

        self.KilledWorker = KilledWorker
        self.logdir = logdir
        self.cluster = LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            redis_url=redis_url,
            log_directory=logdir,
            nanny=nanny,
            scheduler_options={"lease_ttl": lease_ttl} if lease_ttl else None,
        )
        self.client = Client(self.cluster)
        self.redis = redis.Redis.from_url(redis_url)
        self.keys = Keys(self.cluster.cluster_name)
        self._unpack = unpack
        self._n = 2
        self.leader: subprocess.Popen[bytes] | None = None

    def worker_processes(self) -> list[subprocess.Popen[bytes]]:
        return self.cluster.worker_processes

    def worker_pids(self) -> dict[str, int]:
        raw = self.redis.hgetall(self.keys.workers)
        return {a.decode(): self._unpack(v)["pid"] for a, v in raw.items()}

    def worker_addresses(self) -> set[str]:
        return {a.decode() for a in self.redis.hkeys(self.keys.workers)}

    def start_worker(self) -> Any:
        self._n += 1
        return self.cluster.start_worker(name=f"worker-{self._n}")

    def kill_scheduler_and_restart(self) -> None:
        process = self.cluster.scheduler_process
        assert process is not None
        process.kill()
        process.wait()
        self.cluster.start_scheduler()  # takes over when the dead one's lease expires

    def start_standby(self) -> None:
        log = self.logdir / "scheduler.log"
        seen = log.read_bytes().count(b"standing by") if log.exists() else 0
        self.leader = self.cluster.scheduler_process
        self.cluster.start_scheduler(standby=True)
        # it says so once it has looked at the leader's connections
        poll_until(lambda: log.read_bytes().count(b"standing by") > seen, TIMEOUT, 0.01)

    def kill_scheduler(self) -> Callable[[], bool]:
        token = self.redis.get(self.keys.lease)
        assert self.leader is not None
        self.leader.kill()
        return lambda: self.redis.get(self.keys.lease) not in (None, token)

    def close(self) -> None:
        self.client.close()
        self.cluster.close()
        self.redis.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Dask(System):
    name = "dask"

    def __init__(self, logdir: Path, nanny: bool = False) -> None:
        self.nanny = nanny
        import distributed

        self.KilledWorker = distributed.KilledWorker
        self.logdir = logdir
        self.port = free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.scheduler = self._spawn(
            ["scheduler", "--host", "127.0.0.1", "--port", str(self.port), "--no-dashboard"],
            "scheduler",
        )
        self.workers: list[subprocess.Popen[bytes]] = []
        self._n = 0
        for _ in range(2):
            self.start_worker()
        self.client = distributed.Client(self.address, timeout=30)
        self.client.wait_for_workers(2, timeout=30)

    def _spawn(self, args: list[str], label: str) -> subprocess.Popen[bytes]:
        out = open(self.logdir / f"dask-{label}.log", "ab")  # noqa: SIM115 - the child's
        return subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_" + args[0], *args[1:]],
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def worker_processes(self) -> list[subprocess.Popen[bytes]]:
        return self.workers

    def worker_pids(self) -> dict[str, int]:
        return self.client.run(os.getpid)

    def worker_addresses(self) -> set[str]:
        return set(self.client.scheduler_info()["workers"])

    def start_worker(self) -> Any:
        self._n += 1
        args = ["worker", self.address, "--nthreads", "1", "--no-dashboard"]
        args.append("--nanny" if self.nanny else "--no-nanny")
        proc = self._spawn([*args, "--name", f"worker-{self._n}"], f"worker-{self._n}")
        self.workers.append(proc)
        return proc

    def kill_scheduler_and_restart(self) -> None:
        self.scheduler.kill()
        self.scheduler.wait()
        self.scheduler = self._spawn(
            ["scheduler", "--host", "127.0.0.1", "--port", str(self.port), "--no-dashboard"],
            "scheduler",
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close(timeout=10)
        for proc in [*self.workers, self.scheduler]:
            if proc.poll() is None:
                proc.terminate()
        for proc in [*self.workers, self.scheduler]:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ------------------------------------------------------------------------ scenarios


def _map(system: System) -> list[Any]:
    return system.client.map(_tasks.sleep_inc, range(N_TASKS), delay=TASK_SECONDS, pure=False)


def _check(values: list[int]) -> None:
    if values != list(range(1, N_TASKS + 1)):
        raise AssertionError("wrong results")


def baseline(system: System) -> dict[str, Any]:
    t0 = time.perf_counter()
    _check(system.client.gather(_map(system)))
    return {"total_s": time.perf_counter() - t0}


def worker_kill(system: System) -> dict[str, Any]:
    t0 = time.perf_counter()
    futures = _map(system)
    wait_done(futures, KILL_AFTER)
    pids = system.worker_pids()
    victim = system.worker_processes()[0]
    [address] = [a for a, pid in pids.items() if pid == victim.pid]
    victim.kill()
    notice = poll_until(lambda: address not in system.worker_addresses(), TIMEOUT, 0.005)
    _check(system.client.gather(futures))
    return {"notice_s": notice, "total_s": time.perf_counter() - t0}


def scheduler_kill(system: System) -> dict[str, Any]:
    t0 = time.perf_counter()
    futures = _map(system)
    wait_done(futures, KILL_AFTER)
    system.kill_scheduler_and_restart()
    try:
        values = system.client.gather(futures)
    except Exception as exc:  # what the client saw instead of its results
        return {
            "total_s": None,
            "client_saw": f"{type(exc).__module__}.{type(exc).__name__}: {exc}"[:300],
            "after_s": time.perf_counter() - t0,
        }
    _check(values)
    return {"total_s": time.perf_counter() - t0, "client_saw": "every result"}


def killed_worker(system: System) -> dict[str, Any]:
    with Respawner(system.worker_processes(), system.start_worker) as respawner:
        t0 = time.perf_counter()
        future = system.client.submit(_tasks.exit_process, 1, pure=False)
        try:
            future.result(timeout=TIMEOUT)
        except system.KilledWorker:
            elapsed = time.perf_counter() - t0
        else:
            raise AssertionError("the task returned")
        restarts = respawner.restarts
    return {"killed_worker_s": elapsed, "workers_killed": restarts}


def killed_worker_nannies(system: System) -> dict[str, Any]:
    """The same task, with each system's own nannies restarting the workers."""
    t0 = time.perf_counter()
    future = system.client.submit(_tasks.exit_process, 1, pure=False)
    try:
        future.result(timeout=TIMEOUT)
    except system.KilledWorker:
        return {"killed_worker_s": time.perf_counter() - t0}
    raise AssertionError("the task returned")


def long_batch(system: System) -> dict[str, Any]:
    """200,000 tasks in one ``map`` with a 2 s lease and one scheduler."""
    assert isinstance(system, RedisDask)
    token = system.redis.get(system.keys.lease)
    scheduler = system.cluster.scheduler_process
    t0 = time.perf_counter()
    futures = system.client.map(_tasks.inc, range(LONG_BATCH_TASKS))
    values = system.client.gather(futures)
    total = time.perf_counter() - t0
    if values != list(range(1, LONG_BATCH_TASKS + 1)):
        raise AssertionError("wrong results")
    kept = system.redis.get(system.keys.lease) == token and scheduler.poll() is None
    return {"total_s": total, "kept_lease": kept}


def standby_takeover(system: System) -> dict[str, Any]:
    """SIGKILL of the scheduler while a standby runs: how long until work moves again."""
    system.start_standby()
    t0 = time.perf_counter()
    futures = _map(system)
    wait_done(futures, KILL_AFTER)
    taken_over = system.kill_scheduler()
    killed = time.perf_counter()
    # ahead of the 150 tasks still queued: it waits for the scheduler, not for them
    new = system.client.submit(_tasks.sleep_inc, -1, delay=0, pure=False, priority=100)
    takeover = poll_until(taken_over, TIMEOUT, 0.005)
    if new.result(timeout=TIMEOUT) != 0:
        raise AssertionError("wrong result")
    new_task = time.perf_counter() - killed
    _check(system.client.gather(futures))
    return {"takeover_s": takeover, "new_task_s": new_task, "total_s": time.perf_counter() - t0}


REDISDASK_ONLY = {"standby-takeover", "long-batch"}  # Dask: no standby, no lease
SCENARIOS: dict[str, Callable[[System], dict[str, Any]]] = {
    "baseline": baseline,
    "worker-kill": worker_kill,
    "scheduler-kill": scheduler_kill,
    "killed-worker": killed_worker,
    "killed-worker-nannies": killed_worker_nannies,
    "standby-takeover": standby_takeover,
    "long-batch": long_batch,
}


# ------------------------------------------------------------------------ driver


@contextlib.contextmanager
def make(name: str, redis_url: str, logdir: Path, scenario: str) -> Iterator[System]:
    nanny = scenario.endswith("-nannies")
    lease_ttl = LONG_BATCH_LEASE_TTL if scenario == "long-batch" else None
    system: System = (
        RedisDask(redis_url, logdir, nanny, lease_ttl)
        if name == "redisdask"
        else Dask(logdir, nanny)
    )
    try:
        yield system
    finally:
        system.close()


def run(
    names: list[str], repeats: int, logdir: Path, only: list[str] | None = None
) -> dict[str, dict[str, list[Any]]]:
    from redisdask.deploy.embedded import EmbeddedRedis

    results: dict[str, dict[str, list[Any]]] = {}
    with EmbeddedRedis() as redis_server:
        for scenario, fn in SCENARIOS.items():
            if only and scenario not in only:
                continue
            for r in range(repeats):
                for name in names:  # interleaved, so drift in machine load hits both
                    if name != "redisdask" and scenario in REDISDASK_ONLY:
                        continue
                    print(f"[{name}] {scenario} #{r + 1} ...", file=sys.stderr, flush=True)
                    try:
                        with make(name, redis_server.url, logdir, scenario) as system:
                            outcome = fn(system)
                    except Exception as exc:
                        outcome = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                    print(f"[{name}] {scenario} #{r + 1}: {outcome}", file=sys.stderr, flush=True)
                    results.setdefault(name, {}).setdefault(scenario, []).append(outcome)
    return results


def _median(outcomes: list[dict[str, Any]], field: str) -> float | None:
    values = [o[field] for o in outcomes if o.get(field) is not None]
    return statistics.median(values) if values else None


ROWS = [  # scenario, field, label
    ("baseline", "total_s", "200 x 0.05 s tasks, no fault: total s"),
    ("worker-kill", "notice_s", "kill -9 of a worker: noticed after, s"),
    ("worker-kill", "total_s", "kill -9 of a worker: total s"),
    ("scheduler-kill", "total_s", "kill -9 of the scheduler + restart: total s"),
    ("killed-worker", "killed_worker_s", "task calling os._exit(1): KilledWorker after, s"),
    ("killed-worker-nannies", "killed_worker_s", "  same, workers under nannies, s"),
    ("standby-takeover", "takeover_s", "kill -9 of the scheduler, standby: lease taken, s"),
    ("standby-takeover", "new_task_s", "  a task submitted after the kill: result after, s"),
    ("long-batch", "total_s", "map of 200,000 tasks, 2 s lease: total s"),
]


def report(results: dict[str, dict[str, list[Any]]]) -> str:
    header = ("metric (median)", "redisdask", "dask", "dask/redisdask")
    rows = [header]
    for scenario, field, label in ROWS:
        a = _median(results.get("redisdask", {}).get(scenario, []), field)
        b = _median(results.get("dask", {}).get(scenario, []), field)
        ratio = f"{b / a:.2f}x" if a and b else "-"
        rows.append(
            (label, "-" if a is None else f"{a:.3f}", "-" if b is None else f"{b:.3f}", ratio)
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [
        "  ".join(
            [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        )
        for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for name, by_scenario in results.items():
        for scenario, outcomes in by_scenario.items():
            for o in outcomes:
                if "error" in o:
                    lines.append(f"ERROR [{name}] {scenario}: {o['error']}")
                elif o.get("kept_lease") is False:
                    lines.append(f"[{name}] {scenario}: the scheduler lost its lease")
                elif o.get("client_saw") not in (None, "every result"):
                    lines.append(f"[{name}] {scenario}: the client saw {o['client_saw']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="fresh clusters per scenario")
    parser.add_argument("--only", choices=["redisdask", "dask"], help="run one system")
    parser.add_argument("--json", metavar="PATH", help="also write every outcome here")
    parser.add_argument(
        "--scenario", action="append", choices=list(SCENARIOS), help="run only these"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    for noisy in ("distributed", "redisdask", "tornado", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    names = [args.only] if args.only else ["redisdask", "dask"]
    with tempfile.TemporaryDirectory(prefix="rd-bench-failures-") as tmp:
        results = run(names, args.repeats, Path(tmp), args.scenario)
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
