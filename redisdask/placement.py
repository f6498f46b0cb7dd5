"""Where a task may run: worker resources and ``workers=`` restrictions, as in Dask.

One set of rules for every process that needs them: the client and the config check what
users write (``task_options``, ``parse_resources``), the scheduler's state machine asks
``Placement`` which workers' ready sets a task goes into, the worker keeps its own
count of what its claimed tasks hold (``fits``), the ``CLAIM`` script reads the stored
form (``format_resources``), and ``redisdask inspect`` and the monitor say why a task
waits in ``no-worker`` (``Placement.why_not``).

* **Resources** (``--resources "GPU=2,MEM=10e9"``, ``submit(..., resources={"GPU": 1})``)
  are abstract amounts a worker declares and a task needs while it runs, as in Dask: a
  worker never runs tasks whose needs add up to more than it has.  A task with resources
  is queued only on the workers whose *capacity* could ever run it; none registered:
  ``no-worker`` until one joins.  Resources are never loose.
* **Restrictions** (``workers=``) name workers by address, name or host.
  ``allow_other_workers=True`` (Dask's ``loose_restrictions``) makes them a preference:
  the task goes to the named workers while any is registered, else to any worker.

Pure functions and a cache, no I/O.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

Resources = dict[str, float]

EPSILON = 1e-9  # float slack when amounts are added up and compared (the CLAIM script's too)
_NAME = re.compile(r"^[^\s=,]+$")
_EXAMPLE = "'GPU=2,MEM=10e9'"


# --------------------------------------------------------------------------- resources


def _about(what: str, text: str) -> str:
    return f"{what}: {text}" if what else text


def _amount(name: str, value: Any, what: str, shown: str | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            _about(
                what,
                f"the amount of {name!r} must be a number, got {value!r} ({type(value).__name__})",
            )
        )
    amount = float(value)
    shown = shown or repr(value)
    if not math.isfinite(amount):
        raise ValueError(_about(what, f"the amount of {name!r} is {shown}; it must be finite"))
    if amount < 0:
        raise ValueError(_about(what, f"the amount of {name!r} is {shown}; it must be 0 or more"))
    return amount


def check_resources(value: Any, what: str = "resources") -> Resources:
    """A mapping ``{name: amount}`` checked: names are non-empty str without spaces, ``=``
    or ``,``; amounts finite numbers >= 0.  ``TypeError``/``ValueError`` name the entry."""
    if not isinstance(value, Mapping):
        raise TypeError(f"{what or 'resources'} must be a dict like {{'GPU': 1}}")
    out: Resources = {}
    for name, amount in value.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(
                _about(
                    what,
                    f"{name!r} is no resource name (a word without spaces, '=' or ',', e.g. 'GPU')",
                )
            )
        out[name] = _amount(name, amount, what)
    return out


def parse_resources(value: Any, what: str = "resources") -> Resources:
    """A worker's resources from ``"GPU=2,MEM=10e9"`` (or spaces between the pairs, as
    ``dask worker --resources`` takes them), a mapping, or None (none)."""
    if value is None or value == "":
        return {}
    if not isinstance(value, str):
        return check_resources(value, what)
    out: Resources = {}
    for pair in value.replace(",", " ").split():
        name, sep, amount = pair.partition("=")
        if not sep or not name or not amount:
            raise ValueError(
                _about(
                    what,
                    f"{pair!r} is not NAME=AMOUNT; write the pairs like {_EXAMPLE} "
                    "(commas or spaces between them)",
                )
            )
        if name in out:
            raise ValueError(_about(what, f"{name!r} is given twice in {value!r}"))
        try:
            number = float(amount)
        except ValueError:
            raise ValueError(
                _about(what, f"the amount of {name!r} is {amount!r}, not a number; e.g. {name}=2")
            ) from None
        out[name] = _amount(name, number, what, shown=amount)
    return check_resources(out, what)


def format_resources(resources: Mapping[str, float] | None) -> str:
    """The stored and shown form: ``"GPU=2 MEM=10000000000"`` (exact: integers as such,
    other amounts as Python's shortest round-trip text, which Lua's ``tonumber`` reads)."""
    words = []
    for name, amount in sorted((resources or {}).items()):
        value = float(amount)
        text = str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)
        words.append(f"{name}={text}")
    return " ".join(words)


def split_resources(raw: bytes | str | None) -> Resources:
    """The stored form back (tolerant: a word that is no ``NAME=AMOUNT`` is skipped)."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw or ""
    out: Resources = {}
    for word in text.split():
        name, _, amount = word.partition("=")
        try:
            out[name] = float(amount)
        except ValueError:
            continue
    return out


def fits(need: Mapping[str, float], available: Mapping[str, float]) -> bool:
    """Whether ``need`` fits in ``available`` (a resource not there counts as 0)."""
    return all(n <= available.get(name, 0.0) + EPSILON for name, n in need.items())


