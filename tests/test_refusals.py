"""Redis refusing writes (full, read-only, cannot persist) and an evicting Redis: every
process waits a refusal out and says why; none works on an evicting Redis.

Each test starts its own redis-server (``maxmemory``, ``REPLICAOF`` and the policy are
server-wide), with real scheduler and worker processes.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis
from polling import poll
from tasklib import recorded, wait_for_file

from redisdask import Client, LocalCluster
from redisdask.deploy.embedded import EmbeddedRedis, find_redis_server, version
from redisdask.errors import EvictingRedisError, RedisRefusedError
from redisdask.scheduler.driver import MAX_SCRIPT_COMMANDS, Scheduler
from redisdask.store.bootstrap import ensure_cluster
from redisdask.store.codecs import unpack
from redisdask.store.keyspace import Keys
from redisdask.workers.worker import Worker


@pytest.fixture
def own_redis() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


def inc(x: int) -> int:
    return x + 1


def blob(i: int) -> bytes:
    return bytes([i % 256]) * 20_000


def wait_for(started: str, flag: str) -> int:
    """A task that says it started, and runs until the test creates ``flag``."""
    Path(started).touch()
    wait_for_file(flag)
    return 1


def _alive(cluster: LocalCluster) -> bool:
    return all(
        psutil.pid_exists(p.pid) and psutil.Process(p.pid).status() != "zombie"
        for p in cluster.subprocesses
    )


def test_an_evicting_redis_is_refused_at_start(own_redis: EmbeddedRedis) -> None:
    r = own_redis.client()
    r.config_set("maxmemory-policy", "allkeys-lru")
    with pytest.raises(EvictingRedisError, match=r"maxmemory-policy allkeys-lru.*noeviction"):
        Scheduler(own_redis.url, "c").run()
    with pytest.raises(EvictingRedisError, match="maxmemory-policy allkeys-lru"):
        Worker(own_redis.url, "c")._ensure_cluster()
    r.config_set("maxmemory-policy", "volatile-lru")  # evicts the lease, the alive keys
    with pytest.raises(EvictingRedisError, match=r"volatile-lru: when full it evicts keys"):
        Client(own_redis.url, cluster_name="c")


def test_a_policy_changed_at_run_time_is_reported(own_redis: EmbeddedRedis) -> None:
    r = own_redis.client()
    keys = Keys("c")
    with LocalCluster(nanny=False, n_workers=1, redis_url=own_redis.url, cluster_name="c"):
        r.config_set("maxmemory-policy", "allkeys-lfu")

        def reported() -> bool:
            events = [unpack(f[b"m"]) for _, f in r.xrange(keys.events)]
            return any(e["kind"] == "redis-evicting" for e in events)

        poll(reported, timeout=20)


def test_a_full_redis_is_waited_out_and_named(
    own_redis: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fill Redis: no process exits, the client's send fails naming the memory, the
    scheduler applies the client's releases through the full Redis, and work resumes
    once Redis has room again."""
    monkeypatch.setenv("REDISDASK__REDIS__DOWN_DEADLINE", "2")
    r = own_redis.client()
    with (
        LocalCluster(
            nanny=False, n_workers=2, redis_url=own_redis.url, cluster_name="c"
        ) as cluster,
        Client(cluster) as client,
    ):
        kept = client.map(blob, range(400))  # 8 MB inlined into Redis
        client.gather(kept)
        r.config_set("maxmemory", 1)  # full, whatever it frees
        with pytest.raises(RedisRefusedError, match=r"Redis is full: used_memory .* of maxmemory"):
            client.submit(inc, 1, pure=False).result(timeout=30)
        assert _alive(cluster)
        used = r.info("memory")["used_memory"]
        del kept  # the release gets through the full Redis, and its results are freed
        poll(lambda: r.info("memory")["used_memory"] < used - 5_000_000, timeout=20)
        r.config_set("maxmemory", 0)  # room again: work resumes by itself
        assert client.submit(inc, 2, pure=False).result(timeout=20) == 3
        assert _alive(cluster)


