"""The cluster event log, ``rd:{c}:events``: what happened to the cluster, one line each.

Anyone may append (the scheduler, nannies); ``redisdask monitor`` shows the newest and
``redisdask inspect events --follow`` tails it.  Each entry's field ``m`` is a msgpack map
with ``kind`` and ``time`` and, per kind:

==================== =========================================================== ===========
kind                 fields                                                      written by
==================== =========================================================== ===========
scheduler-start      scheduler, token, previous (the holder it took over from)   scheduler
redis-reconnected    process, away (seconds Redis was unreachable)               scheduler
redis-evicting       policy, message (maxmemory-policy changed at run time to one  scheduler
                     that evicts: the cluster's state may vanish)
redis-full           used_memory, maxmemory (Redis refuses new work and data)     scheduler
redis-has-room       used_memory, maxmemory (it takes them again)                 scheduler
worker-joined        worker, name, host, nthreads, memory_limit, restarts        scheduler
worker-left          worker, name, reason (it closed or retired on its own)      scheduler
worker-died          worker, name, how, cause (the death's kind: memory, signal,  scheduler,
                     ...), reason, rss, memory_limit, restarted (the full        nanny
                     record is on ``rd:{c}:deaths``)
task-erred           key, worker, exception (its text, at most 500 characters):  scheduler
                     a task that raised on a worker (not the dependents that
                     inherit its error, nor a retried run)
killed-worker        key, workers (the task erred with KilledWorker)             scheduler
lost-claim           key, worker (processing there, but the worker does not      scheduler
                     have it: its claim's reply was lost; queued again)
stolen               victim, thief, n, keys (up to 20): claims the victim gave    scheduler
                     up, queued for the thief (work stealing)
rebalance            client, request, moves, bytes, senders, recipients          scheduler
                     (``Client.rebalance``'s plan; missing: keys not in memory)
rebalanced           request, moved, failed (its moves are over)                 scheduler
spill-failed         worker, name, error (``No space left on device``),          worker
                     directory, managed, spilled, rss, memory_limit, paused
                     (when its spills start failing, when it pauses while they
                     do, every 30 s while it stays paused); clients log it as a
                     warning
==================== =========================================================== ===========

``WARN_CLIENTS`` are the kinds a client logs as warnings when they happen while it runs
(``client/channel.py``): news that explains why its futures may wait.

The stream is trimmed to ``retention.events`` entries on every append.  Readers must
accept kinds and fields they do not know: the log is for people, and a newer process may
write more.
"""

from __future__ import annotations

from typing import Any

from redisdask.store import codecs
from redisdask.utils.sizes import format_bytes

WARN_CLIENTS = frozenset({"spill-failed"})


def event_command(stream: str, maxlen: int, kind: str, now: float, **fields: Any) -> list[Any]:
    """The XADD of one event, trimmed to ``maxlen`` entries."""
    event = codecs.pack({"kind": kind, "time": now, **fields})
    return ["XADD", stream, "MAXLEN", maxlen, "*", "m", event]


def death_fields(record: dict[str, Any]) -> dict[str, Any]:
    """What a ``worker-died`` event carries of a death record."""
    evidence = record.get("evidence") or {}
    fields = {k: record.get(k) for k in ("worker", "name", "how", "reason")}
    fields["cause"] = record.get("kind") or record.get("how")
    for name in ("rss", "memory_limit", "restarted"):
        if evidence.get(name) is not None:
            fields[name] = evidence[name]
    return fields


