"""Push (redisdask/scheduler/push.py) in the scheduler's pure state machine: which root tasks of a
submission go straight to a worker's free thread, and which are queued for the claims.
No Redis, no processes: microseconds each."""

from __future__ import annotations

from typing import Any

import pytest

from redisdask.protocol import ClientDesiresKeys, ClientsTold, ComputeTask, Holding
from redisdask.scheduler.instructions import ClientMsg, Enqueue, Instruction, Push
from redisdask.scheduler.state import (
    AddWorker,
    ReleasedKeys,
    RemoveWorker,
    RetireWorkers,
    SchedulerState,
    TaskClaimed,
    TaskFinished,
    UpdateGraph,
)

pytestmark = pytest.mark.timeout(10)

A = "tcp://10.0.0.1:8000"
B = "tcp://10.0.0.2:8000"


def task(key: str, deps: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    return {"key": key, "spec": b"spec", "deps": deps or [], "priority": 0, **kw}


def make(*workers: tuple[str, int]) -> SchedulerState:
    s = SchedulerState(validate=True)
    for address, nthreads in workers:
        info = {"nthreads": nthreads, "started": 1700000000.5, "name": address[-6:]}
        s.handle_stimulus(AddWorker(worker=address, info=info, stimulus_id=f"add-{address}"))
    return s


def submit(s: SchedulerState, *tasks: dict[str, Any], sid: str = "ug") -> list[Instruction]:
    keys = [t["key"] for t in tasks]
    return s.handle_stimulus(
        UpdateGraph(client="c", tasks=list(tasks), wanted=keys, stimulus_id=sid)
    )


def finish(s: SchedulerState, key: str, worker: str, sid: str) -> None:
    score = s.tasks[key].score
    ev = TaskFinished(worker=worker, key=key, nbytes=8, type="int", score=score, stimulus_id=sid)
    s.handle_stimulus(ev)


def pushes(out: list[Instruction]) -> dict[str, str]:
    """key -> the worker each task was pushed to."""
    return {i.msg.key: i.worker for i in out if isinstance(i, Push)}


def queued(out: list[Instruction]) -> list[str]:
    return [i.key for i in out if isinstance(i, Enqueue)]


def test_a_root_task_goes_to_a_free_thread_processing_there_at_once():
    s = make((A, 1), (B, 1))
    out = submit(s, task("x"))
    assert pushes(out) == {"x": A}  # the least occupied, then the smallest address
    assert queued(out) == []  # no ready set, no ready-signal: no claim, nobody else woken
    ts = s.tasks["x"]
    assert ts.state == "processing" and ts.processing_on == A
    assert ts in s.workers[A].processing
    [push] = [i for i in out if isinstance(i, Push)]
    assert push.msg == ComputeTask("x", ts.score, 1700000000.5, -1.0, False)
    assert [e[1:3] for e in s.stories("x")][-2:] == [
        ("waiting", "queued"),
        ("queued", "processing"),
    ]


def test_free_threads_are_filled_then_the_rest_is_queued_for_claims():
    s = make((A, 2), (B, 1))
    out = submit(s, *[task(f"t{i}") for i in range(6)])
    placed = pushes(out)
    assert sorted(placed.values()) == [A, A, B]  # one per free thread, least occupied first
    assert sorted(queued(out)) == sorted(set(s.tasks) - set(placed))
    # busy now: the next submission is queued
    assert pushes(submit(s, task("later"), sid="ug2")) == {}


def test_only_root_tasks_that_run_anywhere_are_pushed():
    s = make((A, 4))
    out = submit(
        s,
        task("root"),
        task("dep", deps=["root"]),  # placed by data once root is done (scheduler/decide.py)
        task("restricted", workers=[A]),
        task("resourced", resources={"GPU": 1}),
    )
    assert pushes(out) == {"root": A}


def test_the_duration_estimate_and_the_chain_flag_travel_with_the_push():
    s = make((A, 1))
    s.durations.averages["x"] = 0.25
    submit(s, task("x-1"))
    finish(s, "x-1", A, "workers:1-0/0")
    [push] = [i for i in submit(s, task("x-2"), sid="ug2") if isinstance(i, Push)]
    assert push.msg.estimate == 0.25


def test_a_task_queued_again_is_not_pushed():
    """Only a submission pushes: a task given back, or whose worker died, goes to the
    ready set (a paused worker gives back what it is handed; pushing it again there would
    go round and round)."""
    s = make((A, 1), (B, 1))
    submit(s, task("x"))
    out = s.handle_stimulus(RemoveWorker(worker=A, reason="gone", how="heartbeat",
                                         stimulus_id="watch-1"))  # fmt: skip
    assert pushes(out) == {} and queued(out) == ["x"]
    assert s.tasks["x"].state == "queued"


def test_a_worker_that_gives_a_pushed_task_back_gets_no_more_until_it_claims():
    s = make((A, 1), (B, 1))
    submit(s, task("x"))
    out = s.handle_stimulus(ReleasedKeys(worker=A, keys=["x"], scores=[s.tasks["x"].score],
                                         stimulus_id="workers:1-0/0"))  # fmt: skip
    assert queued(out) == ["x"] and s.workers[A].no_push
    assert pushes(submit(s, task("y"), sid="ug2")) == {"y": B}  # A looked free, but is not
    s.handle_stimulus(TaskClaimed(worker=A, keys=["x"], scores=[s.tasks["x"].score],
                                  stimulus_id="workers:2-0/0"))  # fmt: skip
    assert not s.workers[A].no_push  # it claims: it runs what it gets
    finish(s, "x", A, "workers:3-0/0")
    assert pushes(submit(s, task("z"), sid="ug3")) == {"z": A}


def test_a_retiring_worker_gets_no_push():
    s = make((A, 1), (B, 1))
    s.handle_stimulus(RetireWorkers(workers=[A], stimulus_id="ret"))
    assert pushes(submit(s, task("x"))) == {"x": B}


def test_a_worker_without_a_process_stamp_gets_no_push():
    """The push names the worker process it is for (``started``): without one, queue."""
    s = SchedulerState(validate=True)
    s.handle_stimulus(AddWorker(worker=A, info={"nthreads": 1}, stimulus_id="add"))
    out = submit(s, task("x"))
    assert pushes(out) == {} and queued(out) == ["x"]


def test_a_pushed_task_is_not_taken_for_lost_by_the_report_written_before_it_was_read():
    """The worker may write a holding report before it reads the push: that one, and the
    one after it (which lists claims made before the previous report only), say nothing
    of it; the task must stay where it is."""
    s = make((A, 1))
    submit(s, task("x"))
    for n in range(2):
        s.handle_stimulus(Holding(worker=A, keys=[], stimulus_id=f"workers:{n + 1}-0/0"))
        assert s.tasks["x"].processing_on == A
    # a third report without it: its worker does not have it (the push was lost)
    s.handle_stimulus(Holding(worker=A, keys=[], stimulus_id="workers:3-0/0"))
    s.handle_stimulus(Holding(worker=A, keys=[], stimulus_id="workers:4-0/0"))
    assert s.tasks["x"].state in ("queued", "processing")  # queued again (then maybe pushed)
    assert s.tasks["x"].processing_on is None


def client_news(out: list[Instruction]) -> list[tuple[str, str]]:
    return [(i.client, i.msg.key) for i in out if isinstance(i, ClientMsg)]


def test_the_push_names_the_clients_its_report_tells_and_the_scheduler_does_not_repeat_it():
    s = make((A, 1))
    out = submit(s, task("x"))
    [push] = [i for i in out if isinstance(i, Push)]
    assert push.notify == {"c": s.generations.get("c", 0)}  # written into the record
    s.handle_stimulus(ClientDesiresKeys(client="late", keys=["x"], stimulus_id="cd"))
    score = s.tasks["x"].score
    finished = TaskFinished(worker=A, key="x", nbytes=8, type="int", score=score,
                            stimulus_id="workers:1-0/1")  # fmt: skip
    told = ClientsTold(worker=A, keys=["x"], scores=[score], stimulus_id="workers:1-0/0")
    out = s.handle_stimulus(told, finished)
    assert client_news(out) == [("late", "x")]  # "c" had it from the worker's report


def test_a_told_of_another_run_or_worker_changes_nothing():
    s = make((A, 1), (B, 1))
    submit(s, task("x"))
    score = s.tasks["x"].score
    other_run = ClientsTold(worker=A, keys=["x"], scores=[score - 1], stimulus_id="t1")
    other_worker = ClientsTold(worker=B, keys=["x"], scores=[score], stimulus_id="t2")
    s.handle_stimulus(other_run, other_worker)
    assert not s.tasks["x"].told
    ev = TaskFinished(worker=A, key="x", nbytes=8, type="int", score=score, stimulus_id="w")
    assert client_news(s.handle_stimulus(ev)) == [("c", "x")]  # nothing said it was told


def test_a_client_that_sent_a_graph_since_the_push_hears_from_the_scheduler_too():
    """The same key submitted again (a newer graph) before the result: the client takes
    only news as new as that graph, which FINISH's (of the push's generation) is not."""
    s = make((A, 1))
    first = UpdateGraph(client="c", tasks=[task("x")], wanted=["x"], generation=1,
                        stimulus_id="ug1")  # fmt: skip
    again = UpdateGraph(client="c", tasks=[task("x")], wanted=["x"], generation=2,
                        stimulus_id="ug2")  # fmt: skip
    [push] = [i for i in s.handle_stimulus(first) if isinstance(i, Push)]
    assert push.notify == {"c": 1}
    s.handle_stimulus(again)
    score = s.tasks["x"].score
    told = ClientsTold(worker=A, keys=["x"], scores=[score], stimulus_id="workers:1-0/0")
    finished = TaskFinished(worker=A, key="x", nbytes=8, type="int", score=score,
                            stimulus_id="workers:1-0/1")  # fmt: skip
    out = s.handle_stimulus(told, finished)
    assert client_news(out) == [("c", "x")]
    [news] = [i.msg for i in out if isinstance(i, ClientMsg)]
    assert news.seen == 2


def test_a_worker_ignores_a_push_meant_for_another_process_or_without_its_spec():
    """A push names the worker process it is for; one whose spec did not come (its task
    was forgotten in the batch that pushed it) is skipped, and the rest of the entry is
    still applied.  (The scheduler queues such a task again once two holding reports go
    without it: test_a_pushed_task_is_not_taken_for_lost_by_the_report_written_before...)"""
    from redisdask.protocol import FreeKeys
    from redisdask.store import codecs, keyspace
    from redisdask.workers.events import FreeKeysEvent
    from redisdask.workers.inbox import Pushed, inbox_events

    def entry(*msgs: Any, specs: dict[str, bytes] | None = None) -> dict[bytes, bytes]:
        fields = {b"m": codecs.pack([m.to_dict() for m in msgs])}
        for key, spec in (specs or {}).items():
            fields[keyspace.push_spec_field(key).encode()] = spec
        return fields

    mine, gone = 1700000000.5, 1600000000.25
    push = ComputeTask("x", 1.5, mine, 0.01, True)
    [pushed] = inbox_events("1-0", entry(push, specs={"x": b"spec"}), mine)
    assert isinstance(pushed, Pushed) and pushed.chain
    assert (pushed.event.key, pushed.event.run_spec, pushed.event.estimate) == ("x", b"spec", 0.01)
    assert inbox_events("2-0", entry(push, specs={"x": b"spec"}), gone) == []
    [freed] = inbox_events("3-0", entry(push, FreeKeys(["y"])), mine)  # no spec for x
    assert isinstance(freed, FreeKeysEvent) and freed.keys == ["y"]
