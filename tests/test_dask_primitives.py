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

from redisdask import Client, Event, LocalCluster, Lock, Queue, Semaphore, Variable
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


async def apoll(condition: Callable[[], object], timeout: float) -> None:
    """``polling.poll`` on an event loop: the client's loop keeps running meanwhile."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"condition not met within {timeout} s"
        await asyncio.sleep(0.01)


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


# --------------------------------------------------------------------------- events


def _wait_for_it_failing(x: int) -> None:
    event = Event("x")
    assert not event.wait(timeout=0.05)
    assert not event.is_set()


def _wait_for_it_ok(x: int) -> None:
    event = Event("x")
    assert event.wait(timeout=0.5)
    assert event.is_set()


def _set_it() -> None:
    Event("x").set()


def test_event_sync(module_client: Client) -> None:
    """Port of distributed/tests/test_events.py::test_event_sync (and the user-visible
    part of ::test_event_on_workers)"""
    client = module_client
    client.gather(client.map(_wait_for_it_failing, range(10)))
    client.gather(client.submit(_set_it))
    client.gather(client.map(_wait_for_it_ok, range(10)))


def test_default_event(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_events.py::test_default_event"""

    async def test(c: Client) -> None:
        event = Event("x")
        assert not await event.is_set()
        await event.clear()

    arun(module_cluster, test)


def test_set_not_set(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_events.py::test_set_not_set"""

    async def test(c: Client) -> None:
        event = Event("x")
        await event.clear()
        assert not await event.is_set()
        await event.set()
        assert await event.is_set()
        await event.set()
        assert await event.is_set()
        await event.clear()
        assert not await event.is_set()

    arun(module_cluster, test)


def test_set_not_set_many_events(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_events.py::test_set_not_set_many_events"""

    async def test(c: Client) -> None:
        events = [Event(name) for name in range(100)]
        for event in events:
            await event.clear()
            assert not await event.is_set()
        for i, event in enumerate(events):
            if i % 2 == 0:
                await event.set()
                assert await event.is_set()
            else:
                assert not await event.is_set()
        for event in events:
            await event.clear()
            assert not await event.is_set()

    arun(module_cluster, test)


def test_timeout_event(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_events.py::test_timeout"""

    async def test(c: Client) -> None:
        event = Event("x")
        assert not await Event("x").wait(timeout=0.1)
        await event.set()
        assert await Event("x").wait(timeout="100ms")
        await event.clear()
        assert not await Event("x").wait(timeout=timedelta(seconds=0.1))

    arun(module_cluster, test)


def test_event_types(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_events.py::test_event_types"""

    async def test(c: Client) -> None:
        for name in [1, ("a", 1), ["a", 1], b"123", "123"]:
            event = Event(name)
            assert event.name == name
            await event.set()
            await event.clear()
            assert not await event.is_set()

    arun(module_cluster, test)


def _event_name(x: int, event: Any = None) -> int:
    assert event.name == "x"
    return x + 1


def test_serializable_event(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_events.py::test_serializable"""

    async def test(c: Client) -> None:
        event = Event("x")
        futures = c.map(_event_name, range(10), event=event)
        await c.gather(futures)
        event2 = pickle.loads(pickle.dumps(event))
        assert event2.name == event.name
        assert event2.client is event.client

    arun(module_cluster, test)


def _event_not_set(event_name: str) -> None:
    assert not Event(event_name).wait(timeout=0.05)


def _event_is_set(event_name: str) -> None:
    assert Event(event_name).wait(timeout=0.5)


def test_two_events_on_workers(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_events.py::test_two_events_on_workers"""

    async def test(c: Client) -> None:
        await c.gather(c.submit(_event_not_set, "first_event"))
        await c.gather(c.submit(_event_not_set, "second_event"))
        await Event("first_event").set()
        await c.gather(c.submit(_event_is_set, "first_event", pure=False))
        await c.gather(c.submit(_event_not_set, "second_event", pure=False))
        await Event("first_event").clear()
        await Event("second_event").set()
        await c.gather(c.submit(_event_not_set, "first_event", pure=False))
        await c.gather(c.submit(_event_is_set, "second_event", pure=False))
        await Event("first_event").clear()
        await Event("second_event").clear()

    arun(module_cluster, test)


@pytest.mark.parametrize(
    "make, use",
    [
        (lambda: Event(), lambda o: o.set()),
        (lambda: Variable("foo"), lambda o: o.set(42)),
        (lambda: Queue("foo"), lambda o: o.put(1)),
        (lambda: Semaphore(name="foo"), lambda o: o.acquire()),
    ],
    ids=["events", "variable", "queues", "semaphore"],
)
def test_unpickle_without_client(
    module_cluster: LocalCluster, make: Callable[[], Any], use: Callable[[Any], Any]
) -> None:
    """Port of test_unpickle_without_client of distributed/tests/test_events.py,
    test_variable.py, test_queues.py and test_semaphore.py (no ``Client.current()``
    here: ``default_client()`` is its counterpart)"""

    async def test() -> None:
        async with Client(module_cluster, asynchronous=True):
            pickled = pickle.dumps(make())
        with pytest.raises(ValueError):
            default_client()
        obj2 = pickle.loads(pickled)
        with pytest.raises(ValueError):
            default_client()
        assert obj2.client is None
        with pytest.raises(RuntimeError, match="not properly initialized"):
            await use(obj2)
        async with Client(module_cluster, asynchronous=True):
            obj3 = pickle.loads(pickled)
            await use(obj3)

    asyncio.run(test())
