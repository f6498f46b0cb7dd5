"""Ports of distributed's own tests of the cluster-wide client calls (issue 23, area
"admin"): ``restart``, ``replicate``, ``scatter``, ``who_has`` / ``has_what`` /
``nthreads`` and ``get_versions``, as a user's code sees them, on one shared cluster
(two one-thread workers without nannies: a restart forgets every task and keeps the
processes, so it changes nothing a later test relies on).

Where distributed's test reads its in-process ``Scheduler`` or ``Worker`` objects
(``s.tasks``, ``a.data``), the port asks the same question through the public API
(``who_has``, ``has_what``); where it needs more workers than two, the numbers are scaled
to two and the docstring says so."""

from __future__ import annotations

import asyncio
import time
from collections import namedtuple
from collections.abc import Iterator
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FuturesTimeoutError

import numpy as np
import pandas as pd
import pytest
import redis
from polling import poll

from redisdask import Client, LocalCluster, wait
from redisdask.client.futures import Future
from redisdask.observe.inspect import read_task
from redisdask.store.bootstrap import ensure_cluster
from redisdask.store.keyspace import Keys


def inc(x: int) -> int:
    return x + 1


def div(x: float, y: float) -> float:
    return x / y


def add(x: int, y: int) -> int:
    return x + y


@pytest.fixture
def workers(module_client: Client) -> list[str]:
    """The module cluster's two worker addresses, sorted."""
    module_client.wait_for_workers(2)
    return sorted(module_client.nthreads())


@pytest.fixture
def no_workers(redis_url: str, cluster_name: str) -> Iterator[Client]:
    """A client of a cluster that has no worker (and no scheduler): no process starts."""
    ensure_cluster(redis.Redis.from_url(redis_url), Keys(cluster_name))
    with Client(redis_url, cluster_name=cluster_name) as client:
        yield client


# --------------------------------------------------------------------------- restart


def test_restart(module_client: Client) -> None:
    """Port of distributed/tests/test_failed_workers.py::test_restart (what the client
    sees: every future cancelled, the workers back, nothing held)."""
    c = module_client
    x = c.submit(inc, 1)
    y = c.submit(inc, x)
    z = c.submit(div, 1, 0)
    assert y.result(timeout=10) == 3
    c.restart()
    assert len(c.nthreads()) == 2
    assert x.cancelled() and y.cancelled() and z.cancelled()
    assert not any(c.has_what().values())


def test_restart_sync(module_client: Client) -> None:
    """Port of distributed/tests/test_failed_workers.py::test_restart_sync (workers
    without nannies here: they drop their data and stay)."""
    c = module_client
    x = c.submit(div, 1, 2)
    x.result(timeout=10)
    assert c.who_has()
    c.restart()
    assert not any(c.who_has().values())
    assert x.cancelled()
    assert len(c.nthreads()) == 2
    with pytest.raises(CancelledError):
        x.result(timeout=10)
    assert c.submit(div, 1, 3).result(timeout=10) == 1 / 3


