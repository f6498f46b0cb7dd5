"""Chaos: kill -9 workers and the scheduler under a running computation, repeatedly,
then check every result against a local reference.  Seeded; the seed is in the failure
message (REDISDASK_CHAOS_SEED reruns one)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import redis
from conftest import ClusterFactory

from redisdask import Client
from redisdask.store.keyspace import Keys

pytestmark = pytest.mark.timeout(120)

N_LEAVES = 1_024


def leaf(i: int) -> int:
    threading.Event().wait(0.004)  # a little work, so kills land mid-computation
    return i * i % 97


def chaos_over(flag: str) -> int:
    """Holds the root back until the chaos is over (a worker killed while it waits runs
    it again elsewhere), so that every kill lands while the computation runs."""
    deadline = time.monotonic() + 60
    while not os.path.exists(flag) and time.monotonic() < deadline:
        threading.Event().wait(0.01)
    return 0


def combine(a: int, b: int) -> int:
    return (a * 31 + b) % 1_000_003


def reference() -> int:
    level = [i * i % 97 for i in range(N_LEAVES)]
    while len(level) > 1:
        level = [combine(a, b) for a, b in zip(level[::2], level[1::2], strict=True)]
    return level[0]


def _diagnose(redis_url: str, cluster_name: str) -> str:
    """What Redis says about a computation that did not finish."""
    from collections import Counter

    from redisdask.store.codecs import unpack

    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    states: Counter[bytes] = Counter()
    stuck = []
    for key in r.smembers(keys.tasks):
        record = r.hgetall(keys.task(key.decode()))
        states[record.get(b"state", b"?")] += 1
        if record.get(b"state") not in (b"memory", b"released") and len(stuck) < 5:
            stuck.append(
                (key.decode(), {k.decode(): v[:60] for k, v in record.items() if k != b"spec"})
            )
    workers = {
        w.decode(): (
            r.scard(keys.worker_processing(w.decode())),
            r.exists(keys.worker_alive(w.decode())),
        )
        for w in r.hkeys(keys.workers)
    }
    pending = [
        r.xpending(s, "scheduler")["pending"] for s in (keys.worker_stream, keys.client_stream)
    ]
    died = [(d["name"], d["how"]) for d in (unpack(f[b"m"]) for _, f in r.xrange(keys.deaths))]
    inside = {}
    from redisdask import comm
    from redisdask.store.bootstrap import ensure_cluster

    pool = comm.BlockingPool(ensure_cluster(r, keys), timeout=5)
    for address, (busy, _alive) in workers.items():
        if busy:
            try:
                header, _ = pool.rpc(address, {"op": "inspect"})
                inside[address] = {k: v for k, v in header.items() if k != "story"}
                inside[address]["story"] = header.get("story", [])[-15:]
            except Exception as exc:
                inside[address] = repr(exc)
    pool.close()
    return (
        f"states={dict(states)} ready={r.zcard(keys.ready)} workers={workers} "
        f"pending={pending} lease={r.get(keys.lease)} deaths={died} stuck={stuck}"
    )


def test_chaos_kills_workers_and_the_scheduler(
    redis_url: str, cluster_name: str, tmp_path: Path, make_cluster: ClusterFactory
) -> None:
    seed = int(os.environ.get("REDISDASK_CHAOS_SEED", random.randrange(2**32)))
    rng = random.Random(seed)
    started = time.monotonic()
    with (
        make_cluster(
            nanny=False,
            n_workers=3,
            scheduler_options={"lease_ttl": 1, "allowed_failures": 20},
        ) as cluster,
        Client(cluster) as client,
    ):
        leaves = client.map(leaf, range(N_LEAVES))
        level = leaves
        while len(level) > 1:
            level = [
                client.submit(combine, a, b) for a, b in zip(level[::2], level[1::2], strict=True)
            ]
        flag = tmp_path / "chaos-over"
        root = client.submit(combine, level[0], client.submit(chaos_over, str(flag)))
        done = threading.Event()
        log: list[str] = []

        def chaos() -> None:
            try:
                act()
            finally:
                flag.touch()

        def act() -> None:
            restarts = 0
            for action in rng.sample(["worker"] * 5 + ["scheduler"] * 2, 7):
                if done.wait(rng.uniform(0.3, 0.9)):
                    return
                if action == "worker":
                    alive = [p for p in cluster.worker_processes if p.poll() is None]
                    victim = rng.choice(alive)
                    victim.send_signal(signal.SIGKILL)
                    victim.wait()
                    restarts += 1
                    cluster.start_worker(name=f"worker-r{restarts}")
                else:
                    cluster.scheduler_process.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
                    cluster.scheduler_process.wait()  # type: ignore[union-attr]
                    cluster.start_scheduler()
                log.append(f"{time.monotonic() - started:.1f}s kill {action}")

        thread = threading.Thread(target=chaos, daemon=True)
        thread.start()
        try:
            result = root.result(timeout=75)
        except Exception as exc:
            pytest.fail(f"seed={seed}, chaos: {log}: {exc!r}\n{_diagnose(redis_url, cluster_name)}")
        finally:
            done.set()
            thread.join(30)
        context = f"seed={seed}, chaos: {log}"
        assert result == combine(reference(), 0), context
        assert all(f.status == "finished" for f in leaves), context
        assert client.gather(leaves) == [i * i % 97 for i in range(N_LEAVES)], context
        r = redis.Redis.from_url(redis_url)
        assert r.xlen(Keys(cluster_name).dead_letter) == 0, context
        assert len(log) == 7, f"the chaos did not finish: {context}"
        print(f"chaos {context}; {time.monotonic() - started:.1f} s")
