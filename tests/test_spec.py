"""Unit tests of the task spec helpers (redisdask/spec.py): ordering a graph's tasks."""

from __future__ import annotations

import random

import pytest

from redisdask.spec import toposort

pytestmark = pytest.mark.timeout(30)


def _tasks(deps: dict[str, list[str]]) -> list[dict[str, object]]:
    return [{"key": key, "deps": d} for key, d in deps.items()]


def test_dependencies_come_first_and_the_best_rank_breaks_ties() -> None:
    rng = random.Random(11)
    keys = [f"k{i}" for i in range(300)]
    deps = {key: rng.sample(keys[:i], min(i, rng.randrange(4))) for i, key in enumerate(keys)}
    shuffled = list(deps.items())
    rng.shuffle(shuffled)
    rank = {key: rng.random() for key in keys}
    order = [t["key"] for t in toposort(_tasks(dict(shuffled)), rank)]
    assert sorted(order) == sorted(keys)
    seen: set[str] = set()
    for key in order:
        assert set(deps[key]) <= seen, key
        seen.add(key)
    roots = [key for key in keys if not deps[key]]
    assert order[0] == min(roots, key=rank.__getitem__)


def test_without_ranks_the_given_order_is_kept_where_dependencies_allow() -> None:
    order = toposort(_tasks({"c": [], "b": ["a"], "a": [], "outside": ["not-in-graph"]}))
    assert [t["key"] for t in order] == ["c", "a", "b", "outside"]


def test_a_cycle_is_named_and_a_key_twice_is_refused() -> None:
    with pytest.raises(ValueError, match=r"cycle: 'a' -> 'b' -> 'a'|cycle: 'b' -> 'a' -> 'b'"):
        toposort(_tasks({"a": ["b"], "b": ["a"], "c": []}))
    with pytest.raises(ValueError, match="'s' -> 's'"):
        toposort(_tasks({"s": ["s"]}))
    with pytest.raises(ValueError, match="names the task 'a' twice"):
        toposort([{"key": "a", "deps": []}, {"key": "a", "deps": []}])
