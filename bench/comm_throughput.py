"""Peer-to-peer throughput of redisdask.comm for a 100 MB numpy array (not a test).

The data server runs in a separate process (as a peer worker would); this process
fetches the array with the async ConnectionPool and with the BlockingConnection and
prints MB/s, median of 5 transfers each.

    python bench/comm_throughput.py [size_mb]
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from redisdask.comm import (
    BlockingConnection,
    Buffer,
    ConnectionPool,
    DataServer,
    deserialize,
    serialize,
)

SECRET = b"bench-secret"
REPEATS = 5


def _serve(size: int, ready: Any) -> None:
    data = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)

    async def handler(
        header: dict[str, Any], frames: list[memoryview]
    ) -> tuple[dict[str, Any], Sequence[Buffer]]:
        if header["op"] == "put":
            return {"status": "ok", "nbytes": sum(f.nbytes for f in frames)}, []
        return {"status": "ok"}, serialize(data)

    async def main() -> None:
        server = DataServer(SECRET, handler)
        ready.send(await server.start("127.0.0.1"))
        await asyncio.Event().wait()

    asyncio.run(main())


def _report(name: str, size: int, seconds: list[float]) -> None:
    rates = [size / s / 1e6 for s in seconds]
    print(
        f"{name:<28} median {statistics.median(rates):8.0f} MB/s "
        f"(min {min(rates):.0f}, max {max(rates):.0f})"
    )


async def _async_bench(address: str, size: int) -> None:
    pool = ConnectionPool(SECRET, limit=4)
    await pool.rpc(address, {"op": "ping"}, [])  # warm up: connect + handshake
    get, put = [], []
    payload = serialize(np.ones(size, dtype=np.uint8))
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        _, frames = await pool.rpc(address, {"op": "get"})
        deserialize(frames)
        get.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await pool.rpc(address, {"op": "put"}, payload)
        put.append(time.perf_counter() - t0)
    await pool.close()
    _report("async pool, fetch", size, get)
    _report("async pool, send", size, put)


def _blocking_bench(address: str, size: int) -> None:
    conn = BlockingConnection(address, SECRET)
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        _, frames = conn.rpc({"op": "get"})
        deserialize(frames)
        times.append(time.perf_counter() - t0)
    conn.close()
    _report("blocking connection, fetch", size, times)


def main() -> None:
    size = int(float(sys.argv[1]) * 1e6) if len(sys.argv) > 1 else 100_000_000
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_serve, args=(size, child), daemon=True)
    proc.start()
    try:
        address = parent.recv()
        print(f"{size / 1e6:.0f} MB uint8 array from a server process at {address}")
        asyncio.run(_async_bench(address, size))
        _blocking_bench(address, size)
    finally:
        proc.terminate()
        proc.join()


if __name__ == "__main__":
    main()
