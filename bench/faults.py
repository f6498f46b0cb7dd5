"""Issue 22's faults, measured on redisdask alone (not a test): how long until work moves
again, and how many tasks run twice.  Each scenario starts a fresh cluster (and, where
it changes Redis, a Redis of its own); tasks record each run by appending their
argument to a file (not to Redis: a refusing Redis would lose the count):

* ``full-redis``: 200 tasks of 20 ms on 2 workers x 1 thread; once 50 ran, Redis is
  made full (``CONFIG SET maxmemory 1``) for ``--hold`` seconds, then given room again
  (``maxmemory 0``).  ``moved_s``: from the room to the next task the client hears
  finish; ``ran_refused``: tasks that ran while Redis refused; ``twice``: tasks that ran
  more than once; ``exited``: processes (scheduler, workers) that exited meanwhile;
* ``read-only``: the same with ``REPLICAOF`` a server that is not there (read-only, as a
  demoted primary), then ``REPLICAOF NO ONE``;
* ``stopped-holder``: the holder of ``x`` is SIGSTOPped; ``y = add(x, 1)`` is submitted;
  ``moved_s``: until ``y``'s result, with the defaults (the stopped worker's heartbeat
  lapses: ``scheduler.worker-ttl``, 3 s), and ``moved_deadline_s`` with the holder kept
  registered (``worker-ttl`` 120 s, as when only the link is cut) and
  ``comm.timeouts.tcp`` = ``--deadline``;
* ``exit-0``: under nannies (2 workers), ``submit(os._exit, 0)``: seconds to
  ``KilledWorker`` (default ``scheduler.allowed-failures``, 3: four deaths) and the
  workers registered after it;
* ``sigterm``: 12 tasks that hold a ``Semaphore(2)`` and submit a sub-task through
  ``get_client()``, on 2 nannied workers x 2 threads; one worker is SIGTERMed once the
  semaphore is full; ``total_s`` against ``baseline_s`` (the same, no signal), and
  ``twice`` (the guarded tasks that ran more than once);
* ``spill-disk`` (root: a 16 MiB tmpfs): one worker (200 MB limit, low marks) whose spill
  disk fills pauses; a second worker is started; ``moved_s``: from the pause until every
  result; ``after_join_s``: from the second worker's registration; ``twice``.

    python bench/faults.py [--repeats 3] [--scenario NAME ...] [--hold 3] [--deadline 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import redis

from redisdask import (
    Client,
    KilledWorker,
    LocalCluster,
    Semaphore,
    get_client,
    rejoin,
    secede,
    wait,
)
from redisdask.deploy.embedded import EmbeddedRedis
from redisdask.store.codecs import unpack
from redisdask.store.keyspace import Keys

MB = 1_000_000


# ---------------------------------------------------------------- task functions


def note(runs: str, i: int) -> None:
    """Append ``i`` to the file ``runs`` (one small O_APPEND write: atomic)."""
    fd = os.open(runs, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, f"{i}\n".encode())
    finally:
        os.close(fd)


def rec(i: int, runs: str, delay: float) -> int:
    note(runs, i)
    threading.Event().wait(delay)  # stands for the work
    return i


def inc(x: int) -> int:
    return x + 1


def add(a: int, b: int) -> int:
    return a + b


def quit_quietly() -> None:
    os._exit(0)


def guarded(i: int, name: str, runs: str) -> int:
    note(runs, i)
    with Semaphore(max_leases=2, name=name):
        threading.Event().wait(0.2)  # stands for work done while holding the lease
        sub = get_client().submit(inc, i, pure=False)
        threading.Event().wait(0.2)
    secede()
    value = sub.result(timeout=60)
    rejoin()
    return value * 10


def array(i: int, nbytes: int, runs: str) -> Any:
    import numpy as np

    note(runs, i)
    threading.Event().wait(0.05)
    return np.full(nbytes // 8, i, dtype="f8")


cloudpickle.register_pickle_by_value(__import__(__name__))


# ---------------------------------------------------------------------- helpers


def poll(condition: Callable[[], object], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout} s")
        time.sleep(0.005)


def counts(runs: Path) -> Counter[str]:
    return Counter(runs.read_text().split()) if runs.exists() else Counter()


def twice(runs: Path) -> int:
    return sum(n > 1 for n in counts(runs).values())


@contextlib.contextmanager
def env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workers(url: str, cluster: str) -> dict[str, dict[str, Any]]:
    r = redis.Redis.from_url(url)
    return {a.decode(): unpack(v) for a, v in r.hgetall(Keys(cluster).workers).items()}


# -------------------------------------------------------------------- scenarios


def refusal(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    n = 200
    with (
        EmbeddedRedis() as server,
        tempfile.TemporaryDirectory() as tmp,
        LocalCluster(nanny=False, n_workers=2, redis_url=server.url, cluster_name="f") as lc,
        Client(lc) as client,
    ):
        runs, r = Path(tmp) / "runs", server.client()
        futures = client.map(rec, range(n), runs=str(runs), delay=0.02, pure=False)
        poll(lambda: len(counts(runs)) >= n // 4)
        if kind == "full-redis":
            r.config_set("maxmemory", 1)
        else:
            r.execute_command("REPLICAOF", "127.0.0.1", closed_port())
        at_fault = len(counts(runs))
        time.sleep(args.hold)  # the fault's length, not a synchronisation
        heard = sum(f.done() for f in futures)
        ran_refused = len(counts(runs)) - at_fault
        if kind == "full-redis":
            r.config_set("maxmemory", 0)
        else:
            r.execute_command("REPLICAOF", "NO", "ONE")
        room = time.monotonic()
        poll(lambda: sum(f.done() for f in futures) > heard)
        moved = time.monotonic() - room
        assert client.gather(futures) == list(range(n))
        return {
            "moved_s": moved,
            "rest_s": time.monotonic() - room,
            "ran_refused": ran_refused,
            "twice": twice(runs),
            "exited": sum(p.poll() is not None for p in lc.subprocesses),
        }


def stopped_holder(args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for label, extra in (
        ("moved_s", {}),
        (
            "moved_deadline_s",
            {
                "REDISDASK__SCHEDULER__WORKER_TTL": "120",
                "REDISDASK__COMM__TIMEOUTS__TCP": str(args.deadline),
            },
        ),
    ):
        with (
            env(REDISDASK__WORKER__INLINE_RESULT_BYTES="0", **extra),
            EmbeddedRedis() as server,
            LocalCluster(nanny=False, n_workers=2, redis_url=server.url, cluster_name="f") as lc,
            Client(lc) as client,
        ):
            x = client.submit(inc, 41)
            assert x.result(timeout=20) == 42
            [holder] = client.who_has()[x.key]
            info = client.scheduler_info()["workers"]
            [other] = [w for w in info if w != holder]
            w = client.submit(inc, 1, workers=[holder])  # a pooled connection other -> holder
            assert client.submit(add, w, 0, workers=[other]).result(timeout=20) == 2
            os.kill(info[holder]["pid"], signal.SIGSTOP)
            try:
                start = time.monotonic()
                assert client.submit(add, x, 1).result(timeout=120) == 43
                out[label] = time.monotonic() - start
            finally:
                os.kill(info[holder]["pid"], signal.SIGCONT)
    return out


def exit_0(args: argparse.Namespace) -> dict[str, Any]:
    with (
        EmbeddedRedis() as server,
        LocalCluster(nanny=True, n_workers=2, redis_url=server.url, cluster_name="f"),
        Client(server.url, cluster_name="f") as client,
    ):
        start = time.monotonic()
        try:
            client.submit(quit_quietly).result(timeout=120)
        except KilledWorker:
            took = time.monotonic() - start
        else:
            raise AssertionError("no KilledWorker")
        poll(lambda: len(workers(server.url, "f")) == 2)
        back = time.monotonic() - start
        assert client.submit(inc, 1).result(timeout=30) == 2
        return {"killed_worker_s": took, "two_workers_again_s": back}


def sigterm(args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for label, stop in (("baseline_s", False), ("total_s", True)):
        with (
            EmbeddedRedis() as server,
            tempfile.TemporaryDirectory() as tmp,
            LocalCluster(
                nanny=True,
                n_workers=2,
                threads_per_worker=2,
                redis_url=server.url,
                cluster_name="f",
            ),
            Client(server.url, cluster_name="f") as client,
        ):
            runs = Path(tmp) / "runs"
            start = time.monotonic()
            futures = client.map(guarded, range(12), name="f-sem", runs=str(runs))
            if stop:
                pid = next(iter(workers(server.url, "f").values()))["pid"]
                poll(lambda: Semaphore(name="f-sem").get_value() == 2)
                os.kill(pid, signal.SIGTERM)
            assert client.gather(futures) == [10 * (i + 1) for i in range(12)]
            out[label] = time.monotonic() - start
            if stop:
                out["twice"] = twice(runs)
    return out


def spill_disk(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        disk = Path(tmp) / "disk"
        disk.mkdir()
        mount = ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)]
        if shutil.which("mount") is None or subprocess.run(mount, check=False).returncode:
            return {"skipped": "cannot mount a tmpfs (needs root)"}
        try:
            return _spill_disk(disk, Path(tmp))
        finally:
            subprocess.run(["umount", "-l", str(disk)], check=False)


def _spill_disk(disk: Path, tmp: Path) -> dict[str, Any]:
    marks = {f"REDISDASK__WORKER__MEMORY__{k}": v for k, v in
             {"TARGET": "0.1", "SPILL": "0.4", "PAUSE": "0.5"}.items()}  # fmt: skip
    runs = tmp / "runs"
    with (
        env(**marks),
        EmbeddedRedis() as server,
        LocalCluster(
            nanny=False,
            n_workers=1,
            redis_url=server.url,
            cluster_name="f",
            worker_options={"memory_limit": "200MB", "local_directory": str(disk)},
        ) as lc,
        Client(lc) as client,
    ):
        r = server.client()

        def paused() -> bool:
            beats = [unpack(v) for v in r.hgetall(Keys("f").heartbeats).values()]
            return any(b.get("status") == "paused" for b in beats)

        client.gather(client.map(inc, range(20)))
        futures = client.map(array, range(12), nbytes=8 * MB, runs=str(runs))
        poll(paused)
        paused_at = time.monotonic()
        lc.worker_options["local_directory"] = str(tmp / "roomy")
        lc.start_worker(name="worker-roomy")
        lc.wait_for_workers(2)
        joined = time.monotonic()
        wait(futures, timeout=120)
        done = time.monotonic()
        return {
            "moved_s": done - paused_at,
            "after_join_s": done - joined,
            "twice": twice(runs),
        }


SCENARIOS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "full-redis": lambda a: refusal("full-redis", a),
    "read-only": lambda a: refusal("read-only", a),
    "stopped-holder": stopped_holder,
    "exit-0": exit_0,
    "sigterm": sigterm,
    "spill-disk": spill_disk,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scenario", action="append", choices=list(SCENARIOS))
    parser.add_argument("--hold", type=float, default=3.0, help="seconds a refusal lasts")
    parser.add_argument("--deadline", type=float, default=2.0, help="comm.timeouts.tcp, s")
    args = parser.parse_args()
    print(f"load: {os.getloadavg()[0]:.1f} (1 min), {os.cpu_count()} cores")
    for name in args.scenario or list(SCENARIOS):
        runs = [SCENARIOS[name](args) for _ in range(args.repeats)]
        if "skipped" in runs[0]:
            print(f"{name:15} skipped: {runs[0]['skipped']}")
            continue
        figures = []
        for field in runs[0]:
            values = [run[field] for run in runs]
            each = ", ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in values)
            figures.append(f"{field} {statistics.median(values):.2f} ({each})")
        print(f"{name:15} " + "; ".join(figures), flush=True)


if __name__ == "__main__":
    main()
