"""The dashboard's web application (Starlette): pages, their live fragments, and the rules
that keep it safe to expose.

A page is a frame around fragments (``templates/fragments/``).  The page renders each
fragment once, so it reads well without scripts; then ``static/dashboard.js`` opens an
``EventSource`` on ``/live/<fragment>`` and swaps in each new rendering, pushed only when
it changed.  All viewers of one fragment share its reads: a rendering is cached for half
the refresh interval, so ten open tabs cost Redis at most twice what one does.

Safe by default:

* only ``GET`` (and ``HEAD``) routes: no request can ask it to write anything, and the
  Redis user it runs as can be the read-only ``monitor`` role (``redisdask acl monitor``);
* every string from the cluster (task keys, exception text, log lines, worker names) is
  escaped by Jinja2's autoescaping, and a Content-Security-Policy allows no script but
  its own file, so even a missed escape would run nothing;
* with a ``token``, every request must carry it (``?token=`` once, which sets a cookie,
  or an ``Authorization: Bearer`` header); it is compared in constant time and never
  logged.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import math
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import redis
from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import MutableHeaders
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from redisdask.dashboard import reads
from redisdask.observe.views import ago, clock
from redisdask.store.keyspace import Keys
from redisdask.store.urls import redact
from redisdask.utils.sizes import format_bytes

logger = logging.getLogger("redisdask.dashboard")

COOKIE = "redisdask_dashboard"
_LINE_BREAKS = re.compile(r"\r\n|\r|\n")  # what ends a line of an event stream
# what reading or showing a record of an unexpected shape raises
MALFORMED = (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError, OSError)
# a fragment's parameters, the only query parameters a page passes on to it
PARAMS = ("w", "key", "nanny")
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@dataclass
class Page:
    title: str
    fragments: tuple[str, ...]  # rendered in this order


PAGES = {
    "status": Page("Status", ("status",)),
    "task-stream": Page("Task stream", ("task-stream",)),
    "workers": Page("Workers", ("workers",)),
    "worker": Page("Worker", ("worker", "logs")),
    "logs": Page("Logs", ("logs",)),
    "deaths": Page("Deaths", ("deaths",)),
    "events": Page("Events", ("events",)),
    "task": Page("Task", ("task",)),
}
NAVIGATION = ("status", "task-stream", "workers", "deaths", "events", "logs")


@dataclass
class Renderer:
    """Renders fragments from Redis reads, caching each rendering for ``ttl`` seconds."""

    r: redis.Redis
    keys: Keys
    url: str  # for the header, with its password hidden
    ttl: float
    env: Environment = field(init=False)
    _cache: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[float, str]] = field(
        default_factory=dict
    )
    _down: str | None = None  # why Redis cannot be read, while it cannot
    _warned: set[tuple[str, str]] = field(default_factory=set)  # malformed records said

    def __post_init__(self) -> None:
        self.env = Environment(
            loader=PackageLoader("redisdask.dashboard", "templates"),
            autoescape=select_autoescape(default=True, default_for_string=True),
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.filters.update(bytes=_bytes, clock=clock, ago=ago, pct=_pct, link=_link)
        self.env.globals.update(navigation=NAVIGATION, pages=PAGES)

    def fragment(self, name: str, params: reads.Params) -> str:
        """The HTML of fragment ``name`` (cached); a Redis error renders as its message."""
        cache_key = (name, tuple(sorted(params.items())))
        now = time.monotonic()
        cached = self._cache.get(cache_key)
        if cached is not None and now - cached[0] < self.ttl:
            return cached[1]
        html = self._render(name, params, self.context(name, params))
        if len(self._cache) > 1000:  # one entry per fragment and parameters viewed
            self._cache.clear()
        self._cache[cache_key] = (now, html)
        return html

    def context(self, name: str, params: reads.Params) -> dict[str, Any]:
        """What fragment ``name`` shows (``reads``), or ``{"error": why}`` when Redis
        cannot be read or holds a record this part cannot show."""
        try:
            context = reads.FRAGMENTS[name](self.r, self.keys, params)
        except (redis.RedisError, OSError) as exc:  # (before MALFORMED, which has OSError)
            error = _redis_error(exc, self.url)
            if self._down is None:  # once per outage, not at every rendering
                logger.warning("cannot read cluster %r: %s", self.keys.cluster, error)
            self._down = error
            return {"error": error}
        except MALFORMED as exc:
            return {"error": self._malformed(name, params, exc)}
        if self._down is not None:
            logger.info("reading cluster %r again", self.keys.cluster)
        self._down = None
        return context

    def _render(self, name: str, params: reads.Params, context: dict[str, Any]) -> str:
        template = self.env.get_template(f"fragments/{name}.html")
        try:
            return template.render(params=params, now=time.time(), **context)
        except MALFORMED as exc:
            error = self._malformed(name, params, exc)
            return self.env.get_template("fragments/error.html").render(error=error)

    def _malformed(self, name: str, params: reads.Params, exc: Exception) -> str:
        """A record a stranger (or another version) wrote, of a shape this part cannot
        show: the part says so (logged once per part and error), the rest goes on."""
        seen = (name, repr(exc))
        if seen not in self._warned:
            if len(self._warned) > 1000:
                self._warned.clear()
            self._warned.add(seen)
            logger.warning("cannot show %s %s: a malformed record in Redis (%r)", name, params, exc)
        return f"cannot show this: a record in Redis is malformed ({exc!r})"

    def page(self, name: str, params: reads.Params) -> str:
        page = PAGES[name]
        bodies = [(f, self.fragment(f, params)) for f in page.fragments]
        query = urlencode(params)
        return self.env.get_template("page.html").render(
            name=name,
            page=page,
            bodies=bodies,
            query=query,
            params=params,
            cluster=self.keys.cluster,
            url=self.url,
        )


def _redis_error(exc: Exception, url: str) -> str:
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return (
            f"Redis refused a read ({exc}): the dashboard's Redis user needs the monitor "
            "role's rights (redisdask acl monitor)"
        )
    return f"Redis at {url} did not answer ({type(exc).__name__}: {exc}); retrying"


def _bytes(n: Any) -> str:
    ok = isinstance(n, int | float) and not isinstance(n, bool) and math.isfinite(n)
    return format_bytes(int(n)) if ok else "-"


def _pct(part: Any, whole: Any) -> float:
    """``part`` as a percentage of ``whole``, within 0..100 (0 for no whole)."""
    try:
        value = 100.0 * float(part) / float(whole)
    except (TypeError, ValueError, ZeroDivisionError):
        return 0.0
    return min(max(value, 0.0), 100.0) if value == value else 0.0


def _link(value: Any, page: str, name: str = "w") -> str:
    """The query of a link to ``page`` about ``value`` (url-encoded; the template's
    autoescaping then escapes it for the attribute)."""
    return f"/{page}?{urlencode({name: str(value)})}"


def _params(request: Request) -> reads.Params:
    return {k: request.query_params[k] for k in PARAMS if k in request.query_params}


def build_app(
    r: redis.Redis,
    cluster: str,
    url: str,
    *,
    token: str | None = None,
    interval: float = 1.0,
    stopping: threading.Event | None = None,
) -> Starlette:
    """The dashboard of ``cluster``, reading through ``r`` (opened on ``url``); its live
    streams end once ``stopping`` is set (the server's shutdown)."""
    stopping = stopping or threading.Event()
    renderer = Renderer(r, Keys(cluster), redact(url), ttl=interval / 2)

    async def page(request: Request) -> Response:
        name = request.path_params["page"]
        if name not in PAGES:
            return PlainTextResponse(f"no page {name!r}", status_code=404)
        html = await run_in_threadpool(renderer.page, name, _params(request))
        return HTMLResponse(html)

    async def live(request: Request) -> Response:
        name = request.path_params["fragment"]
        if name not in reads.FRAGMENTS:
            return PlainTextResponse(f"no fragment {name!r}", status_code=404)
        render = functools.partial(renderer.fragment, name, _params(request))
        return StreamingResponse(
            _events(request, render, interval, stopping),
            media_type="text/event-stream",
            headers={"X-Accel-Buffering": "no"},
        )

    async def api(request: Request) -> Response:
        name = request.path_params["fragment"]
        if name not in reads.FRAGMENTS:
            return PlainTextResponse(f"no fragment {name!r}", status_code=404)
        context = await run_in_threadpool(renderer.context, name, _params(request))
        status = 503 if "error" in context else 200
        return JSONResponse(reads.as_json(context), status_code=status)

    routes = [
        Route("/", lambda _: RedirectResponse("/status")),
        Route("/health", lambda _: PlainTextResponse("ok")),
        Route("/live/{fragment}", live),
        Route("/api/{fragment}", api),
        Mount("/static", StaticFiles(packages=[("redisdask.dashboard", "static")])),
        Route("/{page}", page),
    ]
    middleware = [Middleware(_Guard, token=token)]
    return Starlette(routes=routes, middleware=middleware)


async def _events(
    request: Request, render: Callable[[], str], interval: float, stopping: threading.Event
) -> AsyncIterator[str]:
    """Server-sent events: the fragment's HTML each time it changes (and a comment every
    15 s, so that proxies keep an idle stream open), until the viewer or the server goes
    (the browser then reconnects by itself)."""
    last, quiet = None, 0.0
    while not stopping.is_set() and not await request.is_disconnected():
        html = await run_in_threadpool(render)
        if html != last:
            last, quiet = html, 0.0
            lines = _LINE_BREAKS.split(html)  # each ends a field of the event stream
            yield "event: html\n" + "".join(f"data: {line}\n" for line in lines) + "\n"
        elif (quiet := quiet + interval) >= 15:
            quiet = 0.0
            yield ": idle\n\n"
        await asyncio.sleep(interval)


class _Guard:
    """Only reads; the token, when one is set; the security headers on every answer.
    (Plain ASGI: a streaming answer goes through untouched.)"""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        given = request.query_params.get("token")
        refusal = self._refusal(request, given)
        # a right ?token= is remembered in a cookie, so that links need not carry it
        remember = self.token is not None and given is not None and self._matches(given)

        async def send_guarded(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    headers[name] = value
                if remember and refusal is None:
                    headers.append(
                        "set-cookie", f"{COOKIE}={self.token}; Path=/; HttpOnly; SameSite=Strict"
                    )
            await send(message)

        app = refusal or self.app
        await app(scope, receive, send_guarded)

    def _refusal(self, request: Request, given: str | None) -> Response | None:
        if request.method not in ("GET", "HEAD"):
            return PlainTextResponse(
                "the dashboard is read-only: only GET", status_code=405, headers={"Allow": "GET"}
            )
        if self.token is None or request.url.path == "/health":  # (it tells nothing)
            return None
        offered = [given, request.cookies.get(COOKIE)]
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer "):
            offered.append(header[7:])
        if any(o is not None and self._matches(o) for o in offered):
            return None
        return PlainTextResponse(
            "this dashboard needs its token: open it once with ?token=<token>", status_code=401
        )

    def _matches(self, offered: str) -> bool:
        """In constant time (``hmac.compare_digest``)."""
        assert self.token is not None
        return hmac.compare_digest(offered.encode(errors="replace"), self.token.encode())
