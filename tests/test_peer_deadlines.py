"""Peers that stop answering: deadlines on progress, idle and capped connections, and
frame headers that lie about their size.  Real sockets; real worker processes that are
really SIGSTOPped (alive, their sockets open, silent: what a network cut looks like)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from conftest import ClusterFactory
from polling import poll

from redisdask import Client, comm, wait
from redisdask.comm import (
    BlockingConnection,
    Buffer,
    ConnectionPool,
    DataServer,
    PeerTimeoutError,
    buffers,
    deserialize,
    encode_header,
    encode_message,
    serialize,
)

SECRET = b"test-cluster-secret"
DEAD_AFTER = 1.0  # comm.timeouts.tcp in these tests


class Server:
    """A DataServer in its own thread and event loop; ``gate`` requests wait until
    ``open_gate()``."""

    def __init__(self, **options: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.gate = asyncio.Event()
        self.srv = DataServer(SECRET, self._handle, handshake_timeout=5.0, **options)
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.srv.start("127.0.0.1"))
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(10)
        assert self.srv.address is not None
        self.address: str = self.srv.address

    async def _handle(
        self, header: dict[str, Any], frames: list[memoryview]
    ) -> tuple[dict[str, Any], Sequence[Buffer]]:
        if header.get("op") == "gate":
            await self.gate.wait()
        return {"status": "ok", "nbytes": sum(f.nbytes for f in frames)}, frames

    def open_gate(self) -> None:
        self.loop.call_soon_threadsafe(self.gate.set)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.srv.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def server_options() -> dict[str, Any]:
    return {"dead_after": DEAD_AFTER}


@pytest.fixture
def server(server_options: dict[str, Any]) -> Iterator[Server]:
    srv = Server(**server_options)
    yield srv
    srv.open_gate()
    srv.close()


def dropped(sock: socket.socket) -> bool:
    """The server closed ``sock`` (EOF or reset); False while it is open."""
    sock.setblocking(False)
    try:
        return sock.recv(1 << 16) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


# ------------------------------------------------------------------ the deadline


@pytest.mark.timeout(30)
def test_a_request_to_a_silent_peer_fails_after_the_deadline(server: Server) -> None:
    async def main() -> None:
        pool = ConnectionPool(SECRET, dead_after=DEAD_AFTER)
        start = time.monotonic()
        with pytest.raises(PeerTimeoutError, match="moved no byte for 1 s"):
            await pool.rpc(server.address, {"op": "gate"})
        assert DEAD_AFTER <= time.monotonic() - start < DEAD_AFTER + 5
        assert pool.n_open == 0  # the connection is closed, not pooled
        reply, _ = await pool.rpc(server.address, {"op": "echo"})  # a fresh one works
        assert reply["status"] == "ok"
        await pool.close()

    asyncio.run(main())


def dead_after_of(sock: socket.socket) -> tuple[int, int]:
    """(SO_KEEPALIVE, TCP_USER_TIMEOUT in ms) of a socket."""
    keepalive = sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
    return keepalive, sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)


@pytest.mark.timeout(30)
@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="Linux only")
def test_every_peer_socket_has_keepalive_and_a_user_timeout(server: Server) -> None:
    async def main() -> None:
        pool = ConnectionPool(SECRET, dead_after=12)
        await pool.rpc(server.address, {"op": "echo"})
        [conn] = pool._idle[server.address]
        assert dead_after_of(conn._sock.sock) == (1, 12_000)
        poll(lambda: len(server.srv._waiting) == 1)  # (the server's side, in its thread)
        [served] = server.srv._waiting.values()
        assert dead_after_of(served._sock.sock) == (1, int(DEAD_AFTER * 1000))
        await pool.close()

    asyncio.run(main())
    blocking = BlockingConnection(server.address, SECRET)
    assert dead_after_of(blocking._sock) == (1, int(comm.DEFAULT_DEAD_AFTER * 1000))
    blocking.close()


@pytest.mark.timeout(60)
def test_a_slow_steady_transfer_is_not_cut_but_a_stall_mid_message_is(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    """The deadline is on progress: a message that takes several deadlines to arrive,
    a little at a time, goes through; one that stops half-way is dropped and logged."""
    payload = np.arange(1 << 20, dtype=np.uint8)  # 1 MiB, sent over ~3 deadlines
    wire = b"".join(bytes(b) for b in encode_message({"op": "echo"}, serialize(payload)))
    conn = BlockingConnection(server.address, SECRET, timeout=20)
    step = len(wire) // 30
    for start in range(0, len(wire), step):
        conn._sock.sendall(wire[start : start + step])
        time.sleep(DEAD_AFTER / 10)  # the pace of a slow link, not a synchronisation
    reply, frames = conn._recv()
    assert reply["status"] == "ok"
    np.testing.assert_array_equal(deserialize(frames), payload)

    def logged() -> bool:  # (the server's thread logs just after it drops the peer)
        messages = [r.getMessage() for r in caplog.records]
        return any("moved no byte for 1 s while receiving" in m for m in messages)

    with caplog.at_level(logging.WARNING, logger="redisdask.comm"):
        conn._sock.sendall(wire[: len(wire) // 2])  # ... and then nothing
        poll(lambda: dropped(conn._sock), timeout=DEAD_AFTER + 10)
        poll(logged, timeout=10)
    conn.close()


# ------------------------------------------------------- idle and capped connections


@pytest.mark.timeout(30)
@pytest.mark.parametrize("server_options", [{"idle_timeout": 0.5}])
def test_idle_connections_are_closed_and_the_pool_reconnects(server: Server) -> None:
    async def main() -> None:
        pool = ConnectionPool(SECRET)
        assert (await pool.rpc(server.address, {"op": "echo"}))[0]["status"] == "ok"
        assert server.srv.n_connections == 1
        # closed by the server after 0.5 s idle (it runs in its own thread)
        poll(lambda: server.srv.n_connections == 0, timeout=10)
        # the pool notices its idle connection was closed and opens another
        assert (await pool.rpc(server.address, {"op": "echo"}))[0]["status"] == "ok"
        assert server.srv.n_accepted == 2
        await pool.close()

    asyncio.run(main())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("server_options", [{"max_connections": 3}])
def test_connections_beyond_the_cap_close_idle_ones_or_are_refused(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    idle = [BlockingConnection(server.address, SECRET, timeout=20) for _ in range(3)]
    for conn in idle:
        conn.rpc({"op": "echo"})
    fourth = BlockingConnection(
        server.address, SECRET, timeout=20
    )  # room made: the oldest idle closed
    assert fourth.rpc({"op": "echo"})[0]["status"] == "ok"
    poll(lambda: dropped(idle[0]._sock))
    assert server.srv.n_connections == 3

    busy = [fourth, *idle[1:]]
    threads = [threading.Thread(target=c.rpc, args=({"op": "gate"},)) for c in busy]
    for t in threads:
        t.start()
    poll(lambda: len(server.srv._waiting) == 0)  # each of the three waits on the gate
    with caplog.at_level(logging.WARNING, logger="redisdask.comm"):
        for _ in range(3):
            with pytest.raises(comm.CommClosedError):
                BlockingConnection(server.address, SECRET)
    refusals = [r.getMessage() for r in caplog.records if "comm.max-connections" in r.getMessage()]
    assert len(refusals) == 1, refusals  # logged once per episode
    server.open_gate()
    for t in threads:
        t.join(10)
    for conn in busy:
        conn.close()
    idle[0].close()


# ------------------------------------------------------------------- lying headers


@pytest.mark.timeout(60)
def test_a_header_announcing_ten_gigabytes_reserves_no_gigabytes(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    me = psutil.Process()
    before = me.memory_info()
    conn = BlockingConnection(server.address, SECRET)
    head = encode_header({"op": "echo"})
    conn._sock.sendall(struct.pack("<IQQ", 2, len(head), 10 << 30) + head + b"x" * 1000)
    growth = 0
    with caplog.at_level(logging.WARNING, logger="redisdask.comm"):
        deadline = time.monotonic() + DEAD_AFTER + 10
        while not dropped(conn._sock):
            now = me.memory_info()
            growth = max(growth, now.vms - before.vms, now.rss - before.rss)
            assert time.monotonic() < deadline, "the stalled connection was not dropped"
            time.sleep(0.01)
        # (the server's thread logs just after it drops the peer)
        poll(lambda: any("moved no byte" in r.getMessage() for r in caplog.records))
    assert growth < 1 << 30, f"the server reserved {growth / 2**30:.1f} GiB"
    conn.close()


@pytest.mark.timeout(60)
def test_a_truthful_frame_bigger_than_the_reservation_arrives_whole(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(buffers, "FRAME_RESERVE", 1 << 20)  # grow from 1 MiB (cheap test)
    payload = np.random.default_rng(0).integers(0, 255, 20_000_003, dtype=np.uint8)
    conn = BlockingConnection(server.address, SECRET, timeout=20)
    for _ in range(2):  # the second reuses the grown buffer from the cache
        _reply, frames = conn.rpc({"op": "echo"}, serialize(payload))
        np.testing.assert_array_equal(deserialize(frames), payload)
    conn.close()


# --------------------------------------------------------------- a stopped holder


def inc(x: int) -> int:
    return x + 1


def add(a: int, b: int) -> int:
    return a + b


def holder_of(client: Client, key: str) -> tuple[str, int, str]:
    """The address and pid of the one worker holding ``key``, and the other worker."""
    [address] = client.who_has()[key]
    workers = client.scheduler_info()["workers"]
    [other] = [w for w in workers if w != address]
    return address, workers[address]["pid"], other


@contextlib.contextmanager
def a_stopped_holder(client: Client) -> Iterator[tuple[Any, str]]:
    """``inc(41)`` held by one worker, to which the client has a pooled connection (on
    which the next request waits: a new one would time out in its handshake, comm's 5 s),
    then SIGSTOPped (SIGCONT on the way out); yields the future and the other worker."""
    x = client.submit(inc, 41)
    wait([x], timeout=20)  # (not result(): that would fetch and keep the value)
    holder, pid, other = holder_of(client, x.key)
    assert client.submit(inc, 1, workers=[holder]).result(timeout=20) == 2
    os.kill(pid, signal.SIGSTOP)
    try:
        yield x, other
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.fixture
def stopped_holder_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A short peer deadline; values only on their workers (not in Redis)."""
    monkeypatch.setenv("REDISDASK__COMM__TIMEOUTS__TCP", str(DEAD_AFTER))
    monkeypatch.setenv("REDISDASK__WORKER__INLINE_RESULT_BYTES", "0")


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "worker_ttl, dead_after",
    [
        # the holder keeps its registration (as when only the link between two workers
        # is cut): nothing but the peer deadline can free the dependent
        ("120", DEAD_AFTER),
        # its heartbeat lapses first: the dependent is taken back and the other worker
        # claims x while its fetch of x still waits on the stopped holder; that claim was
        # lost when the fetch failed, and y waited for ever (issue 22's gaps)
        ("3", 5.0),
    ],
    ids=["registered", "declared-dead-first"],
)
def test_a_dependent_of_a_stopped_holder_finishes_through_a_recompute(
    monkeypatch: pytest.MonkeyPatch,
    stopped_holder_env: None,
    tmp_path: Path,
    worker_ttl: str,
    dead_after: float,
    make_cluster: ClusterFactory,
) -> None:
    monkeypatch.setenv("REDISDASK__SCHEDULER__WORKER_TTL", worker_ttl)
    monkeypatch.setenv("REDISDASK__COMM__TIMEOUTS__TCP", str(dead_after))
    with (
        make_cluster(
            nanny=False,
            n_workers=2,
            log_directory=tmp_path,
        ) as cluster,
        Client(cluster) as client,
    ):
        x = client.submit(inc, 41)
        assert x.result(timeout=20) == 42
        holder, pid, other = holder_of(client, x.key)
        # the other worker fetches from the holder once: a pooled connection, on which the
        # next request waits (a new one would time out in its handshake, comm's 5 s)
        w = client.submit(inc, 1, workers=[holder])
        assert client.submit(add, w, 0, workers=[other]).result(timeout=20) == 2
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            y = client.submit(add, x, 1)
            assert y.result(timeout=60) == 43
            took = time.monotonic() - start
            assert client.who_has()[y.key] == [other]
            assert took < dead_after + 15, took
        finally:
            os.kill(pid, signal.SIGCONT)
    logs = "".join(p.read_text() for p in tmp_path.glob("*.log"))
    assert f"could not fetch 1 keys ['{x.key}'] from {holder}" in logs
    assert f"moved no byte for {dead_after:g} s" in logs


