"""The user's entry point: ``Client``, ``Future``, ``wait`` and ``as_completed``.

The client talks to the scheduler only through Redis: submissions go on the clients
stream (batched: ``map`` of 100,000 items is a few pipelined XADDs), and the scheduler
answers on this client's own events stream, which a background thread reads.  Results
are fetched straight from the workers that hold them, over authenticated TCP
(``redisdask.comm``); they never pass through Redis.

Futures of one key share a ``_FutureState``; the client counts references per key and
tells the scheduler to release a key when its last future is garbage-collected.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from concurrent.futures import TimeoutError as FuturesTimeoutError
from typing import Any, NamedTuple

import cloudpickle
import redis

from redisdask import comm, schema
from redisdask import spec as specs
from redisdask.config import load_config
from redisdask.connection import connect, redact
from redisdask.errors import (
    ClusterConnectionError,
    DataUnavailableError,
    FutureCancelledError,
    KilledWorker,
    RedisDaskError,
)
from redisdask.schema import Keys
from redisdask.versions import VersionMismatchError, mismatches, table, versions

logger = logging.getLogger("redisdask.client")

SUBMIT_BATCH_BYTES = 16 << 20  # specs per stream entry, so the scheduler's writes stay small


# --------------------------------------------------------------------------- futures


class _FutureState:
    """What the client knows of one key, shared by all futures of that key."""

    __slots__ = (
        "callbacks",
        "event",
        "exception",
        "finishes",
        "generation",
        "status",
        "traceback",
        "type",
        "who_has",
    )

    def __init__(self) -> None:
        self.status = "pending"
        self.event = threading.Event()
        self.exception: BaseException | None = None
        self.traceback: Any = None
        self.type = ""
        self.who_has: list[str] = []
        self.callbacks: list[Callable[[], None]] = []
        self.generation = 0  # the client's submission counter when last (re)submitted
        self.finishes = 0  # how many key-in-memory messages arrived (to spot stale ones)

    def _set(self, status: str) -> None:
        self.status = status
        self.event.set()
        callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                logger.exception("a future's done callback raised")

    def finish(self, who_has: list[str], type_name: str) -> None:
        self.who_has, self.type = who_has, type_name
        self.finishes += 1
        self._set("finished")

    def set_error(self, exception: BaseException, traceback: Any) -> None:
        self.exception, self.traceback = exception, traceback
        self._set("error")

    def cancel(self) -> None:
        if self.status == "pending" or self.status == "finished":
            self._set("cancelled")

    def reset(self) -> None:
        self.status = "pending"
        self.event.clear()


class Future:
    """A remotely running computation; ``result()`` brings its value here."""

    def __init__(self, key: str, client: Client, *, _state: _FutureState | None = None) -> None:
        self.key = key
        self.client = client
        self._state = _state or client._state_for(key)
        client._inc_ref(key)
        self._released = False

    @property
    def status(self) -> str:
        return self._state.status

    def done(self) -> bool:
        return self._state.event.is_set()

    def cancelled(self) -> bool:
        return self._state.status == "cancelled"

    def _wait(self, timeout: float | None) -> None:
        """Wait for news; give up with a clear error if Redis stays away too long (the
        future is kept: once Redis is back, waiting again works)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._state.event.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise FuturesTimeoutError(f"task {self.key!r} did not finish within {timeout} s")
            self.client._check_redis()
            self._state.event.wait(0.25 if left is None else min(left, 0.25))

    def result(self, timeout: float | None = None) -> Any:
        return self.client._results([self], timeout)[self.key]

    def _raise_if_failed(self) -> None:
        if self._state.status == "error":
            raise self._state.exception.with_traceback(self._state.traceback)  # type: ignore[union-attr]
        if self._state.status == "cancelled":
            raise FutureCancelledError(self.key)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        return self._state.exception

    def traceback(self, timeout: float | None = None) -> Any:
        self._wait(timeout)
        return self._state.traceback

    def cancel(self) -> None:
        self.client.cancel([self])

    def add_done_callback(self, fn: Callable[[Future], Any]) -> None:
        """Call ``fn(future)`` when it finishes (at once if it has); runs in a client thread."""
        with self.client._lock:
            if not self._state.event.is_set():
                self._state.callbacks.append(lambda: fn(self))
                return
        fn(self)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.client._dec_ref(self.key)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter shutdown anything goes
            self.release()

    def __reduce__(self) -> Any:
        raise TypeError(
            f"a Future ({self.key!r}) cannot be pickled on its own; pass it as an argument of "
            "submit/map (directly or nested in lists, tuples and dicts) to depend on it"
        )

    def __repr__(self) -> str:
        return f"<Future: {self.status}, key: {self.key}>"


# --------------------------------------------------------------------------- client


