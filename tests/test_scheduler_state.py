"""Unit tests of the scheduler's pure state machine (redisdask/scheduler/state.py).

No Redis, no processes, no clocks: events in, instructions out, microseconds each.
Every ``SchedulerState`` here validates its invariants after each ``handle_stimulus``
(except the timing tests, which measure the machine itself)."""

from __future__ import annotations

import heapq
import pickle
import random
import time
from typing import Any

import pytest

from redisdask.errors import ProtocolError
from redisdask.protocol import SCHEDULER_EVENTS
from redisdask.scheduler.instructions import (
    ClaimAccepted,
    ClientMsg,
    Dequeue,
    Enqueue,
    Forget,
    ForgetClient,
    ForgetWorker,
    Instruction,
    LogEvent,
    RecordDeath,
    SetDurations,
    SetState,
    SetWants,
    StoreTask,
    Unclaim,
    WorkerMsg,
)
from redisdask.scheduler.state import (
    AddKeys,
    AddWorker,
    CancelKeys,
    ClientDesiresKeys,
    ClientMissingData,
    ClientReleasesKeys,
    CloseClient,
    Holding,
    MissingData,
    RejectedGraph,
    ReleasedKeys,
    RemoveWorker,
    Replicate,
    Restart,
    RetireWorkers,
    RetryKeys,
    SchedulerState,
    Stimulus,
    TaskClaimed,
    TaskErred,
    TaskFinished,
    UpdateData,
    UpdateGraph,
    priority_score,
)
from redisdask.spec import key_prefix
from redisdask.state_machine import InvalidTransition, table_problems

pytestmark = pytest.mark.timeout(10)

W1 = "tcp://10.0.0.1:8000"
W2 = "tcp://10.0.0.2:8000"
W3 = "tcp://10.0.0.3:8000"


# --------------------------------------------------------------------------- helpers


def task(key: str, deps: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    return {
        "key": key,
        "spec": kw.pop("spec", b"spec-" + key.encode()),
        "deps": deps or [],
        "priority": kw.pop("priority", 0),
        "retries": kw.pop("retries", 0),
        **kw,
    }


def make(*workers: str) -> SchedulerState:
    s = SchedulerState(validate=True)
    if workers:
        s.handle_stimulus(*(AddWorker(worker=w, stimulus_id=f"add-{w}") for w in workers))
    return s


def submit(s: SchedulerState, client: str, tasks: list[dict[str, Any]], wanted: list[str]):
    return s.handle_stimulus(
        UpdateGraph(client=client, tasks=tasks, wanted=wanted, stimulus_id="ug")
    )


def run(s: SchedulerState, key: str, worker: str = W1, nbytes: int = 8) -> list[Instruction]:
    """A worker claims ``key`` and finishes it."""
    out = s.handle_stimulus(TaskClaimed(worker=worker, keys=[key], stimulus_id="claim"))
    assert s.tasks[key].state == "processing"
    return out + s.handle_stimulus(
        TaskFinished(worker=worker, key=key, nbytes=nbytes, type="int", stimulus_id="fin")
    )


def fail(s: SchedulerState, key: str, worker: str = W1, text: str = "ZeroDivisionError: x"):
    s.handle_stimulus(TaskClaimed(worker=worker, keys=[key], stimulus_id="claim"))
    return s.handle_stimulus(
        TaskErred(
            worker=worker,
            key=key,
            exception=b"pickled-exc",
            traceback=b"pickled-tb",
            exception_text=text,
            traceback_text="Traceback ...",
            stimulus_id="err",
        )
    )


def of(instructions: list[Instruction], cls: type) -> list[Any]:
    return [i for i in instructions if isinstance(i, cls)]


def client_msgs(instructions: list[Instruction], op: str, client: str | None = None) -> list:
    return [
        i.msg.to_dict()
        for i in of(instructions, ClientMsg)
        if i.msg.op == op and (client is None or i.client == client)
    ]


def freed(instructions: list[Instruction], worker: str | None = None) -> set[str]:
    return {
        k
        for i in of(instructions, WorkerMsg)
        if i.msg.op == "free-keys" and (worker is None or i.worker == worker)
        for k in i.msg.keys
    }


def net_ready(instructions: list[Instruction]) -> dict[str, float | None]:
    """The ready set's net change, as the driver coalesces it (None: removed)."""
    net: dict[str, float | None] = {}
    for i in instructions:
        if isinstance(i, Enqueue):
            net[i.key] = i.score
        elif isinstance(i, Dequeue):
            net[i.key] = None
    return net


def states(s: SchedulerState) -> dict[str, str]:
    return {k: ts.state for k, ts in s.tasks.items()}


# --------------------------------------------------------------------------- one task


def test_single_task_lifecycle():
    s = make(W1)
    out = submit(s, "c", [task("x")], ["x"])
    assert s.tasks["x"].state == "queued"
    (store,) = of(out, StoreTask)
    assert (store.key, store.spec, store.deps, store.state) == ("x", b"spec-x", [], "released")
    (enq,) = of(out, Enqueue)
    assert enq.key == "x" and enq.score == priority_score(0, 1) == store.score
    assert any(isinstance(i, SetState) and i.state == "queued" for i in out)
    assert of(out, SetWants)[0].add == ["x"]
    assert s.tasks["x"].who_wants == {"c"}

    out = s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id="claim"))
    assert s.tasks["x"].state == "processing" and s.tasks["x"].processing_on == W1
    assert s.tasks["x"] in s.workers[W1].processing
    # the claim script already wrote everything: the instruction is for the story only
    assert [type(i) for i in out] == [ClaimAccepted]

    out = s.handle_stimulus(
        TaskFinished(worker=W1, key="x", nbytes=28, type="int", stimulus_id="fin")
    )
    ts = s.tasks["x"]
    assert ts.state == "memory" and ts.who_has == {W1} and ts.processing_on is None
    assert ts in s.workers[W1].has_what and not s.workers[W1].processing
    assert [u.key for u in of(out, Unclaim)] == ["x"]
    (msg,) = client_msgs(out, "key-in-memory", "c")
    assert msg == {"op": "key-in-memory", "key": "x", "who_has": [W1], "nbytes": 28, "type": "int"}
    (st,) = [i for i in of(out, SetState) if i.key == "x"]
    assert st.state == "memory" and st.fields["who_has"] == [W1]

    out = s.handle_stimulus(ClientReleasesKeys(client="c", keys=["x"], stimulus_id="rel"))
    assert "x" not in s.tasks
    assert freed(out, W1) == {"x"}
    assert [f.key for f in of(out, Forget)] == ["x"]
    assert of(out, SetWants)[0].remove == ["x"]


def test_a_claim_is_written_again_only_if_the_task_was_dequeued_since_it_was_made():
    """The claim script writes a claim; only a task taken out of the ready sets and
    queued again meanwhile (which wrote ``queued`` over the claim) needs it rewritten."""
    s = make(W1)
    # y stays known while released: its erred dependent z is still wanted
    submit(s, "c", [task("x"), task("y"), task("z", ["y", "nobody-made-it"])], ["x", "y", "z"])
    assert s.tasks["z"].state == "erred"
    out = s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id="claim-x"))
    assert [i.rewrite for i in of(out, ClaimAccepted)] == [False]
    score = s.tasks["y"].score
    s.handle_stimulus(ClientReleasesKeys(client="c", keys=["y"], stimulus_id="rel"))
    assert s.tasks["y"].state == "released"
    s.handle_stimulus(ClientDesiresKeys(client="c", keys=["y"], stimulus_id="again"))
    assert s.tasks["y"].state == "queued" and s.tasks["y"].score == score  # the same run
    out = s.handle_stimulus(TaskClaimed(worker=W1, keys=["y"], stimulus_id="claim-y"))
    assert [(i.key, i.rewrite) for i in of(out, ClaimAccepted)] == [("y", True)]
    assert not s.tasks["y"].dequeued


def test_desiring_a_finished_key_reports_it_at_once():
    s = make(W1)
    submit(s, "a", [task("x")], ["x"])
    run(s, "x")
    out = s.handle_stimulus(ClientDesiresKeys(client="b", keys=["x"], stimulus_id="d"))
    assert client_msgs(out, "key-in-memory", "b")[0]["key"] == "x"
    assert s.tasks["x"].who_wants == {"a", "b"}


def test_desiring_an_unknown_key_errs_it_for_that_client():
    """A future unpickled in a task after its submitter let the key go (issue 12): its
    client hears why at once instead of waiting forever."""
    s = make(W1)
    out = s.handle_stimulus(ClientDesiresKeys(client="w", keys=["gone"], stimulus_id="d"))
    [msg] = client_msgs(out, "task-erred", "w")
    assert msg["key"] == "gone" and "unknown to the scheduler" in msg["exception_text"]
    assert "gone" not in s.tasks


def test_resubmitting_a_key_does_not_duplicate_it():
    s = make(W1)
    submit(s, "c", [task("x")], ["x"])
    out = submit(s, "c", [task("x")], ["x"])
    assert not of(out, StoreTask) and not of(out, Enqueue)
    assert s.tasks["x"].state == "queued"


# --------------------------------------------------------------------------- priorities


def test_priority_scores_user_priority_first_then_submission_order():
    s = make(W1)
    out = submit(
        s,
        "c",
        [
            task("a"),
            task("b", priority=5),
            task("c"),
            task("d", priority=-1),
            task("e", priority=5),
        ],
        ["a", "b", "c", "d", "e"],
    )
    scores = {e.key: e.score for e in of(out, Enqueue)}
    assert sorted(scores, key=scores.__getitem__) == ["b", "e", "a", "c", "d"]
    # a later submission with a higher priority still overtakes the earlier ones
    out = submit(s, "c", [task("z", priority=1)], ["z"])
    z = of(out, Enqueue)[0].score
    assert scores["b"] < z < scores["a"]
    assert priority_score(1, 2) < priority_score(0, 1) < priority_score(0, 2)


def test_dependents_are_queued_in_priority_order():
    s = make(W1)
    out = submit(
        s,
        "c",
        [task("root"), task("lo", ["root"]), task("hi", ["root"], priority=3)],
        ["lo", "hi"],
    )
    assert [e.key for e in of(out, Enqueue)] == ["root"]
    out = run(s, "root")
    assert [e.key for e in of(out, Enqueue)] == ["hi", "lo"]


# --------------------------------------------------------------------------- chains


def test_chain_waits_releases_and_forgets():
    s = make(W1, W2)
    out = submit(s, "c", [task("a"), task("b", ["a"]), task("c", ["b"])], ["c"])
    assert states(s) == {"a": "queued", "b": "waiting", "c": "waiting"}
    assert [e.key for e in of(out, Enqueue)] == ["a"]

    out = run(s, "a", W1)
    assert states(s) == {"a": "memory", "b": "queued", "c": "waiting"}
    assert [e.key for e in of(out, Enqueue)] == ["b"]
    assert not client_msgs(out, "key-in-memory")  # nobody wants a itself

    out = run(s, "b", W2)
    # a: nobody wants it, b (its only dependent) is done -> released on its holder ...
    assert freed(out) == {"a"} and freed(out, W1) == {"a"}
    assert s.tasks["a"].state == "released" and not s.tasks["a"].who_has
    # ... but NOT forgotten: b's graph history may need it to recompute b
    assert "a" in s.tasks and not [f for f in of(out, Forget)]
    assert states(s) == {"a": "released", "b": "memory", "c": "queued"}

    out = run(s, "c", W1)
    assert states(s) == {"a": "released", "b": "released", "c": "memory"}
    assert freed(out, W2) == {"b"}
    assert client_msgs(out, "key-in-memory", "c")[0]["key"] == "c"

    out = s.handle_stimulus(ClientReleasesKeys(client="c", keys=["c"], stimulus_id="rel"))
    assert s.tasks == {}
    assert {f.key for f in of(out, Forget)} == {"a", "b", "c"}
    assert freed(out, W1) == {"c"}


def test_diamond_shared_dependency_released_once_both_dependents_are_done():
    s = make(W1)
    submit(s, "c", [task("a"), task("b", ["a"]), task("d", ["a"])], ["b", "d"])
    run(s, "a")
    assert states(s) == {"a": "memory", "b": "queued", "d": "queued"}
    out = run(s, "b")
    assert s.tasks["a"].state == "memory" and not freed(out)
    out = run(s, "d")
    assert s.tasks["a"].state == "released" and freed(out) == {"a"}


def test_released_task_is_recomputed_when_wanted_again():
    s = make(W1)
    submit(s, "c", [task("a"), task("b", ["a"])], ["b"])
    run(s, "a")
    run(s, "b")
    assert s.tasks["a"].state == "released"
    out = s.handle_stimulus(ClientDesiresKeys(client="c", keys=["a"], stimulus_id="d"))
    assert s.tasks["a"].state == "queued" and [e.key for e in of(out, Enqueue)] == ["a"]


# --------------------------------------------------------------------------- errors


def test_task_erred_reports_to_client_and_dependents_inherit():
    s = make(W1)
    submit(s, "c", [task("a"), task("b", ["a"]), task("c", ["b"])], ["b", "c"])
    out = fail(s, "a")
    assert s.tasks["c"].state == "erred" and s.tasks["b"].state == "erred"
    ts_a = s.tasks["a"]  # nobody wants a: released, but kept as history of b
    assert ts_a.state == "released"
    assert [u.key for u in of(out, Unclaim)] == ["a"]
    msgs = {m["key"]: m for m in client_msgs(out, "task-erred", "c")}
    assert set(msgs) == {"b", "c"}
    for key in ("b", "c"):
        assert msgs[key]["exception"] == b"pickled-exc"
        assert msgs[key]["traceback"] == b"pickled-tb"
        assert msgs[key]["exception_text"] == "ZeroDivisionError: x"
        assert msgs[key]["exception_blame"] == "a"
        assert msgs[key]["erred_on"] == W1
        assert s.tasks[key].exception_blame == "a"
    # nothing is queued for erred tasks; releasing forgets everything
    s.handle_stimulus(ClientReleasesKeys(client="c", keys=["b", "c"], stimulus_id="rel"))
    assert s.tasks == {}


def test_erred_root_wanted_by_client_gets_its_own_message():
    s = make(W1)
    submit(s, "c", [task("a"), task("b", ["a"])], ["a", "b"])
    out = fail(s, "a")
    msgs = {m["key"]: m for m in client_msgs(out, "task-erred", "c")}
    assert msgs["a"]["exception_blame"] == "" and msgs["b"]["exception_blame"] == "a"
    assert s.tasks["a"].state == "erred" and s.tasks["a"].erred_on == W1
    # a client asking later is told at once
    out = s.handle_stimulus(ClientDesiresKeys(client="late", keys=["b"], stimulus_id="d"))
    assert client_msgs(out, "task-erred", "late")[0]["exception_blame"] == "a"


def test_submitting_onto_an_erred_dependency_errs_at_once():
    s = make(W1)
    submit(s, "c", [task("a")], ["a"])
    fail(s, "a")
    out = submit(s, "c", [task("b", ["a"])], ["b"])
    assert s.tasks["b"].state == "erred" and s.tasks["b"].exception_blame == "a"
    assert client_msgs(out, "task-erred", "c")[0]["key"] == "b"
    assert not of(out, Enqueue)


def test_retry_runs_an_erred_task_again_and_reports_its_new_result():
    s = make(W1)
    submit(s, "c", [task("a")], ["a"])
    fail(s, "a")
    out = s.handle_stimulus(RetryKeys(client="c", keys=["a"], stimulus_id="retry"))
    ts = s.tasks["a"]
    assert ts.state == "queued" and ts.exception_text == "" and ts.erred_on is None
    assert net_ready(out) == {"a": ts.score}
    out = run(s, "a")
    assert client_msgs(out, "key-in-memory", "c")[0]["key"] == "a"