@pytest.mark.timeout(90)
def test_the_client_does_not_wait_for_ever_on_a_stopped_holder(
    stopped_holder_env: None, make_cluster: ClusterFactory
) -> None:
    with (
        make_cluster(nanny=False, n_workers=2) as cluster,
        Client(cluster) as client,
        a_stopped_holder(client) as (x, _other),
    ):
        # the stopped worker's heartbeat lapses: the scheduler recomputes x elsewhere,
        # and the client, its fetch from the stopped holder given up, reads it there
        assert x.result(timeout=60) == 42


@pytest.mark.timeout(90)
def test_a_client_that_cannot_reach_the_only_holder_has_the_key_recomputed(
    monkeypatch: pytest.MonkeyPatch,
    stopped_holder_env: None,
    make_cluster: ClusterFactory,
) -> None:
    """The holder stays registered (only the link is cut): the client's word, not a
    heartbeat's lapse, makes the scheduler drop it and compute the key again."""
    monkeypatch.setenv("REDISDASK__SCHEDULER__WORKER_TTL", "120")
    with (
        make_cluster(nanny=False, n_workers=2) as cluster,
        Client(cluster) as client,
        a_stopped_holder(client) as (x, other),
    ):
        start = time.monotonic()
        assert x.result(timeout=60) == 42
        took = time.monotonic() - start
        assert client.who_has()[x.key] == [other]
        assert took < DEAD_AFTER + 10, took


