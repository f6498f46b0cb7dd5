"""``LocalCluster``: Redis (embedded when no URL is given), a scheduler and workers as
subprocesses of this one, all stopped by ``close()``."""

from __future__ import annotations

import atexit
import contextlib
import logging
import subprocess
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import psutil

from redisdask.config import load_config
from redisdask.deploy.embedded import EmbeddedRedis
from redisdask.errors import ClusterRunningError, RedisDaskError
from redisdask.placement import format_resources, parse_resources
from redisdask.protocol import CloseWorker
from redisdask.security import Security
from redisdask.store import bootstrap, busy, codecs
from redisdask.store.connection import connect
from redisdask.store.keyspace import Keys
from redisdask.store.urls import redact
from redisdask.utils import spawn
from redisdask.utils.owner import Ownership, owned_redis
from redisdask.utils.ports import free_port

logger = logging.getLogger("redisdask.deploy.cluster")


# the clusters not closed yet (kept: one nobody holds any more is still closed at exit)
_open: set[LocalCluster] = set()
EXIT_CLOSE_TIMEOUT = 10.0  # seconds each process of a cluster gets to stop at exit


@atexit.register
def _close_at_exit() -> None:
    """As distributed closes its clusters at exit: a script that ends without
    ``close()`` leaves no scheduler or worker running.  After the clients' goodbyes (their
    handler is registered later, so it runs first), before an embedded Redis stops
    (``deploy.embedded``, registered earlier)."""
    for cluster in list(_open):
        try:
            cluster.close(EXIT_CLOSE_TIMEOUT)
        except Exception:
            logger.exception("closing %r at exit failed", cluster)


