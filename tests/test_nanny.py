"""Nannies and memory, for real: workers under nannies killed for memory, crashing with
an exit code or a segfault, killed with SIGKILL, spilling to disk, pausing, stopped with
SIGTERM, restarted at the end of their lifetime.  Plus the pure death classification."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import redis
from conftest import ClusterFactory
from polling import poll
from tasklib import allocate_forever

from redisdask import Client, KilledWorker
from redisdask.nanny.deaths import WorkerExit, classify
from redisdask.nanny.output import OutputLines
from redisdask.store.codecs import unpack
from redisdask.store.keyspace import Keys

pytestmark = pytest.mark.timeout(120)

MB = 1_000_000


def inc(x: int) -> int:
    return x + 1


def crash(code: int) -> None:
    print("x" * 70_000, flush=True)  # a line longer than any line buffer
    os._exit(code)


def segfault() -> None:
    import ctypes

    ctypes.string_at(0)


def hog(nbytes: int, seconds: float) -> int:
    """Hold ``nbytes`` of resident memory for ``seconds``, then return."""
    block = b"\x01" * nbytes
    threading.Event().wait(seconds)  # stands for work done while holding the memory
    return len(block)


def array(i: int, nbytes: int):  # type: ignore[no-untyped-def]
    import numpy as np

    return np.full(nbytes // 8, i, dtype="f8")


def deaths(redis_url: str, cluster_name: str) -> list[dict]:
    r = redis.Redis.from_url(redis_url)
    return [unpack(f[b"m"]) for _id, f in r.xrange(Keys(cluster_name).deaths)]


def workers_of(redis_url: str, cluster_name: str) -> dict[str, dict]:
    r = redis.Redis.from_url(redis_url)
    return {a.decode(): unpack(v) for a, v in r.hgetall(Keys(cluster_name).workers).items()}


def heartbeat(redis_url: str, cluster_name: str, address: str) -> dict:
    raw = redis.Redis.from_url(redis_url).hget(Keys(cluster_name).heartbeats, address)
    return unpack(raw) if raw else {}


# --------------------------------------------------------------------------- classify


def test_each_kind_of_death_is_named_with_its_evidence() -> None:
    limit = 300 * MB
    kind, reason = classify(WorkerExit(-9, "memory", 290 * MB, limit, terminate=0.95))
    assert kind == "memory" and "killed by its nanny" in reason and "95% terminate" in reason
    assert "97% of its" in reason
    assert classify(WorkerExit(-9, "hung", silent_for=12.0))[1].startswith(
        "hung: no heartbeat for 12.0 s"
    )
    assert classify(WorkerExit(0, exit_reason="retired")) == ("graceful", "closed: retired")
    kind, reason = classify(WorkerExit(-11, rss=50 * MB, memory_limit=limit))
    assert kind == "signal" and "SIGSEGV" in reason and "segmentation fault" in reason
    kind, reason = classify(WorkerExit(-9, rss=50 * MB, oom_kills_before=2, oom_kills_after=3))
    assert kind == "memory" and "OOM killer" in reason and "2 -> 3" in reason
    kind, reason = classify(WorkerExit(-9, rss=280 * MB, memory_limit=limit))
    assert kind == "memory" and "most likely the kernel's OOM killer" in reason
    assert classify(WorkerExit(-9, rss=50 * MB, memory_limit=limit))[0] == "signal"
    tail = ["x", "Traceback (most recent call last):", '  File "w.py"', "ValueError: boom"]
    kind, reason = classify(WorkerExit(1, log_tail=tail))
    assert kind == "exception" and reason.endswith("ValueError: boom")
    assert classify(WorkerExit(3)) == ("exit-code", "exited with code 3; memory unknown")


# --------------------------------------------------------------------------- real nannies


def test_crashes_are_recorded_with_exit_code_or_signal_and_the_worker_comes_back(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    with (
        make_cluster(
            n_workers=1,
            nanny=True,
            scheduler_options={"allowed_failures": 0},
        ) as cluster,
        Client(cluster) as client,
    ):
        with pytest.raises(KilledWorker, match="exited with code 3"):
            client.submit(crash, 3).result(timeout=30)
        with pytest.raises(KilledWorker, match="SIGSEGV"):
            client.submit(segfault).result(timeout=30)
        poll(lambda: len(workers_of(redis_url, cluster_name)) == 1)  # restarted each time
        [address] = workers_of(redis_url, cluster_name)
        pid = workers_of(redis_url, cluster_name)[address]["pid"]
        os.kill(pid, signal.SIGKILL)  # the worker, not its nanny
        poll(lambda: len(deaths(redis_url, cluster_name)) == 3, timeout=20)
        assert client.submit(inc, 1).result(timeout=30) == 2  # work continues
        exit_code, segv, killed = deaths(redis_url, cluster_name)
        assert exit_code["how"] == "nanny" and exit_code["kind"] == "exit-code"
        assert exit_code["evidence"]["exit_code"] == 3 and exit_code["evidence"]["restarted"]
        assert segv["kind"] == "signal" and segv["evidence"]["signal"] == "SIGSEGV"
        tail = "\n".join(segv["evidence"]["log_tail"])
        assert "Segmentation fault" in tail and "in segfault" in tail  # where, from faulthandler
        assert killed["kind"] == "signal" and killed["evidence"]["signal"] == "SIGKILL"
        assert killed["pid"] == pid
        assert cluster.worker_processes[0].poll() is None  # the nanny lives on


def test_a_task_past_the_memory_limit_is_killed_by_the_nanny_and_named_in_killed_worker(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    with (
        make_cluster(
            n_workers=1,
            nanny=True,
            worker_options={"memory_limit": "300MB"},
            scheduler_options={"allowed_failures": 1},
        ) as cluster,
        Client(cluster) as client,
    ):
        killed_at = time.monotonic()
        with pytest.raises(KilledWorker) as info:
            client.submit(allocate_forever, 20 * MB).result(timeout=60)
        message = str(info.value)
        assert message.count("killed by its nanny") == 2, message
        assert "past the 95% terminate mark" in message and "of its 286.10 MiB limit" in message
        records = deaths(redis_url, cluster_name)
        assert [d["kind"] for d in records] == ["memory", "memory"]
        for record in records:
            evidence = record["evidence"]
            assert evidence["rss"] > 0.95 * 300 * MB and evidence["memory_limit"] == 300 * MB
            assert evidence["restarted"] is True
        poll(lambda: len(workers_of(redis_url, cluster_name)) == 1, timeout=20)
        print(f"two memory deaths and KilledWorker in {time.monotonic() - killed_at:.1f} s")
        assert client.submit(inc, 1).result(timeout=30) == 2
        assert cluster.worker_processes[0].poll() is None


def test_results_past_target_spill_to_disk_and_come_back(
    redis_url: str, cluster_name: str, tmp_path: Path, make_cluster: ClusterFactory
) -> None:
    with (
        make_cluster(
            nanny=False,
            n_workers=1,
            worker_options={"memory_limit": "400MB", "local_directory": str(tmp_path)},
        ) as cluster,
        Client(cluster) as client,
    ):
        futures = [client.submit(array, i, 40 * MB) for i in range(10)]  # 400 MB > 240 target
        client.gather(futures[:1])
        [address] = workers_of(redis_url, cluster_name)
        poll(lambda: heartbeat(redis_url, cluster_name, address).get("spilled", 0) > 100 * MB)
        space = tmp_path / "redisdask-worker-space"
        files = [p for p in space.rglob("*") if p.is_file() and p.parent != space]
        assert len(files) >= 3, files  # the least recently used went to disk
        beat = heartbeat(redis_url, cluster_name, address)
        assert beat["managed"] <= 240 * MB and beat["memory_limit"] == 400 * MB
        for i, value in enumerate(client.gather(futures)):  # read back, peer to peer
            assert value.shape == (5 * MB,) and value[0] == i and value[-1] == i
        assert client.submit(sum, [1, 2]).result() == 3
    assert not list(space.glob("worker-*"))  # removed when the worker closed


def test_memory_pressure_pauses_the_thread_pool_until_it_passes(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    with (
        make_cluster(
            nanny=False,
            n_workers=1,
            threads_per_worker=2,
            worker_options={"memory_limit": "400MB"},
        ) as cluster,
        Client(cluster) as client,
    ):
        [address] = workers_of(redis_url, cluster_name)
        holding = client.submit(hog, 340 * MB, 3.0)  # 85% of the limit for 3 s
        poll(lambda: heartbeat(redis_url, cluster_name, address).get("status") == "paused")
        paused_at = time.time()
        waiting = client.submit(time.time, pure=False)  # a free thread, but paused
        assert holding.result(timeout=30) == 340 * MB
        started = waiting.result(timeout=30)
        assert started > paused_at + 1.0  # it did not run while the worker was paused
        poll(lambda: heartbeat(redis_url, cluster_name, address).get("status") == "running")
        assert cluster.worker_processes[0].poll() is None


def test_sigterm_stops_nanny_and_worker_gracefully_with_no_orphan(
    redis_url: str, cluster_name: str, tmp_path: Path, make_cluster: ClusterFactory
) -> None:
    cluster = make_cluster(
        n_workers=2,
        nanny=True,
        log_directory=tmp_path,
    )
    try:
        with Client(cluster) as client:
            future = client.submit(inc, 41, workers=None)
            assert future.result(timeout=30) == 42
            holder = client.who_has([future])[future.key][0]
            nanny = next(
                p
                for p in cluster.worker_processes
                if psutil.Process(p.pid).children()[0].pid
                == workers_of(redis_url, cluster_name)[holder]["pid"]
            )
            children = psutil.Process(nanny.pid).children(recursive=True)
            nanny.send_signal(signal.SIGTERM)
            assert nanny.wait(30) == 0
            assert not [c for c in children if c.is_running() and c.status() != "zombie"]
            assert holder not in workers_of(redis_url, cluster_name)
            assert future.result() == 42  # its data went to the other worker first
            assert client.who_has([future])[future.key] != [holder]
    finally:
        cluster.close()
    log = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.log"))
    assert "End worker" in log and "signal SIGTERM" in log
    [graceful] = [d for d in deaths(redis_url, cluster_name) if d["worker"] == holder]
    assert graceful["kind"] == "graceful" and graceful["reason"].startswith(
        "closed: signal SIGTERM"
    )


def counted_inc(x: int, url: str, counter: str) -> int:
    redis.Redis.from_url(url).incr(counter)
    return x + 1


def test_a_worker_reaching_its_lifetime_is_replaced_without_losing_a_result(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    env = dict(os.environ, REDISDASK__REDIS__URL=redis_url, REDISDASK__LOGGING__LEVEL="WARNING")
    with (
        make_cluster(
            n_workers=1,
            nanny=True,
            worker_options={"lifetime": "4s", "lifetime_restart": True},
        ) as cluster,
        Client(cluster) as client,
    ):
        [(mortal, info)] = workers_of(redis_url, cluster_name).items()
        steady = subprocess.Popen(  # a worker without a lifetime, to take the data
            [sys.executable, "-m", "redisdask", "worker", "--cluster", cluster_name, "--no-nanny"],
            env=env,
        )
        try:
            poll(lambda: len(workers_of(redis_url, cluster_name)) == 2)
            counter = f"{cluster_name}-runs"
            futures = client.map(counted_inc, range(40), url=redis_url, counter=counter)
            assert client.gather(futures) == list(range(1, 41))
            assert any(mortal in h for h in client.who_has(futures).values())

            def replaced() -> bool:
                now = workers_of(redis_url, cluster_name)
                return len(now) == 2 and all(w["started"] != info["started"] for w in now.values())

            poll(replaced, timeout=40)
            assert client.gather(futures) == list(range(1, 41))
            assert int(redis.Redis.from_url(redis_url).get(counter)) == 40  # none recomputed
            [record] = deaths(redis_url, cluster_name)
            assert (
                record["kind"] == "graceful" and record["reason"] == "closed: lifetime; restarted"
            )
            assert cluster.worker_processes[0].poll() is None  # the same nanny
        finally:
            steady.terminate()
            steady.wait(30)


def test_a_worker_that_cannot_start_is_given_up_on_with_a_clear_message(
    redis_url: str, cluster_name: str
) -> None:
    """The worker cannot serve on its port (another process holds it): it dies at start-up
    every time, and its nanny gives up after three tries, saying why."""
    env = dict(os.environ, REDISDASK__REDIS__URL=redis_url)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        proc = subprocess.run(
            [sys.executable, "-m", "redisdask", "worker", "--cluster", cluster_name,
             "--port", port],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )  # fmt: skip
    assert proc.returncode == 1
    assert "died 3 times in a row before it could register" in proc.stderr
    records = deaths(redis_url, cluster_name)
    assert len(records) == 3 and all(d["kind"] == "exception" for d in records)
    assert "OSError" in records[0]["evidence"]["traceback"]


def test_restart_replaces_the_worker_processes_under_nannies(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    with (
        make_cluster(n_workers=2, nanny=True),
        Client(redis_url, cluster_name=cluster_name) as client,
    ):
        future = client.submit(inc, 1)
        assert future.result(timeout=30) == 2
        pids = {w["pid"] for w in workers_of(redis_url, cluster_name).values()}
        client.restart(timeout=60)  # returns once the new processes registered
        now = workers_of(redis_url, cluster_name)
        assert len(now) == 2 and not pids & {w["pid"] for w in now.values()}
        assert future.status == "cancelled"
        assert client.submit(inc, 10).result(timeout=30) == 11
        assert {d["reason"] for d in deaths(redis_url, cluster_name)} == {
            "closed: restart; restarted"
        }


def test_a_hung_worker_is_killed_and_restarted_by_its_nanny(
    redis_url: str, cluster_name: str, monkeypatch: pytest.MonkeyPatch, make_cluster: ClusterFactory
) -> None:
    monkeypatch.setenv("REDISDASK__WORKER__HANG_TIMEOUT", "2")
    with (
        make_cluster(n_workers=1, nanny=True),
        Client(redis_url, cluster_name=cluster_name) as client,
    ):
        [info] = workers_of(redis_url, cluster_name).values()
        os.kill(info["pid"], signal.SIGSTOP)  # alive, silent, idle
        poll(lambda: any(d["kind"] == "hung" for d in deaths(redis_url, cluster_name)), 30)
        [hung] = [d for d in deaths(redis_url, cluster_name) if d["kind"] == "hung"]
        assert hung["reason"].startswith("hung: no heartbeat for") and hung["pid"] == info["pid"]
        assert (
            not psutil.pid_exists(info["pid"]) or psutil.Process(info["pid"]).status() == "zombie"
        )
        assert client.submit(inc, 1).result(timeout=30) == 2  # a fresh worker took over


STALL_PRELOAD = """
import asyncio, os
from pathlib import Path

