"""The ``redisdask`` command: ``scheduler``, ``worker``, ``status``, ``monitor``, ``inspect``,
``exporter``, ``demo``, ``config show``, ``acl``.

Every command that talks to a cluster takes the Redis URL as its first positional
argument (default from config, else ``redis://127.0.0.1:6379/0``) and ``--cluster NAME``.
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
import sys
from collections.abc import Callable, Sequence

import yaml

from redisdask import __version__
from redisdask.config import Config, ConfigError, load_config, parse_duration
from redisdask.errors import RedisDaskError
from redisdask.placement import format_resources
from redisdask.store.acl import PASSWORD_PLACEHOLDER, ROLES, parse_version, setuser
from redisdask.utils import logs, sizes

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
DEFAULT_EXPORTER_PORT = 9649  # redisdask exporter's /metrics


def _int_at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]``; argparse words the refusal."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f"from {low} to {high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value

    return parse


def _positive_seconds(text: str) -> float:
    """An argparse type: a finite, positive duration (``0.5``, ``'500ms'``)."""
    try:
        value = parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text!r}")
    return value


def _cluster_name(text: str) -> str:
    """An argparse type: a cluster name that can be the hash tag of its keys."""
    from redisdask.store.keyspace import validate_cluster_name

    try:
        return validate_cluster_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _redis_version(text: str) -> tuple[int, ...]:
    """An argparse type: a Redis version such as ``7.0`` or ``6.2``."""
    try:
        return parse_version(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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


def _add_common(parser: argparse.ArgumentParser, default_url: str, default_cluster: str) -> None:
    from redisdask.store.urls import redact

    parser.add_argument(
        "redis_url",
        nargs="?",
        default=default_url,
        help=f"Redis URL of the cluster, redis:// or redis+sentinel:// (default: "
        f"{redact(default_url)})",
    )
    parser.add_argument(
        "--cluster",
        type=_cluster_name,
        default=default_cluster,
        help=f"cluster name; many clusters can share one Redis (default: {default_cluster})",
    )


def build_parser() -> argparse.ArgumentParser:
    config = load_config()
    url, cluster = config.redis.address, config.cluster.name
    parser = argparse.ArgumentParser(prog="redisdask", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--version",
        action="version",
        version=f"redisdask {__version__}",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("scheduler", help="run the scheduler (one holds the lease; others stand by)")
    _add_common(p, url, cluster)
    p.add_argument(
        "--standby",
        action="store_true",
        help="stand by: take over as soon as the running scheduler dies (its Redis "
        "connections close) or its lease expires",
    )
    p.add_argument(
        "--lease-ttl",
        help="seconds the lease of a scheduler that stopped renewing it (paused, cut off) "
        "lasts before a standby takes over "
        f"(config scheduler.lease-ttl: {config.scheduler.lease_ttl})",
    )
    p.add_argument(
        "--allowed-failures",
        help="deaths of workers running a task before it errs with KilledWorker "
        f"(config scheduler.allowed-failures: {config.scheduler.allowed_failures})",
    )
    p.add_argument(
        "--wait-replicas",
        help="replicas that must acknowledge each scheduler write (Redis WAIT) so that it "
        f"survives a failover (config redis.wait-replicas: {config.redis.wait_replicas})",
    )

    p = sub.add_parser("worker", help="run a worker")
    _add_common(p, url, cluster)
    p.add_argument(
        "--nthreads",
        help="threads per worker process "
        f"(config worker.nthreads: {config.worker.nthreads or 'one per core'})",
    )
    p.add_argument("--name", default=None, help="a name for logs and the monitor")
    p.add_argument("--host", default="127.0.0.1", help="interface to serve data on")
    p.add_argument(
        "--port", type=_int_at_least(0, 65535), default=0, help="0: any free port (default)"
    )
    p.add_argument(
        "--nworkers",
        "--nprocs",
        type=_int_at_least(1),
        default=1,
        help="worker processes to start, each under a nanny of its own (default: 1)",
    )
    p.add_argument(
        "--memory-limit",
        help="bytes per worker process: 'auto' (total x min(1, nthreads / cores)), a "
        "fraction of the total (0.5), 4e9, '4GB', '4GiB', or 0 for none "
        f"(config worker.memory-limit: {config.worker.memory_limit})",
    )
    p.add_argument(
        "--local-directory",
        help="where spilled data and the nanny's worker logs go "
        f"(config worker.local-directory: {config.worker.local_directory or 'the temp dir'})",
    )
    p.add_argument(
        "--resources",
        help="abstract resources tasks may ask for (submit(..., resources={'GPU': 1})), "
        "e.g. 'GPU=2,MEM=10e9' (config worker.resources: "
        f"{format_resources(config.worker.resources) or 'none'})",
    )
    p.add_argument(
        "--no-nanny",
        action="store_true",
        help="run a bare worker: no supervision, restarts or death reasons from a nanny",
    )
    p.add_argument("--lifetime", default=None, help="retire after this long, e.g. '1 hour'")
    p.add_argument(
        "--lifetime-stagger",
        default="0",
        help="the lifetime is uniform in lifetime +- this (e.g. '5 minutes')",
    )
    p.add_argument(
        "--lifetime-restart",
        action="store_true",
        help="the nanny starts a fresh worker when one reaches its lifetime",
    )
    p.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODULE",
        help="a module (or .py file) each worker imports at start; its dask_setup(worker) "
        "runs before the worker takes work, dask_teardown(worker) at its close (repeatable)",
    )
    tls = config.comm.tls
    p.add_argument(
        "--tls-ca-file",
        help="TLS between peers (docs/security.md): the CA that signed every peer's "
        f"certificate, PEM (config comm.tls.ca-file: {tls.ca_file})",
    )
    p.add_argument(
        "--tls-cert", help=f"this worker's certificate, PEM (config comm.tls.cert: {tls.cert})"
    )
    p.add_argument("--tls-key", help=f"its private key, PEM (config comm.tls.key: {tls.key})")

    p = sub.add_parser("status", help="a one-shot summary of a cluster (read-only)")
    _add_common(p, url, cluster)
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("monitor", help="a live dashboard of a cluster (read-only; q quits)")
    _add_common(p, url, cluster)
    p.add_argument("--interval", type=_positive_seconds, default=0.5, help="seconds between frames")

    p = sub.add_parser("inspect", help="read-only answers from Redis about a cluster")
    what = p.add_subparsers(dest="what", required=True)
    q = what.add_parser("deaths", help="every recorded worker death, newest first: why it died")
    _add_common(q, url, cluster)
    q.add_argument("--worker", help="only this worker (address or name)")
    q.add_argument("--since", help="only this recent, e.g. '1h', '30 minutes'")
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q = what.add_parser("task", help="a task's state, error, dependencies and story")
    q.add_argument("key", help="the task's key (a future's .key)")
    _add_common(q, url, cluster)
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q = what.add_parser("worker", help="a live or dead worker: info, story, data")
    q.add_argument("worker", help="its address or name")
    _add_common(q, url, cluster)
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q = what.add_parser("keys", help="the cluster's keys in Redis by kind, with memory")
    _add_common(q, url, cluster)
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q = what.add_parser("events", help="the cluster event log (--follow: tail -f)")
    _add_common(q, url, cluster)
    q.add_argument("--follow", "-f", action="store_true", help="print new events as they come")
    q.add_argument(
        "-n", "--count", type=_int_at_least(0), default=50, help="how many recent events"
    )
    q.add_argument("--json", action="store_true", help="JSON (one object per line with -f)")

    p = sub.add_parser(
        "exporter", help="serve the cluster's figures to Prometheus on /metrics (read-only)"
    )
    _add_common(p, url, cluster)
    p.add_argument(
        "--port",
        type=_int_at_least(0, 65535),
        default=DEFAULT_EXPORTER_PORT,
        help=f"port of the metrics endpoint; 0: any free port (default: {DEFAULT_EXPORTER_PORT})",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to serve on; 0.0.0.0 for a Prometheus on another machine "
        "(default: 127.0.0.1)",
    )

    p = sub.add_parser("demo", help="run a small computation on a local cluster")
    p.add_argument(
        "redis_url", nargs="?", default=None, help="Redis URL (default: start an embedded Redis)"
    )
    p.add_argument("--workers", type=_int_at_least(1), default=2)
    p.add_argument(
        "--dask", action="store_true", help="only the dask.array and dask.dataframe part"
    )

    p = sub.add_parser("config", help="configuration")
    p.add_argument("action", choices=["show"], help="show: print the effective configuration")

    p = sub.add_parser("acl", help="print the Redis ACL SETUSER line of a role (docs/security.md)")
    p.add_argument("role", choices=[*ROLES, "all"], help="the role; all: one line each")
    p.add_argument(
        "--cluster", type=_cluster_name, default=cluster, help=f"cluster name (default: {cluster})"
    )
    p.add_argument("--user", help="the user's name (default: rd-<cluster>-<role>)")
    p.add_argument(
        "--redis-version",
        type=_redis_version,
        default="7.0",
        help="the version of the Redis server (default: 7.0); 6.2 has no read-only key "
        "patterns, so its client role may write keys it only reads (docs/security.md)",
    )
    p.add_argument(
        "--password-env",
        metavar="VAR",
        help="the environment variable holding the password (default: a <password> "
        "placeholder to replace); never a password on the command line: ps shows it",
    )
    return parser


def _acl(args: argparse.Namespace) -> int:
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
        from redisdask.workers.worker import main as worker_main
        from redisdask.workers.worker import options_from_config

        if lifetime is not None:
            lifetime = max(1.0, lifetime + random.uniform(-stagger, stagger))
        options = options_from_config(config)
        if local_directory:
            options["local_directory"] = local_directory
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
        return 0
    from redisdask.nanny.nanny import Nanny, run_nannies
    from redisdask.security import Security
    from redisdask.store.connection import connect

    # unreadable TLS files are the same for every restart too: refuse them now
    security = Security.from_config(config)

    # a wrong URL or a Redis that is down is the same for every restart: say so once
    connect(args.redis_url, timeout=config.redis.connect_timeout).close()

    _check_preloads(args.preload)  # here, before nannies start workers that cannot
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


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
    except ConfigError as exc:
        print(f"redisdask: configuration error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        overrides, labels = _flag_overrides(args)
        config = load_config(overrides, labels=labels)
    except ConfigError as exc:
        print(f"redisdask {args.command}: {exc}", file=sys.stderr)
        return 2
    try:
        if args.command == "scheduler":
            logs.setup(config.logging.level, "scheduler", log_format=config.logging.format)
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
        elif args.command == "worker":
            role = "worker" if args.no_nanny else "nanny"
            logs.setup(config.logging.level, role, args.name, config.logging.format)
            return _worker(args, config)
        elif args.command == "exporter":
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
        elif args.command in ("inspect", "status", "monitor"):
            return _read_only(args, config)
        elif args.command == "demo":
            logs.setup("WARNING", "demo", log_format=config.logging.format)
            try:
                from redisdask.cli.demo import run_demo
            except ModuleNotFoundError as exc:
                print(
                    f"redisdask demo needs {exc.name}: pip install 'redisdask[demo]'",
                    file=sys.stderr,
                )
                return 1

            return run_demo(args.redis_url, n_workers=args.workers, only_dask=args.dask)
        elif args.command == "config":
            print(config.to_yaml(), end="")
        elif args.command == "acl":
            return _acl(args)
    except ConfigError as exc:
        print(f"redisdask {args.command}: {exc}", file=sys.stderr)
        return 2
    except RedisDaskError as exc:
        print(f"redisdask {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 1
    return 0
