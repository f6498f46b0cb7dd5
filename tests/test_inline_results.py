"""Small results travel with their reports into the task's record in Redis
(``worker.inline-result-bytes``): a client's ``result()`` and a dependent on another
worker need no fetch from the worker that computed it, and its death loses nothing.
Large results still move peer to peer only."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator

import pytest
import redis
from conftest import ClusterFactory
from polling import poll

from redisdask import Client, LocalCluster, wait
from redisdask.store.keyspace import Keys

pytestmark = pytest.mark.timeout(90)


def count_run(redis_url: str, counter: str, x: int) -> int:
    """``x + 1``, counting its runs in Redis (a side effect a recomputation would show)."""
    redis.Redis.from_url(redis_url).incr(counter)
    return x + 1


def inc(x: int) -> int:
    return x + 1


def add(a: int, b: int) -> int:
    return a + b


def blob(i: int, n: int) -> bytes:
    return bytes([i % 256]) * n


def pids(client: Client) -> dict[str, int]:
    return {a: w["pid"] for a, w in client.scheduler_info()["workers"].items()}


@pytest.fixture
def two(redis_url: str, cluster_name: str) -> Iterator[Client]:
    """A client of two worker processes without nannies (a killed one stays dead)."""
    with (
        LocalCluster(nanny=False, n_workers=2, redis_url=redis_url, cluster_name=cluster_name),
        Client(redis_url, cluster_name=cluster_name) as client,
    ):
        yield client


def test_a_small_result_outlives_its_workers_kill_9_without_recomputation(
    two: Client, redis_url: str, cluster_name: str
) -> None:
    counter = f"runs-{uuid.uuid4().hex}"
    r = redis.Redis.from_url(redis_url)
    two.wait_for_workers(2)
    a, _ = sorted(pids(two))
    x = two.submit(count_run, redis_url, counter, 41, workers=[a], allow_other_workers=True)
    assert x.result(timeout=10) == 42
    os.kill(pids(two)[a], signal.SIGKILL)
    poll(lambda: a not in two.scheduler_info()["workers"], timeout=20)
    assert two.who_has(x)[x.key] == []  # no worker holds it ...
    y = two.submit(add, x, 1)  # ... yet the survivor runs its dependent
    assert y.result(timeout=20) == 43
    assert x.result(timeout=10) == 42
    assert int(r.get(counter) or 0) == 1  # never computed again
    record = r.hmget(Keys(cluster_name).task(x.key), ["state", "who_has"])
    assert record == [b"memory", b"redis"]


def test_a_small_result_needs_no_fetch_from_the_worker_that_computed_it(two: Client) -> None:
    """With its worker stopped (SIGSTOP: it answers nobody), the result still comes,
    and a dependent runs on the other worker."""
    two.wait_for_workers(2)
    a, b = sorted(pids(two))
    x = two.submit(inc, 1, workers=[a])
    wait([x], timeout=10)
    pid = pids(two)[a]
    os.kill(pid, signal.SIGSTOP)
    try:
        assert x.result(timeout=5) == 2
        y = two.submit(inc, x, workers=[b])
        assert y.result(timeout=10) == 3
    finally:
        os.kill(pid, signal.SIGCONT)


def test_large_results_stay_on_their_workers(client: Client, cluster: LocalCluster) -> None:
    r = redis.Redis.from_url(cluster.redis_url)
    keys = Keys(cluster.cluster_name)
    before = r.info("memory")["used_memory"]
    futures = client.map(blob, range(10), n=200_000)  # 2 MB in all, each over 64 KiB
    wait(futures, timeout=30)
    for f in futures:
        value, who_has = r.hmget(keys.task(f.key), ["value", "who_has"])
        assert not value and b"redis" not in (who_has or b"").split()
    assert r.info("memory")["used_memory"] - before < 1_000_000
    assert client.gather(futures) == [blob(i, 200_000) for i in range(10)]


def test_inline_results_can_be_turned_off(
    redis_url: str, cluster_name: str, monkeypatch: pytest.MonkeyPatch, make_cluster: ClusterFactory
) -> None:
    monkeypatch.setenv("REDISDASK__WORKER__INLINE_RESULT_BYTES", "0")
    with (
        make_cluster(nanny=False, n_workers=1) as cluster,
        Client(cluster) as client,
    ):
        x = client.submit(inc, 1)
        assert x.result(timeout=10) == 2
        r = redis.Redis.from_url(redis_url)
        value, who_has = r.hmget(Keys(cluster_name).task(x.key), ["value", "who_has"])
        assert not value and who_has and b"redis" not in who_has.split()


def test_many_small_results_are_gathered_without_a_fetch(client: Client) -> None:
    futures = client.map(inc, range(3000))
    assert client.gather(futures) == list(range(1, 3001))
    assert all(f._state.value is not None for f in futures)  # came with the news


def frame_of(n: int) -> object:
    import pandas as pd

    return pd.DataFrame({"a": range(n), "b": [0.5] * n})


def test_a_small_result_with_buffers_is_pickled_in_one_piece_a_large_one_not_at_all() -> None:
    """The worker pickles a result once: in band, the form kept in Redis, while its
    buffers fit the bound; past it, ``dumps_within`` gives up at the first buffer that
    does not fit instead of copying it."""
    import pickle

    import numpy as np

    from redisdask.utils.pickling import dumps_within

    small = np.arange(100)
    blob = dumps_within(small, 65_536)
    assert blob is not None and (pickle.loads(blob) == small).all()
    assert dumps_within(np.zeros(1_000_000), 65_536) is None
    assert dumps_within(b"x" * 100_000, 65_536) is not None  # no buffer: pickled, then too big


def test_small_arrays_and_frames_are_kept_in_redis_and_read_back(
    client: Client, cluster: LocalCluster
) -> None:
    """Results pickled with out-of-band buffers (numpy, pandas) are inlined in one piece
    when small, and come back equal; a large frame stays on its worker."""
    import numpy as np

    r = redis.Redis.from_url(cluster.redis_url)
    keys = Keys(cluster.cluster_name)
    small, large = client.submit(frame_of, 100), client.submit(frame_of, 100_000)
    array = client.submit(np.arange, 1000)
    wait([small, large, array], timeout=30)
    # (a pushed task's small result may reach the client before the scheduler records it;
    # a large one is told by the scheduler, once recorded)
    poll(lambda: r.hget(keys.task(small.key), "value") and r.hget(keys.task(array.key), "value"))
    assert not r.hget(keys.task(large.key), "value")
    assert small.result().equals(frame_of(100)) and large.result().equals(frame_of(100_000))
    assert (array.result() == np.arange(1000)).all()
