"""Ports of distributed's tests of ``MultiLock`` (tests/test_multi_locks.py, distributed
2026.8) on one cluster for the module, and what redisdask adds: leases that lapse with a
killed holder, misuse, keys left behind.

distributed's tests read the scheduler extension's queues (``ext.locks``,
``ext.requests_left``); here the same facts are asserted through the public API: a lock
that ``ext.locks`` shows as held by someone is one a probe cannot take
(``MultiLock([name]).acquire(blocking=False)``: it joins and leaves the queue in one
script, changing nothing).  Async tests run with an asynchronous client (``arun``).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from polling import poll
from test_dask_primitives import arun

from redisdask import Client, LocalCluster, MultiLock, Variable
from redisdask.errors import LeaseNotHeldError

pytestmark = pytest.mark.timeout(120)


async def free(*names: str) -> list[bool]:
    """Which of ``names`` nobody holds nor waits for now (each probed alone)."""
    out = []
    for name in names:
        probe = MultiLock([name])
        taken = await probe.acquire(blocking=False)
        if taken:
            await probe.release()
        out.append(taken)
    return out


def multilock_keys(client: Client) -> set[bytes]:
    """The cluster's MultiLock keys now (queues, requests, leases, signals)."""
    pattern = client.keys.prefix.replace("{", "[{]").replace("}", "[}]") + "*multilock*"
    return set(client.redis.scan_iter(match=pattern, count=1000))


@pytest.fixture(autouse=True)
def leaves_nothing(module_cluster: LocalCluster) -> Iterator[None]:
    """Each test's MultiLocks leave no key behind once released (a waiter that gave up
    leaves at once too), so tests sharing the cluster start from free locks."""
    yield
    with Client(module_cluster, set_as_default=False) as c:
        poll(lambda: not multilock_keys(c), timeout=10)


# --------------------------------------------------------------------------- ports


def _single(_: int) -> None:
    """In a task: inside ``MultiLock(["x"])`` nobody else is (the flag says so)."""
    flag = Variable("x-locked")
    with MultiLock(names=["x"]):
        assert flag.get() is False
        flag.set(True)
        threading.Event().wait(0.01)
        assert flag.get() is True
        flag.set(False)


