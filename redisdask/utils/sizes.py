"""Memory sizes and limits, the way Dask users write them.

* ``parse_bytes("4GB")``, ``parse_bytes("4e9")``, ``parse_bytes("300 MiB")``;
* ``memory_limit("auto", nthreads)``: total memory x min(1, nthreads / cores), capped by
  the cgroup's limit when the process runs in a container with one;
* ``oom_kills()``: how many times the kernel's OOM killer struck in this cgroup, so a
  nanny can tell an OOM kill from any other SIGKILL.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import psutil

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
CGROUP = Path("/sys/fs/cgroup")
# the smallest byte count taken as a memory limit: a worker's interpreter alone needs ~30 MB,
# and a limit of "2" is far likelier a mistaken fraction than two bytes
MIN_MEMORY_LIMIT = 32 * 2**20


def parse_bytes(value: str | int | float) -> int:
    """``"4GB"`` -> 4_000_000_000; ``"4GiB"``, ``"4e9"``, ``"300 MB"``, ``1024`` work too."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ValueError(f"not a size: {value!r} (a size is a finite number of bytes)")
        if value < 0:
            raise ValueError(f"a size cannot be negative: {value!r}")
        return int(value)
    match = _SIZE.match(value)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"not a size: {value!r} (write bytes like 4000000000, '4e9', '4GB' or '4GiB')"
        )
    size = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(size):
        raise ValueError(f"not a size: {value!r} (a size is a finite number of bytes)")
    return int(size)


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("kiB", 2**10)):
        if abs(n) >= scale * 0.9:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def cgroup_memory_limit() -> int | None:
    """The memory limit of this process's cgroup (v2 or v1), None when there is none."""
    for path in (CGROUP / "memory.max", CGROUP / "memory" / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**62:  # v1 says "no limit" with a huge number
            return int(text)
    return None


def memory_limit(value: str | int | float | None, nthreads: int) -> int:
    """Bytes a worker may use; 0 for no limit.  ``value``: ``"auto"`` (total memory x
    min(1, nthreads / cores), capped by the cgroup's limit), a size (``"4GB"``,
    ``4e9``), a fraction of the total (``0.5``), or ``0``/``None`` for no limit."""
    total = psutil.virtual_memory().total
    cgroup = cgroup_memory_limit()
    if cgroup is not None:
        total = min(total, cgroup)
    if value is None:
        return 0
    if value == "auto":
        return int(total * min(1.0, nthreads / cpu_count()))
    if isinstance(value, str) and re.fullmatch(r"\s*(0?\.\d+|1(\.0*)?)\s*", value):
        value = float(value)
    if isinstance(value, int | float) and 0 < value <= 1:  # a fraction (1: all), as in Dask
        return int(total * value)
    limit = parse_bytes(value)
    if 0 < limit < MIN_MEMORY_LIMIT:
        raise ValueError(
            f"a memory limit of {value!r} would be {limit} bytes, too little for a worker "
            f"(at least {format_bytes(MIN_MEMORY_LIMIT)}): write a fraction of this machine's "
            "memory (0.5), or a size such as '2GB' or '2GiB'"
        )
    return min(limit, total)


def cpu_count() -> float:
    """Cores this process may use: the CPUs, or fewer under a cgroup CPU quota."""
    cores = float(os.cpu_count() or 1)
    try:
        quota, period = (CGROUP / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return cores
    if quota == "max":
        return cores
    return max(1.0, min(cores, int(quota) / int(period)))


def oom_kills() -> int | None:
    """The ``oom_kill`` count of this process's cgroup (v2 ``memory.events``), or None
    where the machine does not expose it."""
    try:
        text = (CGROUP / "memory.events").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, count = line.partition(" ")
        if name == "oom_kill" and count.strip().isdigit():
            return int(count)
    return None
