"""The ``redisdask`` command line: one parser per command, built from ``COMMANDS``.

Every command that talks to a cluster takes the Redis URL as its first positional
argument (default from config, else ``redis://127.0.0.1:6379/0``) and ``--cluster NAME``.
Defaults shown in ``--help`` are the effective config's (file, environment)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from redisdask import __version__
from redisdask.config import Config, load_config, parse_duration
from redisdask.placement import format_resources
from redisdask.store.acl import ROLES, parse_version

DEFAULT_EXPORTER_PORT = 9649  # redisdask exporter's /metrics
DEFAULT_DASHBOARD_PORT = 8787  # distributed's
TOKEN_ENV = "REDISDASK_DASHBOARD_TOKEN"
Subparsers = Any  # argparse's _SubParsersAction (private)


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


def _add_common(parser: argparse.ArgumentParser, config: Config) -> None:
    """The Redis URL and ``--cluster`` of every command that talks to a cluster."""
    default_url, default_cluster = config.redis.address, config.cluster.name
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


def _scheduler_command(sub: Subparsers, config: Config) -> None:
    """``redisdask scheduler``."""
    p = sub.add_parser("scheduler", help="run the scheduler (one holds the lease; others stand by)")
    _add_common(p, config)
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


def _worker_command(sub: Subparsers, config: Config) -> None:
    """``redisdask worker``."""
    p = sub.add_parser("worker", help="run a worker")
    _add_common(p, config)
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


def _status_command(sub: Subparsers, config: Config) -> None:
    """``redisdask status``."""
    p = sub.add_parser("status", help="a one-shot summary of a cluster (read-only)")
    _add_common(p, config)
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _monitor_command(sub: Subparsers, config: Config) -> None:
    """``redisdask monitor``."""
    p = sub.add_parser("monitor", help="a live dashboard of a cluster (read-only; q quits)")
    _add_common(p, config)
    p.add_argument("--interval", type=_positive_seconds, default=0.5, help="seconds between frames")


def _inspect_command(sub: Subparsers, config: Config) -> None:
    """``redisdask inspect``."""
    p = sub.add_parser("inspect", help="read-only answers from Redis about a cluster")
    what = p.add_subparsers(dest="what", required=True)
    q = what.add_parser("deaths", help="every recorded worker death, newest first: why it died")
    _add_common(q, config)
    q.add_argument("--worker", help="only this worker (address or name)")
    q.add_argument("--since", help="only this recent, e.g. '1h', '30 minutes'")
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q = what.add_parser("task", help="a task's state, error, dependencies and story")
    q.add_argument("key", help="the task's key (a future's .key)")
    _add_common(q, config)
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q = what.add_parser("worker", help="a live or dead worker: info, story, data")
    q.add_argument("worker", help="its address or name")
    _add_common(q, config)
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q = what.add_parser("keys", help="the cluster's keys in Redis by kind, with memory")
    _add_common(q, config)
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q = what.add_parser("events", help="the cluster event log (--follow: tail -f)")
    _add_common(q, config)
    q.add_argument("--follow", "-f", action="store_true", help="print new events as they come")
    q.add_argument(
        "-n", "--count", type=_int_at_least(0), default=50, help="how many recent events"
    )
    q.add_argument("--json", action="store_true", help="JSON (one object per line with -f)")


def _logs_command(sub: Subparsers, config: Config) -> None:
    """``redisdask logs``."""
    p = sub.add_parser(
        "logs", help="a process's log records from Redis: the scheduler's, or a worker's, "
        "alive or dead"
    )  # fmt: skip
    p.add_argument("process", help="'scheduler', or a worker's address or name (alive or dead)")
    _add_common(p, config)
    p.add_argument(
        "-n", "--count", type=_int_at_least(0), default=100,
        help="how many recent records (0: every one kept; default: 100)",
    )  # fmt: skip
    p.add_argument("--since", help="only this recent, e.g. '10m', '1h'")
    p.add_argument("--follow", "-f", action="store_true", help="print new records as they come")
    p.add_argument("--json", action="store_true", help="one JSON object per record")
    p.add_argument("--nanny", action="store_true", help="the worker's nanny's records instead")


def _add_listen(parser: argparse.ArgumentParser, port: int, remote: str) -> None:
    """``--port`` and ``--host`` of a command that serves HTTP (loopback by default)."""
    parser.add_argument(
        "--port",
        type=_int_at_least(0, 65535),
        default=port,
        help=f"port to serve on; 0: any free port (default: {port})",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help=f"interface to serve on; 0.0.0.0 for {remote} (default: 127.0.0.1)",
    )


def _exporter_command(sub: Subparsers, config: Config) -> None:
    """``redisdask exporter``."""
    p = sub.add_parser(
        "exporter", help="serve the cluster's figures to Prometheus on /metrics (read-only)"
    )
    _add_common(p, config)
    _add_listen(p, DEFAULT_EXPORTER_PORT, "a Prometheus on another machine")


def _dashboard_command(sub: Subparsers, config: Config) -> None:
    """``redisdask dashboard``."""
    p = sub.add_parser(
        "dashboard", help="serve the web dashboard: status, task stream, workers, logs, deaths"
    )
    _add_common(p, config)
    _add_listen(p, DEFAULT_DASHBOARD_PORT, "browsers on other machines (then set a token)")
    p.add_argument(
        "--token-env",
        metavar="VAR",
        default=TOKEN_ENV,
        help="the environment variable whose value, when set, every request must carry "
        f"(?token= once, or Authorization: Bearer) (default: {TOKEN_ENV}); never a token on "
        "the command line: ps shows it",
    )
    p.add_argument(
        "--interval",
        type=_positive_seconds,
        default=1.0,
        help="seconds between the live pages' updates (default: 1)",
    )


def _demo_command(sub: Subparsers, config: Config) -> None:
    """``redisdask demo``."""
    p = sub.add_parser("demo", help="run a small computation on a local cluster")
    p.add_argument(
        "redis_url", nargs="?", default=None, help="Redis URL (default: start an embedded Redis)"
    )
    p.add_argument("--workers", type=_int_at_least(1), default=2)
    p.add_argument(
        "--dask", action="store_true", help="only the dask.array and dask.dataframe part"
    )


def _config_command(sub: Subparsers, config: Config) -> None:
    """``redisdask config``."""
    p = sub.add_parser("config", help="configuration")
    p.add_argument("action", choices=["show"], help="show: print the effective configuration")


def _acl_command(sub: Subparsers, config: Config) -> None:
    """``redisdask acl``."""
    cluster = config.cluster.name
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


COMMANDS: tuple[Callable[[Subparsers, Config], None], ...] = (
    _scheduler_command,
    _worker_command,
    _status_command,
    _monitor_command,
    _inspect_command,
    _logs_command,
    _exporter_command,
    _dashboard_command,
    _demo_command,
    _config_command,
    _acl_command,
)


def build_parser() -> argparse.ArgumentParser:
    config = load_config()
    parser = argparse.ArgumentParser(
        prog="redisdask", description="A distributed task scheduler whose memory is Redis."
    )
    parser.add_argument("--version", action="version", version=f"redisdask {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub, config)
    return parser
