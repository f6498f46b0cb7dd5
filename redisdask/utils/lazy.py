"""A package whose public names are imported at their first use (PEP 562).

Every process of a cluster runs ``python -m redisdask``: a package that imported its
public names itself (the whole client, for ``redisdask``) would make each of them pay for
modules it never uses.  A package lists where each name lives instead:

    __getattr__, __dir__ = lazy.exports(__name__, {"Client": "redisdask.client.client"})

``from package import Client`` and ``package.Client`` import it then; an attribute that
is no listed name but a subpackage (``redisdask.client`` after ``import redisdask``) is
imported as well.  Importing a submodule no longer runs the others, which also keeps
import cycles between subpackages out (``coordination`` imports ``client.loop``, which
``client.client`` would otherwise pull in half-made).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def exports(
    package: str, names: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``, whose public names are
    ``names`` (name -> the module that defines it)."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise  # (the module exists; something it imports does not)
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # (looked up once)
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
