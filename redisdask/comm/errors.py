"""The transport's exceptions, in one place so that every layer (framing, handshake,
sockets, connections) can raise them without importing the layers above it.

All sit under :class:`redisdask.errors.RedisDaskError` (the tree is drawn in
``redisdask/errors.py``).
"""

from __future__ import annotations

from collections.abc import Hashable

from redisdask import errors


class CommError(errors.RedisDaskError):
    """Base class of every error raised by ``redisdask.comm``."""


class FramingError(CommError, errors.ProtocolError):
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


class PeerTimeoutError(CommClosedError):
    """The peer moved no byte for longer than allowed (``comm.timeouts.tcp``): stopped,
    hung, or cut off; ``idle`` when no message had begun.  The connection is closed (a
    message may be half sent)."""

    def __init__(self, message: str, idle: bool = False) -> None:
        super().__init__(message)
        self.idle = idle