class Client:
    """Connects to a cluster through Redis.

    ``address`` is a ``LocalCluster``, a Redis URL, or None for the configured URL.
    """

    def __init__(
        self,
        address: Any = None,
        cluster_name: str | None = None,
        *,
        timeout: float | None = None,
        set_as_default: bool = True,
        **config: Any,
    ) -> None:
        self.config = load_config(config or None)
        if address is not None and not isinstance(address, str):  # a LocalCluster
            cluster_name = cluster_name or address.cluster_name
            address = address.redis_url
        self.redis_url: str = address or self.config.redis.url
        self.keys = Keys(cluster_name or self.config.cluster.name)
        self.timeout = timeout if timeout is not None else self.config.redis.connect_timeout
        self.id = f"client-{uuid.uuid4().hex[:12]}"
        self.redis = connect(self.redis_url, timeout=self.timeout, name=f"rd-client-{self.id}")
        self.secret = schema.ensure_cluster(self.redis, self.keys)
        self.status = "running"
        self._lock = threading.RLock()
        self._states: dict[str, _FutureState] = {}
        self._refcount: dict[str, int] = defaultdict(int)
        self._pending_release: deque[str] = deque()
        self._send_lock = threading.Lock()
        self._restarted = threading.Event()
        self._retire_refused: dict[str, str] = {}  # worker -> why the scheduler refused
        self._versions = versions()
        self._down_since: float | None = None  # when Redis was found unreachable
        self._generation = 0
        self._peers = comm.BlockingPool(self.secret, timeout=self.timeout)
        self._stop = threading.Event()
        self._heartbeat()
        self._events_redis = connect(
            self.redis_url, timeout=self.timeout, name=f"rd-client-{self.id}-events"
        )
        self._thread = threading.Thread(
            target=self._event_loop, name=f"{self.id}-events", daemon=True
        )
        self._thread.start()
        if set_as_default:
            _set_default(self)

    # ------------------------------------------------------------------ submission

    def submit(
        self,
        func: Callable[..., Any],
        *args: Any,
        key: str | None = None,
        pure: bool = True,
        retries: int = 0,
        priority: int = 0,
        workers: str | list[str] | None = None,
        **kwargs: Any,
    ) -> Future:
        """Run ``func(*args, **kwargs)`` on the cluster; futures in arguments are
        dependencies.  Raises ``TypeError`` at once if anything is unpicklable."""
        self._check_running()
        if not callable(func):
            raise TypeError(f"submit() needs a callable as its first argument, got {func!r}")
        function_bytes = specs.dumps_function(func)
        options = _options(retries, priority, workers)
        task = self._make_task(func, function_bytes, args, kwargs, key, pure, options)
        future = Future(task["key"], self)
        self._send_graph([task], [task["key"]])
        return future

    def map(
        self,
        func: Callable[..., Any],
        *iterables: Iterable[Any],
        key: str | list[str] | None = None,
        pure: bool = True,
        retries: int = 0,
        priority: int = 0,
        workers: str | list[str] | None = None,
        **kwargs: Any,
    ) -> list[Future]:
        """``submit`` for each item of the iterables, in a few batched round trips."""
        self._check_running()
        function_bytes = specs.dumps_function(func)
        items = list(zip(*iterables, strict=False))
        keys = key if isinstance(key, list) else [None] * len(items)
        prefix = key if isinstance(key, str) else None
        options = _options(retries, priority, workers)
        tasks = []
        for i, args in enumerate(items):
            task_key = keys[i] if keys[i] is not None else (f"{prefix}-{i}" if prefix else None)
            tasks.append(
                self._make_task(func, function_bytes, args, kwargs, task_key, pure, options)
            )
        futures = [Future(t["key"], self) for t in tasks]
        self._send_graph(tasks, [t["key"] for t in tasks])
        return futures

    def _make_task(
        self,
        func: Any,
        function_bytes: bytes,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        key: str | None,
        pure: bool,
        options: dict[str, Any],
    ) -> dict[str, Any]:
        deps: set[str] = set()
        args = specs.replace_refs(args, self._future_key, deps)
        kwargs = specs.replace_refs(kwargs, self._future_key, deps)
        spec = specs.dumps_spec(function_bytes, args, kwargs, func)
        if key is None:
            tok = specs.token(spec) if pure else uuid.uuid4().hex
            key = f"{specs.funcname(func)}-{tok}"
        return {"key": key, "spec": spec, "deps": sorted(deps), **options}

    def _future_key(self, obj: Any) -> str | None:
        if isinstance(obj, Future):
            if obj.client is not self:
                raise ValueError(f"future {obj.key!r} belongs to another client")
            return obj.key
        return None

    def _send_graph(self, tasks: list[dict[str, Any]], wanted: list[str]) -> None:
        """Send the graph in batches (one pipeline).  The caller holds futures for
        ``wanted`` already, so no release of those keys can be sent after this."""
        with self._lock:
            self._generation += 1
            for key in wanted:
                state = self._state_for(key)
                if state.status == "cancelled":
                    state.reset()
                state.generation = self._generation
        chunks = _chunks(tasks, self.config.client.submit_batch, SUBMIT_BATCH_BYTES)
        if len(chunks) == 1:
            self._send(
                [{"op": "update-graph", "client": self.id, "tasks": tasks, "wanted": wanted}]
            )
            return
        # A graph sent in several entries: a chunk's tasks that later chunks depend on are
        # wanted until the whole graph is in (else the scheduler would forget them as
        # unneeded), then released.  Tasks come dependencies first (see ``get``).
        wanted_set = set(wanted)
        later_deps: set[str] = set()
        bridges: list[list[str]] = []
        for chunk in reversed(chunks):
            bridges.append(
                [t["key"] for t in chunk if t["key"] in later_deps and t["key"] not in wanted_set]
            )
            later_deps.update(d for t in chunk for d in t["deps"])
        bridges.reverse()
        entries = []
        for chunk, bridge in zip(chunks, bridges, strict=True):
            keys = {t["key"] for t in chunk}
            want = [k for k in wanted if k in keys] + bridge
            entries.append(
                [{"op": "update-graph", "client": self.id, "tasks": chunk, "wanted": want}]
            )
        bridge_keys = [k for bridge in bridges for k in bridge]
        if bridge_keys:
            entries.append([{"op": "client-releases-keys", "client": self.id, "keys": bridge_keys}])
        self._send(*entries)

    def _send(self, *entries: list[dict[str, Any]]) -> None:
        """XADD entries to the clients stream in one pipeline, pending releases first.

        One lock orders every send of this client: a release popped by the heartbeat thread
        can never land after a resubmission of the same key by the user's thread."""
        with self._send_lock:
            releases = self._release_messages()
            if releases:
                entries = (releases, *entries)
            delay = 0.05
            while True:
                try:
                    pipe = self.redis.pipeline(transaction=False)
                    for messages in entries:
                        pipe.xadd(self.keys.client_stream, schema.entry(messages))
                    pipe.execute()  # a retry after a lost reply may repeat an entry: harmless
                    self._redis_back()
                    return
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    self._redis_lost(exc)
                    self._check_redis()
                    time.sleep(delay)  # backoff while Redis is away
                    delay = min(delay * 2, 1.0)

    def _redis_lost(self, exc: Exception) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            logger.warning(
                "client %s lost Redis at %s (%s); retrying with backoff",
                self.id,
                redact(self.redis_url),
                exc,
            )

    def _redis_back(self) -> None:
        if self._down_since is not None:
            logger.warning(
                "client %s reconnected to Redis after %.1f s",
                self.id,
                time.monotonic() - self._down_since,
            )
            self._down_since = None

    def _check_redis(self) -> None:
        """Raise once Redis has been unreachable for longer than ``redis.down-deadline``."""
        since = self._down_since
        deadline = self.config.redis.down_deadline
        if since is not None and time.monotonic() - since > deadline:
            try:
                self.redis.ping()  # back meanwhile? (the event thread may not know yet)
                self._redis_back()
                return
            except (redis.ConnectionError, redis.TimeoutError):
                pass
            raise ClusterConnectionError(
                f"Redis at {redact(self.redis_url)} has been unreachable for more than "
                f"{deadline:g} s (redis.down-deadline); nothing is lost: the futures are kept "
                "and work again once Redis is back"
            )

    def get(self, dsk: Mapping[Hashable, Any], keys: Any, **kwargs: Any) -> Any:
        """Compute a dask-style dict graph; ``keys`` may be one key or nested lists."""
        self._check_running()
        graph_keys = set(dsk)

        def to_ref(obj: Any) -> str | None:
            try:
                return specs.stringify(obj) if obj in graph_keys else None
            except TypeError:  # unhashable
                return None

        tasks = []
        for key, value in dsk.items():
            func, args = specs.graph_task(value, graph_keys)
            deps: set[str] = set()
            args = specs.replace_refs(args, to_ref, deps)
            tasks.append(
                {
                    "key": specs.stringify(key),
                    "deps": sorted(deps),
                    "priority": 0,
                    "retries": kwargs.get("retries", 0),
                    "spec": specs.dumps_spec(specs.dumps_function(func), args, {}, func),
                }
            )
        flat = list(_flatten_lists(keys))  # lists give the shape; tuples are dask keys
        wanted = [specs.stringify(k) for k in flat]
        futures = [Future(k, self) for k in wanted]
        self._send_graph(_toposort(tasks), wanted)
        try:
            results = dict(zip(wanted, self.gather(futures), strict=True))
        finally:
            for f in futures:
                f.release()
        return _pack_lists(keys, lambda k: results[specs.stringify(k)])

    # ------------------------------------------------------------------ results

    def gather(self, futures: Any, errors: str = "raise") -> Any:
        """Wait for futures (also nested in lists, tuples and dicts) and fetch their values."""
        flat = [f for f in _flatten(futures) if isinstance(f, Future)]
        values = self._results(flat, None, skip_errors=errors != "raise")
        return _pack_like(futures, lambda f: values.get(f.key) if isinstance(f, Future) else f)

    def _results(
        self, futures: list[Future], timeout: float | None, skip_errors: bool = False
    ) -> dict[str, Any]:
        """Wait for ``futures`` and fetch their values from the workers.

        The news that a key finished can be stale: it may be about an earlier run of the
        same key (cancelled, released, submitted again).  When no holder has the value and
        the scheduler's record says the task is not in memory, the future waits again."""
        deadline = None if timeout is None else time.monotonic() + timeout
        values: dict[str, Any] = {}
        pending = futures
        while pending:
            for f in pending:
                f._wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if not skip_errors:
                for f in pending:
                    f._raise_if_failed()
            finished = {f.key: f._state.finishes for f in pending if f.status == "finished"}
            got, stale = self._gather_keys(list(finished))
            values.update(got)
            with self._lock:
                for key in stale:
                    state = self._states.get(key)
                    if state is not None and state.finishes == finished[key]:
                        state.reset()  # no newer news arrived meanwhile
            pending = [f for f in pending if f.key in stale]
        return values

    def _gather_keys(self, keys: list[str]) -> tuple[dict[str, Any], set[str]]:
        """Fetch values from the workers holding them, one request per worker.  Returns
        the values and the keys whose task the scheduler no longer has in memory."""
        remaining = set(keys)
        stale: set[str] = set()
        values: dict[str, Any] = {}
        tried: dict[str, set[str]] = defaultdict(set)
        # a holder that just died is still named by the scheduler until it notices (well
        # under a second; scheduler.worker-ttl at worst): wait that long, then give up
        patience = time.monotonic() + self.config.scheduler.worker_ttl + 2.0
        delay = 0.02
        while remaining:
            by_worker: dict[str, list[str]] = defaultdict(list)
            unknown = []
            for key in remaining:
                holders = [w for w in self._state_for(key).who_has if w not in tried[key]]
                if holders:
                    by_worker[holders[hash(key) % len(holders)]].append(key)
                else:
                    unknown.append(key)
            if unknown:
                if time.monotonic() > patience:
                    raise DataUnavailableError(
                        f"could not fetch {sorted(unknown)[:5]} from any worker holding them "
                        f"(tried {dict(tried)}); the workers may have died — resubmit the work"
                    )
                same_holders = False
                for key, state in self._refresh_who_has(unknown).items():
                    if state is not None and state != "memory":
                        stale.add(key)
                        remaining.discard(key)
                    elif set(self._state_for(key).who_has) <= tried[key]:
                        same_holders = True
                    tried[key].clear()
                if same_holders:
                    time.sleep(delay)  # the same dead holders: let the scheduler notice
                    delay = min(delay * 2, 0.5)
                continue
            for address, wkeys in by_worker.items():
                try:
                    header, frames = self._peers.rpc(address, {"op": "get-data", "keys": wkeys})
                    got, errs = comm.deserialize_dict(header, frames)
                except (OSError, comm.CommError) as exc:
                    logger.warning("could not fetch %d keys from %s: %s", len(wkeys), address, exc)
                    got, errs = {}, {}
                if errs:
                    raise next(iter(errs.values()))
                values.update(got)
                for key in wkeys:
                    if key in got:
                        remaining.discard(key)
                    else:
                        tried[key].add(address)
        return values, stale

    def _refresh_who_has(self, keys: list[str]) -> dict[str, str | None]:
        """Read holders from the scheduler's records; returns each key's recorded state."""
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.hmget(self.keys.task(key), ["who_has", "state"])
        states: dict[str, str | None] = {}
        for key, (who_has, state) in zip(keys, pipe.execute(), strict=True):
            states[key] = state.decode() if state is not None else None
            # the scheduler's record wins once it has one; until then (e.g. data scattered
            # a moment ago, not yet processed) what this client knows stands
            if state is not None:
                self._state_for(key).who_has = (who_has or b"").decode().split()
        return states

    def who_has(self, futures: Any = None) -> dict[str, list[str]]:
        keys = [f.key for f in _flatten(futures)] if futures is not None else list(self._states)
        self._refresh_who_has(keys)
        return {k: list(self._state_for(k).who_has) for k in keys}

    def recreate_error_locally(self, future: Future) -> None:
        """Run the task that made ``future`` err here, in this process, with the same
        function, arguments and dependencies, so that a debugger can stop in it (e.g.
        ``pdb.runcall(client.recreate_error_locally, future)`` or ``%debug`` after it).

        The task is the one that raised (``future`` may only have inherited the error);
        its function and arguments come from the graph history in Redis and its
        dependencies from the workers, recomputed first if they were released."""
        future._wait(None)
        if future.status != "error":
            raise ValueError(f"task {future.key!r} did not err (its status is {future.status})")
        blame = (self.redis.hget(self.keys.task(future.key), "exception_blame") or b"").decode()
        key = blame or future.key
        spec, deps = self.redis.hmget(self.keys.task(key), ["spec", "deps"])
        if spec is None:
            raise DataUnavailableError(
                f"the graph history of {key!r} is gone (no spec in Redis), so it cannot be "
                "run again; keep a future of it to keep its history"
            )
        dep_keys = schema.unpack(deps) if deps else []
        pipe = self.redis.pipeline(transaction=False)
        for dep in dep_keys:
            pipe.exists(self.keys.task(dep))
        gone = [d for d, exists in zip(dep_keys, pipe.execute(), strict=True) if not exists]
        if gone:
            raise DataUnavailableError(
                f"the graph history of {key!r}'s dependencies {gone[:5]} is gone, so it cannot "
                "be run again; keep futures of the inputs you may want to debug with"
            )
        dep_futures = [Future(k, self) for k in dep_keys]  # hold them while we need them
        if dep_keys:
            self._send([{"op": "client-desires-keys", "client": self.id, "keys": dep_keys}])
        values = self._results(dep_futures, None)
        specs.run_spec(spec, values, specs.FunctionCache())

    def restart(self, timeout: float = 30.0) -> None:
        """Restart the cluster (as in Dask): every task is forgotten, every future of every
        client becomes cancelled, every worker drops what it holds and runs, and a worker
        under a nanny is replaced by a fresh process.  Returns when as many workers as
        before are registered, the nannies' ones new; the cluster is usable at once."""
        self._check_running()
        before = {
            a.decode(): schema.unpack(v) for a, v in self.redis.hgetall(self.keys.workers).items()
        }
        deadline = time.monotonic() + timeout
        self._restarted.clear()
        with self._lock:
            for state in self._states.values():
                state.cancel()
            self._pending_release.clear()
        self._send([{"op": "restart", "client": self.id}])
        if not self._restarted.wait(timeout):
            raise FuturesTimeoutError(
                f"the scheduler did not restart the cluster within "
                f"{timeout} s (is a scheduler running?)"
            )
        old = {(a, w.get("started")) for a, w in before.items() if w.get("nanny")}

        def back() -> bool:
            now = {
                a.decode(): schema.unpack(v)
                for a, v in self.redis.hgetall(self.keys.workers).items()
            }
            fresh = [a for a, w in now.items() if (a, w.get("started")) not in old]
            return len(fresh) >= len(before)

        while not back():
            if time.monotonic() > deadline:
                raise FuturesTimeoutError(
                    f"the workers did not come back within {timeout} s of the restart"
                )
            time.sleep(0.02)  # the nannies start new processes; their registration is polled

    def replicate(self, futures: Any, n: int = 2, timeout: float | None = 30.0) -> None:
        """Keep ``n`` copies of each future's data on distinct workers (fewer if there are
        fewer workers); the scheduler makes up for a lost copy while one survives.
        Returns when the copies are there."""
        flat = [f for f in _flatten(futures) if isinstance(f, Future)]
        self._results(flat, timeout)  # in memory first
        keys = [f.key for f in flat]
        self._send([{"op": "replicate", "client": self.id, "keys": keys, "n": int(n)}])
        want = min(n, len(self.scheduler_info()["workers"]))
        deadline = None if timeout is None else time.monotonic() + timeout
        while not all(len(holders) >= want for holders in self.who_has(flat).values()):
            if deadline is not None and time.monotonic() > deadline:
                raise FuturesTimeoutError(
                    f"{want} copies of {len(keys)} keys not made within {timeout} s"
                )
            time.sleep(0.02)  # the copies are made worker to worker; their arrival is polled

    def retire_workers(
        self,
        workers: str | list[str] | None = None,
        n: int | None = None,
        timeout: float | None = 60.0,
    ) -> dict[str, Any]:
        """Close workers gracefully (as in Dask): they claim nothing more, hand back the
        tasks they claimed but did not start, finish the running ones, and leave once
        every result that only they held has been copied to a worker that stays, so no
        result is lost or recomputed.  ``workers``: addresses or names; or ``n``: that
        many of the workers holding the least data.  Returns ``{address: info}`` of the
        workers that left.  A retirement that would leave nobody to take their data is
        refused (logged; those workers keep running and are not in the result)."""
        self._check_running()
        info = self.scheduler_info()["workers"]
        if workers is not None:
            by_name = {str(w.get("name")): a for a, w in info.items()}
            wanted = [workers] if isinstance(workers, str) else list(workers)
            unknown = [w for w in wanted if w not in info and w not in by_name]
            if unknown:
                raise ValueError(
                    f"no worker with address or name {unknown} in cluster "
                    f"{self.keys.cluster!r}; its workers are {sorted(info)}"
                )
            addresses = [w if w in info else by_name[w] for w in wanted]
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
        self._send([{"op": "retire-workers", "client": self.id, "workers": addresses}])
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
        return {a: info[a] for a in addresses if a not in refused}

    def _held_bytes(self, addresses: list[str]) -> dict[str, int]:
        """Bytes of results each worker holds, from its last heartbeat."""
        held = dict.fromkeys(addresses, 0)
        for address, raw in self.redis.hgetall(self.keys.heartbeats).items():
            beat = schema.unpack(raw)
            if address.decode() in held and isinstance(beat, dict):
                held[address.decode()] = int(beat.get("managed") or 0)
        return held

    # ------------------------------------------------------------------ scatter

    def scatter(
        self,
        data: Any,
        workers: list[str] | None = None,
        broadcast: bool = False,
        hash: bool = True,
    ) -> Any:
        """Send data straight to workers; returns futures in the shape of ``data``."""
        self._check_running()
        if isinstance(data, dict):
            items = list(data.items())
        elif isinstance(data, list | tuple | set | frozenset):
            items = [(None, v) for v in data]
        else:
            items = [(None, data)]
        targets = workers or sorted(self.scheduler_info()["workers"])
        if not targets:
            raise RedisDaskError("no workers to scatter to: start workers (or wait for them) first")
        keyed: dict[str, Any] = {}
        for name, value in items:
            head = comm.serialize(value)
            tok = specs.token(bytes(head[0])) if hash else uuid.uuid4().hex
            key = specs.stringify(name) if name is not None else f"{type(value).__name__}-{tok}"
            keyed[key] = value
        who_has: dict[str, list[str]] = defaultdict(list)
        by_worker: dict[str, dict[str, Any]] = defaultdict(dict)
        for i, (key, value) in enumerate(keyed.items()):
            chosen = targets if broadcast else [targets[i % len(targets)]]
            for address in chosen:
                by_worker[address][key] = value
                who_has[key].append(address)
        for address, values in by_worker.items():
            header, frames, errors = comm.serialize_dict(values)
            if errors:
                raise TypeError(next(iter(errors.values())))
            reply, _ = self._peers.rpc(address, {"op": "put-data", **header}, frames)
            if reply.get("status") != "OK":
                raise RedisDaskError(f"worker {address} refused scattered data: {reply}")
        nbytes = {k: _sizeof(v) for k, v in keyed.items()}
        types = {k: type(v).__name__ for k, v in keyed.items()}
        with self._lock:
            for key in keyed:
                self._state_for(key).finish(who_has[key], types[key])
        msg = {
            "op": "update-data",
            "client": self.id,
            "who_has": dict(who_has),
            "nbytes": nbytes,
            "types": types,
        }
        futures = {k: Future(k, self) for k in keyed}
        self._send([msg])
        if isinstance(data, dict):
            return futures
        if isinstance(data, list | tuple | set | frozenset):
            return (
                type(data)(futures.values())
                if not isinstance(data, set | frozenset)
                else list(futures.values())
            )
        return next(iter(futures.values()))

    # ------------------------------------------------------------------ cancel

    def cancel(self, futures: Any) -> None:
        keys = [f.key for f in _flatten(futures) if isinstance(f, Future)]
        with self._lock:
            for key in keys:
                self._state_for(key).cancel()
            generation = self._generation
        # the scheduler answers with every key it cancelled (dependents too), echoing the
        # generation so that keys submitted again since are not cancelled by the answer
        self._send(
            [{"op": "cancel-keys", "client": self.id, "keys": keys, "generation": generation}]
        )

    # ------------------------------------------------------------------ information

    def scheduler_info(self) -> dict[str, Any]:
        """A Dask-like summary: ``workers`` keyed by worker address."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.workers)
        pipe.hgetall(self.keys.heartbeats)
        pipe.hgetall(self.keys.scheduler)
        workers_raw, beats_raw, sched = pipe.execute()
        workers = {}
        for address, info in workers_raw.items():
            entry = schema.unpack(info)
            beat = beats_raw.get(address)
            if beat:
                entry["metrics"] = schema.unpack(beat)
            workers[address.decode()] = entry
        return {
            "type": "Scheduler",
            "id": (sched.get(b"id") or b"").decode(),
            "address": redact(self.redis_url),
            "cluster": self.keys.cluster,
            "workers": workers,
        }

    def get_versions(self, check: bool = False) -> dict[str, Any]:
        """Versions of this client, the scheduler and every worker (as in Dask).
        ``check=True`` raises ``VersionMismatchError`` with a table of what differs."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hget(self.keys.scheduler, "versions")
        pipe.hgetall(self.keys.workers)
        sched, workers = pipe.execute()
        result = {
            "client": versions(),
            "scheduler": schema.unpack(sched) if sched else None,
            "workers": {
                a.decode(): schema.unpack(i).get("versions", {}) for a, i in workers.items()
            },
        }
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

    def nthreads(self) -> dict[str, int]:
        return {a: w.get("nthreads", 0) for a, w in self.scheduler_info()["workers"].items()}

    # ------------------------------------------------------------------ reference counting

    def _state_for(self, key: str) -> _FutureState:
        with self._lock:
            state = self._states.get(key)
            if state is None:
                state = self._states[key] = _FutureState()
            return state

    def _inc_ref(self, key: str) -> None:
        with self._lock:
            self._refcount[key] += 1

    def _dec_ref(self, key: str) -> None:
        with self._lock:
            self._refcount[key] -= 1
            if self._refcount[key] <= 0:
                del self._refcount[key]
                self._states.pop(key, None)
                self._pending_release.append(key)

    def _release_messages(self) -> list[dict[str, Any]]:
        keys = []
        while self._pending_release:
            keys.append(self._pending_release.popleft())
        with self._lock:
            keys = [k for k in keys if k not in self._refcount]
        if not keys:
            return []
        return [{"op": "client-releases-keys", "client": self.id, "keys": keys}]

    # ------------------------------------------------------------------ background thread

    def _heartbeat(self) -> None:
        ttl_ms = int(self.config.scheduler.client_ttl * 1000)
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.client_alive(self.id), 1, px=ttl_ms)
        pipe.hset(
            self.keys.clients,
            self.id,
            schema.pack(
                {
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "last_seen": time.time(),
                    "versions": self._versions,
                }
            ),
        )
        pipe.execute()

    def _event_loop(self) -> None:
        stream = self.keys.client_events(self.id)
        last_id = "0"
        interval = self.config.client.heartbeat_interval
        next_beat = time.monotonic() + interval
        while not self._stop.is_set():
            try:
                block = max(1, int((next_beat - time.monotonic()) * 1000))
                reply = self._events_redis.xread({stream: last_id}, block=block, count=1000)
                for _name, items in reply or []:
                    for entry_id, fields in items:
                        last_id = entry_id
                        self._handle_entry(fields)
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + interval
                    # trimming what was read waits for the heartbeat: off the latency path
                    self._events_redis.xtrim(stream, minid=last_id)
                    self._heartbeat()
                    if self._pending_release:
                        self._send()
                self._redis_back()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if self._stop.is_set():
                    return
                self._redis_lost(exc)
                self._stop.wait(0.2)
            except Exception:
                if self._stop.is_set():
                    return
                logger.exception("client %s: error handling scheduler messages", self.id)

    def _handle_entry(self, fields: dict[bytes, bytes]) -> None:
        for msg in schema.unpack(fields[b"m"]):
            op = msg.get("op")
            with self._lock:
                if op == "key-in-memory":
                    state = self._states.get(msg["key"])
                    if state is not None:
                        state.finish(msg["who_has"], msg.get("type", ""))
                elif op == "task-erred":
                    state = self._states.get(msg["key"])
                    if state is not None:
                        exc, tb = _load_error(msg)
                        state.set_error(exc, tb)
                elif op == "retire-refused":
                    for address in msg["workers"]:
                        self._retire_refused[address] = str(msg.get("reason", ""))
                elif op == "restarted":
                    for state in self._states.values():
                        state.cancel()
                    self._restarted.set()
                elif op == "cancelled-keys":
                    for key in msg["keys"]:
                        state = self._states.get(key)
                        if state is not None and state.generation <= msg.get("generation", 0):
                            state.cancel()

    # ------------------------------------------------------------------ lifecycle

    def _check_running(self) -> None:
        if self.status != "running":
            raise RedisDaskError(f"client {self.id} is {self.status}; create a new Client")

    def close(self) -> None:
        if self.status != "running":
            return
        self.status = "closing"
        with self._lock:
            for state in self._states.values():
                state.cancel()
        self._stop.set()
        try:
            pipe = self.redis.pipeline(transaction=True)
            # wake our event thread from its blocking read, then say goodbye (the scheduler
            # deletes the events stream when it handles close-client, after this entry)
            pipe.xadd(self.keys.client_events(self.id), schema.entry([{"op": "closing"}]))
            pipe.xadd(
                self.keys.client_stream, schema.entry([{"op": "close-client", "client": self.id}])
            )
            pipe.delete(self.keys.client_alive(self.id))
            pipe.execute()
        except redis.RedisError as exc:
            logger.warning("client %s could not say goodbye to Redis: %s", self.id, exc)
        self._thread.join(timeout=5)
        self._peers.close()
        self._events_redis.close()
        self.redis.close()
        self.status = "closed"
        if _default_client[0] is self:
            _default_client[0] = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Client {self.id} cluster={self.keys.cluster!r} redis={redact(self.redis_url)}>"