def test_single_lock(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_multi_locks.py::test_single_lock (a Variable for
    set_metadata; the module's workers have one thread each, not 8; the extension's
    emptiness is the ``leaves_nothing`` fixture's check)."""

    async def test(c: Client) -> None:
        await Variable("x-locked").set(False)
        futures = c.map(_single, range(20))
        await c.gather(futures)
        await Variable("x-locked").delete()

    arun(module_cluster, test)


def test_timeout(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_multi_locks.py::test_timeout (``ext.locks["x"] ==
    [lock1.id]``: "x" is still lock1's after lock2 gave up)."""

    async def test(c: Client) -> None:
        lock1 = MultiLock(names=["x"])
        result = await lock1.acquire()
        assert result is True
        assert await free("x") == [False]

        lock2 = MultiLock(names=["x"])
        assert lock1.id != lock2.id

        start = time.monotonic()
        result = await lock2.acquire(timeout=0.1)
        stop = time.monotonic()
        assert stop - start < 0.3
        assert result is False
        assert await free("x") == [False]  # still lock1's

        await lock1.release()
        assert await free("x") == [True]

    arun(module_cluster, test)


def test_timeout_wake_waiter(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_multi_locks.py::test_timeout_wake_waiter"""

    async def test(c: Client) -> None:
        l1 = MultiLock(names=["x"])
        l2 = MultiLock(names=["x", "y"])
        l3 = MultiLock(names=["y"])
        await l1.acquire()

        l2_acquire = asyncio.ensure_future(l2.acquire(timeout=0.5))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(l2_acquire), 0.1)

        l3_acquire = asyncio.ensure_future(l3.acquire())
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(l3_acquire), 0.1)

        assert await l2_acquire is False
        assert await l3_acquire
        await l1.release()
        await l3.release()

    arun(module_cluster, test)


def test_multiple_locks(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_multi_locks.py::test_multiple_locks (the
    extension's queues through probes; l3's acquire is awaited before its release,
    where distributed's ``locked()`` is already True while it waits)."""

    async def test(c: Client) -> None:
        l1 = MultiLock(names=["l1"])
        l2 = MultiLock(names=["l2"])
        l3 = MultiLock(names=["l1", "l2"])

        # Both `l1` and `l2` are free to acquire
        assert await l1.acquire()
        assert await l2.acquire()
        assert await free("l1", "l2") == [False, False]

        # Since `l3` requires both `l1` and `l2`, it isn't available immediately
        l3_acquire = asyncio.ensure_future(l3.acquire())
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(l3_acquire), 0.1)

        # Releasing `l1` isn't enough since `l3` also requires `l2`; `l3` holds `l1` now
        await l1.release()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(l3_acquire), 0.1)
        assert await free("l1", "l2") == [False, False]

        # Releasing `l2` should make `l3` available
        await l2.release()
        assert await asyncio.wait_for(l3_acquire, 5) is True
        assert l3.locked()
        assert await free("l1", "l2") == [False, False]

        await l3.release()
        assert await free("l1", "l2") == [True, True]

    arun(module_cluster, test)


def test_num_locks(module_cluster: LocalCluster) -> None:
    """Port of distributed/tests/test_multi_locks.py::test_num_locks (the extension's
    queues through probes: which names are held; l3's acquire awaited, not slept for)."""

    async def test(c: Client) -> None:
        l1 = MultiLock(names=["l1", "l2", "l3"])
        l2 = MultiLock(names=["l1", "l2", "l3"])
        l3 = MultiLock(names=["l1", "l2", "l3", "l4"])

        # Even though `l1` and `l2` uses the same lock names they
        # only requires a subset of the locks: l1 takes "l1", l2 "l2" and "l3"
        assert await l1.acquire(num_locks=1)
        assert await l2.acquire(num_locks=2)
        assert await free("l1", "l2", "l3", "l4") == [False, False, False, True]

        # Since `l3` requires three out of four locks it has to wait (holding "l4")
        l3_acquire = asyncio.ensure_future(l3.acquire(num_locks=3))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(l3_acquire), 0.1)
        assert await free("l4") == [False]

        # Releasing `l1` isn't enough since `l3` also requires three locks
        await l1.release()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(l3_acquire), 0.1)
        assert await free("l1") == [False]  # l3's now

        # Releasing `l2` is enough to release `l3`, which then heads every queue
        await l2.release()
        assert await asyncio.wait_for(l3_acquire, 5) is True
        assert await free("l1", "l2", "l3", "l4") == [False] * 4

        await l3.release()
        assert await free("l1", "l2", "l3", "l4") == [True] * 4

    arun(module_cluster, test)


# --------------------------------------------------------------------------- redisdask's


def test_multilock_sync_misuse_and_pickling(module_client: Client) -> None:
    """Blocking use (``with``, ``acquire(timeout=)``), distributed's errors for misuse,
    names of any dask-key form, and a MultiLock pickled into a task keeps its names."""
    with MultiLock(["a", ("b", 1)]) as ml:
        assert ml.locked()
        assert MultiLock([("b", 1), "c"]).acquire(timeout=0.1) is False
        with pytest.raises(RuntimeError, match="holds its locks already"):
            ml.acquire()
    assert not ml.locked()
    with pytest.raises(ValueError, match="Lock is not yet acquired"):
        ml.release()
    with pytest.raises(ValueError, match="non-blocking"):
        ml.acquire(blocking=False, timeout=1)
    with pytest.raises(ValueError, match="between 1 and"):
        ml.acquire(num_locks=3)
    with pytest.raises(ValueError, match="no names"):
        MultiLock().acquire()
    with pytest.raises(TypeError, match="list of names"):
        MultiLock("ab")  # type: ignore[arg-type]

    ml2 = pickle.loads(pickle.dumps(MultiLock(["a", "b"])))
    assert ml2.names == ["a", "b"]
    assert module_client.submit(_hold_and_tell, ml2).result() == ["a", "b"]


def test_overlapping_multilocks_exclude_each_other_without_deadlock(
    module_client: Client,
) -> None:
    """Threads taking overlapping pairs of three locks, in opposite orders (the case
    that deadlocks with locks taken one by one): each lock has one holder at a time,
    and every thread gets through."""
    pairs = [["a", "b"], ["b", "c"], ["c", "a"], ["b", "a"]]
    inside = {"a": 0, "b": 0, "c": 0}
    seen: list[int] = []
    guard = threading.Lock()

    def work(names: list[str]) -> None:
        for _ in range(8):
            with MultiLock(names):
                with guard:
                    for n in names:
                        inside[n] += 1
                    seen.append(max(inside.values()))
                threading.Event().wait(0.002)
                with guard:
                    for n in names:
                        inside[n] -= 1

    threads = [threading.Thread(target=work, args=(p,)) for p in pairs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert len(seen) == 32 and max(seen) == 1


def _hold_and_tell(ml: MultiLock) -> list[str]:
    with ml:
        return list(ml.names)


def test_cancelled_acquire_leaves_its_queues(module_cluster: LocalCluster) -> None:
    """A waiting ``await ml.acquire()`` that is cancelled gives up its place (and the
    locks it headed while waiting) at once, not when its word lapses."""

    async def test(c: Client) -> None:
        holder = MultiLock(["p"])
        assert await holder.acquire()
        waiter = MultiLock(["p", "q"])  # heads "q" while it waits for "p"
        task = asyncio.ensure_future(waiter.acquire())
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), 0.2)
        assert await free("q") == [False]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)  # (the leaving runs in the loop's executor)
        q = MultiLock(["q"])
        assert await q.acquire(timeout=1) is True  # well before the word's ~3 s
        await q.release()
        await holder.release()

    arun(module_cluster, test)


