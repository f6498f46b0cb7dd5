"""Claims sized by what tasks are expected to cost (``redisdask/durations.py``): the CLAIM
script's time budget against a real Redis, the Lua twin of ``key_prefix``, the estimates
reloaded by a restarted scheduler, and the straggler case on a real cluster."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from redisdask import Client, get_worker
from redisdask.durations import (
    KEY_PREFIX_LUA,
    Durations,
    claim_delay,
    misleads,
    start_times,
    stuck_in,
)
from redisdask.protocol import AddWorker, ReleasedKeys, TaskClaimed, TaskFinished, UpdateGraph
from redisdask.scheduler.state import SchedulerState
from redisdask.scheduler.translator import Translator, load_state
from redisdask.spec import key_prefix
from redisdask.store.bootstrap import ensure_cluster
from redisdask.store.codecs import pack
from redisdask.store.keyspace import Keys
from redisdask.store.scripts import CLAIM_FULL, Scripts

pytestmark = pytest.mark.timeout(60)

W = "tcp://127.0.0.1:1"


@pytest.fixture
def r(redis_url: str, cluster_name: str) -> Iterator[tuple[redis.Redis, Keys]]:
    conn = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(conn, keys)
    yield conn, keys
    for name in conn.scan_iter(match=keys.prefix.replace("{", "[{]") + "*"):
        conn.delete(name)
    conn.close()


KEYS = [
    "inc-5f3a9c00aa11", "sum-chunk-00ab12cd", "load-data-7", "('x-1a2b', 0)",
    "('rechunk-merge-0123abcd', 0, 1)", "<lambda>-da39a3ee5e6b", "f-deadbeef", "plain", "",
    "a--b", "-a", "<function f at 0x7f>-12", "123abc-x", "_private-abc", "('a,b', 1)",
    "finalize-hlgfinalizecompute-ab12", "wait_for_file-1234", "x-Y-z-9", "<a.b.c d>-q",
]  # fmt: skip


def test_the_lua_key_prefix_agrees_with_key_prefix(r: tuple[redis.Redis, Keys]) -> None:
    conn, _ = r
    script = (
        KEY_PREFIX_LUA
        + """
