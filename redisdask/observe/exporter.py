"""``redisdask exporter``: a cluster's figures for Prometheus, read from Redis alone.

Each scrape of ``/metrics`` is one ``read_snapshot`` (the same pipeline of read-only
commands that ``status`` and each frame of ``monitor`` cost) plus an ``XRANGE`` of the
deaths stream from where the previous scrape stopped.  The exporter writes nothing and
joins no consumer group, so it runs as a Redis user allowed only reads, from any machine
that reaches Redis, and any number of exporters can watch a cluster.

A scrape that cannot read Redis (down, refused, a wrong password) answers
``redisdask_up 0`` and nothing else, and logs why once per distinct cause; the exporter
itself keeps serving.  Names follow distributed's Prometheus metrics where one exists
(``dask_scheduler_tasks{state}`` is ``redisdask_scheduler_tasks{state}``,
``dask_worker_memory_bytes{type}`` is ``redisdask_worker_memory_bytes{type}``,
``dask_worker_transfer_incoming_count_total`` is
``redisdask_worker_transfer_incoming_count_total``); every
metric carries the ``cluster`` label, since many clusters can share one Redis.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import redis
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from redisdask.observe.snapshot import Snapshot, read_snapshot
from redisdask.store import codecs
from redisdask.store.connection import connect
from redisdask.store.keyspace import Keys
from redisdask.store.lease import token_number
from redisdask.store.urls import redact

logger = logging.getLogger("redisdask.observe.exporter")

DEATHS_PAGE = 1000  # entries of the deaths stream per XRANGE
# the scheduler's task states, always exported (a state with no task is 0, not absent,
# so that a graph of it does not break off)
TASK_STATES = ("released", "waiting", "queued", "no-worker", "processing", "memory", "erred")
# the worker task states distributed's dask_worker_tasks reports, from our heartbeats
WORKER_TASK_STATES = {"executing": "executing", "ready": "ready", "stored": "in_memory"}
# a worker's counters of the dependencies it fetched (workers/transfers.py); the first
# is Dask's dask_worker_transfer_incoming_count_total, the others have no Dask equivalent
TRANSFER_COUNTERS = {
    "transfer_incoming_count_total": "Total number of data transfers from other workers "
    "since the worker was started (failed ones included)",
    "transfer_incoming_bytes_total": "Total size of the data received from other workers "
    "since the worker was started",
    "transfer_incoming_redis_bytes_total": "Total size of the small results of dependencies "
    "read from their task records in Redis since the worker was started",
}
# the kinds of the deaths stream's records (docs/redis-schema.md), exported from 0 on so
# that rate() and increase() see a cluster's first death of each
DEATH_KINDS = (
    "graceful", "memory", "hung", "signal", "exception", "exit-code",
    "heartbeat", "connection", "replaced",
)  # fmt: skip


class DeathCounts:
    """Worker ends per ``kind`` (``memory``, ``signal``, ``heartbeat``, ``graceful``, …),
    counted from the deaths stream as it grows: each scrape reads only the entries after
    the last one counted.  At start it counts what the stream holds (the last
    ``retention.deaths`` ends); Prometheus reads a restarted exporter's lower count as a
    counter reset, as for any restarted process."""

    def __init__(self) -> None:
        self.kinds: dict[str, int] = dict.fromkeys(DEATH_KINDS, 0)
        self.last_id: bytes | None = None

    def read(self, r: redis.Redis, keys: Keys) -> None:
        while True:
            start = b"-" if self.last_id is None else b"(" + self.last_id
            entries = r.xrange(keys.deaths, min=start, max=b"+", count=DEATHS_PAGE)
            for entry_id, fields in entries:
                record = codecs.unpack_or(fields.get(b"m"), {}, dict)
                kind = str(record.get("kind") or "unknown")
                self.kinds[kind] = self.kinds.get(kind, 0) + 1
                self.last_id = entry_id
            if len(entries) < DEATHS_PAGE:
                return


class ClusterCollector:
    """A prometheus_client collector: each ``collect`` reads the cluster afresh."""

    def __init__(self, r: redis.Redis, keys: Keys, url: str) -> None:
        self.r, self.keys, self.url = r, keys, redact(url)
        self.deaths = DeathCounts()
        self._lock = threading.Lock()  # scrapes may overlap: one read at a time
        self._last_error: str | None = None
        self._warned_missing = False

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        with self._lock:
            try:
                snap = read_snapshot(self.r, self.keys, events=1, deaths=1, others=False)
                self.deaths.read(self.r, self.keys)
            except Exception as exc:  # Redis down, refused, a stranger's value: a 0, no crash
                self._failed(exc)
                yield self._gauge("up", "1 if the last read of the cluster from Redis worked", 0)
                return
            kinds = dict(self.deaths.kinds)
        self._recovered(snap)
        yield self._gauge("up", "1 if the last read of the cluster from Redis worked", 1)
        yield from self._scheduler(snap)
        yield from self._tasks(snap)
        yield from self._workers(snap)
        deaths = self._family(
            CounterMetricFamily,
            "worker_deaths",
            "Worker ends recorded in the deaths stream, by kind (graceful: a clean exit "
            "under a nanny; memory, signal, exception, exit-code, hung: what the nanny saw; "
            "heartbeat, connection, replaced: what the scheduler saw)",
            ["kind"],
        )
        for kind, n in sorted(kinds.items()):
            deaths.add_metric([self.keys.cluster, kind], n)
        yield deaths
        yield from self._redis(snap)
        yield self._gauge(
            "scrape_duration_seconds",
            "Seconds this scrape took to read the cluster from Redis",
            time.perf_counter() - started,
        )

    # ------------------------------------------------------------------ the parts

    def _scheduler(self, snap: Snapshot) -> Iterator[Metric]:
        s = snap.scheduler
        yield self._gauge(
            "scheduler_up", "1 if a scheduler holds the lease (the cluster is led)",
            int(snap.has_scheduler),
        )  # fmt: skip
        yield self._gauge(
            "scheduler_lease_ttl_seconds",
            "Seconds left on the scheduler's lease (-1: no lease)",
            snap.lease_ttl_ms / 1000 if snap.lease_ttl_ms > 0 else -1,
        )
        if s:
            info = self._family(
                InfoMetricFamily,
                "scheduler",
                "The scheduler that last took the lease: its id, host, pid and fencing token",
                ["id", "host", "pid", "token"],
            )
            labels = [self.keys.cluster, *(s.get(k, "") for k in ("id", "host", "pid", "token"))]
            info.add_metric(labels, {})
            yield info
            yield self._gauge(
                "scheduler_lease_token",
                "Fencing token of the lease holder (its number): it grows by one at every "
                "take-over",
                _token_number(s.get("token")),
            )
            yield self._gauge(
                "scheduler_start_time_seconds",
                "Unix time the lease holder took the lease",
                _number(s.get("since")),
            )
        yield self._gauge("scheduler_clients", "Clients connected", snap.clients)
        if snap.summary_time is not None:
            yield self._gauge(
                "scheduler_summary_age_seconds",
                "Seconds since the scheduler last wrote its summary of the task counts",
                max(0.0, snap.time - snap.summary_time),
            )

    def _tasks(self, snap: Snapshot) -> Iterator[Metric]:
        tasks = self._family(
            GaugeMetricFamily, "scheduler_tasks", "Tasks known by the scheduler, by state",
            ["state"],
        )  # fmt: skip
        for state in sorted({*TASK_STATES, *snap.states}):
            tasks.add_metric([self.keys.cluster, state], snap.states.get(state, 0))
        yield tasks
        prefixes = self._family(
            GaugeMetricFamily,
            "scheduler_prefix_tasks",
            "Tasks known by the scheduler, by task prefix and state (waiting counts waiting, "
            "queued and no-worker; the 100 largest prefixes, the rest as 'other')",
            ["task_prefix_name", "state"],
        )
        for p in snap.prefixes:
            for state in ("waiting", "processing", "memory", "erred", "released"):
                prefixes.add_metric([self.keys.cluster, p.prefix, state], getattr(p, state))
        yield prefixes
        completed = self._family(
            CounterMetricFamily,
            "scheduler_tasks_completed",
            "Tasks that finished (reached memory) since the cluster was created",
            [],
        )
        completed.add_metric([self.keys.cluster], snap.finished_total)
        yield completed
        erred = self._family(
            CounterMetricFamily,
            "scheduler_tasks_erred",
            "Tasks that erred since the cluster was created",
            [],
        )
        erred.add_metric([self.keys.cluster], snap.erred_total)
        yield erred

    def _workers(self, snap: Snapshot) -> Iterator[Metric]:
        by_status: dict[str, int] = {}
        for w in snap.workers:
            by_status[w.status] = by_status.get(w.status, 0) + 1
        workers = self._family(
            GaugeMetricFamily, "scheduler_workers", "Workers registered, by their status",
            ["state"],
        )  # fmt: skip
        for status, n in sorted(by_status.items()):
            workers.add_metric([self.keys.cluster, status], n)
        yield workers
        labels = ["worker", "name"]
        threads = self._family(GaugeMetricFamily, "worker_threads", "Worker threads", labels)
        tasks = self._family(
            GaugeMetricFamily,
            "worker_tasks",
            "Tasks at the worker, by state (executing + ready: its processing tasks; "
            "stored: results it holds)",
            [*labels, "state"],
        )
        memory = self._family(
            GaugeMetricFamily,
            "worker_memory_bytes",
            "Worker memory: managed (its results in memory), unmanaged (the rest of the "
            "process), spilled (its results on disk)",
            [*labels, "type"],
        )
        limit = self._family(
            GaugeMetricFamily, "worker_memory_limit_bytes", "Worker memory limit (0: none)",
            labels,
        )  # fmt: skip
        age = self._family(
            GaugeMetricFamily,
            "worker_heartbeat_age_seconds",
            "Seconds since the worker's last heartbeat",
            labels,
        )
        transfers = [
            self._family(CounterMetricFamily, f"worker_{name}", text, labels)
            for name, text in TRANSFER_COUNTERS.items()
        ]
        for w in snap.workers:
            who = [self.keys.cluster, w.address, w.name]
            for family, name in zip(transfers, TRANSFER_COUNTERS, strict=True):
                family.add_metric(who, getattr(w, name))
            threads.add_metric(who, w.nthreads)
            for state, attribute in WORKER_TASK_STATES.items():
                tasks.add_metric([*who, state], getattr(w, attribute))
            memory.add_metric([*who, "managed"], w.managed)
            memory.add_metric([*who, "unmanaged"], w.unmanaged)
            memory.add_metric([*who, "spilled"], w.spilled)
            limit.add_metric(who, w.memory_limit)
            if w.heartbeat_age is not None:
                age.add_metric(who, max(0.0, w.heartbeat_age))
        yield from (threads, tasks, memory, limit, age, *transfers)

    def _redis(self, snap: Snapshot) -> Iterator[Metric]:
        for field, name, text in (
            ("used_memory", "redis_used_memory_bytes", "Memory Redis uses (all its data)"),
            ("maxmemory", "redis_maxmemory_bytes", "Redis's maxmemory (0: no limit)"),
            ("connected_clients", "redis_connected_clients", "Connections to Redis"),
        ):
            if snap.redis.get(field) is not None:
                yield self._gauge(name, text, _number(snap.redis[field]))

    # ------------------------------------------------------------------ helpers

    def _family(self, kind: type[Any], name: str, text: str, labels: list[str]) -> Any:
        return kind(f"redisdask_{name}", text, labels=["cluster", *labels])

    def _gauge(self, name: str, text: str, value: float) -> GaugeMetricFamily:
        family = self._family(GaugeMetricFamily, name, text, [])
        family.add_metric([self.keys.cluster], value)
        return family

    def _failed(self, exc: Exception) -> None:
        cause = f"{type(exc).__name__}: {exc}"
        if cause != self._last_error:  # once per cause, not at every scrape
            logger.warning("cannot read cluster %r at %s: %s", self.keys.cluster, self.url, cause)
            self._last_error = cause

    def _recovered(self, snap: Snapshot) -> None:
        if self._last_error is not None:
            logger.info("reading cluster %r at %s again", self.keys.cluster, self.url)
            self._last_error = None
        if not snap.exists and not self._warned_missing:
            logger.warning(
                "no cluster %r on Redis at %s (yet): its figures stay 0 until a scheduler "
                "or worker creates it; check --cluster",
                self.keys.cluster,
                self.url,
            )
        self._warned_missing = not snap.exists


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")  # a stranger's value: Prometheus's "no figure"


def _token_number(token: Any) -> float:
    try:
        return float(token_number(str(token)))
    except ValueError:
        return float("nan")  # a stranger's token, or none


def run_exporter(url: str, cluster: str, *, host: str, port: int, connect_timeout: float) -> int:
    """Serve ``/metrics`` on ``host:port`` until SIGTERM or SIGINT; 0 then."""
    r = connect(url, timeout=connect_timeout, name=f"rd-{cluster}-exporter", check=False)
    registry = CollectorRegistry(auto_describe=False)  # nothing read at registration
    registry.register(ClusterCollector(r, Keys(cluster), url))  # type: ignore[arg-type]
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        r.close()
        logger.error(
            "cannot serve metrics on %s:%d (%s): pass a free --port or another --host",
            host, port, exc,
        )  # fmt: skip
        return 1
    bound = server.server_address[1]
    logger.info(
        "serving the metrics of cluster %r at %s on http://%s:%d/metrics",
        cluster, redact(url), host, bound,
    )  # fmt: skip
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    logger.info("stopping")
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)
    r.close()
    return 0