def test_retry_reruns_where_the_error_came_from_and_everything_that_inherited_it():
    """As distributed's stimulus_retry: the erred dependencies of what is retried, and
    every erred task downstream of the task that raised, run again; each client wanting
    one hears task-retried."""
    s = make(W1)
    graph = [task("a"), task("b", ["a"]), task("d", ["b"]), task("e", ["a"]), task("f")]
    submit(s, "c", graph, ["b", "d", "e", "f"])
    submit(s, "other", [], ["d"])
    fail(s, "a")
    fail(s, "f")  # another error: not retried with a's
    assert states(s) == {"a": "released", "b": "erred", "d": "erred", "e": "erred", "f": "erred"}
    out = s.handle_stimulus(RetryKeys(client="c", keys=["b"], stimulus_id="retry"))
    assert states(s) == {
        "a": "queued",
        "b": "waiting",
        "d": "waiting",
        "e": "waiting",
        "f": "erred",
    }
    assert {m["key"] for m in client_msgs(out, "task-retried", "c")} == {"b", "d", "e"}
    assert [m["key"] for m in client_msgs(out, "task-retried", "other")] == ["d"]
    run(s, "a")
    run(s, "b")
    out = run(s, "d")
    assert client_msgs(out, "key-in-memory", "other")[0]["key"] == "d"


def test_retry_ignores_keys_the_client_does_not_want_or_that_did_not_err():
    s = make(W1)
    submit(s, "c", [task("a"), task("b")], ["a", "b"])
    fail(s, "a")
    out = s.handle_stimulus(
        RetryKeys(client="other", keys=["a"], stimulus_id="r1"),
        RetryKeys(client="c", keys=["b", "missing"], stimulus_id="r2"),
    )
    assert states(s) == {"a": "erred", "b": "queued"} and not out


def test_error_propagates_down_a_long_chain_without_recursion():
    n = 1000
    s = make(W1)
    tasks = [task("t0")] + [task(f"t{i}", [f"t{i - 1}"]) for i in range(1, n)]
    submit(s, "c", tasks, [f"t{n - 1}"])
    out = fail(s, "t0")
    assert all(s.tasks[f"t{i}"].state in ("erred", "released") for i in range(n))
    last = s.tasks[f"t{n - 1}"]
    assert last.state == "erred" and last.exception_blame == "t0"
    assert client_msgs(out, "task-erred", "c")[0]["key"] == f"t{n - 1}"
    out = s.handle_stimulus(ClientReleasesKeys(client="c", keys=[f"t{n - 1}"], stimulus_id="rel"))
    assert s.tasks == {} and len(of(out, Forget)) == n


def test_long_chain_runs_and_is_forgotten_iteratively():
    n = 1000
    s = make(W1)
    tasks = [task("t0")] + [task(f"t{i}", [f"t{i - 1}"]) for i in range(1, n)]
    submit(s, "c", tasks, [f"t{n - 1}"])
    s.validate = False  # O(n) each; this test is about recursion depth
    for i in range(n):
        run(s, f"t{i}")
    s.validate = True
    out = s.handle_stimulus(ClientReleasesKeys(client="c", keys=[f"t{n - 1}"], stimulus_id="rel"))
    assert s.tasks == {} and len(of(out, Forget)) == n


def test_cancelling_a_long_waiting_chain():
    n = 2000
    s = make(W1)
    tasks = [task("t0")] + [task(f"t{i}", [f"t{i - 1}"]) for i in range(1, n)]
    submit(s, "c", tasks, [f"t{n - 1}"])
    out = s.handle_stimulus(CancelKeys(client="c", keys=[f"t{n - 1}"], stimulus_id="cx"))
    assert s.tasks == {} and len(of(out, Forget)) == n
    assert [d.key for d in of(out, Dequeue)] == ["t0"]


def test_retries_requeue_before_erring():
    s = make(W1, W2)
    out = submit(s, "c", [task("x", retries=2)], ["x"])
    score = of(out, Enqueue)[0].score
    for attempt, left in ((1, 1), (2, 0)):
        out = fail(s, "x", W1 if attempt == 1 else W2)
        assert s.tasks["x"].state == "queued", attempt
        assert s.tasks["x"].retries == left
        assert [e.score for e in of(out, Enqueue)] == [score]
        assert not client_msgs(out, "task-erred")
        assert any(isinstance(i, SetState) and i.fields.get("retries") == left for i in out)
        assert not s.workers[W1].processing and not s.workers[W2].processing
    out = fail(s, "x", W1)
    assert s.tasks["x"].state == "erred"
    assert client_msgs(out, "task-erred", "c")[0]["key"] == "x"
    assert not of(out, Enqueue)


def test_retries_then_success():
    s = make(W1)
    submit(s, "c", [task("x", retries=1)], ["x"])
    fail(s, "x")
    out = run(s, "x")
    assert s.tasks["x"].state == "memory" and client_msgs(out, "key-in-memory", "c")


def test_a_retry_tells_the_worker_that_failed_to_drop_the_failed_run():
    s = make(W1)
    submit(s, "c", [task("x", retries=1)], ["x"])
    out = fail(s, "x", W1)
    assert s.tasks["x"].state == "queued" and freed(out, W1) == {"x"}
    # written before the task is queued again, so any claim of the retry comes after it
    first_free = next(i for i, ins in enumerate(out) if isinstance(ins, WorkerMsg))
    assert first_free < next(i for i, ins in enumerate(out) if isinstance(ins, Enqueue))


def test_releasing_an_erred_task_tells_the_worker_it_raised_on_and_only_that_one():
    s = make(W1, W2)
    submit(s, "c", [task("a"), task("b", ["a"])], ["a", "b"])
    fail(s, "a", W2)
    assert s.tasks["b"].erred_on == W2  # inherited
    out = s.handle_stimulus(ClientReleasesKeys(client="c", keys=["a", "b"], stimulus_id="rel"))
    assert s.tasks == {}
    assert freed(out, W2) == {"a"} and not freed(out, W1)  # b never ran anywhere
    # a KilledWorker's last worker is dead: nobody to tell
    s = make(W1)
    submit(s, "c", [task("k")], ["k"])
    for i in range(4):
        worker = f"tcp://10.0.1.{i}:1"
        s.handle_stimulus(AddWorker(worker=worker, stimulus_id=f"add{i}"))
        s.handle_stimulus(TaskClaimed(worker=worker, keys=["k"], stimulus_id=f"claim{i}"))
        s.handle_stimulus(
            RemoveWorker(worker=worker, how="connection", reason="x", stimulus_id=f"rm{i}")
        )
    assert s.tasks["k"].state == "erred" and s.tasks["k"].killed
    out = s.handle_stimulus(ClientReleasesKeys(client="c", keys=["k"], stimulus_id="rel"))
    assert not freed(out) and not of(out, WorkerMsg)


def test_scattering_onto_a_key_that_erred_on_the_same_worker_keeps_the_scattered_value():
    """The value was put on the worker (replacing its failed run) before update-data:
    releasing the error must not free it there."""
    s = make(W1, W2)
    submit(s, "c", [task("x")], ["x"])
    fail(s, "x", W1)
    out = s.handle_stimulus(UpdateData(client="c", who_has={"x": [W1]}, stimulus_id="sc"))
    assert s.tasks["x"].state == "memory" and s.tasks["x"].who_has == {W1}
    assert not freed(out)
    submit(s, "c", [task("z")], ["z"])
    fail(s, "z", W2)
    out = s.handle_stimulus(UpdateData(client="c", who_has={"z": [W1]}, stimulus_id="sc2"))
    assert freed(out, W2) == {"z"} and not freed(out, W1)


def test_each_scatter_of_a_key_has_a_score_of_its_own():
    """A worker tells a copy of a scattered key it kept from a newer scatter of the key
    by the score the claims name (``ComputeTaskEvent.runs``): one per scatter."""
    s = make(W1)
    s.handle_stimulus(ClientDesiresKeys(client="c", keys=["x"], stimulus_id="want"))
    out = s.handle_stimulus(UpdateData(client="c", who_has={"x": [W1]}, stimulus_id="sc"))
    first = s.tasks["x"].score
    [store] = of(out, StoreTask)
    assert first != 0.0 and store.score == first
    s.handle_stimulus(ClientReleasesKeys(client="c", keys=["x"], stimulus_id="rel"))
    assert "x" not in s.tasks
    s.handle_stimulus(UpdateData(client="c", who_has={"x": [W1]}, stimulus_id="sc2"))
    assert s.tasks["x"].score not in (0.0, first)
    submit(s, "c", [task("y")], ["y"])  # scattered over a task's run: a score of its own
    queued = s.tasks["y"].score
    out = s.handle_stimulus(UpdateData(client="c", who_has={"y": [W1]}, stimulus_id="sc3"))
    [write] = [i for i in of(out, SetState) if i.key == "y" and i.state == "memory"]
    assert s.tasks["y"].score == write.fields["score"] != queued
    submit(s, "c", [task("a"), task("b", ["a"])], ["b"])  # a: released once b is done
    run(s, "a")
    run(s, "b")
    assert s.tasks["a"].state == "released"
    computed = s.tasks["a"].score
    s.handle_stimulus(UpdateData(client="c", who_has={"a": [W1]}, stimulus_id="sc4"))
    assert s.tasks["a"].state == "memory" and s.tasks["a"].score != computed


def test_error_from_a_worker_not_processing_the_task_is_ignored():
    s = make(W1, W2)
    submit(s, "c", [task("x")], ["x"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id="claim"))
    out = s.handle_stimulus(TaskErred(worker=W2, key="x", exception_text="boom", stimulus_id="e"))
    assert out == [] and s.tasks["x"].state == "processing"


def test_a_rejected_graph_errs_the_clients_keys_it_does_not_already_have_running():
    s = make(W1)
    submit(s, "c", [task("old")], ["old"])
    reason = "malformed 'update-graph' message: task without a str 'key'"
    ev = RejectedGraph(client="c", keys=["y", "old", "y", "z"], reason=reason, stimulus_id="rej")
    out = s.handle_stimulus(ev)
    msgs = client_msgs(out, "task-erred", "c")
    assert [m["key"] for m in msgs] == ["y", "z"]  # "old" runs from an earlier message
    for m in msgs:
        assert m["rejected"] is True and reason in m["exception_text"]
        assert m["exception_text"].startswith("SchedulerRejectedError: ")
    assert out == of(out, ClientMsg) and "rejected-graph" not in SCHEDULER_EVENTS  # internal only
    assert s.tasks["old"].state == "queued"


def test_a_self_dependency_errs_at_once_instead_of_waiting_forever():
    s = make(W1)
    out = submit(s, "c", [task("a", ["a"]), task("b", ["a"])], ["a", "b"])
    assert states(s) == {"a": "erred", "b": "erred"} and not of(out, Enqueue)
    msgs = {m["key"]: m for m in client_msgs(out, "task-erred", "c")}
    assert msgs["a"]["rejected"] is True and msgs["b"]["rejected"] is True
    assert "task 'a' depends on itself" in msgs["a"]["exception_text"]
    assert msgs["b"]["exception_text"] == msgs["a"]["exception_text"]
    assert msgs["b"]["exception_blame"] == "a"
    [store_a] = [i for i in of(out, StoreTask) if i.key == "a"]
    assert store_a.deps == []  # the history keeps no cycle (a reload rebuilds none)
    erred = [i for i in of(out, SetState) if i.key == "a" and i.state == "erred"]
    assert erred[0].fields["rejected"] == 1
    s.handle_stimulus(ClientReleasesKeys(client="c", keys=["a", "b"], stimulus_id="rel"))
    assert s.tasks == {}  # and nothing is kept forever


def test_a_cycle_errs_the_tasks_on_it_and_their_dependents_and_names_them():
    s = make(W1)
    tasks = [task("a", ["b"]), task("b", ["c"]), task("c", ["a"]), task("x"), task("d", ["a", "x"])]
    out = submit(s, "c", tasks, ["d", "x"])
    # a, b and c are cut apart and erred; nobody wants them: only a stays, as d's history
    assert states(s) == {"a": "released", "d": "erred", "x": "queued"}
    [msg] = client_msgs(out, "task-erred", "c")
    assert msg["key"] == "d" and msg["rejected"] is True and msg["exception_blame"] in "abc"
    assert "cycle" in msg["exception_text"]
    assert "'a' -> 'b' -> 'c' -> 'a'" in msg["exception_text"]
    run(s, "x")
    s.handle_stimulus(ClientReleasesKeys(client="c", keys=["d", "x"], stimulus_id="rel"))
    assert s.tasks == {}


def test_a_cycle_of_a_thousand_tasks_is_found_without_recursion():
    n = 1000
    s = make(W1)
    tasks = [task(f"t{i}", [f"t{(i + 1) % n}"]) for i in range(n)]
    out = submit(s, "c", tasks, ["t0"])
    assert states(s) == {"t0": "erred"}  # the others, cut apart and not wanted: forgotten
    [msg] = client_msgs(out, "task-erred", "c")
    assert "'t0' -> 't1' -> " in msg["exception_text"] and "(990 more)" in msg["exception_text"]


def test_a_cycle_closed_through_an_older_task_errs_only_the_resubmitted_one():
    """o was submitted depending on p, which nobody submitted; p, submitted later,
    depends on o: the new dependency closes the cycle, and p is refused."""
    s = make(W1)
    submit(s, "c", [task("o", ["p"])], ["o"])
    assert states(s) == {"o": "erred", "p": "released"}  # p: no task to compute it
    out = submit(s, "c2", [task("p", ["o"])], ["p"])
    assert s.tasks["p"].state == "erred" and s.tasks["p"].rejected
    [msg] = client_msgs(out, "task-erred", "c2")
    assert "'o' -> 'p' -> 'o'" in msg["exception_text"]
    assert not s.tasks["p"].dependencies  # the cycle is cut


def test_a_key_first_named_only_as_a_dependency_is_computed_once_submitted():
    """o was submitted depending on p, which nobody had submitted: o errs, and p is kept
    as a placeholder (o's history).  p submitted then, with its spec, is a task like
    any other: recorded with its spec and run, not erred for want of one."""
    s = make(W1)
    submit(s, "c", [task("o", ["p"])], ["o"])
    assert states(s) == {"o": "erred", "p": "released"} and not s.tasks["p"].has_spec
    out = submit(s, "c2", [task("p", retries=2, priority=5)], ["p"])
    p = s.tasks["p"]
    assert p.has_spec and p.retries == 2 and p.score != 0.0
    [store] = [i for i in of(out, StoreTask) if i.key == "p"]
    assert store.spec == b"spec-p" and store.score == p.score
    assert not client_msgs(out, "task-erred", "c2")
    assert p.state in ("queued", "processing")
    run(s, "p")
    assert p.state == "memory"


def test_chains_submitted_one_task_at_a_time_search_no_older_task():
    """The cycle search is confined to the new tasks: a 3,000-task chain submitted task
    by task stays linear (each submission looks at one task, not the chain below)."""
    s = SchedulerState()
    s.handle_stimulus(AddWorker(worker=W1, stimulus_id="a"))
    start = time.perf_counter()
    submit(s, "c", [task("t0")], ["t0"])
    for i in range(1, 3000):
        submit(s, "c", [task(f"t{i}", [f"t{i - 1}"])], [f"t{i}"])
    assert time.perf_counter() - start < 2.0
    assert s.tasks["t2999"].state == "waiting"


