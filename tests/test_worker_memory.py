"""The worker's memory manager on its own (no worker), the nanny <-> worker contract, and
whether a worker process gives back the memory of the results it no longer holds."""

from __future__ import annotations

import ast
import asyncio
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from conftest import ClusterFactory
from polling import poll

from redisdask import Client, nanny_contract, wait
from redisdask.workers import memory as memory_module
from redisdask.workers.memory import WorkerMemoryManager
from redisdask.workers.spill import SpillBuffer

pytestmark = pytest.mark.timeout(60)

MB, MiB = 1_000_000, 2**20


class _Calls:
    def __init__(self) -> None:
        self.paused: list[str] = []
        self.unpaused: list[str] = []
        self.notes: list[tuple[str, str]] = []
        self.spill_failed: list[dict[str, Any]] = []


def _manager(
    tmp_path: Path, calls: _Calls, memory_limit: int, **fractions: Any
) -> WorkerMemoryManager:
    options = {"target": 0.6, "spill": 0.7, "pause": 0.8} | fractions
    return WorkerMemoryManager(
        memory_limit=memory_limit,
        monitor_interval=0.01,
        local_directory=tmp_path,
        label="tcp://test",
        on_pause=calls.paused.append,
        on_unpause=calls.unpaused.append,
        note=lambda kind, detail: calls.notes.append((kind, detail)),
        in_memory_bytes=lambda: 1234,
        on_spill_failed=calls.spill_failed.append,
        **options,
    )


def _rss() -> int:
    return psutil.Process().memory_info().rss


