"""Failures, for real: kill -9 workers, a task that kills its worker, a hung worker,
lost results, lost scattered data, a paused scheduler fenced out by a standby."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import redis
from conftest import ClusterFactory
from polling import poll

from redisdask import Client, KilledWorker, LocalCluster
from redisdask.errors import DataUnavailableError
from redisdask.observe.inspect import read_events
from redisdask.store.codecs import entry, unpack
from redisdask.store.keyspace import Keys
from redisdask.store.scripts import WRITE_ENTRIES

pytestmark = pytest.mark.timeout(90)


def inc(x: int) -> int:
    return x + 1


def add(a: int, b: int) -> int:
    return a + b


def slow_inc(x: int, delay: float = 0.02) -> int:
    threading.Event().wait(delay)  # stands for real work
    return x + 1


def where() -> str:
    from redisdask.workers import get_worker

    return get_worker().address


def wait_for_gate(redis_url: str, gate: str) -> str:
    """Holds a worker thread until the test pushes to ``gate`` (BLPOP, not a sleep)."""
    assert redis.Redis.from_url(redis_url).blpop([gate], timeout=60) is not None
    return "opened"


def suicide() -> None:
    os._exit(1)


def address_of(client: Client, pid: int) -> str:
    """The address of the worker process ``pid``."""
    return next(a for a, w in client.scheduler_info()["workers"].items() if w["pid"] == pid)


def deaths(r: redis.Redis, keys: Keys) -> list[dict]:
    return [unpack(f[b"m"]) for _id, f in r.xrange(keys.deaths)]


def test_a_killed_worker_is_noticed_at_once_and_its_work_is_redone(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    with (
        make_cluster(nanny=False, n_workers=2) as cluster,
        Client(cluster) as client,
    ):
        r = redis.Redis.from_url(redis_url)
        keys = Keys(cluster_name)
        futures = client.map(slow_inc, range(200))
        poll(lambda: sum(f.done() for f in futures) >= 20)
        victim = cluster.worker_processes[0]
        address = address_of(client, victim.pid)
        killed_at = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        poll(lambda: not r.hexists(keys.workers, address))
        noticed = time.monotonic() - killed_at
        assert client.gather(futures) == list(range(1, 201))
        [record] = deaths(r, keys)
        assert record["worker"] == address and record["how"] == "connection"
        assert record["name"] == "worker-0" and record["pid"] == victim.pid
        print(f"kill -9 noticed after {noticed * 1000:.0f} ms")
        assert noticed < 2.0  # CLIENT LIST: a fraction of a second, not the 3 s TTL


def test_a_task_that_kills_its_workers_errs_with_killed_worker(
    make_cluster: ClusterFactory,
) -> None:
    with (
        make_cluster(
            nanny=False,
            n_workers=3,
            scheduler_options={"allowed_failures": 1},
        ) as cluster,
        Client(cluster) as client,
    ):
        bad = client.submit(suicide)
        with pytest.raises(KilledWorker) as info:
            bad.result(timeout=30)
        exc = info.value
        assert exc.task == bad.key
        assert len(exc.deaths) == 2  # allowed-failures + 1
        for death in exc.deaths:
            assert death["how"] == "connection" and death["host"]
            assert bad.key in death["processing"]
        assert "was running on 2 workers that died" in str(exc)
        assert "worker-" in str(exc)  # the workers are named
        assert client.submit(inc, 1).result(timeout=10) == 2  # the rest keeps working
        assert len(client.scheduler_info()["workers"]) == 1
        dependent = client.submit(inc, bad)
        with pytest.raises(KilledWorker):
            dependent.result(timeout=10)
        for proc in cluster.worker_processes:  # reap the two that died
            if proc.poll() is None:
                continue
            assert proc.returncode == 1


def test_a_hung_worker_is_removed_when_its_heartbeat_expires(
    redis_url: str, cluster_name: str, monkeypatch: pytest.MonkeyPatch, make_cluster: ClusterFactory
) -> None:
    monkeypatch.setenv("REDISDASK__SCHEDULER__WORKER_TTL", "1")
    with (
        make_cluster(nanny=False, n_workers=2) as cluster,
        Client(cluster) as client,
    ):
        r = redis.Redis.from_url(redis_url)
        keys = Keys(cluster_name)
        hung = cluster.worker_processes[0]
        address = address_of(client, hung.pid)
        hung.send_signal(signal.SIGSTOP)  # alive, connections open, silent
        try:
            futures = client.map(slow_inc, range(50))
            assert client.gather(futures) == list(range(1, 51))
            poll(lambda: not r.hexists(keys.workers, address))
            [record] = deaths(r, keys)
            assert record["how"] == "heartbeat" and "last heartbeat" in record["reason"]
        finally:
            hung.send_signal(signal.SIGCONT)
        assert hung.wait(timeout=20) == 1  # it wakes up unknown to the cluster and leaves


async def stall_the_loop(seconds: float) -> int:
    """Run on the worker's event loop (``client.run`` of an ``async def``): holds it as a
    sort of 30,000 keys or a full collection of a large heap did."""
    time.sleep(seconds)
    return os.getpid()


def test_a_worker_whose_event_loop_stalls_past_the_ttl_is_not_declared_dead(
    redis_url: str,
    cluster_name: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    make_cluster: ClusterFactory,
) -> None:
    """A stall of the loop longer than scheduler.worker-ttl had a live worker declared
    dead, and what it held recomputed (on a loaded 2-core machine, while it fetched 30,000
    results); the worker's LoopWatch thread keeps its heartbeat through the stall."""
    monkeypatch.setenv("REDISDASK__SCHEDULER__WORKER_TTL", "1")
    monkeypatch.setenv("REDISDASK__WORKER__HEARTBEAT_INTERVAL", "0.25")
    monkeypatch.setenv("REDISDASK__WORKER__INLINE_RESULT_BYTES", "0")  # held there only
    with (
        make_cluster(nanny=False, n_workers=1, log_directory=tmp_path) as cluster,
        Client(cluster) as client,
    ):
        r = redis.Redis.from_url(redis_url)
        keys = Keys(cluster_name)
        [address] = client.scheduler_info()["workers"]
        x = client.submit(inc, 1)
        assert x.result(timeout=20) == 2
        assert client.run(stall_the_loop, 4) == {address: cluster.worker_processes[0].pid}
        assert client.submit(inc, x).result(timeout=20) == 3
        assert r.hexists(keys.workers, address) and deaths(r, keys) == []
        assert client.who_has(x)[x.key] == [address]  # not recomputed: never lost
        log = (tmp_path / "worker-0.log").read_text()
        assert "has not run for" in log and "stall_the_loop" in log  # where it stood


