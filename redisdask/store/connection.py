"""Opening Redis connections with errors that say what to do (the URLs they take, and
their redaction for logs: ``urls.py``).

Every connection waits out a Redis busy running a script (``BUSY``: ``busy.py``).
``connect(url, cluster_errors=True)`` (the client's connections) gives a ``ClusterRedis``:
every command and every pipeline on it turns redis-py's ``ConnectionError`` and
``TimeoutError`` into ``ClusterConnectionError`` at one boundary
(``cluster_connection_errors``), so no raw ``redis`` error reaches the user.  The
scheduler, workers and nannies keep redis-py's errors: their reconnection loops catch them.

A ``redis+sentinel://`` URL (``parse_sentinel_url``) names Redis Sentinels and a
service instead of one server: every connection is then made to the primary that the
Sentinels name at that moment (redis-py's ``SentinelConnectionPool``), so after a failover
each process's reconnection finds the promoted replica.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import urllib.parse
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import redis
import redis.asyncio.sentinel
import redis.sentinel

from redisdask.errors import ClusterConnectionError
from redisdask.store import busy
from redisdask.store.urls import (
    SENTINEL_FORM,
    SentinelAddress,
    is_sentinel,
    parse_sentinel_url,
    redact,
)

if TYPE_CHECKING:
    from redisdask.config import RedisConfig


def login(config: RedisConfig | None = None) -> dict[str, str]:
    """The ACL user and password to connect as: ``redis.username`` and ``redis.password``
    of ``config`` (else of ``load_config()``: the config file and the environment, which
    the processes a cluster starts inherit).  A user and password in the URL win.  Why not
    the URL only: a URL on a command line shows its password in ``ps``."""
    if config is None:
        from redisdask.config import load_config

        config = load_config().redis
    out = {}
    if config.username:
        out["username"] = config.username
    if config.password is not None:
        out["password"] = config.password.get_secret_value()
    return out


# No CLIENT subcommands on connecting but SETNAME: redis-py (>= 5) sends CLIENT SETINFO
# and (>= 7, over RESP3, which it speaks when it logs in) CLIENT MAINT_NOTIFICATIONS,
# ignoring a refusal.  The ACL roles of redisdask/store/acl.py grant neither (Redis 7.0 refuses
# a rule naming a subcommand it does not know), and every refusal would fill the ACL LOG.
_PARAMETERS = inspect.signature(redis.connection.AbstractConnection.__init__).parameters
_QUIET: dict[str, Any] = (
    {"driver_info": None}  # redis-py >= 7; before it lib_name/lib_version (deprecated since)
    if "driver_info" in _PARAMETERS
    else {"lib_name": None, "lib_version": None}
)
if "maint_notifications_config" in _PARAMETERS:
    from redis.maint_notifications import MaintNotificationsConfig

    _QUIET["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)


def _master(
    address: SentinelAddress, cls: type[Any], options: dict[str, Any], sentinel: type[Any]
) -> Any:
    """A ``cls`` client of the service's primary, through a Sentinel connection pool."""
    ask = {"socket_connect_timeout": options["socket_connect_timeout"],
           "socket_timeout": options["socket_connect_timeout"]}  # fmt: skip
    manager = sentinel(list(address.sentinels), sentinel_kwargs=ask)
    if address.username is not None or address.password is not None:  # the URL's win
        options = {**options, "username": address.username, "password": address.password}
    return manager.master_for(address.service, redis_class=cls, db=address.db, **options)


def _client(url: str, cls: type[Any], options: dict[str, Any], sentinel: type[Any]) -> Any:
    try:
        address = parse_sentinel_url(url)
        if address is None:
            return cls.from_url(url, **options)
    except ValueError as exc:
        raise _invalid_url(url, exc) from exc
    return _master(address, cls, options, sentinel)


def tls_options(url: str, config: RedisConfig | None = None) -> dict[str, Any]:
    """redis-py's ``ssl_*`` keywords for a ``rediss://`` URL, from ``redis.ssl-ca-certs``,
    ``redis.ssl-certfile`` and ``redis.ssl-keyfile`` of ``config`` (else of
    ``load_config()``); nothing for ``redis://`` (the keywords exist only with TLS).  The
    files are checked here: a wrong path is named now, not as a failed handshake later."""
    if urllib.parse.urlsplit(url).scheme != "rediss":
        return {}
    if config is None:
        from redisdask.config import load_config

        config = load_config().redis
    out: dict[str, Any] = {}
    for key, path in (
        ("ssl_ca_certs", config.ssl_ca_certs),
        ("ssl_certfile", config.ssl_certfile),
        ("ssl_keyfile", config.ssl_keyfile),
    ):
        if path is None:
            continue
        if not os.access(path, os.R_OK):
            raise ClusterConnectionError(
                f"cannot read redis.{key.replace('_', '-')} = {path!r} (TLS to Redis at "
                f"{redact(url)}): check the path, or unset it"
            )
        out[key] = path
    return out


def _options(
    url: str, timeout: float, name: str | None, config: RedisConfig | None
) -> dict[str, Any]:
    return {
        "socket_connect_timeout": timeout,
        "socket_keepalive": True,
        "health_check_interval": 30,
        "client_name": name,
        **_QUIET,
        **login(config),
        **tls_options(url, config),
    }


