"""Every process's log records in Redis, so that a worker's logs can be read from
anywhere, alive or dead (``client.get_worker_logs``, ``redisdask logs``).

Dask's "Why did my worker die?" starts with the worker's logs, which live on the machine
that ran it and die with its container.  Here the scheduler, every worker and every
nanny also ship their records to a capped stream of their own:

* ``rd:{c}:logs:scheduler``: every scheduler process of the cluster (leader and
  standbys, each record naming its process), so a failover reads as one story;
* ``rd:{c}:worker:<address>:logs``: a worker's, under the address it listens on;
* ``rd:{c}:logs:nanny:<name>``: a nanny's own (its worker's deaths, restarts, kills).

**Bounded.** Each stream keeps the last ``retention.logs`` records (``XADD MAXLEN``), a
message is cut at ``MAX_MESSAGE`` bytes, and each write renews the stream's TTL
(``retention.logs-ttl``): the stream of a process that died, however it died, is kept
that long after its last record, then Redis drops it.

**Never in the way.** ``emit`` appends to a bounded buffer and returns; a thread writes
the buffer every ``FLUSH_INTERVAL`` through a connection of its own.  While Redis is
away the records wait in the buffer (the oldest dropped past ``BUFFER``); a Redis that
refuses writes (full: OOM, MISCONF, READONLY) costs the records of that write, counted
and said in the next one: logs are the first thing to give up when Redis is full.

**No secrets.** A password in a URL is replaced by ``***`` before a record leaves the
process (``redact_text``), whatever logged it.
"""

from __future__ import annotations

import collections
import logging
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis

from redisdask import context
from redisdask.store import busy, codecs
from redisdask.store.connection import connect

if TYPE_CHECKING:
    from redisdask.config import Config, RedisConfig
    from redisdask.store.keyspace import Keys

FLUSH_INTERVAL = 0.5  # seconds between writes of the buffer
BUFFER = 10_000  # records waiting to be written, at most (the oldest go first)
MAX_MESSAGE = 16_384  # bytes of one record's text (and traceback), at most
ENTRY_OVERHEAD = 32  # bytes of a stream entry besides its message (id, field name, listpack)
LISTPACK_BYTES = 4096  # Redis's stream-node-max-bytes: a longer entry gets a node of its own
CLOSE_WAIT = 2.0  # seconds a process's exit waits for its last records to be written
_PASSWORD = re.compile(r"(://[^/\s:@]*:)[^@\s/]+@")


