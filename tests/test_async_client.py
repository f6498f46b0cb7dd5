"""The asynchronous client (``Client(..., asynchronous=True)``), as distributed's async
tests use it: ``await Client(...)``, ``async with``, ``await future``, ``await
client.gather``, ``async for ... in as_completed``, ``await wait``, awaitable
cluster-wide calls; and the blocking client, which runs the same coroutines on a loop
thread of its own."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from polling import poll
from tasklib import wait_for_file

from redisdask import Client, FutureCancelledError, LocalCluster, RedisDaskError, as_completed, wait
from redisdask.deploy.embedded import EmbeddedRedis

pytestmark = pytest.mark.timeout(120)


def inc(x: int) -> int:
    return x + 1


def divide(a: int, b: int) -> float:
    return a / b


def pid() -> int:
    return os.getpid()


def later(value: int, seconds: float) -> int:
    threading.Event().wait(seconds)  # (a task that takes a while: the waits start first)
    return value


def run(main: Callable[[], Any]) -> Any:
    return asyncio.run(main())


def test_submit_gather_as_completed_wait_under_asyncio_run(cluster: LocalCluster) -> None:
    async def main() -> None:
        async with Client(cluster, asynchronous=True) as client:
            assert client.asynchronous and client.status == "running"
            x = client.submit(inc, 1)  # no await: submit returns the future at once
            assert await x == 2
            assert await x.result(timeout="10s") == 2
            futures = client.map(inc, range(20))
            assert await client.gather(futures) == list(range(1, 21))
            assert await client.gather({"a": futures[:2], "b": x}) == {"a": [1, 2], "b": 2}
            seen = [await f async for f in as_completed(futures)]
            assert sorted(seen) == list(range(1, 21))
            pairs = [pair async for pair in as_completed(futures[:3], with_results=True)]
            assert sorted(result for _f, result in pairs) == [1, 2, 3]
            done, not_done = await wait(futures)
            assert len(done) == 20 and not not_done
            y = client.submit(inc, x)  # a future as an argument: a dependency
            assert await y == 3

    run(main)


def test_errors_come_back_with_their_traceback_and_await_raises(cluster: LocalCluster) -> None:
    async def main() -> None:
        async with Client(cluster, asynchronous=True) as client:
            bad = client.submit(divide, 1, 0)
            with pytest.raises(ZeroDivisionError) as info:
                await bad
            assert "divide" in "".join(traceback.format_tb(info.tb))
            assert isinstance(await bad.exception(), ZeroDivisionError)
            assert await bad.traceback() is not None
            ok = client.submit(inc, 1)
            with pytest.raises(ZeroDivisionError):
                await client.gather([ok, bad])
            assert await client.gather([ok, bad], errors="skip") == [2]
            results = [pair async for pair in as_completed([bad], with_results=True,
                                                           raise_errors=False)]  # fmt: skip
            assert isinstance(results[0][1][1], ZeroDivisionError)  # (type, exc, traceback)

    run(main)


def test_await_client_then_close_and_cancel(cluster: LocalCluster, tmp_path: Path) -> None:
    async def main() -> None:
        client = await Client(cluster.redis_url, cluster.cluster_name, asynchronous=True)
        running = client.submit(wait_for_file, str(tmp_path / "done"))  # still running
        await client.cancel(running, reason="not needed")
        with pytest.raises(FutureCancelledError, match="not needed"):
            await running
        [data] = await client.scatter([41])
        assert await client.submit(inc, data) == 42
        assert (await client.who_has(data))[data.key]  # a worker holds it
        await client.close()
        assert client.status == "closed"
        with pytest.raises(RedisDaskError, match="closed"):
            client.submit(inc, 1)
        await client.close()  # twice: nothing

    run(main)
    (tmp_path / "done").touch()  # the cancelled task ends: the cluster closes at once


def test_cluster_wide_calls_are_awaitable(cluster: LocalCluster) -> None:
    async def main() -> None:
        async with Client(cluster, asynchronous=True) as client:
            await client.wait_for_workers(2, timeout=30)
            info = await client.scheduler_info()
            assert info["n_workers"] == 2
            pids = await client.run(pid)
            assert set(pids) == set(info["workers"])
            x = client.submit(inc, 1)
            await client.publish_dataset(x=x)
            assert await client.list_datasets() == ("x",)
            assert await (await client.get_dataset("x")) == 2
            await client.unpublish_dataset("x")
            assert await client.compute(_delayed_sum()) == 6

    run(main)


def _delayed_sum() -> Any:
    import dask

    return dask.delayed(sum)([1, 2, 3])


def test_an_async_client_needs_a_running_loop_and_async_with() -> None:
    with pytest.raises(RuntimeError, match="running event loop"):
        Client("redis://127.0.0.1:1/0", asynchronous=True)


def test_a_blocking_call_on_the_async_clients_loop_is_refused_not_hung(
    cluster: LocalCluster,
) -> None:
    async def main() -> None:
        async with Client(cluster, asynchronous=True) as client:
            futures = client.map(inc, range(3))
            with pytest.raises(RuntimeError, match="would block the client's own event loop"):
                for _f in as_completed(futures):  # a blocking iteration on the loop
                    pass
            with pytest.raises(TypeError, match="async with"), client:
                pass
            assert await client.gather(futures) == [1, 2, 3]  # the client still works

    run(main)


def test_a_blocking_clients_futures_can_be_awaited_from_asyncio(client: Client) -> None:
    x = client.submit(inc, 1)

    async def main() -> int:
        return await x

    assert asyncio.run(main()) == 2


def test_a_done_callback_may_wait_for_other_futures(client: Client) -> None:
    """Callbacks run in a thread of the client's own, not on its loop: one that blocks
    on a future's result would otherwise wait for the loop it blocks."""
    x = client.submit(inc, 1)
    results: list[int] = []
    called = threading.Event()

    def callback(future: Any) -> None:
        results.append(future.result() + client.submit(inc, 10).result())
        called.set()

    x.add_done_callback(callback)
    assert called.wait(30)
    assert results == [13]


