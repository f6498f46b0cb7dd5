"""Worker plugins: ``WorkerPlugin``, the base class of code that every current and future
worker of a cluster runs at its start, at its close and at every task transition
(``client.register_plugin``), with distributed's names and call conventions.

Any object with at least one of ``setup``, ``teardown`` and ``transition`` is accepted:
subclasses of this class, of distributed's ``WorkerPlugin``, or plain duck-typed objects.
"""

from __future__ import annotations

import uuid
from typing import Any

WORKER_PLUGIN_METHODS = ("setup", "teardown", "transition")
UPLOAD_SUFFIXES = (".py", ".zip", ".egg", ".pyz")  # what client.upload_file accepts


class WorkerPlugin:
    """Code that runs on every worker of a cluster: register an instance with
    ``client.register_plugin(plugin, name=None)``.

    * ``setup(worker)`` runs when the plugin reaches a worker: at once on the workers that
      are registered, and at the start of every worker that joins later (before it claims
      any task).  A plain method runs in a thread of its own (a slow setup does not stop
      the worker's heartbeats); an ``async def`` one is awaited on the worker's loop.
    * ``teardown(worker)`` runs when the worker closes, and when the plugin is removed
      (``client.unregister_worker_plugin(name)``) or replaced by one of the same name.
    * ``transition(key, start, finish, **kwargs)`` runs on the worker's event loop after
      each change of a task's state on that worker (``waiting``, ``ready``, ``executing``,
      ``memory``, ``error``, ``fetch``, ``flight``, ``released``, ``forgotten``, ...).
      Keep it quick: the worker waits for it.

    An exception in a plugin is logged by the worker, never raised there; ``setup``'s
    is also re-raised by ``register_plugin``.  ``name``: the name the plugin is registered
    under when ``register_plugin`` is given none (a plugin of the same name replaces it).
    ``idempotent = True``: registering it again under a name that is taken does nothing.
    """

    idempotent: bool = False

    def setup(self, worker: Any) -> Any:
        """Run when the plugin is attached to a worker."""

    def teardown(self, worker: Any) -> Any:
        """Run when the worker closes, or when the plugin is removed or replaced."""

    def transition(self, key: str, start: str, finish: str, **kwargs: Any) -> None:
        """Run after a task on the worker went from ``start`` to ``finish``."""


def _bases(plugin: Any) -> set[str]:
    return {f"{cls.__module__}.{cls.__qualname__}" for cls in type(plugin).__mro__}


def check_worker_plugin(plugin: Any) -> None:
    """Refuse what cannot run as a worker plugin, saying why and what to do instead."""
    if isinstance(plugin, type):
        raise TypeError(
            f"register_plugin needs an instance of a plugin, not the class {plugin.__name__}: "
            f"write {plugin.__name__}(...)"
        )
    bases = _bases(plugin)
    if "distributed.diagnostics.plugin.SchedulerPlugin" in bases:
        raise NotImplementedError(
            f"{type(plugin).__name__} is a SchedulerPlugin: redisdask has no scheduler process "
            "to run it in (the scheduler's state lives in Redis). Use a WorkerPlugin, or read "
            "the cluster's state with client.scheduler_info() or 'redisdask inspect'"
        )
    if "distributed.diagnostics.plugin.NannyPlugin" in bases:
        raise NotImplementedError(
            f"{type(plugin).__name__} is a NannyPlugin: redisdask's nannies do not run "
            "plugins. Use a WorkerPlugin (its setup runs in every worker process)"
        )
    if not any(callable(getattr(plugin, m, None)) for m in WORKER_PLUGIN_METHODS):
        raise TypeError(
            f"{type(plugin).__name__} is not a worker plugin: it has none of the methods "
            f"{', '.join(WORKER_PLUGIN_METHODS)}. Subclass redisdask.WorkerPlugin"
        )


def plugin_name(plugin: Any, name: str | None) -> str:
    """The name given, else the plugin's ``name``, else its class name and a uuid (as
    distributed does)."""
    if name is None:
        name = getattr(plugin, "name", None)
        if name is None:
            return f"{type(plugin).__name__}-{uuid.uuid4()}"
    if not isinstance(name, str) or not name:
        raise TypeError(f"a plugin's name must be a non-empty str, got {name!r}")
    return name
