"""The monitor's pieces, rendered from hand-made snapshots (no Redis): bars in
proportion, marks where the fractions say, recorded text never taken for markup, and a
frame that fits the terminal it is drawn on."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from redisdask.observe.snapshot import PrefixView, Snapshot, WorkerView
from redisdask.observe.views import (
    dashboard,
    header,
    memory_bar,
    progress_bar,
    sparkline,
    status_view,
)
from redisdask.store.eventlog import describe

pytestmark = pytest.mark.timeout(10)
GiB = 2**30


def text_of(renderable: object, width: int = 120) -> str:
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.export_text()


def worker(name: str = "w1", **kw: object) -> WorkerView:
    fractions = {"target": 0.6, "spill": 0.7, "pause": 0.8, "terminate": 0.95}
    return WorkerView(
        address=f"tcp://10.0.0.1:{len(name)}", name=name, memory_limit=10 * GiB,
        fractions=fractions, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def test_memory_bar_fills_managed_then_unmanaged_and_marks_the_thresholds():
    bar = memory_bar(worker(managed=3 * GiB, unmanaged=2 * GiB, spilled=GiB), 20).plain
    cells = bar[:20]
    assert cells[:6] == "██████" and cells[6:10] == "████"  # 30% managed, 20% unmanaged
    assert cells[12] == "┆" and cells[14] == "┊" and cells[16] == "╏" and cells[19] == "║"
    assert bar[20:] == " 5.00 GiB/10.00 GiB +1.00 GiB spilled"
    full = memory_bar(worker(managed=12 * GiB), 20).plain  # past the limit: capped
    assert full[:20] == "█" * 20


def test_memory_bar_without_a_limit_says_so():
    view = WorkerView(address="a", name="a", rss=GiB)
    assert memory_bar(view, 20).plain == "1.00 GiB (no limit)"


def test_progress_bar_is_in_proportion():
    bar = progress_bar(PrefixView("inc", waiting=25, processing=25, memory=50), 20).plain
    assert bar == "█" * 20
    styles = [
        str(span.style) for span in progress_bar(PrefixView("x", memory=1, erred=1), 10).spans
    ]
    assert styles == ["green", "red"]


def test_sparkline_scales_to_the_peak():
    assert sparkline([0, 1, 2, 4, 8], 5).plain == " ▁▂▄█"
    assert sparkline([0] * 60, 10).plain == " " * 10


def test_recorded_text_is_never_markup():
    snap = Snapshot(cluster="c", time=0.0, workers=[worker("[red]x")])
    snap.prefixes = [PrefixView("[link=evil]p", memory=1)]
    text = text_of(status_view(snap, "redis://h/0"))
    assert "[red]x" in text and "[link=evil]p" in text


@pytest.mark.parametrize(("width", "height"), [(60, 20), (100, 30), (200, 60)])
def test_a_frame_fits_its_terminal(width: int, height: int):
    snap = Snapshot(cluster="c", time=1e9, lease_ttl_ms=3000, scheduler={"id": "s1"})
    snap.workers = [worker(f"w{i}", managed=GiB, status="running") for i in range(4)]
    snap.prefixes = [PrefixView(f"p{i}", waiting=i, memory=10) for i in range(30)]
    snap.finished = list(range(60))
    snap.events = [{"kind": "worker-joined", "name": f"w{i}", "time": 1e9} for i in range(30)]
    lines = text_of(dashboard(snap, "redis://h/0", width, height), width).splitlines()
    assert max(len(line) for line in lines) <= width
    shown = "\n".join(lines)
    if height >= 30:
        assert all(f"w{i}" in shown for i in range(4))  # every worker has its row
    else:
        assert "w0" in shown and "4 workers (3 not shown)" in shown
    assert len(lines) <= height  # rows dropped rather than scrolled


def test_events_are_described_for_people():
    died = {"kind": "worker-died", "name": "w1", "cause": "memory", "reason": "killed",
            "rss": 3 * GiB, "memory_limit": 2 * GiB}  # fmt: skip
    assert describe(died) == "worker w1 died (memory) at 3.00 GiB of 2.00 GiB: killed"
    assert describe({"kind": "killed-worker", "key": "k", "workers": ["a", "b"]}) == (
        "KilledWorker: k was running on 2 workers that died"
    )
    assert "taking over from s0" in describe(
        {"kind": "scheduler-start", "scheduler": "s1", "token": "2", "previous": "s0"}
    )
    assert describe({"kind": "something-new", "x": 1}) == "something-new: x=1"


def test_the_header_says_why_redis_is_stuck():
    """A full Redis and an evicting policy are named, with the fix, in status's header."""
    snap = Snapshot(cluster="c", time=0.0)
    snap.redis = {"used_memory": 50_440_000, "maxmemory": 50_331_648,
                  "maxmemory_policy": "allkeys-lru"}  # fmt: skip
    text = header(snap, "redis://h:6379/0").plain
    assert "Redis is full: used_memory 48.10 MiB of maxmemory 48.00 MiB" in text
    assert "raise maxmemory" in text
    assert "maxmemory-policy allkeys-lru" in text and "CONFIG SET maxmemory-policy" in text
    snap.redis = {"used_memory": 1_000, "maxmemory": 0, "maxmemory_policy": "noeviction"}
    text = header(snap, "redis://h:6379/0").plain
    assert "full" not in text and "policy" not in text
