"""The asyncio client's pool of authenticated connections, reused per address and
bounded in number: what the client and workers use to fetch and send data.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Sequence

from redisdask.comm.connection import PeerConnection, open_connection
from redisdask.comm.errors import CommClosedError
from redisdask.comm.frames import DEFAULT_LIMITS, Buffer, Header, Limits, Message
from redisdask.comm.handshake import check_secret
from redisdask.comm.sockets import DEFAULT_DEAD_AFTER, DEFAULT_TIMEOUT


class ConnectionPool:
    """Bounded pool of authenticated connections, reused per address."""

    def __init__(
        self,
        secret: bytes,
        limit: int = 50,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        limits: Limits = DEFAULT_LIMITS,
        tls: ssl.SSLContext | None = None,
        dead_after: float | None = DEFAULT_DEAD_AFTER,
    ) -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self._secret = check_secret(secret)
        self._tls = tls
        self.limit = limit
        self.timeout = timeout
        self.dead_after = dead_after  # a peer silent this long mid-request is dead
        self._limits = limits
        self._idle: dict[str, list[PeerConnection]] = {}
        self._waiters: list[asyncio.Future[None]] = []
        self.n_open = 0
        self._closed = False

    async def rpc(self, address: str, header: Header, frames: Sequence[Buffer] = ()) -> Message:
        """Send one request to ``address`` and return its ``(header, frames)`` reply;
        :class:`PeerTimeoutError` once the peer moves no byte for ``dead_after``."""
        conn = await self._acquire(address)
        ok = False
        try:
            await conn.send(header, frames)
            reply = await conn.recv()
            ok = True
            return reply
        except CommClosedError:
            raise
        except OSError as exc:
            raise CommClosedError(f"{address}: {exc}") from exc
        finally:
            self._release(conn, ok)

    async def _acquire(self, address: str) -> PeerConnection:
        while True:
            if self._closed:
                raise CommClosedError("connection pool is closed")
            idle = self._idle.get(address)
            if idle:
                conn = idle.pop()
                if not conn.stale:
                    return conn
                conn.close()
                self.n_open -= 1
                continue
            if self.n_open >= self.limit and not self._evict_idle():
                waiter = asyncio.get_running_loop().create_future()
                self._waiters.append(waiter)
                try:
                    await waiter
                finally:
                    with contextlib.suppress(ValueError):
                        self._waiters.remove(waiter)
                continue
            self.n_open += 1
            try:
                return await open_connection(
                    address,
                    self._secret,
                    timeout=self.timeout,
                    limits=self._limits,
                    tls=self._tls,
                    dead_after=self.dead_after,
                )
            except BaseException:
                self.n_open -= 1
                self._wake()
                raise

    def _evict_idle(self) -> bool:
        """Close one idle connection (any address) to make room; False if none."""
        for conns in self._idle.values():
            if conns:
                conns.pop(0).close()
                self.n_open -= 1
                return True
        return False

    def _release(self, conn: PeerConnection, ok: bool) -> None:
        if ok and not self._closed:
            self._idle.setdefault(conn.peer, []).append(conn)
        else:
            conn.close()
            self.n_open -= 1
        self._wake()

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def close(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
                self.n_open -= 1
        self._idle.clear()
        self._wake()
