"""A worker's side of peer-to-peer: the data server that answers other workers and the
clients, and the fetching of its tasks' dependencies.

The server (``comm.DataServer``, authenticated by the cluster's secret, TLS where the
cluster has it) answers ``get-data`` (results to a peer or a client), ``put-data``
(``client.scatter``, replicas and moves), ``inspect``, and the calls of ``calls.py``
(``client.run``, plugins, uploads).  A dependency comes from the peer that holds it, over
a pool of connections; a small one comes from its task's record in Redis instead, where
its report put it (``worker.inline-result-bytes``), or with the claim that brought the
task.  A peer that cannot answer is reported to the scheduler at once (``missing-data``)
while the state machine tries the other holders.  What came, and from where, is counted
(``transfers.py``).
"""

from __future__ import annotations

import itertools
import logging
import pickle
import time
from typing import TYPE_CHECKING, Any

import redis

from redisdask import comm
from redisdask.protocol import MissingData
from redisdask.store import keyspace
from redisdask.workers import calls
from redisdask.workers.events import (
    GatherDepNetworkFailureEvent,
    GatherDepSuccessEvent,
    PutDataEvent,
)
from redisdask.workers.sizeof import sizeof
from redisdask.workers.transfers import TransferCounts

if TYPE_CHECKING:
    from redisdask.workers.worker import Worker

logger = logging.getLogger("redisdask.worker")

_STIMULI = itertools.count()  # makes the transfers' stimulus ids unique


class Peers:
    """Held by the worker as ``worker.peers``: ``start`` serves (and answers the address
    peers reach it at), ``close`` stops serving and fetching."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.transfers = TransferCounts()  # dependencies fetched, for the heartbeat

    async def start(self, secret: bytes) -> str:
        w = self.worker
        self.server = comm.DataServer(
            secret,
            self._handle_rpc,
            tls=w.security.server_context(),
            dead_after=w.peer_timeout,
            idle_timeout=w.idle_timeout,
            max_connections=w.max_connections,
        )
        address = await self.server.start(w.host, w.port)
        self.pool = comm.ConnectionPool(
            secret,
            limit=w.connection_limit,
            timeout=w.peer_connect_timeout,
            tls=w.security.client_context(),
            dead_after=w.peer_timeout,
        )
        return address

    async def close(self) -> None:
        await self.server.close()
        await self.pool.close()

    async def gather_from_redis(self, keys: list[str], claimed: dict[str, bytes]) -> None:
        """Small results kept in their task records: those that came with the claim, the
        others read now.  A key whose record holds no value any more is not in the answer
        (the state machine asks the scheduler where it is)."""
        w = self.worker
        values = dict(claimed)
        missing = [k for k in keys if k not in values]
        if missing:
            try:
                pipe = w.redis.pipeline(transaction=False)
                for key in missing:
                    pipe.hget(w.keys.task(key), "value")
                values.update(zip(missing, await pipe.execute(), strict=True))
            except redis.RedisError as exc:
                logger.warning("could not read %d small results from Redis: %s", len(missing), exc)
        data: dict[str, Any] = {}
        for key, raw in values.items():
            if raw:
                try:
                    data[key] = pickle.loads(raw)  # (Redis is trusted as for task specs)
                except Exception as exc:
                    logger.warning("the small result of %r in Redis cannot be read: %s", key, exc)
        nbytes = {k: sizeof(v) for k, v in data.items()}
        self.transfers.received(sum(nbytes.values()), from_redis=True)
        sid = f"gather-redis-{time.time():.6f}-{next(_STIMULI)}"
        w.handle(GatherDepSuccessEvent(keyspace.REDIS_COPY, data, nbytes, sid))

    async def gather(self, worker: str, keys: list[str]) -> None:
        w = self.worker
        self.transfers.peer_transfer()
        try:
            header, frames = await self.pool.rpc(worker, {"op": "get-data", "keys": keys})
            if header.get("status") != "OK":
                raise comm.CommError(f"peer {worker} answered {header.get('message')!r}")
            data, errors = comm.deserialize_dict(header, frames)
        except (TimeoutError, OSError, comm.CommError) as exc:
            logger.warning(
                "could not fetch %d keys %s from %s: %s; trying other holders, else the "
                "scheduler (missing-data)",
                len(keys),
                keys[:5],
                worker,
                exc,
            )
            # tell the scheduler at once; the state machine tries other holders meanwhile
            w.report(MissingData(w.address, keys, errant_worker=worker))
            w.handle(
                GatherDepNetworkFailureEvent(
                    worker, keys, str(exc), f"gather-fail-{time.time():.6f}-{next(_STIMULI)}"
                )
            )
            return
        for key, err in errors.items():
            logger.warning("peer %s could not send %r: %s", worker, key, err)
        nbytes = {k: sizeof(v) for k, v in data.items()}
        self.transfers.received(sum(nbytes.values()))
        w.handle(
            GatherDepSuccessEvent(
                worker, data, nbytes, f"gather-{time.time():.6f}-{next(_STIMULI)}"
            )
        )

    async def _handle_rpc(
        self, header: dict[str, Any], frames: list[memoryview]
    ) -> tuple[dict[str, Any], list[Any]]:
        w = self.worker
        op = header.get("op")
        if op == "get-data":
            data = w.state.data
            present = {k: data[k] for k in header.get("keys", ()) if k in data}
            reply, out, _errors = comm.serialize_dict(present)
            return {"status": "OK", **reply}, out
        if op == "put-data":
            values, errors = comm.deserialize_dict(header, frames)
            if errors:
                return {"status": "error", "message": str(next(iter(errors.values())))}, []
            w.handle(
                PutDataEvent(
                    dict(values),
                    {k: sizeof(v) for k, v in values.items()},
                    f"put-data-{time.time()}",
                )
            )
            return {"status": "OK", "keys": list(values)}, []
        if op == "inspect":  # what this worker's state machine holds (for diagnosis)
            return {"status": "OK", **w.state_summary()}, []
        if op in calls.OPS:  # client.run, plugins and uploads (workers/calls.py)
            return await calls.handle(w, op, header, frames)
        return {"status": "error", "message": f"unknown op {op!r}"}, []