@pytest.mark.timeout(60)
def test_a_holder_that_answers_without_the_key_has_it_recomputed(
    stopped_holder_env: None, make_cluster: ClusterFactory
) -> None:
    """The record names a holder that dropped the key behind the scheduler's back (as a
    stray free-keys read after the worker answered a claim from its copy once did, when
    Redis had lost writes).  Its answer without the key is reported like a failed fetch
    and the key computed again; the gather gave up with ``DataUnavailableError``."""
    from redisdask.protocol import FreeKeys
    from redisdask.store import codecs
    from redisdask.store.bootstrap import ensure_cluster

    with (
        make_cluster(nanny=False, n_workers=2) as cluster,
        Client(cluster) as client,
    ):
        x = client.submit(inc, 41)
        wait([x], timeout=20)
        holder, _pid, _other = holder_of(client, x.key)
        inbox = cluster.keys.worker_inbox(holder)
        cluster.redis.xadd(inbox, codecs.entry([FreeKeys([x.key]).to_dict()]))
        pool = comm.BlockingPool(ensure_cluster(cluster.redis, cluster.keys), timeout=5)
        try:
            poll(lambda: x.key not in pool.rpc(holder, {"op": "inspect"})[0]["tasks"], 20)
        finally:
            pool.close()
        assert client.who_has()[x.key] == [holder]  # the record still says it holds x
        assert x.result(timeout=30) == 42
        assert x.key in client.who_has()