local out = {}
for i, key in ipairs(ARGV) do out[i] = key_prefix(key) end
return out
"""
    )
    got = [p.decode() for p in conn.eval(script, 0, *KEYS)]
    assert got == [key_prefix(k) for k in KEYS]


def queue(conn: redis.Redis, keys: Keys, *names: str) -> None:
    for i, key in enumerate(names):
        conn.hset(keys.task(key), mapping={"state": "queued", "spec": b"s", "deps": pack([])})
        conn.zadd(keys.ready, {key: float(i)})


def test_a_claim_takes_only_what_starts_within_the_horizon(r: tuple[redis.Redis, Keys]) -> None:
    """The script's side of the budget: a task is taken for the thread free first if it
    starts within the horizon there; the first that does not stays queued, in place."""
    conn, keys = r
    conn.hset(keys.workers, W, pack({"address": W}))
    conn.hset(keys.durations, mapping={"short": "0.005", "long": "2.0"})
    scripts = Scripts(conn, keys)
    names = ["short-0", "short-1", "long-2", "short-3", "new-4", "short-5"]
    queue(conn, keys, *names)

    def claim(*starts: float) -> tuple[list[str], list[bytes], int]:
        tasks, _, _, flags, _ = scripts.claim(
            worker=W, count=1000, last_inbox_id="0-0", horizon=0.02, starts=starts
        )
        return [t[0].decode() for t in tasks], [t[5] for t in tasks], flags

    # a thread free in 12 ms: two 5 ms tasks start within 20 ms, the third would at 22
    assert claim(0.012) == (["short-0", "short-1"], [b"0.005", b"0.005"], CLAIM_FULL)
    assert conn.zrange(keys.ready, 0, -1, withscores=True) == [
        (b"long-2", 2.0), (b"short-3", 3.0), (b"new-4", 4.0), (b"short-5", 5.0)
    ]  # fmt: skip
    assert claim(0.025) == ([], [], CLAIM_FULL)  # busy for longer than the horizon
    # a free thread takes the 2 s task, and nothing after it; a second one a 5 ms task,
    # then a task never seen (its thread is then busy for good), and the claim stops
    assert claim(0.0, 0.0) == (["long-2", "short-3", "new-4"], [b"2", b"0.005", b""], 2)
    assert claim(0.0) == (["short-5"], [b"0.005"], 0)  # the set ran dry: no flag
    assert conn.hget(keys.task("new-4"), "state") == b"processing"
    assert conn.hget(keys.task("short-5"), "state") == b"processing"


def test_start_times_queue_what_is_held_on_the_thread_free_first() -> None:
    assert start_times(2, [], [], 0.02) == [0.0, 0.0]
    assert start_times(2, [0.01, math.inf], [0.005, 0.001], 0.02) == [0.016]
    assert start_times(1, [0.001], [None], 0.02) == []  # held, unknown: busy for good
    assert start_times(3, [0.5], [], 0.02) == [0.0, 0.0]
    assert start_times(2, [0.001], [], 0.0) == [0.0]  # a horizon of 0: free threads only


def test_claim_delay_is_when_start_times_gives_a_thread() -> None:
    """A worker whose thread runs a 40 ms task claims its next one 20 ms before the run
    ends (the horizon), not once it ended: the task then waits for the thread."""
    assert claim_delay(1, [0.04], [], 0.02) == pytest.approx(0.02)
    assert start_times(1, [0.04 - 0.02], [], 0.02) == [pytest.approx(0.02)]  # then
    assert claim_delay(1, [0.01], [], 0.02) == 0.0  # within the horizon now
    assert claim_delay(2, [0.04, 0.1], [0.03], 0.02) == pytest.approx(0.05)  # held: after it
    assert claim_delay(1, [math.inf], [], 0.02) is None  # busy for an unknown time
    assert claim_delay(1, [0.01], [None], 0.02) is None  # held, unknown: busy for good


def test_stuck_in_is_when_a_run_is_past_any_expectation() -> None:
    assert stuck_in(0.01, 0.0, 0.02) == pytest.approx(0.04)  # twice the estimate + slack
    assert stuck_in(0.01, 0.05, 0.02) == 0.0
    assert stuck_in(None, 0.005, 0.02) == pytest.approx(0.015)  # no estimate: the slack


def test_an_estimate_misleads_when_claims_take_several_per_thread() -> None:
    assert misleads(0.0002, 0.02) and misleads(0.004, 0.02)
    assert not misleads(0.005, 0.02) and not misleads(0.01, 0.02)


def test_an_exec_time_past_twice_the_average_forgets_it() -> None:
    """distributed's ``TaskPrefix.add_exec_time``: a run going on past twice the average
    forgets it (written as None: deleted), and the next result sets it anew."""
    d = Durations({"f": 0.0002, "g": 1.0})
    d.add_exec_time("f", 0.0003)  # not twice: kept
    d.add_exec_time("g", 5.0)
    d.add_exec_time("h", 5.0)  # never seen: nothing to forget
    d.add_exec_time("f", math.inf)  # (a broken report)
    assert d.averages == {"f": 0.0002} and d.take_changed() == {"g": None}
    d.add("g", 1.0, 1.04)
    assert d.averages["g"] == pytest.approx(0.04) and d.take_changed() == {"g": 0.04}


def test_durations_reload_after_a_scheduler_restart(r: tuple[redis.Redis, Keys]) -> None:
    """What a scheduler wrote of its averages, a new one reads back; an entry that is no
    number of seconds is left out (logged), the rest stand."""
    conn, keys = r
    state = SchedulerState(validate=True)
    tasks = [{"key": k, "spec": b"s", "deps": [], "priority": 0, "retries": 0}
             for k in ("inc-aaaa1111", "inc-bbbb2222")]  # fmt: skip
    events = [
        AddWorker(worker=W, stimulus_id="a"),
        UpdateGraph(
            client="c", tasks=tasks, wanted=["inc-aaaa1111", "inc-bbbb2222"], stimulus_id="u"
        ),
        TaskClaimed(worker=W, keys=["inc-aaaa1111", "inc-bbbb2222"], stimulus_id="c"),
        TaskFinished(worker=W, key="inc-aaaa1111", start=1.0, stop=1.004, stimulus_id="f1"),
        TaskFinished(worker=W, key="inc-bbbb2222", start=1.0, stop=1.002, stimulus_id="f2"),
    ]
    scripts = Scripts(conn, keys)
    token = scripts.acquire_lease(token=None, ttl_ms=60_000).decode()
    for ev in events:
        commands = Translator(keys).to_commands(state.handle_stimulus(ev))
        scripts.apply_fenced(token=token, commands=commands, ttl_ms=60_000)
    assert state.durations.averages == {"inc": pytest.approx(0.003)}
    assert conn.hgetall(keys.durations) == {b"inc": repr(state.durations.averages["inc"]).encode()}
    conn.hset(keys.durations, mapping={"bad": "soon", "worse": "nan"})
    loaded = load_state(conn, keys, validate=True)
    assert loaded.durations.averages == state.durations.averages


def test_a_forgotten_average_is_deleted_and_claims_take_one_per_thread(
    r: tuple[redis.Redis, Keys],
) -> None:
    """A worker hands back the claims held behind a run far past its prefix's estimate:
    the scheduler queues them again and deletes the average in the same write, so the
    next claim takes one task per free thread, not a horizon's worth."""
    conn, keys = r
    state = SchedulerState(validate=True)
    names = [f"inc-{i:08x}" for i in range(6)]
    tasks = [{"key": k, "spec": b"s", "deps": [], "priority": 0, "retries": 0} for k in names]
    scripts = Scripts(conn, keys)
    token = scripts.acquire_lease(token=None, ttl_ms=60_000).decode()

    def apply(*events: Any) -> None:
        commands = Translator(keys).to_commands(state.handle_stimulus(*events))
        scripts.apply_fenced(token=token, commands=commands, ttl_ms=60_000)

    conn.hset(keys.workers, W, pack({"name": "w", "nthreads": 1}))
    apply(AddWorker(worker=W, stimulus_id="a"))
    apply(UpdateGraph(client="c", tasks=tasks, wanted=names, stimulus_id="u"))
    apply(TaskClaimed(worker=W, keys=names[:1], stimulus_id="c"))
    apply(TaskFinished(worker=W, key=names[0], start=1.0, stop=1.0002, stimulus_id="f"))
    assert conn.hget(keys.durations, "inc") == b"0.0002"

    def claim() -> list[str]:
        tasks, *_ = scripts.claim(
            worker=W, count=10, last_inbox_id="0-0", horizon=0.02, starts=[0.0]
        )
        return [t[0].decode() for t in tasks]

    assert claim() == names[1:]  # a horizon's worth of what the average says is instant
    apply(TaskClaimed(worker=W, keys=names[1:], stimulus_id="c2"))
    held = names[2:]  # names[1] runs, 21 ms so far
    scores = [state.tasks[k].score for k in held]
    apply(ReleasedKeys(worker=W, keys=held, scores=scores, overdue={"inc": 0.021},
                       stimulus_id="back"))  # fmt: skip
    assert conn.hget(keys.durations, "inc") is None and "inc" not in state.durations.averages
    assert all(state.tasks[k].state == "queued" for k in held)
    assert claim() == [names[2]]  # of unknown cost now: one per free thread