def holding(s: SchedulerState, *keys: str, worker: str = W1) -> list[Instruction]:
    return s.handle_stimulus(Holding(worker=worker, keys=list(keys), stimulus_id="hold"))


def test_a_claim_its_worker_never_got_is_queued_again_after_two_reports_without_it():
    """Redis ran a claim script but died before the reply reached the worker: the task
    is processing there, and the worker knows nothing of it."""
    s = make(W1, W2)
    submit(s, "c", [task("x"), task("y")], ["x", "y"])
    holding(s)  # the worker's report before its claims
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x", "y"], stimulus_id="claim"))
    # the next report may not list them yet: a claim made just before it was read
    assert not of(holding(s, "y"), Enqueue)
    out = holding(s, "y")  # listed y; x missing once
    assert s.tasks["x"].state == "processing" and not of(out, Enqueue)
    out = holding(s, "y")  # x missing twice in a row: the worker never got it
    assert s.tasks["x"].state == "queued" and [e.key for e in of(out, Enqueue)] == ["x"]
    assert [u.key for u in of(out, Unclaim)] == ["x"] and s.workers[W1].processing == {s.tasks["y"]}
    [lost] = of(out, LogEvent)
    assert lost.kind == "lost-claim" and lost.fields == {"key": "x", "worker": W1}
    assert [(i.key, i.state) for i in of(out, SetState)] == [("x", "queued")]  # its story
    s.handle_stimulus(TaskClaimed(worker=W2, keys=["x"], stimulus_id="claim2"))
    s.handle_stimulus(TaskFinished(worker=W2, key="x", nbytes=1, stimulus_id="fin"))
    assert s.tasks["x"].state == "memory"


def test_a_task_listed_again_is_never_queued_again():
    s = make(W1)
    submit(s, "c", [task("x")], ["x"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id="claim"))
    for listed in ([], [], ["x"], [], ["x"], [], ["x"]):  # never two misses in a row
        assert not of(holding(s, *listed), Enqueue)
    assert s.tasks["x"].state == "processing"
    assert not of(holding(s, worker=W3), Instruction)  # an unknown worker's: ignored


def test_holding_reports_count_from_the_load_for_tasks_loaded_as_processing():
    """After a reload nothing says which report came before a claim: the first report
    read counts for nothing, and a claim already known moves its mark."""
    s = make(W1)
    submit(s, "c", [task("x"), task("y")], ["x", "y"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x", "y"], stimulus_id="claim"))
    for ts in s.tasks.values():  # as load_state leaves them
        ts.claimed_before = 0
    s.workers[W1].holding_reports = 0
    holding(s)
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["y"], stimulus_id="again"))  # pending, re-read
    holding(s, "y")
    out = holding(s, "y")
    assert [e.key for e in of(out, Enqueue)] == ["x"]
    assert s.tasks["y"].state == "processing"


def reloaded_with_x_claimed_at(entry: str) -> SchedulerState:
    """A scheduler that reloaded with ``x`` processing on W1, claimed by the entry
    ``entry`` of the workers stream (which it has not read yet)."""
    s = make(W1, W2)
    submit(s, "c", [task("x")], ["x"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id=f"workers:{entry}/0"))
    s.tasks["x"].claimed_before = 0  # as load_state leaves them
    s.workers[W1].holding_reports = 0
    return s


def test_holding_reports_written_before_a_reloaded_claim_do_not_count_against_it():
    """Issue 22: the reloaded state is ahead of the backlog by the claims made while no
    scheduler ran.  The worker's reports written before such a claim's entry cannot list
    it; read from the backlog, three of them queued it again, and it ran twice."""
    s = reloaded_with_x_claimed_at("1000-0")
    for entry in ("990-0", "995-0", "998-0"):  # the backlog: reports, then the claim
        out = s.handle_stimulus(Holding(worker=W1, keys=[], stimulus_id=f"workers:{entry}/0"))
        assert not of(out, Enqueue) and not of(out, LogEvent)
    assert s.tasks["x"].state == "processing"
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id="workers:1000-0/0"))
    for entry in ("1001-0", "1002-0"):  # listed: the worker has it
        s.handle_stimulus(Holding(worker=W1, keys=["x"], stimulus_id=f"workers:{entry}/0"))
    assert s.tasks["x"].state == "processing"
    for entry in ("1003-0", "1004-0"):  # a claim it never got is still found
        out = s.handle_stimulus(Holding(worker=W1, keys=[], stimulus_id=f"workers:{entry}/0"))
    assert s.tasks["x"].state == "queued" and [e.key for e in of(out, Enqueue)] == ["x"]


def test_a_resync_written_before_a_reloaded_claim_does_not_take_it_back():
    """A worker's resync (written when it re-registered) cannot list what it claimed
    after; read behind a reload that has the claim, it must not queue the task again."""
    s = reloaded_with_x_claimed_at("1000-0")
    report = {"keys": {}, "processing": []}
    out = s.handle_stimulus(AddWorker(worker=W1, resync=report, stimulus_id="workers:999-0/0"))
    assert s.tasks["x"].state == "processing" and not of(out, Enqueue)
    out = s.handle_stimulus(AddWorker(worker=W1, resync=report, stimulus_id="workers:1001-0/0"))
    assert s.tasks["x"].state == "queued"  # a later one that lacks it: taken back


def test_a_resync_after_redis_lost_writes_trusts_the_worker_about_itself():
    """A worker back after Redis restarted reports what it holds and runs; where Redis
    (and so the reloaded scheduler) says otherwise, the worker's word wins."""
    s = make(W1, W2)
    tasks = [task(k) for k in ("done", "lost", "runs", "theirs", "gone")]
    submit(s, "c", tasks, ["done", "lost", "runs", "theirs"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["done", "lost", "runs"], stimulus_id="claim"))
    s.handle_stimulus(TaskClaimed(worker=W2, keys=["theirs"], stimulus_id="claim2"))
    report = {"keys": {"done": 8, "gone": 3}, "processing": ["runs", "theirs"]}
    out = s.handle_stimulus(AddWorker(worker=W1, resync=report, stimulus_id="back"))
    # finished, its report lost: in memory there; never got: queued again; runs: kept
    assert states(s) == {
        "done": "memory",
        "lost": "queued",
        "runs": "processing",
        "theirs": "processing",
    }
    assert s.tasks["done"].who_has == {W1} and s.tasks["theirs"].processing_on == W2
    # what it runs or holds that is not its own (claimed in a Redis that forgot it, or
    # forgotten meanwhile) it must drop
    assert freed(out, W1) == {"gone", "theirs"} and not freed(out, W2)


def test_a_free_keys_says_up_to_which_claim_the_scheduler_had_read():
    """A stray of a resync is freed while its key is queued again, and its worker may
    claim the key before it reads that free-keys: the free-keys names the last workers
    stream entry read (the resync's), so the worker keeps a copy it claimed after it.
    Unstamped, the worker answered the claim from its copy, then dropped it, and the
    record named a holder that held nothing (CI's DataUnavailableError)."""
    s = make(W1, W2)
    submit(s, "c", [task("x"), task("y")], ["x", "y"])
    report = {"keys": {"x": 8}, "processing": []}  # its claim of x went with Redis
    out = s.handle_stimulus(AddWorker(worker=W1, resync=report, stimulus_id="workers:9-1/0"))
    [free] = [i.msg for i in of(out, WorkerMsg) if i.msg.op == "free-keys"]
    assert (free.keys, free.seen) == (["x"], "9-1")
    # from the clients stream: still what it had read of the workers stream
    out = s.handle_stimulus(ClientReleasesKeys(client="c", keys=["x"], stimulus_id="clients:5-0/0"))
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["y"], stimulus_id="workers:12-0/0"))
    out = s.handle_stimulus(CancelKeys(client="c", keys=["y"], stimulus_id="clients:6-0/0"))
    assert {i.msg.seen for i in of(out, WorkerMsg) if i.msg.op == "free-keys"} == {"12-0"}
    # reloaded: every claim up to the entry written last before the records were read
    s.seen_floor = (20, 0)
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["nothing"], stimulus_id="workers:15-0/0"))
    assert s._seen() == "20-0"


def test_the_entry_read_is_the_newest_of_a_batch_whose_entries_hold_several_messages():
    """``handle_stimulus`` parses an entry's id once for all its messages: the newest
    entry of a batch still counts, the next one's id sharing the last one's digits too."""
    s = make(W1)
    claims = [("workers:21-0/0", ["a"]), ("workers:21-0/1", ["b"]), ("workers:21-1/0", ["c"]),
              ("workers:210-0/0", ["d"]), ("workers:210-0/1", ["e"])]  # fmt: skip
    s.handle_stimulus(*(TaskClaimed(worker=W1, keys=k, stimulus_id=sid) for sid, k in claims))
    assert s._seen() == "210-0"


def test_a_claim_read_after_its_key_was_scattered_there_leaves_the_copy_on_record():
    """Queued x is scattered to W1 (recorded: in memory there) and claimed by W1 in the
    same moment; the claim, read after the update-data, must not free the copy on
    record: W1 holds it, and the record names it."""
    s = make(W1, W2)
    submit(s, "c", [task("x")], ["x"])
    s.handle_stimulus(UpdateData(client="c", who_has={"x": [W1]}, nbytes={"x": 8}, stimulus_id="u"))
    assert s.tasks["x"].state == "memory" and s.tasks["x"].who_has == {W1}
    score = s.tasks["x"].score
    out = s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], scores=[score], stimulus_id="c"))
    assert not freed(out) and s.tasks["x"].who_has == {W1}


# --------------------------------------------------------------------------- clients


def test_two_clients_want_the_same_key():
    s = make(W1)
    submit(s, "c1", [task("x")], ["x"])
    submit(s, "c2", [task("x")], ["x"])
    out = run(s, "x")
    assert {i.client for i in of(out, ClientMsg)} == {"c1", "c2"}
    out = s.handle_stimulus(ClientReleasesKeys(client="c1", keys=["x"], stimulus_id="r1"))
    assert s.tasks["x"].state == "memory" and s.tasks["x"].who_wants == {"c2"}
    assert not freed(out)
    out = s.handle_stimulus(ClientReleasesKeys(client="c2", keys=["x"], stimulus_id="r2"))
    assert "x" not in s.tasks and freed(out, W1) == {"x"}


def test_releasing_a_key_one_does_not_want_is_a_no_op():
    s = make(W1)
    submit(s, "c1", [task("x")], ["x"])
    out = s.handle_stimulus(ClientReleasesKeys(client="c2", keys=["x", "nope"], stimulus_id="r"))
    assert out == [] and s.tasks["x"].state == "queued"


def test_close_client_releases_all_its_keys():
    s = make(W1)
    submit(s, "c1", [task("x"), task("y"), task("z", ["x"])], ["y", "z"])
    submit(s, "c2", [task("y")], ["y"])
    run(s, "x")
    run(s, "y")
    out = s.handle_stimulus(CloseClient(client="c1", stimulus_id="close"))
    assert "c1" not in s.clients
    assert set(s.tasks) == {"y"} and s.tasks["y"].who_wants == {"c2"}
    assert {d.key for d in of(out, Dequeue)} == {"z"}
    assert any(
        getattr(i, "client", None) == "c1" and type(i).__name__ == "ForgetClient" for i in out
    )


# --------------------------------------------------------------------------- holders

FAF = "holder:fire-and-forget"
DATASET = "holder:dataset:ds"


def forgot_client(instructions: list[Instruction]) -> list[str]:
    return [i.client for i in of(instructions, ForgetClient)]


def told(instructions: list[Instruction]) -> set[str]:
    """The clients whose events streams the translated instructions write to (a holder's
    messages are dropped there: it is no process, nobody would read them)."""
    from redisdask.scheduler.translator import Translator
    from redisdask.store.keyspace import Keys

    keys = Keys("c")
    streams = {c[1] for c in Translator(keys).to_commands(instructions) if c[0] == "XADD"}
    return {
        i.client for i in of(instructions, ClientMsg) if keys.client_events(i.client) in streams
    }


def test_fire_and_forget_runs_a_task_nobody_wants_then_releases_its_result():
    """As in Dask: the client closes right after ``fire_and_forget``; the task runs to the
    end, and its result is released when it is in memory."""
    s = make(W1)
    submit(s, "c", [task("x")], ["x"])
    s.handle_stimulus(
        ClientDesiresKeys(client=FAF, keys=["x"], stimulus_id="faf"),
        CloseClient(client="c", stimulus_id="close"),
    )
    assert s.tasks["x"].state == "queued" and s.tasks["x"].who_wants == {FAF}
    out = run(s, "x")
    assert "x" not in s.tasks and FAF not in s.clients
    assert freed(out, W1) == {"x"}  # the result went as soon as it was there
    assert not told(out)  # a holder gets no messages: nobody would read them
    assert forgot_client(out) == [FAF]


def test_fire_and_forget_of_a_task_that_errs_releases_it_too():
    s = make(W1)
    submit(s, "c", [task("x")], ["x"])
    s.handle_stimulus(
        ClientDesiresKeys(client=FAF, keys=["x"], stimulus_id="faf"),
        ClientReleasesKeys(client="c", keys=["x"], stimulus_id="rel"),
    )
    out = fail(s, "x")
    assert "x" not in s.tasks and FAF not in s.clients
    assert not told(out) and forgot_client(out) == [FAF]


def test_fire_and_forget_of_a_finished_task_keeps_nothing():
    s = make(W1)
    submit(s, "c", [task("x")], ["x"])
    run(s, "x")
    out = s.handle_stimulus(ClientDesiresKeys(client=FAF, keys=["x"], stimulus_id="faf"))
    assert s.tasks["x"].who_wants == {"c"} and FAF not in s.clients
    assert not of(out, SetWants) and not told(out)


def test_fire_and_forget_keeps_a_result_another_client_wants():
    s = make(W1)
    submit(s, "c", [task("x")], ["x"])
    s.handle_stimulus(ClientDesiresKeys(client=FAF, keys=["x"], stimulus_id="faf"))
    run(s, "x")
    assert s.tasks["x"].state == "memory" and s.tasks["x"].who_wants == {"c"}


def test_a_holder_keeps_a_key_after_its_client_left_until_it_lets_go():
    """Publish, then release: both on the clients stream, in order, so the key is never
    unwanted in between; a getter adds its own want; unpublishing releases the rest."""
    s = make(W1)
    submit(s, "a", [task("x")], ["x"])
    run(s, "x")
    out = s.handle_stimulus(
        ClientDesiresKeys(client=DATASET, keys=["x"], stimulus_id="publish"),
        ClientReleasesKeys(client="a", keys=["x"], stimulus_id="rel"),
        CloseClient(client="a", stimulus_id="close"),
    )
    assert s.tasks["x"].state == "memory" and s.tasks["x"].who_wants == {DATASET}
    assert not freed(out) and not told(out)
    assert of(out, SetWants)[0].client == DATASET and of(out, SetWants)[0].add == ["x"]
    out = s.handle_stimulus(ClientDesiresKeys(client="b", keys=["x"], stimulus_id="get"))
    assert client_msgs(out, "key-in-memory", "b")  # the getter hears of it at once
    out = s.handle_stimulus(ClientReleasesKeys(client=DATASET, keys=["x"], stimulus_id="unpub"))
    assert DATASET not in s.clients and forgot_client(out) == [DATASET]
    assert s.tasks["x"].who_wants == {"b"}
    out = s.handle_stimulus(ClientReleasesKeys(client="b", keys=["x"], stimulus_id="rel-b"))
    assert "x" not in s.tasks and freed(out, W1) == {"x"}


