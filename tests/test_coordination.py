"""Coordination primitives end to end: a real Redis, a real scheduler, real worker
processes (``Lock``, ``Semaphore``, ``Event``, ``Variable``, ``Queue``, datasets and
``fire_and_forget``), used from two clients and from inside tasks, with the scheduler
killed in the middle, and the keys each leaves behind counted before and after."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from conftest import ClusterFactory
from polling import poll

from redisdask import Client, Event, LocalCluster, Lock, Queue, Semaphore, Variable, fire_and_forget
from redisdask.coordination.scripts import CoordinationScripts
from redisdask.errors import ClientClosedError, FutureCancelledError, LeaseNotHeldError
from redisdask.observe.inspect import read_keys
from redisdask.protocol import CLIENT_TO_SCHEDULER, parse
from redisdask.store.bootstrap import ensure_cluster
from redisdask.store.keyspace import FIRE_AND_FORGET, Keys

pytestmark = pytest.mark.timeout(90)

# every key a primitive, a dataset or a holder may write
COORDINATION = re.compile(
    rb":(lock|semaphore|event|variable|queue|queue-refs|waiters|signal):|:datasets$"
    rb"|:holders$|:client:holder:"
)


def coordination_keys(r: redis.Redis, keys: Keys) -> set[bytes]:
    pattern = keys.prefix.replace("{", "[{]").replace("}", "[}]") + "*"
    return {k for k in r.scan_iter(match=pattern, count=1000) if COORDINATION.search(k)}


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def killable(redis_url: str, cluster_name: str, **options: Any) -> LocalCluster:
    """One worker and a scheduler to kill: a 1 s lease, so the next one leads soon."""
    return LocalCluster(
        n_workers=1,
        redis_url=redis_url,
        cluster_name=cluster_name,
        scheduler_options={"lease_ttl": 1},
        **options,
    )


@pytest.fixture(scope="module")
def shared(redis_url: str) -> Iterator[LocalCluster]:
    """One cluster for the tests that kill nothing: 2 workers x 2 threads."""
    name = f"t-coordination-{uuid.uuid4().hex[:8]}"
    with LocalCluster(
        n_workers=2, threads_per_worker=2, redis_url=redis_url, cluster_name=name
    ) as cluster:
        yield cluster


@pytest.fixture
def c(shared: LocalCluster) -> Iterator[Client]:
    with Client(shared) as client:
        yield client


@pytest.fixture
def c2(shared: LocalCluster) -> Iterator[Client]:
    with Client(shared, set_as_default=False) as client:
        yield client


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def leaves_nothing(r: redis.Redis, shared: LocalCluster) -> Iterator[None]:
    """The test's primitives leave no key behind once unused (waiters' and signals'
    lapse within seconds; the rest go at once)."""
    keys = Keys(shared.cluster_name)
    before = coordination_keys(r, keys)
    yield
    poll(lambda: coordination_keys(r, keys) == before, timeout=10)


# --------------------------------------------------------------------------- tasks


def inc(x: int) -> int:
    return x + 1


def exclusive(name: str, path: str, i: int) -> int:
    """Under the lock: the marker file must not exist (nobody else is inside)."""
    from redisdask import Lock

    with Lock(name):
        marker = Path(path + ".inside")
        if marker.exists():
            raise AssertionError(f"task {i} found another holder inside the lock")
        marker.write_text(str(i))
        threading.Event().wait(0.01)  # a critical section long enough to be overlapped
        count = Path(path)
        count.write_text(str(int(count.read_text() or 0) + 1))
        marker.unlink()
    return i


def count_holders(sem: Semaphore, redis_url: str, counter: str) -> int:
    """How many holders there were with us inside the semaphore, at the most."""
    r = redis.Redis.from_url(redis_url)
    with sem:
        inside = r.incr(counter)
        r.rpush(counter + ":seen", inside)
        threading.Event().wait(0.2)  # a window for the others to overlap it
        r.decr(counter)
    return int(inside)


def wait_for_event(name: str, timeout: float) -> bool:
    from redisdask import Event

    return Event(name).wait(timeout)


def set_event(name: str) -> bool:
    from redisdask import Event

    Event(name).set()
    return True


def queue_roundtrip(name: str) -> list[int]:
    """Plain values through a queue inside a task (through the worker's client)."""
    from redisdask import Queue

    q = Queue(name)
    q.put(1)
    q.put([2, 3])
    return [q.get(timeout=5), *q.get(timeout=5)]


def write_file(path: str, go: str) -> str:
    deadline = time.monotonic() + 60
    while not os.path.exists(go) and time.monotonic() < deadline:
        threading.Event().wait(0.02)
    Path(path).write_text("done")
    return path


# --------------------------------------------------------------------------- fire and forget


def test_fire_and_forget_runs_after_its_client_closed_and_its_keys_go_after(
    shared: LocalCluster, r: redis.Redis, tmp_path: Path, leaves_nothing: None
) -> None:
    keys = Keys(shared.cluster_name)
    out, go = tmp_path / "out", tmp_path / "go"
    with Client(shared, set_as_default=False) as client:
        future = client.submit(write_file, str(out), str(go), pure=False)
        key = future.key
        fire_and_forget(future)
        del future
    # its client is gone (its wants released), and the task has not finished yet
    assert not out.exists()
    poll(lambda: r.smembers(keys.client_wants(FIRE_AND_FORGET)) == {key.encode()})
    go.touch()
    poll(lambda: out.exists())
    poll(lambda: not r.exists(keys.task(key)))  # released, then forgotten
    assert not r.exists(keys.client_events(FIRE_AND_FORGET))  # a holder gets no events


def test_fire_and_forget_of_a_collection_and_of_a_finished_future(c: Client) -> None:
    futures = c.map(inc, range(3))
    fire_and_forget({"a": futures[:2], "b": (futures[2],)})
    assert c.gather(futures) == [1, 2, 3]
    fire_and_forget(futures[0])  # ran already: nothing to hold
    c.close()
    with pytest.raises(ClientClosedError, match="is closed"):
        fire_and_forget(futures)


# --------------------------------------------------------------------------- Lock


def test_lock_excludes_across_20_tasks_on_4_threads(
    c: Client, tmp_path: Path, leaves_nothing: None
) -> None:
    name, path = unique("lock"), tmp_path / "count"
    path.write_text("0")
    futures = c.map(exclusive, [name] * 20, [str(path)] * 20, range(20))
    assert sorted(c.gather(futures)) == list(range(20))
    assert path.read_text() == "20"
    assert not Lock(name).locked()


def test_lock_acquire_release_locked_and_timeouts(c: Client, leaves_nothing: None) -> None:
    name = unique("lock")
    lock, other = Lock(name), Lock(name, client=c)
    assert lock.acquire() and lock.locked()
    assert not other.acquire(blocking=False)
    started = time.monotonic()
    assert not other.acquire(timeout="200ms")
    assert time.monotonic() - started >= 0.19
    with pytest.raises(ValueError, match="non-blocking"):
        other.acquire(blocking=False, timeout=1)
    # a waiter wakes as soon as the holder releases
    threading.Timer(0.2, lock.release).start()
    assert other.acquire(timeout=10)
    other.release()
    with Lock(name) as held:
        assert held.locked()
    assert not lock.locked()


def test_lock_released_by_a_non_holder_says_so_and_changes_nothing(
    c: Client, c2: Client, r: redis.Redis, leaves_nothing: None
) -> None:
    name = unique("lock")
    holder = Lock(name)
    assert holder.acquire()
    before = r.hgetall(Keys(c.keys.cluster).coordination("lock", name))
    for stranger in (Lock(name), Lock(name, client=c2)):
        with pytest.raises(LeaseNotHeldError, match="holds no lease") as info:
            stranger.release()
        assert isinstance(info.value, RuntimeError)  # as distributed's
    assert r.hgetall(Keys(c.keys.cluster).coordination("lock", name)) == before
    assert holder.locked()
    holder.release()
    with pytest.raises(LeaseNotHeldError, match="released more often than acquired"):
        holder.release()


def test_a_lock_whose_holder_is_killed_is_free_after_its_lease(
    shared: LocalCluster, c: Client, monkeypatch: pytest.MonkeyPatch, leaves_nothing: None
) -> None:
    name = unique("lock")
    script = (
        "import sys, threading\n"
        "from redisdask import Client, Lock\n"
        f"c = Client({shared.redis_url!r}, cluster_name={shared.cluster_name!r})\n"
        f"lock = Lock({name!r})\n"
        "assert lock.acquire(timeout=10)\n"
        "print('held', flush=True)\n"
        "threading.Event().wait(60)\n"  # holds it (renewing its lease) until killed
    )
    env = {**os.environ, "REDISDASK__SCHEDULER__LOCKS__LEASE_TIMEOUT": "1.5"}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"held"  # type: ignore[union-attr]
        # renewed: still held well past its lease
        assert not Lock(name).acquire(timeout=3.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        lock = Lock(name)
        assert lock.acquire(timeout=10)
        assert time.monotonic() - killed < 1.5 + 1.5  # its lease (not 30 s), and slack
        lock.release()
    finally:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- Semaphore


def test_semaphore_never_has_more_than_max_leases_holders(
    c: Client, r: redis.Redis, leaves_nothing: None
) -> None:
    sem = Semaphore(max_leases=2, name=unique("sem"))
    counter = f"test:{sem.name}"
    try:
        futures = c.map(count_holders, [sem] * 12, [c.redis_url] * 12, [counter] * 12, pure=False)
        assert max(c.gather(futures)) <= 2
        seen = [int(x) for x in r.lrange(counter + ":seen", 0, -1)]
        assert len(seen) == 12 and max(seen) == 2  # 4 threads: two were inside at once
    finally:
        r.delete(counter, counter + ":seen")
    assert sem.get_value() == 0


def test_semaphore_leases_and_their_misuse(c: Client, leaves_nothing: None) -> None:
    name = unique("sem")
    sem = Semaphore(max_leases=2, name=name)
    assert sem.acquire() and sem.acquire(timeout=0)
    assert sem.get_value() == 2
    assert not Semaphore(2, name).acquire(timeout=0.1)
    with pytest.raises(ValueError, match="other max_leases"):
        Semaphore(3, name).acquire(timeout=0)
    assert sem.release() and sem.release()
    with pytest.raises(LeaseNotHeldError, match="Released too often"):
        sem.release()
    with pytest.raises(ValueError, match="max_leases must be an int"):
        Semaphore(max_leases=0)
    with pytest.raises(TypeError, match="a str, bytes, int, float or a tuple"):
        Semaphore(name={"a": 1})  # type: ignore[arg-type]


# --------------------------------------------------------------------------- Event


def test_event_across_two_clients_and_inside_tasks(
    c: Client, c2: Client, leaves_nothing: None
) -> None:
    name = unique("event")
    mine, theirs = Event(name), Event(name, client=c2)
    assert not mine.is_set() and not mine.wait(0.1)
    results: list[bool] = []
    waiter_here = threading.Thread(target=lambda: results.append(theirs.wait(20)))
    waiter_here.start()
    waiting = c.submit(wait_for_event, name, 20, pure=False)
    assert c.submit(set_event, name, pure=False).result(timeout=10)  # set inside a task
    assert waiting.result(timeout=10) is True
    waiter_here.join(10)
    assert results == [True]
    assert theirs.is_set() and mine.wait(0)
    theirs.clear()
    assert not mine.is_set() and not mine.wait("100ms")


# --------------------------------------------------------------------------- Variable


def test_variable_shares_values_and_keeps_its_future_alive(
    c: Client, c2: Client, r: redis.Redis, leaves_nothing: None
) -> None:
    keys = Keys(c.keys.cluster)
    name = unique("var")
    var = Variable(name)
    with pytest.raises(TimeoutError, match="was not set"):
        Variable(name, client=c2).get(timeout=0.1)
    var.set({"a": 1})
    assert Variable(name, client=c2).get() == {"a": 1}
    future = c.submit(inc, 41)
    key = future.key
    assert future.result(timeout=10) == 42  # (the scheduler knows c wants it)
    var.set(future)
    future.release()  # the variable holds it now
    del future
    poll(lambda: key.encode() not in r.smembers(keys.client_wants(c.id)))
    assert r.hget(keys.task(key), "state") == b"memory"
    got = Variable(name, client=c2).get(timeout=5)
    assert got.client is c2 and got.result(timeout=10) == 42
    var.delete()
    assert got.result(timeout=10) == 42  # c2's own want keeps it
    got.release()
    poll(lambda: not r.exists(keys.task(key)))


def test_variable_and_queue_inside_a_task_values_and_futures(
    c: Client, leaves_nothing: None
) -> None:
    name = unique("var")

    def set_and_get(name: str) -> int:
        from redisdask import Variable

        Variable(name).set(5)
        return Variable(name).get(timeout=5) + 1

    assert c.submit(set_and_get, name).result(timeout=10) == 6
    var = Variable(name)
    assert var.get() == 5
    var.set(c.submit(inc, 1))

    def result_of_stored_future(name: str) -> int:
        """The worker's client (get_client) owns the future the variable hands over."""
        from redisdask import Queue, Variable

        from_variable = Variable(name).get(timeout=5).result(timeout=10)
        from_queue = Queue(name).get(timeout=5).result(timeout=10)
        return from_variable + from_queue

    queue = Queue(name)
    queue.put(c.submit(inc, 10))
    assert c.submit(result_of_stored_future, name).result(timeout=30) == 2 + 11
    var.delete()


# --------------------------------------------------------------------------- Queue


def test_queue_across_two_clients(
    c: Client, c2: Client, r: redis.Redis, leaves_nothing: None
) -> None:
    keys = Keys(c.keys.cluster)
    name = unique("queue")
    producer, consumer = Queue(name), Queue(name, client=c2)
    with pytest.raises(TimeoutError, match="stayed empty"):
        consumer.get(timeout=0.1)
    future = c.submit(inc, 1)
    key = future.key
    for item in (1, future, {"x": [future]}, "last"):
        producer.put(item)
    del future, item
    assert producer.qsize() == consumer.qsize() == 4
    assert r.hgetall(keys.queue_refs(name)) == {f"0:{key}".encode(): b"2"}
    assert consumer.get() == 1
    first = consumer.get(timeout=5)
    assert first.client is c2 and first.result(timeout=10) == 2
    rest = consumer.get(batch=True)
    assert rest[0]["x"][0].result(timeout=10) == 2 and rest[1] == "last"
    assert consumer.get(batch=True) == [] and consumer.qsize() == 0
    # a getter blocked on an empty queue wakes at the put
    threading.Timer(0.2, producer.put, args=("late",)).start()
    assert consumer.get(timeout=10) == "late"
    assert c.submit(queue_roundtrip, unique("queue")).result(timeout=10) == [1, 2, 3]
    del first, rest


def test_queue_maxsize_and_batches(c: Client, leaves_nothing: None) -> None:
    q = Queue(unique("queue"), maxsize=2)
    q.put(1)
    q.put(2)
    with pytest.raises(TimeoutError, match="stayed full"):
        q.put(3, timeout=0.1)
    threading.Timer(0.2, q.get).start()
    q.put(3, timeout=10)  # room made by the get
    assert q.get(batch=2) == [2, 3]
    with pytest.raises(NotImplementedError):
        q.get(batch=2, timeout=1)
    with pytest.raises(ValueError, match="maxsize"):
        Queue(maxsize=-1)


def test_a_queue_get_on_a_closed_client_says_so_and_takes_nothing(
    shared: LocalCluster, c: Client, r: redis.Redis, leaves_nothing: None
) -> None:
    name = unique("queue")
    Queue(name).put("kept")
    with Client(shared, set_as_default=False) as closing:
        q = Queue(name, client=closing)
    with pytest.raises(ClientClosedError, match="is closed"):
        q.get(timeout=1)
    with pytest.raises(ClientClosedError):
        q.put(1)
    assert Queue(name).get(timeout=1) == "kept"

    def blocked_get(q: Queue) -> BaseException | None:
        try:
            q.get()
        except BaseException as exc:
            return exc
        return None

    other = Client(shared, set_as_default=False)
    thread_result: list[BaseException | None] = []
    waiter = threading.Thread(
        target=lambda: thread_result.append(blocked_get(Queue(name, client=other)))
    )
    waiter.start()
    keys = Keys(shared.cluster_name)
    poll(lambda: r.zcard(keys.waiters("queue", name)) == 1)  # it blocks
    other.close()  # a get blocked in another thread hears of it too
    waiter.join(10)
    assert isinstance(thread_result[0], ClientClosedError)


def test_unpicklable_and_cancelled_values_are_refused_before_anything_is_written(
    c: Client, leaves_nothing: None
) -> None:
    q, var = Queue(unique("queue")), Variable(unique("var"))
    with pytest.raises(TypeError, match="could not pickle"):
        q.put(threading.Lock())
    future = c.submit(inc, 1000, pure=False)
    future.cancel()
    with pytest.raises(TimeoutError, match="unknown to scheduler"):
        var.set(future)
    with pytest.raises(TimeoutError, match="unknown to scheduler"):
        q.put(future)
    with pytest.raises(ValueError, match="was cancelled"):
        c.publish_dataset(future, name=unique("ds"))
    assert q.qsize() == 0
    with pytest.raises(TimeoutError):
        var.get(timeout=0)


# --------------------------------------------------------------------------- datasets


def test_datasets_across_clients(
    c: Client, c2: Client, r: redis.Redis, leaves_nothing: None
) -> None:
    keys = Keys(c.keys.cluster)
    x, y = c.submit(inc, 10), c.submit(inc, 20)
    name, tup = unique("ds"), ("ds", 1)
    c.publish_dataset(x, name=name)
    c.publish_dataset({tup: [x, y]}, plain=123)
    with pytest.raises(KeyError, match="already exists"):
        c.publish_dataset(y, name=name)
    assert set(c2.list_datasets()) >= {name, tup, "plain"}
    got = c2.get_dataset(name)
    assert got.client is c2 and got.result(timeout=10) == 11
    assert [f.result(timeout=10) for f in c2.datasets[tup]] == [11, 21]
    assert c2.get_dataset([name, "plain"])[1] == 123
    with pytest.raises(KeyError, match="not found"):
        c2.get_dataset(unique("missing"))
    assert c2.get_dataset(unique("missing"), default=None) is None
    c.publish_dataset(y, name=name, override=True)
    assert c2.get_dataset(name).result(timeout=10) == 21
    xkey = x.key
    del x, got
    c2.datasets["more"] = 5
    assert "more" in c.datasets and len(c.datasets) >= 4
    del c2.datasets["more"]
    c.unpublish_dataset([name, tup, "plain"])
    c.unpublish_dataset("never-published")  # ignored, as in distributed
    assert not {name, tup, "plain", "more"} & set(c.list_datasets())
    poll(lambda: not r.exists(keys.task(xkey)))  # let go once no dataset holds it
    assert r.hget(keys.task(y.key), "state") == b"memory"  # c's own future
    with pytest.raises(ValueError, match="nothing to publish"):
        c.publish_dataset()


def test_a_restart_leaves_stored_futures_cancelled_with_the_reason(
    make_cluster: ClusterFactory,
) -> None:
    with (
        make_cluster(n_workers=1) as cluster,
        Client(cluster) as client,
    ):
        name = unique("ds")
        client.publish_dataset(client.submit(inc, 1), name=name)
        client.restart()
        got = client.get_dataset(name)
        with pytest.raises(FutureCancelledError, match="restarted after it was stored"):
            got.result(timeout=5)
        client.unpublish_dataset(name)


# --------------------------------------------------------------------------- the scheduler dies


def test_datasets_and_holders_survive_a_scheduler_killed_and_restarted(
    redis_url: str, cluster_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill -9 of the scheduler: the restarted one restores the dataset's holder from
    Redis (a getter's release does not free the key), and holders never expire with a
    client's TTL (1 s here)."""
    monkeypatch.setenv("REDISDASK__SCHEDULER__CLIENT_TTL", "1")
    monkeypatch.setenv("REDISDASK__CLIENT__HEARTBEAT_INTERVAL", "0.2")
    keys = Keys(cluster_name)
    r = redis.Redis.from_url(redis_url)
    with killable(redis_url, cluster_name) as cluster:
        with Client(cluster, set_as_default=False) as publisher:
            future = publisher.submit(inc, 1)
            key = future.key
            assert future.result(timeout=10) == 2
            publisher.publish_dataset(future, name="ds")
        poll(lambda: r.smembers(keys.holders) == {b"holder:dataset:ds"})
        cluster.scheduler_process.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        cluster.scheduler_process.wait()  # type: ignore[union-attr]
        cluster.start_scheduler()
        with Client(cluster) as getter:
            got = getter.get_dataset("ds")
            assert got.result(timeout=20) == 2
            got.release()
            poll(lambda: not r.smembers(keys.client_wants(getter.id)))
            threading.Event().wait(2)  # past the client TTL: a holder would have expired
            assert r.hget(keys.task(key), "state") == b"memory"
            assert getter.get_dataset("ds").result(timeout=10) == 2
            getter.unpublish_dataset("ds")
            poll(lambda: not r.exists(keys.task(key)))
            assert not r.exists(keys.holders)


def test_every_primitive_keeps_working_through_a_scheduler_kill(
    redis_url: str, cluster_name: str, tmp_path: Path
) -> None:
    """kill -9 of the scheduler in the middle of each primitive's use: what they store
    is in Redis, and the wants they send wait in the clients stream for the next one."""
    keys = Keys(cluster_name)
    r = redis.Redis.from_url(redis_url)
    out, go = tmp_path / "out", tmp_path / "go"
    with (
        killable(redis_url, cluster_name, threads_per_worker=2) as cluster,
        Client(cluster) as a,
        Client(cluster, set_as_default=False) as b,
    ):
        x, y = a.submit(inc, 1), a.submit(inc, 2)
        assert a.gather([x, y]) == [2, 3]
        Queue("q").put(x)
        Variable("v").set(y)
        lock, sem = Lock("l"), Semaphore(2, "s")
        assert lock.acquire() and sem.acquire()
        gate = a.submit(write_file, str(out), str(go), pure=False)
        fire_and_forget(gate)
        cluster.scheduler_process.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        cluster.scheduler_process.wait()  # type: ignore[union-attr]
        for future in (x, y, gate):
            future.release()
        got_x, got_y = Queue("q", client=b).get(timeout=5), Variable("v", client=b).get()
        theirs = Lock("l", client=b)
        assert not theirs.acquire(timeout=0)
        threading.Timer(0.2, lock.release).start()
        assert theirs.acquire(timeout=10)
        assert Semaphore(2, "s", client=b).acquire(timeout=0)
        assert not Semaphore(2, "s", client=b).acquire(timeout=0)
        waiter = threading.Thread(target=Event("e").wait, args=(20,))
        waiter.start()
        Event("e", client=b).set()
        waiter.join(10)
        assert not waiter.is_alive()
        a.close()  # its wants go, after the holders' (all in the clients stream)
        cluster.start_scheduler()
        assert got_x.result(timeout=30) == 2 and got_y.result(timeout=30) == 3
        go.touch()
        poll(lambda: out.exists(), timeout=30)
        theirs.release()
        Variable("v", client=b).delete()
        Event("e", client=b).clear()
        Semaphore(2, "s", client=b).close()
        del got_x, got_y
        poll(lambda: not coordination_keys(r, keys), timeout=30)


# --------------------------------------------------------------------------- the scripts


def test_what_the_scripts_send_the_scheduler_is_the_protocols(
    redis_url: str, cluster_name: str
) -> None:
    """The wants a script sends on a client's behalf parse as the client's own messages,
    and a get inside a task (no client) refuses futures before taking anything."""
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    scripts = CoordinationScripts(r, keys)
    scripts.queue_put(
        name="q", holder="holder:queue:q", waiter="w", wait_ms=0, data=b"\x00pickle",
        keys=["k1", "k2"], maxsize=0,
    )  # fmt: skip
    kinds = {row["kind"] for row in read_keys(r, keys)}  # (redisdask inspect keys)
    assert {"queue:*", "queue-refs:*"} <= kinds and "queue:q" not in kinds
    with pytest.raises(redis.ResponseError, match="NEEDS_CLIENT"):
        scripts.queue_get(name="q", holder="holder:queue:q", waiter="w", wait_ms=0, client="",
                          count=1)  # fmt: skip
    assert r.llen(keys.coordination("queue", "q")) == 1
    reply = scripts.queue_get(
        name="q", holder="holder:queue:q", waiter="w", wait_ms=0, client="client-1", count=1
    )
    assert msgpack.unpackb(reply[2], raw=True) == [b"0", [b"k1", b"k2"], b"\x00pickle"]
    messages = [
        parse(m, CLIENT_TO_SCHEDULER)
        for _, fields in r.xrange(keys.client_stream)
        for m in msgpack.unpackb(fields[b"m"], raw=False)
    ]
    assert [(m.op, m.client, m.keys) for m in messages] == [  # type: ignore[attr-defined]
        ("client-desires-keys", "holder:queue:q", ["k1", "k2"]),
        ("client-desires-keys", "client-1", ["k1", "k2"]),
        ("client-releases-keys", "holder:queue:q", ["k1", "k2"]),
    ]
    assert not coordination_keys(r, keys)
    for name in r.scan_iter(match=keys.prefix.replace("{", "[{]") + "*"):
        r.delete(name)


def test_a_primitive_in_a_process_with_no_client_says_to_create_one() -> None:
    """Neither a client nor a worker's task: the first use says what is missing."""
    code = "from redisdask import Lock\nLock('x').acquire()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "Lock('x').acquire(): no Client is running here" in done.stderr, done.stderr
