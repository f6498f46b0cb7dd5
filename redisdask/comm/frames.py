"""The wire format: messages to bytes and bytes to messages, sans I/O.

Wire format (all integers little-endian)::

    +-----------+-----------+-----------+-----+-----------+---------+---------+-----+
    | u32       | u64       | u64       | ... | u64       | frame 0 | frame 1 | ... |
    | nframes=N | len(f0)   | len(f1)   |     | len(fN-1) | header  | payload |     |
    +-----------+-----------+-----------+-----+-----------+---------+---------+-----+

Frame 0 is the header: a small msgpack-encoded dict (decoding it never unpickles).
Frames 1..N-1 are opaque payload bytes, typically the output of
:func:`redisdask.comm.serialize.serialize`: a cloudpickle protocol-5 stream followed by
its out-of-band buffers (numpy data travels without copies).  Limits (:class:`Limits`):
header <= 1 MiB, N <= 500 000; anything else raises :class:`FramingError` and the
connection is dropped.  A frame bigger than ``buffers.FRAME_RESERVE`` is reserved as it
arrives (:mod:`redisdask.comm.buffers`).

:func:`encode_message` turns a message into buffers for ``sendall``; :class:`MessageReader`
is a byte-fed state machine that turns received bytes back into messages.  Both
connection kinds (asyncio and blocking) drive these.
"""

from __future__ import annotations

import pickle
import struct
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import msgpack

from redisdask.comm import buffers
from redisdask.comm.buffers import GrowingFrame, allocate
from redisdask.comm.errors import FramingError, SerializationError
from redisdask.utils.packing import packb

Buffer: TypeAlias = bytes | bytearray | memoryview | pickle.PickleBuffer
Header: TypeAlias = dict[str, Any]
Message: TypeAlias = tuple[Header, list[memoryview]]

COALESCE_LIMIT = 64 * 1024  # smaller buffers are joined into one send
DIRECT_READ_THRESHOLD = 64 * 1024  # larger frame remainders are recv'd in place
SCRATCH_SIZE = 256 * 1024

_U32 = struct.Struct("<I")


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


def byte_view(buf: Buffer) -> memoryview:
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
        return packb(header)
    except (TypeError, ValueError, OverflowError) as exc:
        raise SerializationError(f"header is not msgpack-encodable: {exc}") from exc


def decode_header(data: Buffer) -> Header:
    try:
        header = msgpack.unpackb(data, raw=False)
    except Exception as exc:
        raise FramingError(f"undecodable message header: {exc}") from exc
    if not isinstance(header, dict):
        raise FramingError(f"message header is a {type(header).__name__}, not a dict")
    return header


def encode_message(
    header: Header, frames: Sequence[Buffer] = (), limits: Limits = DEFAULT_LIMITS
) -> list[Buffer]:
    """Encode one message into buffers ready for ``sendall`` (payloads are not copied)."""
    head = encode_header(header)
    views = [memoryview(head), *(byte_view(f) for f in frames)]
    if len(head) > limits.max_header_size or len(views) > limits.max_frames:
        raise FramingError(f"message too large: header {len(head)} B, {len(views)} frames")
    lengths = [v.nbytes for v in views]
    prefix = _U32.pack(len(views)) + struct.pack(f"<{len(views)}Q", *lengths)
    return _coalesce([memoryview(prefix), *views])


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
        self._growing: GrowingFrame | None = None

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
        view = byte_view(data)
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
                raise FramingError(f"bad frame count {nframes}")
            self._stage, self._target, self._pos = _LENGTHS, allocate(8 * nframes), 0
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
            raise FramingError(f"header of {lengths[0]} bytes exceeds the limit")
        if sum(lengths) > self._limits.max_message_size:
            raise FramingError(f"message of {sum(lengths)} bytes exceeds the limit")

    def _begin_frame(self) -> None:
        size, self._pos = self._lengths[len(self._frames)], 0
        if size <= buffers.FRAME_RESERVE:
            self._target = allocate(size)
        else:
            self._growing = GrowingFrame(size)
            self._target = self._growing.view()


# ------------------------------------------------------------------------ handshake
