"""Peer-to-peer data transport: worker <-> worker and client <-> worker.

Results never travel through Redis; they travel over these TCP (or TLS) connections.
The package is layered h11-style, each module importing only those above it here: a
sans-I/O core of pure functions and a byte-fed state machine, with thin asyncio and
blocking socket drivers on top.

==================  ==============================================================
``errors``          the transport's exceptions (under ``RedisDaskError``)
``addressing``      ``tcp://`` / ``tls://`` addresses; TLS settings vs scheme
``buffers``         recycled receive buffers; frames that grow as bytes arrive
``frames``          the wire format: :func:`encode_message`, :class:`MessageReader`
``serialize``       pickle-5 with out-of-band buffers; ``{key: value}`` bodies
``handshake``       the mutual HMAC handshake over the cluster secret
``sockets``         keepalive/``TCP_USER_TIMEOUT``; asyncio plain and TLS sockets
``connection``      :class:`AsyncConnection` with deadlines; :func:`open_connection`
``server``          :class:`DataServer`: accept, authenticate, answer requests
``pool``            :class:`ConnectionPool`: bounded, reused per address
``blocking``        :class:`BlockingConnection`, :class:`BlockingPool` (no loop)
==================  ==============================================================

The names below are the transport's API (``from redisdask import comm``;
``comm.ConnectionPool``), as ``distributed.comm`` re-exports its own.
"""

from __future__ import annotations

from redisdask.comm.addressing import SCHEMES, check_scheme, format_address, local_ip, parse_address
from redisdask.comm.blocking import BlockingConnection, BlockingPool
from redisdask.comm.buffers import BUFFER_CACHE, BufferCache
from redisdask.comm.connection import AsyncConnection, PeerConnection, open_connection
from redisdask.comm.errors import (
    AuthenticationError,
    CommClosedError,
    CommError,
    FramingError,
    PeerTimeoutError,
    SecurityMismatchError,
    SerializationError,
)
from redisdask.comm.frames import (
    DEFAULT_LIMITS,
    MAX_KEYS_PER_MESSAGE,
    Buffer,
    Header,
    Limits,
    Message,
    MessageReader,
    decode_header,
    encode_header,
    encode_message,
)
from redisdask.comm.pool import ConnectionPool
from redisdask.comm.serialize import deserialize, deserialize_dict, serialize, serialize_dict
from redisdask.comm.server import (
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DataServer,
    Handler,
)
from redisdask.comm.sockets import DEFAULT_DEAD_AFTER, DEFAULT_TIMEOUT, describe_tls_error

__all__ = [
    "BUFFER_CACHE",
    "DEFAULT_DEAD_AFTER",
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_LIMITS",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_TIMEOUT",
    "MAX_KEYS_PER_MESSAGE",
    "SCHEMES",
    "AsyncConnection",
    "AuthenticationError",
    "BlockingConnection",
    "BlockingPool",
    "Buffer",
    "BufferCache",
    "CommClosedError",
    "CommError",
    "ConnectionPool",
    "DataServer",
    "FramingError",
    "Handler",
    "Header",
    "Limits",
    "Message",
    "MessageReader",
    "PeerConnection",
    "PeerTimeoutError",
    "SecurityMismatchError",
    "SerializationError",
    "check_scheme",
    "decode_header",
    "describe_tls_error",
    "deserialize",
    "deserialize_dict",
    "encode_header",
    "encode_message",
    "format_address",
    "local_ip",
    "open_connection",
    "parse_address",
    "serialize",
    "serialize_dict",
]
