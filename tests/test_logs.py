"""``logging.format: json``: every process of a cluster (scheduler, nanny, worker, a
client's program, the exporter in test_exporter.py) writes one JSON object per line, and
no line holds the Redis password."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import ClusterFactory

from redisdask import Client, LocalCluster
from redisdask.deploy.embedded import EmbeddedRedis
from redisdask.utils.logs import JsonFormatter

pytestmark = pytest.mark.timeout(120)

FIELDS = {"time", "level", "logger", "role", "name", "pid", "message"}


def inc(x: int) -> int:
    return x + 1


@pytest.fixture
def password_url(redis_server: EmbeddedRedis) -> Iterator[tuple[str, str]]:
    """The session's Redis as a user with every right and a password of its own."""
    user, password = f"ops-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    r = redis.Redis.from_url(redis_server.url)
    r.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "&*", "+@all")
    yield redis_server.url.replace("redis://", f"redis://{user}:{password}@", 1), password
    r.execute_command("ACL", "DELUSER", user)
    r.close()


def json_lines(path: Path) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line]
    for record in records:
        assert record.keys() >= FIELDS, record
    return records


def test_scheduler_nanny_and_worker_write_json_lines_without_the_password(
    password_url: tuple[str, str],
    cluster_name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, password = password_url
    monkeypatch.setenv("REDISDASK__LOGGING__FORMAT", "json")  # the processes inherit it
    logs = tmp_path / "logs"
    with (
        LocalCluster(
            n_workers=1,
            threads_per_worker=1,
            redis_url=url,
            cluster_name=cluster_name,
            log_directory=logs,  # their stderr, at INFO
            worker_options={"local_directory": str(tmp_path / "space")},
        ) as cluster,
        Client(cluster) as client,
    ):
        assert client.submit(inc, 1).result(timeout=30) == 2
    scheduler = json_lines(logs / "scheduler.log")
    worker = json_lines(logs / "worker-0.log")  # the nanny's and, through it, its worker's
    assert {r["role"] for r in scheduler} == {"scheduler"}
    assert any("holds the lease" in r["message"] for r in scheduler)
    assert {r["role"] for r in worker} == {"nanny", "worker"}
    assert all(r["name"] == "worker-0" for r in worker if r["role"] == "worker")
    assert {r["pid"] for r in worker if r["role"] == "nanny"} != {
        r["pid"] for r in worker if r["role"] == "worker"
    }
    [nanny_file] = (tmp_path / "space" / "redisdask-worker-space").glob("*.log")
    assert json_lines(nanny_file)  # the nanny's file of its worker's lines: JSON too
    every_line = [p.read_text() for p in (*logs.glob("*.log"), nanny_file)]
    assert password not in "".join(every_line)


CLIENT_PROGRAM = """
import sys, threading
from redisdask import Client

def inc(x):
    return x + 1

called = threading.Event()
def callback(future):
    called.set()
    1 / 0

with Client(sys.argv[1], cluster_name=sys.argv[2]) as client:
    future = client.submit(inc, 1)
    future.add_done_callback(callback)
    assert future.result(timeout=30) == 2
    assert called.wait(30)
"""


def test_a_clients_program_writes_json_lines_with_the_exception_text(
    redis_url: str, cluster_name: str, tmp_path: Path, make_cluster: ClusterFactory
) -> None:
    program = tmp_path / "program.py"
    program.write_text(CLIENT_PROGRAM)
    with make_cluster(nanny=False, n_workers=1, threads_per_worker=1):  # fmt: skip
        done = subprocess.run(
            [sys.executable, str(program), redis_url, cluster_name],
            env={**os.environ, "REDISDASK__LOGGING__FORMAT": "json"},
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stderr.splitlines() if line]
    [error] = [r for r in records if r["level"] == "ERROR"]
    assert error["role"] == "client" and error["logger"] == "redisdask.client"
    assert error["message"] == "a future's done callback raised"
    assert "ZeroDivisionError: division by zero" in error["exception"]
    assert error["exception"].startswith("Traceback (most recent call last)")


def test_the_json_record_holds_the_exception_and_stays_one_line() -> None:
    try:
        raise ValueError("first line\nsecond line")
    except ValueError:
        record = logging.LogRecord(
            "redisdask.x", logging.ERROR, __file__, 1, "a %s\nb", ("c",), sys.exc_info()
        )
    line = JsonFormatter().format(record)
    assert "\n" not in line
    data = json.loads(line)
    assert data["message"] == "a c\nb" and data["level"] == "ERROR"
    assert data["exception"].endswith("ValueError: first line\nsecond line")
    assert data["time"].endswith("Z") and data["pid"] == os.getpid()
