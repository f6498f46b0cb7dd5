"""The small parts of distributed's Client API that existing code touches: reference
counts, ``Future.type``/``retry``/repr, ``as_completed``'s batches, string timeouts,
``scatter`` of sets, ``scheduler_info(n_workers=)``, ``cancel(reason=)`` and the task
stream read back from the workers' stories."""

from __future__ import annotations

import threading
import time
from concurrent.futures import TimeoutError as FuturesTimeoutError
from pathlib import Path

import msgpack
import pytest
import redis
from polling import poll

from redisdask import (
    Client,
    FutureCancelledError,
    LocalCluster,
    as_completed,
    get_task_stream,
    performance_report,
    wait,
)
from redisdask.client.performance_report import report_text
from redisdask.store.keyspace import Keys

pytestmark = pytest.mark.timeout(120)


def inc(x: int) -> int:
    return x + 1


def fails_once(flag: str) -> str:
    """Raises the first time (it leaves ``flag`` behind), returns the second."""
    path = Path(flag)
    if not path.exists():
        path.write_text("failed once")
        raise RuntimeError("first attempt fails")
    return "second attempt"


def until_touched(flag: Path) -> None:
    """A task that stays running until the test touches ``flag`` (at most a minute), so
    that closing the cluster does not wait for it."""
    deadline = time.monotonic() + 60
    while not flag.exists() and time.monotonic() < deadline:
        threading.Event().wait(0.02)


def boom() -> None:
    raise ValueError("boom")


def test_futures_and_refcount_follow_the_futures_held(client: Client) -> None:
    a = client.submit(inc, 1, key="ref-a")
    b = client.submit(inc, 1, key="ref-a")
    assert client.refcount["ref-a"] == 2 and "ref-a" in client.futures
    a.release()
    assert client.refcount["ref-a"] == 1
    b.release()
    assert "ref-a" not in client.refcount and "ref-a" not in client.futures


def test_future_type_and_repr_say_what_it_holds(client: Client, tmp_path: Path) -> None:
    future = client.submit(inc, 1)
    assert future.result(timeout=30) == 2
    assert future.type is int
    assert repr(future) == f"<Future: finished, type: int, key: {future.key}>"
    pending = client.submit(until_touched, tmp_path / "done")
    assert repr(pending) == f"<Future: pending, key: {pending.key}>"
    client.cancel(pending, reason="the test is done with it")
    with pytest.raises(FutureCancelledError, match="the test is done with it"):
        pending.result(timeout=30)
    (tmp_path / "done").touch()


def test_retry_runs_an_erred_task_again(client: Client, tmp_path: Path) -> None:
    future = client.submit(fails_once, str(tmp_path / "flag"))
    with pytest.raises(RuntimeError, match="first attempt fails"):
        future.result(timeout=30)
    future.retry()
    assert future.result(timeout=30) == "second attempt"


def test_retry_of_a_dependent_reruns_the_task_its_error_came_from_and_its_heirs(
    client: Client, tmp_path: Path
) -> None:
    root = client.submit(fails_once, str(tmp_path / "flag"))
    dependent = client.submit(str.upper, root)
    sibling = client.submit(str.lower, root)  # inherited the same error
    del root  # only the dependents are wanted: their root is kept as history
    with pytest.raises(RuntimeError, match="first attempt fails"):
        dependent.result(timeout=30)
    with pytest.raises(RuntimeError, match="first attempt fails"):
        sibling.result(timeout=30)
    client.retry([dependent])
    assert dependent.result(timeout=30) == "SECOND ATTEMPT"
    # as in distributed, what inherited the error runs again too (task-retried)
    assert sibling.result(timeout=30) == "second attempt"


def test_as_completed_batches_and_its_helpers(client: Client, tmp_path: Path) -> None:
    futures = client.map(inc, range(6))
    ac = as_completed(futures[:3])
    ac.update(futures[3:])
    assert ac.count() == 6 and not ac.is_empty()
    wait(futures)
    poll(ac.has_ready, timeout=10)
    got = [f for batch in ac.batches() for f in batch]
    assert sorted(f.result() for f in got) == list(range(1, 7))
    assert ac.is_empty() and ac.next_batch(block=False) == []

    erred = client.submit(boom)
    ac = as_completed([erred], with_results=True, raise_errors=False)
    ((future, (typ, exc, _tb)),) = list(ac)  # as distributed: (type, exception, traceback)
    assert future is erred and typ is ValueError and isinstance(exc, ValueError)

    ac = as_completed([client.submit(until_touched, tmp_path / "done")])
    ac.clear()
    assert ac.is_empty() and list(ac) == []
    (tmp_path / "done").touch()


def test_timeouts_take_strings_as_in_dask(client: Client, tmp_path: Path) -> None:
    slow = client.submit(until_touched, tmp_path / "done")
    with pytest.raises(FuturesTimeoutError):
        slow.result(timeout="100ms")
    with pytest.raises(FuturesTimeoutError):
        wait([slow], timeout="0.1s")
    with pytest.raises(FuturesTimeoutError):
        slow.exception(timeout="100 ms")
    with pytest.raises(FuturesTimeoutError):
        next(as_completed([slow], timeout="100ms"))
    (tmp_path / "done").touch()


def test_scatter_keeps_sets_and_frozensets_and_hash_false_gives_new_keys(client: Client) -> None:
    as_set = client.scatter({1, 2, 3})
    assert isinstance(as_set, set) and sorted(f.result() for f in as_set) == [1, 2, 3]
    as_frozen = client.scatter(frozenset({4}))
    assert isinstance(as_frozen, frozenset)
    one, two = client.scatter([7, 7], hash=False)
    assert one.key != two.key and one.result() == two.result() == 7
    same_a, same_b = client.scatter([8, 8])
    assert same_a.key == same_b.key


