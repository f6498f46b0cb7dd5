"""Work stealing for real (redisdask/scheduler/stealing.py): worker processes, a scheduler process,
Redis, kill -9.  One worker claims a whole batch (its prefix's estimate, learnt from a
warm-up of no-ops, says the batch takes no time, and its claim horizon is long), then a
second worker joins with nothing to claim: it must get its share, and no task may run
twice or be lost, whoever is killed mid-steal.  Every run is counted: the task appends
``i|worker`` to a Redis list as it starts.

With the default claim horizon the busy worker does not wait to be stolen from: once its
run goes on past twice its estimate it hands back what it holds (``RunsOverdueEvent``,
``workers/state.py``); the last tests here are about that."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from polling import poll

from redisdask import Client, LocalCluster
from redisdask.observe.inspect import read_events, task_story
from redisdask.scheduler.driver import Scheduler, decode_reply
from redisdask.store.bootstrap import ensure_cluster
from redisdask.store.codecs import entry, pack, unpack
from redisdask.store.keyspace import SCHEDULER_GROUP, Keys

pytestmark = pytest.mark.timeout(90)

N = 30  # tasks in the batch the first worker claims
DELAY = 0.1  # seconds each runs
RESOURCES = {"R": 100}  # the first worker's, when the pinned tasks need R=1


@pytest.fixture(autouse=True)
def _slow_heartbeat_deaths(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker stopped for a while (SIGSTOP) is not declared dead by its heartbeat here
    (a kill -9 is noticed at once all the same: its connections close).  The workers
    claim 30 s of estimated work ahead, so that the busy one holds its claims until
    they are stolen: with the default 20 ms it would hand them back once its first run
    went on past twice its estimate, before any thief joined."""
    monkeypatch.setenv("REDISDASK__SCHEDULER__WORKER_TTL", "20")
    monkeypatch.setenv("REDISDASK__WORKER__CLAIM_HORIZON", "30")


def work(i: int, delay: float = 0.0, url: str = "", runs: str = "") -> int:
    """A task of prefix ``work``: records its run (when ``runs`` names a list), then
    takes ``delay`` seconds (standing for real work)."""
    if runs:
        from redisdask.workers import get_worker

        redis.Redis.from_url(url).rpush(runs, f"{i}|{get_worker().address}")
    threading.Event().wait(delay)
    return i * 10


def runs_of(r: redis.Redis, runs: str) -> list[tuple[int, str]]:
    return [(int(i), w) for i, _, w in (x.decode().partition("|") for x in r.lrange(runs, 0, -1))]


@contextmanager
def one_worker_taught_no_ops(
    redis_url: str, cluster_name: str, resources: dict[str, float] | None = None
) -> Iterator[tuple[LocalCluster, Client, str]]:
    """A cluster of one worker that ran 200 ``work`` tasks of no time: the estimate of
    ``work`` says next to nothing, so the worker claims a whole batch of them at once.
    Yields the cluster, the client and the worker's address."""
    with (
        LocalCluster(
            nanny=False,
            n_workers=1,
            redis_url=redis_url,
            cluster_name=cluster_name,
            resources=resources,
        ) as cluster,
        Client(cluster) as client,
    ):
        [first] = client.scheduler_info()["workers"]
        assert client.gather(client.map(work, range(-200, 0))) == list(range(-2000, 0, 10))
        yield cluster, client, first


