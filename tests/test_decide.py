"""Placement by data in the scheduler's pure state machine (redisdask/scheduler/decide.py): where a
ready task is queued first.  No Redis, no processes: events in, instructions out."""

from __future__ import annotations

import time

import pytest

from redisdask.scheduler.decide import decide_worker, sticky
from redisdask.scheduler.instructions import Dequeue, Enqueue, Instruction
from redisdask.scheduler.state import (
    MissingData,
    RemoveWorker,
    RetireWorkers,
    TaskClaimed,
    TaskFinished,
)
from tests.test_scheduler_state import W1, W2, W3, make, of, submit, task

pytestmark = pytest.mark.timeout(10)
MB = 1_000_000


def finish(s, key: str, worker: str, nbytes: int, value: bytes | None = None) -> None:
    s.handle_stimulus(TaskClaimed(worker=worker, keys=[key], stimulus_id="claim"))
    s.handle_stimulus(
        TaskFinished(worker=worker, key=key, nbytes=nbytes, type="x", value=value, stimulus_id="f")
    )


def enqueued(out: list[Instruction], key: str) -> Enqueue:
    (ins,) = [i for i in of(out, Enqueue) if i.key == key]
    return ins


def two_deps(s, a_on: str, a_bytes: int, b_on: str, b_bytes: int) -> list[Instruction]:
    """``a`` and ``b`` finish where asked; ``c`` (needing both) is then queued."""
    submit(s, "c1", [task("a"), task("b"), task("c", ["a", "b"])], ["c"])
    finish(s, "a", a_on, a_bytes)
    out = s.handle_stimulus(TaskClaimed(worker=b_on, keys=["b"], stimulus_id="claim"))
    return out + s.handle_stimulus(
        TaskFinished(worker=b_on, key="b", nbytes=b_bytes, type="x", stimulus_id="f")
    )


def test_a_dependent_is_queued_first_for_the_worker_holding_most_of_its_bytes():
    s = make(W1, W2)
    ins = enqueued(two_deps(s, W1, 10, W2, 20 * MB), "c")
    assert (ins.workers, ins.queued_on, ins.preferred) == ((W2,), (W2,), True)
    assert s.tasks["c"].queued_on == (W2,)
    s = make(W1, W2)
    assert enqueued(two_deps(s, W1, 20 * MB, W2, 10), "c").workers == (W1,)


def test_root_tasks_go_to_the_shared_set_for_free_threads_to_pull():
    s = make(W1, W2)
    out = submit(s, "c1", [task(f"r{i}") for i in range(4)], [f"r{i}" for i in range(4)])
    assert all(i.workers == () and not i.preferred for i in of(out, Enqueue))


def test_ties_go_to_the_least_occupied_holder():
    s = make(W1, W2, W3)
    submit(s, "c1", [task("a"), task("busy"), task("c", ["a"])], ["c", "busy"])
    finish(s, "a", W1, MB)
    s.tasks["a"].who_has.add(W2)  # a replica: W1 and W2 hold the same bytes
    s.workers[W2].has_what.add(s.tasks["a"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["busy"], stimulus_id="claim"))
    assert decide_worker(s.tasks["c"], s.workers) == W2
    s2 = make(W1, W2)  # nothing processing anywhere: the smaller address, every time
    submit(s2, "c1", [task("a"), task("c", ["a"])], ["c"])
    finish(s2, "a", W2, MB)
    s2.tasks["a"].who_has.add(W1)
    assert decide_worker(s2.tasks["c"], s2.workers) == W1


def test_results_kept_in_redis_count_for_nothing():
    """Every worker gets a small result in its claim's reply: no preference."""
    s = make(W1, W2)
    submit(s, "c1", [task("a"), task("c", ["a"])], ["c"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["a"], stimulus_id="claim"))
    out = s.handle_stimulus(
        TaskFinished(worker=W1, key="a", nbytes=28, type="int", value=b"v", stimulus_id="f")
    )
    assert enqueued(out, "c").workers == () and not enqueued(out, "c").preferred


