"""How a task travels: its serialized function and arguments (the "spec").

A spec is ``pickling.dumps((function_bytes, args, kwargs))`` where ``function_bytes``
is the function pickled on its own, so that ``map`` pickles a function once and a worker
unpickles it once (``FunctionCache``).  Dependencies inside the arguments — futures, also
nested in lists, tuples, sets and dicts, and keys of a dict graph — are replaced by
``TaskRef(key)`` markers before pickling; the worker substitutes the dependencies' values.
A nested dask-style task ``(func, *args)`` inside a graph becomes a ``SubTask`` that the
worker evaluates in place.  A future anywhere else inside the arguments (in an object of
any kind, in a dask graph node) is pickled as a reference to its key and unpickled on the
worker as the dependency's value (``reduce_future``).  A future pickled anywhere else (in
the function itself, a closure say, or a result) stays a future: it is unpickled bound to
the client of that place (in a task, its worker's; ``futures.rebind_future``).

The scheduler never unpickles a spec: to it the spec is opaque bytes, the graph history.
What it reads of a task is its key, whose prefix (``key_prefix``, Dask's ``key_split``)
groups the task with its kind: for duration estimates, the monitor's rows, the reports.
"""

from __future__ import annotations

import contextvars
import graphlib
import hashlib
import heapq
import importlib.util
import re
import sys
from collections import Counter
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import cloudpickle

from redisdask.utils import pickling

_HEX8 = re.compile(r"^[0-9a-f]{8}$")


def key_prefix(key: str) -> str:
    """The group a task key belongs to, as Dask's ``key_split`` finds it: ``"inc"`` for
    ``"inc-5f3a9c..."``, ``"sum-chunk"`` for ``"sum-chunk-00ab12cd"``, ``"x"`` for the text
    of a tuple key ``"('x-1a2b', 0)"``.  The monitor's progress rows are per prefix."""
    words = key.split("-")
    head = words[0]
    if head.startswith("<"):  # "<lambda>", "<function f at 0x...>"
        head = (head.strip("<>").split() or [""])[0].split(".")[-1]
    elif head and not head[0].isalpha():
        head = head.split(",")[0].strip("_'()\" ")
    parts = [head]
    for word in words[1:]:
        if not word.isalpha() or _HEX8.match(word):
            break
        parts.append(word)
    return "-".join(parts) or "other"


@dataclass(frozen=True, slots=True)
class TaskRef:
    """Stands for the value of task ``key`` inside a spec's arguments."""

    key: str


@dataclass(frozen=True, slots=True)
class SubTask:
    """A dask-style nested task ``(func, *args)``, evaluated where it appears."""

    func: Callable[..., Any]
    args: tuple[Any, ...]


def funcname(func: Any) -> str:
    while hasattr(func, "func"):  # functools.partial and friends
        func = func.func
    name = getattr(func, "__name__", None) or type(func).__name__
    return "lambda" if name == "<lambda>" else name


def dumps_function(func: Any) -> bytes:
    try:
        return pickling.dumps(func)
    except Exception as exc:
        raise TypeError(
            f"could not pickle the function {func!r}: {type(exc).__name__}: {exc}. Tasks are "
            "pickled to reach the workers; define the function at module level or make the "
            "objects it closes over picklable"
        ) from exc


def dumps_spec(
    function_bytes: bytes,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    func: Any = None,
    futures: list[Any] | None = None,
) -> bytes:
    """Pickle a task.  Given a ``futures`` list, a ``Future`` anywhere inside the
    arguments (in any object, a dask node, a closure) is pickled as a reference to its
    key, appended to ``futures``: the task must then depend on those keys, and the
    worker puts each one's value in its place (``run_spec``)."""
    token = _collector.set(futures)
    try:
        return pickling.dumps((function_bytes, args, kwargs))
    except Exception as exc:
        culprit = _first_unpicklable(args, kwargs)
        raise TypeError(
            f"could not pickle the arguments of {funcname(func)}: {culprit or 'an argument'} "
            f"failed with {type(exc).__name__}: {exc}. Arguments are pickled to reach the "
            "workers; pass picklable objects, or create the object inside the function"
        ) from exc
    finally:
        _collector.reset(token)


# The futures met while pickling a spec (None: futures may not be pickled now), and the
# dependencies' values while a worker unpickles one.
_collector: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "redisdask_futures", default=None
)
_values: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
    "redisdask_values", default=None
)


