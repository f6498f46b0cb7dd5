"""Code a client runs on the workers outside the task graph (issue 12, item 5), as
distributed's users call it: ``client.run``, ``wait_for_workers``, ``upload_file``,
worker plugins (``register_plugin``, ``unregister_worker_plugin``) and ``--preload``.
Real worker processes, real TCP, real Redis; evidence from the workers comes back through
``client.run`` itself or through files they write."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
import zipfile
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import ClusterFactory
from polling import poll

from redisdask import (
    Client,
    LocalCluster,
    WorkerPlugin,
    WorkerStartTimeoutError,
    WorkerUnresponsiveError,
)
from redisdask.client import worker_calls

pytestmark = pytest.mark.timeout(90)


def whoami(dask_worker: Any = None) -> tuple[str, str, int]:
    return dask_worker.address, dask_worker.name, os.getpid()


def add(x: int, y: int = 0) -> int:
    return x + y


async def async_name(suffix: str, dask_worker: Any = None) -> str:
    await asyncio.sleep(0)
    return dask_worker.name + suffix


def divide_by_zero() -> float:
    return 1 / 0


def wait_for(gate: str, started: str) -> str:
    """Say it started (a file named after this process), then wait for ``gate``."""
    Path(started, str(os.getpid())).write_text("started")
    deadline = time.monotonic() + 60
    while not os.path.exists(gate) and time.monotonic() < deadline:
        threading.Event().wait(0.01)
    return "done"


def plugins_of(dask_worker: Any = None) -> list[str]:
    return sorted(dask_worker.plugins)


def accepted(dask_worker: Any = None) -> int:
    """Connections this worker's TCP server accepted so far (each client.run opens one)."""
    return dask_worker.peers.server.n_accepted


def workers_by_name(client: Client) -> dict[str, dict[str, Any]]:
    return {w["name"]: w for w in client.scheduler_info()["workers"].values()}


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


class Recorder(WorkerPlugin):
    """Writes one line per call to a file the test reads."""

    def __init__(self, log: Path, name: str = "recorder") -> None:
        self.log, self.name = str(log), name

    def _write(self, line: str) -> None:
        with open(self.log, "a") as f:
            f.write(line + "\n")

    def setup(self, worker: Any) -> None:
        self._write(f"setup {worker.address}")

    def teardown(self, worker: Any) -> None:
        self._write(f"teardown {worker.address}")

    def transition(self, key: str, start: str, finish: str, **kwargs: Any) -> None:
        self._write(f"transition {key} {start} {finish}")


# ------------------------------------------------------------------ client.run


def test_run_returns_a_result_per_worker_keyed_by_address(client: Client) -> None:
    workers = workers_by_name(client)
    results = client.run(whoami)
    assert results is not None and set(results) == {w["address"] for w in workers.values()}
    for address, (seen, name, pid) in results.items():
        assert seen == address and workers[name]["address"] == address
        assert workers[name]["pid"] == pid  # it ran in that worker's process
    assert set(client.run(add, 1, y=2).values()) == {3}
    assert set(client.run(async_name, "!").values()) == {"worker-0!", "worker-1!"}


def test_run_restricted_by_address_or_name(client: Client) -> None:
    workers = workers_by_name(client)
    first, second = workers["worker-0"]["address"], workers["worker-1"]["address"]
    assert client.run(whoami, workers=["worker-0"]) == {
        first: (first, "worker-0", workers["worker-0"]["pid"])
    }
    assert list(client.run(whoami, workers=[second]) or {}) == [second]
    assert list(client.run(whoami, workers=second) or {}) == [second]  # one, as a str
    with pytest.raises(ValueError, match="no worker with address or name \\['nobody'\\]"):
        client.run(whoami, workers=["worker-0", "nobody"])