@contextlib.contextmanager
def cluster_connection_errors(url: str) -> Iterator[None]:
    """Raise redis-py's connection errors and timeouts as ``ClusterConnectionError``,
    naming the (redacted) URL, the cause and the next step."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise ClusterConnectionError(
            f"lost the connection to Redis at {redact(url)} ({type(exc).__name__}: {exc}). "
            "Is redis-server still running there and reachable? Try again once it answers: "
            "the client keeps its futures meanwhile"
        ) from exc


class ClusterRedis(busy.Redis):
    """A redis-py client whose commands and pipelines raise ``ClusterConnectionError``
    instead of redis-py's connection errors and timeouts (``connect(cluster_errors=True)``)."""

    url = ""  # for the error messages; set by connect()

    def execute_command(self, *args: Any, **options: Any) -> Any:
        with cluster_connection_errors(self.url):
            return super().execute_command(*args, **options)

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Any:
        pipe = _ClusterPipeline(
            self.connection_pool, self.response_callbacks, transaction, shard_hint
        )
        pipe.url = self.url
        return pipe


class _ClusterPipeline(busy.Pipeline):
    url = ""

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        with cluster_connection_errors(self.url):
            return super().execute(raise_on_error)


class AsyncClusterRedis(busy.AsyncRedis):
    """``ClusterRedis`` for redis-py's asyncio client."""

    url = ""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        with cluster_connection_errors(self.url):
            return await super().execute_command(*args, **options)

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Any:
        pipe = _AsyncClusterPipeline(
            self.connection_pool, self.response_callbacks, transaction, shard_hint
        )
        pipe.url = self.url
        return pipe


class _AsyncClusterPipeline(busy.AsyncPipeline):
    url = ""

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        with cluster_connection_errors(self.url):
            return await super().execute(raise_on_error)


def connect(
    url: str,
    *,
    timeout: float = 5.0,
    name: str | None = None,
    cluster_errors: bool = False,
    check: bool = True,
    config: RedisConfig | None = None,
) -> redis.Redis:
    """A Redis client for ``url``, checked with PING (unless not ``check``);
    ``ClusterConnectionError`` if not.  ``cluster_errors``: a ``ClusterRedis``, whose
    later connection failures are ``ClusterConnectionError`` too.  ``config``: where the
    user and password come from (``login``)."""
    cls = ClusterRedis if cluster_errors else busy.Redis
    options = _options(url, timeout, name, config)
    client = _client(url, cls, options, redis.sentinel.Sentinel)
    if isinstance(client, ClusterRedis):
        client.url = url
    if not check:
        return client
    try:
        # through the shared pool but without the boundary: each failure says its own why
        busy.Redis(connection_pool=client.connection_pool).ping()
    except (redis.RedisError, OSError) as exc:
        client.close()
        raise unreachable(url, timeout, exc) from exc
    return client


def connect_async(
    url: str,
    *,
    timeout: float = 5.0,
    name: str | None = None,
    cluster_errors: bool = False,
    config: RedisConfig | None = None,
) -> redis.asyncio.Redis:
    """An asyncio Redis client for ``url`` (not yet checked: ``await check_async(...)``);
    with ``cluster_errors`` an ``AsyncClusterRedis``; ``config`` as for ``connect``."""
    cls = AsyncClusterRedis if cluster_errors else busy.AsyncRedis
    options = _options(url, timeout, name, config)
    client = _client(url, cls, options, redis.asyncio.sentinel.Sentinel)
    if isinstance(client, AsyncClusterRedis):
        client.url = url
    return client


async def check_async(client: redis.asyncio.Redis, url: str, timeout: float) -> None:
    """PING through ``client``'s pool; ``ClusterConnectionError`` saying why not."""
    try:
        await busy.AsyncRedis(connection_pool=client.connection_pool).ping()
    except (redis.RedisError, OSError) as exc:
        raise unreachable(url, timeout, exc) from exc


def _invalid_url(url: str, exc: ValueError) -> ClusterConnectionError:
    return ClusterConnectionError(
        f"invalid Redis URL {redact(url)!r}: {exc}; expected redis://host:port/db or "
        f"{SENTINEL_FORM}"
    )


def unreachable(url: str, timeout: float, exc: BaseException) -> BaseException:
    """What a failed first PING means, as an error that says what to do (other
    ``RedisError``s are returned as they are)."""
    if isinstance(exc, redis.AuthenticationError):  # a subclass of ConnectionError: first
        return ClusterConnectionError(
            f"Redis at {redact(url)} refused our credentials ({exc}); check the user and "
            "password in the URL, or redis.username and redis.password in the config "
            "(REDISDASK__REDIS__USERNAME, REDISDASK__REDIS__PASSWORD)"
        )
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError | OSError) and is_sentinel(url):
        return ClusterConnectionError(
            f"cannot reach the primary of {redact(url)} within {timeout:g} s: {exc}. Are the "
            "Sentinels running there, do they monitor that service name, and is its primary "
            "up (during a failover: try again once a replica is promoted)?"
        )
    if "SSL" in str(exc) or "certificate" in str(exc):
        return ClusterConnectionError(
            f"TLS with Redis at {redact(url)} failed: {exc}. Check redis.ssl-ca-certs (the CA "
            "that signed the server's certificate) and, if the server asks for client "
            "certificates, redis.ssl-certfile and redis.ssl-keyfile; a redis:// server wants "
            "no rediss:// URL"
        )
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError | OSError):
        return ClusterConnectionError(
            f"cannot reach Redis at {redact(url)} within {timeout:g} s: {exc}. Is redis-server "
            "running there? Pass the right URL, or use LocalCluster() to start one"
        )
    if isinstance(exc, redis.ResponseError):  # e.g. a database index out of range
        return ClusterConnectionError(f"Redis at {redact(url)} refused us: {exc}")
    return exc
