"""Peer addresses: ``tcp://host:port`` and ``tls://host:port`` strings, parsed and
formatted; the check that a process's TLS settings match the scheme it dials; and the
address this machine is reachable at.
"""

from __future__ import annotations

import socket
import ssl

from redisdask.comm.errors import SecurityMismatchError

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


def local_ip() -> str:
    """This machine's address on the network that leads elsewhere (no packet is sent:
    connecting a UDP socket only picks the route); 127.0.0.1 without a network."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"
