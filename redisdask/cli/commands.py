"""What the ``redisdask`` commands do: ``scheduler``, ``worker``, ``status``, ``monitor``,
``inspect``, ``exporter``, ``demo``, ``config show``, ``acl`` (their flags: ``parser.py``),
each run by its entry in ``RUNNERS``.

A URL with a password belongs in the environment (``REDISDASK__REDIS__URL``) or the config
file rather than on the command line, where ``ps`` shows it to every user of the machine.
Exit codes: 0 success, 1 failure at run time, 2 bad usage or configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import random
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

import yaml

from redisdask.cli.parser import build_parser
from redisdask.config import Config, ConfigError, load_config, parse_duration
from redisdask.errors import RedisDaskError
from redisdask.placement import format_resources
from redisdask.store.acl import PASSWORD_PLACEHOLDER, ROLES, setuser
from redisdask.utils import logs, owner, sizes

# Flags that set a config key: their values go through the config's own validation (with
# the flag named as the source), so `--lease-ttl 0` fails exactly as the YAML key would.
# Numbers are read as YAML, like an environment variable's value; paths are taken as given.
CONFIG_FLAGS = {
    "lease_ttl": "scheduler.lease-ttl",
    "allowed_failures": "scheduler.allowed-failures",
    "wait_replicas": "redis.wait-replicas",
    "nthreads": "worker.nthreads",
    "memory_limit": "worker.memory-limit",
    "resources": "worker.resources",
}
CONFIG_PATH_FLAGS = {
    "local_directory": "worker.local-directory",
    "tls_ca_file": "comm.tls.ca-file",
    "tls_cert": "comm.tls.cert",
    "tls_key": "comm.tls.key",
}


def _check_host(flag: str, host: str) -> None:
    """A ``--host`` to serve on must be an address of this machine: say so before any
    process starts (a worker under a nanny would fail to bind at every restart)."""
    import socket

    try:
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
    except (OSError, UnicodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(
            f"{flag} {host!r}: cannot serve on it ({why}); give a name or address of one of "
            "this machine's interfaces, e.g. 127.0.0.1, 0.0.0.0 (all) or its LAN address"
        ) from None


def _flag_overrides(args: argparse.Namespace) -> tuple[dict[str, object], dict[str, str]]:
    """The config keys the given flags set, and which flag set each."""
    overrides, labels = {}, {}
    for attr, key in (*CONFIG_FLAGS.items(), *CONFIG_PATH_FLAGS.items()):
        raw = getattr(args, attr, None)
        if raw is not None:
            value: object = raw
            if attr in CONFIG_FLAGS:
                with contextlib.suppress(yaml.YAMLError):  # the config then names the value
                    value = yaml.safe_load(raw) if raw.strip() else raw
            overrides[key] = value
            labels[key] = f"command-line flag --{attr.replace('_', '-')}"
    return overrides, labels


def _acl(args: argparse.Namespace, _config: Config) -> int:
    """``redisdask acl``: the ``ACL SETUSER`` lines, for ``redis-cli`` (or ACL files)."""
    password = None
    if args.password_env is not None:
        password = os.environ.get(args.password_env)
        if not password:
            raise ConfigError(
                f"--password-env {args.password_env}: that environment variable is not set "
                f"or empty; export it first (e.g. {args.password_env}=$(openssl rand -hex 32))"
            )
    roles = ROLES if args.role == "all" else (args.role,)
    if args.user and len(roles) > 1:
        raise ConfigError("--user names one user: give one role, not all")
    try:
        lines = [
            setuser(r, args.cluster, user=args.user, password=password, version=args.redis_version)
            for r in roles
        ]
    except ValueError as exc:  # a cluster name that cannot be a hash tag
        raise ConfigError(str(exc)) from None
    print("\n".join(lines))
    if password is None:
        print(f"redisdask acl: replace {PASSWORD_PLACEHOLDER} before use, or pass "
              "--password-env VAR", file=sys.stderr)  # fmt: skip
    return 0


def _worker(args: argparse.Namespace, config: Config) -> int:
    """``redisdask worker``: nannies, each supervising a worker process, or a bare worker."""
    nthreads = config.worker.nthreads or os.cpu_count() or 1
    local_directory = config.worker.local_directory
    memory_limit = sizes.memory_limit(config.worker.memory_limit or None, nthreads)
    try:
        lifetime = parse_duration(args.lifetime) if args.lifetime is not None else None
        stagger = parse_duration(args.lifetime_stagger)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if lifetime is not None and not lifetime > 0:
        raise ConfigError(f"--lifetime must be more than 0 seconds, got {args.lifetime!r}")
    _check_host("--host", args.host)
    if args.no_nanny:
        if args.nworkers > 1:
            raise ConfigError("--nworkers > 1 needs nannies: drop --no-nanny")
        if lifetime is not None:
            lifetime = max(1.0, lifetime + random.uniform(-stagger, stagger))
        _bare_worker(args, config, nthreads, memory_limit, lifetime)
        return 0
    from redisdask.nanny.nanny import Nanny, run_nannies
    from redisdask.store.connection import connect

    worker_args = _nanny_worker_args(args, config, nthreads)
    # a wrong URL or a Redis that is down is the same for every restart: say so once
    connect(args.redis_url, timeout=config.redis.connect_timeout).close()
    _check_preloads(args.preload)  # here, before nannies start workers that cannot
    nannies = [
        Nanny(
            args.redis_url,
            args.cluster,
            index=i,
            name=f"{args.name}-{i}" if args.name and args.nworkers > 1 else args.name,
            worker_args=worker_args,
            memory_limit=memory_limit,
            terminate=config.worker.memory.terminate,
            monitor_interval=config.worker.memory.monitor_interval,
            heartbeat_interval=config.worker.heartbeat_interval,
            worker_ttl=config.scheduler.worker_ttl,
            hang_timeout=config.worker.hang_timeout,
            local_directory=local_directory,
            lifetime=lifetime,
            lifetime_stagger=stagger,
            lifetime_restart=args.lifetime_restart,
            connect_timeout=config.redis.connect_timeout,
            retention=config.retention,
        )
        for i in range(args.nworkers)
    ]
    return run_nannies(nannies)


def _bare_worker(
    args: argparse.Namespace,
    config: Config,
    nthreads: int,
    memory_limit: int,
    lifetime: float | None,
) -> None:
    """``--no-nanny``: one worker in this process, until it is told to stop."""
    from redisdask.workers.process import main as worker_main
    from redisdask.workers.process import options_from_config

    options = options_from_config(config)
    if config.worker.local_directory:
        options["local_directory"] = config.worker.local_directory
    worker_main(
        args.redis_url,
        args.cluster,
        **options,
        nthreads=nthreads,
        name=args.name,
        host=args.host,
        port=args.port,
        memory_limit=memory_limit,
        lifetime=lifetime,
        preload=args.preload,
    )


def _nanny_worker_args(args: argparse.Namespace, config: Config, nthreads: int) -> list[str]:
    """The command-line arguments each nanny gives its ``redisdask worker --no-nanny``."""
    from redisdask.security import Security

    # unreadable TLS files are the same for every restart too: refuse them now
    security = Security.from_config(config)
    worker_args = ["--nthreads", str(nthreads), "--host", args.host]
    for name in args.preload:
        worker_args += ["--preload", name]
    if config.worker.resources:
        worker_args += ["--resources", format_resources(config.worker.resources)]
    if args.port and args.nworkers == 1:
        worker_args += ["--port", str(args.port)]
    for flag, path in (
        ("--tls-ca-file", security.tls_ca_file),
        ("--tls-cert", security.tls_cert),
        ("--tls-key", security.tls_key),
    ):
        if path:
            worker_args += [flag, path]
    return worker_args


def _logs(r: Any, keys: Any, args: argparse.Namespace, since: float | None) -> int:
    from redisdask.observe.logs import logs_command, stream_of

    try:
        stream = stream_of(r, keys, args.process, args.nanny)
    except LookupError as exc:
        print(f"redisdask logs: {exc.args[0]}", file=sys.stderr)
        return 1
    logs_command(r, stream, count=args.count, since=since, follow=args.follow, as_json=args.json)
    return 0


def _check_preloads(names: list[str]) -> None:
    """A ``--preload`` that cannot be found, said at once (its import runs in the workers:
    only whether it can be found is checked here, nothing of it runs)."""
    for name in names:
        if name.endswith(".py"):
            found = os.path.isfile(name)
        else:
            try:
                found = importlib.util.find_spec(name.partition(".")[0]) is not None
            except (ImportError, ValueError):
                found = False
        if not found:
            raise ConfigError(
                f"--preload {name!r}: no such module or file. A preload is a module the "
                "worker can import (installed, or on its PYTHONPATH) or the path of a .py file"
            )


def _read_only(args: argparse.Namespace, config: Config) -> int:
    """``status``, ``monitor`` and ``inspect ...``: they only ever read Redis."""
    from rich.console import Console

    from redisdask.observe import inspect
    from redisdask.store.connection import connect
    from redisdask.store.keyspace import Keys
    from redisdask.store.urls import redact

    console = Console()
    keys = Keys(args.cluster)
    since = None
    if getattr(args, "since", None):
        try:
            since = parse_duration(args.since)
        except ValueError as exc:
            raise ConfigError(f"--since: {exc}") from None
    r = connect(args.redis_url, timeout=config.redis.connect_timeout)
    try:
        if args.command == "logs":
            return _logs(r, keys, args, since)
        if args.command == "monitor":
            from redisdask.observe.monitor import run_monitor

            return run_monitor(r, keys, redact(args.redis_url), interval=args.interval)
        if args.command == "status":
            from redisdask.observe.snapshot import read_snapshot
            from redisdask.observe.views import status_view

            snap = read_snapshot(r, keys)
            if args.json:
                inspect.print_json(console, snap.to_dict())
            else:
                console.print(status_view(snap, redact(args.redis_url), console.width))
            if snap.exists:
                return 0
            found = ", ".join(snap.other_clusters) or "none"
            print(f"redisdask status: no cluster named {args.cluster!r} on "
                  f"{redact(args.redis_url)} (clusters there: {found}); check --cluster",
                  file=sys.stderr)  # fmt: skip
            return 1
        if args.what == "deaths":
            inspect.deaths_command(
                r, keys, worker=args.worker, since=since, as_json=args.json, console=console
            )
        elif args.what == "task":
            task = inspect.read_task(r, keys, args.key)
            if args.json:
                inspect.print_json(console, task)
            else:
                inspect.render_task(task, console)
            if task["state"] == "unknown" and not task["story"]:
                print(f"redisdask inspect task: no task {args.key!r} in cluster {args.cluster!r}",
                      file=sys.stderr)  # fmt: skip
                return 1
        elif args.what == "worker":
            worker = inspect.read_worker(r, keys, args.worker)
            if worker is None:
                print(
                    f"redisdask inspect worker: no worker {args.worker!r}, live or dead, in "
                    f"cluster {args.cluster!r} (redisdask status lists the live ones)",
                    file=sys.stderr,
                )
                return 1
            if args.json:
                inspect.print_json(console, worker)
            else:
                inspect.render_worker(worker, console)
        elif args.what == "keys":
            rows = inspect.read_keys(r, keys)
            if args.json:
                inspect.print_json(console, rows)
            else:
                inspect.render_keys(rows, keys, console)
        elif args.what == "events":
            inspect.events_command(
                r, keys, count=args.count, follow=args.follow, as_json=args.json, console=console
            )
    finally:
        r.close()
    return 0


def _run_scheduler(args: argparse.Namespace, config: Config) -> int:
    logs.setup(config.logging.level, "scheduler", log_format=config.logging.format)
    from redisdask.store import logship
    from redisdask.store.keyspace import Keys

    logship.install(args.redis_url, config, Keys(args.cluster).scheduler_logs)
    from redisdask.scheduler.driver import main as scheduler_main

    scheduler_main(
        args.redis_url,
        args.cluster,
        standby=args.standby,
        lease_ttl=config.scheduler.lease_ttl,
        batch_size=config.scheduler.batch_size,
        allowed_failures=config.scheduler.allowed_failures,
        worker_ttl=config.scheduler.worker_ttl,
        client_ttl=config.scheduler.client_ttl,
        work_stealing=config.scheduler.work_stealing,
        connect_timeout=config.redis.connect_timeout,
        retention=config.retention,
        rebalance=config.worker.memory.rebalance,
        wait_replicas=config.redis.wait_replicas,
        wait_timeout=config.redis.wait_timeout,
    )
    return 0


def _run_worker(args: argparse.Namespace, config: Config) -> int:
    role = "worker" if args.no_nanny else "nanny"
    logs.setup(config.logging.level, role, args.name, config.logging.format)
    from redisdask.store import logship
    from redisdask.store.keyspace import Keys

    # a worker's stream is named by its address, once it listens (``Worker.start``)
    nanny = Keys(args.cluster).nanny_logs(f"{socket.gethostname()}-{os.getpid()}")
    logship.install(args.redis_url, config, None if args.no_nanny else nanny)
    return _worker(args, config)


def _run_exporter(args: argparse.Namespace, config: Config) -> int:
    logs.setup(config.logging.level, "exporter", args.cluster, config.logging.format)
    _check_host("--host", args.host)
    from redisdask.observe.exporter import run_exporter

    return run_exporter(
        args.redis_url,
        args.cluster,
        host=args.host,
        port=args.port,
        connect_timeout=config.redis.connect_timeout,
    )


def _run_dashboard(args: argparse.Namespace, config: Config) -> int:
    logs.setup(config.logging.level, "dashboard", args.cluster, config.logging.format)
    _check_host("--host", args.host)
    try:
        from redisdask.dashboard.serve import run_dashboard
    except ModuleNotFoundError as exc:
        print(
            f"redisdask dashboard needs {exc.name}: pip install 'redisdask[dashboard]'",
            file=sys.stderr,
        )
        return 1
    return run_dashboard(
        args.redis_url,
        args.cluster,
        host=args.host,
        port=args.port,
        token=os.environ.get(args.token_env) or None,
        interval=args.interval,
        connect_timeout=config.redis.connect_timeout,
    )


def _run_demo(args: argparse.Namespace, config: Config) -> int:
    logs.setup("WARNING", "demo", log_format=config.logging.format)
    try:
        from redisdask.cli.demo import run_demo
    except ModuleNotFoundError as exc:
        print(f"redisdask demo needs {exc.name}: pip install 'redisdask[demo]'", file=sys.stderr)
        return 1
    return run_demo(args.redis_url, n_workers=args.workers, only_dask=args.dask)


def _run_config(_args: argparse.Namespace, config: Config) -> int:
    print(config.to_yaml(), end="")
    return 0


# each command's runner, by the name the parser gives it (``parser.COMMANDS``)
RUNNERS: dict[str, Callable[[argparse.Namespace, Config], int]] = {
    "scheduler": _run_scheduler,
    "worker": _run_worker,
    "status": _read_only,
    "monitor": _read_only,
    "inspect": _read_only,
    "logs": _read_only,
    "exporter": _run_exporter,
    "dashboard": _run_dashboard,
    "demo": _run_demo,
    "config": _run_config,
    "acl": _acl,
}


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
    except ConfigError as exc:
        print(f"redisdask: configuration error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    owner.watch_owner()  # (a process a LocalCluster started: it ends with that process)
    try:
        overrides, labels = _flag_overrides(args)
        config = load_config(overrides, labels=labels)
    except ConfigError as exc:
        print(f"redisdask {args.command}: {exc}", file=sys.stderr)
        return 2
    try:
        return RUNNERS[args.command](args, config)
    except ConfigError as exc:
        print(f"redisdask {args.command}: {exc}", file=sys.stderr)
        return 2
    except RedisDaskError as exc:
        print(f"redisdask {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 1
