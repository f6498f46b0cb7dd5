"""The scheduler's lease: one leader per cluster, fenced by a token.

* ``rd:{c}:lease`` holds the leader's token with a PX TTL (``scheduler.lease-ttl``);
  ``rd:{c}:lease-token`` holds the last token handed out, ``<n>.<nonce>`` (n counts up;
  the random nonce keeps two tokens apart where a Redis failover lost the last one and
  n is handed out again: see ``token_number``).  Every write of the leader is
  an ``APPLY_FENCED`` that checks the token first (``scripts._FENCE``), so a scheduler
  that was paused or partitioned while a standby took over can never write again.
* **An expired lease nobody took since is still ours**: the counter still stands at our
  token, so no other scheduler was ever handed one, and none can have written.  A leader
  whose batch outlasted the TTL therefore goes on; only a takeover fences it out.
* **Renewal.**  Every fenced write renews the lease, an idle leader renews it once a third
  of the TTL has passed, and while the driver works (``Lease.kept()``: loading the state,
  a batch from its decoding to its write) a thread renews it too, so that no batch, however
  long, loses the lease to a standby while its scheduler is alive.  The thread is a part of
  the process: a scheduler stopped by SIGSTOP, or killed, renews nothing.
* **Failover.**  A process killed with SIGKILL loses its Redis connections at once.  A
  standby looks every ``LOOK_INTERVAL`` at the connections of the holder
  (``HolderWatch``: ``CLIENT LIST``, the holder's connection name is in the ``scheduler``
  hash, written with its token) and takes the lease as soon as they are gone in two looks
  in a row, instead of waiting for the TTL.  A paused holder (SIGSTOP) keeps its
  connections: it loses the lease only when the TTL runs out, and is fenced as before.
  Where ``CLIENT LIST`` is refused (an ACL), standbys wait for the TTL.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import redis

from redisdask.errors import FencedError
from redisdask.store import keyspace
from redisdask.store.scripts import Scripts

logger = logging.getLogger("redisdask.scheduler")


def token_number(token: str | bytes) -> int:
    """The counting part of a lease token (``"7.1f2e3d4c"`` -> 7): later takeovers have
    larger numbers, except after a Redis failover that lost the last takeover."""
    text = token.decode() if isinstance(token, bytes) else token
    return int(text.partition(".")[0])


class Lease:
    """The lease of one scheduler process: its token, its renewals, the keeper thread."""

    def __init__(self, scripts: Scripts, ttl: float, holder: str, connection: str = "") -> None:
        self.scripts = scripts
        self.ttl_ms = int(ttl * 1000)
        self.holder = holder  # the scheduler's id, for the messages
        self.connection = connection  # the name of our Redis connections
        self.token: str | None = None
        self.renewed_at = 0.0  # monotonic time of the last renewal that held
        self._working = 0  # depth of kept() blocks
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._keeper: threading.Thread | None = None
        self._lost: str | None = None  # the token the keeper found taken over

    @property
    def due(self) -> bool:
        """Whether a third of the TTL has passed since the last renewal."""
        return time.monotonic() - self.renewed_at >= self.ttl_ms / 3000

    def try_acquire(self, gone: str = "") -> str | None:
        """Renew the lease if it is ours (or expired untaken since), else take it if it
        is free or held by ``gone`` (the token of a holder whose connections closed); the
        token held, or None while another scheduler holds it."""
        started = time.monotonic()
        token = self.scripts.acquire_lease(
            token=self.token, ttl_ms=self.ttl_ms, connection=self.connection, gone=gone
        )
        if token is None:
            return None
        self.token = token.decode()
        self.renewed_at = started
        return self.token

    def renew(self) -> None:
        """Renew the lease; ``FencedError`` if another scheduler took it."""
        held = self.token
        started = time.monotonic()
        token = self.scripts.acquire_lease(token=held, ttl_ms=self.ttl_ms)
        if held is None or token is None or token.decode() != held:
            raise FencedError(f"scheduler {self.holder} lost its lease (token {held})")
        self.renewed_at = max(self.renewed_at, started)

    def wrote(self, started: float) -> None:
        """A fenced write that began at ``started`` (monotonic) succeeded: it renewed."""
        self.renewed_at = max(self.renewed_at, started)

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """Keep the lease renewed from a thread while the block runs (re-entrant)."""
        with self._lock:
            self._working += 1
            if self._keeper is None:
                self._keeper = threading.Thread(target=self._keep, name="lease-keeper", daemon=True)
                self._keeper.start()
        try:
            yield
        finally:
            with self._lock:
                self._working -= 1

    def _keep(self) -> None:
        while not self._wake.wait(self.ttl_ms / 6000):
            if not self._working or not self.due or self.token in (None, self._lost):
                continue
            try:
                self.renew()
            except FencedError as exc:
                # a standby took over: the batch's write will be refused, which stops
                # the driver; nothing to renew until then
                logger.warning("%s; the batch under way will be refused", exc)
                self._lost = self.token
            except redis.RedisError as exc:  # the driver meets the same and handles it
                logger.debug("the lease keeper could not renew: %s", exc)

    def close(self) -> None:
        """Stop the keeper thread (the lease itself is released by a fenced write)."""
        self._wake.set()
        if self._keeper is not None:
            self._keeper.join()


LOOK_INTERVAL = 0.05  # seconds between a standby's looks at the holder's connections
LOOKS_GONE = 2  # looks in a row without them before the holder counts as gone


class HolderWatch:
    """A standby's watch on the lease holder's Redis connections.

    ``gone()`` returns the holder's token once its connections (named
    ``Keys.scheduler_connection``) are absent from ``CLIENT LIST`` in ``LOOKS_GONE`` looks
    in a row, all on the Redis server (``run_id``) where this watch saw them before: a
    Redis restart cuts every connection, and the holder may not have reconnected yet.  A
    holder this watch never saw connected (it died before this standby started) is left
    to its TTL.
    """

    def __init__(self, r: redis.Redis, keys: keyspace.Keys) -> None:
        self.redis, self.keys = r, keys
        self.seen: tuple[bytes, str] | None = None  # (token, run_id) seen connected
        self.missing = 0
        self.refused = False  # CLIENT LIST refused: the TTL alone

    def gone(self) -> str:
        """The token of a holder whose connections are gone, or ''."""
        if self.refused:
            return ""
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(self.keys.lease)
        pipe.hmget(self.keys.scheduler, "token", "conn")
        pipe.client_list(_type="normal")
        pipe.info("server")
        token, (hash_token, conn), connections, server = pipe.execute(raise_on_error=False)
        if isinstance(connections, Exception):
            logger.warning(
                "CLIENT LIST refused (%s): this standby takes over when the lease expires "
                "(scheduler.lease-ttl), not as soon as the leader's connections close",
                connections,
            )
            self.refused = True
            return ""
        run_id = server.get("run_id", "") if isinstance(server, dict) else ""
        if token is None or token != hash_token or not conn:
            self.seen, self.missing = None, 0  # no holder, or one that does not say its name
            return ""
        if conn.decode() in {c.get("name", "") for c in connections}:
            self.seen, self.missing = (token, run_id), 0
            return ""
        if self.seen != (token, run_id):
            self.missing = 0
            return ""
        self.missing += 1
        return token.decode() if self.missing >= LOOKS_GONE else ""
