"""Peer-to-peer data transport: worker <-> worker and client <-> worker.

Results never travel through Redis; they travel over these TCP connections.
The module is layered h11-style: a sans-I/O core (framing, handshake, serialization)
made of pure functions and a byte-fed state machine, with thin asyncio and blocking
socket wrappers on top.

Wire format (all integers little-endian)::

    +-----------+-----------+-----------+-----+-----------+---------+---------+-----+
    | u32       | u64       | u64       | ... | u64       | frame 0 | frame 1 | ... |
    | nframes=N | len(f0)   | len(f1)   |     | len(fN-1) | header  | payload |     |
    +-----------+-----------+-----------+-----+-----------+---------+---------+-----+

Frame 0 is the header: a small msgpack-encoded dict (decoding it never unpickles).
Frames 1..N-1 are opaque payload bytes, typically the output of :func:`serialize`:
a cloudpickle protocol-5 stream followed by its out-of-band buffers (numpy data travels
without copies).  Limits (:class:`Limits`): header <= 1 MiB, N <= 10 000; anything else
raises :class:`ProtocolError` and the connection is dropped.

Handshake (mutual HMAC-SHA256 over a shared cluster secret), before any framing::

    server -> client   "RDK1" | server_nonce[32]                                  36 B
    client -> server   "RDK1" | client_nonce[32]
                       | HMAC(secret, b"client" + server_nonce + client_nonce)    68 B
    server -> client   HMAC(secret, b"server" + client_nonce + server_nonce)      32 B

The server verifies with :func:`hmac.compare_digest` and closes the connection on any
mismatch, malformed bytes or timeout (logged at WARNING with the peer address; never
the secret).  Only fixed-size raw byte strings are read before authentication: nothing
unauthenticated is ever msgpack-decoded, let alone unpickled.

Deadlines (``comm.timeouts.*``): a peer that moves no byte for ``dead_after`` seconds
while a reply is awaited, or mid-message either way, is dead (:class:`PeerTimeoutError`);
every peer socket has TCP keepalive and ``TCP_USER_TIMEOUT`` of that length.  A
:class:`DataServer` closes connections idle for ``idle_timeout`` and holds at most
``max_connections``.  A frame bigger than ``FRAME_RESERVE`` is reserved as it arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import hmac
import logging
import mmap
import os
import pickle
import socket
import ssl
import struct
import threading
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import msgpack

from redisdask import errors, pickling

logger = logging.getLogger(__name__)

Buffer: TypeAlias = bytes | bytearray | memoryview | pickle.PickleBuffer
Header: TypeAlias = dict[str, Any]
Message: TypeAlias = tuple[Header, list[memoryview]]
Handler: TypeAlias = Callable[
    [Header, list[memoryview]], Awaitable[tuple[Header, Sequence[Buffer]]]
]

MAGIC = b"RDK1"
NONCE_SIZE = 32
MAC_SIZE = 32
SERVER_HELLO_SIZE = len(MAGIC) + NONCE_SIZE
CLIENT_ANSWER_SIZE = len(MAGIC) + NONCE_SIZE + MAC_SIZE
SERVER_PROOF_SIZE = MAC_SIZE
DEFAULT_TIMEOUT = 5.0
# a peer that moves no byte for this long while we wait on it is dead (comm.timeouts.tcp)
DEFAULT_DEAD_AFTER = 30.0
DEFAULT_IDLE_TIMEOUT = 300.0  # a data server closes connections idle this long
DEFAULT_MAX_CONNECTIONS = 1000  # authenticated connections one data server holds open

COALESCE_LIMIT = 64 * 1024  # smaller buffers are joined into one send
DIRECT_READ_THRESHOLD = 64 * 1024  # larger frame remainders are recv'd in place
SCRATCH_SIZE = 256 * 1024
MMAP_THRESHOLD = 1 << 20  # frames this big get an anonymous mmap (no memset)

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


# --------------------------------------------------------------------------- errors


class CommError(errors.RedisDaskError):
    """Base class of every error raised by this module."""


class ProtocolError(CommError, errors.ProtocolError):
    """The peer sent bytes that do not follow the wire format."""


class AuthenticationError(CommError):
    """The mutual HMAC handshake failed."""


class CommClosedError(CommError, ConnectionError):
    """The connection is closed, could not be opened, or broke mid-way."""


class SecurityMismatchError(CommClosedError):
    """One side of a connection is set up for TLS, the other not: a configuration
    mistake that no retry mends."""


class SerializationError(CommError):
    """A value could not be (de)serialized; ``key`` names it when known."""

    def __init__(self, message: str, key: Hashable | None = None) -> None:
        super().__init__(message)
        self.key = key


# ------------------------------------------------------------------------ addresses


SCHEMES = ("tcp", "tls")  # tls: the peer speaks TLS (redisdask/security.py), then the rest


def parse_address(address: str) -> tuple[str, int]:
    """``"tcp://host:port"`` or ``"tls://host:port"`` (IPv6 as ``tcp://[::1]:port``) ->
    ``(host, port)``."""
    scheme, sep, rest = address.partition("://")
    host, colon, port = rest.rpartition(":")
    if scheme not in SCHEMES or not sep or not colon or not host or not port.isdigit():
        raise ValueError(f"invalid address {address!r}: expected 'tcp://host:port' or 'tls://...'")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def format_address(host: str, port: int, scheme: str = "tcp") -> str:
    """``(host, port)`` -> ``"tcp://host:port"`` (or ``tls://``)."""
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def check_scheme(address: str, tls: ssl.SSLContext | None) -> None:
    """Refuse to connect in the clear when we have TLS settings, or without TLS to a peer
    that requires it: either way the handshake would fail obscurely (or hang) later."""
    scheme = address.partition("://")[0]
    if scheme == "tls" and tls is None:
        raise SecurityMismatchError(
            f"{address} accepts only TLS connections and this process has no TLS settings: "
            "give it the cluster's CA, a certificate and its key (config comm.tls.ca-file, "
            "comm.tls.cert, comm.tls.key; redisdask worker --tls-ca-file/--tls-cert/--tls-key; "
            "Client(security=Security(...)))"
        )
    if scheme == "tcp" and tls is not None:
        raise SecurityMismatchError(
            f"refusing to send data in the clear to {address}: this process is set up for "
            "TLS (comm.tls.*), that worker is not. Start every worker of the cluster with "
            "the same TLS settings"
        )


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


# -------------------------------------------------------------------- serialization


def serialize(obj: Any) -> list[Buffer]:
    """Pickle ``obj`` (protocol 5, cloudpickle where needed); big buffers come out-of-band,
    uncopied."""
    buffers: list[pickle.PickleBuffer] = []
    try:
        head = pickling.dumps(obj, buffer_callback=buffers.append)
    except Exception as exc:
        raise SerializationError(
            f"cannot serialize object of type {type(obj).__qualname__}: {exc}"
        ) from exc
    return [head, *(buf.raw() for buf in buffers)]


def deserialize(frames: Sequence[Buffer]) -> Any:
    """Inverse of :func:`serialize`.  Only call on frames from an authenticated peer."""
    if not frames:
        raise SerializationError("no frames to deserialize")
    try:
        return pickle.loads(frames[0], buffers=frames[1:])
    except Exception as exc:
        raise SerializationError(f"cannot deserialize: {type(exc).__name__}: {exc}") from exc


def serialize_dict(
    data: Mapping[Hashable, Any],
) -> tuple[Header, list[Buffer], dict[Hashable, SerializationError]]:
    """Serialize ``{key: value}`` into one message body; failures are per key.

    Returns ``(header, frames, errors)``.  ``header`` is
    ``{"keys": [...], "ranges": [[start, stop], ...], "errors": [[key, msg], ...]}``
    where ``frames[start:stop]`` holds the value of the matching key; values that
    cannot be pickled are left out, reported in ``errors`` and in the header.
    """
    keys: list[Hashable] = []
    ranges: list[list[int]] = []
    frames: list[Buffer] = []
    errors: dict[Hashable, SerializationError] = {}
    for key, value in data.items():
        try:
            parts = serialize(value)
        except SerializationError as exc:
            errors[key] = SerializationError(f"key {key!r}: {exc}", key=key)
            continue
        keys.append(key)
        ranges.append([len(frames), len(frames) + len(parts)])
        frames.extend(parts)
    failed = [[key, str(err)] for key, err in errors.items()]
    return {"keys": keys, "ranges": ranges, "errors": failed}, frames, errors


def _as_key(key: Any) -> Hashable:
    """msgpack turns tuple keys into lists; turn them back."""
    return tuple(_as_key(k) for k in key) if isinstance(key, list) else key


def deserialize_dict(
    header: Header, frames: Sequence[Buffer]
) -> tuple[dict[Hashable, Any], dict[Hashable, SerializationError]]:
    """Inverse of :func:`serialize_dict`: ``(values, errors)``, errors keyed by key."""
    try:
        pairs = list(zip(header["keys"], header["ranges"], strict=True))
        failed = header.get("errors", [])
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed dict header: {exc}") from exc
    values: dict[Hashable, Any] = {}
    errors = {_as_key(k): SerializationError(str(msg), key=_as_key(k)) for k, msg in failed}
    for raw_key, (start, stop) in pairs:
        key = _as_key(raw_key)
        if not 0 <= start < stop <= len(frames):
            raise ProtocolError(f"frame range {start}:{stop} of key {key!r} out of bounds")
        try:
            values[key] = deserialize(frames[start:stop])
        except SerializationError as exc:
            errors[key] = SerializationError(f"key {key!r}: {exc}", key=key)
    return values, errors


# -------------------------------------------------------------------------- framing


# values per get-data/put-data message: a header of a thousand keys stays far below
# ``Limits.max_header_size`` (client gathers, scatters and worker fetches batch by it)
MAX_KEYS_PER_MESSAGE = 1000


@dataclass(frozen=True)
class Limits:
    """Sanity limits enforced on every received message."""

    max_header_size: int = 1 << 20
    # a value may carry many buffers (a DataFrame: one per column), so a message of a
    # thousand values may carry tens of thousands of frames; 8 bytes of length each
    max_frames: int = 500_000
    max_message_size: int = 1 << 40


DEFAULT_LIMITS = Limits()


def _byte_view(buf: Buffer) -> memoryview:
    view = buf.raw() if isinstance(buf, pickle.PickleBuffer) else memoryview(buf)
    if view.format == "B" and view.ndim == 1:
        return view
    if view.c_contiguous:
        return view.cast("B")
    return memoryview(view.tobytes())


def _coalesce(buffers: Sequence[memoryview], limit: int = COALESCE_LIMIT) -> list[Buffer]:
    """Join runs of small buffers (fewer syscalls); big ones pass through uncopied."""
    out: list[Buffer] = []
    small: list[memoryview] = []
    for buf in buffers:
        if buf.nbytes < limit:
            small.append(buf)
            continue
        if small:
            out.append(b"".join(small))
            small = []
        out.append(buf)
    if small:
        out.append(b"".join(small))
    return out


def encode_header(header: Header) -> bytes:
    try:
        return msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise SerializationError(f"header is not msgpack-encodable: {exc}") from exc


def decode_header(data: Buffer) -> Header:
    try:
        header = msgpack.unpackb(data, raw=False)
    except Exception as exc:
        raise ProtocolError(f"undecodable message header: {exc}") from exc
    if not isinstance(header, dict):
        raise ProtocolError(f"message header is a {type(header).__name__}, not a dict")
    return header


def encode_message(
    header: Header, frames: Sequence[Buffer] = (), limits: Limits = DEFAULT_LIMITS
) -> list[Buffer]:
    """Encode one message into buffers ready for ``sendall`` (payloads are not copied)."""
    head = encode_header(header)
    views = [memoryview(head), *(_byte_view(f) for f in frames)]
    if len(head) > limits.max_header_size or len(views) > limits.max_frames:
        raise ProtocolError(f"message too large: header {len(head)} B, {len(views)} frames")
    lengths = [v.nbytes for v in views]
    prefix = _U32.pack(len(views)) + struct.pack(f"<{len(views)}Q", *lengths)
    return _coalesce([memoryview(prefix), *views])


def local_ip() -> str:
    """This machine's address on the network that leads elsewhere (no packet is sent:
    connecting a UDP socket only picks the route); 127.0.0.1 without a network."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


class BufferCache:
    """Recycles big receive buffers: recv into warm pages is ~1.5x faster than into
    fresh ones (page faults dominate).  Each buffer is exposed through a ctypes array
    over a cached anonymous mmap and only returns to the cache once that exporter is
    garbage, i.e. once no memoryview or ndarray of it remains.  Lock-free (GC-safe).
    """

    def __init__(self, max_idle_bytes: int = 256 << 20) -> None:
        self.max_idle_bytes = max_idle_bytes
        self.idle_bytes = 0
        self._free: dict[int, list[mmap.mmap]] = {}

    @staticmethod
    def size_class(size: int) -> int:
        """Round up to 1 MiB, then to quarter steps of powers of two (<= 25% slack)."""
        step = max(MMAP_THRESHOLD, 1 << max(size.bit_length() - 3, 0))
        return -(-size // step) * step

    def allocate(self, size: int) -> memoryview:
        capacity = self.size_class(size)
        return self.export(self._take(capacity) or mmap.mmap(-1, capacity), size)

    def export(self, area: mmap.mmap, size: int) -> memoryview:
        """The first ``size`` bytes of ``area`` (its length a size class), which returns
        to the cache once nothing refers to them."""
        exporter = (ctypes.c_char * len(area)).from_buffer(area)
        weakref.finalize(exporter, self._release, area)
        return memoryview(exporter).cast("B")[:size]

    def _take(self, capacity: int) -> mmap.mmap | None:
        try:
            area = self._free.get(capacity, []).pop()
        except IndexError:
            return None
        self.idle_bytes -= len(area)
        return area

    def clear(self) -> int:
        """Give the idle buffers back to the OS (under memory pressure); bytes freed."""
        freed, self.idle_bytes = self.idle_bytes, 0
        areas, self._free = self._free, {}
        for group in areas.values():
            for area in group:
                area.close()
        return freed

    def _release(self, area: mmap.mmap) -> None:
        if self.idle_bytes + len(area) <= self.max_idle_bytes:
            self.idle_bytes += len(area)
            self._free.setdefault(len(area), []).append(area)


BUFFER_CACHE = BufferCache()


def _allocate(size: int) -> memoryview:
    if size >= MMAP_THRESHOLD:
        return BUFFER_CACHE.allocate(size)
    return memoryview(bytearray(size))


# a frame is given at most this much memory before its bytes arrive (then twice what
# has arrived): a header announcing 10 GB that sends nothing costs no 10 GB
FRAME_RESERVE = 64 << 20


def _growable(size: int) -> mmap.mmap:
    # private: a shared anonymous mapping is a shmem file of fixed size, and the pages
    # that mremap adds beyond it raise SIGBUS when touched
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)


class _GrowingFrame:
    """The buffer of a frame bigger than ``FRAME_RESERVE``: ``FRAME_RESERVE`` at first,
    doubled each time it fills (``mremap``: the pages move, no byte is copied), up to
    the frame's size class.  An idle cached buffer of the full size is used at once."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.capacity = BufferCache.size_class(size)
        self.area = BUFFER_CACHE._take(self.capacity) or _growable(FRAME_RESERVE)

    def view(self) -> memoryview:
        return memoryview(self.area)[: min(len(self.area), self.size)]

    def grow(self, view: memoryview) -> memoryview:
        """``view`` is full: a view of the grown buffer (its start holds the same bytes)."""
        length = len(self.area)
        new = self.capacity if 2 * length >= self.size else 2 * length
        view.release()
        try:
            self.area.resize(new)
        except BufferError:  # a slice of it is still alive somewhere: copy instead
            bigger = _growable(new)
            bigger[:length] = self.area
            self.area = bigger
        return self.view()

    def finish(self, view: memoryview) -> memoryview:
        view.release()
        return BUFFER_CACHE.export(self.area, self.size)


_PREFIX, _LENGTHS, _FRAME = "prefix", "lengths", "frame"


class MessageReader:
    """Byte-fed decoder state machine: ``feed`` bytes, then pop ``next_message()``.

    For zero-copy I/O, ask ``next_buffer()`` for the memoryview to ``recv_into`` (the
    frame being filled, when a big part of it is missing, else an internal scratch
    buffer) and report the byte count with ``received(n)``.
    """

    def __init__(self, limits: Limits = DEFAULT_LIMITS) -> None:
        self._limits = limits
        self._ready: deque[Message] = deque()
        self._scratch = memoryview(bytearray(SCRATCH_SIZE))
        self._direct = False
        self._start_message()

    def _start_message(self) -> None:
        self._stage = _PREFIX
        self._target = memoryview(bytearray(_U32.size))
        self._pos = 0
        self._lengths: list[int] = []
        self._frames: list[memoryview] = []
        self._growing: _GrowingFrame | None = None

    @property
    def in_message(self) -> bool:
        """True when part of a message has been received."""
        return self._stage != _PREFIX or self._pos > 0

    def next_message(self) -> Message | None:
        return self._ready.popleft() if self._ready else None

    @property
    def ready(self) -> int:
        """Messages received and not yet taken."""
        return len(self._ready)

    def feed(self, data: Buffer) -> None:
        view = _byte_view(data)
        while view.nbytes:
            room = self._target[self._pos :]
            k = min(room.nbytes, view.nbytes)
            room[:k] = view[:k]
            view = view[k:]
            self._advance(k)

    def next_buffer(self) -> memoryview:
        remaining = self._target.nbytes - self._pos
        self._direct = self._stage == _FRAME and remaining >= DIRECT_READ_THRESHOLD
        return self._target[self._pos :] if self._direct else self._scratch

    def received(self, n: int) -> None:
        if self._direct:
            self._advance(n)
        else:
            self.feed(self._scratch[:n])

    def _advance(self, n: int) -> None:
        self._pos += n
        while self._pos == self._target.nbytes:
            growing = self._growing
            if growing is not None and self._pos < growing.size:
                self._target = growing.grow(self._target)
            else:
                self._complete_stage()

    def _complete_stage(self) -> None:
        if self._stage == _PREFIX:
            (nframes,) = _U32.unpack(self._target)
            if not 1 <= nframes <= self._limits.max_frames:
                raise ProtocolError(f"bad frame count {nframes}")
            self._stage, self._target, self._pos = _LENGTHS, _allocate(8 * nframes), 0
        elif self._stage == _LENGTHS:
            self._lengths = list(struct.unpack(f"<{self._target.nbytes // 8}Q", self._target))
            self._check_lengths(self._lengths)
            self._stage = _FRAME
            self._begin_frame()
        else:
            if self._growing is not None:
                self._target, self._growing = self._growing.finish(self._target), None
            self._frames.append(self._target)
            if len(self._frames) == len(self._lengths):
                header = decode_header(self._frames[0])
                self._ready.append((header, self._frames[1:]))
                self._start_message()
            else:
                self._begin_frame()

    def _check_lengths(self, lengths: list[int]) -> None:
        if lengths[0] > self._limits.max_header_size:
            raise ProtocolError(f"header of {lengths[0]} bytes exceeds the limit")
        if sum(lengths) > self._limits.max_message_size:
            raise ProtocolError(f"message of {sum(lengths)} bytes exceeds the limit")

    def _begin_frame(self) -> None:
        size, self._pos = self._lengths[len(self._frames)], 0
        if size <= FRAME_RESERVE:
            self._target = _allocate(size)
        else:
            self._growing = _GrowingFrame(size)
            self._target = self._growing.view()


# ------------------------------------------------------------------------ handshake


def _mac(secret: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, label + first + second, hashlib.sha256).digest()


def _check_secret(secret: bytes) -> bytes:
    if not isinstance(secret, bytes) or not secret:
        raise TypeError("the cluster secret must be non-empty bytes")
    return secret


def server_hello(server_nonce: bytes) -> bytes:
    return MAGIC + server_nonce


def client_answer(secret: bytes, hello: bytes) -> tuple[bytes, bytes, bytes]:
    """Check the server hello; return ``(server_nonce, client_nonce, answer)``."""
    if len(hello) != SERVER_HELLO_SIZE or not hello.startswith(MAGIC):
        raise AuthenticationError("peer is not a redisdask data server (bad hello)")
    server_nonce, client_nonce = hello[len(MAGIC) :], os.urandom(NONCE_SIZE)
    mac = _mac(secret, b"client", server_nonce, client_nonce)
    return server_nonce, client_nonce, MAGIC + client_nonce + mac


def server_proof(secret: bytes, server_nonce: bytes, answer: bytes) -> bytes:
    """Verify the client's answer; return the server's proof to send back."""
    if len(answer) != CLIENT_ANSWER_SIZE or not answer.startswith(MAGIC):
        raise AuthenticationError("malformed handshake answer")
    client_nonce = answer[len(MAGIC) : len(MAGIC) + NONCE_SIZE]
    expected = _mac(secret, b"client", server_nonce, client_nonce)
    if not hmac.compare_digest(answer[len(MAGIC) + NONCE_SIZE :], expected):
        raise AuthenticationError("client MAC mismatch (wrong secret?)")
    return _mac(secret, b"server", client_nonce, server_nonce)


def check_server_proof(
    secret: bytes, server_nonce: bytes, client_nonce: bytes, proof: bytes
) -> None:
    expected = _mac(secret, b"server", client_nonce, server_nonce)
    if not hmac.compare_digest(proof, expected):
        raise AuthenticationError("server MAC mismatch (wrong secret?)")


# --------------------------------------------------------------------- asyncio I/O


KEEPALIVE_PROBES = 10


def _tune(sock: socket.socket, dead_after: float | None = DEFAULT_DEAD_AFTER) -> None:
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


class _PlainSocket:
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


class _TLSSocket:
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
    async def connect(cls, sock: socket.socket, tls: ssl.SSLContext, server: bool) -> _TLSSocket:
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
        view = _byte_view(buf)
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


PeerSocket: TypeAlias = _PlainSocket | _TLSSocket


async def _recv_exactly(sock: PeerSocket, n: int) -> bytes:
    buf = memoryview(bytearray(n))
    got = 0
    while got < n:
        k = await sock.recv_into(buf[got:])
        if k == 0:
            raise CommClosedError("connection closed by peer during handshake")
        got += k
    return bytes(buf)


class PeerTimeoutError(CommClosedError):
    """The peer moved no byte for longer than allowed (``comm.timeouts.tcp``): stopped,
    hung, or cut off; ``idle`` when no message had begun.  The connection is closed (a
    message may be half sent)."""

    def __init__(self, message: str, idle: bool = False) -> None:
        super().__init__(message)
        self.idle = idle


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
                view = _byte_view(buf)
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
                _tune(raw, dead_after)
                if tls is not None:
                    sock = await _TLSSocket.connect(raw, tls, server=False)
                else:
                    sock = _PlainSocket(raw)
                hello = await _recv_exactly(sock, SERVER_HELLO_SIZE)
                server_nonce, client_nonce, answer = client_answer(secret, hello)
                await sock.sendall(answer)
                try:
                    proof = await _recv_exactly(sock, SERVER_PROOF_SIZE)
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
        self._secret = _check_secret(secret)
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
                    sock = _PlainSocket(raw)
                else:
                    try:
                        sock = await _TLSSocket.connect(raw, self._tls, server=True)
                    except CommClosedError as exc:
                        logger.warning("TLS with %s failed: %s; dropping it", peer, exc)
                        return None
                server_nonce = os.urandom(NONCE_SIZE)
                await sock.sendall(server_hello(server_nonce))
                answer = await _recv_exactly(sock, CLIENT_ANSWER_SIZE)
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
        _tune(raw, self._dead_after)
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
        except ProtocolError as exc:
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
        except (SerializationError, ProtocolError) as exc:  # unencodable: say so instead
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
        self._secret = _check_secret(secret)
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


# ------------------------------------------------------------------- blocking I/O


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
            _tune(self._sock)
            if tls is not None:
                self._sock = self._wrap(tls)
            self._handshake(_check_secret(secret))
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
        self._secret = _check_secret(secret)
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
