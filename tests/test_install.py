"""What gets installed: one top-level name, ``redisdask``, so a user's own modules named
``workers`` or ``nanny`` never collide with ours."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(90)

USER_SCRIPT = """
from redisdask import Client, LocalCluster
from workers import double
from nanny import who

with LocalCluster(n_workers=1, nanny=True, redis_url={redis_url!r}) as cluster:
    with Client(cluster) as client:
        assert client.submit(double, 21).result(timeout=30) == 42
        assert client.submit(who).result(timeout=30) == "the user's nanny module"
print("ok")
"""


def test_a_users_workers_and_nanny_modules_do_not_shadow_ours(
    tmp_path: Path, redis_url: str
) -> None:
    """Run from a directory holding ``workers.py`` and ``nanny.py``: the cluster starts
    (its worker and nanny processes import ``redisdask.workers``/``redisdask.nanny``), and
    the user's functions from those modules run on it, found by the workers by name."""
    (tmp_path / "workers.py").write_text("def double(x):\n    return 2 * x\n")
    (tmp_path / "nanny.py").write_text('def who():\n    return "the user\'s nanny module"\n')
    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent(USER_SCRIPT.format(redis_url=redis_url)))
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=80
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


def test_get_worker_is_importable_under_the_documented_name() -> None:
    from redisdask.workers import get_worker

    with pytest.raises(ValueError, match="outside of a task"):
        get_worker()
