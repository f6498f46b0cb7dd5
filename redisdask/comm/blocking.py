"""Blocking client connections, for callers on plain threads without an event loop
(``client.run`` calls every worker from a thread pool, ``client/worker_calls.py``): the same
framing, handshake and TLS as the asyncio side, over a plain socket or an
``ssl.SSLSocket``.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from collections.abc import Sequence

from redisdask.comm.addressing import check_scheme, parse_address
from redisdask.comm.errors import (
    AuthenticationError,
    CommClosedError,
    CommError,
    SerializationError,
)
from redisdask.comm.frames import (
    DEFAULT_LIMITS,
    Buffer,
    Header,
    Limits,
    Message,
    MessageReader,
    encode_message,
)
from redisdask.comm.handshake import (
    SERVER_HELLO_SIZE,
    SERVER_PROOF_SIZE,
    check_secret,
    check_server_proof,
    client_answer,
)
from redisdask.comm.sockets import DEFAULT_TIMEOUT, describe_tls_error, tune_socket


def _recv_exactly_blocking(sock: socket.socket, n: int) -> bytes:
    buf = memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:])
        if k == 0:
            raise CommClosedError("connection closed by peer during handshake")
        got += k
    return bytes(buf)


class BlockingConnection:
    """Synchronous client connection (a plain or, with ``tls``, an ``SSLSocket``; same
    codec and handshake).

    ``timeout`` bounds connecting, the handshake and every single socket operation.
    """

    def __init__(
        self,
        address: str,
        secret: bytes,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        limits: Limits = DEFAULT_LIMITS,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.address = address
        self._limits = limits
        self._reader = MessageReader(limits)
        check_scheme(address, tls)
        try:
            self._sock = socket.create_connection(parse_address(address), timeout=timeout)
        except OSError as exc:
            raise CommClosedError(f"could not connect to {address}: {exc}") from exc
        try:
            tune_socket(self._sock)
            if tls is not None:
                self._sock = self._wrap(tls)
            self._handshake(check_secret(secret))
        except BaseException:
            self._sock.close()
            raise

    def _wrap(self, tls: ssl.SSLContext) -> ssl.SSLSocket:
        try:
            return tls.wrap_socket(self._sock, server_side=False)
        except ssl.SSLError as exc:
            raise CommClosedError(f"{self.address}: {describe_tls_error(exc)}") from exc
        except OSError as exc:
            raise CommClosedError(f"TLS with {self.address} failed: {exc}") from exc

    def _handshake(self, secret: bytes) -> None:
        try:
            hello = _recv_exactly_blocking(self._sock, SERVER_HELLO_SIZE)
            server_nonce, client_nonce, answer = client_answer(secret, hello)
            self._sock.sendall(answer)
            try:
                proof = _recv_exactly_blocking(self._sock, SERVER_PROOF_SIZE)
            except CommClosedError as exc:
                raise AuthenticationError("server rejected our credentials") from exc
            check_server_proof(secret, server_nonce, client_nonce, proof)
        except AuthenticationError as exc:
            raise AuthenticationError(f"{self.address}: {exc}") from exc
        except ssl.SSLError as exc:
            raise CommClosedError(f"{self.address}: {describe_tls_error(exc)}") from exc
        except OSError as exc:
            raise CommClosedError(f"handshake with {self.address} failed: {exc}") from exc

    def rpc(self, header: Header, frames: Sequence[Buffer] = ()) -> Message:
        try:
            for buf in encode_message(header, frames, self._limits):
                self._sock.sendall(buf)
            return self._recv()
        except SerializationError:
            raise  # nothing was sent; the connection is still in sync
        except CommError:
            self.close()
            raise
        except OSError as exc:
            self.close()
            raise CommClosedError(f"{self.address}: {exc}") from exc

    def _recv(self) -> Message:
        reader = self._reader
        while (message := reader.next_message()) is None:
            n = self._sock.recv_into(reader.next_buffer())
            if n == 0:
                raise CommClosedError(f"connection to {self.address} closed")
            reader.received(n)
        return message

    @property
    def closed(self) -> bool:
        return self._sock.fileno() == -1

    def close(self) -> None:
        self._sock.close()

    def abort(self) -> None:
        """Close from another thread: wakes a thread blocked on the socket at once
        (``close`` alone does not)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


class BlockingPool:
    """Thread-safe cache of :class:`BlockingConnection` keyed by address."""

    def __init__(
        self, secret: bytes, timeout: float = DEFAULT_TIMEOUT, *, tls: ssl.SSLContext | None = None
    ) -> None:
        self._secret = check_secret(secret)
        self.timeout = timeout
        self._tls = tls
        self._lock = threading.Lock()
        self._idle: dict[str, list[BlockingConnection]] = {}

    def rpc(self, address: str, header: Header, frames: Sequence[Buffer] = ()) -> Message:
        with self._lock:
            idle = self._idle.get(address)
            conn = idle.pop() if idle else None
        if conn is None:
            conn = BlockingConnection(address, self._secret, self.timeout, tls=self._tls)
        try:
            reply = conn.rpc(header, frames)
        except BaseException:
            conn.close()
            raise
        with self._lock:
            self._idle.setdefault(address, []).append(conn)
        return reply

    def close(self) -> None:
        with self._lock:
            conns = [c for cs in self._idle.values() for c in cs]
            self._idle.clear()
        for conn in conns:
            conn.close()
