"""One consistent look at a cluster, read from Redis: what ``status`` prints and each
frame of ``monitor`` draws.

``read_snapshot`` sends one pipeline of read-only commands (``SNAPSHOT_COMMANDS`` of
them: the scheduler and summary hashes, the lease's TTL, the workers and heartbeats
hashes, the newest events and deaths, ``INFO``, whether the cluster exists; a SCAN
for the other clusters only when it does not, and not for the exporter), so a refresh
costs Redis the same whether the cluster runs ten tasks or a million: the scheduler keeps
the counts per task prefix and state in ``rd:{c}:summary`` for exactly this.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from redisdask.store import codecs
from redisdask.store.bootstrap import known_clusters
from redisdask.store.keyspace import Keys

SNAPSHOT_COMMANDS = 9  # Redis commands per read_snapshot (the monitor's cost per frame)
WAITING_STATES = ("waiting", "queued", "no-worker")


@dataclass(slots=True)
class WorkerView:
    address: str
    name: str
    host: str = ""
    nthreads: int = 0
    status: str = "?"
    executing: int = 0
    ready: int = 0
    in_memory: int = 0
    managed: int = 0
    unmanaged: int = 0
    spilled: int = 0
    rss: int = 0
    memory_limit: int = 0
    fractions: dict[str, float | bool] = field(default_factory=dict)
    cpu: float = 0.0
    heartbeat_age: float | None = None  # seconds since its last heartbeat
    restarts: int = 0
    nanny: bool = False
    spill_error: str = ""  # why its spills fail (a full disk), while they do
    # dependencies fetched since it started (workers/transfers.py): transfers and bytes
    # from peers, bytes of small results read from Redis
    transfer_incoming_count_total: int = 0
    transfer_incoming_bytes_total: int = 0
    transfer_incoming_redis_bytes_total: int = 0


@dataclass(slots=True)
class PrefixView:
    prefix: str
    waiting: int = 0  # waiting, queued or no-worker
    processing: int = 0
    memory: int = 0
    erred: int = 0
    released: int = 0

    @property
    def total(self) -> int:
        return self.waiting + self.processing + self.memory + self.erred + self.released


@dataclass(slots=True)
class Snapshot:
    cluster: str
    time: float
    scheduler: dict[str, Any] = field(default_factory=dict)  # empty: none ever led
    lease_ttl_ms: int = -2  # PTTL of the lease: -2 none (no live scheduler)
    workers: list[WorkerView] = field(default_factory=list)
    prefixes: list[PrefixView] = field(default_factory=list)
    states: dict[str, int] = field(default_factory=dict)
    finished: list[int] = field(default_factory=list)  # per second, oldest first, 60 s
    finished_total: int = 0
    erred_total: int = 0
    clients: int = 0
    no_worker: list[dict[str, Any]] = field(default_factory=list)  # why those tasks wait
    summary_time: float | None = None
    events: list[dict[str, Any]] = field(default_factory=list)  # newest first
    deaths: list[dict[str, Any]] = field(default_factory=list)  # newest first
    redis: dict[str, Any] = field(default_factory=dict)
    exists: bool = True  # False: no scheduler or worker ever created this cluster
    other_clusters: list[str] = field(default_factory=list)  # when it does not exist

    @property
    def has_scheduler(self) -> bool:
        return self.lease_ttl_ms > 0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["has_scheduler"] = self.has_scheduler
        return data


def read_snapshot(
    r: redis.Redis,
    keys: Keys,
    *,
    events: int = 20,
    deaths: int = 5,
    window: int = 60,
    others: bool = True,
) -> Snapshot:
    """Everything the monitor shows, in one round trip of read-only commands (and, when
    the cluster does not exist and ``others``, a SCAN for the names of those that do)."""
    pipe = r.pipeline(transaction=False)
    pipe.hgetall(keys.scheduler)
    pipe.pttl(keys.lease)
    pipe.hgetall(keys.workers)
    pipe.hgetall(keys.heartbeats)
    pipe.hgetall(keys.summary)
    pipe.xrevrange(keys.events, count=events)
    pipe.xrevrange(keys.deaths, count=deaths)
    pipe.info()
    pipe.exists(keys.meta)
    scheduler, pttl, workers, beats, summary, event_entries, death_entries, info, exists = (
        pipe.execute()
    )
    now = time.time()
    snap = Snapshot(cluster=keys.cluster, time=now, lease_ttl_ms=int(pttl), exists=bool(exists))
    if not exists and others:
        snap.other_clusters = known_clusters(r)
    snap.scheduler = {k.decode(): v.decode(errors="replace") for k, v in scheduler.items()}
    snap.scheduler.pop("versions", None)
    views = (
        _worker_view(a.decode(errors="replace"), _unpack(i), _unpack(beats.get(a)), now)
        for a, i in workers.items()
    )
    snap.workers = sorted(views, key=lambda w: (w.name, w.address))
    _read_summary(snap, summary, now, window)
    snap.events = _entries(event_entries)
    snap.deaths = _entries(death_entries)
    snap.redis = {
        k: info.get(k)
        for k in (
            "redis_version",
            "used_memory",
            "used_memory_peak",
            "maxmemory",
            "maxmemory_policy",
            "instantaneous_ops_per_sec",
            "connected_clients",
            "uptime_in_seconds",
        )
    }
    return snap


def _unpack(raw: bytes | None) -> dict[str, Any]:
    return codecs.unpack_or(raw, {}, dict)  # a stranger's value: show what is known


def _worker_view(
    address: str, info: dict[str, Any], beat: dict[str, Any], now: float
) -> WorkerView:
    try:
        return _parse_worker(address, info, beat, now)
    except (TypeError, ValueError, KeyError):  # a stranger's values: a row, not a crash
        return WorkerView(address=address, name=address, status="unreadable")


def _parse_worker(
    address: str, info: dict[str, Any], beat: dict[str, Any], now: float
) -> WorkerView:
    fractions = info.get("memory_fractions")
    return WorkerView(
        address=address,
        name=str(info.get("name") or address),
        host=str(info.get("host", "")),
        nthreads=int(info.get("nthreads") or 0),
        status=str(beat.get("status", "?")),
        executing=int(beat.get("n_executing") or 0),
        ready=int(beat.get("ready") or 0),
        in_memory=int(beat.get("in_memory") or 0),
        managed=int(beat.get("managed") or 0),
        unmanaged=int(beat.get("unmanaged") or 0),
        spilled=int(beat.get("spilled") or 0),
        rss=int(beat.get("rss") or 0),
        memory_limit=int(beat.get("memory_limit") or info.get("memory_limit") or 0),
        fractions={
            str(k): v
            for k, v in (fractions.items() if isinstance(fractions, dict) else ())
            if isinstance(v, int | float)
        },
        cpu=float(beat.get("cpu") or 0.0),
        heartbeat_age=now - float(beat["time"]) if beat.get("time") else None,
        restarts=int(info.get("restarts") or 0),
        nanny=bool(info.get("nanny")),
        spill_error=str(beat.get("spill_error") or ""),
        transfer_incoming_count_total=int(beat.get("transfer_incoming_count_total") or 0),
        transfer_incoming_bytes_total=int(beat.get("transfer_incoming_bytes_total") or 0),
        transfer_incoming_redis_bytes_total=int(
            beat.get("transfer_incoming_redis_bytes_total") or 0
        ),
    )


def _number(raw: Any, kind: type = int) -> Any:
    """A count or a time from a stranger's value; 0 for what is no number."""
    try:
        value = kind(raw or 0)
    except (TypeError, ValueError, OverflowError):
        return kind(0)
    return value if value == value else kind(0)  # (nan)