@contextmanager
def one_busy_worker(
    redis_url: str, cluster_name: str, pinned: int = 0, by: str = "workers"
) -> Iterator[tuple[LocalCluster, Client, list[Any], str, str]]:
    """A cluster whose only worker claimed the whole batch (``N`` tasks, then ``pinned``
    more, ``100, 101, ...``, restricted to it: those it would start last; ``by``
    ``workers=`` or ``resources=``, which only it has), and a second worker that joins
    after that; yields the cluster, the client, the batch's futures, the first worker's
    address and the runs list."""
    resources = RESOURCES if by == "resources" else None
    with one_worker_taught_no_ops(redis_url, cluster_name, resources) as (cluster, client, first):
        runs = f"{cluster_name}-runs"
        futures = client.map(work, range(N), delay=DELAY, url=redis_url, runs=runs)
        only = {"workers": [first]} if by == "workers" else {"resources": {"R": 1}}
        futures += client.map(work, range(100, 100 + pinned), delay=DELAY, url=redis_url,
                              runs=runs, **only)  # fmt: skip
        r = redis.Redis.from_url(redis_url)
        processing = Keys(cluster_name).worker_processing(first)
        poll(lambda: r.scard(processing) + r.llen(runs) >= len(futures))  # all claimed there
        cluster.start_worker(name="thief", resources={})  # (none)
        cluster.wait_for_workers(2)
        yield cluster, client, futures, first, runs


def thief_of(client: Client, first: str) -> str:
    return next(a for a in client.scheduler_info()["workers"] if a != first)


@pytest.mark.parametrize("by", ["workers", "resources"])
def test_an_idle_worker_takes_its_share_of_a_busy_workers_claims_and_none_runs_twice(
    redis_url: str, cluster_name: str, by: str
) -> None:
    """And never one restricted to the busy worker (``workers=``, or ``resources=`` only
    it has), though those are the ones it would start last."""
    pinned = range(100, 110)
    with one_busy_worker(redis_url, cluster_name, len(pinned), by) as (
        _cluster, client, futures, first, runs
    ):  # fmt: skip
        thief = thief_of(client, first)
        assert client.gather(futures) == [i * 10 for i in (*range(N), *pinned)]
        r = redis.Redis.from_url(redis_url)
        done = runs_of(r, runs)
        assert sorted(i for i, _ in done) == [*range(N), *pinned]  # each once: none lost
        assert {w for i, w in done if i in pinned} == {first}
        # of the tasks free to go that started once the thief was there, it ran a fair share
        joined = next(n for n, (_, w) in enumerate(done) if w == thief)
        later = [w for i, w in done[joined:] if i not in pinned]
        assert later.count(thief) >= 0.3 * len(later), (later, joined)
        keys = Keys(cluster_name)
        stolen = [e for e in read_events(r, keys, count=1000) if e["kind"] == "stolen"]
        # (the first worker may steal some back at the end, once it ran out before the
        # thief did: a machine loaded by other tests slows either)
        assert stolen and (stolen[0]["victim"], stolen[0]["thief"]) == (first, thief)
        # the story of a stolen task: queued by the victim's stolen-keys, claimed by the thief
        key = stolen[0]["keys"][0]
        story = [(s["state"], s["cause"], s["origin"]) for s in task_story(r, keys, key)]
        assert ("queued", "stolen-keys", first) in story


def pid_of(client: Client, address: str) -> int:
    return int(client.scheduler_info()["workers"][address]["pid"])


def unanswered_steal_request(r: redis.Redis, inbox: str, after: bytes) -> bool:
    """A steal-request written to ``inbox`` after the entry ``after``."""
    return any(b"steal-request" in f[b"m"] for _, f in r.xrange(inbox, min=b"(" + after))


@contextmanager
def victim_stopped_with_a_request(
    r: redis.Redis, cluster_name: str, client: Client, first: str
) -> Iterator[int]:
    """SIGSTOP the busy worker, and wait until a steal request it has not read is in its
    inbox: the steal is in the middle (asked, not answered).  Yields its pid."""
    pid = pid_of(client, first)
    inbox = Keys(cluster_name).worker_inbox(first)
    os.kill(pid, signal.SIGSTOP)
    try:
        last = r.xrevrange(inbox, count=1)
        after = last[0][0] if last else b"0-0"
        poll(lambda: unanswered_steal_request(r, inbox, after))
        yield pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def ran_at_most_once_but_on(done: list[tuple[int, str]], killed: str) -> None:
    """Every task ran, and none twice, but for a run again because ``killed`` died
    running it or holding its result: never twice elsewhere, never twice there."""
    assert sorted({i for i, _ in done}) == list(range(N))
    for worker_runs in (
        collections.Counter(i for i, w in done if w == killed),
        collections.Counter(i for i, w in done if w != killed),
    ):
        assert max(worker_runs.values(), default=1) == 1, worker_runs