def test_durations_cap_the_prefixes_they_remember(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("redisdask.durations.MAX_PREFIXES", 2)
    d = Durations()
    for prefix in ("a", "b", "c"):
        d.add(prefix, 1.0, 2.0)
    d.add("a", 1.0, 1.5)  # a known one goes on
    assert d.averages == {"a": 0.75, "b": 1.0} and set(d.take_changed()) == {"a", "b"}


def noop(i: int) -> int:
    return i


def slow_task(path: str) -> None:
    """Runs until the test creates ``path``, or for 30 s: then the short tasks a worker
    took behind it (the old claims) run after it, and the test fails instead of hanging."""
    deadline = time.monotonic() + 30
    while not os.path.exists(path) and time.monotonic() < deadline:
        threading.Event().wait(0.02)


def short_task(i: int) -> str:
    threading.Event().wait(0.02)  # the task's cost, not a synchronisation
    return get_worker().address


def test_a_long_task_does_not_hold_short_ones_behind_it(client: Client, tmp_path: Path) -> None:
    """The straggler case on two one-thread workers: a long task submitted first, then
    100 tasks of 20 ms.  Every short task runs on the other worker, read from the
    address each one returns: the long task's prefix has no estimate, so the claim that
    took it stopped right behind it and its worker claims nothing while it runs (the
    bound is zero, not "all but a few").  Both workers first ran tiny tasks, after
    which the old per-worker average claimed hundreds at once, the long task's worker
    taking most of them."""
    workers = sorted(client.scheduler_info()["workers"])
    for w in workers:  # warm both up with tiny tasks
        client.gather(client.map(noop, range(30), workers=[w], pure=False))
    release = tmp_path / "release"
    slow = client.submit(slow_task, str(release), pure=False)
    shorts = client.map(short_task, range(100), pure=False)
    ran_on = client.gather(shorts)
    release.touch()
    slow.result()
    [slow_worker] = client.who_has([slow])[slow.key]
    assert slow_worker in workers
    assert [w for w in ran_on if w == slow_worker] == []
