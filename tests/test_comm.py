"""Tests of redisdask.comm: real sockets on 127.0.0.1, no Redis needed."""

from __future__ import annotations

import asyncio
import gc
import logging
import pickle
import socket
import struct
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from redisdask.comm import (
    AuthenticationError,
    BlockingConnection,
    BlockingPool,
    Buffer,
    BufferCache,
    CommClosedError,
    ConnectionPool,
    DataServer,
    FramingError,
    MessageReader,
    SerializationError,
    deserialize,
    deserialize_dict,
    encode_message,
    parse_address,
    serialize,
    serialize_dict,
)

SECRET = b"test-cluster-secret"
Reply = tuple[dict[str, Any], Sequence[Buffer]]


class Marker:
    """Unpickling this creates a file: proof that something was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return open, (self.path, "w")


class EchoHandler:
    """Echoes dict payloads back; ``op="fail"`` raises; ``op="gate"`` blocks on a gate."""

    def __init__(self) -> None:
        self.calls = 0
        self.active = 0
        self.max_active = 0
        self.gate: asyncio.Event | None = None
        self.all_active: asyncio.Event | None = None
        self.expected_active = 0

    async def __call__(self, header: dict[str, Any], frames: list[memoryview]) -> Reply:
        self.calls += 1
        op = header.get("op")
        if op == "fail":
            raise ValueError("handler exploded")
        if op == "unpickle":
            return {"status": "ok", "value": repr(deserialize(frames))}, []
        if op == "gate":
            return await self._gated(header)
        return {"status": "ok", "echo": header, "nframes": len(frames)}, frames

    async def _gated(self, header: dict[str, Any]) -> Reply:
        assert self.gate is not None and self.all_active is not None
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        if self.active >= self.expected_active:
            self.all_active.set()
        await self.gate.wait()
        self.active -= 1
        return {"status": "ok", "i": header["i"]}, []


ServerBody = Callable[[DataServer, EchoHandler], Awaitable[None]]


def with_server(body: ServerBody) -> None:
    """Run ``body(server, handler)`` in a fresh event loop with a started DataServer."""

    async def main() -> None:
        handler = EchoHandler()
        srv = DataServer(SECRET, handler, handshake_timeout=1.0)
        await srv.start("127.0.0.1")
        try:
            await body(srv, handler)
        finally:
            await srv.close()

    asyncio.run(asyncio.wait_for(main(), 25))


@pytest.fixture
def threaded_server() -> Iterator[tuple[DataServer, EchoHandler]]:
    """A DataServer running in its own thread and event loop."""
    handler = EchoHandler()
    srv = DataServer(SECRET, handler, handshake_timeout=1.0)
    loop = asyncio.new_event_loop()
    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(srv.start("127.0.0.1"))
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(10)
    yield srv, handler
    asyncio.run_coroutine_threadsafe(srv.close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def raw_connect(address: str) -> socket.socket:
    sock = socket.create_connection(parse_address(address), timeout=10)
    return sock


def assert_dropped(sock: socket.socket) -> None:
    """The server closes the connection: recv sees EOF (or a reset)."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    finally:
        sock.close()


# ------------------------------------------------------------------ sans-I/O core


@pytest.mark.timeout(30)
def test_reader_fed_byte_by_byte_and_in_one_chunk() -> None:
    messages = [({"op": "a", "n": 1}, [b"xyz", b""]), ({"op": "b"}, [])]
    wire = b"".join(bytes(b) for h, f in messages for b in encode_message(h, f))
    for chunks in ([wire], [wire[i : i + 1] for i in range(len(wire))]):
        reader = MessageReader()
        for chunk in chunks:
            reader.feed(chunk)
        got = [reader.next_message(), reader.next_message()]
        assert reader.next_message() is None
        assert [(h, [bytes(f) for f in fs]) for h, fs in got] == messages  # type: ignore[misc]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "garbage",
    [
        struct.pack("<I", 0),  # no header frame
        struct.pack("<I", 10**6),  # too many frames
        struct.pack("<IQ", 1, 2**40),  # oversize header
        struct.pack("<IQQ", 2, 1, 2**62),  # oversize message
        struct.pack("<IQ", 1, 3) + b"\xc1\xc1\xc1",  # invalid msgpack
        struct.pack("<IQ", 1, 1) + b"\x01",  # header not a dict
    ],
)
def test_reader_rejects_garbage(garbage: bytes) -> None:
    with pytest.raises(FramingError):
        MessageReader().feed(garbage)


