"""The task options of a call, merged with the ``dask.annotate(...)`` blocks active at it.

distributed's ``Client._graph_to_futures`` (behind ``submit``, ``map``, ``get``,
``compute`` and ``persist`` alike) merges ``dask.get_annotations()`` with the call's own
options, and an option of the call counts only when it is truthy:
``priority=0``, ``retries=None`` or ``allow_other_workers=False`` leave an annotation's
value standing.  The scheduler then lets the annotations of single keys (a graph
layer's) override these, and calls a callable value with the task's key.  Of the
annotations, only the ones distributed's scheduler acts on are options here; others
(``dask.annotate(foo=1)``) are ignored as they are by distributed's placement.

dask is looked up in ``sys.modules``: a program that never imported dask has no
``annotate`` block open, and ``submit`` does not import dask for it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

from redisdask.placement import task_options

# the annotations that distributed's scheduler turns into task state (``_apply_annotations``)
ANNOTATIONS = ("priority", "retries", "workers", "allow_other_workers", "resources")


def merged(explicit: Mapping[str, Any]) -> dict[str, Any]:
    """The active ``dask.annotate`` options, with the call's truthy options over them."""
    dask = sys.modules.get("dask")
    active = dask.get_annotations() if dask is not None else {}
    out = {name: value for name, value in active.items() if name in ANNOTATIONS}
    out.update({name: value for name, value in explicit.items() if value})
    return out


def resolved(options: Mapping[str, Any], key: Hashable) -> dict[str, Any]:
    """``options`` for one task: a callable value is called with the task's key."""
    return {name: value(key) if callable(value) else value for name, value in options.items()}


def as_task_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Resolved options as the scheduler reads them from a task (checked: a mistake
    raises at the call)."""
    return task_options(
        options.get("retries"),
        options.get("priority"),
        options.get("workers"),
        options.get("allow_other_workers"),
        options.get("resources"),
    )


def call_options(
    retries: int | None,
    priority: int | None,
    workers: str | Iterable[str] | None,
    allow_other_workers: bool | None,
    resources: Mapping[str, float] | None,
) -> Callable[[Hashable], dict[str, Any]]:
    """The task options of a ``submit`` or ``map`` call, as a function of a task's key
    (one dict for every key, unless an annotation is a callable of the key)."""
    options = merged(
        {
            "retries": retries,
            "priority": priority,
            "workers": workers,
            "allow_other_workers": allow_other_workers,
            "resources": resources,
        }
    )
    if any(callable(value) for value in options.values()):
        return lambda key: as_task_options(resolved(options, key))
    fixed = as_task_options(options)
    return lambda key: fixed
