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


def test_the_workers_state_machine_is_sans_io() -> None:
    """``workers/state.py`` is mapped in as ``redisdask.workers.state``, outside the folder
    grimp reads: its own imports are read here, and grimp's graph says what each reaches."""
    import ast

    import grimp

    tree = ast.parse((ROOT / "workers" / "state.py").read_text())
    imported = {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
    } | {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    ours = sorted(m for m in imported if m.startswith("redisdask"))
    assert ours, "workers/state.py imports nothing of redisdask: the test reads the wrong file"
    assert not [m for m in imported if m.split(".")[0] in ("redis", "socket", "asyncio")]
    graph = grimp.build_graph("redisdask", include_external_packages=True, cache_dir=None)
    for module in ours:
        for io in IO_MODULES:
            assert module != io and not module.startswith(io + "."), f"it imports {module}"
            chain = graph.find_shortest_chain(importer=module, imported=io)
            assert chain is None, f"workers/state.py -> {' -> '.join(chain or ())}"
