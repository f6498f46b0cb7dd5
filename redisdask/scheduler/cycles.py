"""Cycles in a task graph: finding them, and saying where one runs.

A graph with a cycle can never run: the scheduler refuses every task on one (they err
with ``SchedulerRejectedError``, ``SchedulerState._cut_cycles``) instead of leaving them
waiting forever.  ``find_cycles`` finds them among the tasks a submission added (Tarjan's
algorithm, without recursion, so a long chain cannot overflow the stack);
``cycle_text`` is the error the tasks on one carry, naming a shortest cycle through them.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from redisdask.scheduler.tasks import TaskState


def find_cycles(roots: list[TaskState], within: set[TaskState]) -> list[list[TaskState]]:
    """The strongly connected components of the dependency graph restricted to
    ``within`` that hold a cycle (several tasks, or one depending on itself), reached from
    ``roots``: Tarjan's algorithm without recursion."""
    index: dict[TaskState, int] = {}
    low: dict[TaskState, int] = {}
    stack: list[TaskState] = []
    on_stack: set[TaskState] = set()
    found: list[list[TaskState]] = []
    for root in roots:
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(root.dependencies))]
        while work:
            ts, deps = work[-1]
            for dep in deps:
                if dep not in within:
                    continue
                if dep not in index:
                    index[dep] = low[dep] = len(index)
                    stack.append(dep)
                    on_stack.add(dep)
                    work.append((dep, iter(dep.dependencies)))
                    break
                if dep in on_stack:
                    low[ts] = min(low[ts], index[dep])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[ts])
                if low[ts] == index[ts]:
                    members = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        members.append(member)
                        if member is ts:
                            break
                    if len(members) > 1 or ts in ts.dependencies:
                        found.append(members)
    return found


def cycle_text(members: list[TaskState]) -> str:
    """The error of the tasks on a cycle: one cycle through them, shortest first found."""
    inside = set(members)
    start = min(members, key=lambda t: t.key)
    parent: dict[TaskState, TaskState] = {}
    queue = deque([start])
    path: list[TaskState] = []
    while queue and not path:
        ts = queue.popleft()
        for dep in sorted(ts.dependencies & inside, key=lambda t: t.key):
            if dep is start:  # back round: start -> ... -> ts -> start
                path = [ts]
                while path[-1] is not start:
                    path.append(parent[path[-1]])
                path.reverse()
                break
            if dep not in parent:
                parent[dep] = ts
                queue.append(dep)
    others = len(members) - len(path)
    also = f", and {others} more tasks are on cycles with it" if others else ""
    if len(path) == 1:
        return (
            f"SchedulerRejectedError: task {start.key!r} depends on itself, so it can never "
            f"run{also}; fix its dependencies and submit it again"
        )
    names = [repr(t.key) for t in path] + [repr(start.key)]
    if len(names) > 12:
        names = [*names[:10], f"... ({len(names) - 11} more)", names[-1]]
    return (
        "SchedulerRejectedError: the graph has a cycle, so none of its tasks can run: "
        f"{' -> '.join(names)} (each depends on the next){also}; fix the dependencies and "
        "submit the graph again"
    )
