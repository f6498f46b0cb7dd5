"""``redisdask status`` and ``monitor`` against real clusters: what they draw, that they
only read (they run as a Redis user that may not write), and the retention caps that keep
the event and story streams bounded."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis
from conftest import ClusterFactory
from polling import poll
from rich.console import Console
from tasklib import wait_for_file

from redisdask import Client, LocalCluster, progress
from redisdask.observe.inspect import read_deaths
from redisdask.observe.snapshot import SNAPSHOT_COMMANDS, read_snapshot
from redisdask.observe.views import dashboard, status_view
from redisdask.store.bootstrap import ensure_cluster
from redisdask.store.connection import connect
from redisdask.store.keyspace import Keys

pytestmark = pytest.mark.timeout(120)


def inc(x: int) -> int:
    return x + 1


def render(renderable: object, width: int) -> str:
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.export_text()


def test_status_and_monitor_frames_show_workers_memory_progress_and_a_death(
    read_only_url: str,
    cluster_name: str,
    tmp_path: Path,
    make_cluster: ClusterFactory,
) -> None:
    release = str(tmp_path / "release")
    with (
        make_cluster(
            nanny=False,
            n_workers=3,
            threads_per_worker=2,  # one stays free while a task waits for the file
            worker_options={"memory_limit": "1GB"},
        ) as cluster,
        Client(cluster) as client,
    ):
        incs = client.map(inc, range(40))
        total = client.submit(sum, incs)
        assert total.result(timeout=30) == sum(range(1, 41))
        survivor = client.scheduler_info()["workers"]
        by_name = {info["name"]: address for address, info in survivor.items()}
        blocked = client.submit(wait_for_file, release, workers=[by_name["worker-0"]])
        cluster.worker_processes[2].kill()  # kill -9 worker-2
        keys = Keys(cluster_name)
        poll(lambda: read_deaths(cluster.redis, keys), timeout=30)
        r = connect(read_only_url)
        # (worker-2's results are recomputed on the others: the futures still want them)
        expected = {"memory": 41, "processing": 1}
        poll(lambda: read_snapshot(r, keys).states == expected, timeout=30)
        snap = read_snapshot(r, keys)
        status = render(status_view(snap, "redis://example:6379/0"), 150)
        frame = render(dashboard(snap, "redis://example:6379/0", 150, 60), 150)
        (tmp_path / "release").touch()
        assert blocked.result(timeout=30) == release
    r.close()

    assert f"cluster {cluster_name}" in status
    assert "scheduler scheduler-" in status and "lease" in status
    worker_rows = [line for line in status.splitlines() if "running" in line]
    assert {"worker-0", "worker-1"} <= {w for line in worker_rows for w in line.split()}
    assert not any("worker-2" in line for line in worker_rows)  # dead: gone from the table
    assert all("/0.93 GiB" in line for line in worker_rows)  # usage against the 1 GB limit
    # the target, spill and pause marks; no terminate mark: no nanny watches these workers
    assert all("┆" in row and "┊" in row and "╏" in row for row in worker_rows)
    assert not any("║" in row for row in worker_rows)
    inc_row = next(line for line in status.splitlines() if line.startswith("│ inc "))
    assert [c.strip() for c in inc_row.split("│")[3:7]] == ["0", "0", "40", "0"]  # w/p/m/e
    assert any(line.startswith("│ sum ") for line in status.splitlines())
    wait_row = next(line for line in status.splitlines() if line.startswith("│ wait_for_file"))
    assert wait_row.split("│")[4].strip() == "1", wait_row  # processing
    assert "worker-2" in status and "its Redis connections closed" in status  # the death

    assert "finished/s" in frame and "q or Ctrl-C quits" in frame
    assert "worker worker-2 died (connection)" in frame  # the event log
    assert "worker worker-0 joined" in frame
    assert "█" in frame  # progress bars

    narrow = render(dashboard(snap, "redis://example:6379/0", 70, 30), 70)
    assert "worker-0" in narrow and "host" not in narrow  # columns dropped, rows kept
    assert max(len(line) for line in narrow.splitlines()) <= 70


def test_status_json_and_waiting_for_a_scheduler(read_only_url: str, cluster_name: str) -> None:
    r = connect(read_only_url)
    snap = read_snapshot(r, Keys(cluster_name))  # nothing exists yet
    r.close()
    assert not snap.has_scheduler and snap.workers == []
    assert "waiting for a scheduler on redis://h:1/0" in render(
        dashboard(snap, "redis://h:1/0"), 100
    )
    result = subprocess.run(
        [sys.executable, "-m", "redisdask", "status", read_only_url, "--cluster", cluster_name,
         "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1  # no such cluster (yet): said, and not a success
    assert f"no cluster named {cluster_name!r}" in result.stderr
    data = json.loads(result.stdout)
    assert data["cluster"] == cluster_name and data["has_scheduler"] is False
    assert data["exists"] is False
    assert data["workers"] == [] and len(data["finished"]) == 60


def test_status_json_of_a_running_cluster(
    read_only_url: str, cluster: LocalCluster, client: Client
) -> None:
    incs = client.map(inc, range(30))  # held: their results stay in memory
    assert sum(client.gather(incs)) == sum(range(1, 31))
    bad = client.submit(divide, 0)
    assert isinstance(bad.exception(timeout=30), ZeroDivisionError)
    r = connect(cluster.redis_url)
    poll(lambda: r.hget(cluster.keys.summary, "erred_total") == b"1")
    # the current second is not shown until it is over
    poll(lambda: sum(read_snapshot(r, cluster.keys).finished) == 30, timeout=5)
    r.close()
    result = subprocess.run(
        [sys.executable, "-m", "redisdask", "status", read_only_url, "--cluster",
         cluster.cluster_name, "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["has_scheduler"] and data["scheduler"]["id"].startswith("scheduler-")
    assert sorted(w["name"] for w in data["workers"]) == ["worker-0", "worker-1"]
    assert all(w["status"] == "running" and w["rss"] > 0 for w in data["workers"])
    assert data["states"] == {"memory": 30, "erred": 1}
    assert data["finished_total"] == 30 and data["erred_total"] == 1
    assert sum(data["finished"]) == 30  # all within the last minute
    assert [p["prefix"] for p in data["prefixes"]] == ["divide", "inc"]


def test_one_snapshot_is_one_round_trip_of_a_few_reads(tmp_path: Path, cluster_name: str) -> None:
    """The Redis cost of a monitor frame, measured: commands per snapshot (on a Redis of
    its own: INFO commandstats counts every client's commands)."""
    from redisdask.deploy.embedded import EmbeddedRedis

    with EmbeddedRedis(data_dir=tmp_path) as server:
        r = redis.Redis.from_url(server.url)
        keys = Keys(cluster_name)
        ensure_cluster(r, keys)  # (a cluster that does not exist costs a SCAN more)

        def calls() -> int:
            return sum(v["calls"] for v in r.info("commandstats").values())

        before = calls()
        for _ in range(10):
            read_snapshot(r, keys)
        per_snapshot = (calls() - before - 1) / 10  # (the INFO commandstats of calls())
        assert per_snapshot == SNAPSHOT_COMMANDS
        r.close()


# --------------------------------------------------------------------------- the real monitor


@contextlib.contextmanager
def monitor_in_a_terminal(url: str, cluster: str) -> Iterator[tuple[int, int]]:
    """``redisdask monitor`` in a pseudo-terminal of 120x40 (its controlling terminal):
    ``(pid, fd)``; the child is killed and the terminal closed on the way out."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: become the monitor
        _interruptible()
        os.environ.update(COLUMNS="120", LINES="40", TERM="xterm-256color")
        os.execv(
            sys.executable,
            [sys.executable, "-m", "redisdask", "monitor", url, "--cluster", cluster],
        )
    try:
        yield pid, fd
    finally:
        os.close(fd)
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _interruptible() -> None:
    """SIGINT as a terminal's user has it, even where this suite was started with it
    ignored (a non-interactive shell's background job: its children inherit that, and
    Python then installs no KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _read_until(fd: int, needle: bytes, timeout: float = 30.0) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while needle not in out:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"{needle!r} not drawn within {timeout} s; got {out[-2000:]!r}"
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            try:
                out += os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
    return out


def _exit_code(pid: int, timeout: float = 15.0) -> int:
    status: list[int] = []

    def exited() -> bool:
        done, code = os.waitpid(pid, os.WNOHANG)
        if done:
            status.append(os.waitstatus_to_exitcode(code))
        return bool(done)

    poll(exited, timeout)
    return status[0]


def test_monitor_draws_a_live_cluster_in_a_terminal_and_quits_on_q(
    read_only_url: str, cluster: LocalCluster, client: Client
) -> None:
    assert client.submit(inc, 1).result(timeout=30) == 2
    with monitor_in_a_terminal(read_only_url, cluster.cluster_name) as (pid, fd):
        drawn = _read_until(fd, b"worker-1")
        _read_until(fd, b"finished/s")
        assert b"\x1b[?1049h" in drawn  # the alternate screen: full-screen, restored at exit
        os.write(fd, b"q")
        assert _exit_code(pid) == 0


def test_monitor_waits_for_a_cluster_and_quits_on_ctrl_c(
    read_only_url: str, cluster_name: str
) -> None:
    with monitor_in_a_terminal(read_only_url, cluster_name) as (pid, fd):
        _read_until(fd, b"waiting for a scheduler")
        os.write(fd, b"\x03")  # Ctrl-C, through the terminal: SIGINT to the monitor
        assert _exit_code(pid) == 0


# --------------------------------------------------------------------------- retention


def test_event_and_story_streams_stay_within_their_caps(
    cluster_name: str, monkeypatch: pytest.MonkeyPatch, make_cluster: ClusterFactory
) -> None:
    for key, value in {"EVENTS": "4", "DEATHS": "1", "STORY": "3", "WORKER_STORY": "2"}.items():
        monkeypatch.setenv(f"REDISDASK__RETENTION__{key}", value)
    keys = Keys(cluster_name)
    with (
        make_cluster(nanny=False, n_workers=3) as cluster,
        Client(cluster) as client,
    ):
        for i in range(20):  # many batches: many story entries
            assert client.submit(inc, i).result(timeout=30) == i + 1
        assert sum(client.gather(client.map(inc, range(500)))) == sum(range(1, 501))
        for process in cluster.worker_processes[1:]:
            process.kill()  # two deaths, two more events
        poll(lambda: len(client.scheduler_info()["workers"]) == 1, timeout=30)
        r = cluster.redis
        worker = next(iter(client.scheduler_info()["workers"]))
        more = itertools.count(1000)  # (small results survived the deaths: no recomputation)

        def two_story_entries() -> bool:
            assert client.submit(inc, next(more)).result(timeout=30)  # story for a heartbeat
            return r.xlen(keys.worker_story(worker)) == 2

        poll(two_story_entries)
        assert r.xlen(keys.events) == 4  # of 6+: scheduler-start, 3 joined, 2 died
        assert r.xlen(keys.deaths) == 1
        assert r.xlen(keys.story) == 3


# --------------------------------------------------------------------------- client progress


def divide(x: int) -> float:
    return 1 / x


def test_progress_draws_a_bar_per_prefix_counts_errors_and_times_out(
    client: Client, tmp_path: Path
) -> None:
    incs = client.map(inc, range(20))
    bad = client.submit(divide, 0)
    terminal = Console(force_terminal=True, record=True, file=io.StringIO(), width=100)
    progress({"incs": incs, "bad": [bad]}, console=terminal, timeout=30)
    drawn = terminal.export_text()
    assert "inc" in drawn and "20/20" in drawn
    assert "divide" in drawn and "1/1" in drawn and "1 erred" in drawn
    log = Console(file=io.StringIO(), force_terminal=False, record=True)
    progress([incs, bad], console=log, timeout=30)
    assert log.export_text() == "21 tasks: 20 done, 1 erred\n"  # one line, no bars
    blocked = client.submit(wait_for_file, str(tmp_path / "never"))
    with pytest.raises(TimeoutError, match="1 of 1 futures"):
        progress(blocked, console=log, timeout=0.3)
    (tmp_path / "never").touch()
    assert blocked.result(timeout=30)


# --------------------------------------------------------------------------- logging

LOG_LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) +"
    r"(?P<role>scheduler|nanny|worker)(?: (?P<name>\S+))?\[(?P<pid>\d+)\] redisdask\.\S+: "
)


