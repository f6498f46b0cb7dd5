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


# --------------------------------------------------------------------------- variables


def test_variable(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_variable.py::test_variable (the task's release
    seen in its record's absence instead of ``s.tasks``)"""

    async def test(c: Client) -> None:
        x = Variable("x")
        xx = Variable("x")
        assert x.client is c
        future = c.submit(inc, 1, key=("x", 0))
        await x.set(future)
        future2 = await xx.get()
        assert future.key == future2.key == ("x", 0)
        task = c.keys.task(future._key)
        del future, future2
        await asyncio.sleep(0.1)
        assert await c._aredis.exists(task)  # the variable keeps it
        await x.delete()
        await apoll(lambda: not c.redis.exists(task), timeout=10)

    arun(module_cluster, test)


def test_delete_unset_variable(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_variable.py::test_delete_unset_variable"""

    async def test(c: Client) -> None:
        x = Variable()
        assert x.client is c
        await x.delete()

    arun(module_cluster, test)


def test_queue_with_data(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_variable.py::test_queue_with_data"""

    async def test(c: Client) -> None:
        x = Variable("x")
        xx = Variable("x")
        await x.set((1, "hello"))
        assert await xx.get() == (1, "hello")

    arun(module_cluster, test)


def test_sync(module_client: Client) -> None:
    """Port of distributed/tests/test_variable.py::test_sync"""
    future = module_client.submit(lambda x: x + 1, 10)
    x = Variable("x")
    xx = Variable("x")
    x.set(future)
    future2 = xx.get()
    assert future2.result() == 11


def test_hold_futures(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_variable.py::test_hold_futures"""

    async def test() -> None:
        async with Client(module_cluster, asynchronous=True) as c1:
            future = c1.submit(lambda x: x + 1, 10)
            x1 = Variable("x")
            await x1.set(future)
            del x1
        await asyncio.sleep(0.1)
        async with Client(module_cluster, asynchronous=True):
            future2 = await Variable("x").get()
            assert await future2 == 11

    asyncio.run(test())


def test_timeout_variable(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_variable.py::test_timeout"""

    async def test(c: Client) -> None:
        v = Variable("v")
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            await v.get(timeout="200ms")
        assert 0.2 < time.monotonic() - start < 2.0
        with pytest.raises(TimeoutError):
            await v.get(timeout=timedelta(milliseconds=10))

    arun(module_cluster, test)


def test_timeout_sync_variable(module_client: Client) -> None:
    """Port of distributed/tests/test_variable.py::test_timeout_sync"""
    v = Variable("v")
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        v.get(timeout=0.2)
    assert 0.2 < time.monotonic() - start < 2.0
    with pytest.raises(TimeoutError):
        v.get(timeout=0.01)


def test_cleanup(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_variable.py::test_cleanup"""

    async def test(c: Client) -> None:
        v = Variable("v")
        vv = Variable("v")
        x = c.submit(lambda x: x + 1, 10)
        y = c.submit(lambda x: x + 1, 20)
        x_key = x.key
        await v.set(x)
        del x
        await asyncio.sleep(0.1)
        t_future = asyncio.ensure_future(vv.get())
        await asyncio.sleep(0)
        setting = asyncio.ensure_future(v.set(y))
        future = await t_future
        assert future.key == x_key
        assert await future == 11
        await setting

    arun(module_cluster, test)


def test_pickleable(module_client: Client) -> None:
    """Port of distributed/tests/test_variable.py::test_pickleable"""
    v = Variable("v")

    def f(x: int) -> None:
        v.set(x + 1)

    module_client.submit(f, 10).result()
    assert v.get() == 11


def test_timeout_get(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_variable.py::test_timeout_get"""

    async def test(c: Client) -> None:
        v = Variable("v")
        getting = v.get()
        vv = Variable("v")
        await vv.set(1)
        assert await getting == 1

    arun(module_cluster, test)


@pytest.mark.parametrize("kind", ["variable", "queue"])
def test_Future_knows_status_immediately(module_cluster: LocalCluster, kind: str) -> None:
    """Port of test_Future_knows_status_immediately of distributed/tests/
    test_variable.py and test_queues.py"""

    async def test(c: Client) -> None:
        x = await c.scatter(123)
        await c.wait_for_workers(1)
        await apoll(lambda: c.redis.hget(c.keys.task(x._key), "state") == b"memory", timeout=10)
        v = Variable("x") if kind == "variable" else await Queue("q")
        send = v.set if kind == "variable" else v.put
        await send(x)
        async with Client(module_cluster, asynchronous=True) as c2:
            v2 = Variable("x", client=c2) if kind == "variable" else await Queue("q", client=c2)
            future = await v2.get()
            assert future.status == "finished"
            x = c.submit(div, 1, 0)
            await c.gather([x], errors="skip")
            await send(x)
            future2 = await v2.get()
            assert future2.status == "error"
            with pytest.raises(ZeroDivisionError):
                await future2

    arun(module_cluster, test)


@pytest.mark.parametrize("kind", ["variable", "queue"])
def test_erred_future(module_cluster: LocalCluster, kind: str) -> None:
    """Port of test_erred_future of distributed/tests/test_variable.py and
    test_queues.py"""

    async def test(c: Client) -> None:
        future = c.submit(div, 1, 0)
        var = Variable() if kind == "variable" else await Queue()
        await (var.set(future) if kind == "variable" else var.put(future))
        await asyncio.sleep(0.1)
        future2 = await var.get()
        with pytest.raises(ZeroDivisionError):
            await future2.result()
        assert isinstance(await future2.exception(), ZeroDivisionError)

    arun(module_cluster, test)


def test_future_erred_sync(module_client: Client) -> None:
    """Port of distributed/tests/test_variable.py::test_future_erred_sync"""
    future = module_client.submit(div, 1, 0)
    var = Variable()
    var.set(future)
    future2 = var.get()
    with pytest.raises(ZeroDivisionError):
        future2.result()


@pytest.mark.parametrize("kind", ["variable", "queue"])
def test_set_cancelled_future(module_cluster: LocalCluster, kind: str) -> None:
    """Port of test_set_cancelled_future of distributed/tests/test_variable.py and
    test_queues.py"""

    async def test(c: Client) -> None:
        x = c.submit(inc, 1)
        await x.cancel()
        if kind == "variable":
            with pytest.raises(TimeoutError):
                await Variable("x").set(x, timeout="5ms")
        else:
            with pytest.raises(Exception, match="unknown to scheduler"):
                await Queue("x").put(x, timeout="100ms")

    arun(module_cluster, test)


# --------------------------------------------------------------------------- queues


def test_queue(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_queues.py::test_queue (the release seen in the
    task record's absence instead of ``s.tasks``)"""

    async def test(c: Client) -> None:
        x = await Queue("x")
        y = await Queue("y")
        xx = await Queue("x")
        assert x.client is c
        future = c.submit(inc, 1)
        await x.put(future)
        await y.put(future)
        future2 = await xx.get()
        assert future.key == future2.key
        with pytest.raises(TimeoutError):
            await x.get(timeout=0.1)
        task = c.keys.task(future._key)
        del future, future2
        await asyncio.sleep(0.1)
        assert c.redis.exists(task)  # still in y's queue
        await y.get()
        await apoll(lambda: not c.redis.exists(task), timeout=10)

    arun(module_cluster, test)


def test_queue_with_data_queue(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_queues.py::test_queue_with_data"""

    async def test(c: Client) -> None:
        x = await Queue("x")
        xx = await Queue("x")
        await x.put((1, "hello"))
        assert await xx.get() == (1, "hello")
        with pytest.raises(TimeoutError):
            await x.get(timeout=0.1)

    arun(module_cluster, test)


def test_sync_queue(module_client: Client) -> None:
    """Port of distributed/tests/test_queues.py::test_sync"""
    future = module_client.submit(lambda x: x + 1, 10)
    x = Queue("x")
    xx = Queue("x")
    x.put(future)
    assert x.qsize() == 1
    assert xx.qsize() == 1
    assert xx.get().result() == 11


def test_picklability(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_queues.py::test_picklability"""

    async def test(c: Client) -> None:
        q = Queue()

        def f(x: int) -> None:
            q.put(x + 1)

        await c.submit(f, 10)
        assert await q.get() == 11

    arun(module_cluster, test)


def test_get_many(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_queues.py::test_get_many"""

    async def test(c: Client) -> None:
        x = await Queue("x")
        xx = await Queue("x")
        for i in (1, 2, 3):
            await x.put(i)
        assert await xx.get(batch=True) == [1, 2, 3]
        for i in (1, 2, 3):
            await x.put(i)
        assert await xx.get(batch=2) == [1, 2]
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(xx.get(batch=2), 0.1)

    arun(module_cluster, test)


def test_timeout_queue(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_queues.py::test_timeout"""

    async def test(c: Client) -> None:
        q = await Queue("v", maxsize=1)
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            await q.get(timeout="300ms")
        assert 0.2 < time.monotonic() - start < 2.0
        await q.put(1)
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            await q.put(2, timeout=timedelta(seconds=0.3))
        assert 0.1 < time.monotonic() - start < 2.0

    arun(module_cluster, test)


def test_2220(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_queues.py::test_2220"""

    async def test(c: Client) -> None:
        q = Queue()

        def put() -> None:
            q.put(55)

        def get() -> int:
            return q.get()

        fut = c.submit(put)
        res = c.submit(get)
        assert (await c.gather([res, fut]))[0] == 55

    arun(module_cluster, test)


# --------------------------------------------------------------------------- datasets


def test_publish_simple(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_publish.py::test_publish_simple (``list_datasets``
    for the scheduler's ``publish_list``)"""

    async def test(c: Client) -> None:
        async with Client(module_cluster, asynchronous=True) as c2:
            data = await c.scatter(range(3))
            await c.publish_dataset(data=data)
            with pytest.raises(KeyError) as exc_info:
                await c.publish_dataset(data=data)
            assert "exists" in str(exc_info.value)
            assert "data" in str(exc_info.value)
            assert await c.list_datasets() == ("data",)
            assert await c2.list_datasets() == ("data",)

    arun(module_cluster, test)


@pytest.mark.parametrize("name", [("a", "b"), 9.0, 8])
def test_publish_non_string_names(module_cluster: LocalCluster, name: Any) -> None:
    """Port of distributed/tests/test_publish.py::test_publish_non_string_names"""

    async def test(c: Client) -> None:
        future = c.submit(lambda: 123, key=("x", 1))
        await c.publish_dataset(future, name=name)
        assert await c.list_datasets() == (name,)
        future = await c.get_dataset(name)
        assert future.key == ("x", 1)
        await c.unpublish_dataset(name)
        assert await c.list_datasets() == ()
        assert await future == 123

    arun(module_cluster, test)


def test_publish_multiple_names(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_publish.py::test_publish_multiple_names"""

    async def test(c: Client) -> None:
        f1 = c.submit(lambda: 1, key="x")
        f2 = c.submit(lambda: 2, key="y")
        f3 = c.submit(lambda: 3, key="z")
        await c.publish_dataset({("a", "b"): f1, 8: f2}, n3=f3)
        assert await c.list_datasets() == (("a", "b"), 8, "n3")
        f1, f2, f3 = await c.get_dataset([("a", "b"), 8, "n3"])
        await c.unpublish_dataset([("a", "b"), 8, "n3"])
        assert await c.list_datasets() == ()
        assert [await f1, await f2, await f3] == [1, 2, 3]

    arun(module_cluster, test)


def test_unpublish_sync(module_client: Client) -> None:
    """Port of distributed/tests/test_publish.py::test_unpublish_sync"""
    client = module_client
    data = client.scatter([0, 1, 2])
    client.publish_dataset(data=data)
    client.unpublish_dataset(name="data")
    with pytest.raises(KeyError) as exc_info:
        client.get_dataset(name="data")
    assert "not found" in str(exc_info.value)
    assert "data" in str(exc_info.value)


def test_datasets_setitem_getitem_delitem(module_client: Client) -> None:
    """Port of distributed/tests/test_publish.py::test_datasets_setitem,
    ::test_datasets_getitem and ::test_datasets_delitem"""
    client = module_client
    for key in ["key", ("key", "key"), 1]:
        client.datasets[key] = "value"
        assert client.get_dataset(key) == "value"
        assert client.get_dataset(key, default="something else") == "value"
        assert client.datasets[key] == "value"
        assert client.datasets.get(key, default="something else") == "value"
        del client.datasets[key]
        assert key not in client.list_datasets()


def test_datasets_getitem_default(module_client: Client) -> None:
    """Port of distributed/tests/test_publish.py::test_datasets_getitem_default"""
    client = module_client
    with pytest.raises(KeyError):
        client.get_dataset("key")
    assert client.datasets.get("key", default="value") == "value"
    assert client.datasets.get("key", default=None) is None
    assert client.get_dataset("key", default="value") == "value"


def test_datasets_keys_contains_iter(module_client: Client) -> None:
    """Port of distributed/tests/test_publish.py::test_datasets_keys,
    ::test_datasets_contains and ::test_datasets_iter"""
    client = module_client
    client.publish_dataset(**{str(n): n for n in range(10)})
    assert list(client.datasets.keys()) == [str(n) for n in range(10)]
    assert "3" in client.datasets
    for n, key in enumerate(client.datasets):
        assert key == str(n)
    with pytest.raises(TypeError):
        client.datasets.__aiter__()


def test_publish_dataset_override(module_client: Client) -> None:
    """Port of distributed/tests/test_publish.py::test_publish_dataset_override"""
    client = module_client
    client.publish_dataset(key="value")
    assert client.get_dataset("key") == "value"
    with pytest.raises(KeyError):
        client.publish_dataset(key="value")
    client.publish_dataset(key="value2", override=True)
    assert client.get_dataset("key") == "value2"


def test_datasets_async(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_publish.py::test_datasets_async"""

    async def test(c: Client) -> None:
        await c.publish_dataset(foo=1, bar=2)
        assert await c.datasets["foo"] == 1
        assert {k async for k in c.datasets} == {"foo", "bar"}
        with pytest.raises(TypeError):
            c.datasets["baz"] = 3
        with pytest.raises(TypeError):
            del c.datasets["foo"]
        with pytest.raises(TypeError):
            next(iter(c.datasets))
        with pytest.raises(TypeError):
            len(c.datasets)

    arun(module_cluster, test)


def test_publish_bad_syntax(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_publish.py::test_publish_bad_syntax"""

    async def test(c: Client) -> None:
        with pytest.raises(ValueError, match="If name is provided, expecting call signature"):
            await c.publish_dataset(name="x")
        for args in [(1,), (1, "x"), ({"x": 1}, {"y": 2})]:
            with pytest.raises(ValueError, match="If name is omitted, positional argument must"):
                await c.publish_dataset(*args)

    arun(module_cluster, test)