FLAG = Path({flag!r})


def dask_setup(worker):
    register = worker._register

    async def register_then_stall(*args, **kwargs):
        await register(*args, **kwargs)
        if FLAG.exists():  # registered, and stalled before its start ends: to be killed
            FLAG.write_text(str(os.getpid()))
            await asyncio.sleep(3600)

    worker._register = register_then_stall
"""


def test_a_worker_killed_just_after_it_registered_is_named_to_the_scheduler(
    redis_url: str, cluster_name: str, tmp_path: Path, make_cluster: ClusterFactory
) -> None:
    """Killed between its registration and the rest of its start: its nanny names it to
    the scheduler, which removes it with the death's record.  Before, the worker told its
    nanny its address only once started, so the nanny recorded the death of a worker "not
    registered" and the scheduler went on pushing tasks to the dead worker until its
    watch noticed, blaming the first of them for the death (``KilledWorker``: CI's
    ``test_crashes_are_recorded_with_exit_code_or_signal_and_the_worker_comes_back``)."""
    flag = tmp_path / "stall"
    preload = tmp_path / "stall_preload.py"
    preload.write_text(STALL_PRELOAD.format(flag=str(flag)))
    with (
        make_cluster(
            n_workers=1,
            nanny=True,
            worker_options={"preload": [str(preload)]},
            scheduler_options={"allowed_failures": 0},
        ) as cluster,
        Client(cluster) as client,
    ):
        assert client.submit(inc, 0).result(timeout=30) == 1
        [(first, info)] = workers_of(redis_url, cluster_name).items()
        flag.write_text("")
        os.kill(info["pid"], signal.SIGKILL)  # its nanny starts the next, which stalls
        poll(lambda: flag.read_text().isdigit(), timeout=30)
        stalled_pid = int(flag.read_text())
        [stalled] = [
            a for a, i in workers_of(redis_url, cluster_name).items() if i["pid"] == stalled_pid
        ]
        flag.unlink()  # the one after it starts whole
        os.kill(stalled_pid, signal.SIGKILL)
        poll(lambda: stalled in {d["worker"] for d in deaths(redis_url, cluster_name)})
        [death] = [d for d in deaths(redis_url, cluster_name) if d["worker"] == stalled]
        assert death["how"] == "nanny" and death["evidence"]["signal"] == "SIGKILL"
        assert stalled not in workers_of(redis_url, cluster_name)  # removed with its death
        assert client.submit(inc, 1).result(timeout=30) == 2  # not pushed to the dead one
        assert first != stalled and cluster.worker_processes[0].poll() is None


def test_the_lines_of_a_logged_traceback_belong_to_its_record_not_to_the_output() -> None:
    lines = OutputLines()
    worker_output = [
        ("2026-11-28 12:00:00,000 ERROR   worker w[1] user: caught", False),
        ("Traceback (most recent call last):", False),
        ('  File "t.py", line 1, in f', False),
        ("    raise KeyError(1)", False),
        ("KeyError: 1", False),
        ("", False),
        ("During handling of the above exception, another exception occurred:", False),
        ("", False),
        ("Traceback (most recent call last):", False),
        ('  File "t.py", line 3, in f', False),
        ("ValueError: 2", False),
        ("printed by a task", True),
        ("Traceback (most recent call last):", True),  # printed, not logged: output
        ('  File "t.py", line 1, in g', True),
        ('{"time": "2026-11-28T12:00:00", "level": "INFO"}', False),
        ("Traceback (most recent call last):", True),  # a JSON record holds its own
        ("Fatal Python error: Segmentation fault", True),
    ]
    assert [lines.is_output(line) for line, _ in worker_output] == [o for _, o in worker_output]