def test_every_process_logs_one_format_with_its_role_and_name(
    tmp_path: Path, make_cluster: ClusterFactory
) -> None:
    with (
        make_cluster(
            n_workers=1, nanny=True, log_directory=tmp_path,
            worker_options={"local_directory": str(tmp_path)},
        ) as cluster,
        Client(cluster) as client,
    ):  # fmt: skip
        assert client.submit(inc, 1).result(timeout=30) == 2
    lines = [
        line
        for log in tmp_path.glob("*.log")
        for line in log.read_text().splitlines()
        if " redisdask." in line
    ]
    parsed = [LOG_LINE.match(line) for line in lines]
    assert all(parsed), [line for line, m in zip(lines, parsed, strict=True) if not m]
    roles = {(m["role"], m["name"]) for m in parsed if m}
    assert ("scheduler", None) in roles
    assert ("nanny", "worker-0") in roles and ("worker", "worker-0") in roles
    # the nanny's own file of its worker's output: the same lines, as the worker wrote them
    [worker_log] = (tmp_path / "redisdask-worker-space").glob("worker-0.log")
    assert "worker worker-0[" in worker_log.read_text()


def test_inspect_events_follow_prints_new_events_as_they_come(
    read_only_url: str, cluster: LocalCluster
) -> None:
    follower = subprocess.Popen(
        [sys.executable, "-m", "redisdask", "inspect", "events", read_only_url, "--cluster",
         cluster.cluster_name, "--follow", "--json"],
        stdout=subprocess.PIPE, text=True, preexec_fn=_interruptible,
    )  # fmt: skip
    try:
        assert follower.stdout is not None
        seen = [json.loads(follower.stdout.readline())["kind"] for _ in range(3)]
        assert seen == ["scheduler-start", "worker-joined", "worker-joined"]  # the history
        cluster.start_worker(name="late")  # then what happens next, as it happens
        late = json.loads(follower.stdout.readline())
        assert late["kind"] == "worker-joined" and late["name"] == "late"
        follower.send_signal(signal.SIGINT)
        assert follower.wait(timeout=15) == 0
    finally:
        follower.kill()