def _read_summary(snap: Snapshot, summary: dict[bytes, bytes], now: float, window: int) -> None:
    prefixes = _unpack(summary.get(b"prefixes"))
    states: dict[str, int] = {}
    for prefix, counts in sorted(prefixes.items(), key=lambda item: str(item[0])):
        view = PrefixView(str(prefix))
        for state, n in counts.items() if isinstance(counts, dict) else ():
            n = _number(n)
            states[str(state)] = states.get(str(state), 0) + n
            if state in WAITING_STATES:
                view.waiting += n
            elif state in ("processing", "memory", "erred", "released"):
                setattr(view, state, getattr(view, state) + n)
        snap.prefixes.append(view)
    snap.states = states
    finished = codecs.unpack_or(summary.get(b"finished"), [], list)
    per_second = {p[0]: p[1] for p in finished if isinstance(p, list | tuple) and len(p) == 2}
    last = int(now) - 1  # the current second is not over yet
    snap.finished = [_number(per_second.get(s)) for s in range(last - window + 1, last + 1)]
    snap.finished_total = _number(summary.get(b"finished_total"))
    snap.erred_total = _number(summary.get(b"erred_total"))
    snap.clients = _number(summary.get(b"clients"))
    snap.no_worker = [
        {"reason": str(n.get("reason", "")), "count": n.get("count"), "key": str(n.get("key"))}
        for n in codecs.unpack_or(summary.get(b"no_worker"), [], list)
        if isinstance(n, dict)
    ]
    snap.summary_time = _number(summary.get(b"time"), float) or None


def _entries(entries: list[tuple[bytes, dict[bytes, bytes]]]) -> list[dict[str, Any]]:
    out = []
    for entry_id, fields in entries:
        record = _unpack(fields.get(b"m"))
        if record:  # a stranger's entry is skipped, not fatal
            record["id"] = entry_id.decode()
            out.append(record)
    return out