def test_multiple_clients_restart(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_failed_workers.py::test_multiple_clients_restart.
    Deviation: ``c.futures`` keeps the cancelled futures' states while the futures
    live (distributed empties it), so those two asserts are left out."""
    with Client(module_cluster) as c1, Client(module_cluster) as c2:
        x = c1.submit(inc, 1)
        y = c2.submit(inc, 2)
        assert x.result(timeout=10) == 2
        assert y.result(timeout=10) == 3
        c1.restart()
        assert x.cancelled()
        poll(y.cancelled, timeout=5)
        # both clients still work after the restart; reusing a key runs it anew
        x2 = c1.submit(inc, 1, key=x.key)
        y2 = c2.submit(inc, 2, key=y.key)
        assert x2.result(timeout=10) == 2
        assert y2.result(timeout=10) == 3


def test_restart_from_a_client_that_submitted_nothing(module_cluster: LocalCluster) -> None:
    """Issue 23, item 3: a client that never submitted anything restarts the cluster at
    once (it waited 30 s, then raised, though the cluster had restarted: the scheduler
    told only the clients it knew from their graphs), and another client's futures are
    cancelled, as in distributed."""
    with Client(module_cluster) as busy, Client(module_cluster) as fresh:
        x = busy.submit(inc, 1)
        assert x.result(timeout=10) == 2
        start = time.monotonic()
        fresh.restart()
        assert time.monotonic() - start < 10  # (the default timeout is 30 s)
        poll(x.cancelled, timeout=5)
        assert fresh.submit(inc, 2).result(timeout=10) == 3


# --------------------------------------------------------------------------- replicate


def test_client_replicate(module_client: Client, workers: list[str]) -> None:
    """Port of distributed/tests/test_client.py::test_client_replicate, scaled from ten
    workers to two: n=2 makes two copies, n=1 then leaves one (the surplus is dropped),
    n=None one on every worker."""
    c = module_client
    x = c.submit(inc, 1)
    y = c.submit(inc, 2)
    c.replicate([x, y], n=2)
    assert [len(h) for h in c.who_has([x, y]).values()] == [2, 2]
    c.replicate([x, y], n=1)
    assert [len(h) for h in c.who_has([x, y]).values()] == [1, 1]
    held = {w: set(keys) & {x.key, y.key} for w, keys in c.has_what().items()}
    assert sum(len(keys) for keys in held.values()) == 2  # the workers dropped them
    c.replicate([x, y])
    assert [sorted(h) for h in c.who_has([x, y]).values()] == [workers, workers]


def test_client_replicate_sync(module_client: Client) -> None:
    """Port of distributed/tests/test_client.py::test_client_replicate_sync."""
    c = module_client
    x = c.submit(inc, 1)
    y = c.submit(inc, 2)
    c.replicate([x, y], n=2)
    who_has = c.who_has()
    assert len(who_has[x.key]) == len(who_has[y.key]) == 2
    with pytest.raises(ValueError):
        c.replicate([x], n=0)


def test_replicate_tuple_keys(module_client: Client, workers: list[str]) -> None:
    """Port of distributed/tests/test_client.py::test_replicate_tuple_keys."""
    dask = pytest.importorskip("dask")
    c = module_client
    x = dask.delayed(inc)(1, dask_key_name=("x", 1))
    f = c.persist(x)
    c.replicate(f, n=5)
    assert all(c.has_what().values())  # both workers hold it
    c.rebalance(f)


# --------------------------------------------------------------------------- scatter


def test_scatter(module_client: Client, workers: list[str]) -> None:
    """Port of distributed/tests/test_client.py::test_scatter."""
    c = module_client
    d = c.scatter({"y": 20})
    assert isinstance(d["y"], Future)
    assert c.who_has(d["y"])["y"][0] in workers
    assert c.gather([d["y"]]) == [20]
    [x] = c.scatter([10])
    assert isinstance(x, Future)
    assert c.who_has(x)[x.key][0] in workers
    assert c.gather([x]) == [10]
    z = c.submit(add, x, d["y"])  # submit works on futures
    assert z.result(timeout=10) == 30
    assert c.gather([z, x]) == [30, 10]


def test_scatter_types(module_client: Client) -> None:
    """Port of distributed/tests/test_client.py::test_scatter_types (a range scatters as
    a list of one future per element)."""
    c = module_client
    d = c.scatter({"x": 1})
    assert isinstance(d, dict)
    assert list(d) == ["x"]
    for seq in [[1], (1,), {1}, frozenset([1])]:
        L = c.scatter(seq)
        assert isinstance(L, type(seq))
        assert len(L) == 1
    seq = c.scatter(range(5))
    assert isinstance(seq, list)
    assert len(seq) == 5
    assert c.gather(seq) == [0, 1, 2, 3, 4]


def test_scatter_of_an_iterator_is_refused_as_in_dask(module_client: Client) -> None:
    """Issue 23, item 5: distributed's ``scatter`` refuses an iterator or a queue with a
    TypeError (it consumed it into one future before), and a range of 100 gives 100."""
    with pytest.raises(TypeError, match="Iterators or Queues"):
        module_client.scatter(x for x in range(3))
    with pytest.raises(TypeError, match="Iterators or Queues"):
        module_client.scatter(iter([1, 2]))
    futures = module_client.scatter(range(100))
    assert len(futures) == 100
    assert module_client.gather(futures) == list(range(100))


def test_scatter_collection_subclass(module_client: Client) -> None:
    """Port of distributed/tests/test_client.py::test_scatter_collection_subclass."""

    class Bunch(dict):
        def __getattr__(self, key: str) -> object:
            try:
                return self[key]
            except KeyError:
                raise AttributeError(key) from None

    class MyList(list):
        pass

    class MySet(set):
        pass

    c = module_client
    for obj in [Bunch(a=1, b=2), MyList([1, 2, 3]), MySet({1, 2, 3})]:
        future = c.scatter(obj)
        assert isinstance(future, Future)
        result = future.result(timeout=10)
        assert type(result) is type(obj)
        assert result == obj
    future = c.scatter(Bunch(transform=10))
    assert c.submit(lambda b: b.transform, future).result(timeout=10) == 10


def test_scatter_namedtuple(module_client: Client) -> None:
    """Port of distributed/tests/test_client.py::test_scatter_namedtuple."""
    Point = namedtuple("Point", ["x", "y"])
    out = module_client.scatter(Point(1, 2))
    assert type(out) is Point
    assert all(isinstance(f, Future) for f in out)
    x_future, y_future = out
    assert (x_future.result(timeout=10), y_future.result(timeout=10)) == (1, 2)
    assert (out.x.result(timeout=10), out.y.result(timeout=10)) == (1, 2)


def test_scatter_non_list(module_client: Client) -> None:
    """Port of distributed/tests/test_client.py::test_scatter_non_list."""
    x = module_client.scatter(1)
    assert isinstance(x, Future)
    assert x.result(timeout=10) == 1


def test_scatter_singletons(module_client: Client) -> None:
    """Port of distributed/tests/test_client.py::test_scatter_singletons."""
    for x in [1, np.ones(5), pd.DataFrame({"x": [1, 2, 3]})]:
        future = module_client.scatter(x)
        assert str(future.result(timeout=10)) == str(x)


def test_scatter_typename(module_client: Client) -> None:
    """Port of distributed/tests/test_client.py::test_scatter_typename."""
    assert module_client.scatter(123).key.startswith("int")


def test_scatter_hash(module_client: Client) -> None:
    """Port of distributed/tests/test_client.py::test_scatter_hash."""
    x = module_client.scatter(123)
    y = module_client.scatter(123)
    assert x.key == y.key
    z = module_client.scatter(123, hash=False)
    assert z.key != y.key


def test_scatter_hash_2(module_client: Client) -> None:
    """Port of distributed/tests/test_client.py::test_scatter_hash_2."""
    [a] = module_client.scatter([1])
    [b] = module_client.scatter([1])
    assert a.key == b.key


def test_directed_scatter(module_client: Client, workers: list[str]) -> None:
    """Port of distributed/tests/test_client.py::test_directed_scatter (by address, then
    by the worker's name; ``has_what`` in place of the workers' ``data``)."""
    c = module_client
    a, b = workers
    abc = c.scatter([1, 2, 3], workers=[a])
    assert all(c.who_has(f)[f.key] == [a] for f in abc)
    name = c.scheduler_info()["workers"][b]["name"]
    de = c.scatter([4, 5], workers=[name])
    assert all(c.who_has(f)[f.key] == [b] for f in de)
    assert {f.key for f in de} <= set(c.has_what(b)[b])
    assert not {f.key for f in de} & set(c.has_what([a])[a])


def test_scatter_direct(module_client: Client, workers: list[str]) -> None:
    """Port of distributed/tests/test_client.py::test_scatter_direct."""
    future = module_client.scatter(123, direct=True)
    assert module_client.who_has(future)[future.key][0] in workers
    assert future.status == "finished"
    assert future.result(timeout=10) == 123


def test_scatter_direct_numpy(module_client: Client) -> None:
    """Port of distributed/tests/test_client.py::test_scatter_direct_numpy."""
    x = np.ones(5)
    future = module_client.scatter(x, direct=True)
    assert np.allclose(x, future.result(timeout=10))


def test_scatter_direct_broadcast(module_client: Client, workers: list[str]) -> None:
    """Port of distributed/tests/test_client.py::test_scatter_direct_broadcast."""
    future2 = module_client.scatter(456, direct=True, broadcast=True)
    assert sorted(module_client.who_has(future2)[future2.key]) == workers
    assert future2.result(timeout=10) == 456


def test_scatter_direct_broadcast_target(module_client: Client, workers: list[str]) -> None:
    """Port of distributed/tests/test_client.py::test_scatter_direct_broadcast_target,
    scaled from four workers to two (one target, then a broadcast to both)."""
    c = module_client
    a, _ = workers
    futures = c.scatter([123, 456], direct=True, workers=a)
    assert all(c.who_has(f)[f.key] == [a] for f in futures)
    futures = c.scatter([124, 457], direct=True, broadcast=True, workers=workers)
    assert all(sorted(c.who_has(f)[f.key]) == workers for f in futures)


def test_scatter_direct_empty(no_workers: Client) -> None:
    """Port of distributed/tests/test_client.py::test_scatter_direct_empty."""
    with pytest.raises((ValueError, TimeoutError)):
        no_workers.scatter(123, direct=True, timeout=0.1)


def test_scatter_raises_if_no_workers(no_workers: Client) -> None:
    """Port of distributed/tests/test_client.py::test_scatter_raises_if_no_workers."""
    with pytest.raises(TimeoutError):
        no_workers.scatter(1, timeout=0.01)


def test_scatter_direct_spread_evenly(module_client: Client, workers: list[str]) -> None:
    """Port of distributed/tests/test_client.py::test_scatter_direct_spread_evenly,
    scaled from five workers to two: one value at a time still reaches every worker."""
    futures = [module_client.scatter(i + 1000, direct=True) for i in range(10)]
    holders = {w for f in futures for w in module_client.who_has(f)[f.key]}
    assert holders == set(workers)


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("broadcast", [True, False])
def test_scatter_gather_sync(module_client: Client, direct: bool, broadcast: bool) -> None:
    """Port of distributed/tests/test_client.py::test_scatter_gather_sync (without the
    dask.delayed compute, which is not about scatter)."""
    futures = module_client.scatter([1, 2, 3], direct=direct, broadcast=broadcast)
    assert module_client.gather(futures, direct=direct) == [1, 2, 3]


def test_scatter_dict_workers(module_client: Client, workers: list[str]) -> None:
    """Port of distributed/tests/test_client.py::test_scatter_dict_workers."""
    d = module_client.scatter({"a": 10}, workers=workers)  # (kept: else released)
    assert module_client.who_has()["a"][0] in workers
    assert d["a"].result(timeout=10) == 10


def test_multiple_scatter(module_client: Client) -> None:
    """Port of distributed/tests/test_client.py::test_multiple_scatter (the five
    scatters run concurrently in threads: the client is blocking here)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(5) as pool:
        futures = list(pool.map(lambda _: module_client.scatter(1, direct=True), range(5)))
    assert futures[0].result(timeout=10) == 1
    assert futures[0].result(timeout=10) == 1


# --------------------------------------------------------------------------- diagnostics


def test_diagnostic_ui(module_client: Client, workers: list[str]) -> None:
    """Port of distributed/tests/test_client.py::test_diagnostic_ui (a fresh client's
    keys: the shared cluster holds nothing else once the other tests' clients closed)."""
    c = module_client
    a_addr, b_addr = workers
    assert c.nthreads() == {a_addr: 1, b_addr: 1}
    assert c.nthreads([a_addr]) == {a_addr: 1}
    assert c.nthreads(a_addr) == {a_addr: 1}
    x, y, z = c.submit(inc, 1), c.submit(inc, 2), c.submit(inc, 3)
    wait([x, y, z])
    poll(lambda: {x.key, y.key, z.key} <= set(c.who_has()), timeout=5)
    d = c.who_has()
    assert {x.key, y.key, z.key} <= set(d)
    assert all(w in [a_addr, b_addr] for v in d.values() for w in v)
    assert all(d[k] for k in (x.key, y.key, z.key))
    assert set(c.who_has([x, y])) == {x.key, y.key}
    assert set(c.who_has(x)) == {x.key}
    d = c.has_what()
    assert set(d) == {a_addr, b_addr}
    assert {x.key, y.key, z.key} <= {k for v in d.values() for k in v}
    assert set(c.has_what([a_addr])) == {a_addr}
    assert set(c.has_what(a_addr)) == {a_addr}


def test_who_has_names_only_workers_and_inspect_says_the_result_is_in_redis(
    module_client: Client, module_cluster: LocalCluster, workers: list[str]
) -> None:
    """Issue 23, item 5: a small result lives in its task's record in Redis too; the
    record names that place ``redis``, which ``inspect task`` showed among the holders.
    ``who_has``/``has_what`` name only workers; ``inspect task`` says "in Redis"."""
    c = module_client
    x = c.submit(inc, 41)
    assert x.result(timeout=10) == 42
    r = redis.Redis.from_url(module_cluster.redis_url)
    keys = Keys(module_cluster.cluster_name)
    poll(lambda: b"redis" in (r.hget(keys.task(x.key), "who_has") or b""), timeout=5)
    assert all(w in workers for v in c.who_has().values() for w in v)
    assert set(c.has_what()) == set(workers)
    task = read_task(r, keys, x.key)
    assert task["in_redis"] is True
    assert task["who_has"] and set(task["who_has"]) <= set(workers)


# --------------------------------------------------------------------------- versions


def test_get_versions_sync(module_client: Client) -> None:
    """Port of distributed/tests/test_client.py::test_get_versions_sync (with pytest in
    place of requests, which is not installed here)."""
    c = module_client
    v = c.get_versions()
    assert v["scheduler"] is not None
    assert v["client"] is not None
    assert len(v["workers"]) == 2
    for wv in v["workers"].values():
        assert wv is not None
    c.get_versions(check=True)
    v = c.get_versions(packages=["pytest"])
    assert v["client"]["packages"]["pytest"] == pytest.__version__
    assert set(v["client"]) == {"host", "packages"}  # distributed's shape
    assert all(w["packages"]["pytest"] == pytest.__version__ for w in v["workers"].values())


def test_get_versions_async(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_client.py::test_get_versions_async."""

    async def main() -> None:
        async with Client(module_cluster, asynchronous=True) as c:
            v = await c.get_versions(check=True)
            assert v.keys() == {"scheduler", "client", "workers"}

    asyncio.run(main())


def test_get_versions_check_raises_a_value_error(
    module_client: Client, module_cluster: LocalCluster
) -> None:
    """As distributed's ``get_versions(check=True)``, a mismatch raises a ValueError
    naming the package (a forged scheduler record stands for another install)."""
    from redisdask.store.codecs import pack, unpack

    r = redis.Redis.from_url(module_cluster.redis_url)
    keys = Keys(module_cluster.cluster_name)
    recorded = r.hget(keys.scheduler, "versions")
    r.hset(keys.scheduler, "versions", pack({**unpack(recorded), "cloudpickle": "0.0.1"}))
    try:
        with pytest.raises(ValueError, match="cloudpickle"):
            module_client.get_versions(check=True)
    finally:
        r.hset(keys.scheduler, "versions", recorded)


def test_restart_timeout_is_a_timeout_error(no_workers: Client) -> None:
    """``restart`` with no scheduler to take it up raises TimeoutError (as distributed's
    when the cluster does not restart in time), saying why."""
    with pytest.raises(FuturesTimeoutError, match="scheduler"):
        no_workers.restart(timeout=0.2)
