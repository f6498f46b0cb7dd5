"""Work stealing in the scheduler's pure state machine (redisdask/scheduler/stealing.py): which
claims an idle worker asks a busy one for, and how the victim's answer queues them for
the thief.  No Redis, no processes, no clocks: microseconds each."""

from __future__ import annotations

from typing import Any

import pytest

from redisdask.protocol import StealRequest, StolenKeys
from redisdask.scheduler.instructions import Enqueue, Instruction, LogEvent, Unclaim, WorkerMsg
from redisdask.scheduler.state import (
    AddWorker,
    RemoveWorker,
    RetireWorkers,
    SchedulerState,
    TaskClaimed,
    TaskFinished,
    UpdateGraph,
)
from redisdask.scheduler.stealing import STEAL_TIMEOUT, StealTick, plan_steals

pytestmark = pytest.mark.timeout(10)

V = "tcp://10.0.0.1:8000"  # the victim: claimed more than it has threads
T = "tcp://10.0.0.2:8000"  # the thief: idle
W3 = "tcp://10.0.0.3:8000"  # another worker


def task(key: str, deps: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    return {"key": key, "spec": b"spec", "deps": deps or [], "priority": 0, **kw}


def make(*workers: str, resources: dict[str, dict[str, float]] | None = None) -> SchedulerState:
    s = SchedulerState(validate=True)
    for w in workers:
        info: dict[str, Any] = {"nthreads": 1, "name": w[-6:]}
        if resources and w in resources:
            info["resources"] = resources[w]
        s.handle_stimulus(AddWorker(worker=w, info=info, stimulus_id=f"add-{w}"))
    return s


def claimed_by_victim(s: SchedulerState, tasks: list[dict[str, Any]]) -> None:
    """Submit ``tasks``; the victim claims them all (one runs, the others wait)."""
    keys = [t["key"] for t in tasks]
    s.handle_stimulus(UpdateGraph(client="c", tasks=tasks, wanted=keys, stimulus_id="ug"))
    s.handle_stimulus(TaskClaimed(worker=V, keys=keys, stimulus_id="workers:1-0/0"))
    assert all(s.tasks[k].processing_on == V for k in keys)


def tick(s: SchedulerState, now: float = 100.0) -> list[Instruction]:
    return s.handle_stimulus(StealTick(now=now, stimulus_id=f"steal-{now}"))


def requests(out: list[Instruction]) -> list[tuple[str, str, list[str]]]:
    """(victim, thief, keys) of each steal request."""
    return [
        (i.worker, i.msg.thief, i.msg.keys)
        for i in out
        if isinstance(i, WorkerMsg) and isinstance(i.msg, StealRequest)
    ]


def test_an_idle_worker_asks_for_the_claims_the_busy_one_would_start_last():
    s = make(V, T)
    claimed_by_victim(s, [task(k) for k in "abcde"])  # 1 thread: 4 claimed ahead
    # half its claims, rounded down (2 of 5: 3 stay), the ones it would start last
    assert requests(tick(s)) == [(V, T, ["e", "d"])]
    # a thief with more threads takes a larger share: 9 claims, 2 per thread on V, 7 on
    # T's 3 (one more would leave T's threads busier than V's)
    s2 = SchedulerState(validate=True)
    for w, n in ((V, 1), (T, 3)):
        s2.handle_stimulus(AddWorker(worker=w, info={"nthreads": n}, stimulus_id=f"add-{w}"))
    claimed_by_victim(s2, [task(k) for k in "abcdefghi"])
    assert requests(tick(s2)) == [(V, T, list("ihgfedc"))]


def test_nothing_is_stolen_while_the_idle_worker_can_claim_queued_work():
    s = make(V, T)
    claimed_by_victim(s, [task(k) for k in "abc"])
    s.handle_stimulus(
        UpdateGraph(client="c", tasks=[task("free")], wanted=["free"], stimulus_id="ug2")
    )
    assert s.tasks["free"].state == "queued"
    assert requests(tick(s)) == []


def test_nothing_is_stolen_from_a_worker_without_surplus():
    s = make(V, T)
    claimed_by_victim(s, [task("a")])  # one claim, one thread: it runs
    assert requests(tick(s)) == []


def test_a_key_is_asked_for_once_until_answered_or_timed_out():
    s = make(V, T)
    claimed_by_victim(s, [task(k) for k in "ab"])
    assert requests(tick(s, 100.0)) == [(V, T, ["b"])]
    assert requests(tick(s, 100.2)) == []  # in flight: not asked again
    assert requests(tick(s, 100.0 + STEAL_TIMEOUT + 0.1)) == [(V, T, ["b"])]
    # refused (it started there): never asked for again while it runs there
    s.handle_stimulus(StolenKeys(worker=V, thief=T, refused=["b"], stimulus_id="workers:2-0/0"))
    assert s.tasks["b"].processing_on == V
    assert requests(tick(s, 200.0)) == []
    s.handle_stimulus(TaskFinished(worker=V, key="a", nbytes=1, stimulus_id="w:3"))
    s.handle_stimulus(TaskFinished(worker=V, key="b", nbytes=1, stimulus_id="w:4"))
    tick(s, 201.0)
    assert not s.stealing.steals  # (forgotten once it left the victim)


def test_the_victims_answer_queues_the_task_for_the_thief_which_claims_it():
    s = make(V, T)
    claimed_by_victim(s, [task(k) for k in "abc"])
    tick(s)
    score = s.tasks["c"].score
    out = s.handle_stimulus(
        StolenKeys(worker=V, thief=T, keys=["c"], scores=[score], stimulus_id="workers:2-0/0")
    )
    ts = s.tasks["c"]
    assert ts.state == "queued" and ts.queued_on == (T,)
    assert ts not in s.workers[V].processing and not s.stealing.steals
    assert [(u.worker, u.key) for u in out if isinstance(u, Unclaim)] == [(V, "c")]
    [enqueue] = [i for i in out if isinstance(i, Enqueue)]
    assert (enqueue.workers, enqueue.preferred) == ((T,), True)  # others take it if T is busy
    [event] = [i for i in out if isinstance(i, LogEvent)]
    assert event.kind == "stolen" and event.fields["victim"] == V and event.fields["thief"] == T
    assert ("c", "processing", "queued", "workers:2-0/0") in s.stories("c")
    s.handle_stimulus(TaskClaimed(worker=T, keys=["c"], scores=[score], stimulus_id="w:3"))
    assert s.tasks["c"].processing_on == T
    s.handle_stimulus(TaskFinished(worker=T, key="c", nbytes=1, stimulus_id="w:4"))
    assert s.tasks["c"].state == "memory" and s.tasks["c"].who_has == {T}


def test_an_answer_about_a_task_no_longer_processing_on_the_victim_changes_nothing():
    s = make(V, T, W3)
    claimed_by_victim(s, [task(k) for k in "abc"])
    s.handle_stimulus(RemoveWorker(worker=V, reason="x", how="heartbeat", stimulus_id="dead"))
    assert s.tasks["c"].state == "queued"  # the death queued it again
    before = s.tasks["c"].queued_on
    out = s.handle_stimulus(StolenKeys(worker=V, thief=T, keys=["c"], stimulus_id="w:5"))
    assert out == [] and s.tasks["c"].queued_on == before
    # another run of the key (its score is not the current one): ignored too
    s2 = make(V, T)
    claimed_by_victim(s2, [task(k) for k in "ab"])
    stale = StolenKeys(worker=V, thief=T, keys=["b"], scores=[-1.0], stimulus_id="w:6")
    assert s2.handle_stimulus(stale) == [] and s2.tasks["b"].processing_on == V


def test_a_thief_that_left_before_the_answer_gets_nothing_placed():
    s = make(V, T, W3)
    claimed_by_victim(s, [task(k) for k in "abc"])
    tick(s)
    s.handle_stimulus(RemoveWorker(worker=T, reason="bye", stimulus_id="gone"))
    s.handle_stimulus(StolenKeys(worker=V, thief=T, keys=["c"], stimulus_id="w:7"))
    assert s.tasks["c"].state == "queued" and T not in s.tasks["c"].queued_on


def test_a_restricted_task_is_never_asked_for_a_worker_outside_its_restriction():
    s = make(V, T)
    claimed_by_victim(s, [task(k, workers=[V]) for k in "abc"])
    assert requests(tick(s)) == []  # the surplus may run on V alone
    s2 = make(V, T)
    claimed_by_victim(s2, [task("a"), task("b", workers=[V, T]), task("c", workers=[V])])
    assert requests(tick(s2)) == [(V, T, ["b"])]
    out = s2.handle_stimulus(StolenKeys(worker=V, thief=T, keys=["b"], stimulus_id="w:8"))
    # queued as any restricted task: on every worker its restriction names
    assert s2.tasks["b"].state == "queued" and set(s2.tasks["b"].queued_on) == {V, T}
    assert any(isinstance(i, Enqueue) and not i.preferred for i in out)


def test_a_task_needing_resources_is_never_asked_for_a_worker_without_them():
    gpu = {"GPU": 1.0}
    s = make(V, T, resources={V: gpu})
    claimed_by_victim(s, [task(k, resources=gpu) for k in "abc"])
    assert requests(tick(s)) == []
    s2 = make(V, T, resources={V: gpu, T: gpu})
    claimed_by_victim(s2, [task(k, resources=gpu) for k in "abc"])
    assert requests(tick(s2)) == [(V, T, ["c"])]


def test_a_retiring_worker_steals_nothing():
    s = make(V, T)
    claimed_by_victim(s, [task(k) for k in "abc"])
    s.handle_stimulus(RetireWorkers(workers=[T], stimulus_id="retire"))
    assert requests(tick(s)) == []


def test_a_task_whose_data_costs_more_to_move_than_to_run_stays():
    s = make(V, T)
    s.handle_stimulus(
        UpdateGraph(client="c", tasks=[task("big")], wanted=["big"], stimulus_id="ug0")
    )
    s.handle_stimulus(TaskClaimed(worker=V, keys=["big"], stimulus_id="w:0"))
    s.handle_stimulus(
        TaskFinished(worker=V, key="big", nbytes=10**9, start=1.0, stop=1.01, stimulus_id="w:1")
    )
    claimed_by_victim(s, [task("use-1", ["big"]), task("use-2", ["big"])])
    s.durations.averages["use"] = 0.01  # 10 ms to run; 10 s to move 1 GB
    assert requests(tick(s)) == []
    s.durations.averages["use"] = 20.0  # worth it now
    assert requests(tick(s)) == [(V, T, ["use-2"])]


def test_the_plan_levels_a_surplus_over_several_thieves():
    """Each claim goes to the least loaded thief: two each, not half to the first thief
    and half of the rest to the next (the mis-estimated row at 8 workers: 68 and 34)."""
    s = make(V, T, W3)
    claimed_by_victim(s, [task(k) for k in "abcdef"])  # 6 claims, 1 thread
    plans = plan_steals(s.workers, {}, lambda ts, thief: True, lambda thief: False)
    assert [(v, t, [ts.key for ts in tasks]) for v, t, tasks in plans] == [
        (V, T, ["f", "d"]),
        (V, W3, ["e", "c"]),
    ]
    # and several victims over several thieves: 4 claims each, 8 workers of 1 thread
    many = [f"tcp://10.0.1.{i}:8000" for i in range(8)]
    s = make(*many)
    for i, victim in enumerate(many[:2]):
        keys = [f"t{i}-{j}" for j in range(8)]
        s.handle_stimulus(UpdateGraph(client="c", tasks=[task(k) for k in keys], wanted=keys,
                                      stimulus_id=f"ug{i}"))  # fmt: skip
        s.handle_stimulus(TaskClaimed(worker=victim, keys=keys, stimulus_id=f"w:{i}"))
    asked: dict[str, int] = {}
    for _, thief, keys in requests(tick(s)):
        asked[thief] = asked.get(thief, 0) + len(keys)
    assert sorted(asked.values()) == [2, 2, 2, 2, 2, 2] and set(asked) == set(many[2:])


def test_the_plan_weighs_claims_by_their_estimates():
    """A victim running a 1 s task with a 1 s one and four 10 ms ones waiting gives all
    five to an idle thief (by counts: half); running a 10 ms task, it keeps the 1 s one,
    which it starts next (and never the one it runs, though that one is short)."""
    for running, kept in ((1.0, []), (0.01, ["slow-1"])):
        s = make(V, T)
        claimed_by_victim(
            s, [task("run-1"), task("slow-1")] + [task(f"fast-{i}") for i in range(4)]
        )
        s.durations.averages.update({"run": running, "slow": 1.0, "fast": 0.01})
        [(victim, thief, keys)] = requests(tick(s))
        assert (victim, thief) == (V, T)
        assert keys == [f"fast-{i}" for i in (3, 2, 1, 0)] + (["slow-1"] if not kept else [])


def test_an_estimate_of_nothing_still_moves_only_a_share():
    """Claims of a prefix whose runs take no time count for ``MIN_COST`` each: an idle
    thief asks for half of them, not all (they would all be moved at a cost of 0)."""
    s = make(V, T)
    claimed_by_victim(s, [task(f"noop-{i}") for i in range(6)])
    s.durations.averages["noop"] = 0.0
    [(_, _, keys)] = requests(tick(s))
    assert keys == ["noop-5", "noop-4", "noop-3"]


def test_requests_in_flight_count_on_their_thief():
    """The next tick, before the victim answered, asks for nothing more: what is on its
    way to the thief already counts there."""
    s = make(V, T, W3)
    claimed_by_victim(s, [task(k) for k in "abcdef"])
    assert len(requests(tick(s, 100.0))) == 2
    assert requests(tick(s, 100.1)) == []


def test_a_tick_with_nothing_to_move_says_nothing():
    s = make(V, T)
    assert tick(s) == []
    claimed_by_victim(s, [task("a")])
    assert tick(s) == []