def test_the_monitor_outlives_a_redis_that_goes_away_and_comes_back(
    tmp_path: Path, cluster_name: str
) -> None:
    from redisdask.deploy.embedded import EmbeddedRedis

    with (
        EmbeddedRedis(data_dir=tmp_path) as server,
        monitor_in_a_terminal(server.url, cluster_name) as (pid, fd),
    ):
        _read_until(fd, b"waiting for a scheduler")
        server.kill()  # kill -9: the monitor says so and keeps trying
        _read_until(fd, b"cannot read Redis")
        server.start()  # same port, same data
        _read_until(fd, b"waiting for a scheduler")
        os.write(fd, b"q")
        assert _exit_code(pid) == 0


def test_strangers_entries_are_shown_or_skipped_never_fatal(
    redis_url: str, cluster_name: str
) -> None:
    from redisdask.observe.inspect import read_events, read_task, read_worker
    from redisdask.store import codecs

    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    odd = "tcp://10.9.9.9:1"
    for stream in (keys.events, keys.story, keys.deaths, keys.worker_story(odd)):
        r.xadd(stream, {"m": b"\xc1 not msgpack"})
        r.xadd(stream, {"m": codecs.pack([1, "k", 2])})
        r.xadd(stream, {"m": codecs.pack({"transitions": 5, "kind": ["k"]})})
        r.xadd(stream, {"m": codecs.pack({"transitions": [["k", "memory", ["x"]]], "causes": 1})})
    r.hset(keys.workers, odd, codecs.pack({"name": "k", "nthreads": "many",
                                           "memory_fractions": {"pause": "high"}}))  # fmt: skip
    r.hset(keys.heartbeats, odd, codecs.pack({"time": "yesterday"}))
    snap = read_snapshot(r, keys)
    assert [w.status for w in snap.workers] == ["unreadable"]
    assert "unreadable" in render(status_view(snap, "redis://h/0"), 120)
    assert render(dashboard(snap, "redis://h/0"), 120)
    assert read_task(r, keys, "k")["state"] == "unknown"
    assert all(isinstance(e, dict) for e in read_events(r, keys))
    assert read_worker(r, keys, odd) is not None
    # figures of the wrong type in events of the right kinds
    for kind in ("worker-died", "redis-reconnected", "scheduler-start", "worker-joined"):
        event = {"kind": kind, "time": "noon", "name": "k", "rss": "big", "memory_limit": [1],
                 "away": "x"}  # fmt: skip
        r.xadd(keys.events, {"m": codecs.pack(event)})
    r.hset(keys.workers, "tcp://10.9.9.9:2", codecs.pack(7))  # not even a map
    snap = read_snapshot(r, keys)
    frame = render(dashboard(snap, "redis://h/0"), 120)
    assert "worker k died" in frame and "--:--:--" in frame
    assert read_worker(r, keys, "tcp://10.9.9.9:2") is not None
    r.close()