def test_an_exception_in_run_is_reraised_with_the_worker_named(client: Client) -> None:
    first = workers_by_name(client)["worker-0"]["address"]
    with pytest.raises(ZeroDivisionError) as info:
        client.run(divide_by_zero, workers=["worker-0"])
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert f"raised on worker {first} (worker-0) by client.run(divide_by_zero)" in notes
    assert info.traceback[-1].name == "divide_by_zero"  # the remote traceback came along
    returned = client.run(divide_by_zero, on_error="return")
    assert returned is not None and len(returned) == 2
    assert all(isinstance(e, ZeroDivisionError) for e in returned.values())
    assert client.run(divide_by_zero, on_error="ignore") == {}
    with pytest.raises(ValueError, match="on_error must be"):
        client.run(divide_by_zero, on_error="shrug")  # type: ignore[arg-type]
    assert len(client.run(add, 1) or {}) == 2  # the workers are fine


def test_run_with_wait_false_returns_none_and_runs_anyway(client: Client, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    assert client.run(wait_for, str(gate), str(tmp_path), wait=False) is None
    pids = {w["pid"] for w in client.scheduler_info()["workers"].values()}
    poll(lambda: {p.name for p in tmp_path.iterdir()} >= {str(p) for p in pids})
    gate.write_text("open")  # returned before the functions could finish


def test_run_of_an_unpicklable_function_fails_before_anything_is_sent(client: Client) -> None:
    lock = threading.Lock()
    before = client.run(accepted)
    with pytest.raises(TypeError, match=r"cannot be pickled.*nothing was sent"):
        client.run(lambda: lock.locked())
    with pytest.raises(TypeError, match="cannot be pickled"):
        client.run(add, lock)
    with pytest.raises(TypeError, match="needs a function"):
        client.run(42)  # type: ignore[arg-type]
    after = client.run(accepted)
    assert before is not None and after is not None
    assert all(after[a] == before[a] + 1 for a in before)  # only this last run's connection
    r = redis.Redis.from_url(client.redis_url)
    assert r.hlen(client.keys.uploads) == 0 and r.hlen(client.keys.worker_plugins) == 0


def test_a_worker_killed_during_a_run_is_named_within_the_timeout(
    client: Client, tmp_path: Path
) -> None:
    workers = workers_by_name(client)
    victim, survivor = workers["worker-0"], workers["worker-1"]
    gate, outcome = tmp_path / "gate", {}

    def run() -> None:
        start = time.monotonic()
        try:
            outcome["result"] = client.run(wait_for, str(gate), str(tmp_path), timeout=30)
        except Exception as exc:
            outcome["error"] = exc
        outcome["took"] = time.monotonic() - start

    caller = threading.Thread(target=run)
    caller.start()
    poll(lambda: (tmp_path / str(victim["pid"])).exists())  # it runs there now
    os.kill(victim["pid"], signal.SIGKILL)
    gate.write_text("open")
    caller.join(40)
    error = outcome["error"]
    assert isinstance(error, WorkerUnresponsiveError)
    assert list(error.unanswered) == [victim["address"]]
    assert f"{victim['address']} (worker-0)" in str(error) and "has it died?" in str(error)
    assert error.results == {survivor["address"]: "done"}
    assert outcome["took"] < 25  # the death is seen at once, not at the timeout


def test_a_dead_or_stopped_worker_is_named_instead_of_a_hang(client: Client) -> None:
    workers = workers_by_name(client)
    stopped, dead = workers["worker-0"], workers["worker-1"]
    os.kill(stopped["pid"], signal.SIGSTOP)  # alive but silent: registered a while yet
    try:
        start = time.monotonic()
        with pytest.raises(WorkerUnresponsiveError, match="no answer within 1 s") as info:
            client.run(add, 1, workers=[stopped["address"]], timeout=1)
        assert time.monotonic() - start < 5
        assert list(info.value.unanswered) == [stopped["address"]]
    finally:
        os.kill(stopped["pid"], signal.SIGCONT)
    os.kill(dead["pid"], signal.SIGKILL)
    start = time.monotonic()
    # the scheduler may already have removed it: named either way, at once
    with pytest.raises((WorkerUnresponsiveError, ValueError), match=dead["address"]):
        client.run(add, 1, workers=[dead["address"]], timeout=10)
    assert time.monotonic() - start < 5


def test_run_on_scheduler_says_why_not_and_what_instead(client: Client) -> None:
    with pytest.raises(NotImplementedError, match=r"no scheduler process.*client\.run"):
        client.run_on_scheduler(add, 1)


# ------------------------------------------------------------------ wait_for_workers


def test_wait_for_workers_waits_for_a_worker_started_later(
    cluster: LocalCluster, client: Client
) -> None:
    client.wait_for_workers(2, timeout=5)
    with pytest.raises(WorkerStartTimeoutError, match="only 2 of 3 workers arrived") as info:
        client.wait_for_workers(3, timeout=0.3)
    assert isinstance(info.value, TimeoutError)
    assert (info.value.available_workers, info.value.expected_workers) == (2, 3)
    assert cluster.cluster_name in str(info.value)
    cluster.start_worker(name="late")
    client.wait_for_workers(3, timeout=30)
    assert "late" in workers_by_name(client)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            client.wait_for_workers(bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------ upload_file


def module_file(directory: Path, body: str) -> Path:
    path = directory / f"rdupload_{uuid.uuid4().hex[:8]}.py"
    path.write_text(body)
    return path


def is_imported(name: str) -> bool:
    return name in sys.modules


def module_value(name: str) -> Any:
    return sys.modules[name].VALUE


def test_upload_file_reaches_current_and_later_workers(
    cluster: LocalCluster, client: Client, tmp_path: Path
) -> None:
    path = module_file(tmp_path, "VALUE = 1\n\ndef double(x):\n    return 2 * x\n")
    name = path.stem
    assert str(tmp_path) not in sys.path  # workers search where this process does
    answers = client.upload_file(path)
    assert set(answers) == set(client.scheduler_info()["workers"])
    assert set(client.run(is_imported, name).values()) == {True}  # load=True imports it
    # a task imports it by name ...
    assert client.submit(lambda x: __import__(name).double(x), 21).result() == 42
    # ... and a function of it, imported here too, is sent by reference
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        assert client.submit(module.double, 5).result() == 10
        cluster.start_worker(name="late")  # after the upload
        client.wait_for_workers(3, timeout=30)
        assert client.run(is_imported, name, workers=["late"]) == {
            workers_by_name(client)["late"]["address"]: True
        }
        assert client.submit(module.double, 7, workers=["late"], pure=False).result() == 14
        path.write_text("VALUE = 2\n\ndef double(x):\n    return 4 * x\n")
        client.upload_file(path)  # the same name again: replaced and reloaded everywhere
        assert set(client.run(module_value, name).values()) == {2}
    finally:
        del sys.modules[name]
    r = redis.Redis.from_url(client.redis_url)
    assert r.hkeys(client.keys.uploads) == [path.name.encode()]


def test_upload_file_of_an_archive_with_load_false_is_importable_by_tasks(
    client: Client, tmp_path: Path
) -> None:
    package = f"rdzip_{uuid.uuid4().hex[:8]}"
    archive = tmp_path / f"{package}.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr(f"{package}/__init__.py", "def triple(x):\n    return 3 * x\n")
    client.upload_file(archive, load=False)
    assert set(client.run(is_imported, package).values()) == {False}  # not imported ...
    assert client.submit(lambda x: __import__(package).triple(x), 3).result() == 9  # ... yet


def test_upload_file_refuses_bad_files_and_leaves_nothing_behind(
    client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = redis.Redis.from_url(client.redis_url)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match=r"only \.py, \.zip, \.egg, \.pyz files"):
        client.upload_file(text)
    with pytest.raises(FileNotFoundError, match="no file"):
        client.upload_file(tmp_path / "absent.py")
    with pytest.raises(SyntaxError) as syntax:
        client.upload_file(module_file(tmp_path, "def broken(:\n"))
    assert "nothing was uploaded" in "\n".join(syntax.value.__notes__)
    failing = module_file(tmp_path, "raise RuntimeError('no import for you')\n")
    with pytest.raises(RuntimeError, match="no import for you") as info:
        client.upload_file(failing)
    notes = "\n".join(info.value.__notes__)
    assert "raised on worker" in notes and "was undone" in notes
    assert r.hlen(client.keys.uploads) == 0
    not_zip = tmp_path / "lib.zip"
    not_zip.write_bytes(b"PK? no")
    with pytest.raises(ValueError, match="not a zip archive"):
        client.upload_file(not_zip)
    monkeypatch.setattr(worker_calls, "MAX_ENTRY_BYTES", 100)
    with pytest.raises(ValueError, match="more than the 100 B"):
        client.upload_file(module_file(tmp_path, "# " + "x" * 200 + "\n"))
    assert r.hlen(client.keys.uploads) == 0
    assert len(client.run(add, 1) or {}) == 2  # the workers are fine


# ------------------------------------------------------------------ plugins


def test_a_plugin_is_set_up_on_current_and_later_workers_and_sees_transitions(
    cluster: LocalCluster, client: Client, tmp_path: Path
) -> None:
    log = tmp_path / "plugin.log"
    first = set(client.scheduler_info()["workers"])
    assert set(client.register_plugin(Recorder(log))) == first
    assert sorted(lines(log)) == sorted(f"setup {a}" for a in first)
    assert set(map(tuple, client.run(plugins_of).values())) == {("recorder",)}

    future = client.submit(add, 1, 2)
    assert future.result() == 3
    moves = [line.split()[2:] for line in lines(log) if line.startswith(f"transition {future.key}")]
    for move in (["ready", "executing"], ["executing", "memory"]):
        assert move in moves

    cluster.start_worker(name="late")
    client.wait_for_workers(3, timeout=30)
    late = workers_by_name(client)["late"]["address"]
    assert f"setup {late}" in lines(log)  # set up before it registered, so before any claim
    r = redis.Redis.from_url(client.redis_url)
    assert r.hkeys(client.keys.worker_plugins) == [b"recorder"]

    client.retire_workers(workers=["late"])  # a worker that closes tears its plugins down
    poll(lambda: f"teardown {late}" in lines(log))
    assert set(client.unregister_worker_plugin("recorder")) == first
    assert sorted(line for line in lines(log) if line.startswith("teardown")) == sorted(
        f"teardown {a}" for a in {*first, late}
    )
    assert set(map(tuple, client.run(plugins_of).values())) == {()}
    assert r.hlen(client.keys.worker_plugins) == 0
    with pytest.raises(ValueError, match="no worker plugin named 'recorder'"):
        client.unregister_worker_plugin("recorder")


def test_a_plugin_of_the_same_name_replaces_the_old_unless_idempotent(
    client: Client, tmp_path: Path
) -> None:
    old, new = tmp_path / "old.log", tmp_path / "new.log"
    client.register_plugin(Recorder(old), name="p")
    client.register_plugin(Recorder(new), name="p")
    assert len([x for x in lines(old) if x.startswith("teardown")]) == 2
    assert len([x for x in lines(new) if x.startswith("setup")]) == 2

    class Once(Recorder):
        idempotent = True

    assert client.register_plugin(Once(old), name="p") == {}  # taken: nothing happens
    assert len([x for x in lines(new) if x.startswith("teardown")]) == 0


class FailingSetup(WorkerPlugin):
    def setup(self, worker: Any) -> None:
        raise ValueError(f"cannot set up on {worker.name}")


class FailingTransition(WorkerPlugin):
    def transition(self, key: str, start: str, finish: str, **kwargs: Any) -> None:
        raise RuntimeError("a plugin bug")


def test_plugin_errors_never_crash_a_worker_and_a_failed_setup_is_not_kept(
    client: Client,
) -> None:
    r = redis.Redis.from_url(client.redis_url)
    with pytest.raises(ValueError, match="cannot set up on worker-") as info:
        client.register_plugin(FailingSetup(), name="failing")
    assert "raised on worker" in "\n".join(info.value.__notes__)
    assert r.hlen(client.keys.worker_plugins) == 0  # nothing left for later workers
    assert set(map(tuple, client.run(plugins_of).values())) == {()}
    client.register_plugin(FailingTransition(), name="buggy")
    assert client.submit(add, 2, 3).result() == 5  # the worker logged it and went on
    assert len(client.run(add, 1) or {}) == 2


def test_what_cannot_be_a_worker_plugin_is_refused_clearly(client: Client) -> None:
    with pytest.raises(TypeError, match="an instance of a plugin, not the class Recorder"):
        client.register_plugin(Recorder)
    with pytest.raises(TypeError, match="none of the methods setup, teardown, transition"):
        client.register_plugin(object())
    lock = threading.Lock()

    class Unpicklable(WorkerPlugin):
        def setup(self, worker: Any) -> None:
            lock.locked()

    with pytest.raises(TypeError, match=r"cannot be pickled.*nothing was registered"):
        client.register_plugin(Unpicklable(), name="u")
    assert redis.Redis.from_url(client.redis_url).hlen(client.keys.worker_plugins) == 0


def test_distributed_plugins_and_the_older_alias(client: Client, tmp_path: Path) -> None:
    import distributed.diagnostics.plugin as plugin_module

    class Scheduled(plugin_module.SchedulerPlugin):
        pass

    with pytest.raises(NotImplementedError, match="no scheduler process"):
        client.register_plugin(Scheduled())
    log = str(tmp_path / "distributed.log")

    class Theirs(plugin_module.WorkerPlugin):
        def setup(self, worker: Any) -> None:
            with open(log, "a") as f:
                f.write(f"setup {worker.name}\n")

    with pytest.warns(DeprecationWarning, match="use register_plugin"):
        client.register_worker_plugin(Theirs(), name="theirs")
    assert sorted(lines(Path(log))) == ["setup worker-0", "setup worker-1"]


# ------------------------------------------------------------------ --preload


PRELOAD = """
import os

def dask_setup(worker):
    worker.preloaded = "yes"
    with open(os.path.join({directory!r}, "setup-" + str(os.getpid())), "w") as f:
        f.write(worker.address)

def dask_teardown(worker):
    with open(os.path.join({directory!r}, "teardown-" + str(os.getpid())), "w") as f:
        f.write(worker.address)
"""


def preloaded(dask_worker: Any = None) -> str:
    return getattr(dask_worker, "preloaded", "no")


@pytest.mark.parametrize("nanny", [False, True])
def test_preload_runs_dask_setup_at_start_and_dask_teardown_at_close(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    nanny: bool,
    make_cluster: ClusterFactory,
) -> None:
    name = f"rdpreload_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(PRELOAD.format(directory=str(tmp_path)))
    monkeypatch.syspath_prepend(str(tmp_path))  # the workers import what this process can
    with (
        make_cluster(
            n_workers=1,
            nanny=nanny,
            worker_options={"preload": [name] if nanny else name},  # (a list: repeated)
        ) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        [(address, info)] = client.scheduler_info()["workers"].items()
        assert (tmp_path / f"setup-{info['pid']}").read_text() == address
        assert client.run(preloaded) == {address: "yes"}
    assert (tmp_path / f"teardown-{info['pid']}").read_text() == address


def worker_command(cluster_name: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "redisdask", "worker", "--cluster", cluster_name, *args]


def test_a_preload_that_cannot_be_imported_stops_the_worker_naming_it(
    redis_url: str, cluster_name: str, tmp_path: Path
) -> None:
    env = dict(os.environ, REDISDASK__REDIS__URL=redis_url, PYTHONPATH=str(tmp_path))
    (tmp_path / "rdpreload_raises.py").write_text("raise RuntimeError('not today')\n")
    cases = [
        (["--no-nanny", "--preload", "rd_no_such_module"], "cannot import it"),
        (["--preload", "rd_no_such_module"], "no such module or file"),  # said by the nanny
        (["--no-nanny", "--preload", "rdpreload_raises"], "RuntimeError: not today"),
    ]
    for args, why in cases:
        done = subprocess.run(
            worker_command(cluster_name, *args), env=env, capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert args[-1] in done.stderr and why in done.stderr
    assert redis.Redis.from_url(redis_url).hlen(f"rd:{{{cluster_name}}}:workers") == 0
