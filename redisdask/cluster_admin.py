"""The client's operations on the cluster as a whole, as distributed names them:
``restart``, ``replicate``, ``rebalance``, ``retire_workers``, ``scheduler_info``,
``get_versions``, ``nthreads``.  ``Client`` inherits them; they read Redis and send the
scheduler messages through the client's own machinery (``_send``, ``_results``)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import TimeoutError as FuturesTimeoutError
from typing import TYPE_CHECKING, Any

from redisdask import schema
from redisdask.connection import redact
from redisdask.futures import Future, _flatten, _FutureState, _seconds
from redisdask.loop import offloaded
from redisdask.protocol import Rebalance, Replicate, Restart, RetireWorkers
from redisdask.scheduler_moves import RebalanceRecord
from redisdask.task_stream import read_task_stream, when
from redisdask.versions import VersionMismatchError, mismatches, table, versions

if TYPE_CHECKING:
    import redis

    from redisdask.schema import Keys

logger = logging.getLogger("redisdask.client")


class ClusterAdmin:
    """The cluster-wide half of ``Client``: a mixin, whose attributes (below) and helper
    methods (``_check_running``, ``_send``, ``_results``, ``who_has``, and ``run`` and
    ``_workers_named`` from ``WorkerCalls``) are the client's.  It declares no stubs of
    them: a stub here would come before the real method in ``Client``'s MRO."""

    id: str
    redis: redis.Redis
    redis_url: str
    keys: Keys
    _lock: threading.RLock
    _states: dict[str, _FutureState]
    _pending_release: dict[str, int]
    _restarted: threading.Event
    _retire_refused: dict[str, str]

    @offloaded
    def restart(self, timeout: float | str = 30.0, wait_for_workers: bool = True) -> None:
        """Restart the cluster (as in Dask): every task is forgotten, every future of every
        client becomes cancelled, every worker drops what it holds and runs, and a worker
        under a nanny is replaced by a fresh process.  Returns when as many workers as
        before are registered, the nannies' ones new; the cluster is usable at once."""
        self._check_running()
        timeout = _seconds(timeout) or 30.0
        before = {
            a.decode(errors="replace"): schema.worker_info_or_empty(v)
            for a, v in self.redis.hgetall(self.keys.workers).items()
        }
        deadline = time.monotonic() + timeout
        self._restarted.clear()
        with self._lock:
            for state in list(self._states.values()):
                state.cancel()
            self._pending_release.clear()
        self._send([Restart(self.id)])
        if not self._restarted.wait(timeout):
            raise FuturesTimeoutError(
                f"the scheduler did not restart the cluster within "
                f"{timeout} s (is a scheduler running?)"
            )
        old = {(a, w.get("started")) for a, w in before.items() if w.get("nanny")}

        def back() -> bool:
            now = {
                a.decode(errors="replace"): schema.worker_info_or_empty(v)
                for a, v in self.redis.hgetall(self.keys.workers).items()
            }
            fresh = [a for a, w in now.items() if (a, w.get("started")) not in old]
            return len(fresh) >= len(before)

        while wait_for_workers and not back():
            if time.monotonic() > deadline:
                raise FuturesTimeoutError(
                    f"the workers did not come back within {timeout} s of the restart"
                )
            time.sleep(0.02)  # the nannies start new processes; their registration is polled

    @offloaded
    def replicate(
        self,
        futures: Any,
        n: int = 2,
        workers: Any = None,
        branching_factor: int = 2,
        timeout: float | str | None = 30.0,
    ) -> None:
        """Keep ``n`` copies of each future's data on distinct workers (fewer if there are
        fewer workers); the scheduler makes up for a lost copy while one survives.
        Returns when the copies are there.  ``workers`` and ``branching_factor`` are
        accepted for distributed's sake: the scheduler picks the workers here."""
        timeout = _seconds(timeout)
        flat = [f for f in _flatten(futures) if isinstance(f, Future)]
        self._results(flat, timeout)  # in memory first
        keys = [f._key for f in flat]
        self._send([Replicate(self.id, keys, int(n))])
        want = min(n, len(self._cluster_info()["workers"]))
        deadline = None if timeout is None else time.monotonic() + timeout
        while not all(len(h) >= want for h in self._block(self._awho_has, keys).values()):
            if deadline is not None and time.monotonic() > deadline:
                raise FuturesTimeoutError(
                    f"{want} copies of {len(keys)} keys not made within {timeout} s"
                )
            time.sleep(0.02)  # the copies are made worker to worker; their arrival is polled

    @offloaded
    def rebalance(self, futures: Any = None, workers: Any = None, **kwargs: Any) -> None:
        """Move results between workers so that each holds about the same bytes (as
        distributed's ``rebalance``): workers above the mean give their oldest results
        to workers below it, within ``worker.memory.rebalance``'s limits (as in Dask, by
        default nothing moves while every worker holds under 30% of its memory limit;
        see ``redisdask.scheduler_moves``).  A worker is weighed by the sizes of the
        results it holds (Dask's *managed* memory).

        ``futures``: move only their keys (waited for first; None: any result);
        ``workers``: addresses or names, moves only among those (None: all).  Each copy
        goes worker to worker; the sender drops its copy only once the recipient holds
        it, so nothing is lost or recomputed, and a move whose recipient dies first
        leaves the data where it was.  Returns when every move is done (a scheduler
        restarted meanwhile carries on with them); ``timeout=`` (seconds, 60; None: no
        limit) else raises ``TimeoutError``.  With ``futures``, a key that was not in
        memory (an erred or cancelled future) or could not be moved raises ``KeyError``
        naming it, as in distributed; nothing moves when one was not in memory."""
        self._check_running()
        timeout = _seconds(kwargs.pop("timeout", 60.0))
        if kwargs:
            raise TypeError(f"rebalance() got unexpected keyword arguments {sorted(kwargs)}")
        deadline = None if timeout is None else time.monotonic() + timeout
        keys = None
        if futures is not None:
            flat = [f for f in _flatten(futures) if isinstance(f, Future)]
            if not flat:
                return  # (as distributed: no keys, nothing to move)
            self._wait_for(flat, deadline, stop_on_error=False)  # finished; not fetched
            keys = list(dict.fromkeys(f._key for f in flat))
        addresses = None
        if workers is not None:
            addresses = list(self._workers_named(workers))  # ValueError naming unknown ones
            if not addresses:
                return
        request = uuid.uuid4().hex
        self._send([Rebalance(self.id, request, keys=keys, workers=addresses)])
        record = self._rebalance_done(request, deadline, timeout)
        if keys is not None:
            self._block(self._arefresh_who_has, keys)  # where the values are now
            if record.failed:
                raise KeyError(f"Could not rebalance keys: {record.failed}")

    def _rebalance_done(
        self, request: str, deadline: float | None, timeout: float | None
    ) -> RebalanceRecord:
        """Wait for the scheduler's record of a rebalance to say it is done."""
        name = self.keys.rebalance(request)
        fields = ("client", "status", "moves", "moved", "failed")
        while True:
            values = self.redis.hmget(name, fields)
            record = RebalanceRecord.from_hash(
                {f.encode(): v for f, v in zip(fields, values, strict=True) if v is not None}
            )
            if record.status == "done":
                return record
            if deadline is not None and time.monotonic() > deadline:
                if not record.status:
                    raise FuturesTimeoutError(
                        f"the scheduler did not take up the rebalance within {timeout} s "
                        "(is a scheduler running?)"
                    )
                raise FuturesTimeoutError(
                    f"the rebalance did not finish within {timeout} s: {record.moved} of "
                    f"{record.moves} moves done; the rest go on (a recipient fetches each "
                    "copy from its sender)"
                )
            time.sleep(0.02)  # the copies are made worker to worker; the record is polled

    @offloaded
    def retire_workers(
        self,
        workers: str | list[str] | None = None,
        n: int | None = None,
        timeout: float | str | None = 60.0,
        close_workers: bool = True,
        remove: bool = True,
    ) -> dict[str, Any]:
        """Close workers gracefully (as in Dask): they claim nothing more, hand back the
        tasks they claimed but did not start, finish the running ones, and leave once
        every result that only they held has been copied to a worker that stays, so no
        result is lost or recomputed.  ``workers``: addresses or names; or ``n``: that
        many of the workers holding the least data.  Returns ``{address: info}`` of the
        workers that left.  A retirement that would leave nobody to take their data is
        refused (logged; those workers keep running and are not in the result).
        ``close_workers`` and ``remove`` are accepted for distributed's sake: a retired
        worker always leaves and its process exits (its nanny does not restart it)."""
        self._check_running()
        timeout = _seconds(timeout)
        info = self._cluster_info()["workers"]
        if workers is not None:
            addresses = list(self._workers_named(workers))  # ValueError naming unknown ones
        elif n is not None:
            held = self._held_bytes(list(info))
            addresses = sorted(info, key=lambda a: (held[a], a))[: max(0, n)]
        else:
            raise ValueError("say which workers to retire: workers=[address or name] or n=")
        if not addresses:
            return {}
        with self._lock:
            for address in addresses:
                self._retire_refused.pop(address, None)
        self._send([RetireWorkers(self.id, addresses)])
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            present = set(self.redis.hkeys(self.keys.workers))
            with self._lock:
                refused = {
                    a: self._retire_refused[a] for a in addresses if a in self._retire_refused
                }
            pending = [a for a in addresses if a.encode() in present and a not in refused]
            if not pending:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise FuturesTimeoutError(
                    f"workers {pending} did not retire within {timeout} s; they are still "
                    "moving their data (or no worker that stays is reachable)"
                )
            time.sleep(0.02)  # the workers leave on their own; their departure is polled
        for address, reason in refused.items():
            logger.warning("worker %s was not retired: %s", address, reason)
        return {a: info.get(a, {}) for a in addresses if a not in refused}

    def _held_bytes(self, addresses: list[str]) -> dict[str, int]:
        """Bytes of results each worker holds, from its last heartbeat."""
        held = dict.fromkeys(addresses, 0)
        for address, raw in self.redis.hgetall(self.keys.heartbeats).items():
            beat = schema.unpack_or(raw, {}, dict)
            managed = beat.get("managed")
            if address.decode(errors="replace") in held and isinstance(managed, int):
                held[address.decode()] = managed
        return held

    # ------------------------------------------------------------------ information

    @offloaded
    def scheduler_info(self, n_workers: int = -1, **kwargs: Any) -> dict[str, Any]:
        """A Dask-like summary: ``workers`` keyed by worker address (the first
        ``n_workers`` by address, as distributed; -1: all), ``n_workers`` how many there
        are, ``started`` when the leading scheduler took the lease (epoch seconds)."""
        info = self._cluster_info()
        if n_workers >= 0:
            info["workers"] = dict(sorted(info["workers"].items())[:n_workers])
        return info

    def _cluster_info(self) -> dict[str, Any]:
        """``scheduler_info`` with every worker."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.workers)
        pipe.hgetall(self.keys.heartbeats)
        pipe.hgetall(self.keys.scheduler)
        workers_raw, beats_raw, sched = pipe.execute()
        workers = {}
        for address, info in workers_raw.items():
            entry = schema.worker_info_or_empty(info)  # (a stranger's entry: what is known)
            beat = beats_raw.get(address)
            if beat:
                entry["metrics"] = schema.unpack_or(beat, {}, dict)
            workers[address.decode(errors="replace")] = entry
        return {
            "type": "Scheduler",
            "id": (sched.get(b"id") or b"").decode(),
            "address": redact(self.redis_url),
            "cluster": self.keys.cluster,
            "started": _since(sched.get(b"since")),
            "n_workers": len(workers),
            "total_threads": sum(int(w.get("nthreads") or 0) for w in workers.values()),
            "workers": workers,
        }

    @offloaded
    def get_versions(self, check: bool = False, packages: Iterable[str] = ()) -> dict[str, Any]:
        """Versions of this client, the scheduler and every worker (as in Dask).
        ``packages``: more package names, read in the client and each worker (with
        ``run``; the scheduler runs no user code, so it is not asked).  ``check=True``
        raises ``VersionMismatchError`` with a table of what differs."""
        packages = list(packages)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hget(self.keys.scheduler, "versions")
        pipe.hgetall(self.keys.workers)
        sched, workers = pipe.execute()
        result = {
            "client": versions(packages),
            "scheduler": schema.unpack_or(sched, None, dict),
            "workers": {
                a.decode(errors="replace"): schema.worker_info_or_empty(i).get("versions", {})
                for a, i in workers.items()
            },
        }
        if packages:
            for address, found in self.run(versions, packages, on_error="ignore").items():
                result["workers"].setdefault(address, {}).update(found)
        if check:
            by_process = {"client": result["client"], **result["workers"]}
            if result["scheduler"]:
                by_process["scheduler"] = result["scheduler"]
            rows = mismatches(by_process)
            if rows:
                raise VersionMismatchError(
                    "processes of this cluster run different versions:\n" + table(rows)
                )
        return result

    @offloaded
    def get_task_stream(
        self,
        start: float | str | None = None,
        stop: float | str | None = None,
        count: int | None = None,
        plot: bool = False,
        **kwargs: Any,
    ) -> list[dict[str, Any]]:
        """When and where tasks ran, from the workers' stories in Redis (as distributed:
        ``start``/``stop`` are epoch seconds or a duration before now such as ``"60s"``;
        ``count`` the last that many).  See ``redisdask.task_stream``."""
        if plot:
            raise NotImplementedError(
                "get_task_stream(plot=True): redisdask draws no bokeh plots; use the list "
                "this returns, or `redisdask monitor`"
            )
        return read_task_stream(self.redis, self.keys, when(start), when(stop), count)

    @offloaded
    def nthreads(self) -> dict[str, int]:
        return {a: w.get("nthreads", 0) for a, w in self._cluster_info()["workers"].items()}


def _since(raw: bytes | None) -> float | None:
    """When the leading scheduler took the lease; None when unknown (or unreadable)."""
    try:
        return float(raw) if raw else None
    except ValueError:
        return None
