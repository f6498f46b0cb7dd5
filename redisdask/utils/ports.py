"""A free TCP port to listen on."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1", wanted: int = 0) -> int:
    """``wanted`` if nothing listens on it on ``host``, else (or for 0) one the OS picks.
    Probed as servers bind (``SO_REUSEADDR``: a port left in TIME_WAIT is free); whoever
    binds it next may still lose a race, and must say so."""
    family = socket.getaddrinfo(host, wanted, type=socket.SOCK_STREAM)[0][0]
    for port in (wanted, 0) if wanted else (0,):
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return int(probe.getsockname()[1])
    raise OSError(f"no free port on {host}")
