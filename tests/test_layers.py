"""The layering rules of ``pyproject.toml``'s ``[tool.importlinter]``, checked by
import-linter against the source tree: a change that imports up a layer fails here."""

from __future__ import annotations

from pathlib import Path

import pytest
from importlinter.cli import lint_imports

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_contracts_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # (grimp finds redisdask/ from here, as an editable install does)
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True) == 0
