"""Ports of distributed's tests of futures (issue 23): ``dask.annotate`` on ``submit`` and
``map``, ``wait``/``cancel``/``retry`` on dask collections (``futures_of``), ``Future.type``
and ``as_completed`` (all of ``tests/test_as_completed.py`` that a user's code can run).

Each port keeps the name of the test it ports; they share one cluster per module (two
one-thread workers, ``worker-0`` and ``worker-1``), to which ``gpu_worker`` adds a third,
``gpu``, with ``GPU=1``.  ``gen_cluster`` tests (``async def test(c, s, a, b)``) run under
``asyncio.run`` with an asynchronous client; what they read of the scheduler's and the
workers' objects (``s.tasks``, ``a.data``) is read here as a user can: where tasks ran,
their records in Redis.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError
from operator import add
from pathlib import Path
from typing import Any

import dask
import dask.bag as db
import pytest
from polling import poll

from redisdask import Client, FuturesCancelledError, LocalCluster, as_completed, futures_of, wait
from redisdask.observe.inspect import read_task
from redisdask.scheduler.tasks import PRIORITY_SCALE

pytestmark = pytest.mark.timeout(120)

GPU = {"GPU": 1}


def inc(x: float) -> float:
    return x + 1


def double(x: Any) -> Any:
    return x * 2


def slowinc(x: float, delay: float = 0.02) -> float:
    threading.Event().wait(delay)  # stands for work
    return x + 1


def throws(x: Any) -> None:
    raise RuntimeError("hello!")


def name_of(*_: Any) -> str:
    from redisdask.workers import get_worker

    return str(get_worker().name)


def fails_once(marker: str) -> str:
    """Raises the first time (it leaves ``marker``), returns after."""
    path = Path(marker)
    if not path.exists():
        path.touch()
        raise ZeroDivisionError("first attempt")
    return "second attempt"


def until_touched(path: str, tag: int = 0) -> str:
    while not Path(path).exists():
        threading.Event().wait(0.01)
    return path


def run_async(cluster: LocalCluster, body: Callable[[Client], Any]) -> Any:
    """``body(client)`` under ``asyncio.run``, with an asynchronous client of ``cluster``."""

    async def main() -> Any:
        async with Client(cluster, asynchronous=True) as client:
            return await body(client)

    return asyncio.run(main())


@pytest.fixture(scope="module")
def gpu_worker(module_cluster: LocalCluster) -> Iterator[str]:
    """A third worker, ``gpu``, the only one with a GPU."""
    module_cluster.start_worker(name="gpu", resources="GPU=1")
    module_cluster.wait_for_workers(3)
    yield "gpu"


# --------------------------------------------------------------------------- annotations


def test_annotations_submit_map(module_client: Client, gpu_worker: str) -> None:
    """Port of distributed/tests/test_client.py::test_annotations_submit_map (where the
    tasks ran, instead of ``ts.resource_restrictions``); 8 tasks, as issue 23 saw them
    placed on workers without the resource."""
    with dask.annotate(resources={"GPU": 1}):
        f = module_client.submit(name_of, 0, pure=False)
    with dask.annotate(resources={"GPU": 1}):
        fs = module_client.map(name_of, range(8), pure=False)
    assert set(module_client.gather([f, *fs])) == {gpu_worker}


def test_annotate_workers_retries_priority_on_submit_and_map(
    module_client: Client, module_cluster: LocalCluster, tmp_path: Path
) -> None:
    """``workers=``, ``retries=`` and ``priority=`` annotations reach ``submit`` and
    ``map`` as distributed's ``_graph_to_futures`` merges them."""
    with dask.annotate(workers=["worker-1"]):
        placed = [module_client.submit(name_of, "s", pure=False)]
        placed += module_client.map(name_of, range(6), pure=False)
    assert set(module_client.gather(placed)) == {"worker-1"}

    with dask.annotate(retries=1):
        once = module_client.submit(fails_once, str(tmp_path / "a"))
        mapped = module_client.map(fails_once, [str(tmp_path / "b")])
    assert once.result(timeout=30) == mapped[0].result(timeout=30) == "second attempt"

    r, keys = module_cluster.redis, module_cluster.keys
    with dask.annotate(priority=7):
        first = module_client.submit(inc, 1, pure=False)
        second = module_client.map(inc, [2], pure=False)[0]
    wait([first, second])
    for future in (first, second):
        score = read_task(r, keys, future.key)["score"]
        assert round(score / PRIORITY_SCALE) == -7  # as user priority 7 (higher first)


