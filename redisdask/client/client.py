"""The user's entry point: ``Client`` (``Future`` and ``wait`` live in ``futures.py``,
``as_completed`` in ``completed.py``; the package ``redisdask.client`` exports them all).

The client talks to the scheduler only through Redis: submissions go on the clients
stream (batched: ``map`` of 100,000 items is a few pipelined XADDs), and the scheduler
answers on this client's own events stream (both in ``channel.py``).  Results are
fetched straight from the workers that hold them, over authenticated TCP
(``redisdask.comm``; ``fetch.py``); only small ones pass through Redis, in their task
records.  The I/O is coroutines, run on the
caller's loop (``asynchronous=True``) or on the blocking client's own loop thread.

Futures of one key share a ``_FutureState`` (``redisdask.client.futures``); the client counts
references per key and tells the scheduler to release a key when its last future is
garbage-collected.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import inspect
import logging
import queue
import threading
import time
import uuid
import weakref
from collections import defaultdict, deque
from collections.abc import (
    Awaitable,
    Callable,
    Coroutine,
    Generator,
    Hashable,
    Iterable,
    Iterator,
    Mapping,
)
from concurrent.futures import TimeoutError as FuturesTimeoutError
from typing import Any, TypeVar

from redisdask import comm, context
from redisdask import spec as specs
from redisdask.client.admin import ClusterAdmin
from redisdask.client.annotations import call_options
from redisdask.client.channel import SchedulerChannel
from redisdask.client.events import EventMethods, Subscriptions
from redisdask.client.fetch import ResultFetcher
from redisdask.client.futures import (
    Future,
    _flatten,
    _FutureState,
    _seconds,
    futures_of,
)
from redisdask.client.logs import LogMethods
from redisdask.client.loop import (
    LoopThread,
    awaitable_on,
    offloaded,
    run_blocking,
    running_loop,
    wake,
)
from redisdask.client.scatter import ScatterMethods
from redisdask.client.tracebacks import shorten_traceback
from redisdask.client.worker_calls import WorkerCalls
from redisdask.config import load_config
from redisdask.coordination.datasets import DatasetMethods
from redisdask.deploy.cluster import LocalCluster
from redisdask.errors import (
    ClusterNotRunningError,
    DataUnavailableError,
    RedisDaskError,
)
from redisdask.placement import task_options as _options
from redisdask.protocol import (
    CancelKeys,
    ClientDesiresKeys,
    ClientReleasesKeys,
    RetryKeys,
    Stimulus,
    UpdateGraph,
)
from redisdask.security import Security
from redisdask.store import bootstrap, redis_memory
from redisdask.store.connection import check_async, connect, connect_async
from redisdask.store.keyspace import Keys
from redisdask.store.task_record import TaskRecord
from redisdask.store.urls import redact
from redisdask.utils import logs
from redisdask.utils.backoff import Backoff
from redisdask.utils.sizes import format_bytes

logger = logging.getLogger("redisdask.client")

SUBMIT_BATCH_BYTES = 16 << 20  # specs per stream entry, so the scheduler's writes stay small
# the largest spec (function and arguments) a task may carry: it travels through Redis,
# whose bulk strings stop at 512 MB, once from the client and again in the scheduler's
# fenced write
MAX_SPEC_BYTES = 256 << 20
# keywords of Client() with no address that go to the LocalCluster it starts
_LOCAL_CLUSTER_ARGS = frozenset(inspect.signature(LocalCluster).parameters) - {"cluster_name"}
T = TypeVar("T")


# --------------------------------------------------------------------------- client


class Client(ClusterAdmin, WorkerCalls, ScatterMethods, DatasetMethods, LogMethods, EventMethods):
    """Connects to a cluster through Redis.

    ``address`` is a ``LocalCluster``, a Redis URL (``redis://``, ``redis+sentinel://``),
    or None: then the configured URL (``redis.url``, or ``redis.sentinels``) if one is
    configured, else, as distributed's ``Client()`` does, a new ``LocalCluster`` that the
    client owns and closes (keywords such as ``n_workers`` go to it).  Other keywords are
    config overrides (``**{"client.heartbeat-interval": 1}``).

    A client never creates a cluster: when none of that name exists in Redis it waits up
    to ``client.no-scheduler-timeout`` for one to appear, then raises
    ``ClusterNotRunningError`` naming the clusters it found, so a mistyped name leaves no
    keys behind.

    With ``asynchronous=True`` (made in a coroutine) its calls return awaitables on the
    caller's loop; a blocking client runs the same coroutines on a loop thread of its own
    (``redisdask.client.loop``; docs/design.md, "One client, blocking or asynchronous").

    Sending to the scheduler and reading its messages is the work of the
    ``SchedulerChannel`` it holds (``channel.py``); the cluster-wide operations (``restart``,
    ``retire_workers``, ``scheduler_info``…) from ``ClusterAdmin`` (``admin.py``);
    ``run``, ``upload_file`` and plugins from ``WorkerCalls`` (``worker_calls.py``);
    ``scatter`` from ``ScatterMethods`` (``scatter.py``).  ``publish_dataset``,
    ``get_dataset``, ``list_datasets``, ``unpublish_dataset`` and ``datasets`` come from
    ``DatasetMethods`` (``redisdask.coordination.datasets``); ``get_worker_logs`` and
    ``get_scheduler_logs`` from ``LogMethods`` (``logs.py``); ``log_event``,
    ``get_events`` and ``subscribe_topic`` from ``EventMethods`` (``events.py``).
    """

    def __init__(
        self,
        address: Any = None,
        cluster_name: str | None = None,
        *,
        timeout: float | str | None = None,
        set_as_default: bool = True,
        asynchronous: bool = False,
        security: Security | None = None,
        **kwargs: Any,
    ) -> None:
        if asynchronous and running_loop() is None:
            raise RuntimeError(
                "Client(asynchronous=True) belongs to a running event loop: make it in a "
                "coroutine (client = await Client(..., asynchronous=True), or async with)"
            )
        cluster_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in _LOCAL_CLUSTER_ARGS}
        self.config = load_config(kwargs or None)
        logs.setup_client(self.config.logging.level, self.config.logging.format)
        self.cluster: LocalCluster | None = None  # a cluster this client started (and closes)
        self._new_cluster: dict[str, Any] | None = None  # LocalCluster arguments, to start one
        configured = {"url", "sentinels"} & self.config.redis.model_fields_set
        if address is None and not configured:
            self._new_cluster = {"cluster_name": cluster_name, **cluster_kwargs}
        elif cluster_kwargs:
            raise TypeError(
                f"Client({address!r}) connects to a running cluster; {sorted(cluster_kwargs)} "
                "are LocalCluster arguments, for Client() with no address"
            )
        self._given_cluster: LocalCluster | None = None
        if address is not None and not isinstance(address, str):  # a LocalCluster
            self._given_cluster = address
            cluster_name = cluster_name or address.cluster_name
            security = security or address.security
            address = address.redis_url
        # TLS to the workers (redisdask/security.py): given, the cluster's, or configured
        self.security = security or Security.from_config(self.config)
        if self._new_cluster is not None:
            self._new_cluster["security"] = self.security
        self.redis_url: str = address or self.config.redis.address
        self.keys = Keys(cluster_name or self.config.cluster.name)
        self.timeout = _seconds(timeout) or self.config.redis.connect_timeout
        self.id = f"client-{uuid.uuid4().hex[:12]}"
        self.status = "connecting"
        self.asynchronous = asynchronous  # dask asks before using a client as its scheduler
        self._lock = threading.RLock()
        self._states: dict[str, _FutureState] = {}  # key -> what its futures share
        self._refcount: dict[str, int] = defaultdict(int)  # key -> its live futures
        # keys of futures the garbage collector took, counted down at the next look at the
        # counts (``_drain_dropped``): a ``__del__`` never waits for the lock
        self._dropped: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._generation = 0
        self._callbacks: concurrent.futures.ThreadPoolExecutor | None = None
        self._dask_config: Any = None
        self._set_as_default = set_as_default
        self._loop_thread: LoopThread | None = None
        if asynchronous:
            self.loop = asyncio.get_running_loop()
            self._started: asyncio.Future[None] = asyncio.ensure_future(self._astart())
            return
        self._loop_thread = LoopThread(name=f"{self.id}-loop")
        self.loop = self._loop_thread.loop
        try:
            run_blocking(self.loop, self._astart)
        except BaseException:
            self._loop_thread.stop()
            raise
        _open_clients.add(self)

    async def _astart(self) -> None:
        """Connect (a new ``LocalCluster`` first, for ``Client()``), find the cluster,
        say hello, and start the tasks that read the scheduler's messages and send ours."""
        loop = asyncio.get_running_loop()
        if self._new_cluster is not None:
            self.cluster = await loop.run_in_executor(
                None, functools.partial(LocalCluster, **self._new_cluster)
            )
            self.redis_url = self.cluster.redis_url
            self.keys = Keys(self.cluster.cluster_name)
        name = f"rd-client-{self.id}"
        # connection failures are ClusterConnectionError (redisdask.store.connection); the
        # blocking connection serves the cluster-wide calls (ClusterAdmin, WorkerCalls…)
        login = self.config.redis  # the ACL user: redis.username, redis.password
        self._aredis = connect_async(self.redis_url, timeout=self.timeout, name=name,
                                     cluster_errors=True, config=login)  # fmt: skip
        self.redis = connect(self.redis_url, timeout=self.timeout, name=name,
                             cluster_errors=True, check=False, config=login)  # fmt: skip
        self._events_redis = connect_async(
            self.redis_url, timeout=self.timeout, name=f"{name}-events", config=login
        )
        self._channel = SchedulerChannel(
            client_id=self.id,
            config=self.config,
            keys=self.keys,
            redis_url=self.redis_url,
            aredis=self._aredis,
            events_redis=self._events_redis,
            lock=self._lock,
            states=self._states,
            refcount=self._refcount,
            check_running=self._check_running,
            drain=self._drain_dropped,
        )
        try:
            await check_async(self._aredis, self.redis_url, self.timeout)
            memory = await redis_memory.aread(self._aredis)
            if memory is not None:  # (INFO refused: the heartbeat warns, once)
                redis_memory.check_policy(memory, f"client {self.id}")
            self.secret = await self._afind_cluster()
            await self._channel.aheartbeat()
        except BaseException:
            await self._disconnect()
            if self.cluster is not None:
                await loop.run_in_executor(None, self.cluster.close)
            self.status = "failed"
            raise
        for what in self._channel.missing_since:
            logger.warning("%s", self._channel.missing_text(what, waited=None))
        self._peers = comm.ConnectionPool(
            self.secret,
            timeout=self.timeout,
            tls=self.security.client_context(),
            dead_after=self.config.comm.timeouts.tcp,
        )
        self._fetcher = ResultFetcher(self)
        self._channel.start()
        self._subscriptions = Subscriptions(self.redis_url, self.keys, self.config, self.timeout)
        self.status = "running"
        if self._set_as_default:
            context.set_default(self)
            self._dask_config = specs.make_dask_default(self)

    async def _afind_cluster(self) -> bytes:
        """The cluster's secret, once a scheduler or a worker created the cluster."""
        limit = self.config.client.no_scheduler_timeout
        deadline = time.monotonic() + limit
        backoff = Backoff(base=0.05, cap=1.0)
        if (secret := await bootstrap.cluster_secret(self._aredis, self.keys)) is not None:
            return secret
        logger.warning("%s; waiting up to %g s for it", await self._no_cluster_text(), limit)
        while (secret := await bootstrap.cluster_secret(self._aredis, self.keys)) is None:
            if time.monotonic() > deadline:
                raise ClusterNotRunningError(
                    f"{await self._no_cluster_text()} (waited {limit:g} s: "
                    "client.no-scheduler-timeout)"
                )
            await asyncio.sleep(backoff.next())  # connecting: wait for the cluster to be created
        return secret

    async def _no_cluster_text(self) -> str:
        """No such cluster, the ones there are (a SCAN: only for a message), what to do."""
        url, name = redact(self.redis_url), self.keys.cluster
        loop = asyncio.get_running_loop()
        found = await loop.run_in_executor(None, bootstrap.known_clusters, self.redis)
        return (
            f"no cluster named {name!r} on {url} (no scheduler or worker ever ran it); the "
            f"clusters there are {found or 'none'}: check the name, or start its scheduler "
            f"with `redisdask scheduler {url} --cluster {name}`"
        )

    # ------------------------------------------------------------------ sync and async

    def _sync(self, make: Callable[..., Coroutine[Any, Any, T]], *args: Any, **kwargs: Any) -> Any:
        """``make(...)`` run on the client's loop: awaitable for an asynchronous client,
        waited for (its value) by a blocking one, as distributed's ``Client.sync``."""
        if self.asynchronous:
            return awaitable_on(self.loop, make, *args, **kwargs)
        return run_blocking(self.loop, make, *args, **kwargs)

    def _block(self, make: Callable[..., Coroutine[Any, Any, T]], *args: Any, **kwargs: Any) -> T:
        """``make(...)`` run on the client's loop, waited for from this (other) thread."""
        return run_blocking(self.loop, make, *args, **kwargs)

    def __await__(self) -> Generator[Any, None, Client]:
        async def started() -> Client:
            if self.asynchronous:
                await self._started
            return self

        return started().__await__()

    async def __aenter__(self) -> Client:
        return await self

    async def __aexit__(self, *exc: object) -> None:
        await self._sync(self._aclose)

    # ------------------------------------------------------------------ submission

    def submit(
        self,
        func: Callable[..., Any],
        *args: Any,
        key: Hashable | None = None,
        workers: str | Iterable[str] | None = None,
        resources: dict[str, float] | None = None,
        retries: int | None = None,
        priority: int = 0,
        fifo_timeout: str | float = "100 ms",
        allow_other_workers: bool = False,
        actor: bool = False,
        actors: bool = False,
        pure: bool = True,
        **kwargs: Any,
    ) -> Future:
        """Run ``func(*args, **kwargs)`` on the cluster; futures in arguments are
        dependencies.  The keywords are distributed's; ``fifo_timeout`` is accepted and
        has no effect here (the cluster breaks ties by submission order).  Raises
        ``TypeError`` at once if anything is unpicklable."""
        self._check_running()
        if not callable(func):
            raise TypeError(f"submit() needs a callable as its first argument, got {func!r}")
        _refuse_unsupported(actor or actors)
        if allow_other_workers and workers is None:  # (as distributed's submit says)
            raise ValueError("Only use allow_other_workers= if using workers=")
        function_bytes = specs.dumps_function(func)
        options = call_options(retries, priority, workers, allow_other_workers, resources)
        task_key = None if key is None else specs.check_key(key)
        task = self._make_task(func, function_bytes, args, kwargs, task_key, pure)
        task.update(options(task["key"] if key is None else key))
        future = Future(task["key"], self, dask_key=key, _state=self._state_for(task["key"], True))
        cancelled = self._cancelled_dependency(task)
        if cancelled is not None:
            future._state.cancel(f"it depends on {cancelled!r}, which was cancelled")
            return future
        self._send_graph([task], [task["key"]])
        return future

    def map(
        self,
        func: Callable[..., Any],
        *iterables: Iterable[Any],
        key: str | list[Hashable] | None = None,
        workers: str | Iterable[str] | None = None,
        retries: int | None = None,
        resources: dict[str, float] | None = None,
        priority: int = 0,
        allow_other_workers: bool = False,
        fifo_timeout: str | float = "100 ms",
        actor: bool = False,
        actors: bool = False,
        pure: bool = True,
        batch_size: int | None = None,
        **kwargs: Any,
    ) -> list[Future]:
        """``submit`` for each item of the iterables, in a few batched round trips.

        ``key`` is a list of keys, one per item, or a prefix: the keys are then
        ``<prefix>-<token of the function and the item's arguments>``, as in
        distributed, so two maps with one prefix and other items never share keys."""
        self._check_running()
        if not callable(func):
            raise TypeError(f"map() needs a callable as its first argument, got {func!r}")
        _refuse_unsupported(actor or actors)
        if allow_other_workers and workers is None:  # (as distributed's map says)
            raise ValueError("Only use allow_other_workers= if using workers=")
        function_bytes = specs.dumps_function(func)
        items = list(zip(*iterables, strict=False))
        if isinstance(key, list):
            if len(key) != len(items):
                raise ValueError(f"map() got {len(key)} keys for {len(items)} items")
            keys: list[Hashable | None] = list(key)
        elif key is None or isinstance(key, str):
            keys = [None] * len(items)
        else:
            raise TypeError(f"map(key=) takes a prefix (str) or a list of keys, got {key!r}")
        prefix = key if isinstance(key, str) else None
        options = call_options(retries, priority, workers, allow_other_workers, resources)
        tasks = []
        for args, task_key in zip(items, keys, strict=True):
            name = None if task_key is None else specs.check_key(task_key)
            task = self._make_task(func, function_bytes, args, kwargs, name, pure, prefix)
            task.update(options(task["key"] if task_key is None else task_key))
            tasks.append(task)
        futures = [
            Future(t["key"], self, dask_key=k, _state=self._state_for(t["key"], True))
            for t, k in zip(tasks, keys, strict=True)
        ]
        sendable = []
        for task, future in zip(tasks, futures, strict=True):
            cancelled = self._cancelled_dependency(task)
            if cancelled is None:
                sendable.append(task)
            else:
                future._state.cancel(f"it depends on {cancelled!r}, which was cancelled")
        if sendable:
            self._send_graph(sendable, [t["key"] for t in sendable])
        return futures

    def _make_task(
        self,
        func: Any,
        function_bytes: bytes,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        key: str | None,
        pure: bool,
        prefix: str | None = None,
    ) -> dict[str, Any]:
        deps: set[str] = set()
        args = specs.replace_refs(args, self._future_key, deps)
        kwargs = specs.replace_refs(kwargs, self._future_key, deps)
        found: list[Future] = []  # futures deeper inside objects of other types
        spec = specs.dumps_spec(function_bytes, args, kwargs, func, futures=found)
        deps.update(self._future_key(f) for f in found)
        if len(spec) > MAX_SPEC_BYTES:
            raise ValueError(
                f"the arguments of {specs.funcname(func)} pickle to {format_bytes(len(spec))}, "
                f"more than a task may carry ({format_bytes(MAX_SPEC_BYTES)}: tasks travel "
                "through Redis). Send large data to the workers with client.scatter(data) and "
                "pass the future it returns instead"
            )
        if key is None:
            tok = specs.token(spec) if pure else uuid.uuid4().hex
            key = f"{prefix or specs.funcname(func)}-{tok}"
        return {"key": key, "spec": spec, "deps": sorted(deps)}

    def _cancelled_dependency(self, task: dict[str, Any]) -> str | None:
        """The first dependency of ``task`` whose future was cancelled, if any: its task is
        gone from the cluster, so the dependent is cancelled too (as in distributed)."""
        with self._lock:
            for dep in task["deps"]:
                state = self._states.get(dep)
                if state is not None and state.status == "cancelled":
                    return dep
        return None

    def _future_key(self, obj: Any) -> str | None:
        """The key of ``obj`` if it is a future (of this client: else ``ValueError``)."""
        if isinstance(obj, Future):
            if obj.client is not self:
                raise ValueError(f"future {obj.key!r} belongs to another client")
            return obj._key
        return None

    def _send_graph(self, tasks: list[dict[str, Any]], wanted: list[str]) -> None:
        """Send the graph in batches (one pipeline).  The caller holds futures for
        ``wanted`` already, so no release of those keys can be sent after this."""
        submitted = [t["key"] for t in tasks]
        sent_again = set(submitted)
        with self._lock:
            self._generation += 1
            generation = self._generation
            for key in wanted:
                state = self._state_for(key)
                # pending again: cancelled, or erred because its graph was never written
                if state.status == "cancelled" or (state.unsent and key in sent_again):
                    state.reset()
                state.generation = self._generation
        chunks = _chunks(tasks, self.config.client.submit_batch, SUBMIT_BATCH_BYTES)
        if len(chunks) == 1:
            graph = UpdateGraph(self.id, tasks, wanted, generation)
            self._channel.send([graph], resubmitted=submitted, wait=False)
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
        # each wanted key goes with the chunk of its task (its first), a future the graph
        # depends on and already held with the first chunk
        chunk_of: dict[str, int] = {}
        for i, chunk in enumerate(chunks):
            for t in chunk:
                chunk_of.setdefault(t["key"], i)
        wanted_in: list[list[str]] = [[] for _ in chunks]
        for key in wanted:
            wanted_in[chunk_of.get(key, 0)].append(key)
        entries: list[list[Stimulus]] = [
            [UpdateGraph(self.id, chunk, want + bridge, generation)]
            for chunk, want, bridge in zip(chunks, wanted_in, bridges, strict=True)
        ]
        bridge_keys = [k for bridge in bridges for k in bridge]
        if bridge_keys:
            entries.append([ClientReleasesKeys(self.id, bridge_keys)])
        self._channel.send(*entries, resubmitted=submitted, wait=False)

    def get(
        self,
        dsk: Any,
        keys: Any,
        workers: str | Iterable[str] | None = None,
        allow_other_workers: bool | None = None,
        resources: dict[str, float] | None = None,
        sync: bool = True,
        retries: int | None = None,
        priority: int = 0,
        fifo_timeout: str | float = "60s",
        actors: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Compute a dask graph, as dask's schedulers do: ``dask.compute(x,
        scheduler=client.get)``.  ``dsk`` is a dask expression, a HighLevelGraph or a
        dict (old-style tuples, ``dask._task_spec`` nodes, futures as dependencies);
        ``keys`` one key or nested lists of keys.  Returns the values in the shape of
        ``keys``, or futures with ``sync=False``."""
        self._check_running()
        _refuse_unsupported(bool(actors))
        flat = list(_flatten_lists(keys))  # lists give the shape; tuples are dask keys
        futures = self._graph_to_futures(
            dsk, flat, workers, allow_other_workers, retries, priority, resources
        )
        packed = _pack_lists(keys, lambda k: futures[k])
        if not sync:
            return packed
        with shorten_traceback():  # as gather's
            return self._sync(self._aget, packed, list(futures.values()))

    async def _aget(self, packed: Any, futures: list[Future]) -> Any:
        try:
            return await self._agather(packed, "raise")
        finally:
            for f in futures:
                f.release()

    def compute(
        self,
        collections: Any,
        sync: bool = False,
        optimize_graph: bool = True,
        workers: str | Iterable[str] | None = None,
        allow_other_workers: bool = False,
        resources: dict[str, float] | None = None,
        retries: int = 0,
        priority: int = 0,
        fifo_timeout: str | float = "60s",
        actors: Any = None,
        traverse: bool = True,
        **kwargs: Any,
    ) -> Any:
        """Compute dask collections on the cluster, as distributed does: a future per
        collection (a list for a list, one for one), or the values with ``sync=True``.
        Non-dask items of a list pass through unchanged."""
        self._check_running()
        dask = _import_dask("Client.compute")
        from dask._expr import FinalizeCompute
        from dask.base import collections_to_expr

        _refuse_unsupported(bool(actors))
        singleton = not isinstance(collections, list | tuple | set | frozenset)
        items = [collections] if singleton else list(collections)
        if traverse:
            items = [
                dask.delayed(a) if isinstance(a, list | set | tuple | dict | Iterator) else a
                for a in items
            ]
        variables = [a for a in items if dask.is_dask_collection(a)]
        futures: dict[Hashable, Future] = {}
        names: list[Hashable] = []
        if variables:
            expr = FinalizeCompute(collections_to_expr(variables, optimize_graph, **kwargs))
            expr = expr.optimize()
            names = list(_flatten_lists(expr.__dask_keys__()))
            futures = self._graph_to_futures(
                expr, names, workers, allow_other_workers, retries, priority, resources
            )
        out: list[Any] = []
        done = iter(names)
        for item in items:
            out.append(futures[next(done)] if dask.is_dask_collection(item) else item)
        if sync:
            return self._sync(self._acompute_values, out, singleton)
        return out[0] if singleton else out

    async def _acompute_values(self, out: list[Any], singleton: bool) -> Any:
        values = await self._agather(out, "raise")
        return values[0] if singleton else values

    def persist(
        self,
        collections: Any,
        optimize_graph: bool = True,
        workers: str | Iterable[str] | None = None,
        allow_other_workers: bool | None = None,
        resources: dict[str, float] | None = None,
        retries: int | None = None,
        priority: int = 0,
        fifo_timeout: str | float = "60s",
        actors: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Start computing dask collections on the cluster and return, at once, equal
        collections whose graphs are the futures of the results (as distributed does):
        computing them later fetches the results instead of computing them again."""
        self._check_running()
        dask = _import_dask("Client.persist")
        from dask.base import collections_to_expr

        _refuse_unsupported(bool(actors))
        singleton = not isinstance(collections, list | tuple | set | frozenset)
        items = [collections] if singleton else list(collections)
        if not all(dask.is_dask_collection(c) for c in items):
            raise TypeError("Client.persist takes dask collections (arrays, dataframes, ...)")
        expr = collections_to_expr(items, optimize_graph).optimize()
        keys = expr.__dask_keys__()
        futures = self._graph_to_futures(
            expr, list(_flatten_lists(keys)), workers, allow_other_workers, retries, priority,
            resources,
        )  # fmt: skip
        result = []
        for collection, collection_keys in zip(items, keys, strict=True):
            rebuild, args = collection.__dask_postpersist__()
            result.append(rebuild({k: futures[k] for k in _flatten_lists(collection_keys)}, *args))
        return result[0] if singleton else result

    def _graph_to_futures(
        self,
        dsk: Any,
        keys: list[Hashable],
        workers: str | Iterable[str] | None,
        allow_other_workers: bool | None,
        retries: int | None,
        priority: int | None,
        resources: dict[str, float] | None = None,
    ) -> dict[Hashable, Future]:
        """Send a dask graph (see ``get``); a future for each of ``keys``."""
        wanted = [specs.check_key(k) for k in keys]
        call = {"workers": workers, "retries": retries, "priority": priority,
                "allow_other_workers": allow_other_workers, "resources": resources}  # fmt: skip
        if specs.dask_installed():
            from redisdask.client import dask_graph

            graph = dask_graph.to_graph(dsk, call, self._future_key, self._has_live_future)
            tasks = graph.tasks
            known = set(graph.dask_keys) | graph.external
        else:
            if not isinstance(dsk, Mapping):
                raise ImportError(_DASK_MISSING.format(what="a dask collection"))
            tasks = specs.toposort(
                self._legacy_tasks(
                    dsk, _options(retries, priority, workers, allow_other_workers, resources)
                )
            )
            known = {t["key"] for t in tasks}
        absent = [
            k
            for k, name in zip(keys, wanted, strict=True)
            if name not in known and not self._has_live_future(name)
        ]
        if absent:
            raise KeyError(f"keys {absent[:5]} are not in the graph (nor futures of this client)")
        futures = {
            k: Future(name, self, dask_key=k, _state=self._state_for(name, True))
            for k, name in zip(keys, wanted, strict=True)
        }
        self._send_graph(tasks, list(dict.fromkeys(wanted)))
        return futures

    def _has_live_future(self, key: str) -> bool:
        with self._lock:
            state = self._states.get(key)
            return state is not None and state.status != "cancelled"

    def _legacy_tasks(
        self, dsk: Mapping[Hashable, Any], options: dict[str, Any]
    ) -> list[dict[str, Any]]:
        """Tasks of an old-style dict graph of tuples, without dask installed."""
        graph_keys = set(dsk)

        def to_ref(obj: Any) -> str | None:
            if isinstance(obj, Future):
                return self._future_key(obj)
            try:
                return specs.stringify(obj) if obj in graph_keys else None
            except TypeError:  # unhashable
                return None

        tasks = []
        for key, value in dsk.items():
            func, args = specs.graph_task(value, graph_keys)
            deps: set[str] = set()
            args = specs.replace_refs(args, to_ref, deps)
            spec = specs.dumps_spec(specs.dumps_function(func), args, {}, func)
            tasks.append(
                {"key": specs.check_key(key), "deps": sorted(deps), "spec": spec, **options}
            )
        return tasks

    # ------------------------------------------------------------------ results

    def gather(self, futures: Any, errors: str = "raise", direct: bool | None = None) -> Any:
        """Wait for futures (also nested in lists, tuples, sets and dicts) and fetch their
        values.  ``errors="raise"`` raises the first error as soon as it happens;
        ``"skip"`` leaves the erred and cancelled futures out of the result.  ``direct``
        is accepted for distributed's sake: values always come straight from the workers.
        Awaitable on an asynchronous client."""
        if errors not in ("raise", "skip"):
            raise ValueError(f"errors= is 'raise' or 'skip', got {errors!r}")
        with shorten_traceback():  # a task's error: its frames, not the client's
            return self._sync(self._agather, futures, errors)

    async def _agather(self, futures: Any, errors: str) -> Any:
        flat = [f for f in _flatten(futures) if isinstance(f, Future)]
        with shorten_traceback():  # (awaited on an asynchronous client)
            values = await self._aresults(flat, None, skip_errors=errors == "skip")
        packed = _pack_like(
            futures,
            lambda f: values.get(f._key, _SKIPPED) if isinstance(f, Future) else f,
        )
        return None if packed is _SKIPPED else packed

    def _results(
        self, futures: list[Future], timeout: float | None, skip_errors: bool = False
    ) -> dict[str, Any]:
        """``_aresults`` from another thread than the client's loop."""
        return self._block(self._aresults, futures, timeout, skip_errors)

    def _wait_for(self, futures: list[Future], deadline: float | None, stop_on_error: bool) -> None:
        """``_await_for`` from another thread than the client's loop."""
        self._block(self._await_for, futures, deadline, stop_on_error)

    async def _aresults(
        self, futures: list[Future], timeout: float | None, skip_errors: bool = False
    ) -> dict[str, Any]:
        """Wait for ``futures`` and fetch their values from the workers; without
        ``skip_errors``, raise the first error as soon as one of them errs.

        The news that a key finished can be stale: it may be about an earlier run of the
        same key (cancelled, released, submitted again).  When no holder has the value and
        the scheduler's record says the task is not in memory, the future waits again."""
        deadline = None if timeout is None else time.monotonic() + timeout
        values: dict[str, Any] = {}
        pending = futures
        while pending:
            await self._await_for(pending, deadline, stop_on_error=not skip_errors)
            if not skip_errors:
                for f in pending:
                    f._raise_if_failed()
            finished = {f._key: f._state.finishes for f in pending if f.status == "finished"}
            got, stale = await self._fetcher.gather_keys(list(finished))
            values.update(got)
            with self._lock:
                for key in stale:
                    state = self._states.get(key)
                    if state is not None and state.finishes == finished[key]:
                        state.reset()  # no newer news arrived meanwhile
            # what is still to come: stale news, or a future reset meanwhile by another
            # gather of the same key (never left out of the result silently)
            pending = [
                f
                for f in pending
                if f._key not in values and not (skip_errors and f.status in _FAILED)
            ]
        return values

    async def _await_for(
        self, futures: list[Future], deadline: float | None, stop_on_error: bool
    ) -> None:
        """Return when every future is done, or (``stop_on_error``) as soon as one erred or
        was cancelled.  Each finishing future wakes this coroutine once (done callbacks),
        so waiting for 100,000 futures costs no scan per wake-up.  While Redis is away,
        gives up after ``redis.down-deadline`` (the futures are kept)."""
        loop = asyncio.get_running_loop()
        finished: deque[_FutureState] = deque()  # appended to by the done callbacks
        woken = asyncio.Event()
        remaining = 0
        with self._lock:
            for f in futures:
                state = f._state
                if not state.is_set():
                    remaining += 1
                    state.callbacks.append(
                        lambda state=state: (finished.append(state), wake(loop, woken))  # type: ignore[misc]
                    )
                elif stop_on_error and state.status in _FAILED:
                    return
        while remaining:
            woken.clear()
            while finished:
                remaining -= 1
                status = finished.popleft().status
                if stop_on_error and status in _FAILED:
                    return
            if not remaining:
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                undone = sum(not f.done() for f in futures)
                raise FuturesTimeoutError(
                    f"{undone} of {len(futures)} futures did not finish within the timeout"
                )
            await self._channel.acheck_waiting()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), 0.25 if left is None else min(left, 0.25))

    @offloaded
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
        erred = TaskRecord.read(self.redis, self.keys.task(future._key), ["exception_blame"])
        key = erred.exception_blame or future._key  # the task that raised
        record = TaskRecord.read(self.redis, self.keys.task(key), ["spec", "deps"])
        if record.spec is None:
            raise DataUnavailableError(
                f"the graph history of {key!r} is gone (no spec in Redis), so it cannot be "
                "run again; keep a future of it to keep its history"
            )
        dep_keys = record.deps
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
            self._channel.send([ClientDesiresKeys(self.id, dep_keys)])
        values = self._results(dep_futures, None)
        specs.run_spec(record.spec, values, specs.FunctionCache())

    # ------------------------------------------------------------------ cancel

    def cancel(
        self,
        futures: Any,
        asynchronous: bool | None = None,
        force: bool = False,
        reason: str | None = None,
        msg: str | None = None,
    ) -> Awaitable[None] | None:
        """Cancel futures (a future, collections of them, or dask collections: see
        ``futures_of``) and this client's dependents of them: ``result()`` then raises
        ``FutureCancelledError``, with ``reason`` (or ``msg``) in its message.  The
        tasks stop unless another client wants them (``force`` is accepted for
        distributed's sake: another client's wants are its own here).  On an
        asynchronous client it returns an awaitable (the cancellation is sent anyway)."""
        keys = list(dict.fromkeys(f._key for f in futures_of(futures)))
        why = reason or msg or "it was cancelled"
        with self._lock:
            for key in keys:
                self._state_for(key).cancel(why)
            generation = self._generation
        # the scheduler answers with every key it cancelled (dependents too), echoing the
        # generation so that keys submitted again since are not cancelled by the answer
        return self._channel.send([CancelKeys(self.id, keys, generation)])

    def retry(self, futures: Any, asynchronous: bool | None = None) -> Awaitable[None] | None:
        """Run erred futures' tasks again (with the erred tasks they depend on), as
        distributed does; the futures are pending until they finish or err anew."""
        keys = [f._key for f in futures_of(futures) if f.status == "error"]
        with self._lock:
            for key in keys:
                self._state_for(key).reset()
        return self._channel.send([RetryKeys(self.id, keys)]) if keys else self._sync(_nothing)

    @property
    def dashboard_link(self) -> str | None:
        """The URL of the cluster's web dashboard, as in Dask: the one its
        ``LocalCluster(dashboard_address=...)`` started; None when this client knows of
        none (``redisdask dashboard`` serves one for any cluster)."""
        cluster = self.cluster or self._given_cluster
        return getattr(cluster, "dashboard_link", None)

    # ------------------------------------------------------------------ reference counting

    @property
    def futures(self) -> dict[str, _FutureState]:
        """Key -> the state its futures share, for every key this client has futures of."""
        with self._lock:
            self._drain_dropped()
            return dict(self._states)

    @property
    def refcount(self) -> dict[str, int]:
        """Key -> how many live futures this client holds for it."""
        with self._lock:
            self._drain_dropped()
            return dict(self._refcount)

    def _state_for(self, key: str, submitting: bool = False) -> _FutureState:
        """The state shared by the futures of ``key``.  A new one made for a submission
        takes no news written before the scheduler reads that submission
        (``KeyInMemory.seen``): such news is about an earlier run of the key, perhaps of
        another computation, whose release the submission follows."""
        with self._lock:
            self._drain_dropped()
            state = self._states.get(key)
            if state is None:
                state = self._states[key] = _FutureState()
                if submitting:
                    state.generation = self._generation + 1  # (``_send_graph`` sets it)
            return state

    def _inc_ref(self, key: str) -> None:
        with self._lock:
            self._drain_dropped()
            self._refcount[key] += 1

    def _dec_ref(self, key: str) -> None:
        with self._lock:
            self._drain_dropped()
            self._count_down(key)

    def _dropped_future(self, key: str) -> None:
        """A future of ``key`` went with the garbage collector (``Future.__del__``),
        which may run in any thread at any instant, that one holding the lock or waited
        for by the thread that does: counted down later, without waiting for anything."""
        self._dropped.put(key)

    def _drain_dropped(self) -> None:
        """(Under the lock, so the only taker) count down the futures the garbage
        collector took; at every future made or released: no exception raised for none."""
        while not self._dropped.empty():
            self._count_down(self._dropped.get_nowait())

    def _count_down(self, key: str) -> None:
        self._refcount[key] -= 1
        if self._refcount[key] <= 0:
            del self._refcount[key]
            self._states.pop(key, None)
            self._channel.release_later(key)

    def _run_callback(self, callback: Callable[[], Any]) -> None:
        """Run a user's done callback in a thread of its own (as distributed does), so
        that it may block, or wait for other futures, without stalling the client."""
        with self._lock:
            if self._callbacks is None:
                self._callbacks = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix=f"{self.id}-callbacks"
                )
            self._callbacks.submit(_logged(callback))

    # ------------------------------------------------------------------ lifecycle

    @contextlib.contextmanager
    def sending(self) -> Iterator[None]:
        """Around a write that sends wants for this client outside its sender (a
        coordination script: a dataset, a variable, a queue) and the making of the
        futures it hands over: what was queued is written first (a graph just submitted
        is in Redis before its wants), no send of the client's own can interleave (a
        release of the same key popped before, landing after), and the client's reader
        cannot hear of those keys before their futures exist."""
        self._channel.flush()
        with self._channel.send_lock, self._lock:
            yield

    def _check_running(self) -> None:
        if self.status == "running":
            return
        if self.status == "connecting":
            raise RedisDaskError(
                f"client {self.id} is still connecting: await it first "
                "(client = await Client(..., asynchronous=True))"
            )
        raise RedisDaskError(f"client {self.id} is {self.status}; create a new Client")

    def close(self, timeout: float | str | None = None) -> Any:
        """Close the client (and the ``LocalCluster`` it started): every future of it is
        cancelled, the scheduler forgets what only it wanted.  Awaitable on an
        asynchronous client."""
        if self.status in ("closing", "closed", "failed"):
            return self._sync(_nothing) if self.asynchronous else None
        if self.asynchronous:
            return awaitable_on(self.loop, self._aclose)
        if self._loop_thread is not None and running_loop() is not self.loop:
            try:
                run_blocking(self.loop, self._aclose)
            finally:
                self._loop_thread.stop()
                if self.cluster is not None:  # from this thread: at exit no executor runs
                    self.cluster.close()
        return None

    async def _aclose(self) -> None:
        if self.status == "connecting":
            with contextlib.suppress(Exception):
                await self._started
        if self.status != "running":
            return
        with self._lock:
            for state in list(self._states.values()):
                state.cancel(f"its client {self.id} closed")
        # what was queued goes first (e.g. fire_and_forget's message), for a while at most
        flushed = self._channel.send()
        self.status = "closing"
        self._channel.closing = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(flushed, self.timeout)  # type: ignore[arg-type]
        await self._channel.close(self.timeout)
        await self._subscriptions.close()
        await self._peers.close()
        await self._disconnect()
        if self._callbacks is not None:
            self._callbacks.shutdown(wait=False)
        self.status = "closed"
        if self.cluster is not None and self.asynchronous:  # (a blocking client: ``close``)
            await asyncio.get_running_loop().run_in_executor(None, self.cluster.close)
        context.clear_default(self)
        if self._dask_config is not None:  # dask's scheduler as it was before this client
            self._dask_config.__exit__(None, None, None)
            self._dask_config = None

    async def _disconnect(self) -> None:
        await self._events_redis.aclose()
        await self._aredis.aclose()
        self.redis.close()

    def __enter__(self) -> Client:
        if self.asynchronous:
            raise TypeError("an asynchronous Client is used with `async with`, not `with`")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Client {self.id} cluster={self.keys.cluster!r} redis={redact(self.redis_url)}>"