# --------------------------------------------------------------------------- helpers


def _toposort(tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Dependencies before dependents (Kahn); ``ValueError`` naming a key on a cycle."""
    by_key = {t["key"]: t for t in tasks}
    missing = {t["key"]: {d for d in t["deps"] if d in by_key} for t in tasks}
    dependents: dict[str, list[str]] = defaultdict(list)
    for key, deps in missing.items():
        for dep in deps:
            dependents[dep].append(key)
    ready = deque(key for key, deps in missing.items() if not deps)
    order = []
    while ready:
        key = ready.popleft()
        order.append(by_key[key])
        for dependent in dependents[key]:
            missing[dependent].discard(key)
            if not missing[dependent]:
                ready.append(dependent)
    if len(order) < len(tasks):
        stuck = next(k for k, deps in missing.items() if deps)
        raise ValueError(f"the graph has a cycle: {stuck!r} depends (indirectly) on itself")
    return order


def _chunks(
    tasks: list[dict[str, Any]], max_tasks: int, max_bytes: int
) -> list[list[dict[str, Any]]]:
    """Split tasks into stream entries of at most ``max_tasks`` tasks and about
    ``max_bytes`` of specs (a single bigger task gets an entry of its own)."""
    chunks: list[list[dict[str, Any]]] = [[]]
    size = 0
    for task in tasks:
        n = len(task.get("spec") or b"")
        if chunks[-1] and (len(chunks[-1]) >= max_tasks or size + n > max_bytes):
            chunks.append([])
            size = 0
        chunks[-1].append(task)
        size += n
    return chunks


def _options(retries: int, priority: int, workers: str | list[str] | None) -> dict[str, Any]:
    """Per-task options as the scheduler reads them from an update-graph message."""
    options: dict[str, Any] = {"priority": int(priority), "retries": int(retries)}
    if workers:
        options["workers"] = [workers] if isinstance(workers, str) else list(workers)
    return options


def _load_error(msg: dict[str, Any]) -> tuple[BaseException, Any]:
    """Rebuild the original exception and traceback a worker pickled."""
    exc: BaseException
    try:
        exc = cloudpickle.loads(msg["exception"]) if msg.get("exception") else None  # type: ignore[assignment]
    except Exception as err:
        exc = RedisDaskError(
            f"the task raised an exception that could not be unpickled here: {err}; "
            f"it was: {msg.get('exception_text')}"
        )
    if exc is None and msg.get("killed"):
        evidence = schema.unpack(msg["killed"])
        exc = KilledWorker(evidence["task"], evidence["deaths"], msg.get("exception_text", ""))
    if exc is None and msg.get("rejected"):
        from redisdask.errors import SchedulerRejectedError

        exc = SchedulerRejectedError(msg.get("exception_text") or "the scheduler refused it")
    if exc is None:
        exc = DataUnavailableError(msg.get("exception_text") or "task erred")
    tb = None
    if msg.get("traceback"):
        try:
            from tblib import Traceback

            tb = Traceback.from_dict(cloudpickle.loads(msg["traceback"])).as_traceback()
        except Exception:
            tb = None
    return exc, tb


def _sizeof(value: Any) -> int:
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    try:
        return len(cloudpickle.dumps(value, protocol=5))
    except Exception:
        return 0


def _flatten(obj: Any) -> Iterator[Any]:
    if isinstance(obj, list | tuple | set | frozenset | Iterator):
        for x in obj:
            yield from _flatten(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _flatten(x)
    else:
        yield obj


def _flatten_lists(obj: Any) -> Iterator[Any]:
    if isinstance(obj, list):
        for x in obj:
            yield from _flatten_lists(x)
    else:
        yield obj


def _pack_lists(template: Any, leaf: Callable[[Any], Any]) -> Any:
    if isinstance(template, list):
        return [_pack_lists(x, leaf) for x in template]
    return leaf(template)


def _pack_like(template: Any, leaf: Callable[[Any], Any]) -> Any:
    if isinstance(template, list | tuple):
        return type(template)(_pack_like(x, leaf) for x in template)
    if isinstance(template, dict):
        return {k: _pack_like(v, leaf) for k, v in template.items()}
    return leaf(template)


_default_client: list[Client | None] = [None]


def _set_default(client: Client) -> None:
    _default_client[0] = client


def default_client() -> Client:
    client = _default_client[0]
    if client is None:
        raise ValueError("no Client is running: create one with Client(...)")
    return client


# --------------------------------------------------------------------------- wait


class DoneAndNotDoneFutures(NamedTuple):
    done: set[Future]
    not_done: set[Future]


def wait(
    fs: Any, timeout: float | None = None, return_when: str = "ALL_COMPLETED"
) -> DoneAndNotDoneFutures:
    """Wait until all (or the first, ``return_when="FIRST_COMPLETED"``) futures finish."""
    futures = [f for f in _flatten(fs) if isinstance(f, Future)]
    deadline = None if timeout is None else time.monotonic() + timeout
    if return_when == "FIRST_COMPLETED":
        first = threading.Event()
        for f in futures:
            f.add_done_callback(lambda _f: first.set())
        if not first.wait(timeout):
            raise FuturesTimeoutError(f"none of {len(futures)} futures finished in {timeout} s")
    else:
        for f in futures:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not f._state.event.wait(left):
                raise FuturesTimeoutError(
                    f"{sum(not g.done() for g in futures)} of {len(futures)} futures did not "
                    f"finish within {timeout} s"
                )
    done = {f for f in futures if f.done()}
    return DoneAndNotDoneFutures(done, set(futures) - done)


class as_completed:
    """Iterate over futures in the order they finish.  ``with_results=True`` yields
    ``(future, result)`` pairs.  ``add(future)`` adds more while iterating."""

    def __init__(
        self,
        futures: Iterable[Future] = (),
        with_results: bool = False,
        timeout: float | None = None,
    ) -> None:
        self._queue: deque[Future] = deque()
        self._cond = threading.Condition()
        self._pending = 0
        self.with_results = with_results
        self.timeout = timeout
        self._counter = itertools.count()
        for f in futures:
            self.add(f)

    def add(self, future: Future) -> None:
        with self._cond:
            self._pending += 1
        future.add_done_callback(self._on_done)

    def _on_done(self, future: Future) -> None:
        with self._cond:
            self._queue.append(future)
            self._cond.notify_all()

    def __iter__(self) -> as_completed:
        return self

    def __next__(self) -> Any:
        with self._cond:
            if self._pending == 0:
                raise StopIteration
            if not self._cond.wait_for(lambda: bool(self._queue), timeout=self.timeout):
                raise FuturesTimeoutError(f"no future finished within {self.timeout} s")
            future = self._queue.popleft()
            self._pending -= 1
        if self.with_results:
            return future, future.result()
        return future
