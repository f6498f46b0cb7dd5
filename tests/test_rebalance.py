"""``Client.rebalance`` on a real cluster (a real Redis, a scheduler and three worker
processes): data made on one worker spreads over the others, every value stays right,
and the scheduler's ``who_has`` agrees with what the workers hold.  The move rules
themselves (thresholds, "drop the sender's copy only once the recipient holds it", a
recipient dying mid-move) are tested on the pure state machine in
``tests/test_scheduler_rebalance.py``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
from polling import poll

from redisdask import Client, LocalCluster, wait

pytestmark = pytest.mark.timeout(120)

SIZE = 100_000  # bytes of each value (its sizeof is a little more)


def make(i: int) -> bytes:
    return b"%05d" % i + b"x" * SIZE


def slow_make(i: int) -> bytes:
    time.sleep(0.3)  # (the work of a task that takes a while, not a synchronisation)
    return make(i)


def divide(a: int, b: int) -> float:
    return a / b


async def holding(dask_worker: Any = None) -> dict[str, int]:
    """The results this worker holds (on its loop: its state machine's own view)."""
    return {k: ts.nbytes for k, ts in dask_worker.state.tasks.items() if ts.state == "memory"}


@pytest.fixture
def cluster(
    redis_url: str, cluster_name: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[LocalCluster]:
    """Three workers; the scheduler rebalances small data, as distributed's own tests
    configure it (Dask's defaults move nothing while every worker is under 30% of its
    memory limit)."""
    monkeypatch.setenv("REDISDASK__WORKER__MEMORY__REBALANCE__SENDER_MIN", "0")
    monkeypatch.setenv("REDISDASK__WORKER__MEMORY__REBALANCE__SENDER_RECIPIENT_GAP", "0")
    with LocalCluster(
        nanny=False,
        n_workers=3,
        threads_per_worker=2,
        redis_url=redis_url,
        cluster_name=cluster_name,
    ) as cluster:
        yield cluster


def addresses(client: Client) -> dict[str, str]:
    """``{name: address}`` of the workers."""
    return {w["name"]: a for a, w in client.scheduler_info()["workers"].items()}


def what_workers_hold(client: Client) -> dict[str, dict[str, int]]:
    return client.run(holding)


def holders(client: Client, futures: list[Any]) -> dict[str, set[str]]:
    """``{worker: keys}`` from the scheduler's ``who_has`` of ``futures``."""
    by_worker: dict[str, set[str]] = {a: set() for a in addresses(client).values()}
    for key, workers in client.who_has(futures).items():
        for w in workers:
            by_worker[w].add(key)
    return by_worker


def agrees(client: Client, futures: list[Any]) -> bool:
    """The scheduler's who_has is what the workers hold (the senders drop their copies
    as they read their inboxes, just after the scheduler recorded it)."""
    held = {w: set(keys) for w, keys in what_workers_hold(client).items()}
    return held == holders(client, futures)


def check_values(futures: list[Any]) -> None:
    for i, f in enumerate(futures):
        assert f.result() == make(i)


def test_rebalance_spreads_data_made_on_one_worker_over_all_three(client: Client) -> None:
    names = addresses(client)
    futures = client.map(make, range(30), workers=["worker-0"])
    wait(futures)
    assert {k for k in what_workers_hold(client)[names["worker-0"]]} == {f.key for f in futures}
    client.rebalance()
    poll(lambda: agrees(client, futures))
    held = {w: sum(keys.values()) for w, keys in what_workers_hold(client).items()}
    mean = sum(held.values()) / 3
    largest = max(n for keys in what_workers_hold(client).values() for n in keys.values())
    assert all(abs(b - mean) <= largest for b in held.values()), held  # within one value
    assert all(b >= 9 * SIZE for b in held.values()), held
    check_values(futures)  # nothing lost, nothing changed
    assert all(len(ws) == 1 for ws in client.who_has(futures).values())  # moved, not copied
    client.rebalance()  # balanced now: nothing more moves
    assert holders(client, futures) == {
        w: set(keys) for w, keys in what_workers_hold(client).items()
    }


def test_rebalance_of_some_futures_moves_only_those(client: Client) -> None:
    names = addresses(client)
    futures = client.map(make, range(30), workers=["worker-0"])
    subset = futures[5:14]
    client.rebalance(subset)
    poll(lambda: agrees(client, futures))
    who_has = client.who_has(futures)
    moved = {k for k, ws in who_has.items() if ws != [names["worker-0"]]}
    assert moved and moved <= {f.key for f in subset}
    assert all(len(ws) == 1 for ws in who_has.values())
    check_values(futures)


def test_rebalance_among_some_workers_leaves_the_others_alone(client: Client) -> None:
    names = addresses(client)
    futures = client.map(make, range(30), workers=["worker-0"])
    wait(futures)  # (without futures, rebalance moves what is in memory when it is called)
    client.rebalance(workers=["worker-0", names["worker-1"]])  # names or addresses
    poll(lambda: agrees(client, futures))
    held = {w: sum(keys.values()) for w, keys in what_workers_hold(client).items()}
    assert held[names["worker-2"]] == 0
    assert abs(held[names["worker-0"]] - held[names["worker-1"]]) <= 2 * (SIZE + 100), held
    check_values(futures)


def test_rebalance_waits_for_unfinished_futures_and_names_the_ones_not_in_memory(
    client: Client,
) -> None:
    names = addresses(client)
    futures = client.map(slow_make, range(6), workers=["worker-0"])
    client.rebalance(futures)  # they were not finished when it was called
    assert all(f.done() for f in futures)
    poll(lambda: agrees(client, futures))
    assert {len(keys) for keys in holders(client, futures).values()} == {2}
    for i, f in enumerate(futures):
        assert f.result() == make(i)
    erred = client.submit(divide, 1, 0, workers=["worker-0"])
    with pytest.raises(KeyError, match=erred.key):
        client.rebalance([*futures, erred])
    with pytest.raises(ValueError, match="nobody"):
        client.rebalance(workers=["nobody"])
    client.rebalance([])  # nothing to move: returns at once, as in distributed
    client.rebalance(workers=[])
    assert names  # (the cluster is untouched)


def test_an_asynchronous_client_awaits_rebalance(cluster: LocalCluster) -> None:
    async def main() -> None:
        async with Client(cluster, asynchronous=True) as client:
            futures = client.map(make, range(9), workers=["worker-0"])
            await wait(futures)
            await client.rebalance(futures)
            who_has = await client.who_has(futures)
            assert len({ws[0] for ws in who_has.values()}) == 3

    asyncio.run(main())


def test_a_rebalance_survives_its_scheduler_killed_in_the_middle(
    cluster: LocalCluster, client: Client
) -> None:
    """The recipients are paused, so the moves are in flight when the scheduler is
    killed with -9; the next scheduler reloads them from Redis and finishes them when
    the recipients' copies arrive: the call returns, nothing is lost."""
    names = addresses(client)
    futures = client.map(make, range(12), workers=["worker-0"])
    wait(futures)
    pids = client.run(os.getpid)
    recipients = [psutil.Process(pids[names[n]]) for n in ("worker-1", "worker-2")]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for p in recipients:
            p.suspend()  # their inboxes fill, nothing is fetched
        try:
            call = pool.submit(client.rebalance, timeout=90)
            poll(lambda: cluster.redis.scard(cluster.keys.rebalances) == 1)  # planned
            cluster.scheduler_process.kill()  # type: ignore[union-attr]
            cluster.scheduler_process.wait()  # type: ignore[union-attr]
        finally:
            for p in recipients:
                p.resume()
        assert not call.done()  # the senders' copies cannot be dropped by anyone now
        cluster.start_scheduler()
        call.result(timeout=90)
    poll(lambda: agrees(client, futures))
    assert all(len(keys) == 4 for keys in holders(client, futures).values())
    check_values(futures)
