"""The layering rules of ``pyproject.toml``'s ``[tool.importlinter]``, checked by
import-linter against the source tree: a change that imports up a layer fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_contracts_hold() -> None:
    # in a process of its own: import-linter configures logging with dictConfig, which
    # disables every logger that exists (later tests' caplog saw none of ours); run from
    # the root, where grimp finds redisdask/ as an editable install does
    linter = Path(sys.executable).parent / "lint-imports"
    args = ["--config", str(ROOT / "pyproject.toml"), "--no-cache"]
    result = subprocess.run(
        [str(linter), *args], cwd=ROOT, capture_output=True, text=True, timeout=110
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


# what a state machine may not reach, directly or through what it imports
IO_MODULES = ("redis", "socket", "asyncio", "redisdask.comm", "redisdask.store.connection")


@pytest.mark.parametrize("name", ["state.py", "transitions.py", "events.py"])
def test_the_workers_state_machine_is_sans_io(name: str) -> None:
    """``workers/state.py``, its transitions and its events are mapped in as
    ``redisdask.workers``, outside the folder grimp reads: their own imports are read here
    (of each other too), and grimp's graph says what each of the rest reaches."""
    import ast

    import grimp

    tree = ast.parse((ROOT / "workers" / name).read_text())
    imported = {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
    } | {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    ours = sorted(m for m in imported if m.startswith("redisdask"))
    assert ours, f"workers/{name} imports nothing of redisdask: the test reads the wrong file"
    assert not [m for m in imported if m.split(".")[0] in ("redis", "socket", "asyncio")]
    workers = [m for m in ours if m.startswith("redisdask.workers.")]
    machine = {"redisdask.workers.events", "redisdask.workers.transitions"}
    assert set(workers) <= machine, f"it imports {workers}"
    graph = grimp.build_graph("redisdask", include_external_packages=True, cache_dir=None)
    for module in set(ours) - set(workers):
        for io in IO_MODULES:
            assert module != io and not module.startswith(io + "."), f"it imports {module}"
            chain = graph.find_shortest_chain(importer=module, imported=io)
            assert chain is None, f"workers/{name} -> {' -> '.join(chain or ())}"


def test_the_cluster_processes_do_not_import_the_client() -> None:
    """A worker, a nanny and a scheduler run ``python -m redisdask``: the package's public
    names are imported at their first use (``redisdask.__getattr__``), so none of these
    processes pays for the client's modules at start (about a third of their start-up
    CPU), and importing a name still works."""
    code = (
        "import sys\n"
        "import redisdask.cli.commands, redisdask.scheduler.driver, redisdask.nanny.nanny\n"
        "from redisdask.workers import process\n"
        "process.make_dask_default(process._dask_get)  # (as a worker's main() starts)\n"
        "print(sorted(m for m in sys.modules if m.startswith('redisdask.client')))\n"
        "from redisdask import Client, LocalCluster, wait\n"
        "print(Client.__module__, LocalCluster.__module__, wait.__module__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    loaded, names = result.stdout.splitlines()
    assert loaded == "[]", f"the cluster's processes import {loaded}"
    assert names == "redisdask.client.client redisdask.deploy.cluster redisdask.client.futures"


def test_every_public_name_of_the_package_resolves() -> None:
    """The lazily imported names (``utils/lazy.py``) are exactly ``__all__``, a subpackage
    is reachable as an attribute after ``import redisdask``, and each public name imports
    when it is the first thing a program imports (an import cycle between subpackages
    shows only then: ``from redisdask import Lock`` once met the client half-made)."""
    import redisdask

    assert sorted([*redisdask._EXPORTS, "__version__"]) == sorted(redisdask.__all__)
    check = "import redisdask; assert redisdask.client.Client is redisdask.Client"
    runs = {"attribute": subprocess.Popen([sys.executable, "-c", check], stderr=subprocess.PIPE)}
    for name in redisdask._EXPORTS:  # (all at once: each is a fresh interpreter)
        code = f"from redisdask import {name}"
        runs[name] = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    failed = {}
    for name, proc in runs.items():
        _, err = proc.communicate(timeout=120)
        if proc.returncode:
            failed[name] = err.decode(errors="replace").strip().splitlines()[-1]
    assert failed == {}
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        redisdask.no_such_name  # noqa: B018
