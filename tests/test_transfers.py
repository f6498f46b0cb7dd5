"""What moves between workers, and how often: a value one worker fetched from a peer
serves the tasks here that need it, not only the one it was fetched for (real worker
processes, real TCP transfers, counted by the workers' own ``transfer_incoming_*``), and
only when it is of the submission they need: the claim scripts name it (a real Redis)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from polling import poll

from redisdask import Client, LocalCluster, wait
from redisdask.protocol import AddWorker, ClientReleasesKeys, TaskClaimed, TaskFinished, UpdateGraph
from redisdask.scheduler.state import SchedulerState
from redisdask.scheduler.translator import Translator
from redisdask.store.bootstrap import ensure_cluster
from redisdask.store.codecs import pack
from redisdask.store.keyspace import Keys
from redisdask.store.scripts import Scripts

pytestmark = pytest.mark.timeout(90)
SIZE = 300_000  # over ``worker.inline-result-bytes``: it moves peer to peer


def blob(i: int, n: int) -> bytes:
    return bytes([i % 256]) * n


def pair(a: bytes, b: bytes) -> int:
    return len(a) + len(b)


@pytest.fixture
def two(redis_url: str, cluster_name: str) -> Iterator[Client]:
    """A client of two one-thread worker processes."""
    with (
        LocalCluster(nanny=False, n_workers=2, threads_per_worker=1, redis_url=redis_url,
                     cluster_name=cluster_name),
        Client(redis_url, cluster_name=cluster_name) as client,
    ):  # fmt: skip
        client.wait_for_workers(2)
        yield client


def fetched(client: Client, worker: str, after: float) -> tuple[int, int]:
    """The worker's transfers and bytes from peers, by a heartbeat later than ``after``."""
    metrics: dict = {}

    def heard() -> bool:
        metrics.update(client.scheduler_info()["workers"][worker]["metrics"])
        return metrics["time"] > after

    poll(heard, timeout=30)
    return metrics["transfer_incoming_count_total"], metrics["transfer_incoming_bytes_total"]


def test_a_value_fetched_for_one_task_serves_the_next_claimed_that_needs_it(
    two: Client,
) -> None:
    """``(x + x.T)`` on one-thread workers: two tasks need x (made on worker a) and y (made
    on b), and both run on a, which claims the second only once the first has ended.  The
    y it fetched for the first is still there for the second: one transfer, not two."""
    a, b = sorted(two.scheduler_info()["workers"])
    x = two.submit(blob, 1, SIZE, workers=[a])
    y = two.submit(blob, 2, SIZE, workers=[b])
    wait([x, y], timeout=30)
    before = fetched(two, a, time.time())
    first = two.submit(pair, x, y, workers=[a])
    second = two.submit(pair, y, x, workers=[a])
    assert two.gather([first, second]) == [2 * SIZE, 2 * SIZE]
    count, nbytes = fetched(two, a, time.time())
    assert (count - before[0], nbytes - before[1]) == (1, SIZE)


def test_a_claim_names_the_submission_each_dependency_is_of(
    redis_url: str, cluster_name: str
) -> None:
    """The CLAIM and FINISH scripts on a real Redis, driven by the scheduler's own writes:
    ``d`` is computed, released, forgotten and submitted again as another computation.
    A dependent claimed after each names the submission it needs (the record's score),
    which is how a worker tells a copy it kept of the old ``d`` from the new one."""
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    scripts = Scripts(r, keys)
    token = scripts.acquire_lease(token=None, ttl_ms=60_000).decode()
    state = SchedulerState(validate=True)
    a, b = "tcp://10.9.9.9:1", "tcp://10.9.9.9:2"

    def apply(*events: object) -> None:
        commands = Translator(keys).to_commands(state.handle_stimulus(*events))
        scripts.apply_fenced(token=token, commands=commands, ttl_ms=60_000)

    def dependency_of(claimed: list) -> list:
        (task,) = claimed
        (dep,) = task[3]
        return dep

    def submit_and_claim(y: str, spec: bytes) -> list:
        tasks = [{"key": "d", "spec": spec, "deps": [], "priority": 0, "retries": 0},
                 {"key": y, "spec": b"y", "deps": ["d"], "priority": 0, "retries": 0}]  # fmt: skip
        apply(UpdateGraph(client="c", tasks=tasks, wanted=[y], stimulus_id=f"u-{y}"))
        apply(TaskClaimed(worker=b, keys=["d"], stimulus_id=f"c-{y}"))
        apply(TaskFinished(worker=b, key="d", nbytes=8, stimulus_id=f"f-{y}"))
        claimed, *_ = scripts.claim(worker=b, count=10, last_inbox_id="0-0")  # (placed there)
        return claimed

    try:
        for worker in (a, b):
            r.hset(keys.workers, worker, pack({"name": worker, "nthreads": 1}))
            apply(AddWorker(worker=worker, stimulus_id=f"add-{worker}"))
        dep = dependency_of(submit_and_claim("y1", b"old"))
        first = state.tasks["d"].score
        assert dep[:3] == [b"d", b.encode(), b"8"] and float(dep[3]) == first
        apply(TaskClaimed(worker=b, keys=["y1"], stimulus_id="c-y1-b"))
        apply(TaskFinished(worker=b, key="y1", nbytes=8, stimulus_id="f-y1-b"))
        apply(ClientReleasesKeys(client="c", keys=["y1"], stimulus_id="release"))
        assert "d" not in state.tasks and not r.exists(keys.task("d"))  # forgotten
        dep = dependency_of(submit_and_claim("y2", b"new"))
        second = state.tasks["d"].score
        assert second != first and float(dep[3]) == second

        # FINISH claims a chained dependent with the same naming
        r.hset(keys.task("x-1"), mapping={"state": "processing", "worker": a, "spec": b"s",
                                          "deps": pack([]), "chain": pack(["z-1"])})  # fmt: skip
        r.hset(keys.task("e-1"), mapping={"state": "memory", "who_has": b, "nbytes": 8,
                                          "value": b"v", "score": 4})  # fmt: skip
        r.hset(keys.task("z-1"), mapping={"state": "waiting", "spec": b"s", "score": 5,
                                          "deps": pack(["x-1", "e-1"])})  # fmt: skip
        tasks, *_ = scripts.finish(worker=a, ttl_ms=3000, reports=[pack({"op": "x"})],
                                   finished=["x-1"], chain=1, last_inbox_id="0-0")  # fmt: skip
        (z,) = tasks
        assert sorted(z[3]) == [[b"e-1", b.encode(), b"8", b"4", b"v"], [b"x-1", b"", b"0", b""]]
    finally:
        for name in r.scan_iter(match=keys.prefix.replace("{", "[{]") + "*"):
            r.delete(name)
        r.close()
