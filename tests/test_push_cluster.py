"""Push for real (redisdask/scheduler/push.py): a root task submitted while a worker has a free
thread goes to that worker in the scheduler's batch, with no ready-signal and no claim;
and a pushed task whose worker is killed before it starts runs elsewhere, once.  Worker
and scheduler processes, Redis, SIGSTOP and kill -9; every run is counted in a Redis
list as it starts."""

from __future__ import annotations

import os
import signal

import pytest
import redis
from conftest import ClusterFactory
from polling import poll

from redisdask import Client
from redisdask.observe.inspect import task_story
from redisdask.store.keyspace import Keys
from redisdask.store.task_record import TaskRecord

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(autouse=True)
def _slow_heartbeat_deaths(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker stopped for a while (SIGSTOP) is not declared dead by its heartbeat here
    (a kill -9 is noticed at once all the same: its connections close)."""
    monkeypatch.setenv("REDISDASK__SCHEDULER__WORKER_TTL", "20")


def counted(i: int, url: str, runs: str) -> int:
    redis.Redis.from_url(url).rpush(runs, i)
    return i + 1


def last_signal(r: redis.Redis, keys: Keys) -> bytes | None:
    newest = r.xrevrange(keys.ready_signal, count=1)
    return newest[0][0] if newest else None


def pid_of(client: Client, address: str) -> int:
    return int(client.scheduler_info()["workers"][address]["pid"])


def test_a_task_submitted_to_a_free_worker_runs_there_without_a_claim(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    keys = Keys(cluster_name)
    r = redis.Redis.from_url(redis_url)
    with (
        make_cluster(nanny=False, n_workers=2),
        Client(redis_url, cluster_name=cluster_name) as client,
    ):
        assert client.submit(counted, 0, redis_url, "warm").result(timeout=30) == 1
        before = last_signal(r, keys)
        for i in range(20):  # one at a time: each finds both workers free
            future = client.submit(counted, i, redis_url, f"{cluster_name}-runs", pure=False)
            assert future.result(timeout=30) == i + 1
        assert last_signal(r, keys) == before  # nothing was queued for a claim
        # (the result came from the worker's report: the scheduler records it after)
        poll(lambda: task_story(r, keys, future.key)[-1]["state"] == "memory")
        story = [(s["state"], s["cause"], s["origin"]) for s in task_story(r, keys, future.key)]
        workers = set(client.scheduler_info()["workers"])
        assert [(state, cause) for state, cause, _ in story][-3:] == [
            ("queued", "update-graph"), ("processing", "pushed"), ("memory", "task-finished")
        ]  # fmt: skip
        assert story[-2][2] in workers  # the story names the worker it went to


def test_a_pushed_task_whose_worker_dies_before_reading_it_runs_elsewhere_once(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    """Both workers stopped: the push lands in one's inbox, unread; that one is killed
    with -9, the other resumes: the task runs there, once."""
    keys = Keys(cluster_name)
    r = redis.Redis.from_url(redis_url)
    runs = f"{cluster_name}-runs"
    with (
        make_cluster(nanny=False, n_workers=2),
        Client(redis_url, cluster_name=cluster_name) as client,
    ):
        assert client.submit(counted, -1, redis_url, "warm").result(timeout=30) == 0
        pids = {a: pid_of(client, a) for a in client.scheduler_info()["workers"]}
        for pid in pids.values():
            os.kill(pid, signal.SIGSTOP)
        try:
            future = client.submit(counted, 7, redis_url, runs, pure=False)
            record = keys.task(future.key)
            poll(lambda: TaskRecord.from_hash(r.hgetall(record)).state == "processing")
            pushed_to = TaskRecord.from_hash(r.hgetall(record)).worker
            assert pushed_to in pids
            assert r.xlen(keys.worker_inbox(pushed_to)) >= 1  # there, unread
            os.kill(pids[pushed_to], signal.SIGKILL)
        finally:
            for address, pid in pids.items():
                if address != pushed_to:
                    os.kill(pid, signal.SIGCONT)
        assert future.result(timeout=60) == 8
        assert [int(x) for x in r.lrange(runs, 0, -1)] == [7]  # once: not lost, not twice


def gated(i: int, url: str, gate: str) -> int:
    """Waits until ``gate`` (a Redis list) has an item: standing for work."""
    redis.Redis.from_url(url).blpop([gate], timeout=60)
    return i + 1


def test_a_pushed_tasks_result_reaches_its_client_with_the_scheduler_stopped(
    redis_url: str, cluster_name: str, monkeypatch: pytest.MonkeyPatch, make_cluster: ClusterFactory
) -> None:
    """The worker's report sends a small result of a pushed task to the client that
    wanted it (FINISH, the record's ``notify``): the client has it while the scheduler
    is stopped (SIGSTOP), and hears of it once, not again from the scheduler.  (The
    lease outlasts the test: no new scheduler takes over meanwhile.)"""
    monkeypatch.setenv("REDISDASK__SCHEDULER__LEASE_TTL", "120")
    keys = Keys(cluster_name)
    r = redis.Redis.from_url(redis_url)
    gate = f"{cluster_name}-gate"
    with (
        make_cluster(nanny=False, n_workers=1) as cluster,
        Client(redis_url, cluster_name=cluster_name) as client,
    ):
        future = client.submit(gated, 1, redis_url, gate)
        poll(lambda: TaskRecord.from_hash(r.hgetall(keys.task(future.key))).state == "processing")
        scheduler = cluster.scheduler_process
        assert scheduler is not None
        scheduler.send_signal(signal.SIGSTOP)
        try:
            r.rpush(gate, 1)
            assert future.result(timeout=20) == 2  # no scheduler ran meanwhile
            # where it lives, as the client heard it (the record says processing still)
            (worker,) = client.scheduler_info()["workers"]  # (read from Redis)
            assert client.who_has([future]) == {future.key: [worker]}
        finally:
            scheduler.send_signal(signal.SIGCONT)
        # the scheduler reads the report, records the result, and does not tell again
        poll(lambda: TaskRecord.from_hash(r.hgetall(keys.task(future.key))).state == "memory")
        r.rpush(gate, 1)  # a later result, heard after any news of the first
        assert client.submit(gated, 2, redis_url, gate).result(timeout=30) == 3
        assert client.futures[future.key].finishes == 1
