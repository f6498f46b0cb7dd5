"""The mutual HMAC handshake that authenticates a peer before any framing, sans I/O.

Handshake (mutual HMAC-SHA256 over a shared cluster secret)::

    server -> client   "RDK1" | server_nonce[32]                                  36 B
    client -> server   "RDK1" | client_nonce[32]
                       | HMAC(secret, b"client" + server_nonce + client_nonce)    68 B
    server -> client   HMAC(secret, b"server" + client_nonce + server_nonce)      32 B

The server verifies with :func:`hmac.compare_digest` and closes the connection on any
mismatch, malformed bytes or timeout (logged at WARNING with the peer address; never
the secret).  Only fixed-size raw byte strings are read before authentication: nothing
unauthenticated is ever msgpack-decoded, let alone unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from redisdask.comm.errors import AuthenticationError

MAGIC = b"RDK1"
NONCE_SIZE = 32
MAC_SIZE = 32
SERVER_HELLO_SIZE = len(MAGIC) + NONCE_SIZE
CLIENT_ANSWER_SIZE = len(MAGIC) + NONCE_SIZE + MAC_SIZE
SERVER_PROOF_SIZE = MAC_SIZE


def _mac(secret: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, label + first + second, hashlib.sha256).digest()


def check_secret(secret: bytes) -> bytes:
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
