"""Tasks that submit tasks (issue 12, item 3): ``get_client``, ``worker_client``,
``secede``/``rejoin``, futures inside tasks and ``get_worker``, on real clusters (a real
Redis, a real scheduler, real worker processes or threads)."""

from __future__ import annotations

import functools
import os
import signal
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from polling import poll

import redisdask
import redisdask.workers
from redisdask import (
    Client,
    Future,
    LocalCluster,
    comm,
    get_client,
    get_worker,
    rejoin,
    secede,
    worker_client,
)
from redisdask.client import default_client
from redisdask.errors import DataUnavailableError
from redisdask.store import bootstrap, codecs, keyspace

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------- tasks


def fib(n: int) -> int:
    """As distributed's documentation writes it."""
    if n < 2:
        return n
    with worker_client() as client:
        a = client.submit(fib, n - 1)
        b = client.submit(fib, n - 2)
        a, b = client.gather([a, b])
    return a + b


def fib_seceding(n: int) -> int:
    """The other style of distributed's documentation: get_client, secede, rejoin."""
    if n < 2:
        return n
    client = get_client()
    a = client.submit(fib_seceding, n - 1)
    b = client.submit(fib_seceding, n - 2)
    secede()
    a, b = client.gather([a, b])
    rejoin()
    return a + b


def inc(x: int) -> int:
    return x + 1


def wait_for(path: Path) -> None:
    """Block the task until the test creates ``path`` (polled; at most a minute)."""
    poll(path.exists, timeout=60)


def secede_then_rejoin(d: str) -> str:
    secede()
    (Path(d) / "seceded").touch()
    wait_for(Path(d) / "go-rejoin")
    rejoin()
    return "rejoined"


def hold_the_thread(d: str) -> str:
    (Path(d) / "held").touch()
    wait_for(Path(d) / "go-hold")
    return "held"


def where() -> str:
    """Raises ValueError anywhere but in a task on a worker's thread."""
    return get_worker().address


def computes_with_dask() -> Any:
    import dask

    with worker_client():
        return dask.compute(dask.delayed(where)(), dask.delayed(inc)(1))


def whose_client() -> tuple[str, bool, str]:
    client = get_client()
    return client.id, default_client() is client, get_worker().address


def worker_info(dep_key: str, dep: int) -> dict[str, Any]:
    w = get_worker()
    return {
        "address": w.address,
        "name": w.name,
        "nthreads": w.nthreads,
        "holds_dependency": dep_key in w.data,
        "same_function": redisdask.get_worker is redisdask.workers.get_worker,
    }


class Reader:
    """A callable object that carries a future to the worker."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def __call__(self) -> Any:
        return self.future.result(timeout=30) * 10


class HoldsAFuture:
    """Reads its future, waits for the test, reads it again."""

    def __init__(self, future: Future, d: str) -> None:
        self.future, self.d = future, Path(d)

    def __call__(self) -> tuple[int, int]:
        first = self.future.result(timeout=30)
        # written whole, then renamed: the test polls for the name and reads it at once
        (self.d / "first.part").write_text(get_client().id)
        (self.d / "first.part").rename(self.d / "first")
        wait_for(self.d / "go")
        return first, self.future.result(timeout=30)  # fetched again: still there


def child(i: int, d: str) -> int:
    (Path(d) / f"child-{i}-{os.getpid()}").touch()
    wait_for(Path(d) / "go")
    return i * i


def parent(d: str, n: int) -> int:
    (Path(d) / f"parent-{os.getpid()}").touch()
    with worker_client() as client:
        futures = client.map(child, range(n), d=d)
        return sum(client.gather(futures))


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def cluster_of(redis_url: str, cluster_name: str) -> Callable[..., LocalCluster]:
    """``LocalCluster(n_workers, threads_per_worker, ...)`` on the session's Redis."""
    return functools.partial(LocalCluster, redis_url=redis_url, cluster_name=cluster_name)


def task_records(cluster: LocalCluster) -> list[bytes]:
    return list(cluster.redis.scan_iter(match=cluster.keys.task("*"), count=1000))


def inspect_worker(client: Client, address: str) -> dict[str, Any]:
    pool = comm.BlockingPool(client.secret, timeout=5)
    try:
        header, _ = pool.rpc(address, {"op": "inspect"})
    finally:
        pool.close()
    return header


