"""The client's operations on the cluster as a whole, as distributed names them:
``restart``, ``replicate``, ``rebalance``, ``retire_workers``, ``scheduler_info``,
``get_versions``, ``nthreads``, ``who_has``, ``has_what``.  ``Client`` inherits them;
they read Redis and send the scheduler messages through the client's own machinery
(``_send``, ``_results``)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import TimeoutError as FuturesTimeoutError
from numbers import Number
from typing import TYPE_CHECKING, Any

from redisdask.client.futures import _FutureState, _seconds, futures_of
from redisdask.client.loop import offloaded
from redisdask.client.task_stream import when
from redisdask.observe.task_stream import read_task_stream
from redisdask.protocol import Rebalance, Replicate, Restart, RetireWorkers
from redisdask.store import codecs, holdings
from redisdask.store.codecs import RebalanceRecord
from redisdask.store.urls import redact
from redisdask.versions import VersionMismatchError, mismatches, process_versions, table

if TYPE_CHECKING:
    import redis

    from redisdask.client.channel import SchedulerChannel
    from redisdask.client.fetch import ResultFetcher
    from redisdask.store.keyspace import Keys

logger = logging.getLogger("redisdask.client")


class ClusterAdmin:
    """The cluster-wide half of ``Client``: a mixin, whose attributes (below) and helper
    methods (``_check_running``, ``_results``, ``who_has``, and ``run`` and
    ``_workers_named`` from ``WorkerCalls``) are the client's.  It declares no stubs of
    them: a stub here would come before the real method in ``Client``'s MRO."""

    id: str
    redis: redis.Redis
    redis_url: str
    keys: Keys
    _lock: threading.RLock
    _states: dict[str, _FutureState]
    _channel: SchedulerChannel
    _fetcher: ResultFetcher

    @offloaded
    def restart(self, timeout: float | str = 30.0, wait_for_workers: bool = True) -> None:
        """Restart the cluster (as in Dask): every task is forgotten, every future of every
        client becomes cancelled, every worker drops what it holds and runs, and a worker
        under a nanny is replaced by a fresh process.  Returns when as many workers as
        before are registered, the nannies' ones new; the cluster is usable at once."""
        self._check_running()
        timeout = _seconds(timeout) or 30.0
        before = {
            a.decode(errors="replace"): codecs.worker_info_or_empty(v)
            for a, v in self.redis.hgetall(self.keys.workers).items()
        }
        deadline = time.monotonic() + timeout
        self._channel.restarted.clear()
        with self._lock:
            for state in list(self._states.values()):
                state.cancel()
            self._channel.forget_releases()
        self._channel.send([Restart(self.id)])
        if not self._channel.restarted.wait(timeout):
            raise FuturesTimeoutError(
                f"the scheduler did not restart the cluster within "
                f"{timeout} s (is a scheduler running?)"
            )
        old = {(a, w.get("started")) for a, w in before.items() if w.get("nanny")}

        def back() -> bool:
            now = {
                a.decode(errors="replace"): codecs.worker_info_or_empty(v)
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
        n: int | None = None,
        workers: Any = None,
        branching_factor: int = 2,
        timeout: float | str | None = 30.0,
    ) -> None:
        """Keep ``n`` copies of each future's data on distinct workers (None: one on
        every worker; fewer if there are fewer workers): missing copies are made and,
        as in distributed, surplus ones dropped.  The scheduler makes up for a lost copy
        while one survives.  Returns when each key has its ``n`` copies.  ``workers``
        and ``branching_factor`` are accepted for distributed's sake: the scheduler
        picks the workers here (see docs/dask-differences.md)."""
        timeout = _seconds(timeout)
        flat = futures_of(futures)
        n_workers = len(self._cluster_info()["workers"])
        want = n_workers if n is None else min(int(n), n_workers)
        if want <= 0:
            raise ValueError(
                f"replicate(n={n}) with {n_workers} workers: replicate cannot delete data "
                "(n must be at least 1; release the futures to drop the data)"
            )
        self._results(flat, timeout)  # in memory first
        keys = [f._key for f in flat]
        self._channel.send([Replicate(self.id, keys, want)])
        deadline = None if timeout is None else time.monotonic() + timeout
        while not all(len(h) == want for h in self._block(self._awho_has, keys).values()):
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
        see ``redisdask.scheduler.moves``).  A worker is weighed by the sizes of the
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
            flat = futures_of(futures)
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
        self._channel.send([Rebalance(self.id, request, keys=keys, workers=addresses)])
        record = self._rebalance_done(request, deadline, timeout)
        if keys is not None:
            self._block(self._fetcher.refresh_who_has, keys)  # where the values are now
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
                self._channel.retire_refused.pop(address, None)
        self._channel.send([RetireWorkers(self.id, addresses)])
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            present = set(self.redis.hkeys(self.keys.workers))
            with self._lock:
                said = self._channel.retire_refused
                refused = {a: said[a] for a in addresses if a in said}
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
            beat = codecs.unpack_or(raw, {}, dict)
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
            entry = codecs.worker_info_or_empty(info)  # (a stranger's entry: what is known)
            beat = beats_raw.get(address)
            if beat:
                entry["metrics"] = codecs.unpack_or(beat, {}, dict)
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
    def get_versions(
        self, check: bool = False, packages: Iterable[str] | None = None
    ) -> dict[str, Any]:
        """Versions of this client, the scheduler and every worker, in distributed's
        shape: ``{"client": {"host": {...}, "packages": {...}}, "scheduler": {...},
        "workers": {address: {...}}}``.  ``packages``: more package names, read in the
        client and each worker (the scheduler runs no user code: it reports what it
        recorded when it took the lease).  A worker that does not answer is left out,
        as in distributed.  ``check=True`` raises ``VersionMismatchError`` (a
        ``ValueError``) with a table of the packages whose versions differ."""
        packages = list(packages or ())
        raw = self.redis.hmget(self.keys.scheduler, ["versions", "host_info"])
        scheduler = None
        if raw[0] is not None:
            scheduler = {
                "host": codecs.unpack_or(raw[1], {}, dict),
                "packages": codecs.unpack_or(raw[0], {}, dict),
            }
        result = {
            "scheduler": scheduler,
            "workers": self.run(process_versions, packages, on_error="ignore"),
            "client": process_versions(packages),
        }
        if check:
            by_process = {"client": result["client"]["packages"]}
            by_process.update({a: w["packages"] for a, w in result["workers"].items()})
            if scheduler:
                by_process["scheduler"] = scheduler["packages"]
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
        ``count`` the last that many).  See ``redisdask.client.task_stream``."""
        if plot:
            raise NotImplementedError(
                "get_task_stream(plot=True): redisdask draws no bokeh plots; use the list "
                "this returns, or `redisdask monitor`"
            )
        return read_task_stream(self.redis, self.keys, when(start), when(stop), count)

    @offloaded
    def nthreads(self, workers: Any = None, **kwargs: Any) -> dict[str, int]:
        """``{worker address: threads}`` of every worker, or of ``workers`` (addresses or
        names, one or several; those not registered are left out, as in distributed)."""
        info = self._cluster_info()["workers"]
        addresses = _named(info, workers)
        return {a: info[a].get("nthreads", 0) for a in addresses if a in info}

    ncores = nthreads

    def who_has(self, futures: Any = None, **kwargs: Any) -> Any:
        """``{key: [addresses of the workers holding its value]}`` of ``futures``, or of
        every task of the cluster (None, as in distributed).  Only workers are named: a
        small result lives in Redis too (``worker.inline-result-bytes``), so it is not
        lost when its list becomes empty (``redisdask inspect task`` says where it
        lives).  Awaitable on an asynchronous client."""
        if futures is None:
            return self._sync(self._awho_has_all)
        keys = list(dict.fromkeys(f._key for f in futures_of(futures)))
        return self._sync(self._awho_has, keys)

    async def _awho_has(self, keys: list[str]) -> dict[str, list[str]]:
        await self._fetcher.refresh_who_has(keys)
        return {k: holdings.workers_only(self._state_for(k).who_has) for k in keys}

    async def _awho_has_all(self) -> dict[str, list[str]]:
        """Every task's holders, as recorded; data this client scattered a moment ago,
        or a pushed task's result heard from its worker, which the scheduler has not
        recorded yet, as this client knows it."""
        found = await holdings.who_has_all(self._aredis, self.keys)
        with self._lock:
            for key, state in self._states.items():
                if not found.get(key) and state.status == "finished":
                    found[key] = holdings.workers_only(state.who_has)
        return found

    def has_what(self, workers: Any = None, **kwargs: Any) -> Any:
        """``{worker address: [keys of the results it holds]}`` of every worker, or of
        ``workers`` (addresses or names, one or several; one that is not registered
        holds nothing), as distributed's.  Awaitable on an asynchronous client."""
        return self._sync(self._ahas_what, workers)

    async def _ahas_what(self, workers: Any) -> dict[str, list[str]]:
        info = {a.decode(errors="replace"): codecs.worker_info_or_empty(v)
                for a, v in (await self._aredis.hgetall(self.keys.workers)).items()}  # fmt: skip
        return holdings.has_what(await self._awho_has_all(), _named(info, workers))


def _named(info: dict[str, dict[str, Any]], workers: Any) -> list[str]:
    """The addresses ``workers`` names (addresses or names, one or several; all: None)
    among the registered ``info``; one named by neither stays as given."""
    if workers is None:
        return sorted(info)
    wanted = [workers] if isinstance(workers, str | Number) else list(workers)
    by_name = {str(w.get("name")): a for a, w in info.items() if w.get("name") is not None}
    return list(dict.fromkeys(w if w in info else by_name.get(str(w), str(w)) for w in wanted))


def _since(raw: bytes | None) -> float | None:
    """When the leading scheduler took the lease; None when unknown (or unreadable)."""
    try:
        return float(raw) if raw else None
    except ValueError:
        return None