def test_a_holder_that_wants_only_unknown_keys_is_not_kept():
    s = make(W1)
    out = s.handle_stimulus(ClientDesiresKeys(client=DATASET, keys=["gone"], stimulus_id="d"))
    assert DATASET not in s.clients and not out


def test_a_restart_drops_the_holders_with_the_tasks():
    s = make(W1)
    submit(s, "a", [task("x")], ["x"])
    s.handle_stimulus(ClientDesiresKeys(client=DATASET, keys=["x"], stimulus_id="d"))
    out = s.handle_stimulus(Restart(client="a", stimulus_id="restart"))
    assert set(s.clients) == {"a"}
    assert told(out) == {"a"}


def test_holders_are_never_sent_events_and_are_restored_from_their_own_set():
    """The translation: a holder's wants go to its wants set and its id to ``holders``;
    messages to it are dropped (no events stream appears); its end removes it there."""
    from redisdask.scheduler.translator import Translator
    from redisdask.store.keyspace import Keys

    keys = Keys("c")
    s = make(W1)
    submit(s, "a", [task("x")], ["x"])
    out = s.handle_stimulus(ClientDesiresKeys(client=FAF, keys=["x"], stimulus_id="d"))
    out += run(s, "x")
    cmds = Translator(keys).to_commands(out)
    assert ["SADD", keys.holders, FAF] in cmds
    assert ["SREM", keys.holders, FAF] in cmds
    assert not [c for c in cmds if keys.client_events(FAF) in c and c[0] != "DEL"]
    assert not [c for c in cmds if c[0] == "HDEL" and c[1] == keys.clients]
    assert any(c[0] == "XADD" and c[1] == keys.client_events("a") for c in cmds)


# --------------------------------------------------------------------------- cancel


def test_cancel_queued_task():
    s = make(W1)
    submit(s, "c", [task("x")], ["x"])
    out = s.handle_stimulus(CancelKeys(client="c", keys=["x"], stimulus_id="cx"))
    assert [d.key for d in of(out, Dequeue)] == ["x"]
    assert client_msgs(out, "cancelled-keys", "c") == [
        {"op": "cancelled-keys", "keys": ["x"], "generation": 0}
    ]
    assert "x" not in s.tasks
    # the claim that was already in flight is answered with unclaim + free-keys
    out = s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id="late"))
    assert [(u.worker, u.key) for u in of(out, Unclaim)] == [(W1, "x")]
    assert freed(out, W1) == {"x"}


def test_cancel_processing_task():
    s = make(W1)
    submit(s, "c", [task("x")], ["x"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id="claim"))
    out = s.handle_stimulus(CancelKeys(client="c", keys=["x"], stimulus_id="cx"))
    assert freed(out, W1) == {"x"}
    assert [(u.worker, u.key) for u in of(out, Unclaim)] == [(W1, "x")]
    assert "x" not in s.tasks and not s.workers[W1].processing
    # its late result is dropped
    out = s.handle_stimulus(TaskFinished(worker=W1, key="x", nbytes=1, stimulus_id="fin"))
    assert freed(out, W1) == {"x"} and "x" not in s.tasks


def test_cancel_cascades_to_the_clients_dependents():
    s = make(W1)
    submit(s, "c", [task("a"), task("b", ["a"]), task("other")], ["a", "b", "other"])
    out = s.handle_stimulus(CancelKeys(client="c", keys=["a"], stimulus_id="cx"))
    assert set(client_msgs(out, "cancelled-keys", "c")[0]["keys"]) == {"a", "b"}
    assert set(s.tasks) == {"other"}


def test_cancel_keeps_a_key_another_client_wants():
    s = make(W1)
    submit(s, "c1", [task("x")], ["x"])
    submit(s, "c2", [task("x")], ["x"])
    out = s.handle_stimulus(CancelKeys(client="c1", keys=["x"], stimulus_id="cx"))
    assert s.tasks["x"].state == "queued" and not of(out, Dequeue)


# --------------------------------------------------------------------------- claims


def test_claim_for_released_or_unknown_task_is_refused():
    s = make(W1)
    submit(s, "c", [task("a"), task("b", ["a"])], ["b"])
    out = s.handle_stimulus(TaskClaimed(worker=W1, keys=["b", "ghost"], stimulus_id="claim"))
    assert {(u.worker, u.key) for u in of(out, Unclaim)} == {(W1, "b"), (W1, "ghost")}
    assert freed(out, W1) == {"b", "ghost"}
    assert s.tasks["b"].state == "waiting"


def test_claim_by_a_worker_removed_meanwhile_puts_the_task_back():
    """The claim script popped x from the ready set before the remove-worker event (earlier
    in the stream) was applied: x must go back to the ready set, not stay lost."""
    s = make(W1, W2)
    submit(s, "c", [task("x")], ["x"])
    s.handle_stimulus(RemoveWorker(worker=W2, stimulus_id="rm"))
    out = s.handle_stimulus(TaskClaimed(worker=W2, keys=["x"], stimulus_id="claim"))
    assert [(u.worker, u.key) for u in of(out, Unclaim)] == [(W2, "x")]
    assert freed(out, W2) == {"x"}
    assert s.tasks["x"].state == "queued"
    assert net_ready(out) == {"x": s.tasks["x"].score}
    assert any(isinstance(i, SetState) and i.state == "queued" for i in out)
    run(s, "x", W1)


# --------------------------------------------------------------------------- scatter


def test_update_data_scatter_and_dependent_runs():
    s = make(W1, W2)
    out = s.handle_stimulus(
        UpdateData(
            client="c",
            who_has={"d": [W2]},
            nbytes={"d": 100},
            types={"d": "list"},
            stimulus_id="sc",
        )
    )
    ts = s.tasks["d"]
    assert ts.state == "memory" and ts.who_has == {W2} and ts.nbytes == 100
    assert ts in s.workers[W2].has_what and ts.who_wants == {"c"}
    assert not ts.has_spec
    (store,) = of(out, StoreTask)
    assert store.spec is None
    assert client_msgs(out, "key-in-memory", "c")[0]["who_has"] == [W2]

    out = submit(s, "c", [task("f", ["d"])], ["f"])
    assert s.tasks["f"].state == "queued" and [e.key for e in of(out, Enqueue)] == ["f"]
    run(s, "f", W1)
    assert s.tasks["f"].state == "memory"
    assert s.tasks["d"].state == "memory"  # still wanted by the client
    s.handle_stimulus(ClientReleasesKeys(client="c", keys=["d", "f"], stimulus_id="r"))
    assert s.tasks == {}


def test_scattered_again_after_a_release_the_holder_hears_free_keys_then_keys_recorded():
    """The new copy reached the worker over TCP before this update-data; the free-keys
    for the released copy may reach it later.  keys-recorded, after that free-keys in the
    worker's inbox, tells it which free-keys were about older copies (issue 10, item 11)."""
    s = make(W1, W2)
    scatter = {"who_has": {"d": [W1]}, "nbytes": {"d": 8}, "types": {"d": "int"}}
    out = s.handle_stimulus(UpdateData(client="c", **scatter, stimulus_id="sc1"))
    assert [(i.worker, i.msg.to_dict()) for i in of(out, WorkerMsg)] == [
        (W1, {"op": "keys-recorded", "keys": ["d"]})
    ]
    out = s.handle_stimulus(
        ClientReleasesKeys(client="c", keys=["d"], stimulus_id="rel"),
        UpdateData(client="c", **scatter, stimulus_id="sc2"),
    )
    assert [(i.worker, i.msg.op, i.msg.keys) for i in of(out, WorkerMsg)] == [
        (W1, "free-keys", ["d"]),
        (W1, "keys-recorded", ["d"]),
    ]
    assert s.tasks["d"].state == "memory" and s.tasks["d"].who_has == {W1}
    # a holder that is not registered (gone meanwhile) is told nothing
    out = s.handle_stimulus(
        UpdateData(client="c", who_has={"e": [W2, W3]}, nbytes={}, types={}, stimulus_id="sc3")
    )
    assert [(i.worker, i.msg.to_dict()) for i in of(out, WorkerMsg)] == [
        (W2, {"op": "keys-recorded", "keys": ["e"]})
    ]


def test_scatter_wakes_a_waiting_dependent():
    s = make(W1)
    out = submit(s, "c", [task("f", ["d"])], ["f"])
    # d was neither submitted nor held: f errs with a clear message
    assert s.tasks["f"].state == "erred"
    (msg,) = client_msgs(out, "task-erred", "c")
    assert msg["exception_blame"] == "d"
    assert "'d'" in msg["exception_text"] and "not on any worker" in msg["exception_text"]
    assert "DataUnavailableError" in msg["exception_text"]


def test_dependency_missing_in_the_same_graph():
    s = make(W1)
    submit(s, "c", [task("a"), task("b", ["a", "ghost"])], ["b"])
    assert s.tasks["b"].state == "erred" and s.tasks["b"].exception_blame == "ghost"
    assert "ghost" in s.tasks["b"].exception_text
    assert s.tasks["a"].state != "queued" or s.tasks["a"].waiters == set()
    s.handle_stimulus(ClientReleasesKeys(client="c", keys=["b"], stimulus_id="r"))
    assert s.tasks == {}


# --------------------------------------------------------------------------- workers


def test_remove_worker_requeues_its_processing_tasks():
    s = make(W1, W2)
    submit(s, "c", [task("x"), task("y")], ["x", "y"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x", "y"], stimulus_id="claim"))
    out = s.handle_stimulus(RemoveWorker(worker=W1, reason="heartbeat", stimulus_id="rm"))
    assert states(s) == {"x": "queued", "y": "queued"}
    assert {e.key for e in of(out, Enqueue)} == {"x", "y"}
    assert {(u.worker, u.key) for u in of(out, Unclaim)} == {(W1, "x"), (W1, "y")}
    assert W1 not in s.workers
    run(s, "x", W2)
    assert s.tasks["x"].who_has == {W2}


def test_remove_worker_recomputes_lost_wanted_data():
    s = make(W1, W2)
    submit(s, "c", [task("x"), task("y")], ["x", "y"])
    run(s, "x", W1)
    run(s, "y", W2)
    s.handle_stimulus(AddKeys(worker=W2, keys=["x"], stimulus_id="ak"))  # a replica of x on W2
    out = s.handle_stimulus(RemoveWorker(worker=W2, stimulus_id="rm"))
    assert s.tasks["x"].state == "memory" and s.tasks["x"].who_has == {W1}
    assert s.tasks["y"].state == "queued" and [e.key for e in of(out, Enqueue)] == ["y"]


def test_remove_worker_requeues_processing_task_whose_dependency_was_lost_there():
    s = make(W1, W2)
    submit(s, "c", [task("a"), task("b", ["a"])], ["b"])
    run(s, "a", W1)
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["b"], stimulus_id="claim"))
    out = s.handle_stimulus(RemoveWorker(worker=W1, stimulus_id="rm"))
    # a's only copy was on W1: recompute a, b waits for it again
    assert states(s) == {"a": "queued", "b": "waiting"}
    assert net_ready(out) == {"a": s.tasks["a"].score, "b": None}
    run(s, "a", W2)
    run(s, "b", W2)
    assert s.tasks["b"].state == "memory"


def test_remove_worker_sends_queued_dependent_back_to_waiting():
    s = make(W1, W2)
    submit(s, "c", [task("a"), task("b", ["a"])], ["b"])
    run(s, "a", W1)
    assert s.tasks["b"].state == "queued"
    out = s.handle_stimulus(RemoveWorker(worker=W1, stimulus_id="rm"))
    assert states(s) == {"a": "queued", "b": "waiting"}
    assert [d.key for d in of(out, Dequeue)] == ["b"]
    # a claim of b that raced with the removal is refused
    out = s.handle_stimulus(TaskClaimed(worker=W2, keys=["b"], stimulus_id="claim"))
    assert freed(out, W2) == {"b"}


def test_remove_worker_updates_waiting_dependent():
    s = make(W1, W2)
    submit(s, "c", [task("a"), task("z"), task("b", ["a", "z"])], ["b"])
    run(s, "a", W1)
    assert s.tasks["b"].waiting_on == {s.tasks["z"]}
    s.handle_stimulus(RemoveWorker(worker=W1, stimulus_id="rm"))
    assert s.tasks["b"].waiting_on == {s.tasks["a"], s.tasks["z"]}
    run(s, "z", W2)
    assert s.tasks["b"].state == "waiting"
    run(s, "a", W2)
    assert s.tasks["b"].state == "queued"


def test_lost_scattered_data_errs_its_dependents_clearly():
    s = make(W1, W2)
    s.handle_stimulus(
        UpdateData(client="c", who_has={"d": [W1]}, nbytes={"d": 1}, stimulus_id="sc")
    )
    submit(s, "c", [task("z"), task("f", ["d", "z"])], ["f"])
    assert s.tasks["f"].state == "waiting"
    out = s.handle_stimulus(RemoveWorker(worker=W1, stimulus_id="rm"))
    assert s.tasks["f"].state == "erred"
    msgs = {m["key"]: m for m in client_msgs(out, "task-erred", "c")}
    assert set(msgs) == {"d", "f"}
    assert "scattered" in msgs["f"]["exception_text"] and msgs["f"]["exception_blame"] == "d"
    # z is not needed any more: dequeued
    assert s.tasks["z"].state == "released" and net_ready(out) == {"z": None}
    s.handle_stimulus(ClientReleasesKeys(client="c", keys=["f", "d"], stimulus_id="r"))
    assert s.tasks == {}


def test_remove_unknown_worker_is_a_no_op():
    s = make(W1)
    assert s.handle_stimulus(RemoveWorker(worker=W3, stimulus_id="rm")) == []


def test_finished_by_an_unknown_worker_is_dropped():
    s = make(W1)
    submit(s, "c", [task("x")], ["x"])
    out = s.handle_stimulus(TaskFinished(worker=W3, key="x", stimulus_id="fin"))
    assert freed(out, W3) == {"x"} and s.tasks["x"].state == "queued"


def test_late_result_of_a_requeued_task_is_refused():
    """A worker removed (say, by a missed heartbeat) finishes its task after all: only the
    worker that holds the current claim may report a result, so the late one is dropped
    (the worker is told to free it) and the task runs again."""
    s = make(W1, W2)
    submit(s, "c", [task("x")], ["x"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id="claim"))
    s.handle_stimulus(RemoveWorker(worker=W1, stimulus_id="rm"))
    assert s.tasks["x"].state == "queued"
    s.handle_stimulus(AddWorker(worker=W1, stimulus_id="back"))
    out = s.handle_stimulus(TaskFinished(worker=W1, key="x", nbytes=3, stimulus_id="fin"))
    assert s.tasks["x"].state == "queued" and not s.tasks["x"].who_has
    assert freed(out, W1) == {"x"}
    assert not client_msgs(out, "key-in-memory")


