"""An authenticated asyncio connection (:class:`AsyncConnection`) and the client side
that opens one (:func:`open_connection`).

Deadlines (``comm.timeouts.*``): a peer that moves no byte for ``dead_after`` seconds
while a reply is awaited, or mid-message either way, is dead (:class:`PeerTimeoutError`).
The deadline is on progress, not on the whole exchange: a long transfer that keeps
moving is never cut.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Sequence
from typing import TypeAlias

from redisdask.comm.addressing import check_scheme, parse_address
from redisdask.comm.errors import AuthenticationError, CommClosedError, PeerTimeoutError
from redisdask.comm.frames import (
    DEFAULT_LIMITS,
    Buffer,
    Header,
    Limits,
    Message,
    MessageReader,
    byte_view,
    encode_message,
)
from redisdask.comm.handshake import (
    SERVER_HELLO_SIZE,
    SERVER_PROOF_SIZE,
    check_server_proof,
    client_answer,
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

SEND_CHUNK = 4 << 20  # a big buffer is sent this much at a time: progress between chunks


class _Watchdog:
    """Cancels the task awaiting a peer once no byte has moved for ``timeout`` seconds.

    A deadline on progress, not on the whole exchange: a transfer of gigabytes that keeps
    moving is never cut.  One timer per ``timeout`` (rescheduled lazily from the time of
    the last progress), not one per ``recv``: the hot loop only stores a float."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self.last = self._loop.time()
        self.fired = False
        self._handle = self._loop.call_at(self.last + timeout, self._check)

    def progress(self) -> None:
        self.last = self._loop.time()

    def shorten(self, timeout: float) -> None:
        """From now on allow ``timeout`` (less than before) after the last progress."""
        self.timeout = timeout
        self._handle.cancel()
        self._handle = self._loop.call_at(self.last + timeout, self._check)

    def _check(self) -> None:
        due = self.last + self.timeout
        if self._loop.time() < due:
            self._handle = self._loop.call_at(due, self._check)
        elif self._task is not None:
            self.fired = True
            self._task.cancel()

    def stop(self) -> bool:
        """Stop watching; True when it fired and the task's cancellation was only ours
        (taken back now; the caller raises instead).  Idempotent."""
        self._handle.cancel()
        task, self._task = self._task, None
        return self.fired and task is not None and task.uncancel() == 0