def test_a_victim_killed_mid_steal_loses_no_task_and_none_runs_twice_elsewhere(
    redis_url: str, cluster_name: str
) -> None:
    with one_busy_worker(redis_url, cluster_name) as (cluster, client, futures, first, runs):
        r = redis.Redis.from_url(redis_url)
        with victim_stopped_with_a_request(r, cluster_name, client, first) as pid:
            os.kill(pid, signal.SIGKILL)
        cluster.start_worker(name="third")  # (so that two workers share what is left)
        assert client.gather(futures) == [i * 10 for i in range(N)]
        ran_at_most_once_but_on(runs_of(r, runs), first)


def test_a_thief_killed_mid_steal_loses_no_task_and_none_runs_twice_elsewhere(
    redis_url: str, cluster_name: str
) -> None:
    with one_busy_worker(redis_url, cluster_name) as (_cluster, client, futures, first, runs):
        r = redis.Redis.from_url(redis_url)
        keys = Keys(cluster_name)
        thief = thief_of(client, first)
        pid = pid_of(client, thief)
        os.kill(pid, signal.SIGSTOP)  # it claims nothing more: what it is given waits
        try:
            poll(lambda: any(e["kind"] == "stolen" and e["thief"] == thief
                             for e in read_events(r, keys, count=1000)))  # fmt: skip
            os.kill(pid, signal.SIGKILL)  # with stolen tasks queued for it
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        assert client.gather(futures) == [i * 10 for i in range(N)]
        ran_at_most_once_but_on(runs_of(r, runs), thief)


def test_a_scheduler_killed_mid_steal_loses_no_task_and_none_runs_twice(
    redis_url: str, cluster_name: str
) -> None:
    with one_busy_worker(redis_url, cluster_name) as (cluster, client, futures, first, runs):
        r = redis.Redis.from_url(redis_url)
        keys = Keys(cluster_name)
        with victim_stopped_with_a_request(r, cluster_name, client, first):
            cluster.scheduler_process.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
            cluster.scheduler_process.wait()  # type: ignore[union-attr]
            killed_at = time.time()
            cluster.start_scheduler()
        # the victim answers the dead scheduler's request; the new one applies the answer
        assert client.gather(futures) == [i * 10 for i in range(N)]
        done = runs_of(r, runs)
        assert sorted(i for i, _ in done) == list(range(N))  # each ran exactly once
        events = read_events(r, keys, count=1000)
        assert any(e["kind"] == "stolen" and e["time"] > killed_at for e in events)


