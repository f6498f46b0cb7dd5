"""A worker whose spill disk is full, for real: a tmpfs of a few MiB as its local
directory.  It tells the client (a warning naming the worker and the error) and
``redisdask status``; it hands back what it claimed and has not started, so other
workers run it; under a nanny, its death for memory names the full disk, and the next
worker starts on a clean directory."""

from __future__ import annotations

import io
import logging
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from conftest import ClusterFactory
from polling import poll
from rich.console import Console
from tasklib import allocate_forever

from redisdask import Client, KilledWorker, wait
from redisdask.nanny.deaths import WorkerExit, classify
from redisdask.observe.snapshot import read_snapshot
from redisdask.observe.views import status_view
from redisdask.store.codecs import unpack
from redisdask.store.eventlog import describe
from redisdask.store.keyspace import Keys

pytestmark = pytest.mark.timeout(120)

MB = 1_000_000
NO_SPACE = "No space left on device"


def inc(x: int) -> int:
    return x + 1


def array(i: int, nbytes: int) -> np.ndarray:
    """A result of ``nbytes``, computed in 50 ms (so that a worker claims them one or two
    at a time once it has run some)."""
    import numpy as np

    threading.Event().wait(0.05)  # stands for the work that makes it
    return np.full(nbytes // 8, i, dtype="f8")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs: two 8 MB results fit, the third does not (ENOSPC, even for root)."""
    where = tmp_path / "small-disk"
    where.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("cannot mount a tmpfs here: no mount command")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture(params=["tmpfs", "not-a-directory"])
def failing_disk(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, str]:
    """A local directory whose spills fail for real, and the error they fail with: a full
    tmpfs (where the machine lets a test mount one), or, anywhere, a spill directory that
    ``break_spill_directory`` replaces with a file once the worker made it."""
    if request.param == "tmpfs":
        return request.getfixturevalue("small_disk"), NO_SPACE
    return tmp_path / "local", "Not a directory"


def break_spill_directory(local: Path) -> None:
    [directory] = spill_directories(local / "redisdask-worker-space")
    shutil.rmtree(directory)
    directory.write_bytes(b"")  # a file where the worker writes its spilled results


@pytest.fixture
def low_marks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Marks low enough for a 200 MB limit over a ~70 MB process: spill past 20 MB of
    results, pause past 100 MB of process memory (the worker processes read these)."""
    for mark, value in {"target": "0.1", "spill": "0.4", "pause": "0.5"}.items():
        monkeypatch.setenv(f"REDISDASK__WORKER__MEMORY__{mark.upper()}", value)


def heartbeats(redis_url: str, cluster_name: str) -> dict[str, dict]:
    r = redis.Redis.from_url(redis_url)
    return {a.decode(): unpack(v) for a, v in r.hgetall(Keys(cluster_name).heartbeats).items()}


def told(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The client's warnings of a worker that cannot spill."""
    return [r.getMessage() for r in caplog.records if "cannot spill" in r.getMessage()]


def spill_directories(space: Path) -> list[Path]:
    return [p for p in space.glob("worker-*") if p.is_dir()]  # (not the nanny's log)


def status_text(redis_url: str, cluster_name: str) -> str:
    """What ``redisdask status`` prints, on one line (long lines wrap)."""
    console = Console(file=io.StringIO(), width=200, color_system=None)
    snap = read_snapshot(redis.Redis.from_url(redis_url), Keys(cluster_name))
    console.print(status_view(snap, redis_url, width=200))
    return " ".join(console.file.getvalue().split())  # type: ignore[attr-defined]


def test_a_worker_that_cannot_spill_says_so_and_its_claimed_tasks_run_elsewhere(
    redis_url: str,
    cluster_name: str,
    failing_disk: tuple[Path, str],
    tmp_path: Path,
    low_marks: None,
    caplog: pytest.LogCaptureFixture,
    make_cluster: ClusterFactory,
) -> None:
    local, error = failing_disk
    caplog.set_level(logging.WARNING, logger="redisdask.client")
    with (
        make_cluster(
            nanny=False,
            n_workers=1,
            worker_options={"memory_limit": "200MB", "local_directory": str(local)},
        ) as cluster,
        Client(cluster) as client,
    ):
        [full] = heartbeats(redis_url, cluster_name)
        if error != NO_SPACE:
            break_spill_directory(local)
        assert client.gather(client.map(inc, range(20))) == list(range(1, 21))  # short tasks:
        # the worker claims the next ones all at once, and starts them one by one
        futures = client.map(array, range(12), nbytes=8 * MB)
        poll(lambda: heartbeats(redis_url, cluster_name)[full].get("status") == "paused")
        paused_at = time.monotonic()
        beat = heartbeats(redis_url, cluster_name)[full]
        assert beat["spill_error"] == error
        assert sum(f.status == "finished" for f in futures) < 12  # the rest wait for a worker
        # another worker, with room on its disk, runs what the full one claimed
        cluster.worker_options["local_directory"] = str(tmp_path / "roomy")
        cluster.start_worker(name="worker-roomy")
        cluster.wait_for_workers(2)
        started = time.monotonic() - paused_at
        wait(futures, timeout=60)
        moved = time.monotonic() - paused_at
        for i, value in enumerate(client.gather(futures)):  # from both, peer to peer
            assert value[0] == i and value.shape == (MB,)
        poll(lambda: told(caplog))  # (the client looks at every heartbeat: 2 s)
        warnings = told(caplog)
        assert full in warnings[0] and error in warnings[0] and str(local) in warnings[0]
        shown = status_text(redis_url, cluster_name)
        assert f"cannot spill: {error}" in shown and "results held in memory" in shown
        print(f"the client saw: {warnings[0]}")
        print(f"all results {moved:.1f} s after the pause, {moved - started:.1f} s after the")
        print(f"second worker registered ({started:.1f} s after the pause)")


def test_under_a_nanny_the_death_names_the_full_disk_and_the_next_worker_starts_clean(
    redis_url: str,
    cluster_name: str,
    small_disk: Path,
    low_marks: None,
    make_cluster: ClusterFactory,
) -> None:
    start = small_disk / "leak-now"
    with (
        make_cluster(
            nanny=True,
            n_workers=1,
            threads_per_worker=2,
            worker_options={"memory_limit": "200MB", "local_directory": str(small_disk)},
            scheduler_options={"allowed_failures": 0},
        ) as cluster,
        Client(cluster) as client,
    ):
        [first] = heartbeats(redis_url, cluster_name)
        leak = client.submit(allocate_forever, 4 * MB, str(start))  # waits for the file
        futures = client.map(array, range(6), nbytes=8 * MB)  # two spill, then no space
        poll(lambda: heartbeats(redis_url, cluster_name)[first].get("spill_error") == NO_SPACE)
        space = small_disk / "redisdask-worker-space"
        [spill_dir] = spill_directories(space)
        assert shutil.disk_usage(small_disk).free < 8 * MB  # full of what it spilled
        del futures  # (released: nothing to compute again on the next worker)
        start.touch()  # the leak drives the worker past the nanny's 95% mark
        with pytest.raises(KilledWorker, match=f"could not spill: {NO_SPACE}") as info:
            leak.result(timeout=60)
        print(f"KilledWorker: {info.value}")
        poll(lambda: set(heartbeats(redis_url, cluster_name)) - {first}, timeout=30)
        assert shutil.disk_usage(small_disk).used < 2 * MB  # (the nanny's log is there)
        [fresh_dir] = spill_directories(space)
        assert fresh_dir != spill_dir
        assert client.submit(inc, 1).result(timeout=30) == 2
        assert cluster.worker_processes[0].poll() is None


def test_the_death_and_the_event_of_a_worker_that_cannot_spill_say_so() -> None:
    exit = WorkerExit(-9, "memory", 190 * MB, 200 * MB, terminate=0.95, spill_error=NO_SPACE)
    kind, reason = classify(exit)
    assert kind == "memory" and reason.endswith(f"terminate mark; could not spill: {NO_SPACE}")
    assert classify(WorkerExit(-11, spill_error=NO_SPACE))[1].count("spill") == 0  # a crash
    event = {"kind": "spill-failed", "worker": "tcp://h:1", "name": "w1", "error": NO_SPACE,
             "directory": "/d/worker-x", "managed": 150 * MB, "spilled": 0, "rss": 190 * MB,
             "memory_limit": 200 * MB, "paused": True}  # fmt: skip
    assert describe(event) == (
        "worker w1 (tcp://h:1) cannot spill to /d/worker-x: No space left on device; 143.05 "
        "MiB of results held in memory, process 181.20 MiB of its 190.73 MiB limit (paused: "
        "it starts nothing, and what it claimed went back to the queue); free disk space "
        "there or give the worker another --local-directory"
    )