def test_result_of_an_earlier_incarnation_of_a_key_is_refused():
    """Cancelled while W1 ran it, submitted again, claimed by W2: W1's late result is
    not the new run's, and W1 is about to drop it (the cancel freed it)."""
    s = make(W1, W2)
    submit(s, "c", [task("x")], ["x"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id="claim"))
    s.handle_stimulus(CancelKeys(client="c", keys=["x"], stimulus_id="cancel"))
    submit(s, "c", [task("x")], ["x"])
    s.handle_stimulus(TaskClaimed(worker=W2, keys=["x"], stimulus_id="claim"))
    out = s.handle_stimulus(TaskFinished(worker=W1, key="x", nbytes=3, stimulus_id="late"))
    assert s.tasks["x"].state == "processing" and freed(out, W1) == {"x"}
    run_out = s.handle_stimulus(TaskFinished(worker=W2, key="x", nbytes=3, stimulus_id="fin"))
    assert s.tasks["x"].who_has == {W2}
    assert client_msgs(run_out, "key-in-memory", "c")


def test_late_result_while_another_worker_processes_the_task():
    s = make(W1, W2)
    submit(s, "c", [task("x")], ["x"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id="claim"))
    s.handle_stimulus(RemoveWorker(worker=W1, stimulus_id="rm"))
    s.handle_stimulus(TaskClaimed(worker=W2, keys=["x"], stimulus_id="claim"))
    s.handle_stimulus(AddWorker(worker=W1, stimulus_id="back"))
    out = s.handle_stimulus(TaskFinished(worker=W1, key="x", nbytes=3, stimulus_id="fin"))
    assert s.tasks["x"].state == "processing" and s.tasks["x"].processing_on == W2
    assert freed(out, W1) == {"x"}  # not the current claim: W1 drops its copy
    s.handle_stimulus(TaskFinished(worker=W2, key="x", nbytes=3, stimulus_id="fin2"))
    assert s.tasks["x"].state == "memory" and s.tasks["x"].who_has == {W2}


def test_missing_data_about_a_peer():
    s = make(W1, W2, W3)
    submit(s, "c", [task("a"), task("b", ["a"])], ["b"])
    run(s, "a", W1)
    s.handle_stimulus(AddKeys(worker=W2, keys=["a"], stimulus_id="ak"))
    s.handle_stimulus(TaskClaimed(worker=W3, keys=["b"], stimulus_id="claim"))
    out = s.handle_stimulus(MissingData(worker=W3, keys=["a"], errant_worker=W1, stimulus_id="md"))
    assert s.tasks["a"].who_has == {W2} and s.tasks["a"].state == "memory"
    assert s.tasks["a"] not in s.workers[W1].has_what
    (msg,) = [i for i in of(out, WorkerMsg) if i.msg.op == "who-has"]
    assert msg.worker == W3 and msg.msg.who_has == {"a": [W2]}
    # the last copy goes missing too: recompute a, and take b back from W3
    out = s.handle_stimulus(MissingData(worker=W3, keys=["a"], errant_worker=W2, stimulus_id="md2"))
    assert s.tasks["a"].state == "queued" and [e.key for e in of(out, Enqueue)] == ["a"]
    assert s.tasks["b"].state == "waiting" and freed(out, W3) == {"b"}
    run(s, "a", W1)
    assert s.tasks["b"].state == "queued"
    run(s, "b", W3)
    assert s.tasks["b"].state == "memory"


def test_missing_data_from_a_recorded_holder_drops_it_as_a_holder():
    """A worker that misses a key the scheduler counts it as holding has lost its copy.
    Answering its who-has with its own address left its dependent waiting for ever
    (the soak's hang, issue 10 item 11): it is no holder any more."""
    s = make(W1, W2)
    submit(s, "c", [task("a"), task("b", ["a"])], ["b"])
    run(s, "a", W1)
    s.handle_stimulus(AddKeys(worker=W2, keys=["a"], stimulus_id="ak"))
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["b"], stimulus_id="claim"))
    out = s.handle_stimulus(MissingData(worker=W1, keys=["a"], errant_worker="", stimulus_id="md"))
    assert s.tasks["a"].who_has == {W2} and s.tasks["a"] not in s.workers[W1].has_what
    (msg,) = [i for i in of(out, WorkerMsg) if i.msg.op == "who-has"]
    assert msg.worker == W1 and msg.msg.who_has == {"a": [W2]}
    # the only copy: a is computed again, b taken back meanwhile
    s.handle_stimulus(AddKeys(worker=W1, keys=["a"], stimulus_id="ak2"))
    s.handle_stimulus(ReleasedKeys(worker=W2, keys=["a"], stimulus_id="rk"))
    out = s.handle_stimulus(MissingData(worker=W1, keys=["a"], errant_worker="", stimulus_id="md2"))
    assert states(s) == {"a": "queued", "b": "waiting"} and freed(out, W1) == {"b"}


def test_scattered_data_its_holder_misses_errs_its_dependents_instead_of_hanging():
    s = make(W1)
    s.handle_stimulus(
        UpdateData(client="c", who_has={"d": [W1]}, nbytes={}, types={}, stimulus_id="sc")
    )
    submit(s, "c", [task("f", ["d"])], ["f"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["f"], stimulus_id="claim"))
    out = s.handle_stimulus(MissingData(worker=W1, keys=["d"], errant_worker="", stimulus_id="md"))
    assert states(s) == {"d": "erred", "f": "erred"}
    (msg,) = client_msgs(out, "task-erred", "c")[-1:]
    assert "DataUnavailableError" in msg["exception_text"]


def test_missing_data_of_the_last_copy_sends_queued_dependent_back():
    s = make(W1, W2)
    submit(s, "c", [task("a"), task("b", ["a"])], ["b"])
    run(s, "a", W1)
    s.handle_stimulus(MissingData(worker=W2, keys=["a"], errant_worker=W1, stimulus_id="md"))
    assert states(s) == {"a": "queued", "b": "waiting"}


def test_missing_data_for_unknown_key_or_non_holder_is_harmless():
    s = make(W1, W2)
    submit(s, "c", [task("a")], ["a"])
    run(s, "a", W1)
    out = s.handle_stimulus(
        MissingData(worker=W2, keys=["nope", "a"], errant_worker=W2, stimulus_id="md")
    )
    assert s.tasks["a"].who_has == {W1}
    assert all(i.msg.op == "who-has" for i in of(out, WorkerMsg))


def test_a_client_that_reached_no_holder_has_the_key_recomputed():
    """A client's fetch from every holder failed (a cut link: the holders' heartbeats go
    on).  Only the holders it names, and only while recorded, are dropped."""
    s = make(W1, W2, W3)
    submit(s, "c", [task("a")], ["a"])
    run(s, "a", W1)
    s.handle_stimulus(AddKeys(worker=W2, keys=["a"], stimulus_id="ak"))
    out = s.handle_stimulus(ClientMissingData(client="c", who_failed={"a": [W1]}, stimulus_id="m"))
    assert s.tasks["a"].state == "memory" and s.tasks["a"].who_has == {W2}
    assert freed(out, W1) == {"a"} and s.tasks["a"] not in s.workers[W1].has_what
    assert [i.fields["who_has"] for i in of(out, SetState)] == [[W2]]
    # a late or repeated word about a holder no longer recorded changes nothing
    assert not s.handle_stimulus(
        ClientMissingData(client="c", who_failed={"a": [W1, W3], "nope": [W2]}, stimulus_id="m2")
    )
    assert s.tasks["a"].who_has == {W2}
    # no holder left: computed again, and the client hears of it when it is in memory
    out = s.handle_stimulus(ClientMissingData(client="c", who_failed={"a": [W2]}, stimulus_id="m3"))
    assert s.tasks["a"].state == "queued" and [e.key for e in of(out, Enqueue)] == ["a"]
    out = run(s, "a", W3)
    assert s.tasks["a"].who_has == {W3} and client_msgs(out, "key-in-memory", "c")


def test_a_client_that_reached_no_holder_of_scattered_data_gets_a_clear_error():
    s = make(W1)
    s.handle_stimulus(UpdateData(client="c", who_has={"d": [W1]}, stimulus_id="sc"))
    out = s.handle_stimulus(ClientMissingData(client="c", who_failed={"d": [W1]}, stimulus_id="m"))
    assert states(s) == {"d": "erred"}
    (msg,) = client_msgs(out, "task-erred", "c")
    assert "scattered data whose only copy was on" in msg["exception_text"]
    assert W1 in msg["exception_text"] and "could not be reached" in msg["exception_text"]


def test_a_client_cannot_drop_the_copy_of_a_retiring_holder():
    """A retiring worker keeps its data until it has handed it on (as for missing-data)."""
    s = make(W1, W2)
    submit(s, "c", [task("a")], ["a"])
    run(s, "a", W1)
    s.handle_stimulus(RetireWorkers(client="c", workers=[W1], stimulus_id="rw"))
    out = s.handle_stimulus(ClientMissingData(client="c", who_failed={"a": [W1]}, stimulus_id="m"))
    assert s.tasks["a"].who_has == {W1} and not freed(out, W1)


def test_released_keys_from_a_worker():
    s = make(W1, W2)
    submit(s, "c", [task("a"), task("x")], ["a", "x"])
    run(s, "a", W1)
    s.handle_stimulus(AddKeys(worker=W2, keys=["a"], stimulus_id="ak"))
    s.handle_stimulus(TaskClaimed(worker=W2, keys=["x"], stimulus_id="claim"))
    out = s.handle_stimulus(ReleasedKeys(worker=W2, keys=["a", "x"], stimulus_id="rk"))
    assert s.tasks["a"].who_has == {W1}
    assert s.tasks["x"].state == "queued" and [e.key for e in of(out, Enqueue)] == ["x"]
    out = s.handle_stimulus(ReleasedKeys(worker=W1, keys=["a"], stimulus_id="rk"))
    assert s.tasks["a"].state == "queued"  # still wanted: recompute


# --------------------------------------------------------------------------- throughput


def _drive(s: SchedulerState, ready: list[tuple[float, str]], worker: str, batch: int) -> int:
    """Simulate a worker pulling ``batch`` keys at a time from the ready set."""
    done = 0
    dequeued: set[str] = set()
    while ready:
        keys = []
        while ready and len(keys) < batch:
            _, key = heapq.heappop(ready)
            if key not in dequeued:
                keys.append(key)
        events: list[Stimulus] = [TaskClaimed(worker=worker, keys=keys, stimulus_id="c")]
        events += [
            TaskFinished(worker=worker, key=k, nbytes=8, type="int", stimulus_id="f") for k in keys
        ]
        for ins in s.handle_stimulus(*events):
            if isinstance(ins, Enqueue):
                heapq.heappush(ready, (ins.score, ins.key))
            elif isinstance(ins, Dequeue):
                dequeued.add(ins.key)
        done += len(keys)
    return done


def _ready(instructions: list[Instruction]) -> list[tuple[float, str]]:
    ready = [(i.score, i.key) for i in instructions if isinstance(i, Enqueue)]
    heapq.heapify(ready)
    return ready


@pytest.mark.timeout(30)
def test_throughput_map_10000():
    n = 10_000
    s = SchedulerState(validate=False)
    t0 = time.perf_counter()
    s.handle_stimulus(AddWorker(worker=W1, stimulus_id="w"))
    out = submit(s, "c", [task(f"m{i}") for i in range(n)], [f"m{i}" for i in range(n)])
    done = _drive(s, _ready(out), W1, batch=100)
    s.handle_stimulus(
        ClientReleasesKeys(client="c", keys=[f"m{i}" for i in range(n)], stimulus_id="r")
    )
    elapsed = time.perf_counter() - t0
    print(f"\nmap: {n} tasks, {elapsed * 1e6 / n:.1f} µs per task")
    assert done == n and s.tasks == {}
    # a bound that catches work growing with the square of the tasks (minutes), not a
    # speed assertion: a loaded 2-core machine is 5x slower (bench/ measures speed)
    assert elapsed < 20.0


