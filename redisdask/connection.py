"""Opening Redis connections with errors that say what to do, and URLs safe to log."""

from __future__ import annotations

import urllib.parse
from typing import Any

import redis
import redis.asyncio

from redisdask.errors import ClusterConnectionError


def redact(url: str) -> str:
    """The URL without its password, for logs and error messages."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urllib.parse.urlunsplit(parts._replace(netloc=user + netloc))


def _options(timeout: float, name: str | None) -> dict[str, Any]:
    return {
        "socket_connect_timeout": timeout,
        "socket_keepalive": True,
        "health_check_interval": 30,
        "client_name": name,
    }


def connect(url: str, *, timeout: float = 5.0, name: str | None = None) -> redis.Redis:
    """A Redis client for ``url``, checked with PING; ``ClusterConnectionError`` if not."""
    try:
        client = redis.Redis.from_url(url, **_options(timeout, name))
    except ValueError as exc:
        raise ClusterConnectionError(
            f"invalid Redis URL {redact(url)!r}: {exc}; expected redis://host:port/db"
        ) from exc
    try:
        client.ping()
    except redis.AuthenticationError as exc:  # a subclass of ConnectionError: first
        client.close()
        raise ClusterConnectionError(
            f"Redis at {redact(url)} refused our credentials ({exc}); check the user and "
            "password in the URL"
        ) from exc
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        client.close()
        raise ClusterConnectionError(
            f"cannot reach Redis at {redact(url)} within {timeout:g} s: {exc}. Is redis-server "
            "running there? Pass the right URL, or use LocalCluster() to start one"
        ) from exc
    except redis.ResponseError as exc:  # e.g. a database index out of range
        client.close()
        raise ClusterConnectionError(f"Redis at {redact(url)} refused us: {exc}") from exc
    return client


def connect_async(
    url: str, *, timeout: float = 5.0, name: str | None = None
) -> redis.asyncio.Redis:
    """An asyncio Redis client for ``url`` (not yet checked: call ``ping()``)."""
    try:
        return redis.asyncio.Redis.from_url(url, **_options(timeout, name))
    except ValueError as exc:
        raise ClusterConnectionError(
            f"invalid Redis URL {redact(url)!r}: {exc}; expected redis://host:port/db"
        ) from exc
