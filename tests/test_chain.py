"""Chains on a real cluster (redisdask/scheduler/chain.py, the FINISH script): each link
of ``x = submit(f, x)`` is claimed by the worker that finished the link before, in the
step that reports it, and still runs exactly once, through a scheduler ``kill -9`` too."""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path

import pytest
import redis
from conftest import ClusterFactory

from redisdask import Client, LocalCluster
from redisdask.store.codecs import unpack
from redisdask.store.keyspace import Keys
from tests.polling import poll
from tests.tasklib import wait_for_file

pytestmark = pytest.mark.timeout(120)
LINKS = 200


def link(x: int, log: str, gate: str | None = None) -> int:
    """One link: waits for ``gate`` if given, then records its run (one line per run)."""
    if gate is not None:
        wait_for_file(gate)
    with open(log, "a") as f:
        f.write(f"{x}\n")
    return x + 1


def runs(log: Path) -> Counter[int]:
    return Counter(int(line) for line in log.read_text().split()) if log.exists() else Counter()


def submit_chain(client: Client, log: Path, gates: dict[int, Path]) -> list:
    """``LINKS`` links, link ``i`` waiting for ``gates[i]`` if there is one."""
    futures = [client.submit(link, 0, str(log), str(gates[0]) if 0 in gates else None)]
    for i in range(1, LINKS):
        gate = str(gates[i]) if i in gates else None
        futures.append(client.submit(link, futures[-1], str(log), gate))
    return futures


def waiting(r: redis.Redis, keys: Keys, key: str) -> bool:
    return r.hget(keys.task(key), "state") == b"waiting"


def queued_ever(r: redis.Redis, keys: Keys) -> set[str]:
    """The keys that the scheduler's story shows ``queued`` at some point."""
    out = set()
    for _, fields in r.xrange(keys.story):
        for key, state, _ in unpack(fields[b"m"])["transitions"]:
            if state == "queued":
                out.add(key)
    return out


def test_a_chain_runs_each_link_once_on_chained_claims(
    client: Client, cluster: LocalCluster, tmp_path: Path
) -> None:
    r = redis.Redis.from_url(cluster.redis_url)
    keys = Keys(cluster.cluster_name)
    log, gate = tmp_path / "runs", tmp_path / "go"
    futures = submit_chain(client, log, {0: gate})
    # every link waits (and is in its dependency's chain) before the first one runs
    poll(lambda: waiting(r, keys, futures[-1].key))
    gate.touch()
    assert futures[-1].result(timeout=60) == LINKS
    assert runs(log) == Counter(range(LINKS))  # each link ran once
    chained = {f.key for f in futures[1:]} - queued_ever(r, keys)
    # every link after the first was claimed by FINISH, not queued (a few may go the
    # usual way: a report that goes out with a holding report claims nothing)
    assert len(chained) >= (LINKS - 1) * 3 // 4, len(chained)


def fail_at(x: int, at: int) -> int:
    if x == at:
        raise ValueError(f"link {x} fails")
    return x + 1


def test_a_link_that_raises_mid_chain_errs_every_link_after_it(client: Client) -> None:
    """Links claimed on links claimed in the same step (FINISH goes several deep): the one
    that raises errs, and the links chained on it are taken back and err too."""
    x = client.submit(fail_at, 0, 50)
    futures = [x]
    for _ in range(99):
        futures.append(client.submit(fail_at, futures[-1], 50))
    with pytest.raises(ValueError, match="link 50 fails"):
        futures[-1].result(timeout=60)
    assert client.gather(futures[:50]) == list(range(1, 51))
    assert all(f.status == "error" for f in futures[50:])


def test_a_chain_survives_a_scheduler_kill_and_runs_on_without_one(
    redis_url: str, cluster_name: str, tmp_path: Path, make_cluster: ClusterFactory
) -> None:
    """The scheduler is killed (-9) while a link runs; the chain goes on without any
    scheduler (its links are claimed by FINISH), and a new scheduler reads what happened
    meanwhile: the results are right, and no link ran twice."""
    log, first, middle = tmp_path / "runs", tmp_path / "first", tmp_path / "middle"
    with (
        make_cluster(
            nanny=False,
            n_workers=2,
            threads_per_worker=1,
        ) as cluster,
        Client(cluster) as client,
    ):
        r = redis.Redis.from_url(redis_url)
        keys = Keys(cluster_name)
        futures = submit_chain(client, log, {0: first, LINKS // 2: middle})
        poll(lambda: waiting(r, keys, futures[-1].key))
        first.touch()
        poll(lambda: len(runs(log)) == LINKS // 2)  # the middle link waits for its gate
        cluster.scheduler_process.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        cluster.scheduler_process.wait()  # type: ignore[union-attr]
        middle.touch()
        poll(lambda: len(runs(log)) == LINKS, timeout=30)  # no scheduler runs meanwhile
        cluster.start_scheduler()
        assert futures[-1].result(timeout=60) == LINKS
        assert client.gather(futures[::20]) == list(range(1, LINKS + 1, 20))
        assert runs(log) == Counter(range(LINKS))


def test_finish_claims_deeper_links_only_within_the_claim_horizon(
    redis_url: str, cluster_name: str
) -> None:
    """The FINISH script alone, on planted records: x processing here names y in its
    chain, y names z; y follows x, and z follows y only while their estimates fit the
    horizon (and are known)."""
    from redisdask.store.bootstrap import ensure_cluster
    from redisdask.store.codecs import pack
    from redisdask.store.scripts import Scripts

    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    me = "tcp://10.9.9.9:1"
    scripts = Scripts(r, keys)

    def plant(estimate: float | None) -> None:
        r.hset(keys.workers, me, pack({"nthreads": 1}))
        r.hset(
            keys.task("x-1"),
            mapping={
                "state": "processing",
                "worker": me,
                "spec": b"s",
                "deps": pack([]),
                "chain": pack(["y-1"]),
            },
        )
        r.hset(
            keys.task("y-1"),
            mapping={
                "state": "waiting",
                "spec": b"s",
                "score": 2,
                "deps": pack(["x-1"]),
                "chain": pack(["z-1"]),
            },
        )
        r.hset(keys.task("z-1"), mapping={"state": "waiting", "spec": b"s", "score": 3,
                                          "deps": pack(["y-1"])})  # fmt: skip
        r.delete(keys.durations, keys.worker_processing(me))
        if estimate is not None:
            r.hset(keys.durations, mapping={"y": estimate, "z": estimate})

    def claimed(horizon: float) -> list[str]:
        tasks, *_ = scripts.finish(worker=me, ttl_ms=3000, reports=[pack({"op": "x"})],
                                  finished=["x-1"], chain=1, last_inbox_id="0-0",
                                  deeper=16, horizon=horizon)  # fmt: skip
        return [t[0].decode() for t in tasks]

    plant(0.001)
    assert claimed(0.02) == ["y-1", "z-1"]
    assert r.hget(keys.task("z-1"), "state") == b"processing"
    plant(0.015)
    assert claimed(0.02) == ["y-1"]  # y's 15 ms and z's would pass the horizon
    assert r.hget(keys.task("z-1"), "state") == b"waiting"
    plant(None)
    assert claimed(0.02) == ["y-1"]  # unknown cost: no deeper link
