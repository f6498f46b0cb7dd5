"""How redisdask starts its own processes: a scheduler or worker of a ``LocalCluster``, a
nanny's worker.

``python -P -m redisdask ...``: without ``-P`` Python puts the working directory first on
``sys.path``, where a source checkout's ``redisdask/`` folder (which lacks the
``redisdask.workers`` and ``redisdask.nanny`` that the install maps in from ``workers/``
and ``nanny/``) would shadow the installed package, and a user's ``redis.py`` would shadow
redis.  Instead the child searches exactly where its parent searched: ``PYTHONPATH``
carries the parent's ``sys.path``, as multiprocessing's spawn does (an empty entry, the
working directory of an interactive session, as that directory).  So a function a client
pickled by reference from a module beside its script is found on the workers, and a
cluster started from a source checkout imports the package its parent imported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping


def command(*args: str) -> list[str]:
    """The command line of a ``redisdask`` subcommand run by this interpreter."""
    return [sys.executable, "-P", "-m", "redisdask", *args]


def environment(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (default ``os.environ``) plus ``extra``, with ``PYTHONPATH`` set to this
    process's ``sys.path``."""
    cwd = os.getcwd()
    paths = [path or cwd for path in sys.path]
    env = dict(os.environ if base is None else base)
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env