# --------------------------------------------------------------------------- helpers


async def _nothing() -> None:
    """An awaitable that does nothing (what an asynchronous client returns when there is
    nothing to do)."""


def _logged(callback: Callable[[], Any]) -> Callable[[], None]:
    def run() -> None:
        try:
            callback()
        except Exception:
            logger.exception("a future's done callback raised")

    return run


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


def _refuse_unsupported(actor: bool) -> None:
    """Say so instead of passing distributed's keywords to the function or ignoring them."""
    if actor:
        raise NotImplementedError("actors are not supported by redisdask")


_FAILED = ("error", "cancelled")
_SKIPPED = object()  # gather(errors="skip"): the place of a failed future, dropped


_DASK_MISSING = "{what} needs dask, which is not installed here: pip install 'redisdask[dask]'"


def _import_dask(what: str) -> Any:
    try:
        import dask
    except ImportError as exc:
        raise ImportError(_DASK_MISSING.format(what=what)) from exc
    return dask


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
    """``template`` with each leaf replaced by ``leaf(x)``; leaves that become
    ``_SKIPPED`` are left out of their list, tuple, set or dict."""
    if isinstance(template, list | tuple | set | frozenset):
        items = (_pack_like(x, leaf) for x in template)
        return type(template)(x for x in items if x is not _SKIPPED)
    if isinstance(template, dict):
        packed = {k: _pack_like(v, leaf) for k, v in template.items()}
        return {k: v for k, v in packed.items() if v is not _SKIPPED}
    return leaf(template)


