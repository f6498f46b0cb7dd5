"""Type names as results' records keep them, the types they name, and a function's name
as messages about a call show it (``function_name``).

A worker records the type of each result it holds as its name, which travels to the
scheduler and the clients (and ``redisdask inspect`` shows): ``int`` for a builtin,
``module.QualName`` otherwise, as ``dask.utils.typename`` writes it.  ``Future.type``
is the type itself, as in distributed: the name is looked up where the client runs,
importing the module as unpickling the type would; a type that cannot be found there
(a class defined in a worker's ``__main__``) stays its name, as distributed's does when
the worker cannot pickle it.
"""

from __future__ import annotations

import builtins
import functools
import importlib


def type_name(typ: type) -> str:
    """``int`` for a builtin type, ``module.QualName`` for any other."""
    module = getattr(typ, "__module__", "") or ""
    qualname = getattr(typ, "__qualname__", typ.__name__)
    return qualname if module == "builtins" else f"{module}.{qualname}"


def function_name(function: object) -> str:
    """A callable's qualified name (``Class.method``), through ``functools.partial`` and
    its kind, for messages naming a call (``client.run(f)``); not a task key's prefix,
    which is ``spec.funcname``'s."""
    while hasattr(function, "func"):  # functools.partial and friends
        function = function.func
    return str(getattr(function, "__qualname__", None) or type(function).__name__)


@functools.lru_cache(maxsize=256)
def resolve_type(name: str) -> type | str:
    """The type named ``name`` (see ``type_name``); the name itself if it cannot be found."""
    if "." not in name:
        found = getattr(builtins, name, None)
        return found if isinstance(found, type) else name
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest importable module first
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except Exception:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return name
        return obj if isinstance(obj, type) else name
    return name