def redact_text(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***``."""
    return _PASSWORD.sub(r"\1***@", text)


@dataclass(slots=True, frozen=True)
class LogRecord:
    """One shipped record, as read back."""

    time: float
    level: str
    logger: str
    process: str  # the role and name of the process that wrote it ("worker worker-0")
    pid: int
    message: str  # with the traceback, if the record had one
    task: str | None = None  # the key of the task whose thread logged it
    id: str = ""  # its stream entry's

    @property
    def line(self) -> str:
        """The record in the processes' own format (``redisdask.utils.logs.FORMAT``)."""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.time))
        millis = int(self.time % 1 * 1000)
        return (
            f"{stamp},{millis:03d} {self.level:<7} {self.process}[{self.pid}] "
            f"{self.logger}: {self.message}"
        )


class RedisLogHandler(logging.Handler):
    """Ships this process's records to ``stream`` (which may be set later: a worker
    learns its address once it listens; records wait in the buffer until then)."""

    def __init__(
        self,
        redis_url: str,
        *,
        maxlen: int,
        ttl: float,
        max_bytes: int = 4_000_000,
        stream: str | None = None,
        login: RedisConfig | None = None,
    ) -> None:
        super().__init__()
        self.redis_url = redis_url
        self.login = login  # the ACL user: redis.username, redis.password
        self.stream = stream
        self.maxlen = maxlen
        self.max_bytes = max_bytes
        self._entry_bytes = 256.0  # the mean size of an entry written (a moving average)
        self.ttl_ms = int(ttl * 1000)
        self._buffer: collections.deque[dict[str, Any]] = collections.deque(maxlen=BUFFER)
        self._dropped = 0  # records Redis refused or the full buffer pushed out
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._redis: redis.Redis | None = None
        self._thread = threading.Thread(target=self._run, name="rd-log-ship", daemon=True)
        if maxlen:  # 0 (``retention.logs``): nothing shipped
            self._thread.start()

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("redis.") or record.name == __name__:
            return  # (what the shipping itself logs would feed itself)
        try:
            message = record.getMessage()
            if record.exc_info:
                message += "\n" + logging.Formatter().formatException(record.exc_info)
            role = getattr(record, "role", None) or "redisdask"
            task = context.current_key()
            entry = {
                "t": record.created,
                "l": record.levelname,
                "n": record.name,
                "r": role,
                "p": record.process or 0,
                "m": redact_text(message)[:MAX_MESSAGE],
            }
            if task is not None:
                entry["k"] = task
            self._append(entry)
        except Exception:
            self.handleError(record)

    def add_line(self, text: str, *, process: str, pid: int) -> None:
        """A line of a process's output that is no log record (a print, a C library's
        message, a crash dump: a nanny passes its worker's on), as a record of level
        ``OUTPUT``."""
        entry = {"t": time.time(), "l": "OUTPUT", "n": "output", "r": process, "p": pid}
        self._append({**entry, "m": redact_text(text)[:MAX_MESSAGE]})

    def _append(self, entry: dict[str, Any]) -> None:
        if not self.maxlen:
            return
        if len(self._buffer) == self._buffer.maxlen:
            self._dropped += 1
        self._buffer.append(entry)

    def set_stream(self, stream: str) -> None:
        self.stream = stream
        self._wake.set()

    def close(self) -> None:
        """Write what is buffered (waiting for that at most ``CLOSE_WAIT``: a process
        whose Redis is gone still exits at once), then stop."""
        self._stopped.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=CLOSE_WAIT)
        if self._redis is not None:
            self._redis.close()
        super().close()

    def _run(self) -> None:
        while True:
            self._wake.wait(FLUSH_INTERVAL)
            self._wake.clear()
            stopping = self._stopped.is_set()
            self._flush()
            if stopping:
                return

    def _flush(self) -> None:
        if self.stream is None or not self._buffer:
            return
        batch = [self._buffer.popleft() for _ in range(len(self._buffer))]
        notes = [self._note_of_drops()] if self._dropped else []
        try:
            if self._redis is None:  # (without busy's boundary: a refusal is not waited out)
                pool = connect(self.redis_url, timeout=5.0, check=False, config=self.login)
                self._redis = redis.Redis(connection_pool=pool.connection_pool)
            pipe = self._redis.pipeline(transaction=False)
            for entry in (*notes, *batch):
                packed = codecs.pack(entry)
                pipe.xadd(self.stream, {"m": packed}, maxlen=self._cap(packed), approximate=False)
            pipe.pexpire(self.stream, self.ttl_ms)
            pipe.execute()
        except Exception as exc:
            if busy.refusal(exc) or isinstance(exc, redis.ResponseError):
                self._dropped += len(batch)  # a full Redis: logs give way first
            else:  # away: they wait (the oldest pushed out past BUFFER)
                self._buffer.extendleft(reversed(batch))
            return
        self._dropped = 0

    def _cap(self, packed: bytes) -> int:
        """How many entries the stream may keep: ``maxlen``, fewer when its entries are
        big, so that it holds about ``max_bytes`` at most (by the mean size of what this
        process wrote lately: a chatty task's long lines shorten the history, not
        Redis's room).  At least 100, so that the newest lines are always there."""
        size = len(packed) + ENTRY_OVERHEAD
        if len(packed) > LISTPACK_BYTES:  # a node of its own, rounded up by the allocator
            size = size * 5 // 4
        self._entry_bytes += (size - self._entry_bytes) / 64
        return min(self.maxlen, max(int(self.max_bytes / self._entry_bytes), 100))

    def _note_of_drops(self) -> dict[str, Any]:
        return {
            "t": time.time(),
            "l": "WARNING",
            "n": __name__,
            "r": "redisdask",
            "p": 0,
            "m": f"{self._dropped} log records were lost before this one (Redis refused "
            "them, or was away while more than the buffer's records came)",
        }


