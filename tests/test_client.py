"""End to end: a real Redis, a real scheduler and real worker processes."""

from __future__ import annotations

import operator
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import redis
from conftest import ClusterFactory
from polling import poll

from redisdask import Client, FutureCancelledError, LocalCluster, as_completed, wait
from redisdask.store.bootstrap import ensure_cluster
from redisdask.store.keyspace import Keys

pytestmark = pytest.mark.timeout(60)


def inc(x: int) -> int:
    return x + 1


def add(a: int, b: int) -> int:
    return a + b


def div(a: float, b: float) -> float:
    return a / b


def where() -> str:
    from redisdask.workers import get_worker

    return get_worker().address


def block_until_released(redis_url: str, key: str) -> str:
    """Blocks a worker thread until the test pushes to ``key`` (BLPOP, not a sleep)."""
    r = redis.Redis.from_url(redis_url)
    assert r.blpop([key], timeout=30) is not None, "the test never released the task"
    return "released"


def test_submit_and_result(client: Client) -> None:
    assert client.submit(inc, 1).result(timeout=10) == 2


def test_error_propagates_to_dependents(client: Client) -> None:
    """The example from Dask's docs."""
    x = client.submit(div, 1, 0)
    y = client.submit(add, x, 10)
    with pytest.raises(ZeroDivisionError):
        x.result(timeout=10)
    with pytest.raises(ZeroDivisionError) as info:
        y.result(timeout=10)
    assert info.traceback[-1].name == "div"  # the original traceback travelled along
    assert isinstance(x.exception(), ZeroDivisionError)
    assert x.status == y.status == "error"
    assert client.submit(inc, 41).result(timeout=10) == 42  # nothing else is affected


def test_chain_of_1000(client: Client) -> None:
    x = client.submit(inc, 0)
    for _ in range(999):
        x = client.submit(inc, x)
    assert x.result(timeout=30) == 1000


def test_tree_reduction_4096_leaves(client: Client) -> None:
    level = client.map(inc, range(4096))
    while len(level) > 1:
        level = [client.submit(add, a, b) for a, b in zip(level[::2], level[1::2], strict=True)]
    assert level[0].result(timeout=45) == sum(range(1, 4097))


def test_map_10000_gathered(client: Client) -> None:
    futures = client.map(inc, range(10_000))
    assert client.gather(futures) == list(range(1, 10_001))


def test_dict_graph_with_tuple_keys(client: Client) -> None:
    dsk = {
        ("x", 0): 1,
        ("x", 1): (inc, ("x", 0)),
        "y": (add, ("x", 0), ("x", 1)),
        "z": (sum, [("x", 0), ("x", 1), "y"]),  # keys inside a list
        "w": (add, (inc, "y"), 100),  # a nested task
    }
    assert client.get(dsk, "y") == 3
    assert client.get(dsk, ["z", ["w"]]) == [6, [104]]


def test_futures_nested_in_arguments(client: Client) -> None:
    a, b = client.submit(inc, 1), client.submit(inc, 2)
    f = client.submit(lambda xs, t, d: sum(xs) + t[0] + d["k"], [a, b], (b,), {"k": a})
    assert f.result(timeout=10) == (2 + 3) + 3 + 2


def test_pure_and_impure_keys(client: Client) -> None:
    assert client.submit(inc, 1).key == client.submit(inc, 1).key
    assert client.submit(inc, 1).key.startswith("inc-")
    assert client.submit(inc, 1, pure=False).key != client.submit(inc, 1, pure=False).key


