"""Ports of distributed's tests of its coordination primitives and published datasets
(tests/test_locks.py, test_semaphore.py, test_events.py, test_variable.py,
test_queues.py, test_publish.py; distributed 2026.8), on one cluster for the module.

What a user's code sees is ported; what reads the scheduler's extensions (``s.extensions
["semaphores"]``, ``s.tasks``, ``s.clients``) is left out or asserted through the public
API instead, as each docstring says.  distributed's ``gen_cluster`` tests are async:
they run here with an asynchronous client of the module's cluster (``arun``).
``client.set_metadata`` (which redisdask lacks) is replaced by a ``Variable``.
The primitives' names are distributed's ("x"); ``fresh`` empties them after each test,
through the public API, so that tests sharing the cluster do not see each other's.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from polling import poll

from redisdask import Client, Event, LocalCluster, Lock, Queue, Semaphore, Variable, get_client
from redisdask.client import default_client

pytestmark = pytest.mark.timeout(120)


def inc(x: int) -> int:
    return x + 1


def div(x: int, y: int) -> float:
    return x / y


def arun(cluster: LocalCluster, test: Callable[[Client], Awaitable[None]]) -> None:
    """Run ``test(c)`` with an asynchronous client of ``cluster`` (gen_cluster's ``c``)."""

    async def main() -> None:
        async with Client(cluster, asynchronous=True) as c:
            await test(c)

    asyncio.run(main())


@pytest.fixture(autouse=True)
def fresh(module_cluster: LocalCluster) -> Iterator[None]:
    """After each test: no dataset, variable, queue item or set event is left."""
    yield
    with Client(module_cluster) as c:
        c.unpublish_dataset(list(c.list_datasets()))
        prefix = c.keys.prefix
        for kind, empty in (
            ("variable", lambda n: Variable(n).delete()),
            ("queue", lambda n: Queue(n).get(batch=True)),
            ("event", lambda n: Event(n).clear()),
        ):
            for key in c.redis.scan_iter(f"{prefix}{kind}:*"):
                empty(key.decode()[len(prefix) + len(kind) + 1 :])


def slow_inc(x: int) -> int:
    threading.Event().wait(0.05)
    return x + 1


# --------------------------------------------------------------------------- locks


def _exclusive(name: str) -> None:
    """In a task: inside ``Lock(name)`` nobody else is (the ``locked`` flag says so)."""
    flag = Variable(f"{name}-locked")
    with Lock(name):
        assert flag.get() is False
        flag.set(True)
        threading.Event().wait(0.01)
        assert flag.get() is True
        flag.set(False)


def test_lock(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_locks.py::test_lock (a Variable for set_metadata;
    the module's workers have one thread each, not 8)."""

    async def test(c: Client) -> None:
        await Variable("x-locked").set(False)
        futures = c.map(lambda x: _exclusive("x"), range(20))
        await c.gather(futures)

    arun(module_cluster, test)


def test_timeout(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_locks.py::test_timeout"""

    async def test(c: Client) -> None:
        lock = Lock("x")
        result = await lock.acquire()
        assert result is True
        lock2 = Lock("x")
        assert lock.id != lock2.id
        start = time.monotonic()
        result = await lock2.acquire(timeout=0.1)
        assert time.monotonic() - start < 0.3
        assert result is False
        await lock.release()

    arun(module_cluster, test)


def test_acquires_with_zero_timeout(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_locks.py::test_acquires_with_zero_timeout"""

    async def test(c: Client) -> None:
        lock = Lock("x")
        await lock.acquire(timeout=0)
        assert await lock.locked()
        await lock.release()
        await lock.acquire(timeout="1s")
        await lock.release()
        await lock.acquire(timeout=timedelta(seconds=1))
        await lock.release()

    arun(module_cluster, test)


def test_acquires_blocking(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_locks.py::test_acquires_blocking"""

    async def test(c: Client) -> None:
        lock = Lock("x")
        await lock.acquire(blocking=False)
        assert await lock.locked()
        await lock.release()
        assert not await lock.locked()
        with pytest.raises(ValueError):
            lock.acquire(blocking=False, timeout=0.1)

    arun(module_cluster, test)


def test_timeout_sync(module_client: Client) -> None:
    """Port of distributed/tests/test_locks.py::test_timeout_sync"""
    with Lock("x"):
        assert Lock("x").acquire(timeout=0.1) is False


def test_errors(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_locks.py::test_errors"""

    async def test(c: Client) -> None:
        lock = Lock("x")
        with pytest.raises(RuntimeError):
            await lock.release()

    arun(module_cluster, test)


def test_lock_sync(module_client: Client) -> None:
    """Port of distributed/tests/test_locks.py::test_lock_sync (a Variable for
    set_metadata)"""
    Variable("x-locked").set(False)
    futures = module_client.map(lambda x: _exclusive("x"), range(10))
    module_client.gather(futures)


def test_lock_types(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_locks.py::test_lock_types"""

    async def test(c: Client) -> None:
        for name in [1, ("a", 1), ["a", 1], b"123", "123"]:
            lock = Lock(name)
            assert lock.name == name
            await lock.acquire()
            await lock.release()

    arun(module_cluster, test)


def _with_lock(x: int, lock: Any = None) -> int:
    with lock:
        assert lock.name == "x"
        return x + 1


def _acquire_release(x: int, lock: Any = None) -> int:
    lock.acquire()
    try:
        assert lock.name == "x"
        return x + 1
    finally:
        lock.release()


@pytest.mark.parametrize("f", [_with_lock, _acquire_release], ids=["ctx", "no_ctx"])
def test_serializable(module_cluster: LocalCluster, f: Callable[..., int]) -> None:
    """Port of distributed/tests/test_locks.py::test_serializable and
    ::test_serializable_no_ctx"""

    async def test(c: Client) -> None:
        lock = Lock("x")
        futures = c.map(f, range(10), lock=lock)
        assert await c.gather(futures) == list(range(1, 11))
        lock2 = pickle.loads(pickle.dumps(lock))
        assert lock2.name == lock.name

    arun(module_cluster, test)


def test_locks(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_locks.py::test_locks"""

    async def test(c: Client) -> None:
        async with Lock("x"):
            l2 = Lock("x")
            assert await l2.acquire(timeout=0.01) is False
        assert await l2.acquire(timeout=0.01) is True  # (released by async with)
        await l2.release()

    arun(module_cluster, test)


# --------------------------------------------------------------------------- semaphores


def test_semaphore_trivial(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_semaphore.py::test_semaphore_trivial"""

    async def test(c: Client) -> None:
        semaphore = await Semaphore(max_leases=2, name="resource_we_want_to_limit")
        assert await semaphore.acquire() is True
        assert await semaphore.acquire() is True
        start = time.monotonic()
        result = await semaphore.acquire(timeout=0.025)
        assert time.monotonic() - start < 0.2
        assert result is False
        await semaphore.close()

    arun(module_cluster, test)


def test_serializable_semaphore(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_semaphore.py::test_serializable (lease counts by
    ``get_value`` instead of the scheduler extension's)"""

    async def test(c: Client) -> None:
        sem = await Semaphore(max_leases=2, name="x")
        assert await sem.acquire()
        assert await sem.get_value() == 1
        sem2 = pickle.loads(pickle.dumps(sem))
        assert sem2.name == sem.name
        assert await sem.get_value() == 1
        assert await sem2.acquire()
        assert await sem.get_value() == 2
        assert not await sem.acquire(timeout=0.025)
        assert not await sem2.acquire(timeout=0.025)
        await sem.close()

    arun(module_cluster, test)


def _with_semaphore(x: int, semaphore: Any) -> int:
    with semaphore:
        assert semaphore.name == "x"
        return x + 1


def test_release_simple(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_semaphore.py::test_release_simple"""

    async def test(c: Client) -> None:
        sem = await Semaphore(max_leases=2, name="x")
        futures = c.map(_with_semaphore, list(range(10)), semaphore=sem)
        assert await c.gather(futures) == list(range(1, 11))

    arun(module_cluster, test)


def test_acquires_with_timeout(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_semaphore.py::test_acquires_with_timeout"""

    async def test(c: Client) -> None:
        sem = await Semaphore(1, "x")
        assert await sem.acquire(timeout="25ms")
        assert not await sem.acquire(timeout=0.025)
        assert await sem.release() is True
        assert await sem.acquire(timeout=timedelta(seconds=0.025))
        assert await sem.release() is True

    arun(module_cluster, test)


def test_timeout_sync_semaphore(module_client: Client) -> None:
    """Port of distributed/tests/test_semaphore.py::test_timeout_sync"""
    s = Semaphore(name="x")
    with s:
        assert s.acquire(timeout=0.025) is False


def test_async_ctx(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_semaphore.py::test_async_ctx"""

    async def test(c: Client) -> None:
        sem = await Semaphore(name="x")
        async with sem:
            assert not await sem.acquire(timeout=0.025)
        assert await sem.acquire()
        await sem.release()

    arun(module_cluster, test)


def _by_name(x: int, release: bool = True) -> bool:
    sem = Semaphore(name="x")
    if not sem.acquire(timeout=0.1):
        return False
    if release:
        assert sem.release() is True
    return True


def test_access_semaphore_by_name(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_semaphore.py::test_access_semaphore_by_name
    (``get_value`` for the extension's lease count; the leases taken without release
    in the last step are given back by ``close``)"""

    async def test(c: Client) -> None:
        sem = await Semaphore(name="x")
        futures = c.map(_by_name, list(range(10)))
        assert all(await c.gather(futures))
        del futures
        assert await sem.get_value() == 0
        assert await sem.acquire()
        assert await sem.get_value() == 1
        futures = c.map(_by_name, list(range(10)))
        assert not any(await c.gather(futures))
        assert await sem.release() is True
        del futures
        futures = c.map(_by_name, list(range(10)), release=False)
        result = await c.gather(futures)
        assert result.count(True) == 1
        assert result.count(False) == 9
        await sem.close()

    arun(module_cluster, test)


def test_release_once_too_many(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_semaphore.py::test_release_once_too_many"""

    async def test(c: Client) -> None:
        sem = await Semaphore(name="x")
        assert await sem.acquire()
        assert await sem.release() is True
        with pytest.raises(RuntimeError, match="Released too often"):
            sem.release()
        assert await sem.acquire()
        assert await sem.release() is True

    arun(module_cluster, test)


def test_timeout_zero(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_semaphore.py::test_timeout_zero"""

    async def test(c: Client) -> None:
        sem = await Semaphore()
        assert await sem.acquire(timeout=0)
        assert not await sem.acquire(timeout=0)
        assert await sem.release() is True

    arun(module_cluster, test)


def test_getvalue(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_semaphore.py::test_getvalue"""

    async def test(c: Client) -> None:
        sem = await Semaphore()
        assert await sem.get_value() == 0
        await sem.acquire()
        assert await sem.get_value() == 1
        assert await sem.release() is True
        assert await sem.get_value() == 0

    arun(module_cluster, test)