def array(i: int, nbytes: int) -> np.ndarray:
    """A result of ``nbytes``, made in 10 ms."""
    threading.Event().wait(0.01)
    return np.full(nbytes // 8, i, dtype="f8")


def test_no_limit_is_a_plain_dict_without_monitor(tmp_path: Path) -> None:
    calls = _Calls()
    memory = _manager(tmp_path, calls, memory_limit=0)
    assert type(memory.data) is dict
    assert not memory.monitoring
    metrics = memory.metrics()
    assert metrics["managed"] == 1234 and metrics["spilled"] == 0
    assert metrics["rss"] > 0 and metrics["memory_limit"] == 0
    memory.close()
    assert list(tmp_path.iterdir()) == []  # no spill directory was made


def test_spills_pauses_and_unpauses_through_callbacks(tmp_path: Path) -> None:
    calls = _Calls()
    # a limit the process is already far past: every threshold is crossed
    memory = _manager(tmp_path, calls, memory_limit=_rss() // 4)
    assert isinstance(memory.data, SpillBuffer) and memory.monitoring
    assert memory.spill_directory is not None and memory.spill_directory.parent == tmp_path
    for i in range(30):
        memory.data[f"x-{i}"] = b"x" * 1000
    asyncio.run(memory.check())
    assert memory.paused and len(calls.paused) == 1 and calls.unpaused == []
    assert "of" in calls.paused[0]  # the process memory against the limit
    assert [kind for kind, _ in calls.notes] == ["spill"]
    assert memory.metrics()["spilled"] == 30 * 1000  # everything went to disk
    assert memory.data["x-3"] == b"x" * 1000  # read back from disk

    asyncio.run(memory.check())  # still past pause: no second call
    assert len(calls.paused) == 1

    memory.memory_limit = _rss() * 100  # far below every threshold now
    asyncio.run(memory.check())
    assert not memory.paused and len(calls.unpaused) == 1
    directory = memory.spill_directory
    memory.close()
    assert not directory.exists()


def test_a_failing_spill_is_told_once_then_again_when_paused_and_until_it_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _Calls()
    memory = _manager(tmp_path, calls, memory_limit=_rss() // 4, pause=False)
    directory = memory.spill_directory
    assert directory is not None
    directory.rmdir()
    directory.write_bytes(b"")  # a file where the directory was: every write fails
    for i in range(3):
        memory.data[f"x-{i}"] = b"x" * 1000
    asyncio.run(memory.check())
    assert memory.metrics()["spill_error"] == "Not a directory"
    [news] = calls.spill_failed
    assert news["error"] == "Not a directory" and news["directory"] == str(directory)
    assert news["managed"] == 3000 and news["paused"] is False
    asyncio.run(memory.check())  # still failing, not paused: nothing new to tell
    memory.pause = 0.8  # now it pauses: told again, and again after SPILL_FAILED_REPEAT
    asyncio.run(memory.check())
    assert [n["paused"] for n in calls.spill_failed] == [False, True]
    asyncio.run(memory.check())
    assert len(calls.spill_failed) == 2
    monkeypatch.setattr(memory_module, "SPILL_FAILED_REPEAT", 0.0)
    asyncio.run(memory.check())
    assert len(calls.spill_failed) == 3
    assert list(memory.data) == ["x-0", "x-1", "x-2"]  # nothing lost
    directory.unlink()
    directory.mkdir()  # room again: the next spill works, the failure is over
    asyncio.run(memory.check())
    assert memory.metrics()["spill_error"] is None and memory.metrics()["spilled"] == 3000
    assert ("spill", "spilling works again") in calls.notes
    memory.close()


def test_pause_false_never_pauses(tmp_path: Path) -> None:
    calls = _Calls()
    memory = _manager(tmp_path, calls, memory_limit=_rss() // 4, pause=False)
    asyncio.run(memory.check())
    assert calls.paused == [] and not memory.paused
    memory.close()


def test_nanny_contract_round_trip(tmp_path: Path) -> None:
    env = {"OTHER": "1"} | nanny_contract.worker_environment(
        42, tmp_path / "reason", tmp_path / "address", 3
    )
    link = nanny_contract.take_from_environment(env)
    assert link == nanny_contract.NannyLink(
        42, str(tmp_path / "reason"), str(tmp_path / "address"), 3
    )
    assert env == {"OTHER": "1"}  # taken out: a task's subprocess has no nanny
    assert nanny_contract.take_from_environment({}) == nanny_contract.NannyLink()


def test_the_nanny_does_not_import_the_worker_driver() -> None:
    code = "import sys, redisdask.nanny.nanny; print('redisdask.workers.worker' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_memory_manager_does_not_import_the_worker_driver() -> None:
    tree = ast.parse(Path(memory_module.__file__ or "").read_text())
    imported = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert not {m for m in imported if m and m.startswith("redisdask.workers.worker")}


class _Weighed:
    """A value that counts how often it is sized (``sys.getsizeof`` calls this)."""

    calls = 0

    def __sizeof__(self) -> int:
        _Weighed.calls += 1
        return 100


def test_a_value_the_worker_measured_is_not_weighed_again(tmp_path: Path) -> None:
    """Sizing a DataFrame costs as much as a small task: the spill buffer weighs a value by
    the size the worker measured when it made or received it (``known``), on the way in,
    to disk and back, and sizes only what nobody measured."""
    buffer = SpillBuffer(tmp_path, target=150)
    buffer.known = {"a": 100, "b": 90}.get
    _Weighed.calls = 0
    buffer["a"] = _Weighed()
    assert buffer.managed_in_memory == 100
    buffer["b"] = _Weighed()  # 190 > 150: "a", the least recently used, goes to disk
    assert buffer.managed_in_memory == 90 and buffer.spilled_bytes == 100
    assert isinstance(buffer["a"], _Weighed)  # back: "b" goes to disk
    assert buffer.managed_in_memory == 100 and buffer.spilled_bytes == 90
    assert _Weighed.calls == 0
    buffer["unmeasured"] = _Weighed()
    assert _Weighed.calls >= 1


def test_values_are_sized_as_dask_sizes_them_once_dask_is_loaded() -> None:
    """A worker that runs dask graphs (dask is imported) sizes values with dask's own
    rules, so the bytes it reports mean what Dask's mean; its fallback no longer counts a
    dict subclass with its own ``__sizeof__`` twice (a shuffle's ``ShuffleGroupResult``)."""
    import dask.sizeof
    import pandas as pd

    from redisdask.workers import sizeof as sizes

    frame = pd.DataFrame({"a": range(1000), "b": [0.5] * 1000})
    assert sizes.sizeof(frame) == dask.sizeof.sizeof(frame)

    class Groups(dict):  # (a dict that sizes its values, as dask's does)
        def __sizeof__(self) -> int:
            return dict.__sizeof__(self) + sum(len(v) for v in self.values())

    groups = Groups({0: b"x" * 100_000, 1: b"y" * 100_000})
    assert 200_000 <= sizes._fallback(groups) < 210_000


def test_a_worker_process_gives_back_the_memory_of_its_released_results(
    make_cluster: ClusterFactory,
) -> None:
    """Results made and released in rounds, one of each kept: the worker process holds
    what it keeps, not what glibc kept of what it released (``keep_large_blocks_apart``).
    Before, it held three times as much, and a worker past its pause mark after spilling
    stayed paused for good."""
    with (
        make_cluster(
            nanny=False,
            n_workers=1,
            threads_per_worker=2,
        ) as cluster,
        Client(cluster) as client,
    ):
        process = psutil.Process(cluster.worker_processes[0].pid)
        assert client.gather(client.map(str, range(10)))  # imports done, pools started
        base = process.memory_info().rss
        kept = []
        for round in range(4):
            futures = client.map(array, range(8 * round, 8 * round + 8), nbytes=8 * MB)
            wait(futures)
            kept.append(futures[3])
            del futures
        held = len(kept) * 8 * MB
        poll(lambda: process.memory_info().rss - base < held + 20 * MiB, timeout=20)
        assert [f.result()[0] for f in kept] == [3, 11, 19, 27]