def test_scheduler_info_counts_workers_and_says_when_the_scheduler_started(
    client: Client,
) -> None:
    info = client.scheduler_info()
    assert info["n_workers"] == len(info["workers"]) == 2
    assert info["total_threads"] == 2
    assert 0 < time.time() - info["started"] < 600
    assert len(client.scheduler_info(n_workers=1)["workers"]) == 1


def test_get_task_stream_reads_when_and_where_tasks_ran(client: Client) -> None:
    workers = set(client.scheduler_info()["workers"])
    with get_task_stream(client) as ts:
        futures = client.map(inc, range(4), key=[f"stream-{i}" for i in range(4)])
        erred = client.submit(boom, key="stream-boom")
        wait([*futures, erred])
    wanted = {f"stream-{i}" for i in range(4)} | {"stream-boom"}
    # the workers write their stories with each heartbeat
    poll(lambda: wanted <= {t["key"] for t in ts.data}, timeout=30)
    by_key = {t["key"]: t for t in ts.data}
    for key in wanted:
        task = by_key[key]
        assert task["worker"] in workers
        (run,) = task["startstops"]
        assert run["action"] == "compute" and ts.start <= run["start"] <= run["stop"] <= ts.stop
    assert by_key["stream-boom"]["status"] == "error" and by_key["stream-0"]["status"] == "OK"
    assert len(client.get_task_stream(start="1h", count=2)) == 2
    assert client.get_task_stream(start=time.time() + 60) == []
    # a story entry that is not one (a stranger's, or a broken write) is left out
    r = redis.Redis.from_url(client.redis_url)
    story = client.keys.worker_story(sorted(workers)[0])
    for junk in (b"\xc1", msgpack.packb(7), msgpack.packb([[1.0, 2, "a", "b", "c"], "x"])):
        r.xadd(story, {"m": junk})
    r.xadd(story, {"other": b"field"})
    assert {t["key"] for t in client.get_task_stream()} == {t["key"] for t in ts.data}


def test_get_versions_reads_more_packages_in_the_client_and_every_worker(client: Client) -> None:
    found = client.get_versions(packages=["pytest", "no-such-package-xyz"])
    for process in [found["client"], *found["workers"].values()]:
        assert process["packages"]["pytest"] == pytest.__version__
        assert process["packages"]["no-such-package-xyz"] is None
    assert len(found["workers"]) == 2


def test_performance_report_says_what_ran_where_and_which_worker_died(
    client: Client, cluster: LocalCluster, tmp_path: Path
) -> None:
    report = tmp_path / "report.txt"
    keys = Keys(cluster.cluster_name)
    r = redis.Redis.from_url(client.redis_url)
    workers = client.scheduler_info()["workers"]
    busy, idle = sorted(workers)  # the tasks run on one; the other is killed (holding
    victim = next(p for p in cluster.worker_processes if p.pid == workers[idle]["pid"])
    with performance_report(filename=report) as perf:  # nothing, so nothing reruns)
        futures = client.map(inc, range(30), key=[f"report-{i}" for i in range(30)],
                             workers=[busy])  # fmt: skip
        erred = client.submit(boom, key="report-boom", workers=[busy])
        wait([*futures, erred])
        victim.kill()  # kill -9: the report names its death
        victim.wait()
        poll(lambda: r.xlen(keys.deaths) > 0, timeout=30)
    text = report.read_text()
    assert text == perf.text
    assert f"cluster {cluster.cluster_name!r}" in text
    assert "tasks computed: 31 (1 erred)" in text
    rows = {line.split()[0]: line.split()[1:3] for line in text.splitlines() if "report" in line}
    assert rows["report"] == ["30", "0"] and rows["report-boom"] == ["1", "1"]  # tasks, erred
    assert next(line for line in text.splitlines() if busy in line).split()[1] == "31"
    assert "worker deaths while it ran: 1" in text


def test_report_text_sums_prefixes_and_workers() -> None:
    def task(key: str, worker: str, start: float, stop: float, status: str = "OK") -> dict:
        span = {"action": "compute", "start": start, "stop": stop}
        return {"key": key, "worker": worker, "status": status, "startstops": (span,)}

    tasks = [
        task("inc-aaaaaaaa", "tcp://a:1", 0.0, 1.0),
        task("inc-bbbbbbbb", "tcp://b:1", 0.0, 3.0, "error"),
        task("slow-cccccccc", "tcp://a:1", 1.0, 6.0),
    ]
    workers = {"tcp://a:1": {"nthreads": 1}, "tcp://b:1": {"nthreads": 1}}
    text = report_text("cluster 'c'", tasks, workers, [], 0.0, 10.0)
    assert "tasks computed: 3 (1 erred); compute time 9.00 s; thread utilisation 45%" in text
    lines = text.splitlines()
    row = {p: next(i for i, x in enumerate(lines) if x.strip().startswith(p + " ")) for p in
           ("slow", "inc")}  # fmt: skip
    slow, inc = row["slow"], row["inc"]
    assert slow < inc  # by compute time
    assert lines[inc].split() == ["inc", "2", "1", "4.000", "2000.00", "3000.00"]
    assert next(x for x in lines if "tcp://a:1" in x).split()[1:4] == ["2", "6.00", "60%"]
    assert "worker deaths while it ran: none" in text
