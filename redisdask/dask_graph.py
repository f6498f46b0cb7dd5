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
the graph is a future the client already holds (a persisted collection, a future passed
to ``delayed``): dask turns a ``Future`` into such a reference because redisdask's
``Future`` says ``__dask_future__``.

Tasks are sent in dask's own order (``dask.order``), dependencies first, so the
cluster's submission order — which breaks ties between ready tasks — is dask's
memory-frugal, depth-first order.  This module imports dask; ``redisdask`` imports it
only when dask is used.
"""

from __future__ import annotations

import copy
import heapq
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import dask
from dask._task_spec import GraphNode, Task, TaskRef, convert_legacy_graph, parse_input
from dask.order import order

from redisdask import spec as specs

Key = Hashable  # a dask key: str, or a tuple like ("x-1a2b", 0, 1)
ANNOTATIONS = ("priority", "retries", "workers", "allow_other_workers")  # honoured per task


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
    known: Callable[[str], bool],
) -> Graph:
    """Translate ``dsk`` into redisdask tasks.

    ``options`` are the call's own (``priority``, ``retries``, ``workers``), which the
    annotations of single keys override, as in distributed; ``dask.annotate`` blocks
    active now count as call options.  ``known(key)`` says whether a dependency outside
    the graph is a future of this client; any other outside dependency is an error."""
    graph, annotations = graph_of(dsk)
    nodes: dict[Key, GraphNode] = convert_legacy_graph(graph)
    defaults = {k: v for k, v in dask.get_annotations().items() if k in ANNOTATIONS}
    defaults.update({k: v for k, v in options.items() if v is not None})
    strings = {key: specs.stringify(key) for key in nodes}
    external: set[str] = set()

    def references(key: Key, node: GraphNode) -> dict[Key, specs.TaskRef]:
        """The node's dependencies as the worker will substitute them."""
        deps: dict[Key, specs.TaskRef] = {}
        for dep in node.dependencies:
            name = strings.get(dep)
            if name is None:
                name = specs.stringify(dep)
                if not known(name):
                    raise ValueError(
                        f"task {key!r} depends on {dep!r}, which is neither in the graph nor "
                        "a future of this client (was the future released or cancelled?)"
                    )
                external.add(name)
            deps[dep] = specs.TaskRef(name)
        return deps

    tasks: dict[Key, dict[str, Any]] = {}
    for key, node in list(nodes.items()):
        try:
            deps = references(key, node)
            spec = specs.dumps_spec(RUN_NODE, (node, deps), {}, node)
        except TypeError:  # a Future inside a delayed call's arguments, say
            resolved = _resolve_futures(node)
            if resolved is node:
                raise
            nodes[key] = node = resolved
            deps = references(key, node)
            spec = specs.dumps_spec(RUN_NODE, (node, deps), {}, node)
        task_options = dict(defaults)
        for name, per_key in annotations.items():
            if name in ANNOTATIONS and key in per_key:
                task_options[name] = per_key[key]
        tasks[key] = {
            "key": strings[key],
            "deps": sorted(ref.key for ref in deps.values()),
            "spec": spec,
            **task_options,
        }
    ranks = order(nodes) if len(nodes) > 1 else dict.fromkeys(nodes, 0)
    return Graph(
        tasks=_in_order(tasks, nodes, ranks),
        dask_keys={name: key for key, name in strings.items()},
        external=external,
    )


def _is_future(obj: Any) -> bool:
    return getattr(obj, "__dask_future__", False) is True and not isinstance(obj, TaskRef)


def _holds_future(obj: Any) -> bool:
    if _is_future(obj):
        return True
    if isinstance(obj, list | tuple | set | frozenset):
        return any(_holds_future(x) for x in obj)
    if isinstance(obj, dict):
        return any(_holds_future(x) for x in obj.values())
    return False


def _resolve_futures(obj: Any) -> Any:
    """``obj`` with every redisdask ``Future`` in a task's arguments made a dependency
    dask's nodes resolve (an ``Alias`` of its key).  distributed's futures *are* dask
    ``TaskRef``s; ours are not (so that redisdask never needs dask), and dask's
    ``delayed`` leaves such objects in the arguments as they are."""
    if isinstance(obj, Task):
        args = tuple(_resolve_futures(a) for a in obj.args)
        kwargs = {k: _resolve_futures(v) for k, v in obj.kwargs.items()}
        same = all(a is b for a, b in zip(args, obj.args, strict=True))
        if same and all(kwargs[k] is obj.kwargs[k] for k in kwargs):
            return obj
        new = copy.copy(obj)
        new.args, new.kwargs = args, kwargs
        deps: set[Key] = set()
        for a in (*args, *kwargs.values()):
            if isinstance(a, TaskRef):
                deps.add(a.key)
            elif isinstance(a, GraphNode):
                deps |= a.dependencies
        new._dependencies = frozenset(deps)
        new._token = new._repr = None
        return new
    if _holds_future(obj):
        return parse_input(obj)  # a future becomes an Alias; containers become nodes
    return obj


def _in_order(
    tasks: dict[Key, dict[str, Any]], nodes: Mapping[Key, GraphNode], ranks: Mapping[Key, int]
) -> list[dict[str, Any]]:
    """Tasks in dask's order, but never a dependent before its dependencies (Kahn's
    algorithm, taking the best-ranked ready node first)."""
    missing = {key: {d for d in node.dependencies if d in nodes} for key, node in nodes.items()}
    dependents: dict[Key, list[Key]] = {key: [] for key in nodes}
    for key, deps in missing.items():
        for dep in deps:
            dependents[dep].append(key)
    ready = [(ranks.get(key, 0), i, key) for i, key in enumerate(nodes) if not missing[key]]
    heapq.heapify(ready)
    position = {key: i for i, key in enumerate(nodes)}
    out: list[dict[str, Any]] = []
    while ready:
        _, _, key = heapq.heappop(ready)
        out.append(tasks[key])
        for dependent in dependents[key]:
            missing[dependent].discard(key)
            if not missing[dependent]:
                heapq.heappush(ready, (ranks.get(dependent, 0), position[dependent], dependent))
    if len(out) < len(tasks):
        stuck = next(key for key, deps in missing.items() if deps)
        raise ValueError(f"the graph has a cycle: {stuck!r} depends (indirectly) on itself")
    return out


def flatten_keys(keys: Any) -> Iterable[Key]:
    """The keys of a (nested) list of keys; tuples are keys, lists give the shape."""
    if isinstance(keys, list):
        for item in keys:
            yield from flatten_keys(item)
    else:
        yield keys
