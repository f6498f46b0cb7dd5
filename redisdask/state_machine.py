"""The idiom both task state machines share, after Dask's ``worker_state_machine.py``.

``redisdask.scheduler.state.SchedulerState`` and ``redisdask.workers.state.WorkerState``
are written the same way (neither imports the other; both import this module):

* **Handlers chosen by event type.**  A class-level ``_HANDLERS`` dict maps each event
  class to the method that applies it; ``handle_stimulus`` looks the handler up by
  ``type(event)``.  (Measured on Python 3.11: a dict lookup costs about 0.1 µs per event,
  ``functools.singledispatchmethod`` about 1.1 µs, so the dict it is.)
* **An explicit transition table.**  A class-level ``_TRANSITIONS`` dict,
  ``(start, finish) -> _transition_<start>_<finish>``, readable top to bottom as the
  list of legal moves.  ``transition(ts, finish, *, stimulus_id, ...)`` (the worker's
  ``_transition``) looks the move up and raises ``InvalidTransition`` for one that is not
  there.  The unit tests check that the table holds every ``_transition_*`` method, so a
  new one must be registered.
* **``stimulus_id`` keyword-only and last** in every transition method, so the cause of
  each move is passed explicitly and lands in the story.
* **Stories.**  Each machine records the transitions it makes, newest last, in a bounded
  ``story`` deque whose entries begin ``(key, start, finish, stimulus_id, ...)``;
  ``stories(*keys)`` picks a key's entries, and ``InvalidTransition`` carries them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from redisdask.errors import RedisDaskError

STORY_SHOWN = 20  # the last entries of a key's story that an InvalidTransition shows


class InvalidTransition(RedisDaskError, RuntimeError):
    """A stimulus asked a task to move along an edge its state machine does not have.

    A bug (in the machine, or in what fed it), never a user error: the message shows the
    move, its stimulus and the key's story (its last transitions), which is what one needs
    to find how the task got there."""

    def __init__(
        self, key: str, start: str, finish: str, stimulus_id: str, story: Sequence[tuple[Any, ...]]
    ) -> None:
        self.key, self.start, self.finish = key, start, finish
        self.stimulus_id = stimulus_id
        self.story = list(story)
        super().__init__(key, start, finish, stimulus_id, self.story)

    def __reduce__(self) -> tuple[Callable[..., InvalidTransition], tuple[Any, ...]]:
        return type(self), (self.key, self.start, self.finish, self.stimulus_id, self.story)

    def __str__(self) -> str:
        head = (
            f"{self.key!r}: invalid transition {self.start} -> {self.finish} "
            f"(stimulus {self.stimulus_id})"
        )
        if not self.story:
            return head + "\n  Story: (nothing recorded)"
        shown = self.story[-STORY_SHOWN:]
        earlier = len(self.story) - len(shown)
        lines = [f"({earlier} earlier entries not shown)"] if earlier else []
        lines += map(str, shown)
        return head + "\n  Story (oldest first):\n    " + "\n    ".join(lines)

    def __repr__(self) -> str:
        return f"{type(self).__name__}: {self}"


def table_problems(cls: Any) -> list[str]:
    """What is wrong with ``cls._TRANSITIONS`` (empty when nothing is; the unit tests
    check both machines): a ``_transition_<start>_<finish>`` method missing from it, an
    entry that is no such method, or a method whose own edge maps to another method."""
    table: dict[tuple[str, str], Callable[..., Any]] = cls._TRANSITIONS
    methods = {n: getattr(cls, n) for n in dir(cls) if n.startswith("_transition_")}
    states = {state for edge in table for state in edge}
    problems = [
        f"{func.__name__} is in _TRANSITIONS but is no method of {cls.__name__}"
        for func in table.values()
        if func not in methods.values()
    ]
    for name, func in sorted(methods.items()):
        parts = name.removeprefix("_transition_").split("_")
        edges = [("-".join(parts[:i]), "-".join(parts[i:])) for i in range(1, len(parts))]
        edge = next((e for e in edges if e[0] in states and e[1] in states), None)
        if edge is None or table.get(edge) is not func:
            problems.append(f"{name} is not registered in _TRANSITIONS under its own move")
    return problems