def describe(event: dict[str, Any]) -> str:
    """One line for people: ``worker w1 died (memory): ...``."""
    kind = str(event.get("kind", "?"))
    who = event.get("name") or event.get("worker") or "?"
    if kind == "worker-joined":
        extra = f", restart {event['restarts']}" if event.get("restarts") else ""
        return f"worker {who} joined ({event.get('nthreads', '?')} threads{extra})"
    if kind == "worker-left":
        return f"worker {who} left: {event.get('reason') or 'closed'}"
    if kind == "worker-died":
        memory = ""
        rss, limit = event.get("rss"), event.get("memory_limit")
        if _number(rss) and _number(limit):
            memory = f" at {format_bytes(int(rss))} of {format_bytes(int(limit))}"
        return f"worker {who} died ({event.get('cause') or event.get('how')}){memory}: " + str(
            event.get("reason", "")
        )
    if kind == "spill-failed":
        return spill_failed(event)
    if kind == "task-erred":
        return f"{event.get('key')} erred on {who}: {event.get('exception')}"
    if kind == "killed-worker":
        workers = event.get("workers") or []
        return f"KilledWorker: {event.get('key')} was running on {len(workers)} workers that died"
    if kind == "lost-claim":
        return (
            f"{event.get('key')} was processing on {who}, which never got it (the claim's "
            "reply was lost): queued again"
        )
    if kind == "stolen":
        return (
            f"{event.get('n')} tasks claimed by {event.get('victim')} not started: "
            f"given to {event.get('thief')} (work stealing)"
        )
    told = _describe_cluster(kind, event)
    if told is not None:
        return told
    rest = ", ".join(f"{k}={v}" for k, v in event.items() if k not in ("kind", "time"))
    return f"{kind}: {rest}"


def _describe_cluster(kind: str, event: dict[str, Any]) -> str | None:
    """``describe`` of the kinds about the cluster itself (rebalancing, the scheduler,
    Redis); None for another kind."""
    if kind == "rebalance":
        size = event.get("bytes")
        shown = f" ({format_bytes(int(size))})" if _number(size) else ""
        return (
            f"rebalance: {event.get('moves')} keys{shown} from {event.get('senders')} to "
            f"{event.get('recipients')} workers"
        )
    if kind == "rebalanced":
        return f"rebalance done: {event.get('moved')} keys moved, {event.get('failed')} not"
    if kind == "scheduler-start":
        previous = event.get("previous")
        took = f", taking over from {previous}" if previous else ""
        return f"scheduler {event.get('scheduler')} leads (token {event.get('token')}){took}"
    if kind == "redis-evicting":
        return f"REDIS EVICTS: {event.get('message')}"
    if kind in ("redis-full", "redis-has-room"):
        used, limit = event.get("used_memory"), event.get("maxmemory")
        figures = (
            f": used_memory {format_bytes(used)} of maxmemory {format_bytes(limit)}"
            if _number(used) and _number(limit)
            else ""
        )
        return ("Redis is full" if kind == "redis-full" else "Redis has room again") + figures
    if kind == "redis-reconnected":
        away = event.get("away")
        after = f" after {away:.1f} s" if _number(away) else ""
        return f"{event.get('process')} reconnected to Redis{after}"
    return None


def spill_failed(event: dict[str, Any]) -> str:
    """``worker w1 cannot spill to /x: No space left on device; 150 MiB in memory, ...``
    (an event, or a worker's heartbeat figures in the same fields)."""
    who = event.get("name") or event.get("worker") or "?"
    if event.get("worker") and event["worker"] != who:
        who = f"{who} ({event['worker']})"
    where = f" to {event['directory']}" if event.get("directory") else ""
    held = event.get("managed")
    memory = f"; {format_bytes(int(held))} of results held in memory" if _number(held) else ""
    rss, limit = event.get("rss"), event.get("memory_limit")
    if _number(rss) and _number(limit):
        memory += f", process {format_bytes(int(rss))} of its {format_bytes(int(limit))} limit"
    paused = (
        " (paused: it starts nothing, and what it claimed went back to the queue)"
        if event.get("paused")
        else ""
    )
    return (
        f"worker {who} cannot spill{where}: {event.get('error')}{memory}{paused}; free disk "
        "space there or give the worker another --local-directory"
    )


def _number(value: Any) -> bool:
    """A recorded figure worth showing (events may come from strangers)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0