@pytest.mark.timeout(30)
def test_serialize_numpy_out_of_band() -> None:
    arr = np.arange(1_000_000, dtype=np.float64)
    frames = serialize({"a": arr, "f": lambda x: x + 1})
    assert len(frames) > 1
    assert isinstance(frames[1], memoryview) and frames[1].nbytes == arr.nbytes
    out = deserialize(frames)
    np.testing.assert_array_equal(out["a"], arr)
    assert out["f"](1) == 2


@pytest.mark.timeout(30)
def test_unpicklable_value_gives_per_key_error() -> None:
    header, frames, errors = serialize_dict({"good": 1, "bad-key": threading.Lock()})
    assert list(errors) == ["bad-key"]
    err = errors["bad-key"]
    assert isinstance(err, SerializationError) and err.key == "bad-key"
    assert "bad-key" in str(err) and "lock" in str(err).lower()
    values, remote_errors = deserialize_dict(header, frames)
    assert values == {"good": 1}
    assert remote_errors["bad-key"].key == "bad-key"
    with pytest.raises(SerializationError, match="lock"):
        serialize(threading.Lock())


@pytest.mark.timeout(30)
def test_parse_address() -> None:
    assert parse_address("tcp://127.0.0.1:8786") == ("127.0.0.1", 8786)
    assert parse_address("tcp://[::1]:1") == ("::1", 1)
    for bad in ["127.0.0.1:1", "tcp://host", "udp://h:1", "tcp://:1"]:
        with pytest.raises(ValueError):
            parse_address(bad)


# ------------------------------------------------------------------- async server