_open_clients: weakref.WeakSet[Client] = weakref.WeakSet()  # the blocking ones, for atexit
EXIT_CLOSE_TIMEOUT = 5.0  # seconds a process's exit waits for its clients' goodbyes


@atexit.register
def _close_at_exit() -> None:
    """A script that ends without ``close()`` says goodbye all the same, as distributed
    closes its global client at exit: the scheduler releases its keys at once and logs a
    close, not a client that "stopped heartbeating" (after ``scheduler.client-ttl``).  At
    most ``EXIT_CLOSE_TIMEOUT`` in all (a Redis that is away is not waited for).  Then the
    clusters the clients started are closed, as their ``close()`` would: once every
    goodbye is said, as the cluster's Redis may go with it."""
    clients = list(_open_clients)
    owned = [client.cluster for client in clients if client.cluster is not None]
    for client in clients:
        client.cluster = None  # (closed below)
    closers = [
        threading.Thread(target=client.close, daemon=True, name=f"{client.id}-exit")
        for client in clients
    ]
    deadline = time.monotonic() + EXIT_CLOSE_TIMEOUT
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join(max(0.0, deadline - time.monotonic()))
    for cluster in owned:
        try:
            cluster.close()
        except Exception:
            logger.exception("closing %r at exit failed", cluster)
