"""Chains in the scheduler's pure state machine (redisdask/scheduler/chain.py): which
dependents a task's ``chain`` names, and when a chained claim (``FINISH``'s) stands.  No
Redis, no processes: events in, instructions out."""

from __future__ import annotations

import pytest

from redisdask.scheduler.chain import CHAIN_MAX
from redisdask.scheduler.instructions import (
    Enqueue,
    MarkChain,
    SetState,
    Unclaim,
)
from redisdask.scheduler.state import RemoveWorker, TaskClaimed, TaskFinished
from tests.test_scheduler_state import W1, W2, freed, make, of, submit, task

pytestmark = pytest.mark.timeout(10)


def chains(out: list, key: str) -> list[list[str]]:
    return [i.chain for i in of(out, MarkChain) if i.key == key]


def chained_entry(s, worker: str, claimed: str, finished: str) -> list:
    """One FINISH entry: the chained claim first, then the result it follows."""
    score = s.tasks[claimed].score
    return s.handle_stimulus(
        TaskClaimed(worker=worker, keys=[claimed], scores=[score], chained=True,
                    stimulus_id="workers:2-0/0"),
        TaskFinished(worker=worker, key=finished, nbytes=8, type="int",
                     stimulus_id="workers:2-0/1"),
    )  # fmt: skip


def test_a_dependent_waiting_on_one_task_is_named_in_its_chain():
    s = make(W1, W2)
    out = submit(s, "c", [task("x"), task("y", ["x"]), task("z", ["y"])], ["z"])
    assert chains(out, "x") == [["y"]] and chains(out, "y") == [["z"]]
    assert s.tasks["x"].chain == ("y",)


def test_a_dependent_joins_the_chain_of_its_last_dependency():
    s = make(W1, W2)
    out = submit(s, "c", [task("a"), task("b"), task("c", ["a", "b"])], ["c"])
    assert not of(out, MarkChain)  # waits on two
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["a"], stimulus_id="workers:1-0/0"))
    out = s.handle_stimulus(
        TaskFinished(worker=W1, key="a", nbytes=8, type="int", stimulus_id="workers:1-1/0")
    )
    assert chains(out, "b") == [["c"]]


def test_restricted_or_resourced_dependents_are_not_chained_and_chains_are_bounded():
    s = make(W1, W2)
    fan = [task(f"d{i}", ["x"]) for i in range(CHAIN_MAX + 3)]
    out = submit(s, "c", [task("x"), task("r", ["x"], workers=[W2]),
                          task("g", ["x"], resources={"GPU": 1}), *fan],
                 ["r", "g", *(t["key"] for t in fan)])  # fmt: skip
    assert s.tasks["x"].chain == tuple(f"d{i}" for i in range(CHAIN_MAX))
    assert all(len(c) <= CHAIN_MAX for c in chains(out, "x"))


def test_a_chained_claim_stands_and_the_dependent_is_never_queued():
    s = make(W1, W2)
    submit(s, "c", [task("x"), task("y", ["x"])], ["y"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id="workers:1-0/0"))
    out = chained_entry(s, W1, "y", "x")
    assert s.tasks["x"].state == "memory"
    assert s.tasks["y"].state == "processing" and s.tasks["y"].processing_on == W1
    assert s.tasks["y"] in s.workers[W1].processing
    assert not [i for i in of(out, Enqueue) if i.key == "y"]  # no ready set, no signal
    assert not freed(out, W1)
    assert s.stories("y")[-1][1:3] == ("waiting", "processing")
    # and its own result is accepted as any claim's
    s.handle_stimulus(TaskFinished(worker=W1, key="y", nbytes=8, type="int", stimulus_id="f"))
    assert s.tasks["y"].state == "memory"


def test_a_chained_claim_by_another_worker_than_the_dependencys_is_taken_back():
    s = make(W1, W2)
    submit(s, "c", [task("x"), task("y", ["x"])], ["y"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id="workers:1-0/0"))
    out = s.handle_stimulus(
        TaskClaimed(worker=W2, keys=["y"], scores=[s.tasks["y"].score], chained=True,
                    stimulus_id="workers:2-0/0")
    )  # fmt: skip
    assert s.tasks["y"].state == "waiting"
    assert [(u.worker, u.key) for u in of(out, Unclaim)] == [(W2, "y")]
    assert freed(out, W2) == {"y"}
    # the record gets the scheduler's state back over the script's "processing"
    assert [(i.key, i.state) for i in of(out, SetState)] == [("y", "waiting")]


def test_a_chained_claim_from_a_removed_worker_is_taken_back_and_the_task_queued_later():
    s = make(W1, W2)
    submit(s, "c", [task("x"), task("y", ["x"])], ["y"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id="workers:1-0/0"))
    s.handle_stimulus(RemoveWorker(worker=W1, stimulus_id="gone"))  # x queued again
    out = chained_entry(s, W1, "y", "x")  # written before the scheduler's removal landed
    assert s.tasks["y"].state == "waiting" and s.tasks["x"].state == "queued"
    assert ("y", "waiting") in [(i.key, i.state) for i in of(out, SetState)]
    s.handle_stimulus(TaskClaimed(worker=W2, keys=["x"], stimulus_id="workers:3-0/0"))
    out = s.handle_stimulus(
        TaskFinished(worker=W2, key="x", nbytes=8, type="int", stimulus_id="workers:3-1/0")
    )
    assert s.tasks["y"].state == "queued" and [i.key for i in of(out, Enqueue)] == ["y"]