@pytest.mark.timeout(30)
def test_round_trip_dict_with_large_array() -> None:
    async def body(srv: DataServer, handler: EchoHandler) -> None:
        big = np.random.default_rng(0).random(50_000_000 // 8)
        data = {"big": big, "small": [1, "two", 3.0], ("tuple", 1): b"bytes"}
        header, frames, errors = serialize_dict(data)
        assert not errors and len(frames) > len(data)  # numpy data travelled out-of-band
        pool = ConnectionPool(SECRET)
        reply, reply_frames = await pool.rpc(srv.address, {"op": "echo", **header}, frames)
        await pool.close()
        assert reply["status"] == "ok" and reply["nframes"] == len(frames)
        values, errors = deserialize_dict(reply["echo"], reply_frames)
        assert not errors
        np.testing.assert_array_equal(values["big"], big)
        assert values["small"] == [1, "two", 3.0] and values[("tuple", 1)] == b"bytes"

    with_server(body)


@pytest.mark.timeout(30)
def test_many_sequential_requests_reuse_one_connection() -> None:
    async def body(srv: DataServer, handler: EchoHandler) -> None:
        pool = ConnectionPool(SECRET, limit=4)
        for i in range(200):
            reply, frames = await pool.rpc(srv.address, {"op": "echo", "i": i}, [b"p%d" % i])
            assert reply["echo"]["i"] == i and bytes(frames[0]) == b"p%d" % i
        assert srv.n_accepted == 1 and pool.n_open == 1 and handler.calls == 200
        await pool.close()

    with_server(body)


@pytest.mark.timeout(30)
def test_concurrent_requests_respect_pool_limit() -> None:
    async def body(srv: DataServer, handler: EchoHandler) -> None:
        handler.gate, handler.all_active = asyncio.Event(), asyncio.Event()
        handler.expected_active = 3
        pool = ConnectionPool(SECRET, limit=3)
        requests = [pool.rpc(srv.address, {"op": "gate", "i": i}) for i in range(20)]
        tasks = [asyncio.create_task(r) for r in requests]
        await handler.all_active.wait()
        assert pool.n_open == 3 and srv.n_connections == 3
        handler.gate.set()
        replies = await asyncio.gather(*tasks)
        assert sorted(h["i"] for h, _ in replies) == list(range(20))
        assert handler.max_active == 3 and srv.n_accepted == 3 and pool.n_open <= 3
        await pool.close()

    with_server(body)


@pytest.mark.timeout(30)
def test_pool_limit_spans_addresses() -> None:
    async def body(srv: DataServer, handler: EchoHandler) -> None:
        other = DataServer(SECRET, EchoHandler())
        other_address = await other.start("127.0.0.1")
        pool = ConnectionPool(SECRET, limit=1)
        for address in [srv.address, other_address, srv.address]:
            reply, _ = await pool.rpc(address, {"op": "echo"})
            assert reply["status"] == "ok" and pool.n_open == 1
        await pool.close()
        await other.close()

    with_server(body)


@pytest.mark.timeout(30)
def test_wrong_secret_rejected_then_server_still_serves(caplog: pytest.LogCaptureFixture) -> None:
    async def body(srv: DataServer, handler: EchoHandler) -> None:
        bad = ConnectionPool(b"not-the-secret")
        with caplog.at_level(logging.WARNING, logger="redisdask.comm"):
            with pytest.raises(AuthenticationError, match=srv.address):
                await bad.rpc(srv.address, {"op": "echo"})
            good = ConnectionPool(SECRET)
            reply, _ = await good.rpc(srv.address, {"op": "echo"})
        assert reply["status"] == "ok" and handler.calls == 1
        assert any("authentication" in r.getMessage() for r in caplog.records)
        assert all(SECRET.decode() not in r.getMessage() for r in caplog.records)
        await bad.close()
        await good.close()

    with_server(body)


@pytest.mark.timeout(30)
def test_client_rejects_server_with_wrong_secret() -> None:
    async def body() -> None:
        impostor = DataServer(b"impostor", EchoHandler())
        address = await impostor.start("127.0.0.1")
        pool = ConnectionPool(SECRET)
        with pytest.raises(AuthenticationError):
            await pool.rpc(address, {"op": "echo"})
        await pool.close()
        await impostor.close()

    asyncio.run(asyncio.wait_for(body(), 25))


@pytest.mark.timeout(30)
def test_connect_failure_names_address() -> None:
    async def body() -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
        sock.close()  # nothing listens there now
        pool = ConnectionPool(SECRET, timeout=2)
        with pytest.raises(CommClosedError, match=address) as info:
            await pool.rpc(address, {"op": "echo"})
        assert isinstance(info.value, OSError)
        assert pool.n_open == 0
        await pool.close()

    asyncio.run(asyncio.wait_for(body(), 25))


@pytest.mark.timeout(30)
def test_handler_exception_gives_error_reply() -> None:
    async def body(srv: DataServer, handler: EchoHandler) -> None:
        pool = ConnectionPool(SECRET)
        reply, frames = await pool.rpc(srv.address, {"op": "fail"})
        assert reply == {"status": "error", "message": "ValueError: handler exploded"}
        assert frames == []
        reply, _ = await pool.rpc(srv.address, {"op": "echo"})
        assert reply["status"] == "ok" and srv.n_accepted == 1
        await pool.close()

    with_server(body)


async def _stranger(address: str, payload: bytes) -> None:
    def talk() -> None:
        sock = raw_connect(address)
        sock.sendall(payload)
        assert_dropped(sock)

    await asyncio.to_thread(talk)


@pytest.mark.timeout(30)
def test_strangers_are_dropped_and_nothing_is_unpickled(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def body(srv: DataServer, handler: EchoHandler) -> None:
        marker = tmp_path / "unpickled"
        evil = pickle.dumps(Marker(str(marker)))
        valid_looking = b"".join(bytes(b) for b in encode_message({"op": "unpickle"}, [evil]))
        payloads = [
            b"\x00garbage\xff" * 100,  # garbage
            struct.pack("<IQ", 2, 2**63) + b"x" * 100,  # oversize length
            valid_looking,  # a well-formed request, but no handshake
            evil * 3,  # a raw pickle
            b"",  # says nothing: handshake timeout
        ]
        with caplog.at_level(logging.WARNING, logger="redisdask.comm"):
            await asyncio.gather(*(_stranger(srv.address, p) for p in payloads))
        assert not marker.exists() and handler.calls == 0 and srv.n_accepted == 0
        peers = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(peers) == len(payloads) and all("tcp://127.0.0.1:" in m for m in peers)
        pool = ConnectionPool(SECRET)
        reply, _ = await pool.rpc(srv.address, {"op": "unpickle"}, serialize([1, 2]))
        assert reply == {"status": "ok", "value": "[1, 2]"}
        await pool.close()

    with_server(body)


@pytest.mark.timeout(30)
def test_authenticated_garbage_drops_only_that_connection() -> None:
    async def body(srv: DataServer, handler: EchoHandler) -> None:

        def send_garbage() -> None:
            conn = BlockingConnection(srv.address, SECRET)
            conn._sock.sendall(struct.pack("<I", 10**6))  # too many frames
            assert_dropped(conn._sock)

        await asyncio.to_thread(send_garbage)
        pool = ConnectionPool(SECRET)
        reply, _ = await pool.rpc(srv.address, {"op": "echo"})
        assert reply["status"] == "ok"
        await pool.close()

    with_server(body)


# ----------------------------------------------------------------- blocking client


@pytest.mark.timeout(30)
def test_blocking_client_against_threaded_server(
    threaded_server: tuple[DataServer, EchoHandler],
) -> None:
    srv, handler = threaded_server
    assert srv.address is not None
    arr = np.arange(3_000_000, dtype=np.int64)
    conn = BlockingConnection(srv.address, SECRET, timeout=10)
    for i in range(20):
        reply, frames = conn.rpc({"op": "echo", "i": i}, serialize(arr))
        assert reply["echo"]["i"] == i
    np.testing.assert_array_equal(deserialize(frames), arr)
    reply, _ = conn.rpc({"op": "fail"})
    assert reply["status"] == "error"
    assert conn.rpc({"op": "echo"})[0]["status"] == "ok"
    conn.close()
    with pytest.raises(AuthenticationError):
        BlockingConnection(srv.address, b"wrong")

    pool = BlockingPool(SECRET)
    results: list[int] = []

    def worker(k: int) -> None:
        for i in range(10):
            results.append(pool.rpc(srv.address, {"op": "echo", "i": k * 100 + i})[0]["echo"]["i"])

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == sorted(k * 100 + i for k in range(4) for i in range(10))
    assert srv.n_accepted <= 1 + 4 and handler.calls == 20 + 2 + 40
    pool.close()


@pytest.mark.timeout(30)
def test_buffer_cache_recycles_only_unreferenced_buffers() -> None:
    cache = BufferCache()
    assert cache.size_class(5 << 20) == 5 << 20 and cache.size_class(3) == 1 << 20
    first = cache.allocate(3 << 20)
    first[:4] = b"keep"
    arr = np.frombuffer(first[:4], dtype=np.uint8)  # a view outliving the frame
    del first
    gc.collect()
    second = cache.allocate(3 << 20)
    second[:4] = b"over"
    assert bytes(arr) == b"keep"  # not recycled while the ndarray lives
    del arr, second
    gc.collect()
    assert cache.idle_bytes == 2 * (3 << 20)
    third = cache.allocate(3 << 20)
    assert cache.idle_bytes == 3 << 20 and third.nbytes == 3 << 20