def test_multilock_of_a_killed_holder_is_freed_when_its_lease_lapses(
    module_cluster: LocalCluster, module_client: Client
) -> None:
    """A process holding a MultiLock renews its lease while it lives, and when killed
    with -9 its locks pass to the next waiter once the lease lapses (1.5 s here)."""
    names = [f"k-{uuid.uuid4().hex[:8]}", f"k-{uuid.uuid4().hex[:8]}"]
    script = (
        "import threading\n"
        "from redisdask import Client, MultiLock\n"
        f"c = Client({module_cluster.redis_url!r}, cluster_name={module_cluster.cluster_name!r})\n"
        f"ml = MultiLock({names!r})\n"
        "assert ml.acquire(timeout=10)\n"
        "print('held', flush=True)\n"
        "threading.Event().wait(60)\n"  # holds them (renewing its lease) until killed
    )
    env = {**os.environ, "REDISDASK__SCHEDULER__LOCKS__LEASE_TIMEOUT": "1.5"}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"held"  # type: ignore[union-attr]
        waiter = MultiLock([names[1], "other"])
        assert not waiter.acquire(timeout=2.0)  # renewed: still held past its lease
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        assert waiter.acquire(timeout=10)
        assert time.monotonic() - killed < 1.5 + 1.5  # its lease (not 30 s), and slack
        first = MultiLock([names[0]])
        assert first.acquire(blocking=False)  # the other one is free too
        first.release()
        waiter.release()
    finally:
        proc.kill()
        proc.wait()


def test_release_after_the_lease_lapsed_raises(module_client: Client) -> None:
    """A holder whose lease lapsed (nothing renewed it) is told so by ``release``,
    as ``Lock``'s is; the lock was free for others meanwhile."""
    ml = MultiLock(["lapse"])
    assert ml.acquire()
    r: redis.Redis = module_client.redis
    ml._renewing = False  # as a process paused past its lease: nothing renews it
    r.zadd(module_client.keys.multilock_leases, {ml.id: 0})  # its lease ends now
    other = MultiLock(["lapse"])
    assert other.acquire(timeout=5)
    with pytest.raises(LeaseNotHeldError, match="had lapsed"):
        ml.release()
    other.release()