def test_workers_outlive_a_full_redis_longer_than_their_ttl(
    own_redis: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Redis full for longer than ``scheduler.worker-ttl`` while work is queued: every
    worker's heartbeat gets through, none is declared dead, none exits, no task runs
    twice.  The claim loop waits out its refused claim holding the claim lock, and the
    heartbeat loop waited behind it for that lock (its holding report): the heartbeats
    stopped, the workers were declared dead and left, and their tasks ran again."""
    monkeypatch.setenv("REDISDASK__SCHEDULER__WORKER_TTL", "1")
    runs = tmp_path / "runs"
    r = own_redis.client()
    with (
        LocalCluster(
            nanny=False, n_workers=2, redis_url=own_redis.url, cluster_name="c"
        ) as cluster,
        Client(cluster) as client,
    ):
        futures = client.map(recorded, range(100), runs=str(runs), delay=0.02, pure=False)
        poll(lambda: runs.exists() and len(runs.read_text().split()) >= 20)
        r.config_set("maxmemory", 1)
        threading.Event().wait(3.0)  # the fault's length (3 TTLs), not a synchronisation
        r.config_set("maxmemory", 0)
        assert client.gather(futures) == list(range(100))
        assert _alive(cluster) and len(client.scheduler_info()["workers"]) == 2
    counts = Counter(runs.read_text().split())
    assert not [k for k, n in counts.items() if n > 1], counts


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_read_only_redis_is_waited_out(own_redis: EmbeddedRedis) -> None:
    """A demoted primary (REPLICAOF a server that is not there: read-only, its data
    kept) refuses every write: the scheduler and workers wait, then go on."""
    r = own_redis.client()
    with (
        LocalCluster(
            nanny=False, n_workers=1, redis_url=own_redis.url, cluster_name="c"
        ) as cluster,
        Client(cluster) as client,
    ):
        assert client.submit(inc, 1).result(timeout=20) == 2
        r.execute_command("REPLICAOF", "127.0.0.1", _closed_port())
        with pytest.raises(redis.ReadOnlyError):
            r.set("probe", 1)
        pending = client.submit(inc, 10)
        with pytest.raises(TimeoutError):  # refused meanwhile: nothing moves
            pending.result(timeout=2)
        r.execute_command("REPLICAOF", "NO", "ONE")
        assert pending.result(timeout=30) == 11
        assert _alive(cluster)


def _logged(logs: Path, *texts: str) -> bool:
    """Whether the scheduler's and the worker's logs each hold every one of ``texts``."""
    found = [p.read_text() for p in logs.glob("*.log")]
    return len(found) >= 2 and all(all(t in log for t in texts) for log in found)


@contextlib.contextmanager
def _cannot_persist(server: EmbeddedRedis, gone: Path) -> Iterator[redis.Redis]:
    """MISCONF for real: an RDB save that fails (its dir removed under it: root cannot
    write there either) with ``stop-writes-on-bgsave-error yes``; on leaving, the dir is
    back and a BGSAVE succeeds, which ends it (a failing test too)."""
    r = server.client()
    gone.mkdir()
    r.config_set("save", "3600 1")  # what MISCONF needs: RDB snapshots configured
    r.config_set("dir", str(gone))
    gone.rmdir()
    r.bgsave()
    poll(lambda: r.info("persistence")["rdb_last_bgsave_status"] == "err", timeout=10)
    with pytest.raises(redis.ResponseError, match=r"^MISCONF"):
        r.set("probe", 1)
    try:
        yield r
    finally:
        r.config_set("dir", str(server.data_dir))
        r.bgsave()
        poll(lambda: r.info("persistence")["rdb_last_bgsave_status"] == "ok", timeout=10)


def test_a_redis_that_cannot_persist_is_waited_out(tmp_path: Path) -> None:
    """Redis refuses every write (MISCONF): a task finishing meanwhile waits to report,
    nothing moves, no process exits, the logs name MISCONF and the fix, a client closes
    all the same; a save that succeeds ends it, and the work goes on."""
    unlock = ["--enable-protected-configs", "yes"]  # CONFIG SET dir: a protected config
    args = unlock if int(version(find_redis_server()).split(".")[0]) >= 7 else []
    started, flag, logs = tmp_path / "started", tmp_path / "flag", tmp_path / "logs"
    with (
        EmbeddedRedis(args=args) as server,
        LocalCluster(
            nanny=False, n_workers=1, redis_url=server.url, cluster_name="c", log_directory=logs
        ) as cluster,
        Client(cluster) as client,
    ):
        other = Client(server.url, cluster_name="c")
        after = client.submit(inc, client.submit(wait_for, str(started), str(flag)))
        poll(started.exists, timeout=20)
        with _cannot_persist(server, tmp_path / "gone"):
            flag.touch()  # the task ends: its report is refused
            poll(lambda: _logged(logs, "cannot persist", "MISCONF", "BGSAVE; or CONFIG SET stop-"))
            with pytest.raises(TimeoutError):  # refused meanwhile: nothing moves
                after.result(timeout=1)
            closing = threading.Thread(target=other.close, daemon=True)
            closing.start()  # its goodbye is refused: it closes without
            closing.join(timeout=15)
            assert not closing.is_alive(), "a client's close waits for a refusing Redis"
            assert _alive(cluster)
        assert after.result(timeout=30) == 2
        assert _alive(cluster)
        poll(lambda: _logged(logs, "takes"))
        for log in logs.glob("*.log"):  # once per episode, however many threads waited
            assert log.read_text().count("cannot persist") == 1, log.read_text()


def test_the_inline_budget_keeps_results_out_of_a_filling_redis(
    own_redis: EmbeddedRedis,
) -> None:
    r = own_redis.client()
    keys = Keys("c")
    with (
        LocalCluster(
            nanny=False,
            n_workers=1,
            redis_url=own_redis.url,
            cluster_name="c",  # worker.inline-results-redis-fraction: 0.5
        ) as cluster,
        Client(cluster) as client,
    ):
        first = client.submit(inc, 1)
        assert first.result(timeout=20) == 2
        # inlined: Redis has room (a pushed task's small result may reach the client
        # before the scheduler records it)
        poll(lambda: r.hget(keys.task(first.key), "value"))
        r.config_set("maxmemory", int(r.info("memory")["used_memory"] * 1.5))  # 67 % used
        # the next heartbeat reads it: results stay on the workers from then on
        poll(lambda: _not_inlined(client, r, keys), timeout=20)
        assert _alive(cluster)


def _not_inlined(client: Client, r: redis.Redis, keys: Keys) -> bool:
    f = client.submit(inc, 7, pure=False)
    assert f.result(timeout=20) == 8
    # read once the scheduler recorded it (a pushed task's small result may reach the
    # client first: the record has no value yet, inlined or not)
    poll(lambda: r.hget(keys.task(f.key), "state") == b"memory")
    return not r.hget(keys.task(f.key), "value")


def test_a_write_of_several_parts_lands_whole_through_a_full_redis(
    own_redis: EmbeddedRedis,
) -> None:
    """A full Redis refuses every command queued in a MULTI: the scheduler's write of
    several parts goes again as one script, which opens the way, and lands whole."""
    scheduler = Scheduler(own_redis.url, "c")
    ensure_cluster(scheduler.redis, scheduler.keys)
    scheduler.acquire_lease(standby=False)
    r = own_redis.client()
    r.config_set("maxmemory", 1)
    probe, n = scheduler.keys.prefix + "probe", 2 * MAX_SCRIPT_COMMANDS + 1
    scheduler.apply([["HSET", probe, f"f{i}", i] for i in range(n)])
    assert r.hlen(probe) == n
    assert not r.exists(scheduler.keys.applying)  # no part marker left behind
    assert r.get(scheduler.keys.lease).decode() == scheduler.token
    r.config_set("maxmemory", 0)
    scheduler.release_lease()
