"""The data server: the side of a peer connection that accepts, authenticates and
answers requests (a worker's data port), with the limits that keep it alive under many
or misbehaving peers (``comm.timeouts.*``, ``comm.max-connections``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeAlias

from redisdask.comm.addressing import format_address, local_ip
from redisdask.comm.connection import AsyncConnection, PeerConnection
from redisdask.comm.errors import (
    AuthenticationError,
    CommClosedError,
    FramingError,
    PeerTimeoutError,
    SerializationError,
)
from redisdask.comm.frames import DEFAULT_LIMITS, Buffer, Header, Limits
from redisdask.comm.handshake import (
    CLIENT_ANSWER_SIZE,
    NONCE_SIZE,
    check_secret,
    server_hello,
    server_proof,
)
from redisdask.comm.sockets import (
    DEFAULT_DEAD_AFTER,
    DEFAULT_TIMEOUT,
    PeerSocket,
    PlainSocket,
    TLSSocket,
    recv_exactly,
    tune_socket,
)

logger = logging.getLogger(__name__)

Handler: TypeAlias = Callable[
    [Header, list[memoryview]], Awaitable[tuple[Header, Sequence[Buffer]]]
]

DEFAULT_IDLE_TIMEOUT = 300.0  # a data server closes connections idle this long
DEFAULT_MAX_CONNECTIONS = 1000  # authenticated connections one data server holds open


class DataServer:
    """Asyncio server: authenticates peers, then answers requests with ``handler``.

    With ``tls`` (a server context that requires the client's certificate) every
    connection is TLS first, then the HMAC handshake inside it; its address is
    ``tls://``.  A peer that fails either is dropped and logged; the server goes on.

    A connection that sends no request for ``idle_timeout`` seconds is closed, and so is
    one whose peer stops moving bytes mid-message for ``dead_after``.  At most
    ``max_connections`` are open: beyond, the oldest idle one is closed to make room, or
    (none idle) the new one is refused, logged once per episode."""

    def __init__(
        self,
        secret: bytes,
        handler: Handler,
        *,
        handshake_timeout: float = DEFAULT_TIMEOUT,
        limits: Limits = DEFAULT_LIMITS,
        tls: ssl.SSLContext | None = None,
        dead_after: float | None = DEFAULT_DEAD_AFTER,
        idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        self._secret = check_secret(secret)
        self._tls = tls
        self._handler = handler
        self._handshake_timeout = handshake_timeout
        self._limits = limits
        self._dead_after = dead_after
        self._idle_timeout = idle_timeout
        self.max_connections = max_connections
        self._full_logged = False
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # connections waiting for a request, oldest first: the ones to close when full
        self._waiting: dict[asyncio.Task[Any], AsyncConnection] = {}
        self.address: str | None = None
        self.n_connections = 0  # currently open authenticated connections
        self.n_accepted = 0  # authenticated connections ever

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=512)
        self._listener.setblocking(False)
        # listening on every interface: tell peers an address they can reach us at
        contact = local_ip() if host in ("0.0.0.0", "::", "") else host
        scheme = "tls" if self._tls is not None else "tcp"
        self.address = format_address(contact, self._listener.getsockname()[1], scheme)
        self._accept_task = asyncio.create_task(self._accept_loop())
        return self.address

    async def close(self) -> None:
        tasks = [t for t in [self._accept_task, *self._tasks] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                sock, addr = await loop.sock_accept(self._listener)
            except OSError as exc:  # e.g. EMFILE: back off, keep serving
                logger.warning("accept failed on %s: %s", self.address, exc)
                await asyncio.sleep(0.1)
                continue
            peer = format_address(*addr[:2])
            if not self._make_room(peer):
                sock.close()
                continue
            task = asyncio.create_task(self._serve(sock, peer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _make_room(self, peer: str) -> bool:
        """Below ``max_connections`` after closing the oldest idle connection if need be;
        False (logged once until there is room again) when every one is busy."""
        if len(self._tasks) < self.max_connections:
            self._full_logged = False
            return True
        for task, conn in self._waiting.items():
            if not conn.in_message:
                del self._waiting[task]
                task.cancel()  # (its _serve closes the socket)
                self._tasks.discard(task)
                return True
        if not self._full_logged:
            self._full_logged = True
            logger.warning(
                "%s holds %d connections, all busy (comm.max-connections): refusing %s "
                "and any more until one closes",
                self.address,
                len(self._tasks),
                peer,
            )
        return False

    async def _authenticate(self, raw: socket.socket, peer: str) -> PeerSocket | None:
        """TLS (with ``tls``), then the server side of the HMAC handshake; ``None`` (the
        socket closed, the reason logged) for a peer that fails either."""
        sock: PeerSocket | None = None
        try:
            async with asyncio.timeout(self._handshake_timeout):
                if self._tls is None:
                    sock = PlainSocket(raw)
                else:
                    try:
                        sock = await TLSSocket.connect(raw, self._tls, server=True)
                    except CommClosedError as exc:
                        logger.warning("TLS with %s failed: %s; dropping it", peer, exc)
                        return None
                server_nonce = os.urandom(NONCE_SIZE)
                await sock.sendall(server_hello(server_nonce))
                answer = await recv_exactly(sock, CLIENT_ANSWER_SIZE)
                await sock.sendall(server_proof(self._secret, server_nonce, answer))
                return sock
        except TimeoutError:
            slow = "TLS or HMAC handshake" if self._tls is not None else "handshake"
            logger.warning("%s with %s timed out; dropping it", slow, peer)
        except (AuthenticationError, CommClosedError, OSError) as exc:
            logger.warning("authentication of %s failed: %s; dropping it", peer, exc)
        except BaseException:
            (sock or raw).close()
            raise
        (sock or raw).close()
        return None

    async def _serve(self, raw: socket.socket, peer: str) -> None:
        raw.setblocking(False)
        tune_socket(raw, self._dead_after)
        sock = await self._authenticate(raw, peer)
        if sock is None:
            return
        self.n_connections += 1
        self.n_accepted += 1
        conn = AsyncConnection(sock, peer, self._limits, dead_after=self._dead_after)
        try:
            await self._request_loop(conn)
        finally:
            self.n_connections -= 1
            sock.close()

    async def _request_loop(self, conn: PeerConnection) -> None:
        task = asyncio.current_task()
        assert task is not None
        try:
            while True:
                self._waiting[task] = conn
                more = await self._serve_one(conn)
                if not more:
                    return
        finally:
            self._waiting.pop(task, None)

    async def _serve_one(self, conn: PeerConnection) -> bool:
        """One request and its reply; False when the connection ended.  (Its own frame,
        so that neither the request's nor the reply's data outlive it while the
        connection waits for the next request.)"""
        try:
            header, frames = await conn.recv(idle=self._idle_timeout)
        except FramingError as exc:
            logger.warning("protocol error from %s: %s; dropping it", conn.peer, exc)
            return False
        except PeerTimeoutError as exc:
            if exc.idle:  # no request for the idle timeout: tidying, not a fault
                logger.debug("closing the idle connection from %s: %s", conn.peer, exc)
            else:
                logger.warning("%s; dropping it", exc)
            return False
        except OSError as exc:
            logger.debug("connection from %s ended: %s", conn.peer, exc)
            return False
        self._waiting.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
        reply, reply_frames = await self._dispatch(header, frames)
        del frames
        try:
            await conn.send(reply, reply_frames)
        except (SerializationError, FramingError) as exc:  # unencodable: say so instead
            await conn.send({"status": "error", "message": f"bad reply: {exc}"})
        except PeerTimeoutError as exc:
            logger.warning("%s; dropping it", exc)
            return False
        except OSError as exc:
            logger.debug("connection from %s ended: %s", conn.peer, exc)
            return False
        return True

    async def _dispatch(
        self, header: Header, frames: list[memoryview]
    ) -> tuple[Header, Sequence[Buffer]]:
        try:
            return await self._handler(header, frames)
        except Exception as exc:
            logger.debug("handler failed on %r", header.get("op"), exc_info=True)
            return {"status": "error", "message": f"{type(exc).__name__}: {exc}"}, []