def reduce_future(future: Any, key: str) -> tuple[Any, tuple[str]] | None:
    """``Future.__reduce__``: inside ``dumps_spec(..., futures=...)`` a reference to the
    future's value (a dependency of the task); anywhere else None: the future pickles as
    a future."""
    collected = _collector.get()
    if collected is None:
        return None
    collected.append(future)
    return _future_value, (key,)


def _future_value(key: str) -> Any:
    """Unpickled on a worker in place of a future: the value of the dependency ``key``."""
    values = _values.get()
    if values is None or key not in values:
        raise RuntimeError(
            f"the value of future {key!r} is not available here: a future inside a task's "
            "arguments is a dependency, and only a worker running that task has its value"
        )
    return values[key]


def dumps_with_futures(obj: Any) -> tuple[bytes, list[Any]]:
    """Pickle a value kept outside the cluster's tasks (a dataset, a variable's value, a
    queue item): every ``Future`` inside becomes a reference to its key.  Returns the
    bytes and the futures met (whose keys the value's holder must keep alive)."""
    futures: list[Any] = []
    token = _collector.set(futures)
    try:
        return pickling.dumps(obj), futures
    finally:
        _collector.reset(token)


def loads_with_futures(data: bytes, futures: Mapping[str, Any]) -> Any:
    """Unpickle what ``dumps_with_futures`` made, each reference becoming the future of
    its key in ``futures`` (the getting client's own)."""
    token = _values.set(futures)
    try:
        return cloudpickle.loads(data)
    finally:
        _values.reset(token)