@pytest.mark.timeout(30)
def test_throughput_tree_reduction_4096():
    leaves = 4096
    tasks = [task(f"l0-{i}") for i in range(leaves)]
    level, width = 0, leaves
    while width > 1:
        tasks += [
            task(f"l{level + 1}-{i}", [f"l{level}-{2 * i}", f"l{level}-{2 * i + 1}"])
            for i in range(width // 2)
        ]
        level, width = level + 1, width // 2
    root = f"l{level}-0"
    s = SchedulerState(validate=False)
    t0 = time.perf_counter()
    s.handle_stimulus(AddWorker(worker=W1, stimulus_id="w"))
    out = submit(s, "c", tasks, [root])
    done = _drive(s, _ready(out), W1, batch=64)
    elapsed = time.perf_counter() - t0
    print(f"\ntree: {len(tasks)} tasks, {elapsed * 1e6 / len(tasks):.1f} µs per task")
    assert done == len(tasks) == 2 * leaves - 1
    assert s.tasks[root].state == "memory"
    assert sum(ts.state == "memory" for ts in s.tasks.values()) == 1  # the rest released
    # a bound that catches work growing with the square of the tasks (minutes), not a
    # speed assertion: a loaded 2-core machine is 5x slower (bench/ measures speed)
    assert elapsed < 20.0
    s.validate_state()


# --------------------------------------------------------------------------- protocol


def test_accepted_messages_never_crash_the_machine():
    """Whatever from_dict accepts, handle_stimulus must survive (messages from strangers)."""
    s = make(W1)
    for msg in [
        {"op": "update-graph", "client": "c", "tasks": [{"key": "x"}], "wanted": ["x", "nope"]},
        {"op": "claimed", "worker": W1, "keys": ["x", "x"]},
        {"op": "task-finished", "worker": W1, "key": "nope"},
        {"op": "task-erred", "worker": W2, "key": "x"},
        {"op": "client-releases-keys", "client": "ghost", "keys": ["x"]},
        {"op": "cancel-keys", "client": "ghost", "keys": ["nope"]},
        {"op": "close-client", "client": "ghost"},
        {"op": "missing-data", "worker": W1, "keys": ["nope"]},
        {"op": "released-keys", "worker": W2, "keys": ["x"]},
        {"op": "add-keys", "worker": W2, "keys": ["x"]},
        {"op": "remove-worker", "worker": W2},
    ]:
        s.handle_stimulus(Stimulus.from_dict(msg))


# --------------------------------------------------------------------------- randomized


class Model:
    """What Redis would hold: the ready sets (shared and per worker), each restricted
    task's ``queued_on`` field and each worker's processing set."""

    def __init__(self) -> None:
        self.ready: dict[str, float] = {}
        self.worker_ready: dict[str, dict[str, float]] = {}
        self.queued_on: dict[str, tuple[str, ...]] = {}
        self.processing: dict[str, set[str]] = {}

    def apply(self, instructions: list[Instruction]) -> None:
        for ins in instructions:
            if isinstance(ins, Enqueue):
                if ins.queued_on:
                    self.queued_on[ins.key] = ins.queued_on
                for w in ins.workers:
                    self.worker_ready.setdefault(w, {})[ins.key] = ins.score
                if not ins.workers:
                    self.ready[ins.key] = ins.score
            elif isinstance(ins, Dequeue):
                self.ready.pop(ins.key, None)
                for w in ins.workers:
                    self.worker_ready.get(w, {}).pop(ins.key, None)
            elif isinstance(ins, Unclaim):
                self.processing.get(ins.worker, set()).discard(ins.key)
            elif isinstance(ins, ForgetWorker):
                self.worker_ready.pop(ins.worker, None)

    def claim(self, s: SchedulerState, worker: str, n: int) -> list[str]:
        """As the CLAIM script: its own ready set first, stale entries dropped, a claimed
        key taken out of the other ready sets its ``queued_on`` names."""
        if worker not in s.workers:  # the claim script refuses unregistered workers
            return []
        keys: list[str] = []
        for zset in (self.worker_ready.get(worker, {}), self.ready):
            while zset and len(keys) < n:
                key = min(zset, key=zset.__getitem__)
                del zset[key]
                ts = s.tasks.get(key)
                if ts is None or ts.state != "queued" or key in keys:
                    continue  # stale
                keys.append(key)
                for other in self.queued_on.get(key, ()):
                    if other != worker:
                        self.worker_ready.get(other, {}).pop(key, None)
        self.processing.setdefault(worker, set()).update(keys)
        return keys

    def has_work(self) -> bool:
        return bool(self.ready) or any(self.worker_ready.values())


def _random_events(rng: random.Random, s: SchedulerState, model: Model, step: int):
    workers = [W1, W2, W3]
    clients = ["c1", "c2"]
    keys = [f"k{i}" for i in range(12)]
    sid = f"r{step}"
    r = rng.random()
    known = list(s.tasks)
    if rng.random() < 0.05:  # a worker's holding report, listing some of its claims
        w = rng.choice(workers)
        mine = sorted(t.key for t in s.workers[w].processing) if w in s.workers else []
        return Holding(worker=w, keys=rng.sample(mine, rng.randint(0, len(mine))), stimulus_id=sid)
    if r < 0.15:
        n = rng.randint(1, 4)
        new = rng.sample(keys, n)
        tasks = []
        for i, k in enumerate(new):
            # now and then a dependency on k0 or k1 or the task itself: a cycle
            pool = [x for x in keys if x < k] if rng.random() < 0.9 else [*keys[:2], k]
            deps = rng.sample(pool, min(len(pool), rng.randint(0, 2)))
            extra: dict[str, Any] = {}
            if rng.random() < 0.2:  # a restriction by address, name or host
                extra["workers"] = rng.sample(RESTRICTIONS, rng.randint(1, 2))
            priority, retries = rng.choice([0, 0, 1]), rng.randint(0, 1)
            tasks.append(task(k, deps, priority=priority, retries=retries, **extra))
            del i
        wanted = rng.sample(new, rng.randint(1, n))
        return UpdateGraph(client=rng.choice(clients), tasks=tasks, wanted=wanted, stimulus_id=sid)
    if r < 0.20:
        return ClientDesiresKeys(
            client=rng.choice(clients), keys=rng.sample(keys, 2), stimulus_id=sid
        )
    if r < 0.27:
        return ClientReleasesKeys(
            client=rng.choice(clients), keys=rng.sample(keys, 2), stimulus_id=sid
        )
    if r < 0.30:
        return CancelKeys(client=rng.choice(clients), keys=rng.sample(keys, 1), stimulus_id=sid)
    if r < 0.31:
        return CloseClient(client=rng.choice(clients), stimulus_id=sid)
    if r < 0.34:
        return add_named(sid, rng.choice(workers))
    if r < 0.37:
        return RemoveWorker(worker=rng.choice(workers), reason="random", stimulus_id=sid)
    if r < 0.39:
        k = rng.choice(keys[8:])
        return UpdateData(
            client=rng.choice(clients), who_has={k: [rng.choice(workers)]}, stimulus_id=sid
        )
    if r < 0.55:
        w = rng.choice(workers)
        return TaskClaimed(worker=w, keys=model.claim(s, w, rng.randint(1, 3)), stimulus_id=sid)
    processing = [ts for ts in s.tasks.values() if ts.state == "processing"]
    if r < 0.80 and processing:
        ts = rng.choice(processing)
        w = ts.processing_on if rng.random() < 0.9 else rng.choice(workers)
        if rng.random() < 0.8:
            return TaskFinished(worker=w, key=ts.key, nbytes=rng.randint(1, 100), stimulus_id=sid)
        return TaskErred(worker=w, key=ts.key, exception=b"e", exception_text="E", stimulus_id=sid)
    if r < 0.88 and known:
        k = rng.choice(known)
        ts = s.tasks[k]
        holders = sorted(ts.who_has) or workers
        return MissingData(
            worker=rng.choice(workers), keys=[k], errant_worker=rng.choice(holders), stimulus_id=sid
        )
    if r < 0.93 and known:
        k = rng.choice(known)
        holders = sorted(s.tasks[k].who_has) or workers
        return AddKeys(worker=rng.choice(workers), keys=[k], stimulus_id=sid)
    if known:
        k = rng.choice(known)
        ts = s.tasks[k]
        w = rng.choice(sorted(ts.who_has) or [ts.processing_on or rng.choice(workers)])
        return ReleasedKeys(worker=w, keys=[k], stimulus_id=sid)
    return add_named(sid, rng.choice(workers))


# restrictions the random graphs use: W1 by address, W2 by name, W3 by host
RESTRICTIONS = [W1, "name-2", "10.0.0.3"]


def add_named(sid: str, worker: str) -> AddWorker:
    """A worker joins with a name: ``name-2`` for ``tcp://10.0.0.2:8000``."""
    return AddWorker(
        worker=worker, info={"name": f"name-{worker.split('.')[-1][0]}"}, stimulus_id=sid
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(20))
def test_randomized(seed):
    rng = random.Random(seed)
    s = SchedulerState(validate=True)
    model = Model()
    for step in range(400):
        ev = _random_events(rng, s, model, step)
        try:
            model.apply(s.handle_stimulus(ev))
            # Redis' ready sets and processing sets agree with the machine
            queued = {k for k, ts in s.tasks.items() if ts.state == "queued"}
            claimable = set(model.ready) | {
                k for w in s.workers for k in model.worker_ready.get(w, {})
            }
            assert set(model.ready) <= queued, set(model.ready) - queued
            assert queued <= claimable, queued - claimable
            for w, ws in s.workers.items():
                assert model.processing.get(w, set()) >= {t.key for t in ws.processing}
        except Exception as exc:
            raise AssertionError(f"seed={seed} step={step} event={ev!r}: {exc!r}") from exc
    # drain: keep the workers busy until nothing is left to run
    for step in range(400, 2000):
        for w in (W1, W2, W3):
            if w not in s.workers:
                model.apply(s.handle_stimulus(add_named(f"a{step}", w)))
            ev = TaskClaimed(worker=w, keys=model.claim(s, w, 4), stimulus_id=f"d{step}")
            model.apply(s.handle_stimulus(ev))
        evs = [
            TaskFinished(worker=ts.processing_on, key=ts.key, nbytes=1, stimulus_id=f"d{step}")
            for ts in s.tasks.values()
            if ts.state == "processing" and ts.processing_on is not None
        ]
        model.apply(s.handle_stimulus(*evs))
        if not model.has_work() and not any(ts.state == "processing" for ts in s.tasks.values()):
            break
    pending = {k: ts.state for k, ts in s.tasks.items() if ts.state in ("waiting", "queued")}
    assert not pending, f"seed={seed}: stuck tasks {pending}"
    for client in list(s.clients):
        s.handle_stimulus(CloseClient(client=client, stimulus_id="bye"))
    assert s.tasks == {} or all(
        ts.state == "released" and not ts.has_spec for ts in s.tasks.values()
    ), f"seed={seed}: left over {states(s)}"


def test_submitted_task_nobody_needs_is_forgotten():
    s = make(W1)
    out = submit(s, "c", [task("a"), task("b", ["a"]), task("orphan")], ["b"])
    assert "orphan" not in s.tasks and "orphan" in {f.key for f in of(out, Forget)}
    assert states(s) == {"a": "queued", "b": "waiting"}


def test_scatter_over_a_processing_task_replaces_its_run():
    s = make(W1, W2)
    submit(s, "c", [task("x"), task("y")], ["x", "y"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id="claim"))
    out = s.handle_stimulus(
        UpdateData(client="c", who_has={"x": [W2], "y": [W2]}, stimulus_id="sc")
    )
    assert states(s) == {"x": "memory", "y": "memory"}
    assert not s.workers[W1].processing and freed(out, W1) == {"x"}
    assert net_ready(out) == {"y": None}


# --------------------------------------------------------------------------- review fixes


def test_lost_dependency_takes_back_a_dependent_another_worker_claimed():
    """x in memory on W1; y claimed by W3, which cannot fetch x: y must not hang."""
    s = make(W1, W2, W3)
    submit(s, "c", [task("x"), task("y", ["x"])], ["y"])
    run(s, "x", W1)
    s.handle_stimulus(TaskClaimed(worker=W3, keys=["y"], stimulus_id="claim"))
    out = s.handle_stimulus(MissingData(worker=W3, keys=["x"], errant_worker=W1, stimulus_id="md"))
    assert states(s) == {"x": "queued", "y": "waiting"}
    assert freed(out, W3) == {"y"}  # W3 drops its claim on y
    assert freed(out, W1) == {"x"}  # W1 is no longer a holder: no orphan copy
    assert Unclaim("md", W3, "y") in out
    run(s, "x", W2)
    assert states(s) == {"x": "memory", "y": "queued"}
    run(s, "y", W2)
    assert s.tasks["y"].state == "memory"


def test_restricted_tasks_go_only_to_live_allowed_workers():
    s = make(W1)
    out = submit(s, "c", [task("x", workers=[W1, W2])], ["x"])
    [enqueue] = of(out, Enqueue)
    assert enqueue.workers == (W1,)  # W2 is not registered: no zset that leaks


def named(*workers: tuple[str, str, str]) -> SchedulerState:
    """Workers given as (address, name, hostname)."""
    s = SchedulerState(validate=True)
    for address, name, host in workers:
        s.handle_stimulus(
            AddWorker(worker=address, info={"name": name, "host": host}, stimulus_id=f"add-{name}")
        )
    return s


W1_AGAIN = "tcp://10.0.0.1:9000"  # another worker on W1's host


def test_a_restriction_names_workers_by_address_name_or_host():
    s = named((W1, "alice", "box-1"), (W1_AGAIN, "carol", "box-1"), (W2, "bob", "box-2"))
    cases = {
        "by-address": ([W2], (W2,)),
        "by-name": (["bob"], (W2,)),
        "by-address-host": (["10.0.0.1"], (W1, W1_AGAIN)),
        "by-hostname": (["box-1"], (W1, W1_AGAIN)),
        "mixed": (["alice", "box-2"], (W1, W2)),
    }
    for key, (restriction, expected) in cases.items():
        out = submit(s, "c", [task(key, workers=restriction)], [key])
        [enqueue] = of(out, Enqueue)
        assert (enqueue.workers, enqueue.queued_on) == (expected, expected), key
        assert s.tasks[key].state == "queued"
    # taken out of the ready sets by address, whatever the restriction said
    out = s.handle_stimulus(
        CancelKeys(client="c", keys=["by-name", "by-hostname"], stimulus_id="cx")
    )
    assert sorted((d.key, d.workers) for d in of(out, Dequeue)) == [
        ("by-hostname", (W1, W1_AGAIN)),
        ("by-name", (W2,)),
    ]


def test_a_restricted_task_waits_for_a_matching_worker_and_is_queued_on_each_that_joins():
    s = named((W2, "bob", "box-2"))
    submit(s, "c", [task("x", workers=["alice", "box-1"])], ["x"])
    assert s.tasks["x"].state == "no-worker"
    out = s.handle_stimulus(
        AddWorker(worker=W1, info={"name": "alice", "host": "box-1"}, stimulus_id="a")
    )
    assert s.tasks["x"].state == "queued" and [e.workers for e in of(out, Enqueue)] == [(W1,)]
    # another worker on box-1 joins: x goes into its ready set too, and the task hash
    # names both sets for the claim script
    info = {"name": "carol", "host": "box-1"}
    out = s.handle_stimulus(AddWorker(worker=W1_AGAIN, info=info, stimulus_id="a2"))
    [enqueue] = of(out, Enqueue)
    assert (enqueue.workers, enqueue.queued_on) == ((W1_AGAIN,), (W1, W1_AGAIN))
    assert not of(out, SetState)  # still queued: no new state, no story line
    # a worker that does not match changes nothing
    assert not of(
        s.handle_stimulus(AddWorker(worker=W3, info={"name": "dan"}, stimulus_id="a3")), Enqueue
    )
    out = s.handle_stimulus(RemoveWorker(worker=W1, how="connection", reason="x", stimulus_id="rm"))
    assert s.tasks["x"].state == "queued" and s.tasks["x"].queued_on == (W1_AGAIN,)
    assert [(d.key, d.workers) for d in of(out, Dequeue)] == [("x", (W1,))]
    out = s.handle_stimulus(RemoveWorker(worker=W1_AGAIN, reason="bye", stimulus_id="rm2"))
    assert s.tasks["x"].state == "no-worker"
    assert [(d.key, d.workers) for d in of(out, Dequeue)] == [("x", (W1_AGAIN,)), ("x", ())]
    # a new process at a dead worker's address inherits its ready set, not its tasks
    s.handle_stimulus(
        AddWorker(worker=W2, info={"name": "alice", "started": 1.0}, stimulus_id="a5")
    )
    assert s.tasks["x"].queued_on == (W2,)
    out = s.handle_stimulus(
        AddWorker(worker=W2, info={"name": "eve", "started": 2.0}, stimulus_id="a6")
    )
    assert s.tasks["x"].state == "no-worker" and ("x", (W2,)) in [
        (d.key, d.workers) for d in of(out, Dequeue)
    ]
    assert not of(out, Enqueue)
    s.handle_stimulus(AddWorker(worker=W1, info={"name": "alice"}, stimulus_id="a4"))
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id="claim"))
    assert s.tasks["x"].state == "processing" and s.tasks["x"].queued_on == ()


def test_a_restriction_must_be_a_list_of_str():
    with pytest.raises(ProtocolError, match="'workers' should be a list of str"):
        Stimulus.from_dict(
            {"op": "update-graph", "client": "c", "tasks": [{"key": "x", "workers": 5}]}
        )


def test_no_worker_task_keeps_its_dependencies():
    s = make(W1)
    submit(s, "c", [task("x"), task("y", ["x"], workers=[W2])], ["x", "y"])
    run(s, "x", W1)
    assert s.tasks["y"].state == "no-worker"
    s.handle_stimulus(ClientReleasesKeys(client="c", keys=["x"], stimulus_id="rel"))
    assert s.tasks["x"].state == "memory"  # y still needs it
    s.handle_stimulus(AddWorker(worker=W2, stimulus_id="add"))
    assert s.tasks["y"].state == "queued"


def test_a_new_process_at_a_dead_workers_address_replaces_it():
    """A killed worker's port reused by a restarted worker before the death was noticed."""
    s = make()
    s.handle_stimulus(AddWorker(worker=W1, info={"started": 1.0, "name": "old"}, stimulus_id="a1"))
    s.handle_stimulus(AddWorker(worker=W2, info={"started": 1.0}, stimulus_id="a2"))
    submit(s, "c", [task("x"), task("y")], ["x", "y"])
    run(s, "x", W1)
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["y"], stimulus_id="claim"))
    out = s.handle_stimulus(
        AddWorker(worker=W1, info={"started": 2.0, "name": "new"}, stimulus_id="again")
    )
    assert states(s) == {"x": "queued", "y": "queued"}  # both redone
    assert s.tasks["y"].suspicious == 1
    assert s.workers[W1].info["name"] == "new" and not s.workers[W1].processing
    [death] = [i for i in out if type(i).__name__ == "RecordDeath"]
    assert death.record["how"] == "replaced" and death.record["name"] == "old"


