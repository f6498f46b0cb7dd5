"""The nanny: starts a worker process, watches it, restarts it, and says why it died.

One ``Nanny`` per worker process; ``redisdask worker --nworkers N`` runs N of them on one
event loop in one process.  Each nanny:

* starts ``redisdask worker --no-nanny`` as a child in a session of its own (a Ctrl-C in
  the terminal reaches the nanny, which stops its worker gracefully), with its stderr
  piped: every line goes on to the nanny's stderr, into a rotating log file in the local
  directory, and into a tail of the last ``LOG_TAIL`` lines kept for the death record
  (``CRASH_DUMP`` more once a crash dump begins, so its head is kept with every stack);
* every ``worker.memory.monitor-interval`` reads the worker's memory (psutil) and kills
  it past ``worker.memory.terminate`` of its limit ("Worker exceeded 95% memory budget.
  Restarting...");
* every heartbeat interval **vouches** for a worker that is busy (its CPU at work) by
  renewing its ``alive`` key, so a task holding the GIL in compiled code for minutes is
  not taken for a dead worker; a worker silent for ``worker.hang-timeout`` while idle is
  killed and restarted with the reason ``hung``;
* when the process ends, classifies the end (``nanny.deaths``) and reports it: a
  ``remove-worker`` with ``how: nanny`` on the workers stream, so the scheduler removes
  the worker at once and its death record carries the nanny's evidence (exit code or
  signal, memory, log tail, traceback, whether it was restarted); a graceful exit, or a
  worker that never registered, is written to the deaths stream directly;
* restarts it, with a backoff doubling from 0.2 s to 10 s while it keeps dying within
  ``QUICK_DEATH`` s of its start, and gives up after ``MAX_START_FAILURES`` deaths in a row
  before it could register (a worker that can never start: a bad configuration, a
  version the cluster refuses).  A graceful exit (the worker closed itself and said why:
  retired, SIGTERM, lifetime) is not restarted, except for ``Client.restart()`` and at
  the end of the worker's lifetime with ``--lifetime-restart``; any other end, exit code
  0 included (a task's ``os._exit(0)``), is a death: reported, counted, restarted.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import logging.handlers
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import psutil
import redis

from redisdask.config import RetentionConfig
from redisdask.nanny import deaths
from redisdask.nanny.output import OutputLines
from redisdask.nanny_contract import GRACEFUL_TIMEOUT, spill_directory_file, worker_environment
from redisdask.protocol import RemoveWorker
from redisdask.store import codecs, logship, scripts
from redisdask.store.connection import connect_async
from redisdask.store.eventlog import death_fields
from redisdask.store.keyspace import Keys
from redisdask.store.urls import redact
from redisdask.utils import spawn
from redisdask.utils.backoff import Backoff
from redisdask.utils.sizes import format_bytes, oom_kills

logger = logging.getLogger("redisdask.nanny")

LOG_TAIL = 50  # lines of the worker's log kept for its death record
CRASH_DUMP = 300  # more lines kept from a "Fatal Python error" on (every thread's stack)
LOG_FILE_BYTES = 10_000_000  # rotated at this size, two old files kept
QUICK_DEATH = 10.0  # seconds: a worker dying sooner after its start backs off
MAX_START_FAILURES = 3  # deaths in a row before registering: give up
BUSY_CPU_PERCENT = 50.0  # a worker using this much of a core is at work, not hung


class Nanny:
    def __init__(
        self,
        redis_url: str,
        cluster: str,
        *,
        index: int = 0,
        name: str | None = None,
        worker_args: list[str] | None = None,
        memory_limit: int = 0,
        terminate: float | Literal[False] = 0.95,
        monitor_interval: float = 0.2,
        heartbeat_interval: float = 0.5,
        worker_ttl: float = 3.0,
        hang_timeout: float = 10.0,
        local_directory: str | Path | None = None,
        lifetime: float | None = None,
        lifetime_stagger: float = 0.0,
        lifetime_restart: bool = False,
        connect_timeout: float = 5.0,
        retention: RetentionConfig | None = None,
    ) -> None:
        self.redis_url, self.keys = redis_url, Keys(cluster)
        self.retention = retention or RetentionConfig()
        self.restarts = 0  # workers started after the first
        self.name = name
        # unique per host too: containers of one image all run their nanny as pid 1
        self.label = name or f"worker-{socket.gethostname()}-{os.getpid()}-{index}"
        self.worker_args = list(worker_args or [])
        self.memory_limit = memory_limit
        self.terminate = terminate
        self.monitor_interval = monitor_interval
        self.heartbeat_interval = heartbeat_interval
        self.worker_ttl = worker_ttl
        self.hang_timeout = hang_timeout
        base = Path(local_directory or tempfile.gettempdir())
        self.local_directory = base / "redisdask-worker-space"
        self.lifetime, self.lifetime_stagger = lifetime, lifetime_stagger
        self.lifetime_restart = lifetime_restart
        self.connect_timeout = connect_timeout
        self.closing = False
        self._closing = asyncio.Event()
        self.process: asyncio.subprocess.Process | None = None
        self.log_path = self.local_directory / f"{self.label}.log"
        self.tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL)
        self._file_log = self._make_file_log()

    def _make_file_log(self) -> logging.Logger:
        self.local_directory.mkdir(parents=True, exist_ok=True)
        # what the worker tells its nanny, in a directory of this nanny's own
        files = Path(tempfile.mkdtemp(prefix=f"nanny-{self.label}-", dir=self.local_directory))
        self.exit_reason_path = files / "exit-reason"
        self.address_path = files / "address"
        file_log = logging.getLogger(f"redisdask.nanny.worker-log.{self.label}")
        file_log.propagate = False
        file_log.setLevel(logging.INFO)
        if not file_log.handlers:
            handler = logging.handlers.RotatingFileHandler(
                self.log_path, maxBytes=LOG_FILE_BYTES, backupCount=2
            )
            handler.setFormatter(logging.Formatter("%(message)s"))
            file_log.addHandler(handler)
        return file_log

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        """Keep a worker running until asked to stop; 0, or 1 after giving up."""
        name = f"rd-{self.keys.cluster}-nanny-{self.label}"
        self.redis = connect_async(self.redis_url, timeout=self.connect_timeout, name=name)
        start_failures = 0
        restart_backoff = Backoff(base=0.2, cap=10.0)  # for a worker that keeps dying
        try:
            while True:
                started = time.monotonic()
                watch = await self._run_worker_once()
                uptime = time.monotonic() - started
                kind, reason = deaths.classify(watch.exit)
                if watch.address is None and kind != "graceful" and not self.closing:
                    # a Redis that is away is no fault of the worker's: wait for it
                    if await self._wait_for_redis():
                        start_failures += 1
                else:
                    start_failures = 0
                give_up = start_failures >= MAX_START_FAILURES
                restart = self._should_restart(kind, watch.exit) and not give_up
                await self._report(watch, kind, reason, restart)
                if give_up:
                    logger.error(
                        "worker %s died %d times in a row before it could register (last: "
                        "%s); not restarting it. Its log: %s",
                        self.label,
                        start_failures,
                        reason,
                        self.log_path,
                    )
                    return 1
                if not restart:
                    return 0
                if uptime < QUICK_DEATH:
                    delay = restart_backoff.next()
                    logger.info("restarting worker %s in %.1f s", self.label, delay)
                    await asyncio.sleep(delay)  # backoff: no hot loop of deaths
                else:
                    restart_backoff.reset()
                if self.closing:
                    return 0
                self.restarts += 1
        finally:
            await self.redis.aclose()
            shutil.rmtree(self.address_path.parent, ignore_errors=True)

    async def _wait_for_redis(self) -> bool:
        """True if Redis answered at once; else wait (with backoff) until it does."""
        backoff, first = Backoff(base=0.2, cap=2.0), True
        while not self.closing:
            try:
                await self.redis.ping()
                return first
            except redis.RedisError as exc:
                if first:
                    logger.warning("nanny of %s waits for Redis: %s", self.label, exc)
                first = False
            await asyncio.sleep(backoff.next())  # backoff while Redis is away
        return False

    def _should_restart(self, kind: str, exit: deaths.WorkerExit) -> bool:
        if self.closing:
            return False
        if kind == "graceful":
            return exit.exit_reason == "restart" or (
                exit.exit_reason == "lifetime" and self.lifetime_restart
            )
        return True

    def request_close(self) -> None:
        """SIGTERM/Ctrl-C: the worker hands its data over and leaves; a second request
        makes it leave now.  The nanny then ends without restarting it."""
        self.closing = True
        self._closing.set()
        process = self.process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # it just exited
                process.send_signal(signal.SIGTERM)

    # ------------------------------------------------------------------ one worker's life

    async def _run_worker_once(self) -> _Watch:
        self.exit_reason_path.unlink(missing_ok=True)
        self.address_path.unlink(missing_ok=True)
        env = spawn.environment(
            PYTHONUNBUFFERED="1",
            REDISDASK__REDIS__URL=self.redis_url,  # not on a command line ps shows
            **worker_environment(
                os.getpid(), self.exit_reason_path, self.address_path, self.restarts
            ),
        )
        args = spawn.command("worker", "--cluster", self.keys.cluster)
        args += ["--no-nanny", "--memory-limit", str(self.memory_limit), *self.worker_args]
        args += ["--local-directory", str(self.local_directory.parent)]
        if self.name:
            args += ["--name", self.name]
        if self.lifetime is not None:
            stagger = random.uniform(-self.lifetime_stagger, self.lifetime_stagger)
            args += ["--lifetime", str(max(1.0, self.lifetime + stagger))]
        watch = _Watch(oom_kills_before=oom_kills())
        self.tail = collections.deque(maxlen=LOG_TAIL)
        # what the worker prints that is no log record, to its log stream in Redis once
        # its address is known (its records it ships itself)
        self.output_lines = OutputLines()
        self.output = logship.RedisLogHandler(
            self.redis_url,
            maxlen=self.retention.logs,
            ttl=self.retention.logs_ttl,
            max_bytes=self.retention.logs_bytes,
        )
        self.process = process = await asyncio.create_subprocess_exec(
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        if self.closing:  # asked to stop while it was starting
            process.send_signal(signal.SIGTERM)
        pump = asyncio.ensure_future(self._pump_log(process))
        monitor = asyncio.ensure_future(self._monitor(process, watch))
        kill_timer = asyncio.ensure_future(self._kill_if_stuck_closing(process))
        returncode = await process.wait()
        for task in (monitor, kill_timer):
            task.cancel()
        try:
            await asyncio.wait_for(pump, 5.0)  # the rest of its output
        except TimeoutError:
            pump.cancel()
        exit_reason = _read(self.exit_reason_path)
        watch.address = watch.address or _read(self.address_path)
        if watch.address is not None:
            self.output.set_stream(self.keys.worker_logs(watch.address))
        await asyncio.to_thread(self.output.close)
        self._remove_spill_directory()
        watch.exit = deaths.WorkerExit(
            returncode=returncode,
            killed_for=watch.killed_for,
            rss=watch.rss,
            memory_limit=self.memory_limit,
            terminate=self.terminate or None,
            silent_for=watch.silent_for,
            log_tail=list(self.tail),
            exit_reason=exit_reason,
            oom_kills_before=watch.oom_kills_before,
            oom_kills_after=oom_kills(),
            spill_error=await self._spill_error(watch.address),
        )
        watch.pid = process.pid
        return watch

    def _remove_spill_directory(self) -> None:
        """Remove the spill directory of the worker that just ended (one that closed
        itself removed it already), so that the next one does not start on a disk this
        one filled: only the ``worker-*`` directory it named, right in the worker space."""
        note = spill_directory_file(self.address_path)
        named = _read(note)
        note.unlink(missing_ok=True)
        if named is None:
            return
        directory = Path(named)
        space = self.local_directory.resolve()
        if directory.resolve().parent != space or not directory.name.startswith("worker-"):
            logger.warning("not removing %s: not a spill directory in %s", directory, space)
            return
        if directory.exists():
            logger.info("removing the spill directory %s of worker %s", directory, self.label)
            shutil.rmtree(directory, ignore_errors=True)

    async def _spill_error(self, address: str | None) -> str | None:
        """Why the worker could not spill, from its last heartbeat, if it could not."""
        if address is None:
            return None
        try:
            raw = await self.redis.hget(self.keys.heartbeats, address)
        except redis.RedisError:
            return None  # (its death is still recorded, without this detail)
        error = codecs.unpack_or(raw, {}, dict).get("spill_error")
        return str(error) if error else None

    async def _pump_log(self, process: asyncio.subprocess.Process) -> None:
        """Lines of the worker's output to our stderr, the log file and the tail (read in
        chunks: a line of any length is split, never fatal)."""
        assert process.stdout is not None
        pending = b""
        while chunk := await process.stdout.read(65536):
            *lines, pending = (pending + chunk).split(b"\n")
            if len(pending) > 65536:
                lines.append(pending)
                pending = b""
            for line in lines:
                self._log_line(line)
        if pending:
            self._log_line(pending)

    def _log_line(self, line: bytes) -> None:
        text = line.decode(errors="replace")
        if self.output_lines.is_output(text) and self.process is not None:
            self.output.add_line(text, process=f"worker {self.label}", pid=self.process.pid)
        if text.startswith("Fatal Python error:") and self.tail.maxlen == LOG_TAIL:
            # faulthandler's dump: what crashed and where come first, then each other
            # thread's stack, which pushed them out of a tail that has no room for them
            self.tail = collections.deque(self.tail, maxlen=LOG_TAIL + CRASH_DUMP)
        self.tail.append(text)
        self._file_log.info(text)
        with contextlib.suppress(OSError):  # our own stderr closed: the file still has it
            sys.stderr.write(text + "\n")

    async def _kill_if_stuck_closing(self, process: asyncio.subprocess.Process) -> None:
        """A worker asked to stop gets GRACEFUL_TIMEOUT to move its data, then a little
        more; then it is killed."""
        await self._closing.wait()
        await asyncio.sleep(GRACEFUL_TIMEOUT + 5.0)  # the grace period is a timer by nature
        if process.returncode is None:
            logger.warning("worker %s did not stop in time; killing it", self.label)
            _kill_group(process.pid)

    async def _monitor(self, process: asyncio.subprocess.Process, watch: _Watch) -> None:
        try:
            proc = psutil.Process(process.pid)
            proc.cpu_percent(None)  # the first call starts the measurement
        except psutil.Error:
            return
        next_beat = time.monotonic() + self.heartbeat_interval
        while process.returncode is None:
            try:
                rss = proc.memory_info().rss
                status = proc.status()
            except psutil.Error:
                status = psutil.STATUS_ZOMBIE
            if status == psutil.STATUS_ZOMBIE:
                # it exited: end what its tasks started too, whose inherited pipes
                # would otherwise keep us waiting
                _kill_group(process.pid)
                return
            if rss:  # an exiting process reads as 0
                watch.rss = rss
            limit = self.memory_limit
            if limit and self.terminate and rss > self.terminate * limit:
                logger.warning(
                    "Worker exceeded %.0f%% memory budget. Restarting... (worker %s, pid %d: "
                    "process memory %s, limit %s)",
                    100 * self.terminate,
                    self.label,
                    process.pid,
                    format_bytes(rss),
                    format_bytes(limit),
                )
                watch.killed_for = "memory"
                _kill_group(process.pid)
                return
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self.heartbeat_interval
                try:
                    await self._vouch_or_judge(process, proc, status, watch)
                except redis.RedisError as exc:
                    logger.warning("nanny of %s cannot use Redis: %s", self.label, exc)
                    watch.heard_at = time.monotonic()  # silence now says nothing
                if watch.killed_for:
                    return
            await asyncio.sleep(self.monitor_interval)  # the monitor is a timer by nature

    async def _vouch_or_judge(
        self,
        process: asyncio.subprocess.Process,
        proc: psutil.Process,
        status: str,
        watch: _Watch,
    ) -> None:
        if watch.address is None:
            watch.address = _read(self.address_path)
            if watch.address is not None:
                self.output.set_stream(self.keys.worker_logs(watch.address))
            watch.heard_at = time.monotonic()
            return  # not about to register yet, or just now
        busy = proc.cpu_percent(None) >= BUSY_CPU_PERCENT and status not in (
            psutil.STATUS_STOPPED,
            psutil.STATUS_ZOMBIE,
        )
        if busy:  # at work, maybe in compiled code holding the GIL: it is alive
            ttl = int(self.worker_ttl * 1000)
            await self.redis.set(self.keys.worker_alive(watch.address), 1, px=ttl)
            watch.heard_at = time.monotonic()
            return
        # silence is measured on our own clock, from the last change of its heartbeat
        # that we saw (a Redis back from its AOF holds old entries; a removed worker's
        # entry is gone)
        beat = await self.redis.hget(self.keys.heartbeats, watch.address)
        if beat is None and watch.last_beat is None:  # (its address is written before it
            watch.heard_at = time.monotonic()  # registers: silence counts from then)
            return
        if beat is not None and beat != watch.last_beat:
            watch.last_beat, watch.heard_at = beat, time.monotonic()
        silent = time.monotonic() - watch.heard_at
        if silent > self.hang_timeout and not self.closing:
            logger.warning(
                "worker %s (pid %d) is alive but sent no heartbeat for %.1f s while idle: "
                "killing it (hung)",
                self.label,
                process.pid,
                silent,
            )
            watch.killed_for, watch.silent_for = "hung", silent
            _kill_group(process.pid)

    # ------------------------------------------------------------------ reporting

    async def _report(self, watch: _Watch, kind: str, reason: str, restarted: bool) -> None:
        """Tell the scheduler (through Redis) why the worker ended."""
        text = f"{reason}; {'restarted' if restarted else 'not restarted'}"
        if kind == "graceful":
            logger.info("worker %s (pid %s) %s", self.label, watch.pid, text)
        else:
            logger.warning("worker %s (pid %s) died: %s", self.label, watch.pid, text)
        backoff = Backoff(base=0.05, cap=2.0)
        for attempt in range(20):  # Redis may be restarting: try for a few seconds
            try:
                await self._send_report(watch, kind, text, restarted)
                return
            except redis.RedisError as exc:
                if attempt == 19:
                    logger.error(
                        "could not record the death of %s in Redis at %s: %s",
                        self.label,
                        redact(self.redis_url),
                        exc,
                    )
                    return
                await asyncio.sleep(backoff.next())  # backoff while Redis is away

    async def _send_report(self, watch: _Watch, kind: str, reason: str, restarted: bool) -> None:
        last: dict[str, Any] = {}
        if watch.address is not None:
            raw = await self.redis.hget(self.keys.heartbeats, watch.address)
            last = codecs.unpack_or(raw, {}, dict)  # (a stranger's: no evidence, no crash)
        evidence = deaths.evidence(watch.exit, kind, restarted, last)
        evidence.update(
            pid=watch.pid,
            host=socket.gethostname(),
            name=self.name or self.label,
            nanny_pid=os.getpid(),  # names its log stream (store/logship.py)
        )
        if kind != "graceful" and watch.address is not None:
            message = RemoveWorker(watch.address, reason=reason, how="nanny", evidence=evidence)
            stream = self.keys.worker_stream  # through a full Redis: it frees the dead's work
            packed = codecs.pack([message.to_dict()])
            lua = scripts.Scripts(self.redis, self.keys)  # type: ignore[arg-type]
            await lua.through(
                key=stream, ttl_ms=None, commands=[["XADD", stream, "*", "m", packed]]
            )
            return
        # nothing for the scheduler to do: a goodbye was said, or it never registered
        record = {
            "time": time.time(),
            "worker": watch.address or f"(not registered; pid {watch.pid})",
            "name": self.name or watch.address or self.label,
            "host": socket.gethostname(),
            "pid": watch.pid,
            "how": "nanny",
            "kind": kind,
            "reason": reason,
            "processing": [],
            "executing": list(last.get("executing", [])),
            "evidence": evidence,
            "stimulus_id": f"nanny-{self.label}-{time.time():.6f}",
        }
        pipe = self.redis.pipeline(transaction=False)
        keep_deaths, keep_events = self.retention.deaths, self.retention.events
        pipe.xadd(
            self.keys.deaths, {"m": codecs.pack(record)}, maxlen=keep_deaths, approximate=False
        )
        if kind != "graceful":  # (a graceful one's worker-left came from the scheduler)
            event = {"kind": "worker-died", "time": record["time"], **death_fields(record)}
            pipe.xadd(
                self.keys.events, {"m": codecs.pack(event)}, maxlen=keep_events, approximate=False
            )
        await pipe.execute()


def _read(path: Path) -> str | None:
    try:
        return path.read_text() or None
    except OSError:
        return None


class _Watch:
    """What the nanny learned while one worker process ran."""

    __slots__ = (
        "address", "exit", "heard_at", "killed_for", "last_beat", "oom_kills_before", "pid",
        "rss", "silent_for",
    )  # fmt: skip

    def __init__(self, oom_kills_before: int | None) -> None:
        self.address: str | None = None
        self.killed_for: str | None = None
        self.rss: int | None = None
        self.silent_for: float | None = None
        self.oom_kills_before = oom_kills_before
        self.pid: int | None = None
        self.exit = deaths.WorkerExit(returncode=0)
        self.last_beat: bytes | None = None  # its heartbeat entry as last read
        self.heard_at = time.monotonic()  # when we last saw a sign of life


def _kill_group(pid: int) -> None:
    """SIGKILL the worker and every process its tasks started (its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def _run_safely(nanny: Nanny) -> int:
    """One nanny's failure is logged and ends it alone, not its siblings."""
    try:
        return await nanny.run()
    except Exception:
        logger.exception("the nanny of %s failed", nanny.label)
        return 1


def run_nannies(nannies: list[Nanny]) -> int:
    """Run the nannies until they end; SIGTERM/SIGINT stop them gracefully (twice: now)."""

    async def run() -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: [n.request_close() for n in nannies])
        codes = await asyncio.gather(*(_run_safely(n) for n in nannies))
        return max(codes, default=0)

    return asyncio.run(run())
