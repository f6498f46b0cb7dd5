"""TLS between peers: the ``Security`` object, as distributed's, and its SSL contexts.

Why: the HMAC handshake of ``redisdask/comm/handshake.py`` proves that a peer knows the
cluster's secret, but results then cross the network in the clear.  With TLS every worker<->worker
and client<->worker connection is encrypted and *mutually* authenticated by certificates
signed by the cluster's CA; the HMAC handshake still runs inside the TLS channel (a stolen
certificate alone does not let anyone in, nor does the secret alone).

One certificate and key per process (distributed has one per role; its ``tls_client_*`` /
``tls_worker_*`` keywords are accepted as aliases).  Certificates name no host: peers check
that the other side's certificate was signed by the CA, not its host name (as distributed
does), since workers listen on whatever address they were given.

Settings: config ``comm.tls.ca-file``, ``comm.tls.cert``, ``comm.tls.key``
(``REDISDASK__COMM__TLS__CA_FILE`` ...), the CLI's ``--tls-ca-file``, ``--tls-cert``,
``--tls-key``, or ``Security(...)`` passed to ``LocalCluster`` and ``Client``.  TLS is on
when the three are set, and then required: such a process neither serves nor connects in
the clear.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field
from typing import Any

from redisdask.errors import ConfigError

__all__ = ["Security", "TLSSetupError"]

# what a Security is handed to processes it starts by: the config's environment variables
ENV_NAMES = {
    "tls_ca_file": "REDISDASK__COMM__TLS__CA_FILE",
    "tls_cert": "REDISDASK__COMM__TLS__CERT",
    "tls_key": "REDISDASK__COMM__TLS__KEY",
}


class TLSSetupError(ConfigError):
    """A TLS setting names a file that is missing, unreadable or does not hold what it must."""


@dataclass(frozen=True)
class Security:
    """Where this process's TLS material is: ``tls_ca_file`` (the CA that signed every
    peer's certificate), ``tls_cert`` and ``tls_key`` (this process's certificate and its
    private key, PEM; the key may sit in the cert file, then ``tls_key`` may be left out).

    ``Security()`` with nothing set means no TLS.  The files are read at once, so a wrong
    path or a key that does not match its certificate fails here, naming the file."""

    tls_ca_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    _server: ssl.SSLContext | None = field(default=None, init=False, repr=False, compare=False)
    _client: ssl.SSLContext | None = field(default=None, init=False, repr=False, compare=False)

    def __init__(
        self,
        tls_ca_file: str | os.PathLike[str] | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        *,
        tls_client_cert: str | os.PathLike[str] | None = None,
        tls_client_key: str | os.PathLike[str] | None = None,
        tls_worker_cert: str | os.PathLike[str] | None = None,
        tls_worker_key: str | os.PathLike[str] | None = None,
        require_encryption: bool | None = None,
    ) -> None:
        cert = tls_cert or tls_worker_cert or tls_client_cert
        key = tls_key or tls_worker_key or tls_client_key
        for name, value in (("tls_ca_file", tls_ca_file), ("tls_cert", cert), ("tls_key", key)):
            object.__setattr__(self, name, os.fspath(value) if value is not None else None)
        if self.tls_ca_file is None and self.tls_cert is None and self.tls_key is None:
            if require_encryption:
                raise TLSSetupError(
                    "require_encryption=True but no TLS files are set: pass tls_ca_file, "
                    "tls_cert and tls_key (config comm.tls.ca-file, comm.tls.cert, comm.tls.key)"
                )
            object.__setattr__(self, "_server", None)
            object.__setattr__(self, "_client", None)
            return
        if self.tls_ca_file is None or self.tls_cert is None:
            raise TLSSetupError(
                "TLS needs both a CA file and a certificate (with its key): set "
                "comm.tls.ca-file, comm.tls.cert and comm.tls.key (or --tls-ca-file, "
                f"--tls-cert, --tls-key); got ca-file={self.tls_ca_file!r}, "
                f"cert={self.tls_cert!r}, key={self.tls_key!r}"
            )
        object.__setattr__(self, "_server", self._context(ssl.Purpose.CLIENT_AUTH))
        object.__setattr__(self, "_client", self._context(ssl.Purpose.SERVER_AUTH))

    @classmethod
    def from_config(cls, config: Any = None) -> Security:
        """From ``comm.tls.*`` of ``config`` (a loaded ``Config``; else ``load_config()``)."""
        if config is None:
            from redisdask.config import load_config

            config = load_config()
        tls = config.comm.tls
        return cls(tls.ca_file, tls.cert, tls.key)

    @property
    def enabled(self) -> bool:
        return self._server is not None

    @property
    def scheme(self) -> str:
        """The scheme of the addresses of workers using this: ``tls`` or ``tcp``."""
        return "tls" if self.enabled else "tcp"

    def server_context(self) -> ssl.SSLContext | None:
        """The context a worker's data server wraps accepted connections in; None: no TLS."""
        return self._server

    def client_context(self) -> ssl.SSLContext | None:
        """The context connections to a worker are wrapped in; None: no TLS."""
        return self._client

    def environment(self) -> dict[str, str]:
        """The environment variables that hand these settings to a process we start."""
        return {env: getattr(self, attr) for attr, env in ENV_NAMES.items() if getattr(self, attr)}

    def _context(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        assert self.tls_ca_file is not None and self.tls_cert is not None
        what = "CA file (comm.tls.ca-file)"
        try:
            _check_readable(self.tls_ca_file, what)
            ctx = ssl.create_default_context(purpose, cafile=self.tls_ca_file)
            what = "certificate (comm.tls.cert) or key (comm.tls.key)"
            _check_readable(self.tls_cert, "certificate (comm.tls.cert)")
            if self.tls_key is not None:
                _check_readable(self.tls_key, "key (comm.tls.key)")
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        except ssl.SSLError as exc:
            raise TLSSetupError(
                f"cannot use the TLS {what} ({self.tls_ca_file=}, {self.tls_cert=}, "
                f"{self.tls_key=}): {exc.reason or exc}. Each must be PEM, and the key the "
                "one of the certificate"
            ) from exc
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.verify_mode = ssl.CERT_REQUIRED  # mutual: the server asks for the client's too
        ctx.check_hostname = False  # the CA vouches for peers; they carry no host names
        return ctx


def _check_readable(path: str, what: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise TLSSetupError(
            f"cannot read the TLS {what} {path!r}: {exc.strerror or exc}. Check the path "
            "(it is read by every process of the cluster, on its own machine)"
        ) from None