def worker_resources(info: Mapping[str, Any]) -> Resources:
    """A registered worker's capacity, from its info; what cannot be read counts as none."""
    raw = info.get("resources")
    if not isinstance(raw, Mapping):
        return {}
    return {
        str(k): float(v)
        for k, v in raw.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


# --------------------------------------------------------------------------- client options


def task_options(
    retries: int | None,
    priority: int | None,
    workers: str | Iterable[str] | None,
    allow_other_workers: bool | None = False,
    resources: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Per-task options as the scheduler reads them from an update-graph message: a
    restriction (with ``allow_other_workers`` when it is a preference) and resources,
    checked here so a mistake raises at the call, naming what is wrong."""
    options: dict[str, Any] = {"priority": int(priority or 0), "retries": int(retries or 0)}
    if allow_other_workers not in (True, False, None):
        raise TypeError(f"allow_other_workers= must be True or False, got {allow_other_workers!r}")
    if workers:
        names = [workers] if isinstance(workers, str) else list(workers)
        if not all(isinstance(w, str) for w in names):
            raise TypeError(
                f"workers= takes worker addresses, names or hosts as str, got {workers!r}"
            )
        options["workers"] = names
        if allow_other_workers:
            options["allow_other_workers"] = True
    if resources:
        options["resources"] = check_resources(resources, f"resources={resources!r}")
    return options


# --------------------------------------------------------------------------- placement


def address_host(address: str) -> str:
    """The host of a worker address: ``"127.0.0.1"`` for ``"tcp://127.0.0.1:4242"``."""
    host = address.partition("://")[2].rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


class Placement:
    """Which registered workers a task may be queued on, from their info (name, host,
    resources), cached until a worker comes, goes or re-registers (``forget``)."""

    def __init__(self, infos: Callable[[], Mapping[str, Mapping[str, Any]]]) -> None:
        self._infos = infos  # address -> info of every registered worker
        self._aliases: dict[str, set[str]] | None = None  # address/name/host -> addresses
        self._capable: dict[tuple[tuple[str, float], ...], tuple[str, ...]] = {}

    def forget(self) -> None:
        self._aliases = None
        self._capable.clear()

    def named(self, restrict: Sequence[str]) -> tuple[str, ...]:
        """The registered workers a restriction names: each entry matches the workers
        with that address, name, or host (of the address, or the hostname reported)."""
        if self._aliases is None:
            aliases: dict[str, set[str]] = {}
            for address, info in self._infos().items():
                for name in (address, info.get("name"), address_host(address), info.get("host")):
                    if isinstance(name, str) and name:
                        aliases.setdefault(name, set()).add(address)
            self._aliases = aliases
        return tuple(sorted({a for entry in restrict for a in self._aliases.get(entry, ())}))

    def capable(self, resources: Mapping[str, float]) -> tuple[str, ...]:
        """The registered workers whose capacity could ever run a task needing this."""
        signature = tuple(sorted(resources.items()))
        found = self._capable.get(signature)
        if found is None:
            infos = self._infos()
            found = tuple(sorted(a for a in infos if fits(resources, worker_resources(infos[a]))))
            self._capable[signature] = found
        return found

    def targets(
        self, restrict: Sequence[str], resources: Mapping[str, float] | None, loose: bool
    ) -> tuple[str, ...] | None:
        """Where a queued task goes: ``()`` the cluster's ready set, addresses those
        workers' own sets, ``None`` nowhere (``no-worker``).  A loose restriction that
        names no registered worker (or none able to meet the resources) is dropped, as in
        Dask; resources never are."""
        if not restrict and not resources:
            return ()
        named = self.named(restrict) if restrict else None
        if not resources:
            return named or (() if loose else None)
        capable = self.capable(resources)
        if named is not None:
            both = tuple(a for a in named if a in capable)
            if both or not loose:
                return both or None
        return capable or None

    def why_not(
        self, restrict: Sequence[str], resources: Mapping[str, float] | None, loose: bool
    ) -> str:
        """Why no registered worker may run such a task, in words: what it asks for and
        what the workers have (``redisdask inspect task`` and the monitor show it)."""
        infos = self._infos()
        if not infos:
            return "no worker is registered; it runs once one joins"
        named = self.named(restrict) if restrict else ()
        if restrict and not loose and not named:
            return (
                f"workers={list(restrict)} matches no registered worker by address, name or "
                f"host (registered: {_listing(infos, infos)}); it waits for a matching worker"
            )
        if resources and not self.targets(restrict, resources, loose):
            pool = {a: infos[a] for a in named} if restrict and not loose else infos
            who = (
                "none of the workers it may run on" if pool is not infos else "no registered worker"
            )
            needs = format_resources(resources).replace(" ", ",")
            return (
                f"it needs {format_resources(resources)} on one worker and {who} has that "
                f"much ({_listing(pool, infos, with_resources=True)}); it waits for a worker "
                f"started with e.g. --resources '{needs}'"
            )
        return "no registered worker may run it"


def _listing(
    pool: Mapping[str, Mapping[str, Any]],
    infos: Mapping[str, Mapping[str, Any]],
    with_resources: bool = False,
    limit: int = 8,
) -> str:
    """``worker-0 (tcp://...): GPU=1, ...``: a few workers, as a person would name them."""
    rows = []
    for address in sorted(pool)[:limit]:
        info = infos[address]
        name = info.get("name") or address
        label = f"{name} ({address})" if name != address else address
        if with_resources:
            label += f": {format_resources(worker_resources(info)) or 'no resources'}"
        rows.append(label)
    if len(pool) > limit:
        rows.append(f"and {len(pool) - limit} more")
    return "; ".join(rows)
