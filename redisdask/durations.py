"""What tasks are expected to cost: a duration estimate per task prefix, as Dask's
``TaskPrefix.duration_average``, and how a worker sizes its claims from them.

The scheduler folds the run time of every accepted result into its prefix's average
(``Durations.add``: the first run sets it, each later one moves it half-way, as in
distributed), forgets it when a worker reports a run of it going on past twice the
average (``Durations.add_exec_time``, distributed's ``TaskPrefix.add_exec_time``), and
writes the averages that changed in the batch that accepts the results, to the
``durations`` hash (``keyspace.Keys.durations``).  A restarted scheduler reloads them from
there.  Workers never read the hash themselves: the ``CLAIM`` script reads the estimate
of each task it considers (``KEY_PREFIX_LUA`` finds its prefix, as
``spec.key_prefix`` does) and returns it with the task, so knowing what a task
costs takes no round trip of its own.

The worker sizes a claim with ``start_times``: when each of its threads will be free to
start another task, given what it runs and what it holds claimed but not started (its
estimates spread over the threads).  The script takes a task only if it would start
within ``worker.claim-horizon`` on the thread free first, which then is busy for the
task's estimate longer; a task without an estimate (a prefix never seen, or a run past
twice its estimate) keeps its thread busy for an unknown time, so it is claimed only for
a thread free now, and nothing is claimed behind it.  A worker whose one thread runs a
2 s task claims no 20 ms tasks ahead, and another worker takes them.  A worker whose
threads all run tasks longer than the horizon, holding fewer claims than threads, claims
its next task when the first of them comes within the horizon of its end
(``claim_delay``), so that the next task waits for the thread rather than the thread for
a claim.

An estimate can be wrong: a prefix learnt from no-ops whose next runs take 40 ms, or a
straggler.  Then a worker may hold a horizon's worth of what it believed instant behind
a run that goes on.  Once every thread of the worker runs a task past any expectation
(``stuck_in``: the horizon past twice its estimate), it hands back the claims it holds
ready that may run elsewhere, but the next one per thread (``workers/state.py``,
``RunsOverdueEvent``), naming the
prefixes of those runs whose estimate let claims take several per thread (``misleads``)
and how long they ran: the scheduler queues the tasks again and forgets those averages
in the same batch, so that other workers claim them one per free thread, not a
horizon's worth each.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

MAX_PREFIXES = 10_000  # prefixes with an estimate at most (a new one beyond: unknown)
HOARD_RATIO = 4  # tasks per thread a claim takes of a prefix whose stuck runs are reported
OVERDUE = 2.0  # a run this many times its estimate has none any more (as distributed's
# ``TaskPrefix.add_exec_time``, which forgets the average then)


class Durations:
    """The scheduler's per-prefix duration averages, and those changed since the last
    ``take_changed`` (to be written to Redis with the batch that changed them)."""

    __slots__ = ("_changed", "averages")

    def __init__(self, averages: Mapping[str, float] | None = None) -> None:
        self.averages: dict[str, float] = dict(averages or {})
        self._changed: set[str] = set()

    def add(self, prefix: str, start: float, stop: float) -> None:
        """One run of ``prefix`` took ``stop - start`` seconds (distributed's
        ``TaskPrefix.add_duration``: microseconds, never negative)."""
        if not (start > 0 and stop > 0 and math.isfinite(stop - start)):
            return  # no timing (a result put, not computed), or a broken one
        duration = max(round((stop - start) * 1e6), 0) / 1e6
        old = self.averages.get(prefix)
        if old is None:
            if len(self.averages) >= MAX_PREFIXES:
                return
            self.averages[prefix] = duration
        else:
            self.averages[prefix] = 0.5 * duration + 0.5 * old
        self._changed.add(prefix)

    def add_exec_time(self, prefix: str, elapsed: float) -> None:
        """A run of ``prefix`` has gone on for ``elapsed`` seconds and is not done: past
        ``OVERDUE`` times the average, the average says nothing of it and is forgotten
        (distributed's ``TaskPrefix.add_exec_time``): claims then take one task of it
        per free thread until a run of it finishes and sets the average anew."""
        old = self.averages.get(prefix)
        if old is not None and math.isfinite(elapsed) and elapsed > OVERDUE * old:
            del self.averages[prefix]
            self._changed.add(prefix)

    def take_changed(self) -> dict[str, float | None]:
        """The averages changed since the last call (None: forgotten)."""
        changed = {p: self.averages.get(p) for p in self._changed}
        self._changed.clear()
        return changed


def remaining(estimate: float | None, elapsed: float, slack: float = 0.0) -> float:
    """How long a run that started ``elapsed`` seconds ago is expected to go on:
    ``inf`` without an estimate, or once it ran ``slack`` past ``OVERDUE`` times it (the
    slack, the claim horizon, keeps the timing noise of tiny tasks from counting)."""
    if estimate is None or elapsed > OVERDUE * estimate + slack:
        return math.inf
    return max(estimate - elapsed, 0.0)


def misleads(estimate: float, horizon: float) -> bool:
    """Whether a stuck run of this estimate says its prefix's average misleads claims:
    it is so small that a claim takes ``HOARD_RATIO`` or more tasks of the prefix per
    thread (a horizon's worth of what it says is near instant; the mis-estimated case),
    so the worker reports it and the scheduler forgets it.  A larger one (a 10 ms task
    that a loaded machine stalled past 40 ms, a straggler of a prefix of 10 ms runs)
    lets a claim take a task or two ahead at most: it stands."""
    return estimate * HOARD_RATIO < horizon


def stuck_in(estimate: float | None, elapsed: float, slack: float) -> float:
    """Seconds until a run that started ``elapsed`` seconds ago is past any expectation
    (0: it is now): ``slack`` past ``OVERDUE`` times its estimate, or ``slack`` without
    one.  A worker whose every thread is stuck so hands back the claims held behind them
    (``workers/state.py``, ``RunsOverdueEvent``)."""
    limit = slack if estimate is None else OVERDUE * estimate + slack
    return max(limit - elapsed, 0.0)


def start_times(
    nthreads: int, running: Iterable[float], held: list[float | None], horizon: float
) -> list[float]:
    """When each thread may start a task claimed now, in seconds from now, for those
    that start one within ``horizon`` (the others take no claim), smallest first; a
    thread free now always counts, even with a horizon of 0.

    ``running``: the expected remaining time of each run that holds a thread;
    ``held``: the estimate of each task claimed and not started (None: unknown).  Tasks
    of unknown cost take the threads free first, for good; the others' estimates fill
    the remaining threads up evenly, from the one free first (what queueing each on the
    thread free first comes to for small tasks, in any order, in O(nthreads) after one
    pass over ``held``: the worker asks before every claim, holding hundreds of tasks).
    """
    return [t for t in _starts(nthreads, running, held) if t <= horizon]


def claim_delay(
    nthreads: int, running: Iterable[float], held: list[float | None], horizon: float
) -> float | None:
    """Seconds from now until ``start_times`` gives a thread (0: it does now); None if
    none ever comes free by the estimates (every thread is busy for an unknown time).

    A worker that claims nothing now because its threads run tasks longer than the
    horizon claims its next task when the first of them comes within the horizon of its
    end, not once it ended: the next task then waits on the worker for its thread, as
    in distributed a worker holds one task more than it runs (``worker-saturation``),
    instead of the thread waiting a claim's round trip after each run."""
    starts = _starts(nthreads, running, held)
    return max(starts[0] - horizon, 0.0) if starts else None


def _starts(nthreads: int, running: Iterable[float], held: list[float | None]) -> list[float]:
    """When each thread whose end is known may start a task claimed now, smallest first
    (see ``start_times``)."""
    unknown = held.count(None)
    work = sum(filter(None, held))  # (estimates are averages of durations: never < 0)
    loads = sorted(running)[:nthreads]
    loads = sorted(loads + [0.0] * (nthreads - len(loads)))[unknown:]
    loads = [t for t in loads if t != math.inf]
    level = _level(loads, work)
    return [max(t, level) for t in loads]


def _level(loads: list[float], work: float) -> float:
    """The level ``work`` seconds reach poured over threads busy for ``loads`` (sorted):
    ``sum(max(0, level - t) for t in loads) == work``."""
    total = 0.0
    for k, t in enumerate(loads):
        if k and (total + work) / k <= t:
            return (total + work) / k
        total += t
    return (total + work) / len(loads) if loads else math.inf


# The Lua twin of ``spec.key_prefix`` (Dask's ``key_split``), for the CLAIM
# script: the same prefix for every ASCII key (tests/test_durations.py compares them); a
# key whose first word starts with a non-ASCII letter may get another, whose estimate it
# then lacks (claimed one per free thread, which is safe).
KEY_PREFIX_LUA = r"""
local function key_prefix(key)
  local words = {}
  for w in string.gmatch(key .. '-', '([^-]*)-') do words[#words + 1] = w end
  local head = words[1]
  if string.sub(head, 1, 1) == '<' then
    head = string.match(head, '^[<>]*(.-)[<>]*$')
    head = string.match(string.match(head, '%S+') or '', '([^.]*)$')
  elseif head ~= '' and not string.match(string.sub(head, 1, 1), '%a') then
    head = string.match(string.match(head, '^[^,]*'), "^[_'()\" ]*(.-)[_'()\" ]*$")
  end
  local parts = {head}
  for i = 2, #words do
    local w = words[i]
    if not string.match(w, '^%a+$') or (#w == 8 and string.match(w, '^[0-9a-f]+$')) then
      break
    end
    parts[#parts + 1] = w
  end
  local prefix = table.concat(parts, '-')
  if prefix == '' then return 'other' end
  return prefix
end
"""
