"""``redisdask dashboard``: the web application on a socket, served by uvicorn until
SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import socket
import threading
from types import FrameType

import redis
import uvicorn

from redisdask.dashboard.app import build_app
from redisdask.store.bootstrap import known_clusters
from redisdask.store.connection import connect
from redisdask.store.keyspace import Keys
from redisdask.store.urls import redact

logger = logging.getLogger("redisdask.dashboard")


def run_dashboard(
    url: str,
    cluster: str,
    *,
    host: str,
    port: int,
    token: str | None,
    interval: float,
    connect_timeout: float,
) -> int:
    """Serve the dashboard of ``cluster`` on ``host:port`` (0: a free port, which the
    log line names); 0 when stopped, 1 when it cannot listen there."""
    try:
        sock = _listen(host, port)
    except OSError as exc:
        logger.error(
            "cannot serve the dashboard on %s:%d (%s): pass a free --port or another --host",
            host, port, exc,
        )  # fmt: skip
        return 1
    r = connect(url, timeout=connect_timeout, name=f"rd-{cluster}-dashboard", check=False)
    _say_if_unknown(r, cluster)
    stopping = threading.Event()
    app = build_app(r, cluster, url, token=token, interval=interval, stopping=stopping)
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    logger.info(
        "serving the dashboard of cluster %r at %s on http://%s:%d/status%s",
        cluster, redact(url), shown, bound, " (token required)" if token else "",
    )  # fmt: skip
    config = uvicorn.Config(
        app,
        log_config=None,  # its records go through this process's logging, in its format
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=5,
    )
    try:
        _Server(config, stopping).run(sockets=[sock])
    finally:
        r.close()
    return 0


def _say_if_unknown(r: redis.Redis, cluster: str) -> None:
    """A mistyped ``--cluster`` shows an empty cluster: say which ones this Redis holds."""
    try:
        if r.exists(Keys(cluster).meta):
            return
        others = known_clusters(r)
    except (redis.RedisError, OSError):
        return  # (the pages say why Redis cannot be read)
    logger.warning(
        "no cluster named %r in this Redis (yet); it holds %s", cluster, others or "none"
    )


class _Server(uvicorn.Server):
    """Ends the live pages' streams on SIGTERM or SIGINT, so the shutdown need not wait
    for their viewers to leave."""

    def __init__(self, config: uvicorn.Config, stopping: threading.Event) -> None:
        super().__init__(config)
        self.stopping = stopping

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.stopping.set()
        super().handle_exit(sig, frame)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock
