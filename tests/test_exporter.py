"""``redisdask exporter`` as a real process against real clusters, scraped over HTTP: the
figures follow the work, it needs nothing but read access (it runs as a Redis user that
may not write), and a Redis that goes away is ``redisdask_up 0``, not a crash."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import pytest
import redis
from conftest import ClusterFactory, run_cli
from polling import poll
from prometheus_client.parser import text_string_to_metric_families

from redisdask import Client
from redisdask.deploy.embedded import EmbeddedRedis
from redisdask.store.bootstrap import ensure_cluster
from redisdask.store.keyspace import Keys
from redisdask.store.lease import token_number

pytestmark = pytest.mark.timeout(120)


def inc(x: int) -> int:
    return x + 1


class Exporter:
    """A ``redisdask exporter`` process with JSON logs, the URL in its environment (not on
    its command line), on a free port it reports in its first log line."""

    def __init__(self, url: str, cluster: str) -> None:
        env = dict(
            os.environ,
            REDISDASK__REDIS__URL=url,
            REDISDASK__LOGGING__FORMAT="json",
            PYTHONUNBUFFERED="1",
        )
        argv = [sys.executable, "-m", "redisdask", "exporter", "--cluster", cluster, "--port", "0"]
        self.process = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        poll(lambda: self.port is not None or self.process.poll() is not None, timeout=30)
        assert self.port is not None, f"the exporter exited: {self.lines}"

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line.rstrip("\n"))

    @property
    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in list(self.lines)]  # every line is JSON

    @property
    def port(self) -> int | None:
        for record in self.records:
            if record["message"].startswith("serving the metrics"):
                return int(record["message"].rsplit(":", 1)[1].split("/")[0])
        return None

    def scrape(self) -> list[Any]:
        url = f"http://127.0.0.1:{self.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
            text = response.read().decode()
        return [s for family in text_string_to_metric_families(text) for s in family.samples]

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` whose labels include ``labels``."""
        samples = [
            s for s in self.scrape() if s.name == name and labels.items() <= s.labels.items()
        ]
        return sum(s.value for s in samples)

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=15)
        self._reader.join(timeout=5)
        return code


@contextmanager
def exporter(url: str, cluster: str) -> Iterator[Exporter]:
    running = Exporter(url, cluster)
    try:
        yield running
    finally:
        if running.process.poll() is None:
            running.process.kill()
            running.process.wait()


