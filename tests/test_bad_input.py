"""Bad input gets a clear error and loses nothing; strangers cannot hurt a worker."""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time
from pathlib import Path

import pytest
import redis
from conftest import ClusterFactory
from polling import poll

from redisdask import Client, ClusterConnectionError, Future, LocalCluster, SchedulerRejectedError
from redisdask.comm import encode_message, parse_address
from redisdask.errors import ClusterRunningError
from redisdask.store.bootstrap import ensure_cluster
from redisdask.store.codecs import entry
from redisdask.store.keyspace import Keys

pytestmark = pytest.mark.timeout(60)


def inc(x: int) -> int:
    return x + 1


def make_lock() -> threading.Lock:
    return threading.Lock()


def test_unpicklable_function_fails_at_submit(redis_url: str, cluster_name: str) -> None:
    keys = Keys(cluster_name)
    ensure_cluster(redis.Redis.from_url(redis_url), keys)  # as a scheduler that stopped leaves it
    lock = threading.Lock()
    with Client(redis_url, cluster_name=cluster_name) as client:
        with pytest.raises(TypeError, match=r"could not pickle the function .*lock"):
            client.submit(lambda: lock.locked())
        with pytest.raises(TypeError, match=r"argument 1 \(lock"):
            client.submit(pow, 2, lock)
        with pytest.raises(TypeError, match=r"keyword argument 'x'"):
            client.submit(dict, x=lock)
        # nothing reached Redis (no scheduler runs here, so the stream would keep it)
        assert redis.Redis.from_url(redis_url).xlen(keys.client_stream) == 0


def test_unreachable_redis_is_a_clear_connection_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    url = f"redis://:hunter2@127.0.0.1:{port}/0"
    start = time.monotonic()
    with pytest.raises(ConnectionError) as info:
        Client(url, timeout=2)
    assert time.monotonic() - start < 10
    assert isinstance(info.value, ClusterConnectionError)
    assert f"127.0.0.1:{port}" in str(info.value)
    assert "hunter2" not in str(info.value)  # no secrets in messages


def test_invalid_redis_url_is_named() -> None:
    with pytest.raises(ClusterConnectionError, match="invalid Redis URL 'http://nowhere'"):
        Client("http://nowhere")


def test_unpicklable_result_errs_the_task_and_the_worker_keeps_going(client: Client) -> None:
    f = client.submit(make_lock)
    with pytest.raises(TypeError, match=r"result of task .* cannot be pickled"):
        f.result(timeout=10)
    assert client.submit(inc, 1).result(timeout=10) == 2


def test_stranger_on_a_worker_port_is_dropped_and_nothing_is_unpickled(
    client: Client, tmp_path: Path
) -> None:
    a, b = sorted(client.scheduler_info()["workers"])
    host, port = parse_address(a)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.system, (f"touch {marker}",))

    payload = b"".join(bytes(x) for x in encode_message({"op": "put-data"}, [pickle.dumps(Evil())]))
    # each attack is longer than the handshake answer, so it is judged (and refused) at once
    payload += b"\0" * 100
    for attack in (b"GET / HTTP/1.1\r\n\r\n" + b" " * 100, b"\xff" * 100_000, payload):
        with socket.create_connection((host, port), timeout=5) as s:
            s.recv(64)  # the server's hello
            try:
                s.sendall(attack)
                s.settimeout(5)
                assert s.recv(1024) == b""  # dropped, no answer
            except ConnectionResetError:
                pass
    assert not marker.exists()
    # the worker still serves peers: a dependency moves from a to b
    x = client.submit(inc, 1, workers=a)
    assert client.submit(inc, x, workers=b).result(timeout=10) == 3


def test_malformed_stream_entry_is_dead_lettered(client: Client, cluster) -> None:  # type: ignore[no-untyped-def]
    r = redis.Redis.from_url(cluster.redis_url)
    keys = Keys(cluster.cluster_name)
    r.xadd(keys.client_stream, {"m": b"\xc1 not msgpack"})
    r.xadd(keys.client_stream, {"junk": b"1"})
    r.xadd(keys.client_stream, entry([{"op": "update-graph", "client": 5, "tasks": "x"}]))
    r.xadd(keys.worker_stream, entry([{"op": "no-such-op"}]))
    assert client.submit(inc, 1).result(timeout=10) == 2  # the scheduler kept running
    deadline = time.monotonic() + 10
    while r.xlen(keys.dead_letter) < 4:
        assert time.monotonic() < deadline, r.xrange(keys.dead_letter)
        threading.Event().wait(0.01)
    errors = [fields[b"error"].decode() for _id, fields in r.xrange(keys.dead_letter)]
    assert any("not msgpack" in e for e in errors)
    assert any("no 'm' field" in e for e in errors)
    assert any("unknown op 'no-such-op'" in e for e in errors)
    assert cluster.scheduler_process.poll() is None


