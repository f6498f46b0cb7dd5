"""TLS between peers (redisdask/security.py, the tls:// side of redisdask/comm/): real
sockets and real worker processes, certificates from a throwaway CA made by trustme."""

from __future__ import annotations

import asyncio
import datetime
import logging
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trustme
from conftest import ClusterFactory
from polling import poll

from redisdask import Client, Security
from redisdask.comm import (
    BlockingConnection,
    Buffer,
    CommClosedError,
    ConnectionPool,
    DataServer,
    deserialize,
    parse_address,
    serialize,
)
from redisdask.security import TLSSetupError
from redisdask.utils.spawn import command, environment

SECRET = b"tls-test-secret"


def _write(ca: trustme.CA, directory: Path) -> Security:
    """``ca.pem``, ``cert.pem`` and ``key.pem`` in ``directory``; their ``Security``."""
    directory.mkdir(parents=True, exist_ok=True)
    cert = ca.issue_cert("127.0.0.1", "localhost", "redisdask-peer")
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    cert.cert_chain_pems[0].write_to_path(str(directory / "cert.pem"))
    cert.private_key_pem.write_to_path(str(directory / "key.pem"))
    return Security(directory / "ca.pem", directory / "cert.pem", directory / "key.pem")


@pytest.fixture(scope="module")
def security(tmp_path_factory: pytest.TempPathFactory) -> Security:
    return _write(trustme.CA(), tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> Security:
    """Good certificates, from another CA."""
    return _write(trustme.CA(), tmp_path_factory.mktemp("other-ca"))


async def _echo(header: dict[str, Any], frames: list[memoryview]) -> tuple[dict, Sequence[Buffer]]:
    return {"status": "ok", "op": header.get("op")}, frames


def _serve(security: Security | None) -> tuple[DataServer, asyncio.AbstractEventLoop, Any]:
    """A data server on a loop in a thread of its own (the blocking clients' peer)."""
    import threading

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    tls = security.server_context() if security else None
    server = DataServer(SECRET, _echo, tls=tls, handshake_timeout=2.0)
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
    return server, loop, thread


def _stop(server: DataServer, loop: asyncio.AbstractEventLoop, thread: Any) -> None:
    asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def _pool_rpc(address: str, security: Security) -> None:
    """One request to ``address`` through an asyncio ConnectionPool with ``security``."""

    async def through_pool() -> None:
        pool = ConnectionPool(SECRET, tls=security.client_context())
        try:
            await pool.rpc(address, {"op": "x"})
        finally:
            await pool.close()

    asyncio.run(through_pool())


@pytest.fixture
def tls_server(security: Security) -> Any:
    server, loop, thread = _serve(security)
    yield server
    _stop(server, loop, thread)


# ------------------------------------------------------------------------ comm level


def test_tls_round_trip_async_and_blocking(security: Security, tls_server: DataServer) -> None:
    """A big array crosses TLS intact both ways, through the asyncio pool (decrypted
    straight into the frame buffers) and through a blocking SSLSocket."""
    assert tls_server.address is not None and tls_server.address.startswith("tls://")
    array = np.random.default_rng(0).random(3_000_000)  # 24 MB

    async def through_pool() -> Any:
        pool = ConnectionPool(SECRET, tls=security.client_context())
        try:
            replies = []
            for _ in range(2):  # the second reuses the pooled connection
                _, frames = await pool.rpc(tls_server.address, {"op": "x"}, serialize(array))
                replies.append(deserialize(frames))
            return replies
        finally:
            await pool.close()

    for got in asyncio.run(through_pool()):
        np.testing.assert_array_equal(got, array)
    conn = BlockingConnection(tls_server.address, SECRET, tls=security.client_context())
    try:
        header, frames = conn.rpc({"op": "y"}, serialize(array))
    finally:
        conn.close()
    assert header == {"status": "ok", "op": "y"}
    np.testing.assert_array_equal(deserialize(frames), array)
    assert tls_server.n_accepted == 2


def test_plaintext_peer_is_refused_and_the_server_goes_on(
    security: Security, tls_server: DataServer, caplog: pytest.LogCaptureFixture
) -> None:
    host, port = parse_address(tls_server.address or "")
    with caplog.at_level(logging.WARNING, logger="redisdask.comm"):
        # a stranger speaking plaintext: the server answers nothing it could read, and hangs up
        with socket.create_connection((host, port), timeout=10) as raw:
            raw.sendall(b"RDK1" + bytes(64))
            received = b""
            while chunk := raw.recv(4096):
                received += chunk
        assert b"RDK1" not in received  # no handshake hello in the clear
        # our own client without TLS settings refuses a tls:// address before connecting
        with pytest.raises(CommClosedError, match=r"accepts only TLS.*comm.tls.ca-file"):
            BlockingConnection(tls_server.address or "", SECRET)
        # the server logs it just after it hung up
        poll(lambda: "does not speak TLS" in caplog.text)
    # and the server still serves TLS peers
    conn = BlockingConnection(tls_server.address or "", SECRET, tls=security.client_context())
    assert conn.rpc({"op": "after"})[0]["op"] == "after"
    conn.close()


def test_tls_client_refuses_a_plaintext_server(security: Security) -> None:
    server, loop, thread = _serve(None)
    try:
        address = server.address or ""
        assert address.startswith("tcp://")
        with pytest.raises(CommClosedError, match="refusing to send data in the clear"):
            BlockingConnection(address, SECRET, tls=security.client_context())
        # a tls:// address that in truth is a plaintext server: the TLS handshake says so
        lying = address.replace("tcp://", "tls://")
        with pytest.raises(CommClosedError, match="does not speak TLS"):
            BlockingConnection(lying, SECRET, tls=security.client_context(), timeout=5)

        with pytest.raises(CommClosedError, match="does not speak TLS"):
            _pool_rpc(lying, security)
    finally:
        _stop(server, loop, thread)


def test_certificate_of_another_ca_is_refused(
    stranger: Security, tls_server: DataServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="redisdask.comm"):
        with pytest.raises(CommClosedError, match="certificate"):
            BlockingConnection(tls_server.address or "", SECRET, tls=stranger.client_context())

        with pytest.raises(CommClosedError, match="certificate"):
            _pool_rpc(tls_server.address or "", stranger)
        poll(lambda: "TLS with" in caplog.text and "dropping it" in caplog.text)
    assert tls_server.n_accepted == 0


def test_an_expired_certificate_is_refused_and_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker whose certificate expired (from the cluster's own CA): its peers refuse
    it both ways, with the reason, and the server keeps serving."""
    ca = trustme.CA()
    good = _write(ca, tmp_path / "good")
    past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=1)
    old = ca.issue_cert("127.0.0.1", not_before=past - datetime.timedelta(days=30), not_after=past)
    old.cert_chain_pems[0].write_to_path(str(tmp_path / "old.pem"))
    old.private_key_pem.write_to_path(str(tmp_path / "old-key.pem"))
    expired = Security(good.tls_ca_file, tmp_path / "old.pem", tmp_path / "old-key.pem")
    # its server: a peer with a good certificate refuses it
    server, loop, thread = _serve(expired)
    try:
        with pytest.raises(CommClosedError, match="certificate has expired"):
            BlockingConnection(server.address or "", SECRET, tls=good.client_context())
    finally:
        _stop(server, loop, thread)
    # as a client: a server with a good certificate refuses it, says why, and goes on
    server, loop, thread = _serve(good)
    try:
        with caplog.at_level(logging.WARNING, logger="redisdask.comm"):
            with pytest.raises(CommClosedError):
                _pool_rpc(server.address or "", expired)
            poll(lambda: "certificate has expired" in caplog.text)
        conn = BlockingConnection(server.address or "", SECRET, tls=good.client_context())
        assert conn.rpc({"op": "after"})[0]["op"] == "after"
        conn.close()
        assert server.n_accepted == 1
    finally:
        _stop(server, loop, thread)


def test_bad_tls_files_are_named(security: Security, tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(TLSSetupError, match=r"key \(comm.tls.key\).*nope.pem"):
        Security(security.tls_ca_file, security.tls_cert, missing)
    with pytest.raises(TLSSetupError, match="needs both a CA file and a certificate"):
        Security(tls_cert=security.tls_cert, tls_key=security.tls_key)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(TLSSetupError, match=r"garbage\.pem"):
        Security(security.tls_ca_file, garbage, security.tls_key)
    assert not Security().enabled


# ------------------------------------------------------------------ real processes


def _where(x: Any) -> str:
    from redisdask import get_worker

    return get_worker().address


def _total(a: Any, b: Any) -> float:
    return float(a.sum() + b.sum())


def test_local_cluster_over_tls(security: Security, make_cluster: ClusterFactory) -> None:
    """Workers serve tls:// addresses, move dependencies to each other and hand a client a
    big array over TLS; a plaintext stranger is dropped and the worker stays healthy."""
    with (
        make_cluster(n_workers=2, nanny=False, security=security) as cluster,
        Client(cluster) as client,
    ):  # fmt: skip
        workers = sorted(client.scheduler_info()["workers"])
        assert len(workers) == 2 and all(w.startswith("tls://") for w in workers)
        size = 5_000_000  # 40 MB each
        a = client.submit(np.ones, size, workers=[workers[0]], pure=False)
        b = client.submit(np.full, size, 2.0, workers=[workers[1]], pure=False)
        # needs a on workers[1]: a worker -> worker transfer over TLS
        total = client.submit(_total, a, b, workers=[workers[1]], pure=False)
        assert total.result(timeout=60) == 3.0 * size
        np.testing.assert_array_equal(client.gather(a), np.ones(size))
        # a plaintext connection to the TLS worker: dropped
        host, port = parse_address(workers[0])
        with socket.create_connection((host, port), timeout=10) as raw:
            raw.sendall(b"GET / HTTP/1.0\r\n\r\n")
            while raw.recv(4096):
                pass
        # the worker goes on serving (a new connection: the client's pool had one)
        assert client.submit(_where, a, workers=[workers[0]], pure=False).result(30) == workers[0]
        assert client.run(lambda: 1) == dict.fromkeys(workers, 1)  # blocking TLS connections
        # a client without TLS settings says what is missing instead of hanging
        with Client(cluster, security=Security(), set_as_default=False) as plain:
            big = plain.submit(np.ones, 100_000, workers=[workers[0]], pure=False)  # not inline
            with pytest.raises(Exception, match="accepts only TLS"):
                plain.gather(big)


def test_worker_with_missing_key_file_exits_with_a_clear_message(
    redis_url: str, cluster_name: str, security: Security, tmp_path: Path
) -> None:
    missing = str(tmp_path / "missing-key.pem")
    for nanny in ([], ["--no-nanny"]):
        proc = subprocess.run(
            [*command("worker", redis_url, "--cluster", cluster_name, *nanny),
             "--tls-ca-file", str(security.tls_ca_file), "--tls-cert", str(security.tls_cert),
             "--tls-key", missing],
            env=environment(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert "cannot read the TLS key (comm.tls.key)" in proc.stderr
        assert "missing-key.pem" in proc.stderr
        assert "Traceback" not in proc.stderr