def test_numpy_50mb_moves_peer_to_peer(client: Client, cluster) -> None:  # type: ignore[no-untyped-def]
    a, b = sorted(client.scheduler_info()["workers"])
    r = redis.Redis.from_url(cluster.redis_url)
    before = r.info("memory")["used_memory"]
    x = client.submit(np.ones, 50_000_000 // 8, workers=[a])
    y = client.submit(lambda arr: (where(), float(arr.sum()), arr.nbytes), x, workers=[b])
    ran_on, s, nbytes = y.result(timeout=30)
    assert (ran_on, s, nbytes) == (b, 50_000_000 / 8, 50_000_000)
    assert client.who_has(x)[x.key] == [a]
    # the array crossed a -> b over TCP: Redis never held anything near its size
    assert r.info("memory")["used_memory"] - before < 5_000_000
    sizes = [r.memory_usage(k) or 0 for k in r.scan_iter(f"{Keys(cluster.cluster_name).prefix}*")]
    assert max(sizes) < 1_000_000
    np.testing.assert_array_equal(x.result(timeout=10)[:3], [1.0, 1.0, 1.0])


def test_cancel_pending_tasks(client: Client, cluster) -> None:  # type: ignore[no-untyped-def]
    """Cancel tasks that wait in the ready set while every worker is busy."""
    r = redis.Redis.from_url(cluster.redis_url)
    keys = Keys(cluster.cluster_name)
    gate = f"gate-{cluster.cluster_name}"
    blockers = [
        client.submit(block_until_released, cluster.redis_url, gate, workers=w, pure=False)
        for w in client.nthreads()
    ]
    poll(lambda: all(f.key in _executing(r, keys) for f in blockers))
    # a busy worker claims nothing ahead (its tasks' durations are unknown): all wait
    # in the ready set (queued)
    pending = client.map(inc, range(100, 105))
    poll(lambda: r.zcard(keys.ready) == 5)
    client.cancel(pending)
    assert all(f.cancelled() for f in pending)
    with pytest.raises(FutureCancelledError):
        pending[0].result(timeout=5)
    poll(lambda: not any(r.exists(keys.task(f.key)) for f in pending))  # forgotten
    assert r.zcard(keys.ready) == 0
    r.lpush(gate, 1, 1)
    assert client.gather(blockers) == ["released", "released"]
    assert all(f.status == "cancelled" for f in pending)
    assert client.submit(inc, 1).result(timeout=10) == 2
    # (a pushed task's result may reach the client before the scheduler records it)
    poll(lambda: sum(r.scard(keys.worker_processing(w)) for w in client.nthreads()) == 0)


def _executing(r: redis.Redis, keys: Keys) -> set[str]:
    return {
        k.decode()
        for w in r.hkeys(keys.workers)
        for k in r.smembers(keys.worker_processing(w.decode()))
    }


def test_two_clients_with_overlapping_keys(cluster) -> None:  # type: ignore[no-untyped-def]
    with Client(cluster) as c1, Client(cluster) as c2:
        f1 = c1.submit(inc, 10)
        f2 = c2.submit(inc, 10)
        assert f1.key == f2.key
        assert f1.result(timeout=10) == f2.result(timeout=10) == 11
        r = redis.Redis.from_url(cluster.redis_url)
        keys = Keys(cluster.cluster_name)
        c1.close()
        assert f2.result(timeout=10) == 11  # still held for c2
        assert r.sismember(keys.client_wants(c2.id), f2.key)
        g = c2.submit(add, f2, 1)
        assert g.result(timeout=10) == 12
        key = f2.key
        c2.close()
        poll(lambda: not r.exists(keys.task(key)))  # nobody wants it: forgotten


def test_scatter_and_broadcast(client: Client) -> None:
    [x] = client.scatter([np.arange(10)])
    assert client.submit(np.sum, x).result(timeout=10) == 45
    y = client.scatter({"big": 5}, broadcast=True)["big"]
    assert sorted(client.who_has(y)[y.key]) == sorted(client.scheduler_info()["workers"])
    assert client.submit(inc, y).result(timeout=10) == 6


def test_scattering_a_released_value_again_keeps_the_new_copy(
    cluster: LocalCluster, client: Client
) -> None:
    """A value scattered again (same key) to the worker that held its released copy:
    the scheduler's free-keys for the old copy reaches the worker after the new data
    did, and must not drop it.  It did (issue 10, item 11): the scheduler named the
    worker as the holder, a dependent claimed there waited for the data forever."""
    a = sorted(client.scheduler_info()["workers"])[0]
    r = redis.Redis.from_url(cluster.redis_url)
    keys = Keys(cluster.cluster_name)
    [x] = client.scatter([41], workers=[a])
    key = x.key
    poll(lambda: r.hget(keys.task(key), "state") == b"memory")
    scheduler = psutil.Process(cluster.scheduler_process.pid)  # type: ignore[union-attr]
    scheduler.suspend()  # the release and the new scatter's news wait for it, in order
    try:
        poll(lambda: scheduler.status() == psutil.STATUS_STOPPED)
        del x
        z = client.submit(inc, 0)  # a send: carries the release of the scattered key
        [x] = client.scatter([41], workers=[a])  # the data reaches the worker at once
        assert x.key == key
    finally:
        scheduler.resume()
    y = client.submit(inc, x, workers=[a])
    assert y.result(timeout=10) == 42
    assert x.result(timeout=10) == 41 and z.result(timeout=10) == 1


def test_wait_as_completed_and_callbacks(client: Client) -> None:
    futures = client.map(inc, range(20))
    done, not_done = wait(futures, timeout=20)
    assert len(done) == 20 and not not_done
    results = sorted(r for _f, r in as_completed(client.map(inc, range(5, 10)), with_results=True))
    assert results == [6, 7, 8, 9, 10]
    called = threading.Event()
    client.submit(inc, 1000).add_done_callback(lambda f: called.set())
    assert called.wait(10)


def test_scheduler_info(client: Client) -> None:
    info = client.scheduler_info()
    assert len(info["workers"]) == 2
    for address, worker in info["workers"].items():
        assert address.startswith("tcp://127.0.0.1:")
        assert worker["nthreads"] == 1
        assert worker["versions"]["python"]


def test_closed_client_releases_its_keys(cluster) -> None:  # type: ignore[no-untyped-def]
    r = redis.Redis.from_url(cluster.redis_url)
    keys = Keys(cluster.cluster_name)
    with Client(cluster) as c:
        futures = c.map(operator.neg, range(50))
        c.gather(futures)
        task_keys = [f.key for f in futures]
    poll(lambda: not any(r.exists(keys.task(k)) for k in task_keys))


def test_released_future_is_forgotten(client: Client, cluster) -> None:  # type: ignore[no-untyped-def]
    r = redis.Redis.from_url(cluster.redis_url)
    keys = Keys(cluster.cluster_name)
    f = client.submit(inc, 7)
    assert f.result(timeout=10) == 8
    key = f.key
    del f  # the last reference: the client releases the key in its next message
    client.submit(inc, 8).result(timeout=10)
    poll(lambda: not r.exists(keys.task(key)))


def test_map_of_100000_is_sent_in_a_few_batched_entries(redis_url: str, cluster_name: str) -> None:
    """No scheduler runs here, so the client stream keeps what the client wrote."""
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)  # as a scheduler that stopped leaves it
    with Client(redis_url, cluster_name=cluster_name) as c:
        calls_before = r.info("commandstats").get("cmdstat_xadd", {}).get("calls", 0)
        futures = c.map(inc, range(100_000))
        assert len({f.key for f in futures}) == 100_000
        batch = c.config.client.submit_batch
        # map does not wait for the write (as in distributed): the sender task writes it
        poll(lambda: r.xlen(keys.client_stream) == 100_000 // batch, timeout=60)
        calls = r.info("commandstats")["cmdstat_xadd"]["calls"] - calls_before
        assert calls <= 100_000 // batch + 2  # (+ a heartbeat-time release, at most)


def test_local_cluster_with_workers_in_threads(make_cluster: ClusterFactory) -> None:

    with (
        make_cluster(
            nanny=False,
            n_workers=2,
            processes=False,
        ) as cluster,
        Client(cluster) as client,
    ):
        assert len(cluster.subprocesses) == 1  # only the scheduler
        a, b = sorted(client.scheduler_info()["workers"])
        x = client.submit(np.arange, 1_000_000, workers=a)
        y = client.submit(lambda arr: (where(), int(arr.sum())), x, workers=b)
        assert y.result(timeout=20) == (b, 499999500000)
        threads = [w.thread for w in cluster.thread_workers]
    assert not any(t.is_alive() for t in threads)


def test_tasks_allowed_on_several_workers_leave_no_stale_queue_entries(
    client: Client,
    cluster,  # type: ignore[no-untyped-def]
) -> None:
    r = redis.Redis.from_url(cluster.redis_url)
    keys = Keys(cluster.cluster_name)
    both = sorted(client.nthreads())
    assert client.gather(client.map(inc, range(10), workers=both)) == list(range(1, 11))
    assert [r.zcard(keys.worker_ready(w)) for w in both] == [0, 0]
    # each worker still claims from its own set and from the shared one
    assert client.gather([client.submit(where, workers=w, pure=False) for w in both]) == both
    assert client.gather(client.map(inc, range(100, 110))) == list(range(101, 111))


def test_a_restriction_may_name_a_worker_or_a_host(client: Client) -> None:
    """As in Dask: ``workers=`` takes addresses, worker names and hosts."""
    info = client.scheduler_info()["workers"]
    for address, worker in info.items():
        assert (
            client.submit(where, workers=worker["name"], pure=False).result(timeout=10) == address
        )
    hosts = {"127.0.0.1", next(iter(info.values()))["host"]}  # of the address; the hostname
    for host in hosts:
        ran = client.gather([client.submit(where, workers=host, pure=False) for _ in range(4)])
        assert set(ran) <= set(info)


def test_cancel_then_submit_the_same_key_again(client: Client) -> None:
    for i in range(5):
        f = client.submit(inc, 1000 + i)
        f.cancel()
        g = client.submit(inc, 1000 + i)  # same pure key, submitted after the cancel
        assert g.result(timeout=10) == 1001 + i
        assert g.status == "finished"


def test_a_key_released_and_resubmitted_at_once_still_resolves(client: Client) -> None:
    for i in range(20):
        f = client.submit(inc, 2000 + i)
        assert f.result(timeout=10) == 2001 + i
        del f  # queued for release; the next submit sends the release first
        assert client.submit(inc, 2000 + i).result(timeout=10) == 2001 + i


def test_a_graph_larger_than_one_submission_batch(client: Client) -> None:
    """12,000 tasks in three stream entries, listed dependents first: the scheduler must
    not forget a chunk's tasks before the chunks that need them arrive."""
    n = 6_000
    dsk: dict[Any, Any] = {("sum", i): (add, ("x", i), ("x", i + 1)) for i in range(n - 1)}
    dsk.update({("x", i): (inc, i) for i in range(n)})
    out = client.get(dsk, [("sum", 0), ("sum", n - 2)])
    assert out == [1 + 2, (n - 1) + n]


def test_a_cyclic_graph_is_refused(client: Client) -> None:
    with pytest.raises(ValueError, match="cycle"):
        client.get({"a": (inc, "b"), "b": (inc, "a")}, "a")


def test_large_arguments_go_in_several_entries(client: Client) -> None:
    blobs = [bytes([i]) * 2_000_000 for i in range(20)]  # 40 MB of arguments
    assert client.gather(client.map(len, blobs)) == [2_000_000] * 20


def test_released_results_leave_the_workers_memory(make_cluster: ClusterFactory) -> None:
    """free-keys reaches the workers whichever way it comes (listener or claim)."""

    with (
        make_cluster(
            nanny=False,
            n_workers=2,
            processes=False,
        ) as cluster,
        Client(cluster) as client,
    ):
        for round_ in range(3):
            futures = client.map(inc, range(round_ * 1000, round_ * 1000 + 300))
            client.gather(futures)
            del futures
        client.submit(inc, -1).result(timeout=10)  # carries the last releases
        data = [w.worker.state.data for w in cluster.thread_workers]
        poll(lambda: sum(len(d) for d in data) == 1, timeout=15)  # only inc(-1) is left


# ------------------------------------------------------------------ a failed run is not kept


@pytest.fixture
def lone_worker(redis_url: str, cluster_name: str) -> Iterator[LocalCluster]:
    """One worker: every run and every retry of a task happens on it."""
    with LocalCluster(
        nanny=False, n_workers=1, redis_url=redis_url, cluster_name=cluster_name
    ) as cluster:
        yield cluster


def count_and_fail(redis_url: str, counter: str) -> None:
    runs = redis.Redis.from_url(redis_url).incr(counter)
    raise ValueError(f"run {runs} failed")


def fail_the_first_time(path: str) -> str:
    if not os.path.exists(path):
        open(path, "w").close()  # a marker file
        raise ValueError("the first run failed")
    return "the second run worked"


def test_retries_run_the_function_again_on_the_worker_where_it_failed(
    lone_worker: LocalCluster,
) -> None:
    r = redis.Redis.from_url(lone_worker.redis_url)
    counter = f"runs-{lone_worker.cluster_name}"
    with Client(lone_worker) as client:
        f = client.submit(count_and_fail, lone_worker.redis_url, counter, retries=3)
        with pytest.raises(ValueError, match="run 4 failed"):
            f.result(timeout=20)
    assert int(r.get(counter)) == 4  # the first run and three retries, all on one worker


def test_a_key_that_erred_and_was_released_runs_again_when_submitted_again(
    lone_worker: LocalCluster, tmp_path: Path
) -> None:
    r = redis.Redis.from_url(lone_worker.redis_url)
    keys = Keys(lone_worker.cluster_name)
    marker = str(tmp_path / "ran-once")
    with Client(lone_worker) as first:
        f = first.submit(fail_the_first_time, marker)
        with pytest.raises(ValueError, match="the first run failed"):
            f.result(timeout=10)
        key = f.key
    poll(lambda: not r.exists(keys.task(key)))  # released with its client, and forgotten
    with Client(lone_worker) as second:  # another client's graph, the same (pure) key
        g = second.submit(fail_the_first_time, marker)
        assert g.key == key
        assert g.result(timeout=10) == "the second run worked"


def test_a_future_collected_while_another_thread_holds_the_clients_lock_does_not_wait(
    cluster: LocalCluster,
) -> None:
    """``Future.__del__`` runs in whatever thread the garbage collector starts in, at any
    instant.  It took the client's lock, so a thread that held the lock and waited for
    that one deadlocked: a CI run hung in ``Client.close``, whose loop thread, holding
    the lock, waited for a new callback thread to start while that thread, collecting
    cycles in its bootstrap, ran a future's ``__del__`` and waited for the lock."""
    with Client(cluster) as client:
        future = client.submit(inc, 1)
        assert future.result(timeout=20) == 2
        key, holder, dropped = future.key, [future], threading.Event()
        del future

        def drop() -> None:
            holder.clear()  # the last reference: ``__del__`` runs here
            dropped.set()

        with client._lock:  # as the loop thread holds it while it waits
            thread = threading.Thread(target=drop)
            thread.start()
            assert dropped.wait(10), "Future.__del__ waited for the client's lock"
        thread.join(timeout=10)
        assert key not in client.refcount  # counted down at the next look
        # and released: the scheduler forgets it (the client's heartbeat sends it)
        poll(lambda: not cluster.redis.exists(cluster.keys.task(key)), timeout=20)


def test_a_gather_reports_only_the_holders_on_record_that_answered_without_the_key():
    """A holder named by news older than a move (a rebalance, a retirement) answers
    without the key, and that is no fault: only a holder the record still names is
    reported (once), and such reports are not the unreachable holders that make a
    client give up."""
    from redisdask.client.fetch import _Tries
    from redisdask.store.keyspace import REDIS_COPY

    tries = _Tries({"x": 1})
    for holder in ("tcp://moved-from:1", "tcp://dropped-it:1", REDIS_COPY):
        tries.missed("x", holder, None)
    recorded = ["tcp://dropped-it:1", "tcp://other:1", REDIS_COPY]
    assert tries.to_report_absent("x", recorded) == ["tcp://dropped-it:1"]
    assert tries.to_report_absent("x", recorded) == []
    assert tries.to_report(["x"]) == {}  # (the unreachable ones: none)
