"""Every process's logs in Redis (issue 26, part 1): a worker's records, alive or killed,
read with distributed's ``get_worker_logs`` and with ``redisdask logs`` by name; the
scheduler's; a nanny's; capped, expiring, without passwords, and never in the way of a
Redis that refuses writes."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from conftest import ClusterFactory, run_cli
from polling import poll
from tasklib import wait_for_file

from redisdask import Client
from redisdask.deploy.embedded import EmbeddedRedis
from redisdask.store import logship
from redisdask.store.keyspace import Keys

pytestmark = pytest.mark.timeout(120)


def shout(text: str, times: int = 1) -> str:
    for i in range(times):
        logging.getLogger("user.task").warning("%s %d", text, i)
    return text


def lines_of(client: Client, **kwargs: object) -> list[str]:
    return [line for logs in client.get_worker_logs(**kwargs).values() for _, line in logs]


def test_a_workers_records_are_read_back_in_distributeds_shape_without_passwords(
    make_cluster: ClusterFactory,
) -> None:
    with make_cluster(nanny=False, n_workers=1) as cluster, Client(cluster) as client:
        [address] = client.scheduler_info()["workers"]
        secret = "redis://user:hunter2@db.example:6379/0"
        assert client.submit(shout, f"from the task, to {secret}").result(timeout=20)
        poll(lambda: any("from the task" in line for line in lines_of(client)), timeout=20)
        logs = client.get_worker_logs()
        assert list(logs) == [address]
        [(level, line)] = [entry for entry in logs[address] if "from the task" in entry[1]]
        assert level == "WARNING" and "user.task" in line and "worker-0" in line
        assert "hunter2" not in line and "redis://user:***@db.example" in line
        assert client.get_worker_logs(n=1, workers=["worker-0"])[address][-1][1] == line


def test_a_killed_workers_logs_are_read_by_its_name_from_the_client_and_the_cli(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    with make_cluster(nanny=False, n_workers=2) as cluster, Client(cluster) as client:
        workers = client.scheduler_info()["workers"]
        victim = next(a for a, w in workers.items() if w["name"] == "worker-0")
        client.submit(shout, "its last words", workers=[victim]).result(timeout=20)
        poll(lambda: any("its last words" in x for x in lines_of(client, workers=victim)), 20)
        os.kill(workers[victim]["pid"], signal.SIGKILL)
        poll(lambda: victim not in client.scheduler_info()["workers"], timeout=20)
        # gone from the cluster, kept in Redis: by its name, as its death record says
        [(level, line)] = client.get_worker_logs(workers=["worker-0"])[victim]
        assert "its last words 0" in line and level == "WARNING"
        out = run_cli("logs", "worker-0", redis_url, "--cluster", cluster_name)
        assert out.returncode == 0, out.stderr
        assert "its last words 0" in out.stdout
        out = run_cli("logs", victim, redis_url, "--cluster", cluster_name, "--json", "-n", "1")
        record = json.loads(out.stdout.splitlines()[-1])
        assert record["message"] == "its last words 0" and record["level"] == "WARNING"
        out = run_cli("logs", "worker-9", redis_url, "--cluster", cluster_name)
        assert out.returncode == 1 and "no worker with address or name 'worker-9'" in out.stderr
        with pytest.raises(ValueError, match="worker-9"):
            client.get_worker_logs(workers=["worker-9"])


def test_inspect_task_shows_the_lines_its_run_logged(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    with make_cluster(nanny=False, n_workers=1) as cluster, Client(cluster) as client:
        mine, other = client.submit(shout, "mine"), client.submit(shout, "not mine")
        assert client.gather([mine, other]) == ["mine", "not mine"]
        poll(lambda: sum("mine " in x for x in lines_of(client)) == 2, timeout=20)
        out = run_cli("inspect", "task", mine.key, redis_url, "--cluster", cluster_name, "--json")
        assert out.returncode == 0, out.stderr
        [record] = json.loads(out.stdout)["logs"]
        assert record["message"] == "mine 0" and record["task"] == mine.key
        out = run_cli("inspect", "task", mine.key, redis_url, "--cluster", cluster_name)
        assert "logged by its runs" in out.stdout and "user.task: mine 0" in out.stdout


def test_the_schedulers_records_are_read_back(make_cluster: ClusterFactory) -> None:
    with (
        make_cluster(nanny=False, n_workers=1, silence_logs="INFO") as cluster,
        Client(cluster) as client,
    ):
        poll(lambda: any("holds the lease" in x for _, x in client.get_scheduler_logs()), 20)
        [(level, line)] = client.get_scheduler_logs(n=1)
        assert level in ("INFO", "WARNING") and " scheduler[" in line


def test_a_nannys_records_tell_of_its_workers_death(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    with make_cluster(nanny=True, n_workers=1) as cluster, Client(cluster) as client:
        [(address, info)] = client.scheduler_info()["workers"].items()
        os.kill(info["pid"], signal.SIGKILL)
        poll(lambda: set(client.scheduler_info()["workers"]) - {address}, timeout=30)
        poll(lambda: any("killed by SIGKILL" in x for x in lines_of(client, nanny=True)), 20)
        out = run_cli("logs", "worker-0", redis_url, "--cluster", cluster_name, "--nanny")
        assert out.returncode == 0 and "killed by SIGKILL" in out.stdout, out.stderr
        # the dead worker's nanny, by the death record (it is no longer registered)
        dead = lines_of(client, workers=[address], nanny=True)
        assert any("killed by SIGKILL" in line for line in dead)
        out = run_cli("logs", address, redis_url, "--cluster", cluster_name, "--nanny")
        assert out.returncode == 0 and "killed by SIGKILL" in out.stdout, out.stderr


def say_and_crash(go: str) -> None:
    try:
        raise KeyError("logged with its traceback")
    except KeyError:
        logging.getLogger("user.task").exception("caught")
    print("printed by the task", flush=True)
    wait_for_file(go)  # until its record is in Redis (a crash loses the unshipped ones)
    import ctypes

    ctypes.string_at(0)  # a segfault: faulthandler dumps every thread's stack


def test_what_a_worker_prints_and_its_crash_dump_reach_its_stream_through_its_nanny(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    with make_cluster(nanny=True, n_workers=1) as cluster, Client(cluster) as client:
        [address] = client.scheduler_info()["workers"]
        go = tmp_path / "go"
        crash = client.submit(say_and_crash, str(go))  # (held: a future dropped is released)
        r = redis.Redis.from_url(redis_url)
        stream = Keys(cluster_name).worker_logs(address)
        poll(lambda: any(rec.message.startswith("caught") for rec in logship.read(r, stream)))
        go.touch()

        def output() -> list[logship.LogRecord]:
            return [rec for rec in logship.read(r, stream) if rec.level == "OUTPUT"]

        poll(lambda: any("in say_and_crash" in rec.message for rec in output()), timeout=30)
        messages = [rec.message for rec in output()]
        assert "printed by the task" in messages
        assert "Fatal Python error: Segmentation fault" in messages
        assert all(rec.process == "worker worker-0" for rec in output())
        # the logged traceback is in its record, and not shipped again as output
        [caught] = [rec for rec in logship.read(r, stream) if rec.message.startswith("caught")]
        assert "KeyError: 'logged with its traceback'" in caught.message
        assert not [m for m in messages if "logged with its traceback" in m or "Traceback" in m]
        crash.cancel()  # (it would kill its next workers too)


def test_a_stream_keeps_its_last_records_and_expires_after_its_last_write(
    redis_url: str, cluster_name: str, monkeypatch: pytest.MonkeyPatch, make_cluster: ClusterFactory
) -> None:
    monkeypatch.setenv("REDISDASK__RETENTION__LOGS", "50")
    monkeypatch.setenv("REDISDASK__RETENTION__LOGS_TTL", "600")
    with make_cluster(nanny=False, n_workers=1) as cluster, Client(cluster) as client:
        [address] = client.scheduler_info()["workers"]
        client.submit(shout, "many", 500).result(timeout=20)
        poll(lambda: any("many 499" in x for x in lines_of(client)), timeout=20)
        r = redis.Redis.from_url(redis_url)
        stream = Keys(cluster_name).worker_logs(address)
        assert r.xlen(stream) == 50
        assert 500_000 < r.pttl(stream) <= 600_000
        assert len(client.get_worker_logs()[address]) == 50


def chatter(n: int, size: int) -> int:
    for i in range(n):
        logging.getLogger("user.task").warning("%d %s", i, "x" * size)
    return n


def test_a_chatty_task_keeps_its_stream_within_the_bytes_cap_and_0_ships_nothing(
    redis_url: str, cluster_name: str, monkeypatch: pytest.MonkeyPatch, make_cluster: ClusterFactory
) -> None:
    monkeypatch.setenv("REDISDASK__RETENTION__LOGS_BYTES", "1000000")
    r = redis.Redis.from_url(redis_url)
    with make_cluster(nanny=False, n_workers=1) as cluster, Client(cluster) as client:
        [address] = client.scheduler_info()["workers"]
        stream = Keys(cluster_name).worker_logs(address)
        client.submit(chatter, 2000, 8000).result(timeout=30)  # 16 MB of lines
        poll(lambda: any(line.split()[-2:-1] == ["1999"] for line in lines_of(client, n=1)))
        assert 100 <= r.xlen(stream) < 10_000  # fewer than retention.logs: the bytes cap
        assert r.memory_usage(stream) < 1_300_000, r.memory_usage(stream)
    monkeypatch.setenv("REDISDASK__RETENTION__LOGS", "0")
    with make_cluster(nanny=False, n_workers=1) as cluster, Client(cluster) as client:
        [address] = client.scheduler_info()["workers"]
        assert client.submit(chatter, 10, 10).result(timeout=30) == 10
        shippers = client.run(lambda: [h.maxlen for h in logging.getLogger().handlers
                                       if isinstance(h, logship.RedisLogHandler)])  # fmt: skip
        assert shippers == {address: []}  # none installed
        assert client.get_worker_logs()[address] == []
        assert not r.exists(Keys(cluster_name).worker_logs(address))


@pytest.fixture
def own_redis() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


def test_a_full_redis_costs_the_records_never_the_process_and_says_how_many(
    own_redis: EmbeddedRedis,
) -> None:
    """Logs give way first when Redis is full: the records of a refused write are
    dropped (emit never waits, never raises), and the next write says how many."""
    r = own_redis.client()
    r.config_set("maxmemory-policy", "noeviction")
    handler = logship.RedisLogHandler(own_redis.url, maxlen=1000, ttl=60, stream="s")
    log = logging.getLogger("test.full")
    log.addHandler(handler)
    log.propagate = False
    try:
        r.config_set("maxmemory", 1)  # full, whatever it frees
        start = time.monotonic()
        for i in range(200):
            log.warning("refused %d", i)
        assert time.monotonic() - start < 1.0  # (emit only buffers)
        poll(lambda: handler._dropped == 200, timeout=10)
        assert r.xlen("s") == 0
        r.config_set("maxmemory", 0)  # room again
        log.warning("after")
        poll(lambda: r.xlen("s") == 2, timeout=10)
        note, after = logship.read(r, "s")
        assert "200 log records were lost" in note.message and after.message == "after"
    finally:
        log.removeHandler(handler)
        handler.close()


def test_records_logged_while_redis_is_away_wait_and_arrive_when_it_is_back(
    own_redis: EmbeddedRedis,
) -> None:
    """A Redis that is away costs no record (up to the buffer's 10,000) and never holds
    up the logging call; the local log (stderr) is another handler, untouched."""
    r = own_redis.client()
    handler = logship.RedisLogHandler(own_redis.url, maxlen=1000, ttl=60, stream="s")
    log = logging.getLogger("test.away")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("before")
        poll(lambda: r.xlen("s") == 1, timeout=10)
        own_redis.kill()  # the data dir stays for the start below
        start = time.monotonic()
        for i in range(50):
            log.warning("while away %d", i)
        assert time.monotonic() - start < 1.0  # (emit only buffers)
        own_redis.start()  # the same port
        r = own_redis.client()
        poll(lambda: r.xlen("s") == 51, timeout=20)
        messages = [record.message for record in logship.read(r, "s")]
        assert messages == ["before"] + [f"while away {i}" for i in range(50)]
        assert handler._dropped == 0
    finally:
        log.removeHandler(handler)
        handler.close()
