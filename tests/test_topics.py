"""Structured events by topic (issue 26, part 3), as distributed's: ``log_event`` from a
client and from a task's worker, ``get_events``, ``subscribe_topic`` /
``unsubscribe_topic``, and the cluster's own event log read as the topic "cluster"."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

import pytest
import redis
from conftest import ClusterFactory
from polling import poll

from redisdask import Client, get_worker
from redisdask.client.events import Subscriptions
from redisdask.config import load_config
from redisdask.deploy.embedded import EmbeddedRedis
from redisdask.store import topics
from redisdask.store.keyspace import Keys

pytestmark = pytest.mark.timeout(90)


def tell(x: int) -> int:
    get_worker().log_event(["progress", "audit"], {"x": x, "done": True})
    return x


def test_events_logged_by_a_client_and_by_tasks_are_read_back_by_topic(
    make_cluster: ClusterFactory,
) -> None:
    with make_cluster(nanny=False, n_workers=1) as cluster, Client(cluster) as client:
        client.log_event("progress", {"stage": "start"})
        assert client.gather(client.map(tell, range(3))) == [0, 1, 2]
        poll(lambda: len(client.get_events("audit")) == 3, timeout=20)
        progress = client.get_events("progress")
        assert progress[0][1] == {"stage": "start"}
        assert sorted(msg["x"] for _, msg in progress[1:]) == [0, 1, 2]
        times = [t for t, _ in progress]
        assert times == sorted(times) and all(t > 1.7e9 for t in times)
        every = client.get_events()
        assert {"progress", "audit", "cluster"} <= set(every)
        assert every["audit"] == client.get_events("audit")
        assert client.get_events("nothing-logged") == ()
        with pytest.raises(TypeError, match="plain data"):
            client.log_event("progress", object())
        with pytest.raises(ValueError, match="read-only"):
            client.log_event("cluster", "forged")


def test_a_subscriber_gets_each_new_event_until_it_unsubscribes(
    make_cluster: ClusterFactory,
) -> None:
    with make_cluster(nanny=False, n_workers=1) as cluster, Client(cluster) as client:
        client.log_event("news", "before the subscription")
        got: list[object] = []
        lock = threading.Lock()

        def handler(event: tuple[float, object]) -> None:
            with lock:
                got.append(event[1])

        client.subscribe_topic("news", handler)
        client.log_event("news", "first")
        client.submit(tell, 7).result(timeout=20)  # (not its topic)
        client.log_event("news", "second")
        poll(lambda: len(got) == 2, timeout=20)
        assert got == ["first", "second"]
        client.unsubscribe_topic("news")
        client.log_event("news", "after")
        poll(lambda: len(client.get_events("news")) == 4, timeout=10)
        assert got == ["first", "second"]


def cluster_events(client: Client) -> list[dict]:
    """The events of the ``cluster`` topic from now on, as a subscription delivers them."""
    events: list[dict] = []
    client.subscribe_topic("cluster", lambda e: events.append(e[1]))
    return events


def first_of(kind: str, events: list[dict]) -> dict:
    """The first event of ``kind``, once a subscription delivered it."""
    poll(lambda: any(e.get("kind") == kind for e in events), timeout=20)
    return next(e for e in events if e.get("kind") == kind)


def test_a_workers_death_is_an_event_of_the_cluster_topic_with_its_reason(
    make_cluster: ClusterFactory,
) -> None:
    with make_cluster(nanny=False, n_workers=2) as cluster, Client(cluster) as client:
        events = cluster_events(client)
        [(address, info), _] = client.scheduler_info()["workers"].items()
        os.kill(info["pid"], signal.SIGKILL)
        died = first_of("worker-died", events)
        assert died["worker"] == address and died["reason"]
        assert any(e[1].get("kind") == "worker-died" for e in client.get_events("cluster"))


def fail(x: int) -> int:
    raise ValueError(f"no {x}")


def test_a_task_that_raised_is_an_event_of_the_cluster_topic(
    make_cluster: ClusterFactory,
) -> None:
    with make_cluster(nanny=False, n_workers=1) as cluster, Client(cluster) as client:
        events = cluster_events(client)
        [address] = client.scheduler_info()["workers"]
        future = client.submit(fail, 7)
        dependent = client.submit(str, future)
        with pytest.raises(ValueError):
            dependent.result(timeout=20)
        first_of("task-erred", events)
        [event] = [e[1] for e in client.get_events("cluster") if e[1]["kind"] == "task-erred"]
        assert event["key"] == future.key and event["worker"] == address  # not its dependent
        assert event["exception"] == "ValueError: no 7"


def test_a_subscription_outlives_a_redis_that_goes_away_and_says_so_once(
    cluster_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The reader of the subscribed topics waits out a Redis that went away, saying so
    once, and hands over what is logged once it is back."""
    caplog.set_level(logging.INFO, logger="redisdask")
    with EmbeddedRedis() as server:
        keys = Keys(cluster_name)
        got: list[object] = []

        async def run() -> None:
            subscriptions = Subscriptions(server.url, keys, load_config(), timeout=5.0)
            subscriptions.add("t", lambda event: got.append(event[1]), "0-0")
            log_event(server.client(), keys, "t", {"n": 1})
            await wait_for(lambda: got == [{"n": 1}])
            server.kill()  # the data dir stays for the start below
            await wait_for(lambda: subscriptions.failed_reads >= 3)
            server.start()  # the same port
            log_event(server.client(), keys, "t", {"n": 2})
            await wait_for(lambda: got == [{"n": 1}, {"n": 2}])
            await subscriptions.close()

        asyncio.run(run())
    assert caplog.text.count("reading the subscribed topics failed") == 1  # of 3 or more
    assert "reading the subscribed topics again, after" in caplog.text


def log_event(r: redis.Redis, keys: Keys, topic: str, msg: object) -> None:
    for command in topics.commands(keys, topic, msg, maxlen=100):
        r.execute_command(*command)


async def wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"condition not met within {timeout} s"
        await asyncio.sleep(0.01)