def test_an_async_graph_redis_refuses_errs_its_future_instead_of_hanging(
    redis_url: str,
) -> None:
    """An asynchronous ``submit`` does not wait for its write: when Redis refuses it
    (here an argument larger than its proto-max-bulk-len), the future errs."""
    with EmbeddedRedis() as server:
        r = redis.Redis.from_url(server.url)
        r.config_set("proto-max-bulk-len", 1 << 20)
        r.close()
        with LocalCluster(1, redis_url=server.url, nanny=False) as cluster:

            async def main() -> None:
                async with Client(cluster, asynchronous=True) as client:
                    big = client.submit(len, b"x" * (2 << 20))
                    with pytest.raises(RedisDaskError, match=r"never sent.*proto-max-bulk-len"):
                        await big.result(timeout=60)
                    assert await client.submit(inc, 1) == 2  # the client goes on

            run(main)


def test_a_release_never_overtakes_a_graph_queued_before_it(client: Client) -> None:
    """``submit`` queues its graph for the sender task.  A future dropped after a graph
    that depends on it was queued, but before that graph was written, must be released
    after it: released first, the scheduler forgot the key, and the dependent erred with
    DataUnavailableError (found by the chaos test)."""
    a = client.submit(inc, 1)
    assert a.result(timeout=30) == 2  # its graph is in
    with client._channel.send_lock:  # the sender waits: the next sends pile up in its outbox
        b = client.submit(inc, a)
        del a  # its release is queued after b, which depends on it
        gc.collect()
    assert b.result(timeout=30) == 3


def test_a_release_waits_for_a_graph_queued_while_the_sender_was_writing(client: Client) -> None:
    """The sender takes what is queued, then writes it.  A graph queued in between, and a
    future it depends on dropped after it, must not see that future released in the
    write under way, ahead of the graph still queued (found by bench/throughput.py's tree:
    the scheduler forgot the key and the dependent erred with DataUnavailableError)."""
    a = client.submit(inc, 1)
    assert a.result(timeout=30) == 2
    with client._channel.send_lock:  # the sender takes the next send, then waits to write it
        other = client.submit(inc, 100)
        poll(lambda: client._channel._writing and not client._channel._outbox, timeout=10)
        b = client.submit(inc, a)  # queued behind the write under way
        del a  # released after b, which depends on it
        gc.collect()
    assert other.result(timeout=30) == 101
    assert b.result(timeout=30) == 3


def test_a_key_released_then_submitted_again_in_one_write_is_computed_anew(
    client: Client,
) -> None:
    y = client.get({"y": (inc, 1)}, "y", sync=False)
    assert y.result(timeout=30) == 2
    with client._channel.send_lock:  # its release and the new graph go in one pipeline
        del y
        gc.collect()
        y = client.get({"y": (inc, 10)}, "y", sync=False)
    assert y.result(timeout=30) == 11


def test_a_release_sent_with_a_refused_graph_is_sent_again(redis_url: str) -> None:
    """A write Redis refuses is tried again without the graph: the releases it carried
    still reach the scheduler (before, they were dropped and the keys stayed wanted)."""
    with EmbeddedRedis() as server:
        r = redis.Redis.from_url(server.url)
        r.config_set("proto-max-bulk-len", 1 << 20)
        with LocalCluster(1, redis_url=server.url, nanny=False) as cluster, Client(cluster) as c:
            a = c.submit(inc, 1)
            assert a.result(timeout=30) == 2
            task = c.keys.task(a._key)
            with c._channel.send_lock:  # the refused graph and then a's release go in one write
                big = c.submit(len, b"x" * (2 << 20))
                del a
                gc.collect()
            with pytest.raises(RedisDaskError, match="proto-max-bulk-len"):
                big.result(timeout=60)
            # the scheduler forgets a once the release lands (no one else wants it)
            poll(lambda: not r.exists(task), timeout=30)


def test_two_waits_on_one_as_completed_are_both_woken(cluster: LocalCluster) -> None:
    """Each ``async for`` (or blocking iteration) waiting on one ``as_completed`` gets
    its wake-up: the wait registered second used to take the first one's place, and the
    first waited for ever."""

    async def main() -> None:
        async with Client(cluster, asynchronous=True) as client:
            a, b = client.submit(later, 1, 0.5), client.submit(later, 2, 0.5)
            ac = as_completed([a, b])
            got = await asyncio.wait_for(asyncio.gather(ac.__anext__(), ac.__anext__()), 30)
            assert {f.key for f in got} == {a.key, b.key}

    run(main)


def test_a_graph_that_was_never_written_is_sent_again_when_resubmitted(
    redis_url: str,
) -> None:
    """The future of a refused graph errs; submitting the same (pure) key again, once
    Redis takes it, sends it again instead of answering with the old error."""
    with EmbeddedRedis() as server:
        r = redis.Redis.from_url(server.url)
        r.config_set("proto-max-bulk-len", 1 << 20)
        with LocalCluster(1, redis_url=server.url, nanny=False) as cluster, Client(cluster) as c:
            data = b"x" * (2 << 20)
            refused = c.submit(len, data)
            with pytest.raises(RedisDaskError, match="proto-max-bulk-len"):
                refused.result(timeout=60)
            r.config_set("proto-max-bulk-len", 512 << 20)
            again = c.submit(len, data)  # the same key, while `refused` is still held
            assert again.key == refused.key
            assert again.result(timeout=60) == 2 << 20