def test_restricted_and_resourced_tasks_keep_their_own_placement():
    s = make(W1, W2)
    submit(s, "c1", [task("a"), task("c", ["a"], workers=[W2])], ["c"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["a"], stimulus_id="claim"))
    out = s.handle_stimulus(TaskFinished(worker=W1, key="a", nbytes=MB, stimulus_id="f"))
    ins = enqueued(out, "c")
    assert ins.workers == (W2,) and not ins.preferred


def test_a_retiring_holder_gets_no_new_work():
    s = make(W1, W2)
    submit(s, "c1", [task("a"), task("c", ["a"])], ["c"])
    s.handle_stimulus(RetireWorkers(workers=[W1], stimulus_id="retire"))
    finish(s, "a", W1, MB)
    assert s.tasks["c"].state == "queued" and s.tasks["c"].queued_on == ()


def test_another_worker_may_claim_a_task_placed_elsewhere():
    s = make(W1, W2)
    two_deps(s, W1, 10, W2, 20 * MB)
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["c"], stimulus_id="steal"))
    assert s.tasks["c"].state == "processing" and s.tasks["c"].processing_on == W1
    assert s.tasks["c"].queued_on == ()


def test_a_recompute_after_a_failed_fetch_goes_first_to_the_worker_that_missed_it():
    """W2 could not fetch ``x`` from W1 (a network cut: W1 is alive and keeps claiming).
    The recompute of ``x``, a root task, went to the shared set, where W1 could take it
    again and W2's fetch fail again, round after round (tests/test_network_cut.py)."""
    s = make(W1, W2)
    submit(s, "c1", [task("x"), task("y", ["x"])], ["y"])
    finish(s, "x", W1, MB)
    s.handle_stimulus(TaskClaimed(worker=W2, keys=["y"], stimulus_id="steal"))
    out = s.handle_stimulus(MissingData(worker=W2, keys=["x"], errant_worker=W1, stimulus_id="m"))
    ins = enqueued(out, "x")
    assert (ins.workers, ins.preferred, s.tasks["x"].queued_on) == ((W2,), True, (W2,))
    assert s.tasks["y"].state == "waiting"
    finish(s, "x", W2, MB)  # ... and only that once: lost again, it goes anywhere
    out = s.handle_stimulus(RemoveWorker(worker=W2, how="goodbye", stimulus_id="bye"))
    assert enqueued(out, "x").workers == ()


def test_when_the_preferred_worker_leaves_the_task_is_placed_again():
    s = make(W1, W2)
    submit(s, "c1", [task("a"), task("b"), task("c", ["a", "b"])], ["c"])
    finish(s, "a", W1, 10)
    finish(s, "b", W2, 20 * MB)
    assert s.tasks["c"].queued_on == (W2,)
    s.tasks["b"].who_has.add(W1)  # W1 has a copy of b too
    s.workers[W1].has_what.add(s.tasks["b"])
    out = s.handle_stimulus(RemoveWorker(worker=W2, how="goodbye", stimulus_id="bye"))
    assert any(isinstance(i, Dequeue) and i.key == "c" for i in out)
    ins = enqueued(out, "c")
    assert ins.workers == (W1,) and ins.preferred and s.tasks["c"].queued_on == (W1,)


def learnt(s, prefix: str, seconds: float) -> None:
    """A run of ``prefix`` took ``seconds``: its estimate (``Durations``) is that now."""
    s.durations.add(prefix, 1000.0, 1000.0 + seconds)