def test_a_refused_submission_errs_the_clients_futures_instead_of_hanging(
    client: Client,
    cluster,  # type: ignore[no-untyped-def]
) -> None:
    """A task key that is not a str (msgpack turned a tuple into a list) fails validation:
    the entry is dead-lettered, and the client's futures of its keys raise."""
    r = redis.Redis.from_url(cluster.redis_url)
    keys = Keys(cluster.cluster_name)
    y = Future("y-refused", client)
    bad = {"key": ["x", 0], "spec": None, "deps": []}
    good = {"key": "y-refused", "spec": None, "deps": []}
    message = {"op": "update-graph", "client": client.id, "tasks": [bad, good], "wanted": [y.key]}
    r.xadd(keys.client_stream, entry([message]))
    with pytest.raises(SchedulerRejectedError, match="refused the message") as info:
        y.result(timeout=10)
    assert "task without a str 'key'" in str(info.value)
    assert r.xlen(keys.dead_letter) == 1
    assert client.submit(inc, 1).result(timeout=10) == 2  # and the scheduler goes on


def test_a_graph_with_a_cycle_that_reaches_the_scheduler_errs_instead_of_hanging(
    client: Client,
    cluster,  # type: ignore[no-untyped-def]
) -> None:
    """The client refuses cycles; a message written by anything else must not leave the
    futures of a cycle, a self-dependency or their dependents waiting forever."""
    r = redis.Redis.from_url(cluster.redis_url)
    keys = Keys(cluster.cluster_name)
    graph = {"cyc-a": ["cyc-b"], "cyc-b": ["cyc-a"], "self-c": ["self-c"], "dep-d": ["cyc-a"]}
    futures = {key: Future(key, client) for key in graph}
    tasks = [{"key": key, "spec": b"never run", "deps": deps} for key, deps in graph.items()]
    message = {"op": "update-graph", "client": client.id, "tasks": tasks, "wanted": list(graph)}
    r.xadd(keys.client_stream, entry([message]))
    for key in ("cyc-a", "cyc-b", "dep-d"):
        with pytest.raises(SchedulerRejectedError, match="the graph has a cycle") as info:
            futures[key].result(timeout=10)
        assert "'cyc-a' -> 'cyc-b' -> 'cyc-a'" in str(info.value)
    with pytest.raises(SchedulerRejectedError, match="task 'self-c' depends on itself"):
        futures["self-c"].result(timeout=10)
    assert r.hget(keys.task("cyc-a"), "rejected") == b"1"
    assert client.submit(inc, 1).result(timeout=10) == 2  # and the scheduler goes on


def test_huge_malformed_entries_are_dead_lettered_within_bounds(
    client: Client,
    cluster,  # type: ignore[no-untyped-def]
) -> None:
    r = redis.Redis.from_url(cluster.redis_url)
    keys = Keys(cluster.cluster_name)
    r.xadd(keys.worker_stream, {f"f{i}": b"x" for i in range(5_000)})  # no 'm', many fields
    r.xadd(keys.client_stream, {"m": b"\xc1" * 10_000_000})  # 10 MB of garbage
    assert client.submit(inc, 1).result(timeout=20) == 2
    deadline = time.monotonic() + 10
    while r.xlen(keys.dead_letter) < 2:
        assert time.monotonic() < deadline
        threading.Event().wait(0.01)
    for _id, fields in r.xrange(keys.dead_letter):
        assert len(fields[b"sample"]) < 100_000
    assert int(r.xrange(keys.dead_letter)[0][1][b"nfields"]) == 5_000
    assert cluster.scheduler_process.poll() is None


def test_wrong_credentials_are_named_without_the_password() -> None:
    from redisdask.deploy.embedded import EmbeddedRedis

    with EmbeddedRedis() as server:
        server.client().config_set("requirepass", "s3cret")
        url = f"redis://:wrong-pw@127.0.0.1:{server.port}/0"
        with pytest.raises(ClusterConnectionError, match="refused our credentials") as info:
            Client(url)
        assert "wrong-pw" not in str(info.value)
        with pytest.raises(ClusterConnectionError, match="refused"):
            Client(f"redis://:s3cret@127.0.0.1:{server.port}/99")  # no such database


