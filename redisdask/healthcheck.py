"""``python -m redisdask.healthcheck ROLE``: the healthchecks of compose.yaml's services.

Exit 0 when healthy, 1 (with the reason on stderr) when not:

* ``scheduler``: a scheduler holds the cluster's lease (for a standby too: it is healthy
  while the cluster is led, by it or by the other);
* ``worker``: a worker on this host (``socket.gethostname()``: the container) has sent a
  heartbeat within ``scheduler.worker-ttl``;
* ``exporter [PORT]``: the exporter on this host answers ``/metrics`` (default port 9649);
* ``dashboard [PORT]``: the dashboard on this host answers ``/health`` (default 8787).

The Redis URL and cluster name come from the config and its environment variables
(``REDISDASK__REDIS__URL``, ``REDISDASK__CLUSTER__NAME``), as for the processes checked.
Like the monitor, it only reads.
"""

from __future__ import annotations

import socket
import sys
import urllib.request
from collections.abc import Sequence

from redisdask.config import load_config
from redisdask.observe.snapshot import Snapshot, read_snapshot
from redisdask.store.connection import connect
from redisdask.store.keyspace import Keys
from redisdask.store.urls import redact

HTTP_CHECKS = {"exporter": (9649, "/metrics"), "dashboard": (8787, "/health")}


def check(role: str, snap: Snapshot, host: str, worker_ttl: float) -> str | None:
    """Why ``role`` is unhealthy in ``snap``, or None."""
    if role == "scheduler":
        return None if snap.has_scheduler else "no scheduler holds the lease"
    fresh = [
        w
        for w in snap.workers
        if w.host == host and w.heartbeat_age is not None and w.heartbeat_age < worker_ttl
    ]
    return None if fresh else f"no worker on {host} sent a heartbeat in the last {worker_ttl:g} s"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("scheduler", "worker", *HTTP_CHECKS):
        print("usage: python -m redisdask.healthcheck scheduler|worker|exporter|dashboard "
              "[PORT]", file=sys.stderr)  # fmt: skip
        return 2
    role = args[0]
    try:
        if role in HTTP_CHECKS:
            default, path = HTTP_CHECKS[role]
            port = int(args[1]) if len(args) > 1 else default
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
                return 0 if answer.status == 200 else 1
        config = load_config()
        r = connect(config.redis.address, timeout=config.redis.connect_timeout)
        try:
            snap = read_snapshot(r, Keys(config.cluster.name), events=1, deaths=1, others=False)
        finally:
            r.close()
        why = check(role, snap, socket.gethostname(), config.scheduler.worker_ttl)
    except Exception as exc:  # unreachable Redis or exporter, a bad config: unhealthy
        print(f"unhealthy: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if why is not None:
        print(f"unhealthy: {why} (cluster {config.cluster.name!r} at "
              f"{redact(config.redis.address)})", file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