def test_the_driver_writes_a_steal_request_and_nothing_when_nothing_moves(
    redis_url: str, cluster_name: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    victim, thief = "tcp://10.9.9.8:1", "tcp://10.9.9.8:2"
    for address, name in ((victim, "v"), (thief, "t")):
        r.hset(keys.workers, address, pack({"name": name, "nthreads": 1}))
    scheduler = Scheduler(redis_url, cluster_name, validate=True)
    scheduler.acquire_lease()
    scheduler.state = scheduler._load()

    def balance_writes() -> bool:
        """Whether a balance wrote a batch (every batch writes ``meta``'s ``seq``)."""
        r.hset(keys.meta, "seq", "untouched")
        scheduler.balance()
        return r.hget(keys.meta, "seq") != b"untouched"

    assert not balance_writes()  # two idle workers, nothing to move: no write at all
    tasks = [{"key": f"x-{i}", "spec": b"s", "deps": []} for i in range(4)]
    wanted = [t["key"] for t in tasks]
    r.xadd(
        keys.client_stream,
        entry([{"op": "update-graph", "client": "c", "wanted": wanted, "tasks": tasks}]),
    )
    scheduler.process(decode_reply(r.xreadgroup(SCHEDULER_GROUP, "s", {keys.client_stream: ">"})))
    claimed, *_ = scheduler.scripts.claim(worker=victim, count=10, last_inbox_id="0-0")
    assert len(claimed) == 4
    scheduler.process(decode_reply(r.xreadgroup(SCHEDULER_GROUP, "s", {keys.worker_stream: ">"})))
    assert balance_writes()
    [(_, fields)] = r.xrange(keys.worker_inbox(victim))
    assert unpack(fields[b"m"]) == [{"op": "steal-request", "keys": ["x-3", "x-2"], "thief": thief}]
    assert not balance_writes()  # asked already: not again
    assert r.xlen(keys.worker_inbox(victim)) == 1


def test_a_worker_hands_back_its_claims_once_its_run_goes_on_past_twice_its_estimate(
    redis_url: str, cluster_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mis-estimated case with the default claim horizon: the only worker claims the
    whole batch (its prefix's estimate, from no-ops, says it takes no time); once its
    first run is 20 ms past twice that estimate it hands the rest back (``released-keys``
    naming the run's prefix, which the scheduler forgets), and a worker that joins
    later gets its share from the queue, with no steal needed for those.  None runs
    twice, none is lost.  (Before, the batch waited claimed on the first worker until a
    steal moved some of it: the last task's story said ``stolen-keys``.)"""
    monkeypatch.setenv("REDISDASK__WORKER__CLAIM_HORIZON", "0.02")
    with one_worker_taught_no_ops(redis_url, cluster_name) as (cluster, client, first):
        runs = f"{cluster_name}-runs"
        futures = client.map(work, range(N), delay=DELAY, url=redis_url, runs=runs)
        r = redis.Redis.from_url(redis_url)
        keys = Keys(cluster_name)
        last = futures[-1].key  # (the one the first worker would have started last)
        poll(lambda: ("queued", "released-keys", first) in story_of(r, keys, last))
        cluster.start_worker(name="second")
        cluster.wait_for_workers(2)
        second = thief_of(client, first)
        assert client.gather(futures) == [i * 10 for i in range(N)]
        done = runs_of(r, runs)
        assert sorted(i for i, _ in done) == list(range(N))  # each once: none lost
        joined = next(n for n, (_, w) in enumerate(done) if w == second)
        later = [w for _, w in done[joined:]]
        assert later.count(second) >= 0.3 * len(later), (later, joined)
        assert ("processing", "claimed", first) in story_of(r, keys, last)  # (at first)
        assert not any(s[1] == "stolen-keys" for s in story_of(r, keys, last))


class SlowLoop:
    """A worker plugin that holds the worker's event loop 40 ms as each task starts, as a
    loop busy with a claim of hundreds does: the task's run, in its pool thread, then
    begins late (or ends before the loop hears of it)."""

    name = "slow-loop"

    def transition(self, key: str, start: str, finish: str, **kwargs: Any) -> None:
        if finish == "executing":
            time.sleep(0.04)  # (the busy loop under test, not a wait for anything)


def test_tiny_runs_that_wait_for_a_busy_loop_are_not_overdue(
    redis_url: str, cluster_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run is overdue by its pool thread's clock, not by the time since its Execute:
    no-ops that wait 40 ms for the worker's loop each are never handed back (before,
    each looked 40 ms long, past 20 ms plus twice its estimate, and the claims behind
    it went back to the queue, a tenth of a tree of no-ops)."""
    monkeypatch.setenv("REDISDASK__WORKER__CLAIM_HORIZON", "0.02")
    with one_worker_taught_no_ops(redis_url, cluster_name) as (_, client, worker):
        client.register_plugin(SlowLoop())
        futures = client.map(work, range(60))
        assert client.gather(futures) == [i * 10 for i in range(60)]
        r, keys = redis.Redis.from_url(redis_url), Keys(cluster_name)
        poll(lambda: story_of(r, keys, futures[-1].key)[-1][0] == "memory")
        back = ("queued", "released-keys", worker)
        assert [f.key for f in futures if back in story_of(r, keys, f.key)] == []


def story_of(r: redis.Redis, keys: Keys, key: str) -> list[tuple[str, str, str]]:
    return [(s["state"], s["cause"], s["origin"]) for s in task_story(r, keys, key)]
