"""Reloading the scheduler's state from Redis (``load_state``), and what a graph leaves
in Redis once released: the behaviour the scale figures of docs/performance.md rest on.

* A reloaded state of a mixed graph (queued, waiting, no-worker, processing, memory with
  the result in Redis or on a worker only, erred; dependencies, resources, restrictions,
  retries, wants) equals the state that wrote it.
* A reload reads in pages (a bounded number of round trips) and never reads the specs
  or the small results kept in the records.
* Once a client releases a 20,000-task map, the cluster's keys in Redis are back to what
  they were before it (the bounded history streams aside): no key leaks.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import redis
from conftest import ClusterFactory
from mixed_state import build
from polling import poll
from test_scheduler_roundtrip import carried, differences

from redisdask import Client, wait
from redisdask.scheduler.translator import LOAD_PAGE, load_state
from redisdask.store.keyspace import REDIS_COPY, Keys

pytestmark = pytest.mark.timeout(180)


class CountingConnection(redis.Connection):
    """A real connection that counts its writes: one per command or pipeline sent."""

    sent = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.sent += 1
        super().send_packed_command(command, check_health)


def test_a_reloaded_mixed_state_equals_the_state_that_wrote_it(
    redis_url: str, cluster_name: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ours = build(r, keys, 6000)
    states = {ts.state for ts in ours.tasks.values()}
    assert {"queued", "waiting", "no-worker", "processing", "memory", "erred"} <= states
    assert any(ts.inline for ts in ours.tasks.values())  # who_has names "redis"
    assert any(ts.state == "memory" and not ts.inline for ts in ours.tasks.values())
    assert any(ts.resources for ts in ours.tasks.values())
    assert any(not ts.has_spec for ts in ours.tasks.values())  # a dependency never submitted

    loaded = load_state(r, keys)
    loaded.validate_state()
    problems = list(differences(carried(ours), carried(loaded)))
    assert not problems, "\n".join(problems[:20])
    inline = {k for k, ts in ours.tasks.items() if ts.inline}
    assert inline == {k for k, ts in loaded.tasks.items() if ts.inline}
    ts = loaded.tasks[next(iter(inline))]
    assert REDIS_COPY in ts.holders()


def test_a_reload_reads_pages_of_records_without_their_specs_or_results(
    redis_url: str, cluster_name: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    n = 20_000
    ours = build(r, keys, n)
    big = b"x" * 2000  # a task's graph history: never read by a reload
    pipe = r.pipeline(transaction=False)
    for key in ours.tasks:
        pipe.hset(keys.task(key), "spec", big)
        if ours.tasks[key].inline:
            pipe.hset(keys.task(key), "value", big)
    pipe.execute()

    counted = redis.Redis(
        connection_pool=redis.ConnectionPool.from_url(
            redis_url, connection_class=CountingConnection
        )
    )
    sent_before = CountingConnection.sent
    out_before = r.info("stats")["total_net_output_bytes"]
    loaded = load_state(counted, keys)
    sent = CountingConnection.sent - sent_before
    read = r.info("stats")["total_net_output_bytes"] - out_before

    assert len(loaded.tasks) == len(ours.tasks)
    assert sent <= 2 * len(ours.tasks) / LOAD_PAGE + 20, f"{sent} round trips"
    # about 150 bytes a record; its spec alone would be 2,000
    assert read < 400 * len(ours.tasks), f"{read:,} bytes read for {len(ours.tasks):,} tasks"
    assert all(ts.has_spec for key, ts in loaded.tasks.items() if ours.tasks[key].has_spec)


# --------------------------------------------------------------------------- release


def inc(x: int) -> int:
    return x + 1


HISTORY = (":story", ":events", ":deaths", ":dead-letter", ":ready-signal")


def state_bytes(r: redis.Redis, keys: Keys) -> dict[str, int]:
    """The cluster's keys and their sizes, the history streams (bounded by
    ``retention``) aside."""
    out = {}
    for name in r.scan_iter(match=f"{keys.prefix}*", count=1000):
        text = name.decode()
        if not text.endswith(HISTORY):
            out[text] = r.memory_usage(name, samples=0) or 0
    return out


def test_redis_returns_to_its_baseline_once_a_map_is_released(
    redis_url: str, make_cluster: ClusterFactory
) -> None:
    n = 20_000
    with (
        make_cluster(nanny=False, n_workers=2, threads_per_worker=1) as cluster,
        Client(cluster) as client,
    ):  # fmt: skip
        r = redis.Redis.from_url(redis_url)
        keys = cluster.keys
        warm = client.map(inc, range(100))
        client.gather(warm)
        del warm
        gc.collect()
        poll(lambda: r.scard(keys.tasks) == 0, timeout=30)
        poll(lambda: sum(state_bytes(r, keys).values()) < 1 << 20, timeout=30)
        base = state_bytes(r, keys)

        futures = client.map(inc, range(n))
        wait(futures, timeout=150)
        live = state_bytes(r, keys)
        assert sum(live.values()) - sum(base.values()) > 100 * n  # the records are there
        assert client.gather(futures[-3:]) == [n - 2, n - 1, n]
        del futures
        gc.collect()

        def back() -> bool:
            now = state_bytes(r, keys)
            return set(now) <= set(base) and sum(now.values()) <= sum(base.values()) + 64_000

        poll(lambda: r.scard(keys.tasks) == 0, timeout=60)
        try:
            poll(back, timeout=60)  # inboxes and events streams are trimmed at heartbeats
        except AssertionError:
            now = state_bytes(r, keys)
            grown = {k: (base.get(k), v) for k, v in now.items() if v > base.get(k, 0) + 1000}
            raise AssertionError(f"keys grown or new since the baseline: {grown}") from None


def test_a_reloaded_state_has_read_every_claim_written_before_it(
    redis_url: str, cluster_name: str
) -> None:
    """Its free-keys name at least the last entry of the workers stream written before
    it read the records (the records hold every claim up to it), even when the applied
    entries are deleted: a worker then obeys a free-keys about a copy it claimed then."""
    from redisdask.scheduler.instructions import WorkerMsg
    from redisdask.scheduler.state import AddWorker, UpdateGraph
    from redisdask.store.bootstrap import ensure_cluster

    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    entries = [r.xadd(keys.worker_stream, {"m": b"x"}) for _ in range(3)]
    r.xdel(keys.worker_stream, *entries)  # (as the writes that apply them do)
    loaded = load_state(r, keys)
    last = entries[-1].decode()
    worker = "tcp://10.0.0.1:1"
    loaded.handle_stimulus(AddWorker(worker=worker, stimulus_id="add"))
    task = {"key": "x", "spec": b"s", "deps": [], "priority": 0, "retries": 0}
    loaded.handle_stimulus(UpdateGraph(client="c", tasks=[task], wanted=["x"], stimulus_id="g"))
    report = {"keys": {"x": 8}, "processing": []}  # a stray: x is queued
    out = loaded.handle_stimulus(AddWorker(worker=worker, resync=report, stimulus_id="back"))
    frees = [i.msg for i in out if isinstance(i, WorkerMsg) and i.msg.op == "free-keys"]
    assert [f.seen for f in frees] == [last]
