"""How a worker runs: in a process of its own (``main``, which ``redisdask worker`` and a
nanny's child call), or on an event loop in a thread of the caller's process
(``ThreadWorker``, ``LocalCluster(processes=False)``); and its options from the loaded
configuration (``options_from_config``)."""

from __future__ import annotations

import asyncio
import faulthandler
import signal
import threading
import time
from typing import Any

from redisdask.security import Security
from redisdask.spec import make_dask_default
from redisdask.store import logship
from redisdask.utils import logs
from redisdask.utils.heap import Heap
from redisdask.workers.memory import keep_large_blocks_apart
from redisdask.workers.worker import Worker

HEAP_SETTLE_INTERVAL = 1.0  # seconds between freezes of what survived (``redisdask.utils.heap``)


def options_from_config(config: Any) -> dict[str, Any]:
    """``Worker`` keyword arguments from a loaded ``redisdask.config.Config``."""
    return {
        "heartbeat_interval": config.worker.heartbeat_interval,
        "story_maxlen": config.retention.worker_story,
        "events_maxlen": config.retention.events,
        "worker_ttl": config.scheduler.worker_ttl,
        "hang_timeout": config.worker.hang_timeout,
        "claim_horizon": config.worker.claim_horizon,
        "connection_limit": config.worker.connection_limit,
        "peer_timeout": config.comm.timeouts.tcp,
        "peer_connect_timeout": config.comm.timeouts.connect,
        "idle_timeout": config.comm.timeouts.idle,
        "max_connections": config.comm.max_connections,
        "transfer_batch_bytes": config.worker.transfer_batch_bytes,
        "inline_result_bytes": config.worker.inline_result_bytes,
        "inline_results_redis_fraction": config.worker.inline_results_redis_fraction,
        "inline_results_redis_bytes": config.worker.inline_results_redis_bytes,
        "connect_timeout": config.redis.connect_timeout,
        "local_directory": config.worker.local_directory,
        "memory_target": config.worker.memory.target,
        "memory_spill": config.worker.memory.spill,
        "memory_pause": config.worker.memory.pause,
        "memory_monitor_interval": config.worker.memory.monitor_interval,
        "memory_terminate": config.worker.memory.terminate,
        "resources": config.worker.resources,
        "max_error_length": config.admin.max_error_length,
        "security": Security.from_config(config),
    }


class ThreadWorker:
    """A worker on its own event loop in a thread of this process
    (``LocalCluster(processes=False)``)."""

    def __init__(self, redis_url: str, cluster: str, **options: Any) -> None:
        self.worker = Worker(redis_url, cluster, **options)
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(
            target=asyncio.run,
            args=(self._main(),),
            daemon=True,
            name=f"rd-worker-{options.get('name') or ''}",
        )

    def start(self, timeout: float = 30.0) -> ThreadWorker:
        self.thread.start()
        if not self._started.wait(timeout):
            raise TimeoutError(f"an in-process worker did not start within {timeout} s")
        if self._error is not None:
            raise self._error
        return self

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            await self.worker.start()
        except BaseException as exc:
            self._error = exc
            return
        finally:
            self._started.set()
        await self.worker.run()

    def close(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self.thread.is_alive():
            future = asyncio.run_coroutine_threadsafe(
                self.worker.close("cluster-close"), self._loop
            )
            future.result(timeout)
        self.thread.join(timeout)


async def _settle_heap() -> None:
    heap = Heap()
    while True:
        heap.settle()
        await asyncio.sleep(HEAP_SETTLE_INTERVAL)  # a timer by nature


def _dask_get(dsk: Any, keys: Any, **kwargs: Any) -> Any:
    """dask's scheduler in a worker's process (``worker_client.dask_get``), imported at
    the first graph a task computes: a worker starts without the client's modules."""
    from redisdask.client.worker_client import dask_get

    return dask_get(dsk, keys, **kwargs)


def main(redis_url: str, cluster: str, **kwargs: Any) -> None:
    """Run one worker in this process until SIGTERM/SIGINT, then leave gracefully."""
    faulthandler.enable()  # a crash in compiled code prints every thread's Python stack
    keep_large_blocks_apart()

    async def run() -> None:
        # this process is the worker's own: dask's scheduler here is the cluster inside a
        # task (as distributed's get_client() is dask's fallback there), dask's threads
        # elsewhere; in-thread workers leave the user's process's dask config alone
        make_dask_default(_dask_get)
        worker = Worker(redis_url, cluster, **kwargs)
        loop = asyncio.get_running_loop()
        closing: set[asyncio.Task[None]] = set()  # the loop holds tasks weakly: keep them
        first_signal: list[float] = []
        early: list[signal.Signals] = []  # a signal while starting: acted on once started

        def on_signal(sig: signal.Signals) -> None:
            # while starting (registered, perhaps, and its tasks claimed soon): leave
            # gracefully once started; before, such a signal killed the process outright
            # and what it had claimed was taken for a death's.  A second one: at once
            if worker.status == "init":
                if early:
                    loop.remove_signal_handler(sig)
                    signal.raise_signal(sig)
                early.append(sig)
                return
            # the first signal: hand the data over, then leave; a second one (not the
            # same stop sent to the whole process group and again by the nanny): now
            if first_signal and time.monotonic() - first_signal[0] < 2.0:
                return
            first_signal.append(time.monotonic())
            if closing:
                closing.add(asyncio.ensure_future(worker.close(f"signal {sig.name} (again)")))
            else:
                closing.add(asyncio.ensure_future(worker.close_gracefully(f"signal {sig.name}")))

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        await worker.start()
        logs.set_name(worker.name or worker.address)  # its address, if it had no name
        logship.set_stream(worker.keys.worker_logs(worker.address))
        if early:
            on_signal(early[0])
        # the process is ours (not an in-thread worker's host): keep the cycle collector
        # off the results it holds, whose full scans outlived the heartbeat's TTL (kept
        # apart from ``closing``, which says whether a signal already began the close)
        settle = asyncio.ensure_future(_settle_heap())
        await worker.run()
        settle.cancel()
        if worker.failure is not None:
            raise SystemExit(1)

    asyncio.run(run())