def test_explicit_options_win_over_annotations_unless_falsy(
    module_client: Client, module_cluster: LocalCluster
) -> None:
    """distributed: ``merge(dask.get_annotations(), explicit)``, where an explicit option
    counts only when truthy (``priority=0`` leaves the annotation's)."""
    with dask.annotate(workers=["worker-0"], priority=3):
        explicit = module_client.submit(name_of, "x", workers=["worker-1"], pure=False)
        default = module_client.submit(name_of, "y", priority=0, pure=False)
    assert explicit.result(timeout=30) == "worker-1"
    assert default.result(timeout=30) == "worker-0"
    score = read_task(module_cluster.redis, module_cluster.keys, default.key)["score"]
    assert round(score / PRIORITY_SCALE) == -3


def test_annotations_compute_time(module_client: Client, module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_client.py::test_annotations_compute_time, with
    ``priority`` (an option redisdask reads) for ``foo``, read from the task's record."""
    x = db.from_sequence(range(4), npartitions=2).map(inc)
    with dask.annotate(priority=5):
        fut = module_client.compute(x, optimize_graph=False)
    assert sorted(fut.result(timeout=30)) == [1, 2, 3, 4]
    r, keys = module_cluster.redis, module_cluster.keys
    assert round(read_task(r, keys, fut.key)["score"] / PRIORITY_SCALE) == -5


# --------------------------------------------------------------------------- futures_of


def test_wait_on_collections(module_client: Client) -> None:
    """Port of distributed/tests/test_client.py::test_wait_on_collections."""
    c = module_client
    L = c.map(slowinc, [1, 2, 3], delay=0.3)
    x = db.Bag({("b", i): f for i, f in enumerate(L)}, "b", 3)
    wait(x)
    assert all(f.status == "finished" for f in L)
    persisted = c.persist(db.from_sequence(range(3), npartitions=3).map(slowinc, 0.3))
    wait(persisted)
    assert all(f.status == "finished" for f in futures_of(persisted))


def test_cancel_collection(module_client: Client) -> None:
    """Port of distributed/tests/test_client.py::test_cancel_collection (``s.tasks``
    emptying is not read)."""
    c = module_client
    L = c.map(double, [[1], [2], [3]])
    x = db.Bag({("b", i): f for i, f in enumerate(L)}, "b", 3)
    c.cancel(x)
    c.cancel([x])
    assert all(f.cancelled() for f in L)


def test_news_of_a_run_that_ended_before_its_cancellation_keeps_the_future_cancelled(
    module_client: Client,
) -> None:
    """The run's news, written before the scheduler read the cancellation, reached the
    client after it: the future turned finished again (test_cancel_collection failed so
    on a loaded machine).  The news is the scheduler's own message, handled as read."""
    from redisdask.protocol import KeyInMemory
    from redisdask.store import codecs

    c = module_client
    [future] = c.map(double, [[1]])
    assert future.result(timeout=20) == [1, 1]
    [address] = c.who_has(future)[future.key]
    c.cancel(future)
    late = KeyInMemory(future.key, [address], nbytes=8, type="list")
    c._channel._handle_entry({b"m": codecs.pack([late.to_dict()])})
    assert future.cancelled()
    again = c.submit(double, [2], key=future.key)  # submitted again: its news counts
    assert again.result(timeout=20) == [2, 2]


def test_futures_of_get(module_client: Client) -> None:
    """Port of distributed/tests/test_client.py::test_futures_of_get."""
    x, y, z = module_client.map(inc, [1, 2, 3])
    assert set(futures_of(0)) == set()
    assert set(futures_of(x)) == {x}
    assert set(futures_of([x, y, z])) == {x, y, z}
    assert set(futures_of([x, [y], [[z]]])) == {x, y, z}
    assert set(futures_of({"x": x, "y": [y]})) == {x, y}
    b = db.Bag({("b", i): f for i, f in enumerate([x, y, z])}, "b", 3)
    assert set(futures_of(b)) == {x, y, z}


def test_futures_of_class() -> None:
    """Port of distributed/tests/test_client.py::test_futures_of_class."""
    da = pytest.importorskip("dask.array")
    assert futures_of([da.Array]) == []


def test_futures_of_sorted(module_client: Client) -> None:
    """Port of distributed/tests/test_client.py::test_futures_of_sorted."""
    b = module_client.persist(db.from_sequence(range(10), npartitions=5))
    futures = futures_of(b)
    assert [fut.key for fut in futures] == list(b.__dask_keys__())


def test_wait_raises_on_cancelled_futures_and_retry_takes_collections(
    module_client: Client, tmp_path: Path
) -> None:
    """distributed's ``wait`` raises ``FuturesCancelledError`` when a future it waited
    for was cancelled; ``retry`` finds the futures of a collection (``futures_of``)."""
    c = module_client
    x = c.submit(until_touched, str(tmp_path / "go"))
    c.cancel(x, reason="testreason")
    (tmp_path / "go").touch()  # the cancelled task's thread ends
    with pytest.raises(FuturesCancelledError, match="testreason") as info:
        wait([x])
    assert isinstance(info.value, CancelledError)
    erred = c.submit(fails_once, str(tmp_path / "m"))
    wait(erred)
    assert erred.status == "error"
    c.retry(db.Bag({("r", 0): erred}, "r", 1))
    assert erred.result(timeout=30) == "second attempt"


# --------------------------------------------------------------------------- Future.type


def test_future_type(module_client: Client) -> None:
    """Port of distributed/tests/test_client.py::test_future_type."""
    x = module_client.submit(inc, 1)
    wait([x])
    assert x.type is int
    assert "int" in str(x)
    frame = module_client.submit(Path, "p")
    wait(frame)
    assert frame.type is type(Path("p"))  # a type of a module, found by its name


def test_scatter_type(module_client: Client) -> None:
    """Port of distributed/tests/test_client.py::test_scatter_type."""
    [future] = module_client.scatter([1])
    assert future.type is int
    d = module_client.scatter({"x": 1.0})
    assert d["x"].type is float


# --------------------------------------------------------------------------- as_completed


def test_as_completed_timeout_async(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_as_completed.py::test_as_completed_timeout_async."""

    async def body(c: Client) -> None:
        x = c.submit(inc, 1)
        y = c.submit(inc, 1)
        z = c.submit(slowinc, 2, delay=1)
        seq = as_completed([x, y, z], timeout="0.5s")
        await seq.__anext__()
        await seq.__anext__()
        with pytest.raises(TimeoutError):
            await seq.__anext__()

    run_async(module_cluster, body)


def test_as_completed_timeout_sync(module_client: Client) -> None:
    """Port of distributed/tests/test_as_completed.py::test_as_completed_timeout_sync."""
    x = module_client.submit(inc, 1)
    y = module_client.submit(inc, 1)
    z = module_client.submit(slowinc, 2, delay=3)
    # (x and y done first: the timeout counts from here, and a loaded machine may take
    # longer than 0.5 s for a round trip; distributed's test leaves that to chance)
    wait([x, y])
    seq = as_completed([x, y, z], timeout="0.5s")
    next(seq)
    next(seq)
    with pytest.raises(TimeoutError):
        next(seq)


def test_as_completed_sync(module_client: Client) -> None:
    """Port of distributed/tests/test_as_completed.py::test_as_completed_sync."""
    x = module_client.submit(inc, 1)
    y = module_client.submit(inc, 2)
    z = module_client.submit(inc, 1)
    seq = as_completed([x, y, z])
    assert seq.count() == 3
    assert isinstance(seq, Iterator)
    assert set(seq) == {x, y, z}
    assert seq.count() == 0
    assert list(as_completed([])) == []


def test_as_completed_with_non_futures(module_client: Client) -> None:
    """Port of distributed/tests/test_as_completed.py::test_as_completed_with_non_futures."""
    with pytest.raises(TypeError, match="Input must be a future, got 1"):
        list(as_completed([1, 2, 3]))


def test_as_completed_add(module_client: Client) -> None:
    """Port of distributed/tests/test_as_completed.py::test_as_completed_add."""
    total = 0
    expected = sum(map(inc, range(10)))
    futures = module_client.map(inc, range(10))
    ac = as_completed(futures)
    for future in ac:
        result = future.result()
        total += result
        if random.random() < 0.5:
            future = module_client.submit(add, future, 10)
            ac.add(future)
            expected += result + 10
    assert total == expected


def test_as_completed_update(module_client: Client) -> None:
    """Port of distributed/tests/test_as_completed.py::test_as_completed_update."""
    total = 0
    todo = list(range(10))
    expected = sum(map(inc, todo))
    ac = as_completed([])
    while todo or not ac.is_empty():
        if todo:
            work, todo = todo[:4], todo[4:]
            ac.update(module_client.map(inc, work))
        batch = ac.next_batch(block=True)
        total += sum(r.result() for r in batch)
    assert total == expected


def test_as_completed_repeats(module_client: Client) -> None:
    """Port of distributed/tests/test_as_completed.py::test_as_completed_repeats."""
    ac = as_completed()
    x = module_client.submit(inc, 1)
    ac.add(x)
    ac.add(x)
    assert next(ac) is x
    assert next(ac) is x
    with pytest.raises(StopIteration):
        next(ac)
    ac.add(x)
    assert next(ac) is x


def test_as_completed_is_empty(module_client: Client) -> None:
    """Port of distributed/tests/test_as_completed.py::test_as_completed_is_empty."""
    ac = as_completed()
    assert ac.is_empty()
    x = module_client.submit(inc, 1)
    ac.add(x)
    assert not ac.is_empty()
    assert next(ac) is x
    assert ac.is_empty()


def test_as_completed_cancel(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_as_completed.py::test_as_completed_cancel."""

    async def body(c: Client) -> None:
        x = c.submit(inc, 1)
        y = c.submit(inc, 1)
        ac = as_completed([x, y])
        await x.cancel()
        async for fut in ac:
            assert fut is y or fut is x
        assert ac.queue.empty()
        res = [fut async for fut in as_completed([x, y, x])]
        assert len(res) == 3
        assert set(res) == {x, y}
        assert res.count(x) == 2

    run_async(module_cluster, body)


def test_as_completed_cancel_last(module_client: Client, tmp_path: Path) -> None:
    """Port of distributed/tests/test_as_completed.py::test_as_completed_cancel_last:
    ``w`` and ``y`` are cancelled from another thread while the iteration waits
    (distributed schedules that on its loop with ``add_callback``)."""
    w = module_client.submit(until_touched, str(tmp_path / "go"), 1)
    x = module_client.submit(inc, 1)
    y = module_client.submit(until_touched, str(tmp_path / "go"), 2)

    def cancel() -> None:
        w.cancel()
        y.cancel()

    ac = as_completed([x, y])
    canceller = threading.Thread(target=cancel)
    canceller.start()
    try:
        result = set(ac)
    finally:
        canceller.join()
        (tmp_path / "go").touch()  # the cancelled tasks' threads end
    assert result == {x, y}


def test_async_for_py2_equivalent(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_as_completed.py::test_async_for_py2_equivalent."""

    async def body(c: Client) -> None:
        futures = c.map(slowinc, [0.01] * 3, pure=False)
        seq = as_completed(futures)
        x, y, z = [el async for el in seq]
        assert x.done() and y.done() and z.done()
        assert x.key != y.key

    run_async(module_cluster, body)


def test_as_completed_error_async(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_as_completed.py::test_as_completed_error_async."""

    async def body(c: Client) -> None:
        x = c.submit(throws, 1)
        y = c.submit(inc, 1)
        ac = as_completed([x, y])
        result = {el async for el in ac}
        assert result == {x, y}
        assert x.status == "error"
        assert y.status == "finished"

    run_async(module_cluster, body)


def test_as_completed_error(module_client: Client) -> None:
    """Port of distributed/tests/test_as_completed.py::test_as_completed_error."""
    x = module_client.submit(throws, 1)
    y = module_client.submit(inc, 1)
    ac = as_completed([x, y])
    result = set(ac)
    assert result == {x, y}
    assert x.status == "error"
    assert y.status == "finished"


def test_as_completed_with_results(module_client: Client) -> None:
    """Port of distributed/tests/test_as_completed.py::test_as_completed_with_results."""
    x = module_client.submit(throws, 1)
    y = module_client.submit(inc, 5)
    z = module_client.submit(inc, 1)
    ac = as_completed([x, y, z], with_results=True)
    y.cancel()
    with pytest.raises(RuntimeError) as exc:
        list(ac)
    assert str(exc.value) == "hello!"


def test_as_completed_with_results_async(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_as_completed.py::test_as_completed_with_results_async."""

    async def body(c: Client) -> None:
        x = c.submit(throws, 1)
        y = c.submit(inc, 5)
        z = c.submit(inc, 1)
        ac = as_completed([x, y, z], with_results=True)
        await y.cancel()
        with pytest.raises(RuntimeError) as exc:
            async for _ in ac:
                pass
        assert str(exc.value) == "hello!"

    run_async(module_cluster, body)


def test_as_completed_with_results_no_raise(module_client: Client) -> None:
    """Port of distributed/tests/test_as_completed.py::test_as_completed_with_results_no_raise."""
    x = module_client.submit(throws, 1)
    y = module_client.submit(inc, 5)
    z = module_client.submit(inc, 1)
    ac = as_completed([x, y, z], with_results=True, raise_errors=False)
    y.cancel()
    res = list(ac)
    dd = {r[0]: r[1:] for r in res}
    assert dd.keys() == {x, y, z}
    assert x.status == "error"
    assert y.status == "cancelled"
    assert z.status == "finished"
    assert isinstance(dd[y][0], CancelledError) or dd[y][0] == 6
    assert isinstance(dd[x][0][1], RuntimeError)
    assert dd[z][0] == 2


def test_str(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_as_completed.py::test_str."""

    async def body(c: Client) -> None:
        futures = c.map(slowinc, range(3), delay=0.2)
        ac = as_completed(futures)
        assert "waiting=3" in str(ac)
        assert "waiting=3" in repr(ac)
        assert "done=0" in str(ac)
        assert "done=0" in repr(ac)
        await ac.__anext__()
        await asyncio.to_thread(poll, lambda: "done=2" in str(ac), 10)

    run_async(module_cluster, body)


def test_as_completed_with_results_no_raise_async(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_as_completed.py::
    test_as_completed_with_results_no_raise_async."""

    async def body(c: Client) -> None:
        x = c.submit(throws, 1, key="x")
        y = c.submit(inc, 5, key="y")
        z = c.submit(inc, 1, key="z")
        ac = as_completed([x, y, z], with_results=True, raise_errors=False)
        await y.cancel()
        res = [el async for el in ac]
        dd = {r[0]: r[1:] for r in res}
        assert set(dd.keys()) == {y, x, z}
        assert x.status == "error"
        assert y.status == "cancelled"
        assert z.status == "finished"
        assert isinstance(dd[y][0], CancelledError)
        assert isinstance(dd[x][0][1], RuntimeError)
        assert dd[z][0] == 2

    run_async(module_cluster, body)


def test_clear(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_as_completed.py::test_clear (the scheduler's tasks
    emptying after ``del futures`` is not read)."""

    async def body(c: Client) -> None:
        futures = c.map(inc, range(3))
        ac = as_completed(futures)
        await wait(futures)
        ac.clear()
        with pytest.raises(StopAsyncIteration):
            await ac.__anext__()

    run_async(module_cluster, body)


def test_next_batch_and_batches_as_distributed(module_client: Client) -> None:
    """``next_batch(block=True)`` raises ``StopIteration`` once nothing is left (as
    distributed's), ``batches()`` ends there; a batch's later errors do not raise."""
    ac = as_completed(module_client.map(inc, range(4)))
    assert sorted(f.result() for batch in ac.batches() for f in batch) == [1, 2, 3, 4]
    with pytest.raises(StopIteration):
        ac.next_batch(block=True)
    assert ac.next_batch(block=False) == []