class AsyncConnection:
    """An authenticated connection (plain TCP or TLS) speaking the message protocol.

    With ``dead_after`` (seconds), ``send`` and ``recv`` raise :class:`PeerTimeoutError`
    and close the connection when the peer moves no byte for that long."""

    def __init__(
        self,
        sock: PeerSocket,
        peer: str,
        limits: Limits = DEFAULT_LIMITS,
        *,
        dead_after: float | None = None,
    ) -> None:
        self.peer = peer
        self._sock = sock
        self._reader = MessageReader(limits)
        self._limits = limits
        self.dead_after = dead_after

    @property
    def closed(self) -> bool:
        return self._sock.closed

    @property
    def in_message(self) -> bool:
        """Part of a message has been received."""
        return self._reader.in_message

    @property
    def stale(self) -> bool:
        """Between requests a peer sends nothing: a readable socket means it closed
        (e.g. its idle timeout), sent garbage, or we are closed.  (Peeks the raw
        socket, under TLS too: nothing is consumed.)"""
        if self.closed or self._reader.in_message:
            return True
        try:
            socket.socket.recv(self._sock.sock, 1, socket.MSG_PEEK)
        except BlockingIOError:
            return False
        except OSError:
            return True
        return True

    async def send(self, header: Header, frames: Sequence[Buffer] = ()) -> None:
        buffers = encode_message(header, frames, self._limits)
        watch = self._watch(self.dead_after)
        try:
            for buf in buffers:
                view = byte_view(buf)
                for start in range(0, view.nbytes, SEND_CHUNK):
                    await self._sock.sendall(view[start : start + SEND_CHUNK])
                    if watch is not None:
                        watch.progress()
        except asyncio.CancelledError:
            self._timed_out(watch, "sending")
            raise
        finally:
            if watch is not None:
                watch.stop()

    async def recv(self, idle: float | None = None) -> Message:
        """The next message.  ``idle``: how long to wait for its first byte (default
        ``dead_after``); a server waiting for a request gives its idle timeout."""
        reader = self._reader
        waiting = self.dead_after if idle is None or reader.in_message else idle
        watch = self._watch(waiting)
        try:
            while (message := reader.next_message()) is None:
                n = await self._sock.recv_into(reader.next_buffer())
                if n == 0:
                    where = " mid-message" if reader.in_message else ""
                    raise CommClosedError(f"connection to {self.peer} closed{where}")
                reader.received(n)
                if watch is not None:
                    watch.progress()
                    if self.dead_after is not None and watch.timeout > self.dead_after:
                        watch.shorten(self.dead_after)  # a message began: the peer is busy
        except asyncio.CancelledError:
            self._timed_out(watch, "receiving" if reader.in_message else "waiting for")
            raise
        finally:
            if watch is not None:
                watch.stop()
        return message

    @staticmethod
    def _watch(timeout: float | None) -> _Watchdog | None:
        return None if timeout is None else _Watchdog(timeout)

    def _timed_out(self, watch: _Watchdog | None, doing: str) -> None:
        """After a cancellation: raise PeerTimeoutError if our watchdog caused it."""
        if watch is None or not watch.stop():
            return
        self.close()
        what = "a message" if doing != "sending" else "a message (it stopped reading)"
        raise PeerTimeoutError(
            f"{self.peer} moved no byte for {watch.timeout:g} s while {doing} {what}",
            idle=doing == "waiting for",
        ) from None

    def close(self) -> None:
        self._sock.close()


PeerConnection: TypeAlias = AsyncConnection


async def open_connection(
    address: str,
    secret: bytes,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    limits: Limits = DEFAULT_LIMITS,
    tls: ssl.SSLContext | None = None,
    dead_after: float | None = DEFAULT_DEAD_AFTER,
) -> PeerConnection:
    """Connect to ``address`` and run the client side of the handshake (inside TLS with
    ``tls``, which a ``tls://`` address needs and a ``tcp://`` one refuses).  The
    connection gives up on a peer silent for ``dead_after`` seconds (``AsyncConnection``)."""
    host, port = parse_address(address)
    check_scheme(address, tls)
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            family, kind, proto, _, addr = (
                await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            )[0]
            raw = socket.socket(family, kind, proto)
            sock: PeerSocket | None = None
            try:
                raw.setblocking(False)
                await loop.sock_connect(raw, addr)
                tune_socket(raw, dead_after)
                if tls is not None:
                    sock = await TLSSocket.connect(raw, tls, server=False)
                else:
                    sock = PlainSocket(raw)
                hello = await recv_exactly(sock, SERVER_HELLO_SIZE)
                server_nonce, client_nonce, answer = client_answer(secret, hello)
                await sock.sendall(answer)
                try:
                    proof = await recv_exactly(sock, SERVER_PROOF_SIZE)
                except CommClosedError as exc:
                    raise AuthenticationError(f"server rejected our credentials ({exc})") from exc
                check_server_proof(secret, server_nonce, client_nonce, proof)
            except BaseException:
                (sock or raw).close()
                raise
    except TimeoutError as exc:
        raise CommClosedError(f"timed out after {timeout}s connecting to {address}") from exc
    except AuthenticationError as exc:
        raise AuthenticationError(f"{address}: {exc}") from exc
    except CommClosedError as exc:
        raise CommClosedError(f"could not connect to {address}: {exc}") from exc
    except OSError as exc:
        raise CommClosedError(f"could not connect to {address}: {exc}") from exc
    return AsyncConnection(sock, address, limits, dead_after=dead_after)
