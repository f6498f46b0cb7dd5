"""What a worker runs besides tasks: ``--preload`` modules, files uploaded with
``client.upload_file`` and worker plugins (``client.register_plugin``).

Uploads and plugins live in Redis (``rd:{c}:uploads``, ``rd:{c}:worker-plugins``; see
``docs/redis-schema.md``), so a worker that starts later gets them too: ``PluginHost.sync``
reads both hashes and applies what changed since it last looked (each entry carries a
token that changes when it is written again).  A worker syncs before it registers, again
just after (what was registered in between reaches it either way), and whenever a client
asks (the ``sync-plugins`` call of ``workers/calls.py``).

Nothing here lets user code crash the worker: an exception in a plugin or a preload hook
is logged; the error of a ``setup``, a ``teardown`` or an import is also handed back to
the client that asked for it.  Only a preload that cannot be imported stops the worker
at start, with an error that names the module.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import os
import pickle
import pkgutil
import shutil
import sys
import tempfile
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from redisdask.errors import ConfigError
from redisdask.plugins import UPLOAD_SUFFIXES
from redisdask.store import codecs
from redisdask.workers.calls import call_user, in_thread

if TYPE_CHECKING:
    from redisdask.workers.state import WorkerState
    from redisdask.workers.worker import Worker

logger = logging.getLogger("redisdask.worker")

CLOSE_HOOK_TIMEOUT = 10.0  # seconds each teardown may take when the worker closes


# ------------------------------------------------------------------ importing files


def import_file(path: Path) -> list[ModuleType]:
    """Import what a ``.py``, ``.zip``, ``.egg`` or ``.pyz`` file holds (distributed's
    ``import_file``): the module of a ``.py`` file from its directory, the top-level
    modules of an archive, which stays on ``sys.path``.  A module imported before is
    reloaded, so a file uploaded again replaces its code."""
    names: list[str] = []
    added = None  # the directory of a .py file, on sys.path for its import only
    if path.suffix == ".py":
        if str(path.parent) not in sys.path:
            added = str(path.parent)
            sys.path.insert(0, added)
        names.append(path.stem)
        cached = importlib.util.cache_from_source(str(path))
        if os.path.exists(cached):  # a .pyc of an older upload with the same size and mtime
            os.remove(cached)
    else:
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
        names.extend(info.name for info in pkgutil.iter_modules([str(path)]))
    if not names:
        logger.warning("found nothing to import in %s", path.name)
    importlib.invalidate_caches()
    modules = []
    try:
        for name in names:
            logger.info("import module %s from %s", name, path.name)
            module = sys.modules.get(name)
            modules.append(importlib.reload(module) if module else importlib.import_module(name))
    finally:
        if added is not None:
            sys.path.remove(added)
    return modules


# ------------------------------------------------------------------ preloads


class Preload:
    """A ``--preload`` module: imported when the worker is made (an import that fails
    stops the worker at once, naming the module), its ``dask_setup(worker)`` called at
    start and ``dask_teardown(worker)`` at close, if it defines them (as in distributed)."""

    def __init__(self, name: str) -> None:
        self.name = name
        try:
            if name.endswith(".py"):
                self.module = import_file(Path(name).resolve())[0]
            else:
                self.module = importlib.import_module(name)
        except Exception as exc:
            raise ConfigError(
                f"--preload {name!r}: cannot import it ({type(exc).__name__}: {exc}). A "
                "preload is a module the worker can import (installed, or on its "
                "PYTHONPATH) or the path of a .py file",
                key="--preload",
                value=name,
            ) from exc

    async def hook(self, which: str, worker: Worker, timeout: float | None = None) -> None:
        function = getattr(self.module, which, None)
        if function is None:
            return
        logger.info("run %s of preload %s", which, self.name)
        try:
            await asyncio.wait_for(call_user(function, worker), timeout)
        except Exception:
            logger.exception("%s of preload %s failed", which, self.name)


# ------------------------------------------------------------------ the host


class PluginHost:
    """A worker's preloads, uploaded files and plugins (``plugins``: name -> plugin, the
    dict a worker exposes as ``worker.plugins``, as distributed's does)."""

    def __init__(self, preload: str | Sequence[str] | None, local_directory: Path) -> None:
        names = [preload] if isinstance(preload, str) else list(preload or ())
        self.preloads = [Preload(name) for name in names]
        self.local_directory = local_directory
        self.upload_directory: Path | None = None
        self.plugins: dict[str, Any] = {}
        self._tokens: dict[tuple[str, str], str] = {}  # (kind, name) -> token applied
        self._lock = asyncio.Lock()
        self._story_seen = 0  # WorkerState.story_total when plugins last heard of it
        self._background: set[asyncio.Task[Any]] = set()
        self._closing = False

    async def start(self, worker: Worker) -> None:
        """Before the worker registers: preloads' ``dask_setup``, then uploads and plugins."""
        self.local_directory.mkdir(parents=True, exist_ok=True)
        directory = tempfile.mkdtemp(prefix="uploads-", dir=self.local_directory)
        self.upload_directory = Path(directory)
        sys.path.insert(0, directory)  # an upload with load=False is importable by tasks
        for preload in self.preloads:
            await preload.hook("dask_setup", worker)
        await self.sync(worker)

    async def sync(self, worker: Worker) -> dict[tuple[str, str], BaseException]:
        """Apply the uploads and plugins in Redis that changed since the last look, and
        tear down the plugins that were removed.  Returns the errors, keyed by
        ``(kind, name)`` (kind ``upload`` or ``plugin``)."""
        async with self._lock:
            if self._closing:  # its plugins are torn down: set up nothing more
                return {}
            pipe = worker.redis.pipeline(transaction=False)
            pipe.hgetall(worker.keys.uploads)
            pipe.hgetall(worker.keys.worker_plugins)
            uploads, plugins = await pipe.execute()
            errors: dict[tuple[str, str], BaseException] = {}
            for name, entry in _by_time(uploads):
                if self._tokens.get(("upload", name)) != entry["token"]:
                    self._tokens["upload", name] = entry["token"]
                    await self._upload(name, entry, errors)
            wanted = {name for name, _ in _by_time(plugins)}
            for name in reversed(list(self.plugins)):
                if ("plugin", name) in self._tokens and name not in wanted:
                    await self._remove(worker, name, errors)
            for kind, name in list(self._tokens):
                if kind == "plugin" and name not in wanted:
                    del self._tokens[kind, name]  # its setup had failed: nothing to remove
            for name, entry in _by_time(plugins):
                if self._tokens.get(("plugin", name)) != entry["token"]:
                    await self._add(worker, name, entry, errors)
            return errors

    async def _upload(
        self, name: str, entry: dict[str, Any], errors: dict[tuple[str, str], BaseException]
    ) -> None:
        assert self.upload_directory is not None
        path = self.upload_directory / Path(name).name
        try:
            if path.name != name or path.suffix not in UPLOAD_SUFFIXES:
                raise ValueError(f"refusing to write an upload named {name!r}")
            await in_thread(_write_and_import, path, entry["data"], entry["load"])
        except Exception as exc:
            logger.exception("uploaded file %s could not be imported", name)
            errors["upload", name] = exc

    async def _add(
        self,
        worker: Worker,
        name: str,
        entry: dict[str, Any],
        errors: dict[tuple[str, str], BaseException],
    ) -> None:
        if name in self.plugins:  # replaced: the old one's teardown error is only logged
            await self._remove(worker, name, {})
        self._tokens["plugin", name] = entry["token"]
        try:
            plugin = pickle.loads(entry["plugin"])
            if callable(getattr(plugin, "setup", None)):
                await call_user(plugin.setup, worker=worker)
        except Exception as exc:
            logger.exception("worker plugin %s failed to set up", name)
            errors["plugin", name] = exc
            return
        logger.info("worker plugin %s set up", name)
        self.plugins[name] = plugin

    async def _remove(
        self,
        worker: Worker,
        name: str,
        errors: dict[tuple[str, str], BaseException],
        timeout: float | None = None,
    ) -> None:
        plugin = self.plugins.pop(name)
        self._tokens.pop(("plugin", name), None)
        try:
            if callable(getattr(plugin, "teardown", None)):
                await asyncio.wait_for(call_user(plugin.teardown, worker=worker), timeout)
        except Exception as exc:
            logger.exception("worker plugin %s failed to tear down", name)
            errors["plugin", name] = exc

    def transitions(self, state: WorkerState) -> None:
        """Tell the plugins of the task transitions the state machine made since the last
        call (from its story; the state machine itself knows nothing of plugins)."""
        seen, self._story_seen = self._story_seen, state.story_total
        if not self.plugins or seen == state.story_total:
            return
        plugins = [(n, p.transition) for n, p in self.plugins.items() if hasattr(p, "transition")]
        for key, start, finish, _sid, _time in state.story_since(seen):
            if start == "forgotten":  # a note about a key it does not know, no transition
                continue
            for name, transition in plugins:
                try:
                    transition(key, start, finish)
                except Exception:
                    logger.exception("worker plugin %s failed in transition(%r)", name, key)

    def in_background(self, call: Coroutine[Any, Any, Any], name: str) -> None:
        """Run a ``client.run(..., wait=False)`` call; its error is logged."""

        def done(task: asyncio.Task[Any]) -> None:
            self._background.discard(task)
            if not task.cancelled() and task.exception() is not None:
                logger.error("client.run of %s failed", name, exc_info=task.exception())

        task = asyncio.ensure_future(call)
        self._background.add(task)
        task.add_done_callback(done)

    async def close(self, worker: Worker) -> None:
        """At the worker's close: every plugin's ``teardown`` (the last registered first),
        then the preloads' ``dask_teardown``; the uploaded files are deleted."""
        self._closing = True
        for task in list(self._background):
            task.cancel()
        errors: dict[tuple[str, str], BaseException] = {}
        for name in reversed(list(self.plugins)):
            await self._remove(worker, name, errors, CLOSE_HOOK_TIMEOUT)
        for preload in reversed(self.preloads):
            await preload.hook("dask_teardown", worker, CLOSE_HOOK_TIMEOUT)
        if self.upload_directory is not None:
            if str(self.upload_directory) in sys.path:
                sys.path.remove(str(self.upload_directory))
            shutil.rmtree(self.upload_directory, ignore_errors=True)


def _by_time(raw: dict[bytes, bytes]) -> list[tuple[str, dict[str, Any]]]:
    """A hash of msgpack entries with a ``time``, oldest first; malformed ones skipped."""
    entries = []
    for field, value in raw.items():
        try:
            entry = codecs.unpack(value)
            when, token = float(entry["time"]), entry["token"]
            if not isinstance(token, str):
                raise TypeError(f"token {token!r} is not a str")
        except (ValueError, TypeError, KeyError) as exc:
            logger.warning("ignoring a malformed entry %r: %s", field, exc)
            continue
        entries.append((when, field.decode(), entry))
    return [(name, entry) for _, name, entry in sorted(entries, key=lambda e: e[:2])]


def _write_and_import(path: Path, data: bytes, load: bool) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}")
    partial.write_bytes(data)
    os.replace(partial, path)  # atomic: an import never sees half a file
    if load:
        import_file(path)
    elif path.suffix != ".py" and str(path) not in sys.path:
        sys.path.insert(0, str(path))  # importable by tasks (a .py is: its directory is)