@pytest.mark.timeout(60)
def test_a_worker_keeps_a_copy_it_claimed_after_what_a_free_keys_was_decided_on(
    make_cluster: ClusterFactory,
) -> None:
    """A free-keys names the last workers stream entry the scheduler had read: a copy
    the worker claimed in a later entry (here: one claimed and answered before the
    worker read a free-keys sent about an older copy) stays, and one decided after the
    claim is obeyed; both come through a real inbox, in order."""
    from redisdask.protocol import FreeKeys
    from redisdask.store import codecs
    from redisdask.store.bootstrap import ensure_cluster

    with (
        make_cluster(nanny=False, n_workers=1) as cluster,
        Client(cluster) as client,
    ):
        futures = client.map(inc, range(6))  # one worker, one thread: most are claimed
        wait(futures, timeout=20)
        r, keys = cluster.redis, cluster.keys
        claims = {f.key: r.hget(keys.task(f.key), "claim") for f in futures}
        [kept, dropped] = [k for k, claim in claims.items() if claim][:2]
        [worker] = client.scheduler_info()["workers"]

        def before(claim: bytes) -> str:
            ms, seq = map(int, claim.decode().split("-"))
            return f"{ms - 1}-{seq}"

        stale = FreeKeys([kept], seen=before(claims[kept])).to_dict()
        current = FreeKeys([dropped], seen=claims[dropped].decode()).to_dict()
        r.xadd(keys.worker_inbox(worker), codecs.entry([stale, current]))
        pool = comm.BlockingPool(ensure_cluster(r, keys), timeout=5)
        try:
            held = lambda: pool.rpc(worker, {"op": "inspect"})[0]["tasks"]  # noqa: E731
            poll(lambda: dropped not in held(), 20)  # (read after the stale one)
            assert held()[kept] == "memory"
        finally:
            pool.close()


