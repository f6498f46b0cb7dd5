"""Structured events by topic (issue 26, part 3), as distributed's: ``log_event`` from a
client and from a task's worker, ``get_events``, ``subscribe_topic`` /
``unsubscribe_topic``, and the cluster's own event log read as the topic "cluster"."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from conftest import ClusterFactory
from polling import poll

from redisdask import Client, get_worker

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


def test_a_workers_death_is_an_event_of_the_cluster_topic_with_its_reason(
    make_cluster: ClusterFactory,
) -> None:
    with make_cluster(nanny=False, n_workers=2) as cluster, Client(cluster) as client:
        deaths: list[dict] = []
        client.subscribe_topic("cluster", lambda e: deaths.append(e[1]))
        [(address, info), _] = client.scheduler_info()["workers"].items()
        os.kill(info["pid"], signal.SIGKILL)
        poll(lambda: any(d.get("kind") == "worker-died" for d in deaths), timeout=20)
        [died] = [d for d in deaths if d.get("kind") == "worker-died"]
        assert died["worker"] == address and died["reason"]
        assert any(e[1].get("kind") == "worker-died" for e in client.get_events("cluster"))