def test_replicate_asks_the_least_loaded_workers_and_restores_copies_after_a_loss():
    s = make(W1, W2, W3)
    submit(s, "c", [task("x")], ["x"])
    run(s, "x", W1)
    out = s.handle_stimulus(Replicate(client="c", keys=["x"], n=2, stimulus_id="r"))
    [ask] = [i for i in of(out, WorkerMsg) if i.msg.op == "acquire-replicas"]
    assert ask.msg.who_has == {"x": [W1]} and ask.worker in (W2, W3)
    s.handle_stimulus(AddKeys(worker=ask.worker, keys=["x"], nbytes={"x": 8}, stimulus_id="ak"))
    assert s.tasks["x"].who_has == {W1, ask.worker}
    out = s.handle_stimulus(
        RemoveWorker(worker=W1, how="connection", reason="killed", stimulus_id="rm")
    )
    [again] = [i for i in of(out, WorkerMsg) if i.msg.op == "acquire-replicas"]
    assert again.worker not in (W1, ask.worker)
    assert s.tasks["x"].state == "memory"  # a copy survived: nothing recomputed


def test_restart_forgets_everything_and_tells_every_worker_and_client():
    s = make(W1, W2)
    submit(s, "c1", [task("x"), task("y", ["x"])], ["y"])
    submit(s, "c2", [task("z")], ["z"])
    run(s, "x", W1)
    s.handle_stimulus(TaskClaimed(worker=W2, keys=["y"], stimulus_id="claim"))
    out = s.handle_stimulus(Restart(client="c1", stimulus_id="r"))
    assert s.tasks == {} and not s.workers[W2].processing and not s.workers[W1].has_what
    assert {i.worker for i in of(out, WorkerMsg) if i.msg.op == "restart"} == {W1, W2}
    assert {i.client for i in of(out, ClientMsg) if i.msg.op == "restarted"} == {"c1", "c2"}
    submit(s, "c2", [task("z")], ["z"])  # usable right after
    assert s.tasks["z"].state == "queued"


def test_a_late_claim_or_result_of_an_earlier_run_of_a_key_is_not_this_runs():
    """x popped by W1, then cancelled and submitted again (a new run, a new score) before
    the scheduler read W1's claim: neither that claim nor its result count for the new run."""
    s = make(W1, W2)
    submit(s, "c", [task("x")], ["x"])
    old = s.tasks["x"].score
    s.handle_stimulus(CancelKeys(client="c", keys=["x"], stimulus_id="cancel"))
    submit(s, "c", [task("x")], ["x"])
    assert s.tasks["x"].score != old
    out = s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], scores=[old], stimulus_id="late"))
    assert s.tasks["x"].state == "queued"  # the new run is untouched
    # W1 drops that run's copy, not one of the new run it may have by then
    [free] = [i.msg for i in of(out, WorkerMsg) if i.msg.op == "free-keys"]
    assert (free.keys, free.run) == (["x"], old)
    s.handle_stimulus(TaskFinished(worker=W1, key="x", nbytes=1, score=old, stimulus_id="late"))
    assert s.tasks["x"].state == "queued"
    new = s.tasks["x"].score
    s.handle_stimulus(TaskClaimed(worker=W2, keys=["x"], scores=[new], stimulus_id="claim"))
    s.handle_stimulus(TaskFinished(worker=W2, key="x", nbytes=1, score=new, stimulus_id="fin"))
    assert s.tasks["x"].state == "memory" and s.tasks["x"].who_has == {W2}


def acquire_asks(out: list[Instruction]) -> dict[str, dict[str, list[str]]]:
    return {i.worker: i.msg.who_has for i in of(out, WorkerMsg) if i.msg.op == "acquire-replicas"}


def closes(out: list[Instruction]) -> set[str]:
    return {i.worker for i in of(out, WorkerMsg) if i.msg.op == "close"}


def aborts(out: list[Instruction]) -> set[str]:
    return {i.worker for i in of(out, WorkerMsg) if i.msg.op == "retire-aborted"}


def test_retiring_a_worker_copies_its_unique_data_then_tells_it_to_close():
    s = make(W1, W2, W3)
    submit(s, "c", [task("x"), task("y"), task("z"), task("slow")], ["x", "y", "z", "slow"])
    run(s, "x", W1, nbytes=100)
    run(s, "y", W1, nbytes=10)
    run(s, "z", W2)
    s.handle_stimulus(Replicate(client="c", keys=["z"], n=2, stimulus_id="r"))
    s.handle_stimulus(AddKeys(worker=W1, keys=["z"], nbytes={"z": 8}, stimulus_id="ak"))
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["slow"], stimulus_id="claim"))
    out = s.handle_stimulus(RetireWorkers(client="c", workers=[W1], stimulus_id="rw"))
    assert [i.worker for i in of(out, WorkerMsg) if i.msg.op == "retire"] == [W1]
    asks = acquire_asks(out)
    assert {k for who_has in asks.values() for k in who_has} == {"x", "y"}  # z has a copy
    assert W1 not in asks and len(asks) == 2  # x and y go to different staying workers
    for worker, who_has in asks.items():
        assert not closes(
            s.handle_stimulus(AddKeys(worker=worker, keys=list(who_has), stimulus_id="ak"))
        )
    # nothing unique left, but "slow" still runs there: it finishes, its result moves
    out = s.handle_stimulus(
        TaskFinished(worker=W1, key="slow", nbytes=1, type="int", stimulus_id="fin")
    )
    [(target, who_has)] = acquire_asks(out).items()
    assert who_has == {"slow": [W1]} and not closes(out)
    out = s.handle_stimulus(AddKeys(worker=target, keys=["slow"], stimulus_id="ak"))
    assert not closes(out)  # W1 has not said yet that it claims no more
    out = s.handle_stimulus(RetireWorkers(workers=[W1], stimulus_id="self"))
    assert closes(out) == {W1} and not acquire_asks(out)
    out = s.handle_stimulus(RemoveWorker(worker=W1, reason="retired", stimulus_id="bye"))
    assert not of(out, RecordDeath) and not freed(out)
    assert all(s.tasks[k].state == "memory" for k in ["x", "y", "z", "slow"])


def test_an_idle_worker_is_closed_only_after_its_own_word_that_it_claims_no_more():
    s = make(W1, W2)
    submit(s, "c", [task("x")], ["x"])
    assert not closes(s.handle_stimulus(RetireWorkers(client="c", workers=[W1], stimulus_id="rw")))
    # a claim W1 made before it heard "retire" is read before W1's own request
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id="claim"))
    assert not closes(s.handle_stimulus(RetireWorkers(workers=[W1], stimulus_id="self")))
    out = s.handle_stimulus(TaskFinished(worker=W1, key="x", nbytes=1, stimulus_id="fin"))
    assert acquire_asks(out) == {W2: {"x": [W1]}}
    assert closes(s.handle_stimulus(AddKeys(worker=W2, keys=["x"], stimulus_id="ak"))) == {W1}


def test_a_retiring_worker_is_no_target_for_copies_and_a_lost_target_is_replaced():
    s = make(W1, W2, W3)
    submit(s, "c", [task("x")], ["x"])
    run(s, "x", W1)
    s.handle_stimulus(RetireWorkers(client="c", workers=[W2], stimulus_id="rw"))
    out = s.handle_stimulus(RetireWorkers(client="c", workers=[W1], stimulus_id="rw"))
    assert list(acquire_asks(out)) == [W3]
    out = s.handle_stimulus(
        RemoveWorker(worker=W3, how="connection", reason="killed", stimulus_id="rm")
    )
    # nobody stays to take x: the retirement stops (as distributed's), the worker works
    # on, the client is told at once (it waited for its timeout, and with every worker
    # retiring nothing claimed work meanwhile)
    [refused] = client_msgs(out, "retire-refused", "c")
    assert refused["workers"] == [W1] and "results left" in refused["reason"]
    assert aborts(out) == {W1} and not acquire_asks(out) and not closes(out)
    assert not s.workers[W1].retiring and s.workers[W2].retiring  # (W2 holds nothing)
    # its own repeat, not forced, that crossed the abort: stopped again, told once
    out = s.handle_stimulus(RetireWorkers(workers=[W1], stimulus_id="self"))
    assert aborts(out) == {W1} and not client_msgs(out, "retire-refused") and not closes(out)
    out = s.handle_stimulus(AddWorker(worker=W3, info={"started": 2.0}, stimulus_id="add"))
    assert not acquire_asks(out)
    out = s.handle_stimulus(RetireWorkers(client="c", workers=[W1], stimulus_id="rw2"))
    assert acquire_asks(out) == {W3: {"x": [W1]}}  # asked again: the copy is made there
    # a copy that did not come (the target failed to fetch) is asked for again; the
    # retiring holder keeps its copy: it is alive, the failure taken for a passing one
    out = s.handle_stimulus(MissingData(worker=W3, keys=["x"], errant_worker=W1, stimulus_id="md"))
    assert acquire_asks(out) == {W3: {"x": [W1]}} and not freed(out)
    assert s.tasks["x"].who_has == {W1}
    # a target that never answers is asked again at the worker's next repeat
    assert acquire_asks(s.handle_stimulus(RetireWorkers(workers=[W1], stimulus_id="again"))) == {
        W3: {"x": [W1]}
    }


def test_a_retirement_that_would_lose_data_is_refused_unless_the_worker_must_go():
    s = make(W1)
    submit(s, "c", [task("x"), task("y")], ["x", "y"])
    run(s, "x", W1)
    out = s.handle_stimulus(RetireWorkers(client="c", workers=[W1], stimulus_id="rw"))
    [refused] = client_msgs(out, "retire-refused", "c")
    assert refused["workers"] == [W1] and "no worker would stay" in refused["reason"]
    assert not s.workers[W1].retiring and not of(out, WorkerMsg)
    s2 = make(W1)
    submit(s2, "c", [task("y")], ["y"])
    s2.handle_stimulus(TaskClaimed(worker=W1, keys=["y"], stimulus_id="claim"))  # only computing
    out = s2.handle_stimulus(RetireWorkers(client="c", workers=[W1], stimulus_id="rw"))
    assert client_msgs(out, "retire-refused")
    # a worker that must go (SIGTERM, lifetime) with nowhere to put its data goes now
    out = s.handle_stimulus(RetireWorkers(workers=[W1], force=True, stimulus_id="self"))
    assert closes(out) == {W1}


def test_a_copy_being_made_of_a_released_key_is_freed_on_its_target():
    s = make(W1, W2)
    submit(s, "c", [task("x")], ["x"])
    run(s, "x", W1)
    s.handle_stimulus(RetireWorkers(client="c", workers=[W1], stimulus_id="rw"))
    out = s.handle_stimulus(ClientReleasesKeys(client="c", keys=["x"], stimulus_id="rel"))
    assert freed(out, W2) == {"x"} and freed(out, W1) == {"x"}


def test_a_nannys_report_after_the_worker_was_removed_is_still_recorded():
    s = make(W1)
    s.handle_stimulus(RemoveWorker(worker=W1, how="heartbeat", reason="silent", stimulus_id="hb"))
    evidence = {"kind": "hung", "pid": 42, "host": "h", "name": "w-0"}
    out = s.handle_stimulus(
        RemoveWorker(
            worker=W1, how="nanny", reason="hung: ...", evidence=evidence, stimulus_id="nanny"
        )
    )
    [record] = [i.record for i in of(out, RecordDeath)]
    assert record["kind"] == "hung" and record["pid"] == 42 and record["name"] == "w-0"


# --------------------------------------------------------------------------- event log


def test_the_event_log_hears_of_joins_goodbyes_and_killed_workers():
    s = SchedulerState(validate=True, allowed_failures=0)
    joined = s.handle_stimulus(
        AddWorker(worker=W1, info={"name": "w1", "nthreads": 2, "restarts": 3}, stimulus_id="a1")
    )
    assert [(e.kind, e.fields) for e in of(joined, LogEvent)] == [
        ("worker-joined", {"worker": W1, "name": "w1", "nthreads": 2, "restarts": 3})
    ]
    assert not of(s.handle_stimulus(AddWorker(worker=W1, stimulus_id="a1-again")), LogEvent)  # once
    s.handle_stimulus(AddWorker(worker=W2, stimulus_id="a2"))
    submit(s, "c", [task("boom")], ["boom"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["boom"], stimulus_id="claim"))
    died = s.handle_stimulus(
        RemoveWorker(worker=W1, how="nanny", reason="memory", stimulus_id="rw")
    )
    assert [(e.kind, e.fields) for e in of(died, LogEvent)] == [
        ("killed-worker", {"key": "boom", "workers": [W1]})
    ]
    left = s.handle_stimulus(
        RemoveWorker(worker=W2, how="goodbye", reason="closed", stimulus_id="bye")
    )
    assert [(e.kind, e.fields["reason"]) for e in of(left, LogEvent)] == [("worker-left", "closed")]


def test_a_worker_loaded_from_redis_is_announced_when_its_own_message_arrives():
    s = SchedulerState(validate=True)
    assert not of(s.handle_stimulus(AddWorker(worker=W1, stimulus_id="load")), LogEvent)
    assert (
        len(of(s.handle_stimulus(AddWorker(worker=W1, stimulus_id="workers:1-0/0")), LogEvent)) == 1
    )


@pytest.mark.parametrize(
    ("key", "prefix"),
    [
        ("inc-5f3a9c00aa11", "inc"),
        ("sum-chunk-00ab12cd", "sum-chunk"),
        ("load-data-7", "load-data"),
        ("('x-1a2b', 0)", "x"),
        ("<lambda>-da39a3ee5e6b", "lambda"),
        ("f-deadbeef", "f"),
        ("plain", "plain"),
        ("", "other"),
    ],
)
def test_key_prefix_groups_keys_like_dask(key: str, prefix: str):
    assert key_prefix(key) == prefix


def finish_timed(s: SchedulerState, key: str, start: float, stop: float, **kw: Any):
    s.handle_stimulus(TaskClaimed(worker=W1, keys=[key], stimulus_id="claim"))
    ev = TaskFinished(worker=W1, key=key, start=start, stop=stop, stimulus_id=f"fin-{key}", **kw)
    return s.handle_stimulus(ev)


def test_durations_are_averaged_per_prefix_like_dask_and_written_per_batch():
    """distributed's ``TaskPrefix.add_duration``: the first run sets the average, each
    later one moves it half-way; one SetDurations per batch, of the prefixes it changed."""
    s = make(W1)
    keys = ["inc-aaaa1111", "inc-bbbb2222", "inc-cccc3333", "slow-dddd4444"]
    submit(s, "c", [task(k) for k in keys], keys)
    out = finish_timed(s, "inc-aaaa1111", 10.0, 10.004)
    assert of(out, SetDurations) == [SetDurations("fin-inc-aaaa1111", {"inc": 0.004})]
    s.handle_stimulus(
        TaskClaimed(worker=W1, keys=["inc-bbbb2222", "slow-dddd4444"], stimulus_id="c")
    )
    out = s.handle_stimulus(
        TaskFinished(worker=W1, key="inc-bbbb2222", start=1.0, stop=1.002, stimulus_id="f1"),
        TaskFinished(worker=W1, key="slow-dddd4444", start=1.0, stop=3.0, stimulus_id="f2"),
    )
    [written] = of(out, SetDurations)
    assert written.averages == pytest.approx({"inc": 0.003, "slow": 2.0})
    assert s.durations.averages == written.averages