class LocalCluster:
    """A whole cluster on this machine.

    With ``processes=False`` the workers run in threads of this process, each on its own
    event loop (the scheduler is still a subprocess: it must be killable on its own).
    Worker processes run under nannies by default, as in distributed and as
    ``redisdask worker`` does: a nanny restarts its worker when it dies (a segfaulting
    task, the memory limit) and records why, so such a task ends in ``KilledWorker``
    instead of leaving the cluster without workers.  ``worker_processes`` are then the
    nannies' processes; ``nanny=False`` runs bare workers.  ``resources`` (``{"GPU": 2}``
    or ``"GPU=2"``) are given to every worker, as ``LocalCluster(resources=...)`` does in
    Dask; ``start_worker(resources=...)`` gives one worker its own.  ``security``
    (``Security(tls_ca_file=..., tls_cert=..., tls_key=...)``, default: the config's
    ``comm.tls``) gives every worker TLS between peers; ``Client(cluster)`` uses it too.
    ``dashboard_address`` (``":8787"``, ``"0.0.0.0:8787"``; port 0: any free one) starts
    ``redisdask dashboard`` too, on loopback unless a host is named, on another free port
    (with a warning) when that one is taken, as Dask does; ``dashboard_link`` is its URL.
    None (the default, unlike Dask's) starts none: a cluster costs one process less.
    """

    def __init__(
        self,
        n_workers: int = 2,
        threads_per_worker: int = 1,
        processes: bool = True,
        redis_url: str | None = None,
        cluster_name: str | None = None,
        *,
        start_timeout: float = 30.0,
        log_directory: str | Path | None = None,
        silence_logs: str = "WARNING",
        worker_options: dict[str, Any] | None = None,
        scheduler_options: dict[str, Any] | None = None,
        nanny: bool = True,
        resources: dict[str, float] | str | None = None,
        security: Security | None = None,
        dashboard_address: str | None = None,
    ) -> None:
        # checked before anything starts: a mistake is one clear error, not dead workers
        self.resources = parse_resources(resources, "LocalCluster(resources=...)")
        dashboard = None if dashboard_address is None else _host_port(dashboard_address)
        self.security = security or Security.from_config()
        self.cluster_name = cluster_name or f"local-{uuid.uuid4().hex[:8]}"
        self.keys = Keys(self.cluster_name)
        self.n_workers = n_workers
        self.use_processes = processes
        self.nanny = nanny and processes
        self.threads_per_worker = threads_per_worker
        self.worker_options = worker_options or {}
        self.scheduler_options = scheduler_options or {}
        self.start_timeout = start_timeout
        self.embedded: EmbeddedRedis | None = None
        if redis_url is None:
            self.embedded = EmbeddedRedis().start()
            redis_url = self.embedded.url
        self.redis_url = redis_url
        self.redis = connect(redis_url)
        self._refuse_a_running_cluster()
        bootstrap.ensure_cluster(self.redis, self.keys)
        self.log_directory = Path(log_directory) if log_directory else None
        self.log_level = "INFO" if self.log_directory else silence_logs
        self.scheduler_process: subprocess.Popen[bytes] | None = None
        self.worker_processes: list[subprocess.Popen[bytes]] = []
        self.thread_workers: list[Any] = []  # workers.process.ThreadWorker
        self._logs: list[Any] = []
        self.dashboard_process: subprocess.Popen[bytes] | None = None
        self.dashboard_link: str | None = None
        self._close_lock = threading.Lock()  # (at exit, a client's and the exit handler's)
        self.closed = False
        self._ownership = Ownership()  # its processes end with this one (utils/owner.py)
        _open.add(self)
        try:
            self.start_scheduler()
            for i in range(n_workers):
                self.start_worker(name=f"worker-{i}")
            if dashboard is not None:
                self._start_dashboard(*dashboard)
            self.wait_for_workers(n_workers, timeout=start_timeout)
            if self.dashboard_link is not None:
                self._wait_for_dashboard(self.dashboard_link, start_timeout)
        except BaseException:
            self.close()
            raise

    def _refuse_a_running_cluster(self) -> None:
        """A second scheduler (a standby) and more workers would join a cluster that runs
        under this name: ``Client(redis_url=...)`` reads like a connection, but with no
        address it starts a cluster."""
        if self.redis.exists(self.keys.leader):
            url = redact(self.redis_url)
            raise ClusterRunningError(
                f"cluster {self.cluster_name!r} already runs at {url} (a scheduler leads "
                f"it, or one killed less than scheduler.lease-ttl ago did): to use it, "
                f"connect with Client({url!r}, cluster_name={self.cluster_name!r}); to "
                f"start another, give a new name"
            )

    def _spawn(self, args: list[str], label: str, **extra_env: str) -> subprocess.Popen[bytes]:
        if self.closed:
            raise RedisDaskError(f"{self!r} is closed: start a new LocalCluster")
        out: Any = subprocess.DEVNULL
        if self.log_directory is not None:
            self.log_directory.mkdir(parents=True, exist_ok=True)
            out = open(self.log_directory / f"{label}.log", "ab")  # noqa: SIM115 - kept open
            self._logs.append(out)
        # the URL (it may hold a password) goes by environment, not on a command line
        # that every user of the machine can read with ps
        env = spawn.environment(
            PYTHONUNBUFFERED="1",
            REDISDASK__LOGGING__LEVEL=self.log_level,
            REDISDASK__REDIS__URL=self.redis_url,
            **self.security.environment(),
            **self._ownership.environment(),
            **extra_env,
        )
        return subprocess.Popen(
            spawn.command(*args),
            pass_fds=(self._ownership.fd,),
            stdout=out,
            stderr=subprocess.STDOUT if out is not subprocess.DEVNULL else None,
            env=env,
        )

    def start_scheduler(self, standby: bool = False) -> subprocess.Popen[bytes]:
        """Start (or, after it died, restart) the scheduler process, or a standby."""
        args = ["scheduler", "--cluster", self.cluster_name]
        if standby:
            args.append("--standby")
        for option, value in self.scheduler_options.items():
            args += [f"--{option.replace('_', '-')}", str(value)]
        # (killed with this process, it stops an embedded Redis too: utils/owner.py)
        pid = self.embedded.pid if self.embedded else None
        owned = owned_redis(pid) if pid is not None else {}
        self.scheduler_process = self._spawn(args, "scheduler", **owned)
        return self.scheduler_process

    def start_worker(
        self, name: str | None = None, resources: dict[str, float] | str | None = None
    ) -> Any:
        """Start a worker process (or, with ``processes=False``, a worker thread), with
        the cluster's ``resources`` or, given, these."""
        given = self.resources if resources is None else parse_resources(resources)
        if not self.use_processes:
            from redisdask.workers.process import ThreadWorker, options_from_config

            options = {**options_from_config(load_config()), **self.worker_options}
            options["security"] = self.security
            if given:
                options["resources"] = given
            worker = ThreadWorker(
                self.redis_url,
                self.cluster_name,
                name=name,
                nthreads=self.threads_per_worker,
                **options,
            )
            self.thread_workers.append(worker.start(self.start_timeout))
            return worker
        args = [
            "worker",
            "--cluster",
            self.cluster_name,
            "--nthreads",
            str(self.threads_per_worker),
        ]
        if not self.nanny:
            args.append("--no-nanny")
        if name:
            args += ["--name", name]
        if given:
            args += ["--resources", format_resources(given)]
        for option, value in self.worker_options.items():
            flag = f"--{option.replace('_', '-')}"
            if value is True:
                args.append(flag)
            elif isinstance(value, list | tuple):  # a repeatable flag, e.g. preload
                for item in value:
                    args += [flag, str(item)]
            elif value is not False and value is not None:
                args += [flag, str(value)]
        proc = self._spawn(args, name or f"worker-{len(self.worker_processes)}")
        self.worker_processes.append(proc)
        return proc

    def _start_dashboard(self, host: str, free: int) -> None:
        """``redisdask dashboard`` on ``host:free``."""
        args = ["dashboard", "--cluster", self.cluster_name, "--host", host, "--port", str(free)]
        self.dashboard_process = self._spawn(args, "dashboard")
        shown = f"[{host}]" if ":" in host else host
        self.dashboard_link = f"http://{shown}:{free}/status"

    def _wait_for_dashboard(self, link: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        health = link.rsplit("/", 1)[0] + "/health"
        while True:
            try:
                with urllib.request.urlopen(health, timeout=2):
                    return
            except OSError as exc:
                process = self.dashboard_process
                if process is not None and process.poll() is not None:
                    raise RedisDaskError(
                        f"the dashboard exited with code {process.returncode} during "
                        "start-up (is redisdask[dashboard] installed? was its port taken "
                        "meanwhile?); pass log_directory= to see why"
                    ) from exc
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the dashboard did not answer within {timeout} s") from exc
            time.sleep(0.05)  # start-up: poll a condition with a deadline

    def wait_for_workers(self, n: int, timeout: float = 30.0) -> None:
        """Until ``n`` workers registered and a scheduler holds the lease."""
        deadline = time.monotonic() + timeout
        while self.redis.hlen(self.keys.workers) < n or not self.redis.exists(self.keys.lease):
            for proc in [self.scheduler_process, *self.worker_processes]:
                if proc is not None and proc.poll() is not None:
                    raise RedisDaskError(
                        f"a cluster process ({' '.join(map(str, proc.args[2:4]))}) exited with "  # type: ignore[index]
                        f"code {proc.returncode} during start-up; pass log_directory= to see why"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {self.redis.hlen(self.keys.workers)} of {n} workers "
                    f"registered within {timeout} s"
                )
            time.sleep(0.02)  # start-up: poll a condition with a deadline

    @property
    def subprocesses(self) -> list[subprocess.Popen[bytes]]:
        processes = [self.scheduler_process, *self.worker_processes, self.dashboard_process]
        return [p for p in processes if p is not None]

    def close(self, timeout: float = 10.0) -> None:
        """Stop workers (gracefully), the scheduler and an embedded Redis; leave nothing.
        Once: a second call waits for the first to end."""
        with self._close_lock:
            if not self.closed:
                self._close(timeout)
                self.closed = True
                _open.discard(self)

    def _close(self, timeout: float) -> None:
        for worker in self.thread_workers:
            try:
                worker.close(timeout)
            except Exception:
                logger.exception("an in-process worker did not close cleanly")
        self._tell_workers_to_close()
        for proc in self.worker_processes:
            if proc.poll() is None:
                proc.terminate()
        _wait_all(self.worker_processes, timeout)
        for proc in (self.scheduler_process, self.dashboard_process):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                _wait_all([proc], timeout)
        if getattr(self, "redis", None) is not None:
            self.redis.close()
        if self.embedded is not None:
            self.embedded.stop()
        for f in self._logs:
            f.close()
        self._ownership.close()

    def _tell_workers_to_close(self) -> None:
        """The whole cluster stops, so its workers need not move their data to each other
        (what SIGTERM alone would make them do): tell each to close now."""
        try:
            addresses = self.redis.hkeys(self.keys.workers)
            pipe = self.redis.pipeline(transaction=False)
            message = codecs.entry([CloseWorker("the cluster is closing").to_dict()])
            for address in addresses:
                pipe.xadd(self.keys.worker_inbox(address.decode()), message)
            with busy.raised():  # (a full Redis: the signals below do it)
                pipe.execute()
        except Exception as exc:  # Redis gone: the signals below still stop them
            logger.warning("could not tell the workers to close through Redis: %s", exc)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"LocalCluster({self.cluster_name!r}, workers={len(self.worker_processes)}, "
            f"redis={redact(self.redis_url)})"
        )


def _host_port(address: str) -> tuple[str, int]:
    """``(host, port)`` for a ``dashboard_address`` (``":8787"``: loopback): its port if
    free, else another (said), checked before anything starts."""
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_text or 8787)
    except ValueError:
        raise ValueError(f"dashboard_address={address!r}: not host:port") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"dashboard_address={address!r}: no port {port}")
    try:
        free = free_port(host, port)
    except OSError as exc:
        raise ValueError(
            f"dashboard_address={address!r}: cannot listen on {host} ({exc}); give an "
            "address of this machine, e.g. 127.0.0.1 or 0.0.0.0"
        ) from None
    if port and free != port:
        logger.warning("port %d is already in use: the dashboard is on port %d instead", port, free)
    return host, free


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("process %d did not stop in %g s; killing it", proc.pid, timeout)
            with contextlib.suppress(psutil.NoSuchProcess):  # (it ended just now)
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
            proc.kill()
            proc.wait()
