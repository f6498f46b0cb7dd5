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


def test_a_redisdask_folder_in_the_working_directory_does_not_shadow_the_package(
    tmp_path: Path, redis_url: str
) -> None:
    """`redisdask demo` run in a source checkout: the working directory holds a
    ``redisdask/`` folder that is not the installed package (a checkout's lacks the
    ``redisdask.workers`` the install maps in).  The cluster's processes, scheduler, nannies
    and workers, import the package their parent imported, not that folder; the modules
    beside the script are found on the workers, as the script found them."""
    checkout = tmp_path / "checkout"
    (checkout / "redisdask").mkdir(parents=True)
    (checkout / "redisdask" / "__init__.py").write_text(
        "raise ImportError('the checkout folder was imported, not the installed package')\n"
    )
    script = tmp_path / "elsewhere" / "main.py"  # like a console script: not in the cwd
    script.parent.mkdir()
    (script.parent / "helpers.py").write_text("def triple(x):\n    return 3 * x\n")
    script.write_text(
        textwrap.dedent(
            USER_SCRIPT.format(redis_url=redis_url)
            .replace("from workers import double", "from helpers import triple as double")
            .replace("from nanny import who\n", "")
            .replace("== 42", "== 63")
            .replace("assert client.submit(who)", "# ")
        )
    )
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


def test_get_worker_is_importable_under_the_documented_name() -> None:
    from redisdask.workers import get_worker

    with pytest.raises(ValueError, match="outside of a task"):
        get_worker()
