"""What moves between workers, and how often: a value one worker fetched from a peer
serves the tasks here that need it, not only the one it was fetched for (real worker
processes, real TCP transfers, counted by the workers' own ``transfer_incoming_*``)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from polling import poll

from redisdask import Client, LocalCluster, wait

pytestmark = pytest.mark.timeout(90)
SIZE = 300_000  # over ``worker.inline-result-bytes``: it moves peer to peer


def blob(i: int, n: int) -> bytes:
    return bytes([i % 256]) * n


def pair(a: bytes, b: bytes) -> int:
    return len(a) + len(b)


@pytest.fixture
def two(redis_url: str, cluster_name: str) -> Iterator[Client]:
    """A client of two one-thread worker processes."""
    with (
        LocalCluster(nanny=False, n_workers=2, threads_per_worker=1, redis_url=redis_url,
                     cluster_name=cluster_name),
        Client(redis_url, cluster_name=cluster_name) as client,
    ):  # fmt: skip
        client.wait_for_workers(2)
        yield client


def fetched(client: Client, worker: str, after: float) -> tuple[int, int]:
    """The worker's transfers and bytes from peers, by a heartbeat later than ``after``."""
    metrics: dict = {}

    def heard() -> bool:
        metrics.update(client.scheduler_info()["workers"][worker]["metrics"])
        return metrics["time"] > after

    poll(heard, timeout=30)
    return metrics["transfer_incoming_count_total"], metrics["transfer_incoming_bytes_total"]


def test_a_value_fetched_for_one_task_serves_the_next_claimed_that_needs_it(
    two: Client,
) -> None:
    """``(x + x.T)`` on one-thread workers: two tasks need x (made on worker a) and y (made
    on b), and both run on a, which claims the second only once the first has ended.  The
    y it fetched for the first is still there for the second: one transfer, not two."""
    a, b = sorted(two.scheduler_info()["workers"])
    x = two.submit(blob, 1, SIZE, workers=[a])
    y = two.submit(blob, 2, SIZE, workers=[b])
    wait([x, y], timeout=30)
    before = fetched(two, a, time.time())
    first = two.submit(pair, x, y, workers=[a])
    second = two.submit(pair, y, x, workers=[a])
    assert two.gather([first, second]) == [2 * SIZE, 2 * SIZE]
    count, nbytes = fetched(two, a, time.time())
    assert (count - before[0], nbytes - before[1]) == (1, SIZE)