def test_the_figures_follow_the_work_read_only(
    read_only_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    password = read_only_url.split(":")[2].split("@")[0]
    with (
        make_cluster(
            nanny=False,
            n_workers=2,
            threads_per_worker=1,
        ) as cluster,
        Client(cluster) as client,
        exporter(read_only_url, cluster_name) as metrics,
    ):
        assert password not in " ".join(psutil.Process(metrics.process.pid).cmdline())
        assert metrics.value("redisdask_up") == 1
        assert metrics.value("redisdask_scheduler_up") == 1
        assert metrics.value("redisdask_scheduler_workers", state="running") == 2
        assert metrics.value("redisdask_worker_threads") == 2
        holder = {
            field: cluster.redis.hget(Keys(cluster_name).scheduler, field).decode()
            for field in ("id", "token")
        }
        [info] = [s for s in metrics.scrape() if s.name == "redisdask_scheduler_info"]
        assert info.labels["id"] == holder["id"] and info.labels["token"] == holder["token"]
        assert metrics.value("redisdask_scheduler_lease_token") == token_number(holder["token"])
        assert metrics.value("redisdask_scheduler_tasks_completed_total") == 0
        assert metrics.value("redisdask_redis_used_memory_bytes") > 0

        futures = client.map(inc, range(25))
        assert client.gather(futures) == list(range(1, 26))

        def finished() -> bool:
            return (
                metrics.value("redisdask_scheduler_tasks_completed_total") == 25
                and metrics.value("redisdask_scheduler_tasks", state="memory") == 25
                and metrics.value(
                    "redisdask_scheduler_prefix_tasks", task_prefix_name="inc", state="memory"
                )
                == 25
                and metrics.value("redisdask_worker_tasks", state="stored") == 25
            )

        poll(finished, timeout=30)
        assert metrics.value("redisdask_worker_memory_bytes", type="managed") > 0
        del futures  # released: memory empties, the completed counter stays
        poll(lambda: metrics.value("redisdask_scheduler_tasks", state="memory") == 0, 30)
        assert metrics.value("redisdask_scheduler_tasks_completed_total") == 25
        assert metrics.value("redisdask_worker_deaths_total") == 0
        _a_dependency_fetched_from_a_peer_is_counted(client, metrics)

        cluster.worker_processes[1].kill()  # kill -9: the scheduler records the death
        poll(lambda: metrics.value("redisdask_worker_deaths_total") == 1, timeout=30)
        assert metrics.value("redisdask_scheduler_workers") == 1
        assert metrics.value("redisdask_up") == 1  # every read was allowed to the observer
        assert metrics.stop() == 0
    records = metrics.records
    assert {r["role"] for r in records} == {"exporter"}
    assert not [line for line in metrics.lines if password in line]
    assert "redis://observer:***@" in records[0]["message"]  # the URL is logged, redacted


def make_bytes(n: int) -> bytes:
    return b"x" * n


def _a_dependency_fetched_from_a_peer_is_counted(client: Client, metrics: Exporter) -> None:
    """A value above ``worker.inline-result-bytes`` made on one worker and needed on the
    other: the fetching worker's transfer counters rise by one transfer and by the value's
    size (``sizeof`` of bytes: their length), in ``scheduler_info()`` and in the exporter,
    and the holder's stay as they were."""
    holder, fetcher = sorted(client.scheduler_info()["workers"])

    def counters(worker: str) -> tuple[int, int]:
        m = client.scheduler_info()["workers"][worker]["metrics"]
        return m["transfer_incoming_count_total"], m["transfer_incoming_bytes_total"]

    before = {w: counters(w) for w in (holder, fetcher)}
    nbytes = 300_000
    value = client.submit(make_bytes, nbytes, workers=[holder])
    assert client.submit(len, value, workers=[fetcher]).result(timeout=30) == nbytes
    count, fetched = before[fetcher]
    poll(lambda: counters(fetcher) == (count + 1, fetched + nbytes), timeout=30)
    assert counters(holder) == before[holder]
    poll(
        lambda: (
            metrics.value("redisdask_worker_transfer_incoming_bytes_total", worker=fetcher)
            == fetched + nbytes
            and metrics.value("redisdask_worker_transfer_incoming_count_total", worker=fetcher)
            == count + 1
        ),
        timeout=30,
    )


def test_a_redis_that_goes_away_is_up_0_and_the_exporter_keeps_serving(
    cluster_name: str,
) -> None:
    with EmbeddedRedis() as server:
        ensure_cluster(redis.Redis.from_url(server.url), Keys(cluster_name))
        with exporter(server.url, cluster_name) as metrics:
            assert metrics.value("redisdask_up") == 1
            assert metrics.value("redisdask_scheduler_up") == 0  # no scheduler yet
            server.kill()  # the data dir stays for the start below
            for _ in range(3):  # each scrape answers, and says Redis is not there
                assert [(s.name, s.value) for s in metrics.scrape()] == [("redisdask_up", 0)]
            assert metrics.process.poll() is None
            server.start()  # the same port
            poll(lambda: metrics.value("redisdask_up") == 1, timeout=30)
            assert metrics.stop() == 0
        warnings = [r for r in metrics.records if r["level"] == "WARNING"]
        [down] = warnings  # once per cause, not at every scrape
        assert down["message"].startswith(f"cannot read cluster {cluster_name!r}")
        assert any(r["message"].startswith("reading cluster") for r in metrics.records)


def test_a_port_in_use_is_said_and_exits_1(redis_url: str, cluster_name: str) -> None:
    with exporter(redis_url, cluster_name) as first:
        argv = ["exporter", "--cluster", cluster_name, "--port", str(first.port)]
        done = run_cli(*argv, redis_url=redis_url, timeout=30)
        assert done.returncode == 1
        assert f"cannot serve metrics on 127.0.0.1:{first.port}" in done.stderr
        assert "free --port" in done.stderr
        first.stop()


def healthcheck(url: str, cluster: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, REDISDASK__REDIS__URL=url, REDISDASK__CLUSTER__NAME=cluster)
    return subprocess.run(
        [sys.executable, "-m", "redisdask.healthcheck", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_the_compose_healthchecks_on_a_running_and_an_absent_cluster(
    redis_url: str, read_only_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    with (
        make_cluster(nanny=False, n_workers=1, threads_per_worker=1),
        exporter(read_only_url, cluster_name) as metrics,
    ):  # fmt: skip
        for role in ("scheduler", "worker"):  # read-only, as the monitor
            assert healthcheck(read_only_url, cluster_name, role).returncode == 0, role
        assert healthcheck(redis_url, cluster_name, "exporter", str(metrics.port)).returncode == 0
    led = healthcheck(read_only_url, cluster_name, "scheduler")  # the cluster stopped
    assert led.returncode == 1 and "no scheduler holds the lease" in led.stderr
    worker = healthcheck(read_only_url, cluster_name, "worker")
    assert worker.returncode == 1 and "sent a heartbeat in the last 3 s" in worker.stderr
    assert "observer:***@" in worker.stderr and read_only_url not in worker.stderr
    gone = healthcheck(redis_url, cluster_name, "exporter", str(metrics.port))
    assert gone.returncode == 1 and "unhealthy" in gone.stderr
