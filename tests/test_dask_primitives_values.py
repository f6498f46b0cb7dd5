"""Ports of distributed's tests of values shared through the cluster: tests/
test_variable.py, test_queues.py and test_publish.py (distributed 2026.8), on one
cluster for the module; see tests/test_dask_primitives.py for how they are ported
(``arun``, ``apoll``, ``fresh`` are the same)."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

import pytest
from test_dask_primitives import apoll, arun, div, fresh, inc  # noqa: F401 (fresh: autouse)

from redisdask import Client, LocalCluster, Queue, Variable

pytestmark = pytest.mark.timeout(120)


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
