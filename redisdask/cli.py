"""The ``redisdask`` command: ``scheduler``, ``worker``, ``demo``, ``config show``.

Every command that talks to a cluster takes the Redis URL as its first positional
argument (default from config, else ``redis://127.0.0.1:6379/0``) and ``--cluster NAME``.
Exit codes: 0 success, 1 failure at run time, 2 bad usage or configuration.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from redisdask.config import ConfigError, load_config
from redisdask.errors import RedisDaskError


def _setup_logging(level: str, role: str) -> None:
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)-7s {role}[{os.getpid()}] %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _add_common(parser: argparse.ArgumentParser, default_url: str, default_cluster: str) -> None:
    parser.add_argument(
        "redis_url",
        nargs="?",
        default=default_url,
        help=f"Redis URL of the cluster (default: {default_url})",
    )
    parser.add_argument(
        "--cluster",
        default=default_cluster,
        help=f"cluster name; many clusters can share one Redis (default: {default_cluster})",
    )


def build_parser() -> argparse.ArgumentParser:
    config = load_config()
    url, cluster = config.redis.url, config.cluster.name
    parser = argparse.ArgumentParser(prog="redisdask", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("scheduler", help="run the scheduler (one holds the lease; others stand by)")
    _add_common(p, url, cluster)
    p.add_argument(
        "--standby",
        action="store_true",
        help="wait for the lease of a running scheduler to expire, then take over",
    )
    p.add_argument("--lease-ttl", type=float, default=config.scheduler.lease_ttl)
    p.add_argument(
        "--allowed-failures",
        type=int,
        default=config.scheduler.allowed_failures,
        help="deaths of workers running a task before it errs with KilledWorker",
    )

    p = sub.add_parser("worker", help="run a worker")
    _add_common(p, url, cluster)
    p.add_argument("--nthreads", type=int, default=config.worker.nthreads or os.cpu_count() or 1)
    p.add_argument("--name", default=None, help="a name for logs and the monitor")
    p.add_argument("--host", default="127.0.0.1", help="interface to serve data on")
    p.add_argument("--port", type=int, default=0)
    p.add_argument(
        "--no-nanny",
        action="store_true",
        help="run a bare worker (nannies arrive in a later release; this is the default now)",
    )

    p = sub.add_parser("demo", help="run a small computation on a local cluster")
    p.add_argument(
        "redis_url", nargs="?", default=None, help="Redis URL (default: start an embedded Redis)"
    )
    p.add_argument("--workers", type=int, default=2)

    p = sub.add_parser("config", help="configuration")
    p.add_argument("action", choices=["show"], help="show: print the effective configuration")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
    except ConfigError as exc:
        print(f"redisdask: configuration error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    config = load_config()
    try:
        if args.command == "scheduler":
            _setup_logging(config.logging.level, "scheduler")
            from redisdask.scheduler import main as scheduler_main

            scheduler_main(
                args.redis_url,
                args.cluster,
                standby=args.standby,
                lease_ttl=args.lease_ttl,
                batch_size=config.scheduler.batch_size,
                allowed_failures=args.allowed_failures,
                worker_ttl=config.scheduler.worker_ttl,
                client_ttl=config.scheduler.client_ttl,
                connect_timeout=config.redis.connect_timeout,
            )
        elif args.command == "worker":
            _setup_logging(config.logging.level, f"worker:{args.name or ''}")
            from workers.worker import main as worker_main
            from workers.worker import options_from_config

            worker_main(
                args.redis_url,
                args.cluster,
                **options_from_config(config),
                nthreads=args.nthreads,
                name=args.name,
                host=args.host,
                port=args.port,
            )
        elif args.command == "demo":
            _setup_logging("WARNING", "demo")
            try:
                from redisdask.demo import run_demo
            except ModuleNotFoundError as exc:
                print(
                    f"redisdask demo needs {exc.name}: pip install 'redisdask[demo]'",
                    file=sys.stderr,
                )
                return 1

            return run_demo(args.redis_url, n_workers=args.workers)
        elif args.command == "config":
            print(config.to_yaml(), end="")
    except RedisDaskError as exc:
        print(f"redisdask {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 1
    return 0