def test_a_chained_claim_of_a_released_task_is_taken_back():
    from redisdask.scheduler.state import CancelKeys

    s = make(W1)
    submit(s, "c", [task("x"), task("y", ["x"])], ["x", "y"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id="workers:1-0/0"))
    s.handle_stimulus(CancelKeys(client="c", keys=["y"], stimulus_id="cancel"))
    score = 1.0
    out = s.handle_stimulus(
        TaskClaimed(worker=W1, keys=["y"], scores=[score], chained=True, stimulus_id="w:2-0/0"),
        TaskFinished(worker=W1, key="x", nbytes=8, type="int", stimulus_id="w:2-0/1"),
    )
    assert "y" not in s.tasks or s.tasks["y"].state != "processing"
    assert [(u.worker, u.key) for u in of(out, Unclaim)][:1] == [(W1, "y")]
    assert s.tasks["x"].state == "memory"


def test_a_chained_claim_read_again_after_a_reload_is_known():
    """A scheduler killed after the FINISH script: the reloaded state has the claim
    (processing there); reading its entry again changes nothing."""
    s = make(W1)
    submit(s, "c", [task("x"), task("y", ["x"])], ["y"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id="workers:1-0/0"))
    chained_entry(s, W1, "y", "x")
    out = s.handle_stimulus(
        TaskClaimed(worker=W1, keys=["y"], scores=[s.tasks["y"].score], chained=True,
                    stimulus_id="workers:2-0/0")
    )  # fmt: skip
    assert s.tasks["y"].state == "processing" and not of(out, Unclaim)


def deep_entry(s, worker: str, finished: str, *claimed: str) -> list:
    """A FINISH entry that claimed ``claimed`` (each waiting on the one before it, the
    first on ``finished``), then reports ``finished``."""
    scores = [s.tasks[k].score for k in claimed]
    return s.handle_stimulus(
        TaskClaimed(worker=worker, keys=list(claimed), scores=scores, chained=True,
                    stimulus_id="workers:2-0/0"),
        TaskFinished(worker=worker, key=finished, nbytes=8, type="int",
                     stimulus_id="workers:2-0/1"),
    )  # fmt: skip


def chain_of_three(s) -> None:
    submit(s, "c", [task("x"), task("y", ["x"]), task("z", ["y"])], ["z"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id="workers:1-0/0"))
    deep_entry(s, W1, "x", "y", "z")


def test_a_link_chained_on_a_link_claimed_in_the_same_step_stands():
    s = make(W1, W2)
    chain_of_three(s)
    assert [s.tasks[k].state for k in "xyz"] == ["memory", "processing", "processing"]
    assert s.tasks["z"].processing_on == W1 and s.tasks["z"].waiting_on == {s.tasks["y"]}
    s.handle_stimulus(TaskFinished(worker=W1, key="y", nbytes=8, type="int", stimulus_id="f"))
    s.handle_stimulus(TaskFinished(worker=W1, key="z", nbytes=8, type="int", stimulus_id="g"))
    assert s.tasks["z"].state == "memory"


def test_the_links_chained_on_a_task_that_errs_err_and_are_taken_back():
    from redisdask.scheduler.state import TaskErred

    s = make(W1, W2)
    chain_of_three(s)
    out = s.handle_stimulus(TaskErred(worker=W1, key="y", exception_text="boom", stimulus_id="e"))
    assert s.tasks["z"].state == "erred"  # (and y, erred, released: z no longer needs it)
    assert s.tasks["z"].exception_blame == "y"
    assert ("z" in freed(out, W1)) and (W1, "z") in [(u.worker, u.key) for u in of(out, Unclaim)]
    assert s.tasks["z"] not in s.workers[W1].processing


def test_the_links_chained_on_a_task_queued_again_wait_again():
    from redisdask.scheduler.state import TaskErred

    s = make(W1, W2)
    submit(s, "c", [task("x"), task("y", ["x"], retries=1), task("z", ["y"])], ["z"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["x"], stimulus_id="workers:1-0/0"))
    deep_entry(s, W1, "x", "y", "z")
    out = s.handle_stimulus(TaskErred(worker=W1, key="y", exception_text="once", stimulus_id="e"))
    assert s.tasks["y"].state == "queued" and s.tasks["z"].state == "waiting"
    assert "z" in freed(out, W1) and not [i for i in of(out, Enqueue) if i.key == "z"]


def test_a_dead_worker_s_chained_links_wait_for_their_dependency_again():
    s = make(W1, W2)
    chain_of_three(s)
    s.handle_stimulus(RemoveWorker(worker=W1, stimulus_id="gone"))
    # x's only copy died: computed again; y and z wait for it (none queued without it)
    assert s.tasks["x"].state in ("queued", "processing", "waiting")
    assert s.tasks["y"].state == "waiting" and s.tasks["z"].state == "waiting"
    assert s.tasks["z"].suspicious == 0


def test_work_stealing_leaves_a_chain_claimed_together_alone():
    s = make(W1, W2)
    chain_of_three(s)  # y and z processing on W1, z waiting there for y
    assert not s.stealing.may_steal(s.tasks["z"], W2)  # waits on a run chained with it
    assert not s.stealing.may_steal(s.tasks["y"], W2)  # z waits for it on W1