@pytest.mark.timeout(90)
def test_a_client_that_reaches_no_worker_gives_up_after_a_few_recomputes(
    stopped_holder_env: None, make_cluster: ClusterFactory
) -> None:
    """Every worker refuses this client's connections (its pool carries a wrong secret:
    the workers are there, the client cannot get to them, as behind a firewall). Each
    report has the key computed again, so the client stops after MAX_MISSING_REPORTS
    with an error naming the network, instead of having it computed for ever."""
    from redisdask.client.fetch import MAX_MISSING_REPORTS
    from redisdask.errors import DataUnavailableError

    with (
        make_cluster(nanny=False, n_workers=1) as cluster,
        Client(cluster) as client,
    ):
        x = client.submit(inc, 41)
        wait([x], timeout=20)
        client._peers = ConnectionPool(b"not this cluster's secret", timeout=2.0)
        with pytest.raises(DataUnavailableError, match="check the network") as info:
            x.result(timeout=60)
        assert f"{MAX_MISSING_REPORTS} times over" in str(info.value)
        # the cluster goes on: the key is in memory again, on a worker the client missed
        assert x.status == "finished"
        assert client.who_has()[x.key]


@pytest.mark.timeout(90)
def test_a_client_waits_for_a_busy_scheduler_to_read_its_report_of_a_silent_holder(
    stopped_holder_env: None, make_cluster: ClusterFactory
) -> None:
    """The scheduler is busy (here: stopped) when the client reports the holder that did
    not answer: the client waits for it to read the report and have the key computed
    again, not ``worker-ttl`` + 2 s from the gather's start, after which it gave up with
    ``DataUnavailableError`` (a 100,000-task map's batches, seconds long on a loaded
    machine, made CI's gather fail so)."""
    with (
        make_cluster(nanny=False, n_workers=2) as cluster,
        Client(cluster) as client,
        a_stopped_holder(client) as (x, _other),
    ):
        scheduler = cluster.scheduler_process
        assert scheduler is not None
        os.kill(scheduler.pid, signal.SIGSTOP)
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                result = pool.submit(x.result, timeout=80)
                patience = client.config.scheduler.worker_ttl + 2.0
                with pytest.raises(concurrent.futures.TimeoutError):  # still waiting
                    result.result(timeout=DEAD_AFTER + patience + 2.0)
                os.kill(scheduler.pid, signal.SIGCONT)
                assert result.result(timeout=60) == 42
        finally:
            os.kill(scheduler.pid, signal.SIGCONT)