def test_a_task_whose_data_costs_more_to_move_than_to_run_waits_for_its_worker():
    """A shuffle's split: a ``getitem`` of a millisecond on a group of megabytes.  It is
    placed on the group's holder and marked sticky (CLAIM then leaves it to that worker
    while it is busy): at 100 MB/s, 10 MB take 100 ms to move."""
    s = make(W1, W2)
    learnt(s, "split", 0.001)
    submit(s, "c1", [task("group"), task("split-1", ["group"])], ["split-1"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["group"], stimulus_id="claim"))
    out = s.handle_stimulus(TaskFinished(worker=W1, key="group", nbytes=10 * MB, stimulus_id="f"))
    ins = enqueued(out, "split-1")
    assert (ins.workers, ins.preferred, ins.sticky) == ((W1,), True, True)
    assert s.tasks["split-1"].queued_on == (W1,) and s.tasks["split-1"].sticky


def test_a_task_that_runs_longer_than_its_move_may_go_to_an_idle_worker_at_once():
    """A move costs its bytes at 100 MB/s plus 100 ms (Dask's stealing's latency): a
    merge of 1 s on 10 MB (0.2 s to move) is not sticky, one of 50 ms on 1 MB (0.11 s)
    is."""
    s = make(W1, W2)
    learnt(s, "merge", 1.0)
    submit(s, "c1", [task("part"), task("merge-1", ["part"])], ["merge-1"])
    finish(s, "part", W1, 10 * MB)
    assert s.tasks["merge-1"].queued_on == (W1,) and not s.tasks["merge-1"].sticky
    assert sticky(s.tasks["merge-1"], 0.15)  # (0.15 s of work: shorter than the move)
    learnt(s, "small", 0.05)
    submit(s, "c1", [task("piece"), task("small-1", ["piece"])], ["small-1"])
    finish(s, "piece", W2, MB)
    assert s.tasks["small-1"].queued_on == (W2,) and s.tasks["small-1"].sticky


def test_a_task_of_unknown_duration_with_data_to_move_is_sticky():
    """The first wave of a prefix is queued before any of its runs finished: no estimate,
    and a busy holder is no reason to move its data."""
    s = make(W1, W2)
    submit(s, "c1", [task("load"), task("step-1", ["load"])], ["step-1"])
    finish(s, "load", W1, 2 * MB)
    assert s.tasks["step-1"].sticky


def test_sticky_is_written_with_the_placement_and_dropped_when_it_is_claimed():
    s = make(W1, W2)
    submit(s, "c1", [task("a"), task("b", ["a"])], ["b"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["a"], stimulus_id="claim"))
    out = s.handle_stimulus(TaskFinished(worker=W1, key="a", nbytes=MB, stimulus_id="f"))
    ins = enqueued(out, "b")
    assert (ins.workers, ins.preferred, ins.sticky) == ((W1,), True, True)
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["b"], stimulus_id="claim-b"))
    assert not s.tasks["b"].sticky and s.tasks["b"].state == "processing"


def test_small_results_in_redis_make_nothing_sticky():
    """A dependency kept in its record comes with every claim's reply: nothing to move,
    no preference (the shared set), and so nothing sticky."""
    s = make(W1, W2)
    submit(s, "c1", [task("a"), task("c", ["a"])], ["c"])
    s.handle_stimulus(TaskClaimed(worker=W1, keys=["a"], stimulus_id="claim"))
    out = s.handle_stimulus(
        TaskFinished(worker=W1, key="a", nbytes=28, type="int", value=b"v", stimulus_id="f")
    )
    assert not enqueued(out, "c").sticky and not s.tasks["c"].sticky


def test_the_decision_takes_microseconds():
    s = make(W1, W2, W3)
    deps = [f"d{i}" for i in range(20)]
    submit(s, "c1", [*(task(d) for d in deps), task("c", deps)], ["c"])
    for i, d in enumerate(deps):
        finish(s, d, (W1, W2, W3)[i % 3], 1000 * (i + 1))
    ts = s.tasks["c"]
    n = 2000
    start = time.perf_counter()
    for _ in range(n):
        decide_worker(ts, s.workers)
        sticky(ts, 0.01)
    assert (time.perf_counter() - start) / n < 200e-6