def _first_unpicklable(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    for i, arg in enumerate(args):
        try:
            cloudpickle.dumps(arg)
        except Exception:
            return f"argument {i} ({type(arg).__qualname__} {_short(arg)})"
    for name, arg in kwargs.items():
        try:
            cloudpickle.dumps(arg)
        except Exception:
            return f"keyword argument {name!r} ({type(arg).__qualname__} {_short(arg)})"
    return None


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 60 else text[:57] + "..."


def token(*parts: bytes) -> str:
    h = hashlib.sha1(usedforsecurity=False)
    for part in parts:
        h.update(part)
    return h.hexdigest()


def replace_refs(obj: Any, to_ref: Callable[[Any], str | None], deps: set[str]) -> Any:
    """Copy ``obj`` with every dependency (``to_ref(x)`` returns its key) replaced by a
    ``TaskRef``, collecting the keys in ``deps``.  Walks lists, tuples, sets and dicts."""
    key = to_ref(obj)
    if key is not None:
        deps.add(key)
        return TaskRef(key)
    typ = type(obj)
    if typ in (list, tuple, set, frozenset):
        items = [replace_refs(x, to_ref, deps) for x in obj]
        return typ(items)
    if typ is dict:
        return {k: replace_refs(v, to_ref, deps) for k, v in obj.items()}
    if typ is SubTask:
        return SubTask(obj.func, tuple(replace_refs(x, to_ref, deps) for x in obj.args))
    return obj


def substitute(obj: Any, data: Mapping[str, Any]) -> Any:
    """Inverse of ``replace_refs`` on the worker: TaskRefs become values, SubTasks run."""
    typ = type(obj)
    if typ is TaskRef:
        return data[obj.key]
    if typ in (list, tuple, set, frozenset):
        return typ([substitute(x, data) for x in obj])
    if typ is dict:
        return {k: substitute(v, data) for k, v in obj.items()}
    if typ is SubTask:
        return obj.func(*(substitute(x, data) for x in obj.args))
    return obj


# in the pickle of a function that holds futures (``futures.rebind_future``'s name)
_HOLDS_FUTURES = b"rebind_future"


class FunctionCache:
    """Unpickled functions by their pickled bytes (a map's tasks share one function).
    One that holds futures is not kept: each run unpickles its own, whose futures keep
    their keys wanted while the task runs, not for as long as the cache holds it."""

    def __init__(self, size: int = 256) -> None:
        self._cache: dict[bytes, Any] = {}
        self._size = size

    def get(self, function_bytes: bytes) -> Any:
        func = self._cache.get(function_bytes)
        if func is None:
            func = cloudpickle.loads(function_bytes)
            if _HOLDS_FUTURES in function_bytes:
                return func
            if len(self._cache) >= self._size:
                self._cache.pop(next(iter(self._cache)))
            self._cache[function_bytes] = func
        return func


def run_spec(spec: bytes, data: Mapping[str, Any], functions: FunctionCache) -> Any:
    """Unpickle and run a task with its dependencies' values from ``data``."""
    token = _values.set(data)
    try:
        function_bytes, args, kwargs = cloudpickle.loads(spec)
    finally:
        _values.reset(token)
    func = functions.get(function_bytes)
    return func(*substitute(args, data), **substitute(kwargs, data))


# --------------------------------------------------------------------------- dict graphs


def toposort(
    tasks: list[dict[str, Any]], rank: Mapping[str, float] | None = None
) -> list[dict[str, Any]]:
    """Tasks (``{"key", "deps", ...}``) with dependencies before dependents, taking the
    best-ranked ready task first (the given order without ranks). ``ValueError`` naming
    the keys of a cycle. Dependencies outside ``tasks`` are ignored."""
    rank = rank or {}
    position = {t["key"]: i for i, t in enumerate(tasks)}
    if len(position) < len(tasks):
        twice = next(k for k, n in Counter(t["key"] for t in tasks).items() if n > 1)
        raise ValueError(f"the graph names the task {twice!r} twice")
    sorter = graphlib.TopologicalSorter(
        {t["key"]: [d for d in t["deps"] if d in position] for t in tasks}
    )
    try:
        sorter.prepare()
    except graphlib.CycleError as exc:
        cycle = " -> ".join(repr(key) for key in reversed(exc.args[1]))
        raise ValueError(f"the graph has a cycle: {cycle}") from None
    ready: list[tuple[float, int, str]] = []
    order: list[dict[str, Any]] = []
    while sorter.is_active():
        for key in sorter.get_ready():
            heapq.heappush(ready, (rank.get(key, 0), position[key], key))
        key = heapq.heappop(ready)[2]
        order.append(tasks[position[key]])
        sorter.done(key)
    return order


def stringify(key: Hashable) -> str:
    """Dask keys are str or tuples like ('x', 0); Redis keys are strings."""
    return key if isinstance(key, str) else repr(key)


def is_dask_key(key: Any) -> bool:
    """A key dask accepts: str, bytes, int, float, or a tuple of those (nested)."""
    if isinstance(key, str | bytes | int | float):
        return True
    return isinstance(key, tuple) and all(is_dask_key(k) for k in key)


def check_key(key: Hashable) -> str:
    """The cluster's string form of a dask key; ``TypeError`` for anything dask refuses."""
    if not is_dask_key(key):
        raise TypeError(
            f"unexpected key type {type(key).__name__} ({key!r}): a key is a str, bytes, "
            "int, float or a tuple of those, as in dask"
        )
    return stringify(key)


def dask_installed() -> bool:
    """Whether dask can be imported here (without importing it)."""
    if "dask" in sys.modules:
        return True
    return importlib.util.find_spec("dask") is not None


def make_dask_default(scheduler: Any) -> Any:
    """With dask installed, make ``scheduler`` (a client, or a ``get`` function) dask's
    scheduler (``x.compute()``, ``dask.compute``, ``dask.persist`` run on the cluster), as
    distributed's default client is, with the shuffle and rechunk methods that work on any
    cluster; returns what restores dask's config as it was (``__exit__``)."""
    if not dask_installed():
        return None
    import dask

    wanted = {"scheduler": scheduler}
    for name in ("dataframe.shuffle.method", "array.rechunk.method"):
        if dask.config.get(name, None) is None:  # the user's choice stands
            wanted[name] = "tasks"
    return dask.config.set(wanted)


def is_task(obj: Any) -> bool:
    return type(obj) is tuple and bool(obj) and callable(obj[0])


def _identity(x: Any) -> Any:
    return x


def graph_task(value: Any, graph_keys: set[Hashable]) -> tuple[Any, tuple[Any, ...]]:
    """``(func, args)`` of one entry of a dask-style dict graph, keys left as they are."""
    if is_task(value):
        return value[0], tuple(_nest(a, graph_keys) for a in value[1:])
    return _identity, (_nest(value, graph_keys),)


def _nest(arg: Any, graph_keys: set[Hashable]) -> Any:
    if is_task(arg):
        return SubTask(arg[0], tuple(_nest(a, graph_keys) for a in arg[1:]))
    if type(arg) is list:
        return [_nest(a, graph_keys) for a in arg]
    return arg
