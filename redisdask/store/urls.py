"""Redis URLs: a URL safe to log (``redact``) and the ``redis+sentinel://`` form that names
Redis Sentinels and a service instead of one server (``parse_sentinel_url``,
``sentinel_url``).  Plain string work: the config reads it without opening anything."""

from __future__ import annotations

import functools
import re
import urllib.parse
from dataclasses import dataclass


def redact(url: str) -> str:
    """The URL without its password (in its address, or a ``password=`` of its query,
    which redis-py takes too), for logs, pages and error messages."""
    parts = urllib.parse.urlsplit(url)
    query = _QUERY_PASSWORD.sub(r"\1***", parts.query)
    if parts.password is None and query == parts.query:
        return url
    netloc = parts.netloc
    if parts.password is not None:
        user = f"{parts.username}:***@" if parts.username else ":***@"
        netloc = user + netloc.rsplit("@", 1)[1]
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))


_QUERY_PASSWORD = re.compile(r"((?:^|&)password=)[^&]*", re.IGNORECASE)


SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_PORT = 26379
SENTINEL_FORM = "redis+sentinel://[user:password@]host:26379[,host2:26379...]/service-name[/db]"


@dataclass(frozen=True)
class SentinelAddress:
    """What a ``redis+sentinel://`` URL names: the Sentinels to ask, the service (the
    name of the primary in their configuration), and how to log in to the primary."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None


def parse_sentinel_url(url: str) -> SentinelAddress | None:
    """The Sentinels and service of a ``redis+sentinel://`` URL (None for any other
    scheme), in the form of the ``redis-sentinel-url`` package:
    ``redis+sentinel://[user:password@]host1:26379,host2:26379/service[/db]`` (kombu's
    ``sentinel://h1:26379;sentinel://h2:26379`` leaves the service to an option; one URL
    that names it travels whole through ``REDISDASK__REDIS__URL`` and command lines).
    The credentials are the data servers' (the Sentinels are asked without any); a host
    without a port is on 26379.  ``ValueError`` naming what is wrong."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        return None
    if parts.query or parts.fragment:
        raise ValueError(f"a Sentinel URL takes no query or fragment; expected {SENTINEL_FORM}")
    hosts = parts.netloc.rsplit("@", 1)[-1]
    sentinels = []
    for host in hosts.split(","):
        name, colon, port = host.strip().rpartition(":") if ":" in host else (host, "", "")
        name = name.strip("[]")  # an IPv6 address in brackets
        if not name or (colon and not port.isdigit()) or not 0 < int(port or 1) < 65536:
            raise ValueError(f"bad Sentinel address {host!r}; expected {SENTINEL_FORM}")
        sentinels.append((name, int(port) if port else SENTINEL_PORT))
    path = [urllib.parse.unquote(p) for p in parts.path.strip("/").split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"expected a service name and an optional db number: {SENTINEL_FORM}")
    return SentinelAddress(
        sentinels=tuple(sentinels),
        service=path[0],
        db=int(path[1]) if len(path) == 2 else 0,
        username=urllib.parse.unquote(parts.username) if parts.username else None,
        password=urllib.parse.unquote(parts.password) if parts.password is not None else None,
    )


def sentinel_url(
    sentinels: list[str], service: str, username: str | None, password: str | None, db: int
) -> str:
    """A ``redis+sentinel://`` URL of ``host:port`` Sentinels (the config's
    ``redis.sentinels`` and ``redis.sentinel-service``)."""
    login = ""
    if password is not None or username:
        quote = functools.partial(urllib.parse.quote, safe="")
        login = f"{quote(username or '')}:{quote(password or '')}@"
    return f"{SENTINEL_SCHEME}://{login}{','.join(sentinels)}/{service}/{db}"


def is_sentinel(url: str) -> bool:
    return urllib.parse.urlsplit(url).scheme == SENTINEL_SCHEME