def test_a_worker_whose_event_loop_hangs_past_the_hang_timeout_is_declared_dead(
    redis_url: str,
    cluster_name: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    make_cluster: ClusterFactory,
) -> None:
    monkeypatch.setenv("REDISDASK__SCHEDULER__WORKER_TTL", "1")
    monkeypatch.setenv("REDISDASK__WORKER__HANG_TIMEOUT", "2")
    with (
        make_cluster(nanny=False, n_workers=2, log_directory=tmp_path) as cluster,
        Client(cluster) as client,
    ):
        r = redis.Redis.from_url(redis_url)
        keys = Keys(cluster_name)
        hung = cluster.worker_processes[0]
        address = address_of(client, hung.pid)
        client.run(stall_the_loop, 8, workers=[address], wait=False)
        poll(lambda: not r.hexists(keys.workers, address), timeout=20)
        [record] = deaths(r, keys)
        assert record["how"] == "heartbeat"
        assert hung.wait(timeout=30) == 1  # it wakes up unknown to the cluster and leaves
        assert "no longer keeping its heartbeat" in (tmp_path / "worker-0.log").read_text()
        assert client.submit(inc, 1).result(timeout=20) == 2


def test_a_worker_removed_while_stopped_leaves_when_it_wakes_and_does_not_come_back(
    redis_url: str,
    cluster_name: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    make_cluster: ClusterFactory,
) -> None:
    """distributed's worker closes when the scheduler removed it (its nanny starts a fresh
    one).  Ours came back instead: stopped past its Redis reads' timeout (5 s), it woke
    on SIGCONT to a timed-out read, reconnected, and registered again with its stale
    state; stopped less long and idle, it lingered unknown until work was queued."""
    monkeypatch.setenv("REDISDASK__SCHEDULER__WORKER_TTL", "1")
    with (
        make_cluster(nanny=False, n_workers=2, log_directory=tmp_path) as cluster,
        Client(cluster) as client,
    ):  # fmt: skip
        r = redis.Redis.from_url(redis_url)
        keys = Keys(cluster_name)
        stopped = cluster.worker_processes[0]
        address = address_of(client, stopped.pid)
        x = client.submit(inc, 1, workers=[address])
        assert x.result(timeout=20) == 2
        stopped.send_signal(signal.SIGSTOP)
        try:
            poll(lambda: not r.hexists(keys.workers, address), timeout=20)
            time.sleep(6)  # (the fault: stopped past its reads' timeout)
        finally:
            stopped.send_signal(signal.SIGCONT)
        assert stopped.wait(timeout=20) == 1  # idle, nothing queued: it leaves all the same
        assert not r.hexists(keys.workers, address)
        assert "removed from the cluster" in (tmp_path / "worker-0.log").read_text()
        assert x.result(timeout=20) == 2 and client.submit(inc, 2).result(timeout=20) == 3
        assert len(client.scheduler_info()["workers"]) == 1


