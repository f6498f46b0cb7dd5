"""Versions that must agree across a cluster, and the check that says which do not.

Pickles travel between clients and workers; a Python or cloudpickle that differs is the
leading cause of "unrecoverable exception" deaths in Dask's own docs.  Every process
records its versions in Redis (workers in their info, the scheduler in its hash, clients
in theirs); the first process of a cluster records the cluster's own in the meta hash,
and a worker whose Python or cloudpickle breaks with it refuses to join.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import struct
import sys
from collections.abc import Iterable
from typing import Any

import cloudpickle
import msgpack

from redisdask.errors import RedisDaskError


class VersionMismatchError(RedisDaskError, ValueError):
    """Processes of one cluster run versions that cannot exchange pickles safely (a
    ``ValueError``, as distributed's ``get_versions(check=True)`` raises)."""


def versions(packages: Iterable[str] = ()) -> dict[str, str | None]:
    """This process's versions of what must agree across the cluster, and of
    ``packages`` (None where one is not installed)."""
    out: dict[str, str | None] = {
        "python": platform.python_version(),
        "redisdask": importlib.metadata.version("redisdask"),
        "cloudpickle": cloudpickle.__version__,
        "msgpack": ".".join(map(str, msgpack.version)),
    }
    for name in ("numpy", "pandas", *packages):  # installed, imported or not
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def host_info() -> dict[str, Any]:
    """This machine and interpreter, as distributed's ``get_versions()["host"]``."""
    uname = platform.uname()
    return {
        "python": "%d.%d.%d.%s.%s" % sys.version_info,  # noqa: UP031 (distributed's form)
        "python-bits": struct.calcsize("P") * 8,
        "OS": uname.system,
        "OS-release": uname.release,
        "machine": uname.machine,
        "processor": uname.processor,
        "byteorder": sys.byteorder,
        "LC_ALL": os.environ.get("LC_ALL", "None"),
        "LANG": os.environ.get("LANG", "None"),
    }


def process_versions(packages: Iterable[str] = ()) -> dict[str, Any]:
    """One process's entry of ``Client.get_versions()``, in distributed's shape:
    ``{"host": host_info(), "packages": versions(packages)}``."""
    return {"host": host_info(), "packages": versions(packages)}


def _series(version: str | None, parts: int) -> str | None:
    return ".".join(version.split(".")[:parts]) if version else None


def pickle_breaking(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """The differences that break unpickling: Python's minor version, cloudpickle's major."""
    problems = []
    if _series(ours.get("python"), 2) != _series(theirs.get("python"), 2):
        problems.append(f"python {ours.get('python')} here, {theirs.get('python')} in the cluster")
    if _series(ours.get("cloudpickle"), 1) != _series(theirs.get("cloudpickle"), 1):
        problems.append(
            f"cloudpickle {ours.get('cloudpickle')} here, {theirs.get('cloudpickle')} in the "
            "cluster"
        )
    return problems


def mismatches(by_process: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Packages whose version is not the same in every process that reports it (None:
    not installed there): (package, {process: v}).  The scheduler reports only its own."""
    packages = sorted({p for v in by_process.values() for p in v})
    out = []
    for package in packages:
        seen = {proc: v[package] for proc, v in by_process.items() if package in v}
        if len(set(seen.values())) > 1:
            out.append((package, seen))
    return out


def table(rows: list[tuple[str, dict[str, Any]]]) -> str:
    lines = []
    for package, seen in rows:
        lines.append(f"  {package}:")
        lines.extend(f"    {proc:<40} {version}" for proc, version in sorted(seen.items()))
    return "\n".join(lines)
