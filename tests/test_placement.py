"""The placement rules (redisdask/placement.py): pure, no Redis, microseconds."""

from __future__ import annotations

import math
from typing import Any

import pytest

from redisdask.placement import (
    Placement,
    fits,
    format_resources,
    parse_resources,
    split_resources,
    task_options,
)

pytestmark = pytest.mark.timeout(10)

A, B, C = "tcp://10.0.0.1:1", "tcp://10.0.0.2:2", "tcp://10.0.0.1:3"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("GPU=2,MEM=10e9", {"GPU": 2.0, "MEM": 1e10}),
        ("GPU=2 MEM=10e9", {"GPU": 2.0, "MEM": 1e10}),  # as dask worker takes them
        (" GPU=0.5 , ", {"GPU": 0.5}),
        ("", {}),
        (None, {}),
        ({"GPU": 1}, {"GPU": 1.0}),
    ],
)
def test_a_workers_resources_are_read_as_dask_writes_them(text: Any, expected: dict) -> None:
    assert parse_resources(text) == expected


@pytest.mark.parametrize(
    "text, match",
    [
        ("GPU", "'GPU' is not NAME=AMOUNT; write the pairs like 'GPU=2,MEM=10e9'"),
        ("GPU=two", "the amount of 'GPU' is 'two', not a number"),
        ("GPU=-1", "the amount of 'GPU' is -1; it must be 0 or more"),
        ("GPU=nan", "it must be finite"),
        ("GPU=1,GPU=2", "'GPU' is given twice"),
        ("=1", "not NAME=AMOUNT"),
        ({"GPU": True}, "must be a number"),
        ({"a b": 1}, "no resource name"),
    ],
)
def test_bad_resources_are_refused_naming_the_entry(text: Any, match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        parse_resources(text, "--resources")


def test_the_stored_form_reads_back_exactly() -> None:
    resources = {"MEM": 1e10, "GPU": 1.0, "frac": 0.1 + 0.2, "tiny": 1e-300}
    text = format_resources(resources)
    assert text.startswith("GPU=1 MEM=10000000000 frac=0.30000000000000004 ")
    assert split_resources(text.encode()) == resources
    assert split_resources(b"GPU=1 junk =x") == {"GPU": 1.0}  # tolerant of what it cannot read
    assert format_resources(None) == "" and split_resources(None) == {}


def test_fits_counts_a_resource_a_worker_lacks_as_none() -> None:
    assert fits({"GPU": 1}, {"GPU": 1.0})
    assert fits({"GPU": 0.1 + 0.2}, {"GPU": 0.3})  # float slack
    assert not fits({"GPU": 1.5}, {"GPU": 1.0})
    assert not fits({"MEM": 1}, {"GPU": 4})
    assert fits({}, {})


def test_task_options_check_what_distributed_checks() -> None:
    assert task_options(None, None, None) == {"priority": 0, "retries": 0}
    assert task_options(1, 2, "a", True, {"GPU": 1}) == {
        "priority": 2,
        "retries": 1,
        "workers": ["a"],
        "allow_other_workers": True,
        "resources": {"GPU": 1.0},
    }
    assert "allow_other_workers" not in task_options(0, 0, None, True)  # nothing to prefer
    with pytest.raises(TypeError, match="allow_other_workers= must be True or False"):
        task_options(0, 0, ["a"], "yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="workers= takes worker addresses"):
        task_options(0, 0, [1])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"resources=\{'GPU': -1\}: .* 0 or more"):
        task_options(0, 0, None, False, {"GPU": -1})
    with pytest.raises(TypeError, match="must be a dict"):
        task_options(0, 0, None, False, ["GPU"])  # type: ignore[arg-type]


def placement() -> Placement:
    infos = {
        A: {"name": "alice", "host": "box-1", "resources": {"GPU": 1}},
        B: {"name": "bob", "host": "box-2", "resources": {"GPU": 2, "MEM": 8e9}},
        C: {"name": "carol", "host": "box-1", "resources": {"GPU": "lots"}},  # unreadable
    }
    return Placement(lambda: infos)


def test_targets_follow_dask_restrictions_preferences_and_resources() -> None:
    p = placement()
    assert p.targets((), None, False) == ()  # anywhere: the cluster's ready set
    assert p.targets(("box-1",), None, False) == (A, C)
    assert p.targets(("nobody",), None, False) is None  # waits: no-worker
    assert p.targets(("nobody",), None, True) == ()  # a preference: anywhere
    assert p.targets((), {"GPU": 1}, False) == (A, B)  # C's GPUs cannot be read: none
    assert p.targets((), {"GPU": 2}, False) == (B,)
    assert p.targets((), {"GPU": 3}, False) is None
    assert p.targets((), {"GPU": 3}, True) is None  # resources are never loose
    assert p.targets(("alice",), {"GPU": 2}, False) is None
    assert p.targets(("alice",), {"GPU": 2}, True) == (B,)  # preference dropped, not resources
    assert p.targets(("alice", "bob"), {"GPU": 1, "MEM": 1}, False) == (B,)


def test_why_not_says_what_is_asked_and_what_the_workers_have() -> None:
    p = placement()
    text = p.why_not((), {"GPU": 3}, False)
    assert text.startswith("it needs GPU=3 on one worker and no registered worker has that much")
    assert f"alice ({A}): GPU=1; carol ({C}): no resources; bob ({B}): GPU=2 MEM=8000" in text
    assert "--resources 'GPU=3'" in text
    text = p.why_not(("alice",), {"GPU": 2}, False)
    assert "GPU=2 on one worker and none of the workers it may run on has that much" in text
    assert "bob" not in text
    text = p.why_not(("gpu-box",), None, False)
    assert text.startswith("workers=['gpu-box'] matches no registered worker")
    assert Placement(dict).why_not((), {"GPU": 1}, False).startswith("no worker is registered")


def test_capable_workers_are_cached_until_workers_change() -> None:
    infos: dict[str, dict[str, Any]] = {A: {"resources": {"GPU": 1}}}
    p = Placement(lambda: infos)
    assert p.capable({"GPU": 1}) == (A,)
    infos[B] = {"resources": {"GPU": math.inf}}  # not finite: counted as none
    assert p.capable({"GPU": 1}) == (A,)  # cached
    p.forget()
    infos[B] = {"resources": {"GPU": 4}}
    assert p.capable({"GPU": 1}) == (A, B)