# --------------------------------------------------------------------------- tests


def test_fib_20_with_worker_client_on_two_workers_of_two_threads(
    cluster_of: Callable[..., LocalCluster],
) -> None:
    with cluster_of(2, 2) as cluster, Client(cluster) as client:
        future = client.submit(fib, 20)
        assert future.result(timeout=90) == 6765
        assert client.submit(fib_seceding, 20).result(timeout=90) == 6765
        del future
        # the workers' clients let go of what their tasks submitted, and the user of the
        # rest: nothing is left behind in Redis
        poll(lambda: not task_records(cluster), timeout=30)


@pytest.mark.parametrize("function", [fib, fib_seceding])
def test_fib_10_on_one_worker_with_one_thread(
    cluster_of: Callable[..., LocalCluster], function: Any
) -> None:
    """Every parent waits on its children in the only worker's only thread: each one
    that secedes frees that thread's slot for the next task, so nothing deadlocks."""
    with cluster_of(1, 1) as cluster, Client(cluster) as client:
        assert client.submit(function, 10).result(timeout=60) == 55


def test_rejoin_blocks_until_a_slot_is_free(
    cluster_of: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    d = str(tmp_path)
    with cluster_of(1, 1) as cluster, Client(cluster) as client:
        [address] = [a.decode() for a in cluster.redis.hkeys(cluster.keys.workers)]
        seceded = client.submit(secede_then_rejoin, d)
        poll((tmp_path / "seceded").exists)
        holder = client.submit(hold_the_thread, d)  # runs: the seceded task left the slot
        poll((tmp_path / "held").exists)
        (tmp_path / "go-rejoin").touch()
        poll(lambda: inspect_worker(client, address)["rejoining"] == [seceded.key])
        summary = inspect_worker(client, address)
        assert summary["tasks"][seceded.key] == "long-running"
        assert not seceded.done()  # its thread waits in rejoin() for the held slot
        (tmp_path / "go-hold").touch()
        assert seceded.result(timeout=30) == "rejoined"
        assert holder.result(timeout=30) == "held"
        story = [tuple(entry[:3]) for entry in inspect_worker(client, address)["story"]]
        key = seceded.key
        assert (key, "executing", "long-running") in story
        assert (key, "long-running", "executing") in story  # it counted again
        assert (key, "executing", "memory") in story


def test_a_future_in_a_closure_or_an_object_is_a_future_in_the_task(
    client: Client,
) -> None:
    x = client.submit(inc, 1)

    def uses_x() -> tuple[int, bool, str]:
        return x.result(timeout=30) + 1, x.client is get_client(), x.client.id

    value, bound_to_the_workers_client, client_id = client.submit(uses_x).result(timeout=30)
    assert value == 3 and bound_to_the_workers_client and client_id != client.id
    assert client.submit(Reader(x)).result(timeout=30) == 20
    # a future among the arguments stays a dependency: its value, as in Dask
    assert client.submit(inc, x).result(timeout=30) == 3


def test_a_future_unpickled_in_a_task_keeps_its_key_wanted(
    client: Client, cluster: LocalCluster, tmp_path: Path
) -> None:
    x = client.submit(inc, 1)
    key = x.key
    task = client.submit(HoldsAFuture(x, str(tmp_path)))
    poll((tmp_path / "first").exists)
    worker_client_id = (tmp_path / "first").read_text()
    del x  # the user lets go of the key: only the task's future wants it now
    r = cluster.redis
    poll(lambda: not r.sismember(cluster.keys.client_wants(client.id), key))
    assert r.sismember(cluster.keys.client_wants(worker_client_id), key)
    assert r.hget(cluster.keys.task(key), "state") == b"memory"
    (tmp_path / "go").touch()
    assert task.result(timeout=30) == (2, 2)
    # once the task is done its future goes (the function that held it is not cached):
    # the key is released and forgotten
    poll(lambda: not r.exists(cluster.keys.task(key)), timeout=30)


def test_a_future_of_a_key_the_scheduler_forgot_errs_in_the_task(client: Client) -> None:
    ghost = Future(f"ghost-{uuid.uuid4().hex}", client)  # the scheduler never heard of it

    def reads_the_ghost() -> Any:
        return ghost.result(timeout=30)

    with pytest.raises(DataUnavailableError, match="unknown to the scheduler"):
        client.submit(reads_the_ghost).result(timeout=30)


def test_get_worker_inside_a_task(client: Client, cluster: LocalCluster) -> None:
    x = client.submit(inc, 1)
    info = client.submit(worker_info, x.key, x).result(timeout=30)
    addresses = {a.decode() for a in cluster.redis.hkeys(cluster.keys.workers)}
    assert info["address"] in addresses
    assert info["name"] in ("worker-0", "worker-1")
    assert info["nthreads"] == 1
    assert info["holds_dependency"] and info["same_function"]


def test_get_client_and_friends_outside_a_task(redis_url: str, cluster_name: str) -> None:
    with pytest.raises(ValueError, match="No global client found"):
        get_client()
    for call in (secede, rejoin, lambda: worker_client().__enter__()):
        with pytest.raises(ValueError, match="outside of a task"):
            call()
    with pytest.raises(ValueError, match="No worker found"):
        get_worker()
    r = redis.Redis.from_url(redis_url)
    bootstrap.ensure_cluster(
        r, keyspace.Keys(cluster_name)
    )  # as a scheduler that stopped leaves it
    r.close()
    with Client(redis_url, cluster_name) as client:  # none runs now: it only warns
        assert get_client() is client is default_client()
        assert get_client(address=redis_url) is client
    with pytest.raises(ValueError, match="No global client found"):
        get_client()


def test_dask_compute_inside_a_task_runs_on_the_cluster(
    client: Client, cluster: LocalCluster
) -> None:
    address, value = client.submit(computes_with_dask).result(timeout=60)
    assert value == 2
    assert address in {a.decode() for a in cluster.redis.hkeys(cluster.keys.workers)}


def test_in_thread_workers_each_have_their_own_client(
    cluster_of: Callable[..., LocalCluster],
) -> None:
    with cluster_of(2, 1, processes=False) as cluster, Client(cluster) as client:
        addresses = sorted(a.decode() for a in cluster.redis.hkeys(cluster.keys.workers))
        answers = [
            client.submit(whose_client, workers=[a], pure=False).result(timeout=30)
            for a in addresses * 2
        ]
        by_worker = {address: cid for cid, _, address in answers}
        assert sorted(by_worker) == addresses
        assert len(set(by_worker.values())) == 2 and client.id not in by_worker.values()
        assert len({cid for cid, _, _ in answers}) == 2  # one client per worker, kept
        assert all(is_default for _, is_default, _ in answers)
        assert default_client() is client  # this thread's default is still the user's
        assert client.submit(fib, 12).result(timeout=60) == 144


def test_the_workers_client_closes_with_the_worker(
    redis_url: str, cluster_name: str, cluster_of: Callable[..., LocalCluster]
) -> None:
    r = redis.Redis.from_url(redis_url)
    alive = keyspace.Keys(cluster_name).client_alive
    with cluster_of(1, 1) as cluster, Client(cluster) as client:
        worker_client_id, _, _ = client.submit(whose_client).result(timeout=30)
        assert r.exists(alive(worker_client_id))
    assert not r.exists(alive(worker_client_id))  # it said goodbye: it did not expire
    r.close()


def test_a_worker_killed_during_a_worker_client_computation(
    cluster_of: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    """The parent dies with its worker: it is queued again like any task of a dead worker
    and runs again elsewhere, submitting its children again (the same keys: what ran or
    was held elsewhere is reused, what died with the worker is recomputed)."""
    d, n = str(tmp_path), 6
    with cluster_of(2, 2) as cluster, Client(cluster) as client:
        future = client.submit(parent, d, n)
        poll(lambda: len(list(tmp_path.glob("child-*"))) >= 2 and any(tmp_path.glob("parent-*")))
        [first] = list(tmp_path.glob("parent-*"))
        pid = int(first.name.split("-")[1])
        os.kill(pid, signal.SIGKILL)
        (tmp_path / "go").touch()
        assert future.result(timeout=90) == sum(i * i for i in range(n))
        pids = {int(p.name.split("-")[1]) for p in tmp_path.glob("parent-*")}
        assert pid in pids and len(pids) == 2  # it ran again, in the other worker
        records = [codecs.unpack(f[b"m"]) for _, f in cluster.redis.xrange(cluster.keys.deaths)]
        assert [r["pid"] for r in records] == [pid]
        assert future.key in records[0]["processing"]