def install(redis_url: str, config: Config, stream: str | None = None) -> None:
    """Ship this process's records (the root logger's) to ``stream`` from now on, as
    ``config`` says (``retention.logs``, ``-bytes``, ``-ttl``, the Redis login); with
    ``retention.logs`` 0, nothing (no handler: records cost nothing more)."""
    if not config.retention.logs:
        return
    handler = RedisLogHandler(
        redis_url,
        maxlen=config.retention.logs,
        ttl=config.retention.logs_ttl,
        max_bytes=config.retention.logs_bytes,
        stream=stream,
        login=config.redis,
    )
    for existing in logging.getLogger().handlers:  # the role's label, as the lines have
        for log_filter in existing.filters:
            handler.addFilter(log_filter)
    logging.getLogger().addHandler(handler)


def set_stream(stream: str) -> None:
    """The stream this process's records go to, once it is known (a worker's address)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, RedisLogHandler):
            handler.set_stream(stream)


def read(
    r: redis.Redis, stream: str, *, n: int | None = None, since: float | None = None
) -> list[LogRecord]:
    """The last ``n`` records of ``stream`` (all: None), oldest first, from ``since``
    (a time) on.  A malformed entry is skipped."""
    start = f"{int(since * 1000)}-0" if since is not None else "-"
    if n is None:
        entries = r.xrange(stream, min=start)
    else:
        entries = list(reversed(r.xrevrange(stream, min=start, count=n)))
    return list(records(entries))


def records(entries: Iterable[tuple[Any, dict[bytes, bytes]]]) -> Iterable[LogRecord]:
    """Decoded stream entries (as ``XRANGE`` returns them), malformed ones skipped."""
    for entry_id, fields in entries:
        entry = codecs.unpack_or(fields.get(b"m"), None, dict)
        if entry is None:
            continue
        try:
            yield LogRecord(
                time=float(entry["t"]),
                level=str(entry["l"]),
                logger=str(entry["n"]),
                process=str(entry.get("r", "")),
                pid=int(entry.get("p", 0)),
                message=str(entry["m"]),
                task=None if entry.get("k") is None else str(entry["k"]),
                id=entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id),
            )
        except (KeyError, TypeError, ValueError):
            continue


def known_workers(r: redis.Redis, keys: Keys) -> dict[str, str]:
    """``{address: name}`` of every worker Redis knows of: the registered ones first,
    then the dead ones of the last 1,000 death records, newest first."""
    known = {
        address.decode(errors="replace"): str(
            codecs.worker_info_or_empty(info).get("name") or address.decode(errors="replace")
        )
        for address, info in r.hgetall(keys.workers).items()
    }
    for _id, fields in r.xrevrange(keys.deaths, count=1000):
        death = codecs.unpack_or(fields.get(b"m"), {}, dict)
        address = death.get("worker")
        if isinstance(address, str) and address not in known:
            known[address] = str(death.get("name") or address)
    return known


def find_worker(known: dict[str, str], who: str) -> str | None:
    """The address ``who`` names (an address, or a name: the registered worker's, else
    the most recent dead one's) among ``known_workers``."""
    if who in known:
        return who
    return next((address for address, name in known.items() if name == who), None)


def nanny_stream(r: redis.Redis, keys: Keys, address: str) -> str | None:
    """The log stream of the nanny of the worker at ``address``: the registered worker's
    nanny, else the one the newest of the last 1,000 death records of it names (its
    ``evidence.nanny_pid``); None for a bare worker."""
    info = codecs.worker_info_or_empty(r.hget(keys.workers, address))
    if info.get("nanny"):
        return keys.nanny_logs(f"{info.get('host')}-{info.get('nanny')}")
    for _id, fields in r.xrevrange(keys.deaths, count=1000):
        death = codecs.unpack_or(fields.get(b"m"), {}, dict)
        evidence = death.get("evidence")
        if death.get("worker") == address and isinstance(evidence, dict):
            pid = evidence.get("nanny_pid")
            if isinstance(pid, int):
                return keys.nanny_logs(f"{death.get('host')}-{pid}")
    return None