def test_durations_leave_out_seceded_stale_and_untimed_results():
    s = make(W1)
    keys = ["a-aaaa1111", "b-bbbb2222", "c-cccc3333"]
    submit(s, "c", [task(k) for k in keys], keys)
    out = finish_timed(s, "a-aaaa1111", 1.0, 61.0, seceded=True)  # it waited on others
    assert s.tasks["a-aaaa1111"].state == "memory" and not of(out, SetDurations)
    out = finish_timed(s, "b-bbbb2222", 0.0, 0.0)  # no timing
    assert s.tasks["b-bbbb2222"].state == "memory" and not of(out, SetDurations)
    # a result nobody asked this worker for (not the claim holder's) says nothing either
    out = s.handle_stimulus(
        TaskFinished(worker=W2, key="c-cccc3333", start=1.0, stop=2.0, stimulus_id="late")
    )
    assert not of(out, SetDurations) and s.durations.averages == {}


def test_claims_that_stand_are_told_and_only_real_results_and_errors_are_counted():
    s = make(W1, W2)
    submit(s, "c", [task("a"), task("b")], ["a", "b"])
    out = s.handle_stimulus(TaskClaimed(worker=W1, keys=["a", "nobody-knows"], stimulus_id="claim"))
    assert [(i.key, i.worker) for i in of(out, ClaimAccepted)] == [("a", W1)]
    s.handle_stimulus(TaskFinished(worker=W1, key="a", nbytes=8, type="int", stimulus_id="fin"))
    s.handle_stimulus(TaskFinished(worker=W1, key="a", nbytes=8, type="int", stimulus_id="again"))
    s.handle_stimulus(
        TaskFinished(worker=W2, key="zzz", nbytes=8, type="int", stimulus_id="stranger")
    )
    assert (s.n_finished, s.n_erred) == (1, 0)  # the duplicate and the unknown key: ignored
    fail(s, "b", worker=W2)
    assert (s.n_finished, s.n_erred) == (1, 1)


# --------------------------------------------------------------------------- the idiom


def test_an_illegal_transition_raises_with_the_story_of_its_key():
    s = make(W1)
    submit(s, "c", [task("x")], ["x"])
    run(s, "x")
    story = [
        ("x", "released", "waiting", "ug"),
        ("x", "waiting", "queued", "ug"),
        ("x", "queued", "processing", "claim"),
        ("x", "processing", "memory", "fin"),
    ]
    assert s.stories("x") == story
    with pytest.raises(InvalidTransition) as info:
        s.transition(s.tasks["x"], "processing", worker=s.workers[W1], stimulus_id="bad")
    err = info.value
    assert (err.key, err.start, err.finish, err.stimulus_id) == ("x", "memory", "processing", "bad")
    assert err.story == story
    text = str(err)
    assert "'x': invalid transition memory -> processing (stimulus bad)" in text
    assert all(str(entry) in text for entry in story)
    again = pickle.loads(pickle.dumps(err))  # it crosses process boundaries intact
    assert (again.key, again.story, str(again)) == (err.key, err.story, text)


def test_the_transition_table_holds_every_transition_method():
    assert table_problems(SchedulerState) == []

    class WithAnUnregisteredMove(SchedulerState):
        def _transition_memory_erred(self, ts: Any, *, stimulus_id: str) -> None: ...

    assert table_problems(WithAnUnregisteredMove) == [
        "_transition_memory_erred is not registered in _TRANSITIONS under its own move"
    ]


def test_every_event_type_has_its_handler():
    assert set(SchedulerState._HANDLERS) == set(Stimulus.__subclasses__())
    assert set(SCHEDULER_EVENTS.values()) <= set(SchedulerState._HANDLERS)
    handlers = {n for n in dir(SchedulerState) if n.startswith("_handle_")}
    assert {f.__name__ for f in SchedulerState._HANDLERS.values()} == handlers


# --------------------------------------------------------------------------- resources


def gpus(**workers: float) -> SchedulerState:
    """Workers W1, W2, W3 with these GPUs (``W1=1``); one not named has none."""
    s = SchedulerState(validate=True)
    for name, address in (("W1", W1), ("W2", W2), ("W3", W3)):
        has = {"GPU": workers[name]} if name in workers else {}
        info = {"name": name.lower(), "resources": has}
        s.handle_stimulus(AddWorker(worker=address, info=info, stimulus_id=f"add-{name}"))
    return s


def test_a_task_with_resources_is_queued_on_the_workers_able_to_run_it_and_waits_otherwise():
    s = gpus(W1=1, W3=2)
    tasks = [task("one", resources={"GPU": 1}), task("two", resources={"GPU": 2})]
    out = submit(s, "c", tasks, ["one", "two"])
    queued = {e.key: (e.workers, e.queued_on, e.constrained, e.placed) for e in of(out, Enqueue)}
    assert queued == {"one": ((W1, W3), (W1, W3), True, True), "two": ((W3,), (W3,), True, True)}
    [store] = [st for st in of(out, StoreTask) if st.key == "two"]
    assert (store.resources, store.loose) == ({"GPU": 2}, False)
    out = submit(s, "c", [task("four", resources={"GPU": 4})], ["four"])
    assert s.tasks["four"].state == "no-worker" and not of(out, Enqueue)
    # a worker able to run it joins: it is queued there, and so is what it could run too
    info = {"name": "big", "resources": {"GPU": 4}}
    out = s.handle_stimulus(AddWorker(worker="tcp://10.0.0.4:8000", info=info, stimulus_id="a"))
    assert s.tasks["four"].state == "queued"
    assert sorted((e.key, e.workers) for e in of(out, Enqueue)) == [
        ("four", ("tcp://10.0.0.4:8000",)),
        ("one", ("tcp://10.0.0.4:8000",)),
        ("two", ("tcp://10.0.0.4:8000",)),
    ]
    assert s.tasks["two"].queued_on == (W3, "tcp://10.0.0.4:8000")
    # taken out of the constrained sets, not the ready sets
    out = s.handle_stimulus(CancelKeys(client="c", keys=["two"], stimulus_id="cx"))
    [dequeue] = of(out, Dequeue)
    assert (dequeue.workers, dequeue.constrained) == ((W3, "tcp://10.0.0.4:8000"), True)


def test_a_dead_or_retired_workers_resourced_tasks_go_to_the_others_able_to_run_them():
    s = gpus(W1=1, W3=1)
    submit(s, "c", [task("x", resources={"GPU": 1}), task("y", resources={"GPU": 1})], ["x", "y"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id="claim"))
    out = s.handle_stimulus(RemoveWorker(worker=W1, how="connection", reason="x", stimulus_id="rm"))
    assert s.tasks["x"].state == "queued" and s.tasks["x"].suspicious == 1
    assert s.tasks["x"].queued_on == (W3,) and s.tasks["y"].queued_on == (W3,)
    assert ("x", (W3,), True) in [(e.key, e.workers, e.constrained) for e in of(out, Enqueue)]
    assert ("y", (W1,), True) in [(d.key, d.workers, d.constrained) for d in of(out, Dequeue)]
    # the last able worker retires: what it claimed and had not started comes back, and
    # waits for a worker with a GPU once it is gone
    s.handle_stimulus(TaskClaimed(worker=W3, keys=["x", "y"], stimulus_id="claim2"))
    s.handle_stimulus(RetireWorkers(client="c", workers=[W3], stimulus_id="rw"))
    s.handle_stimulus(ReleasedKeys(worker=W3, keys=["y"], stimulus_id="back"))
    assert s.tasks["y"].state == "queued" and s.tasks["y"].queued_on == (W3,)
    run_x = s.handle_stimulus(
        TaskFinished(worker=W3, key="x", nbytes=1, type="int", stimulus_id="fin")
    )
    assert s.tasks["x"].state == "memory" and of(run_x, WorkerMsg)  # copied off W3 first
    s.handle_stimulus(RemoveWorker(worker=W3, reason="retired", stimulus_id="bye"))
    assert s.tasks["y"].state == "no-worker"
    s.handle_stimulus(AddWorker(worker=W1, info={"resources": {"GPU": 1}}, stimulus_id="back"))
    assert s.tasks["y"].state == "queued" and s.tasks["y"].queued_on == (W1,)


def test_resources_and_a_restriction_both_hold_and_allow_other_workers_drops_only_the_restriction():
    s = gpus(W1=1, W3=1)
    tasks = [
        task("strict", workers=["w2"], resources={"GPU": 1}),  # w2 has no GPU
        task("loose", workers=["w2"], resources={"GPU": 1}, allow_other_workers=True),
        task("both", workers=["w1", "w2"], resources={"GPU": 1}),
        task("nowhere", workers=["w1"], resources={"GPU": 5}, allow_other_workers=True),
    ]
    submit(s, "c", tasks, [t["key"] for t in tasks])
    assert states(s) == {"strict": "no-worker", "loose": "queued", "both": "queued",
                         "nowhere": "no-worker"}  # fmt: skip
    assert s.tasks["loose"].queued_on == (W1, W3)  # any able worker: resources are never loose
    assert s.tasks["both"].queued_on == (W1,)


def test_allow_other_workers_makes_a_restriction_a_preference():
    s = gpus()
    tasks = [
        task("pref", workers=["w2"], allow_other_workers=True),
        task("gone", workers=["nobody"], allow_other_workers=True),
        task("hard", workers=["nobody"]),
    ]
    out = submit(s, "c", tasks, ["pref", "gone", "hard"])
    queued = {e.key: (e.workers, e.placed) for e in of(out, Enqueue)}
    # the named worker while it is there; else the cluster's ready set (queued_on written
    # empty, so a reload knows where it is)
    assert queued == {"pref": ((W2,), True), "gone": ((), True)}
    assert s.tasks["hard"].state == "no-worker"
    assert [st.loose for st in of(out, StoreTask)] == [True, True, False]
    out = s.handle_stimulus(RemoveWorker(worker=W2, reason="bye", stimulus_id="rm"))
    assert s.tasks["pref"].state == "queued" and s.tasks["pref"].queued_on == ()
    assert [(e.key, e.workers, e.placed) for e in of(out, Enqueue)] == [("pref", (), True)]
    # a preference given without any worker named means nothing (as in distributed)
    submit(s, "c", [task("plain", allow_other_workers=True)], ["plain"])
    assert not s.tasks["plain"].loose


def test_no_worker_tasks_say_what_they_ask_for_and_what_the_workers_have():
    from redisdask.scheduler.translator import no_worker_reasons

    s = gpus(W1=1)
    tasks = [task(f"big-{i}", resources={"GPU": 2}) for i in range(3)]
    tasks.append(task("named", workers=["gpu-box"]))
    submit(s, "c", tasks, [t["key"] for t in tasks])
    big, named = no_worker_reasons(s)
    assert (big["count"], big["key"], named["count"]) == (3, "big-0", 1)
    assert "needs GPU=2 on one worker" in big["reason"]
    assert f"w1 ({W1}): GPU=1" in big["reason"] and f"w2 ({W2}): no resources" in big["reason"]
    assert "--resources 'GPU=2'" in big["reason"]
    assert "workers=['gpu-box'] matches no registered worker" in named["reason"]


def test_resources_in_an_update_graph_must_be_a_map_of_amounts():
    for bad, match in (
        ({"GPU": "1"}, "must be a number"),
        ({"GPU": -1}, "0 or more"),
        ([1], "must be a dict"),
        ({"GPU": float("nan")}, "finite"),
    ):
        with pytest.raises(ProtocolError, match=match):
            Stimulus.from_dict(
                {"op": "update-graph", "client": "c", "tasks": [{"key": "x", "resources": bad}]}
            )
    with pytest.raises(ProtocolError, match="allow_other_workers"):
        Stimulus.from_dict(
            {"op": "update-graph", "client": "c", "tasks": [{"key": "x", "allow_other_workers": 1}]}
        )


def test_a_small_result_kept_in_its_record_outlives_its_only_worker():
    """A result that came with its report (``value``) is written to the record and sent
    to the clients; the holder's death leaves it in memory (no recomputation), with
    ``redis`` as its holder; its release empties the record's value."""
    s = make(W1, W2)
    submit(s, "c", [task("x"), task("y", ["x"])], ["x", "y"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id="claim"))
    out = s.handle_stimulus(
        TaskFinished(worker=W1, key="x", nbytes=28, type="int", value=b"pickled", stimulus_id="f")
    )
    [stored] = [i for i in of(out, SetState) if i.key == "x" and i.state == "memory"]
    assert stored.fields["value"] == b"pickled" and stored.fields["who_has"] == [W1, "redis"]
    [news] = client_msgs(out, "key-in-memory", "c")
    assert news["value"] == b"pickled" and news["who_has"] == [W1, "redis"]
    out = s.handle_stimulus(RemoveWorker(worker=W1, stimulus_id="rm"))
    assert s.tasks["x"].state == "memory" and s.tasks["x"].holders() == ["redis"]
    assert s.tasks["y"].state == "queued" and not of(out, StoreTask)  # nothing recomputed
    # a client that wants it now hears where it is (the value is read from the record)
    out = s.handle_stimulus(ClientDesiresKeys(client="d", keys=["x"], stimulus_id="cd"))
    [news] = client_msgs(out, "key-in-memory", "d")
    assert news["who_has"] == ["redis"] and "value" not in news
    s.handle_stimulus(ClientReleasesKeys(client="c", keys=["x", "y"], stimulus_id="rel"))
    out = s.handle_stimulus(ClientReleasesKeys(client="d", keys=["x"], stimulus_id="rel2"))
    assert "x" not in s.tasks  # forgotten: the record is deleted, its value with it
    assert any(i.key == "x" and i.fields.get("value", 1) is None for i in of(out, SetState))


def test_news_of_a_key_says_which_submission_the_scheduler_had_read():
    """``seen``: the generation of the client's last graph read when the news was
    written, for the client to tell news of an earlier run of a resubmitted key."""
    s = make(W1)
    s.handle_stimulus(
        UpdateGraph(client="c", tasks=[task("x")], wanted=["x"], generation=4, stimulus_id="g")
    )
    [news] = client_msgs(run(s, "x"), "key-in-memory", "c")
    assert news["seen"] == 4
    out = s.handle_stimulus(
        UpdateGraph(client="c", tasks=[task("y")], wanted=["x", "y"], generation=5, stimulus_id="h")
    )
    [news] = client_msgs(out, "key-in-memory", "c")  # x asked for again: reported again
    assert news["seen"] == 5
    [erred] = client_msgs(fail(s, "y"), "task-erred", "c")
    assert erred["seen"] == 5
    s.handle_stimulus(CloseClient(client="c", stimulus_id="bye"))
    assert "c" not in s.generations
    # a client whose graphs the scheduler has not read since it (re)started: no claim
    out = s.handle_stimulus(ClientDesiresKeys(client="d", keys=["gone"], stimulus_id="d"))
    assert "seen" not in client_msgs(out, "task-erred", "d")[0]


def test_a_released_keys_of_an_earlier_run_leaves_the_current_claim_alone():
    """A worker drops a cancelled run's result after it claimed the key's next run: its
    released-keys names the old run's score and must not take the new claim back (it
    did, and the worker's later free-keys dropped the new result: DataUnavailableError)."""
    s = make(W1)
    submit(s, "c", [task("x")], ["x"])
    old = s.tasks["x"].score
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id="claim"))
    s.handle_stimulus(ClientReleasesKeys(client="c", keys=["x"], stimulus_id="rel"))
    submit(s, "c", [task("x")], ["x"])
    assert s.tasks["x"].score != old
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id="claim2"))
    out = s.handle_stimulus(ReleasedKeys(worker=W1, keys=["x"], scores=[old], stimulus_id="r"))
    assert s.tasks["x"].state == "processing" and not freed(out)
    new = s.tasks["x"].score  # the same message about the current run hands it back
    s.handle_stimulus(ReleasedKeys(worker=W1, keys=["x"], scores=[new], stimulus_id="r2"))
    assert s.tasks["x"].state == "queued"
