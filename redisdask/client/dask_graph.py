"""Dask graphs as redisdask tasks: what ``Client.get``, ``compute`` and ``persist`` send.

Current dask hands a scheduler an *expression* (``dask._expr.Expr``) or a graph whose
values are ``dask._task_spec`` nodes (``Task``, ``Alias``, ``DataNode``, ``List``,
``Dict``, ... with ``TaskRef`` dependencies); older code hands it a dict of tuples.
Each becomes, through ``dask._task_spec.convert_legacy_graph``, one node per key, and each
node one redisdask task: the node itself travels in the spec and the worker calls it
with its dependencies' values (``run_node``).  A node is never taken apart here, so every
kind of node dask has, nested or not, runs exactly as dask's own schedulers run it.

Keys keep their dask form at the edges (``Future.key``, the results of ``get``); inside
the cluster a key is its string form (``spec.stringify``).  A dependency that is not in
the graph is a future the client already holds: a persisted collection's graph is its
futures, and a future passed to ``delayed`` or put in a graph stays inside a node, where
pickling the node finds it (``spec.dumps_spec``) and the worker puts its value.

Tasks are sent in dask's own order (``dask.order``), dependencies first, so the
cluster's submission order — which breaks ties between ready tasks — is dask's
memory-frugal, depth-first order.  This module imports dask; ``redisdask`` imports it
only when dask is used.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import dask
from dask._task_spec import DataNode, GraphNode, convert_legacy_graph
from dask.order import order

from redisdask import spec as specs
from redisdask.client.annotations import ANNOTATIONS, as_task_options, merged, resolved

Key = Hashable  # a dask key: str, or a tuple like ("x-1a2b", 0, 1)


def run_node(node: GraphNode, values: dict[Key, Any]) -> Any:
    """Run one dask graph node on a worker; ``values`` are its dependencies' results,
    keyed by their dask keys."""
    return node(values)


RUN_NODE = specs.dumps_function(run_node)


@dataclass(slots=True)
class Graph:
    """A dask graph made ready to send: tasks in dask's order, dependencies first."""

    tasks: list[dict[str, Any]]
    dask_keys: dict[str, Key]  # string key -> dask key, for every task
    external: set[str] = field(default_factory=set)  # dependencies outside the graph


def is_dask_collection(obj: Any) -> bool:
    return dask.is_dask_collection(obj)


def graph_of(dsk: Any) -> tuple[Mapping[Key, Any], dict[str, dict[Key, Any]]]:
    """The graph and the per-key annotations of an expression, a HighLevelGraph or a dict."""
    annotations: dict[str, dict[Key, Any]] = {}
    if not isinstance(dsk, Mapping):
        if not hasattr(dsk, "__dask_graph__"):
            raise TypeError(
                f"Client.get needs a dask graph (a Mapping of keys to tasks) or a dask "
                f"expression, got {type(dsk).__name__}"
            )
        annotations = dict(getattr(dsk, "__dask_annotations__", dict)() or {})
        dsk = dsk.__dask_graph__()
    layers = getattr(dsk, "layers", None)
    if isinstance(layers, Mapping):  # a HighLevelGraph: annotations live on its layers
        for layer in layers.values():
            for name, value in (getattr(layer, "annotations", None) or {}).items():
                per_key = annotations.setdefault(name, {})
                for key in layer:
                    per_key.setdefault(key, value(key) if callable(value) else value)
    return dsk, annotations


def to_graph(
    dsk: Any,
    options: Mapping[str, Any],
    future_key: Callable[[Any], str | None],
    known: Callable[[str], bool],
) -> Graph:
    """Translate ``dsk`` into redisdask tasks.

    ``options`` are the call's own (``priority``, ``retries``, ``workers``, ...), merged
    over the ``dask.annotate`` blocks active now and overridden by the annotations of
    single keys, as in distributed (see ``redisdask.client.annotations``).  ``future_key(obj)``
    is the key of a future of this client (``None`` for anything else); ``known(key)``
    says whether a key outside the graph is one that this client holds a live future
    of."""
    graph, annotations = graph_of(dsk)
    nodes: dict[Key, GraphNode] = convert_legacy_graph(graph)
    defaults = merged(options)
    strings = {key: specs.stringify(key) for key in nodes}
    external: set[str] = set()

    def outside(name: str, needed_by: Key) -> None:
        if not known(name):
            raise ValueError(
                f"task {needed_by!r} depends on {name!r}, which is neither in the graph nor "
                "a future of this client (was the future released or cancelled?)"
            )
        external.add(name)

    tasks: dict[Key, dict[str, Any]] = {}
    for key, node in list(nodes.items()):
        if isinstance(node, DataNode) and future_key(node.value) == strings[key]:
            # a persisted collection's graph: the key *is* that future
            outside(strings[key], key)
            del nodes[key]
            continue
        deps: dict[Key, specs.TaskRef] = {}
        for dep in node.dependencies:
            name = strings.get(dep)
            if name is None:
                name = specs.stringify(dep)
                outside(name, key)
            deps[dep] = specs.TaskRef(name)
        found: list[Any] = []  # futures inside the node: dask leaves them as they are
        spec = specs.dumps_spec(RUN_NODE, (node, deps), {}, node, futures=found)
        names = {ref.key for ref in deps.values()}
        for future in found:
            name = future_key(future)
            if name is None:  # pragma: no cover - only our futures pickle as references
                raise TypeError(f"{future!r} is not a future of this client")
            outside(name, key)
            names.add(name)
        task_options = resolved(defaults, key)
        for name, per_key in annotations.items():
            if name in ANNOTATIONS and per_key.get(key) is not None:
                task_options[name] = per_key[key]
        tasks[key] = {
            "key": strings[key],
            "deps": sorted(names),
            "spec": spec,
            **as_task_options(task_options),
        }
    try:
        ranks = order(nodes) if len(nodes) > 1 else dict.fromkeys(nodes, 0)
    except RuntimeError as exc:  # dask.order names the keys on a cycle
        if "Cycle" not in str(exc):
            raise
        raise ValueError(f"the graph has a cycle: {exc}") from None
    rank_of = {strings[key]: rank for key, rank in ranks.items()}
    return Graph(
        tasks=specs.toposort(list(tasks.values()), rank_of),
        dask_keys={name: key for key, name in strings.items()},
        external=external,
    )