def test_a_result_lost_with_its_worker_is_recomputed(
    monkeypatch: pytest.MonkeyPatch, make_cluster: ClusterFactory
) -> None:
    # (a small result is kept in Redis too, and never lost: tests/test_inline_results.py)
    monkeypatch.setenv("REDISDASK__WORKER__INLINE_RESULT_BYTES", "0")
    with (
        make_cluster(nanny=False, n_workers=2) as cluster,
        Client(cluster) as client,
    ):
        a, b = sorted(client.scheduler_info()["workers"])
        x = client.submit(inc, 41, workers=[a, b])
        x.result(timeout=10)
        holder = client.who_has(x)[x.key][0]
        pid = client.scheduler_info()["workers"][holder]["pid"]
        os.kill(pid, signal.SIGKILL)
        y = client.submit(add, x, 1)
        assert y.result(timeout=20) == 43
        assert x.result(timeout=20) == 42
        assert client.who_has(x)[x.key] == [next(w for w in (a, b) if w != holder)]


def test_scattered_data_lost_with_its_only_worker_fails_dependents_clearly(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    with (
        make_cluster(nanny=False, n_workers=2) as cluster,
        Client(cluster) as client,
    ):
        a, _ = sorted(client.scheduler_info()["workers"])
        [x] = client.scatter([10], workers=[a])
        assert client.submit(inc, x).result(timeout=10) == 11
        os.kill(client.scheduler_info()["workers"][a]["pid"], signal.SIGKILL)
        r = redis.Redis.from_url(redis_url)
        poll(lambda: not r.hexists(Keys(cluster_name).workers, a))
        y = client.submit(add, x, 1)
        with pytest.raises(DataUnavailableError) as info:
            y.result(timeout=20)
        message = str(info.value)
        assert "scattered" in message and a in message and "replicate" in message
        assert client.submit(inc, 1).result(timeout=10) == 2


def test_a_paused_scheduler_is_fenced_out_by_the_standby_that_took_over(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    with (
        make_cluster(
            nanny=False,
            n_workers=2,
            scheduler_options={"lease_ttl": 1},
        ) as cluster,
        Client(cluster) as client,
    ):
        r = redis.Redis.from_url(redis_url)
        keys = Keys(cluster_name)
        old = cluster.scheduler_process
        standby = cluster.start_scheduler(standby=True)
        assert client.submit(inc, 1).result(timeout=10) == 2
        token = r.get(keys.lease)
        old_id = r.hget(keys.scheduler, "id").decode()
        old.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        try:
            poll(lambda: r.get(keys.lease) not in (None, token))  # the standby leads
            futures = client.map(slow_inc, range(100))  # work the old one never saw
            assert client.gather(futures) == list(range(1, 101))
        finally:
            old.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        # awake, it tries to write with its stale token, is refused, and leaves
        assert old.wait(timeout=20) == 1  # type: ignore[union-attr]
        assert standby.poll() is None
        assert client.gather(client.map(inc, range(10))) == list(range(1, 11))
        assert r.xlen(keys.dead_letter) == 0
        # the event log tells of the failover
        starts = [e for e in read_events(r, keys) if e["kind"] == "scheduler-start"]
        assert [e["previous"] for e in starts] == [None, old_id]


def test_versions_are_recorded_and_checked(client: Client, cluster) -> None:  # type: ignore[no-untyped-def]
    from redisdask.store.codecs import pack
    from redisdask.versions import VersionMismatchError

    found = client.get_versions(check=True)  # one machine, one venv: all agree
    assert found["client"]["packages"]["python"] == found["scheduler"]["packages"]["python"]
    assert len(found["workers"]) == 2
    r = redis.Redis.from_url(cluster.redis_url)
    keys = Keys(cluster.cluster_name)
    # (the workers are asked, as in distributed; the scheduler's versions are its record)
    recorded = unpack(r.hget(keys.scheduler, "versions"))
    r.hset(keys.scheduler, "versions", pack({**recorded, "cloudpickle": "0.0.1"}))
    with pytest.raises(VersionMismatchError, match="cloudpickle"):
        client.get_versions(check=True)


def test_a_worker_that_cannot_read_the_clusters_pickles_refuses_to_join(
    redis_url: str, cluster_name: str
) -> None:
    import subprocess
    import sys

    from redisdask.store.bootstrap import ensure_cluster
    from redisdask.store.codecs import pack

    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    r.hset(keys.meta, "versions", pack({"python": "2.7.18", "cloudpickle": "0.5.0"}))
    result = subprocess.run(
        [sys.executable, "-m", "redisdask", "worker", redis_url, "--cluster", cluster_name],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert "cannot join" in result.stderr
    assert "python" in result.stderr and "2.7.18" in result.stderr
    assert "0.5.0 in the cluster" in result.stderr
    assert not r.hlen(keys.workers)


def div_here(a: float, b: float) -> float:
    if b == 0:
        raise ZeroDivisionError(f"division by zero in process {os.getpid()}")
    return a / b


def test_recreate_error_locally_runs_the_failing_task_here(client: Client) -> None:
    x = client.submit(inc, 1)
    y = client.submit(div_here, x, 0)  # the task that raises, on a worker
    z = client.submit(inc, y)  # inherits the error
    with pytest.raises(ZeroDivisionError):
        z.result(timeout=10)
    with pytest.raises(ZeroDivisionError) as remote:
        y.result()
    assert f"process {os.getpid()}" not in str(remote.value)
    del x  # its value is released: it is recomputed from the graph history
    with pytest.raises(ZeroDivisionError) as info:
        client.recreate_error_locally(z)
    assert f"process {os.getpid()}" in str(info.value)  # here, where a debugger can stop
    assert info.traceback[-1].name == "div_here"
    with pytest.raises(ValueError, match="did not err"):
        client.recreate_error_locally(client.submit(inc, 5))


def test_a_restarted_redis_under_a_running_computation(tmp_path, cluster_name: str) -> None:  # type: ignore[no-untyped-def]
    from redisdask.deploy.embedded import EmbeddedRedis

    with (
        EmbeddedRedis(data_dir=tmp_path) as server,
        LocalCluster(
            nanny=False, n_workers=2, redis_url=server.url, cluster_name=cluster_name
        ) as cluster,
        Client(cluster) as client,
    ):
        futures = client.map(slow_inc, range(300))
        total = client.submit(sum, futures)
        poll(lambda: sum(f.done() for f in futures) >= 30)
        server.restart()  # AOF on: the cluster's records survive, connections do not
        assert client.gather(futures) == list(range(1, 301))
        assert total.result(timeout=60) == sum(range(1, 301))
        assert client.submit(inc, 1).result(timeout=20) == 2
        assert all(p.poll() is None for p in cluster.subprocesses)  # nobody gave up
        events = read_events(cluster.redis, cluster.keys)
        backs = [e for e in events if e["kind"] == "redis-reconnected"]
        assert backs and all(b["process"].startswith("scheduler-") for b in backs)
        assert all(b["away"] > 0 for b in backs)


def test_a_claim_whose_reply_never_reached_its_worker_is_queued_again(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    """As when Redis dies after running a claim script and before answering it: Redis
    and the scheduler say the task is processing on a live worker that knows nothing of
    it.  Written here by hand, as the script would, without the worker hearing of it."""
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    gate = f"gate-{cluster_name}"
    with (
        make_cluster(nanny=False, n_workers=1) as cluster,
        Client(cluster) as client,
    ):
        [worker] = client.scheduler_info()["workers"]
        blocker = client.submit(wait_for_gate, redis_url, gate, pure=False)
        poll(lambda: r.scard(keys.worker_processing(worker)) == 1)  # its one thread is busy
        x = client.submit(inc, 41)
        poll(lambda: r.zscore(keys.ready, x.key) is not None)
        score = r.zscore(keys.ready, x.key)
        claim = {"op": "claimed", "worker": worker, "keys": [x.key], "scores": [score]}
        pipe = r.pipeline(transaction=True)  # what CLAIM writes, in one step
        pipe.zrem(keys.ready, x.key)
        pipe.hset(keys.task(x.key), mapping={"state": "processing", "worker": worker})
        pipe.sadd(keys.worker_processing(worker), x.key)
        pipe.xadd(keys.worker_stream, entry([claim]))
        assert pipe.execute()[0] == 1
        r.lpush(gate, 1)
        assert blocker.result(timeout=20) == "opened"
        assert x.result(timeout=20) == 42
        lost = [e for e in read_events(cluster.redis, cluster.keys) if e["kind"] == "lost-claim"]
        assert [(e["key"], e["worker"]) for e in lost] == [(x.key, worker)]


def test_busy_workers_lose_no_claims(client: Client, cluster) -> None:  # type: ignore[no-untyped-def]
    """Claims, results and holding reports racing for seconds on busy workers: no task
    is ever taken for a lost claim (each would be run twice)."""
    slow = client.map(slow_inc, range(40), delay=0.05)  # claimed two by two, held a while
    tiny = client.map(inc, range(8_000))  # claimed by the hundred
    assert client.gather(slow) == list(range(1, 41))
    assert client.gather(tiny) == list(range(1, 8_001))
    kinds = {e["kind"] for e in read_events(cluster.redis, cluster.keys)}
    assert "lost-claim" not in kinds


def test_redis_killed_again_and_again_under_a_running_computation(
    tmp_path,  # type: ignore[no-untyped-def]
    cluster_name: str,
) -> None:
    """kill -9 of Redis (AOF everysec: it may come back without its last writes) three
    times while tasks are claimed, run and reported: every task still finishes."""
    from redisdask.deploy.embedded import EmbeddedRedis

    with (
        EmbeddedRedis(data_dir=tmp_path) as server,
        LocalCluster(
            nanny=False, n_workers=2, redis_url=server.url, cluster_name=cluster_name
        ) as cluster,
        Client(cluster) as client,
    ):
        futures = client.map(slow_inc, range(400), delay=0.01)
        total = client.submit(sum, futures)
        for done in (50, 150, 250):
            poll(lambda n=done: sum(f.done() for f in futures) >= n, timeout=60)
            server.kill()
            server.start()  # same port, same AOF
        assert client.gather(futures) == list(range(1, 401))
        assert total.result(timeout=60) == sum(range(1, 401))


def test_each_write_of_a_client_is_numbered_and_never_landed_twice(redis_url: str) -> None:
    """WRITE_ENTRIES, the clients' only way into the clients stream: it writes only at
    the count the client expects; a call made again after its reply was lost (its token)
    is found written, not written twice; a stale or an ahead count writes nothing and
    says what Redis holds."""
    r = redis.Redis.from_url(redis_url)
    keys = Keys(f"numbered-{os.getpid()}")
    write = r.register_script(WRITE_ENTRIES)
    ks = [keys.client_stream, keys.client_written("c")]
    assert write(keys=ks, args=[0, "t1", b"a", b"b"]) == [2, 1]
    assert write(keys=ks, args=[0, "t1", b"a", b"b"]) == [2, 1]  # the same call again
    assert r.xlen(keys.client_stream) == 2
    assert write(keys=ks, args=[0, "t2", b"c"]) == [2, 0]  # Redis holds more: a given-up write
    assert write(keys=ks, args=[5, "t3", b"c"]) == [2, 0]  # Redis holds fewer: lost writes
    assert write(keys=ks, args=[2, "t4"]) == [2, 0]  # a look writes nothing
    assert write(keys=ks, args=[2, "t5", b"c"]) == [3, 1]
    assert [f[b"m"] for _, f in r.xrange(keys.client_stream)] == [b"a", b"b", b"c"]
    r.delete(*ks)


@pytest.mark.parametrize("then", ["waits", "writes"])
def test_a_graph_redis_acknowledged_then_lost_is_sent_again(
    tmp_path,  # type: ignore[no-untyped-def]
    cluster_name: str,
    then: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Redis acknowledged a graph, then lost it: it came back from a snapshot taken just
    before (as a replica promoted before the graph reached it, or an AOF without its last
    second).  The client finds Redis holds fewer of its entries than it wrote (at its
    next heartbeat, or at its next write) and sends the graph again: its future gets the
    right result instead of waiting forever."""
    from tasklib import wait_for_file

    from redisdask.deploy.embedded import EmbeddedRedis

    gate = tmp_path / "gate"
    if then == "writes":  # no heartbeat comes first: the write finds the loss
        monkeypatch.setenv("REDISDASK__CLIENT__HEARTBEAT_INTERVAL", "60")
        monkeypatch.setenv("REDISDASK__SCHEDULER__CLIENT_TTL", "120")
    server = EmbeddedRedis(data_dir=tmp_path / "redis").start()
    try:
        with (
            LocalCluster(
                nanny=False, n_workers=1, redis_url=server.url, cluster_name=cluster_name
            ) as cluster,
            Client(cluster) as client,
        ):
            x = client.submit(wait_for_file, str(gate), key="x")
            poll(lambda: cluster.redis.hget(cluster.keys.task("x"), "state") == b"processing")
            assert cluster.redis.save()  # the snapshot the server comes back from
            y = client.submit(os.path.basename, x, key="y")
            poll(lambda: cluster.redis.exists(cluster.keys.task("y")))  # acknowledged, read
            server.kill()
            server = EmbeddedRedis(
                data_dir=server.data_dir, port=server.port, args=["--appendonly", "no"]
            ).start()
            if then == "waits":  # the client's next heartbeat finds y lost
                gate.touch()
                assert y.result(timeout=30) == "gate"
                return
            assert not server.client().exists(cluster.keys.task("y"))  # lost, truly
            with Client(cluster) as other:
                # another client writes to the new server first, and this one writes a
                # graph that needs y before any heartbeat: it finds y lost and sends it
                # again before z (which would otherwise err: a dependency nobody sent)
                elsewhere = other.submit(abs, -3)
                z = client.submit(len, y, key="z")
                gate.touch()
                assert y.result(timeout=30) == "gate"
                assert z.result(timeout=30) == 4
                assert x.result() == str(gate)
                assert elsewhere.result(timeout=30) == 3
    finally:
        server.stop()


def test_a_client_waits_for_redis_then_says_so_and_keeps_its_futures(
    tmp_path,
    cluster_name: str,  # type: ignore[no-untyped-def]
) -> None:
    from redisdask import ClusterConnectionError
    from redisdask.deploy.embedded import EmbeddedRedis

    with (
        EmbeddedRedis(data_dir=tmp_path) as server,
        LocalCluster(
            nanny=False, n_workers=1, redis_url=server.url, cluster_name=cluster_name
        ) as cluster,
        Client(cluster, **{"redis.down-deadline": 1.0}) as client,
    ):
        x = client.submit(inc, 1)
        assert x.result(timeout=10) == 2
        gate = client.submit(slow_inc, 10, 1.5)  # still running when Redis goes
        record = Keys(cluster_name).task(gate.key)
        poll(lambda: cluster.redis.hget(record, "state") == b"processing")
        server.kill()  # kill -9: no goodbye
        started = time.monotonic()
        with pytest.raises(ClusterConnectionError, match="unreachable for more than 1 s"):
            gate.result()
        assert time.monotonic() - started < 10
        with pytest.raises(ClusterConnectionError):  # never sent, or Redis away too long
            client.submit(inc, 2).result()
        server.start()  # same port, same AOF
        assert gate.result(timeout=30) == 11  # the same future, kept
        assert client.submit(inc, 2).result(timeout=30) == 3


def test_a_vanished_clients_keys_are_released_after_its_ttl(
    redis_url: str, cluster_name: str, monkeypatch: pytest.MonkeyPatch, make_cluster: ClusterFactory
) -> None:
    import subprocess
    import sys

    monkeypatch.setenv("REDISDASK__SCHEDULER__CLIENT_TTL", "1")
    monkeypatch.setenv("REDISDASK__CLIENT__HEARTBEAT_INTERVAL", "0.2")
    with (
        make_cluster(nanny=False, n_workers=1) as cluster,
        Client(cluster) as alive,
    ):
        kept = alive.submit(pow, 3, 100)
        assert kept.result(timeout=20) == 3**100
        script = (
            "import sys, time\n"
            "from redisdask import Client\n"
            f"c = Client({redis_url!r}, cluster_name={cluster_name!r})\n"
            "f = c.submit(pow, 2, 100)\n"
            "assert f.result(timeout=20) == 2 ** 100\n"
            "print(f.key, flush=True)\n"
            "import threading\n"
            "threading.Event().wait(60)\n"  # it hangs on to its future until killed
        )
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        key = proc.stdout.readline().strip()  # type: ignore[union-attr]
        r = redis.Redis.from_url(redis_url)
        keys = Keys(cluster_name)
        # (a pushed task's small result may reach its client before the scheduler records it)
        poll(lambda: r.hget(keys.task(key), "state") == b"memory")
        proc.send_signal(signal.SIGKILL)  # no goodbye
        proc.wait()
        poll(lambda: not r.exists(keys.task(key)))  # released and forgotten
        assert r.hget(keys.task(kept.key), "state") == b"memory"  # a live client keeps its
        assert kept.result(timeout=10) == 3**100


def test_replicated_scattered_data_survives_the_loss_of_a_holder(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    with (
        make_cluster(nanny=False, n_workers=3) as cluster,
        Client(cluster) as client,
    ):
        workers = client.scheduler_info()["workers"]
        [x] = client.scatter([123], workers=[sorted(workers)[0]])
        client.replicate([x], n=2)
        holders = client.who_has(x)[x.key]
        assert len(holders) == 2
        os.kill(workers[holders[0]]["pid"], signal.SIGKILL)
        r = redis.Redis.from_url(redis_url)
        poll(lambda: not r.hexists(Keys(cluster_name).workers, holders[0]))
        assert client.submit(inc, x).result(timeout=20) == 124  # no loss, no error
        poll(lambda: len(client.who_has(x)[x.key]) == 2)  # back to two copies
        assert holders[0] not in client.who_has(x)[x.key]


def test_client_restart_cancels_everything_and_the_cluster_works_right_after(
    client: Client,
    cluster,  # type: ignore[no-untyped-def]
) -> None:
    with Client(cluster) as other:
        theirs = other.submit(inc, 5)
        assert theirs.result(timeout=10) == 6
        running = client.map(slow_inc, range(40), delay=0.05)
        done = client.submit(inc, 1)
        assert done.result(timeout=10) == 2
        client.restart()
        assert all(f.cancelled() for f in [*running, done])
        poll(lambda: theirs.cancelled())  # every client's futures
        r = redis.Redis.from_url(cluster.redis_url)
        keys = Keys(cluster.cluster_name)
        assert r.scard(keys.tasks) == 0 and r.zcard(keys.ready) == 0
        assert client.submit(inc, 10).result(timeout=10) == 11
        assert other.submit(inc, 20).result(timeout=10) == 21


def counted_inc(x: int, url: str, counter: str) -> int:
    redis.Redis.from_url(url).incr(counter)  # how many times tasks really ran
    return x + 1


def test_retire_workers_moves_their_data_so_nothing_is_lost_or_recomputed(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    with (
        make_cluster(nanny=False, n_workers=3) as cluster,
        Client(cluster) as client,
    ):
        r = redis.Redis.from_url(redis_url)
        keys = Keys(cluster_name)
        counter = f"{cluster_name}-runs"
        futures = client.map(counted_inc, range(60), url=redis_url, counter=counter)
        assert client.gather(futures) == list(range(1, 61))
        workers = client.scheduler_info()["workers"]
        victim = max(workers, key=lambda a: sum(a in h for h in client.who_has(futures).values()))
        scattered = client.scatter(list(range(100, 110)), workers=[victim])
        on_victim = [f for f, h in client.who_has(futures).items() if h == [victim]]
        assert on_victim  # the retiree holds the only copy of some results
        victim_pid = workers[victim]["pid"]
        retired = client.retire_workers([workers[victim]["name"]])  # by name
        assert list(retired) == [victim]
        assert victim not in client.scheduler_info()["workers"]
        process = next(p for p in cluster.worker_processes if p.pid == victim_pid)
        assert process.wait(10) == 0  # it left on its own, cleanly
        assert client.gather(futures) == list(range(1, 61))
        assert client.gather(scattered) == list(range(100, 110))  # scattered data survived
        assert int(r.get(counter)) == 60  # nothing recomputed
        assert deaths(r, keys) == []  # a retirement is no death
        assert all(victim not in h for h in client.who_has(futures + scattered).values())
        assert client.submit(inc, 1).result() == 2  # the others keep working


def test_retiring_the_last_worker_holding_data_is_refused(make_cluster: ClusterFactory):
    with (
        make_cluster(nanny=False, n_workers=1) as cluster,
        Client(cluster) as client,
    ):
        future = client.submit(inc, 1)
        assert future.result() == 2
        [address] = client.scheduler_info()["workers"]
        assert client.retire_workers([address]) == {}
        assert list(client.scheduler_info()["workers"]) == [address]
        assert client.submit(inc, future).result() == 3  # it still holds and claims
        with pytest.raises(ValueError, match="no worker with address or name"):
            client.retire_workers(["nobody"])
        assert cluster.worker_processes[0].poll() is None


def test_a_retirement_whose_recipients_all_die_is_stopped_and_the_worker_works_on(
    redis_url: str,
    cluster_name: str,
    monkeypatch: pytest.MonkeyPatch,
    make_cluster: ClusterFactory,
) -> None:
    """The only worker that was to take a retiring worker's results died: the retirement
    waited for a recipient for ever, the client for its whole timeout, and the retiring
    worker claimed nothing meanwhile, so the cluster stood still (distributed keeps such
    a worker running)."""
    monkeypatch.setenv("REDISDASK__SCHEDULER__WORKER_TTL", "1")
    monkeypatch.setenv("REDISDASK__WORKER__INLINE_RESULT_BYTES", "0")  # held there only
    with (
        make_cluster(nanny=False, n_workers=2) as cluster,
        Client(cluster) as client,
    ):
        r = redis.Redis.from_url(redis_url)
        keys = Keys(cluster_name)
        workers = client.scheduler_info()["workers"]
        holder, other = sorted(workers)
        x = client.submit(inc, 1, workers=[holder])
        assert x.result(timeout=20) == 2
        stopped = next(p for p in cluster.worker_processes if p.pid == workers[other]["pid"])
        stopped.send_signal(signal.SIGSTOP)  # the recipient: silent, then declared dead
        try:
            start = time.monotonic()
            assert client.retire_workers([holder], timeout=30) == {}
            assert time.monotonic() - start < 20  # told, not timed out
            assert not r.hexists(keys.workers, other)
            assert list(client.scheduler_info()["workers"]) == [holder]
            assert client.submit(inc, x).result(timeout=20) == 3  # it holds and claims
        finally:
            stopped.send_signal(signal.SIGCONT)
        assert stopped.wait(timeout=20) == 1  # removed while stopped: it leaves


def slow_counted_inc(x: int, url: str, counter: str) -> int:
    threading.Event().wait(0.05)  # stands for real work
    return counted_inc(x, url, counter)


def test_a_worker_retired_mid_computation_hands_back_what_it_had_not_started(
    redis_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    with (
        make_cluster(
            nanny=False,
            n_workers=3,
            threads_per_worker=2,
        ) as cluster,
        Client(cluster) as client,
    ):
        r = redis.Redis.from_url(redis_url)
        counter = f"{cluster_name}-runs"
        futures = client.map(slow_counted_inc, range(120), url=redis_url, counter=counter)
        poll(lambda: sum(f.done() for f in futures) >= 10)
        retired = client.retire_workers(n=1)
        assert len(retired) == 1
        assert client.gather(futures) == list(range(1, 121))
        assert int(r.get(counter)) == 120  # each task ran once: none lost, none run twice
        assert len(client.scheduler_info()["workers"]) == 2
        # the retired process leaves right after its goodbye
        poll(lambda: [p.poll() for p in cluster.worker_processes].count(0) == 1)
