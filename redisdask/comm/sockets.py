"""The socket layer under every connection: kernel settings that detect a dead peer,
what a failed TLS handshake means, and the asyncio adapters that read and write a plain
or a TLS socket into and from the caller's own buffers (no copies).

Every peer socket gets TCP keepalive and ``TCP_USER_TIMEOUT`` of ``dead_after`` seconds
(``comm.timeouts.tcp``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
from collections.abc import Callable
from typing import Any, TypeAlias

from redisdask.comm.errors import CommClosedError
from redisdask.comm.frames import Buffer, byte_view

DEFAULT_TIMEOUT = 5.0
# a peer that moves no byte for this long while we wait on it is dead (comm.timeouts.tcp)
DEFAULT_DEAD_AFTER = 30.0


def describe_tls_error(exc: BaseException) -> str:
    """What a failed TLS handshake most likely means, and what to do about it."""
    reason = getattr(exc, "reason", None) or ""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (
            f"the peer's certificate was not accepted ({exc.verify_message}): it must be "
            "signed by the CA of comm.tls.ca-file and be valid now"
        )
    if reason in (
        "WRONG_VERSION_NUMBER",
        "UNKNOWN_PROTOCOL",
        "HTTP_REQUEST",
        "RECORD_LAYER_FAILURE",
    ):
        return (
            f"the peer does not speak TLS ({reason}): a process without the cluster's TLS "
            "settings (comm.tls.*)?"
        )
    if "ALERT" in reason or "CERTIFICATE" in reason:
        return (
            f"the peer refused our certificate ({reason}): is it signed by the CA the "
            "peer trusts (comm.tls.ca-file), and valid now?"
        )
    return f"TLS failed: {exc}"


KEEPALIVE_PROBES = 10


def tune_socket(sock: socket.socket, dead_after: float | None = DEFAULT_DEAD_AFTER) -> None:
    """No Nagle delay; and with ``dead_after`` (seconds, ``comm.timeouts.tcp``) the kernel
    gives up on a peer that stops acknowledging: keepalive probes on an idle connection
    and ``TCP_USER_TIMEOUT`` on unacknowledged data (Linux), as distributed does."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if dead_after is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        seconds = max(int(dead_after), KEEPALIVE_PROBES + 1)
        interval = max(1, seconds // (2 * KEEPALIVE_PROBES))
        idle = max(1, seconds - interval * KEEPALIVE_PROBES)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(dead_after * 1000))


class PlainSocket:
    """A connected non-blocking socket, read and written with asyncio's ``sock_*``."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._loop = asyncio.get_running_loop()

    async def recv_into(self, buf: memoryview) -> int:
        return await self._loop.sock_recv_into(self.sock, buf)

    async def sendall(self, buf: Buffer) -> None:
        await self._loop.sock_sendall(self.sock, buf)

    @property
    def closed(self) -> bool:
        return self.sock.fileno() == -1

    def close(self) -> None:
        self.sock.close()


TLS_WRITE_CHUNK = 1 << 20  # a big frame is handed to OpenSSL this much at a time


class TLSSocket:
    """A non-blocking ``ssl.SSLSocket`` driven from the event loop: OpenSSL decrypts
    straight into the buffer ``recv_into`` is given (a big frame's own, in place) and
    encrypts straight from the one ``sendall`` is given.  asyncio's SSL transport moves
    every byte through memory BIOs and a copy of its own, which made TLS transfers four
    to six times slower than plain TCP.

    A read or write waits only when OpenSSL says the socket must be readable
    (``SSLWantReadError``) or writable (``SSLWantWriteError``) first, either way round (a
    TLS 1.3 read may have to write); several waiters of one kind share one callback."""

    def __init__(self, sock: ssl.SSLSocket) -> None:
        self.sock = sock
        self._fd = sock.fileno()
        self._loop = asyncio.get_running_loop()
        self._waiters: dict[bool, list[asyncio.Future[None]]] = {False: [], True: []}

    @classmethod
    async def connect(cls, sock: socket.socket, tls: ssl.SSLContext, server: bool) -> TLSSocket:
        """TLS over the connected ``sock``; raises ``CommClosedError`` naming what failed."""
        # (peers are known by the cluster's CA, not by host names: no hostname check)
        wrapped = tls.wrap_socket(sock, server_side=server, do_handshake_on_connect=False)
        self = cls(wrapped)
        try:
            await self._retry(wrapped.do_handshake)
        except ssl.SSLError as exc:
            # what the peer sent is read first: a close with unread bytes is a TCP reset,
            # which a plaintext peer would see as "reset" instead of the end
            with contextlib.suppress(OSError):
                while os.read(self._fd, 1 << 16):
                    pass
            self.close()
            raise CommClosedError(describe_tls_error(exc)) from exc
        except BaseException:
            self.close()
            raise
        return self

    async def _retry(self, operation: Callable[[], Any]) -> Any:
        while True:
            try:
                return operation()
            except ssl.SSLWantReadError:
                await self._ready(writing=False)
            except ssl.SSLWantWriteError:
                await self._ready(writing=True)

    def _ready(self, writing: bool) -> asyncio.Future[None]:
        waiters = self._waiters[writing]
        if not waiters:
            watch = self._loop.add_writer if writing else self._loop.add_reader
            watch(self._fd, self._wake, writing)
        future = self._loop.create_future()
        waiters.append(future)
        return future

    def _wake(self, writing: bool) -> None:
        (self._loop.remove_writer if writing else self._loop.remove_reader)(self._fd)
        waiters, self._waiters[writing] = self._waiters[writing], []
        for future in waiters:
            if not future.done():
                future.set_result(None)

    async def recv_into(self, buf: memoryview) -> int:
        try:
            return int(await self._retry(lambda: self.sock.recv_into(buf)))
        except ssl.SSLZeroReturnError:  # the peer's close_notify
            return 0
        except ssl.SSLError as exc:
            raise CommClosedError(describe_tls_error(exc)) from exc

    async def sendall(self, buf: Buffer) -> None:
        view = byte_view(buf)
        sent = 0
        try:
            while sent < view.nbytes:
                # (after a WANT_WRITE OpenSSL needs the same bytes again: the same slice)
                chunk = view[sent : sent + TLS_WRITE_CHUNK]
                sent += await self._retry(lambda chunk=chunk: self.sock.send(chunk))
        except ssl.SSLError as exc:
            raise CommClosedError(describe_tls_error(exc)) from exc

    @property
    def closed(self) -> bool:
        return self._fd == -1 or self.sock.fileno() == -1

    def close(self) -> None:
        if self._fd != -1:
            self._loop.remove_reader(self._fd)
            self._loop.remove_writer(self._fd)
            for future in self._waiters[False] + self._waiters[True]:
                if not future.done():
                    future.set_exception(CommClosedError("connection closed"))
            self._fd = -1
        self.sock.close()


PeerSocket: TypeAlias = PlainSocket | TLSSocket


async def recv_exactly(sock: PeerSocket, n: int) -> bytes:
    buf = memoryview(bytearray(n))
    got = 0
    while got < n:
        k = await sock.recv_into(buf[got:])
        if k == 0:
            raise CommClosedError("connection closed by peer during handshake")
        got += k
    return bytes(buf)
