"""The scheduler: a pure state machine and the driver that feeds it from Redis.

As ``workers/`` holds ``state.py`` (the worker's state machine) beside ``worker.py`` (its
driver), this package holds the scheduler's rooms:

* ``state``: ``SchedulerState``, pure Python, no I/O: ``handle_stimulus(*events) ->
  instructions``, what each event means; ``transitions``, the model it extends
  (``SchedulerTransitions``: the tasks, workers and clients, every legal move of a task);
  ``tasks``, what it knows of a task and a worker; ``instructions``, the changes it asks
  for; ``moves``, ``chain``, ``stealing``, ``decide``, ``push``, ``cycles``: its parts,
  each with its own concern;
* ``translator``: the instructions as Redis commands, the stream entries as stimuli, a
  reload from the records;
* ``driver``: the blocking loop (``redisdask scheduler``) with its lease, reads and fenced
  writes (``pipe``), and ``quarantine``, the dead letters.

Importing a room does not import the driver: ``Scheduler`` and ``main`` are loaded on
first use from here (``from redisdask.scheduler import Scheduler`` keeps working).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Scheduler", "main"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from redisdask.scheduler import driver

        return getattr(driver, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