def test_malformed_inbox_messages_leave_the_worker_working(
    client: Client,
    cluster,  # type: ignore[no-untyped-def]
) -> None:
    r = redis.Redis.from_url(cluster.redis_url)
    keys = Keys(cluster.cluster_name)
    workers = sorted(client.nthreads())
    for w in workers:
        r.xadd(keys.worker_inbox(w), entry([{"op": "free-keys"}]))  # no keys
        r.xadd(keys.worker_inbox(w), entry([{"op": "keys-recorded", "keys": [3]}]))
        r.xadd(keys.worker_inbox(w), entry([{"op": "who-has", "who_has": "x"}, 7]))
        r.xadd(keys.worker_inbox(w), {"m": b"\xc1"})
    for w in workers:  # each still claims and runs its own work
        assert client.submit(inc, 5, workers=w, pure=False).result(timeout=10) == 6


def test_a_worker_that_cannot_claim_leaves_instead_of_lingering(
    client: Client,
    cluster,  # type: ignore[no-untyped-def]
) -> None:
    r = redis.Redis.from_url(cluster.redis_url)
    keys = Keys(cluster.cluster_name)
    info = client.scheduler_info()["workers"]
    victim = next(a for a, w in info.items() if w["name"] == "worker-0")
    r.hdel(keys.workers, victim)  # its claims are now refused (UNKNOWN_WORKER)
    assert client.gather(client.map(inc, range(50))) == list(range(1, 51))
    proc = cluster.worker_processes[0]
    assert proc.wait(timeout=20) == 1  # it left, with an error status


def test_the_redis_password_is_not_on_any_command_line(cluster_name: str) -> None:
    import psutil

    from redisdask.deploy.embedded import EmbeddedRedis

    with EmbeddedRedis() as server:
        server.client().config_set("requirepass", "pw-4-test")
        url = f"redis://:pw-4-test@127.0.0.1:{server.port}/0"
        with LocalCluster(
            nanny=False, n_workers=1, redis_url=url, cluster_name=cluster_name
        ) as cluster:
            with Client(cluster) as client:
                assert client.submit(inc, 1).result(timeout=15) == 2
            for proc in cluster.subprocesses:
                assert "pw-4-test" not in " ".join(psutil.Process(proc.pid).cmdline())


def test_malformed_scheduler_messages_are_skipped_by_the_client(
    redis_url: str, cluster_name: str
) -> None:
    """A message on a client's events stream that does not parse is logged and skipped;
    the messages after it in the same entry still count."""
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)  # as a scheduler that stopped leaves it
    with Client(redis_url, cluster_name=cluster_name) as client:
        future = client.submit(inc, 1)  # no scheduler here: it stays pending
        bad = [
            {"op": "key-in-memory", "key": future.key},  # no who_has
            {"op": "task-erred", "key": future.key, "exception": "not bytes"},
            {"op": "no-such-op"},
            7,
        ]
        r.xadd(keys.client_events(client.id), entry([*bad, {"op": "restarted", "by": "x"}]))
        poll(future.cancelled)
        assert future.status == "cancelled"


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis+sentinel://h1:26379/", "expected a service name"),
        ("redis+sentinel://h1:26379/svc/zero", "expected a service name and an optional db"),
        ("redis+sentinel://h1:port/svc", "bad Sentinel address 'h1:port'"),
        ("redis+sentinel://:hunter2@h1/svc?db=1", "takes no query"),
    ],
)
def test_a_bad_sentinel_url_is_named_with_the_form_expected(url: str, why: str) -> None:
    with pytest.raises(ClusterConnectionError) as info:
        Client(url)
    assert why in str(info.value)
    assert "redis+sentinel://[user:password@]host:26379" in str(info.value)
    assert "hunter2" not in str(info.value)


def test_sentinels_that_cannot_be_reached_are_a_clear_connection_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    url = f"redis+sentinel://:hunter2@127.0.0.1:{port}/mymaster/0"
    with pytest.raises(ClusterConnectionError) as info:
        Client(url, timeout=1)
    assert f"127.0.0.1:{port}/mymaster" in str(info.value)
    assert "Sentinels running there" in str(info.value)
    assert "hunter2" not in str(info.value)


def test_a_local_cluster_under_a_running_clusters_name_is_refused(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    """``Client(redis_url=...)`` with no address starts a LocalCluster: under the name of
    a cluster that runs there, it would add a second scheduler and more workers to it.
    It is refused, and the message says how to connect instead."""
    with make_cluster(n_workers=1, nanny=False):
        with pytest.raises(ClusterRunningError, match=r"connect with Client\('redis://"):
            Client(redis_url=redis_url, cluster_name=cluster_name)
        r = redis.Redis.from_url(redis_url)
        assert r.hlen(Keys(cluster_name).workers) == 1  # nothing joined it
