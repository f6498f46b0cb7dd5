"""The web dashboard (issue 26, parts 4 and 5), a real ``redisdask dashboard`` process on a
real cluster, read by Debian's chromium driven with Playwright: workers appear, progress
moves without a reload, a worker killed by a memory bomb shows on the deaths page with
its reason and its logs after it died, a task key holding a script renders as text; it
runs as the read-only ``monitor`` Redis user, takes no write request, and wants its token.

The screenshots it takes go to ``$REDISDASK_SCREENSHOTS`` when set (``docs/dashboard``
holds the ones the docs show), else to the test's temporary folder.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis
from conftest import ClusterFactory, run_cli
from polling import poll
from tasklib import allocate_forever

from redisdask import Client, KilledWorker, LocalCluster
from redisdask.deploy.embedded import EmbeddedRedis
from redisdask.store.bootstrap import ensure_cluster
from redisdask.store.codecs import pack
from redisdask.store.keyspace import Keys

pytestmark = pytest.mark.timeout(150)

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [  # as root, headless, on a machine with no way out
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


class Dashboard:
    """A ``redisdask dashboard`` process with JSON logs, the URL (and the token) in its
    environment, on a free port it reports in its first log line."""

    def __init__(self, url: str, cluster: str, token: str | None = None) -> None:
        env = dict(
            os.environ,
            REDISDASK__REDIS__URL=url,
            REDISDASK__LOGGING__FORMAT="json",
            PYTHONUNBUFFERED="1",
        )
        env.pop("REDISDASK_DASHBOARD_TOKEN", None)
        if token is not None:
            env["REDISDASK_DASHBOARD_TOKEN"] = token
        argv = [sys.executable, "-m", "redisdask", "dashboard", "--cluster", cluster]
        argv += ["--port", "0", "--interval", "0.5"]
        self.process = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        poll(lambda: self.port is not None or self.process.poll() is not None, timeout=30)
        assert self.port is not None, f"the dashboard exited: {self.lines}"
        self.base = f"http://127.0.0.1:{self.port}"

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line.rstrip("\n"))

    @property
    def port(self) -> int | None:
        for line in list(self.lines):
            message = json.loads(line)["message"]
            if message.startswith("serving the dashboard"):
                return int(message.rsplit(":", 1)[1].split("/")[0])
        return None

    def get(self, path: str, **headers: str) -> tuple[int, str, Any]:
        request = urllib.request.Request(self.base + path, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read().decode(), response.headers
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(), exc.headers


@contextmanager
def dashboard(url: str, cluster: str, token: str | None = None) -> Iterator[Dashboard]:
    running = Dashboard(url, cluster, token)
    try:
        yield running
    finally:
        running.process.send_signal(signal.SIGTERM)
        try:
            running.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            running.process.kill()
            running.process.wait()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    assert os.path.exists(CHROMIUM), (
        f"the dashboard tests drive Debian's chromium at {CHROMIUM}: apt-get install "
        "chromium (.ci/run installs it)"
    )
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    yield context.new_page()
    context.close()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("REDISDASK_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def slow_inc(x: int) -> int:
    threading.Event().wait(0.05)
    return x + 1


def say_then_allocate(words: str, go: str) -> None:
    logging.getLogger("user.task").warning(words)
    allocate_forever(2_000_000, go)


def name_of(client: Client) -> Any:
    workers = client.scheduler_info()["workers"]
    return lambda address: workers[address]["name"]


def progress(page: Any, prefix: str) -> tuple[int, int]:
    row = page.locator(f'tr.prefix[data-prefix="{prefix}"]')
    if row.count() == 0:
        return 0, 0
    return int(row.get_attribute("data-done")), int(row.get_attribute("data-total"))


def test_the_status_page_shows_the_workers_and_moves_with_a_map_without_reloading(
    read_only_url: str, cluster_name: str, make_cluster: ClusterFactory, page: Any, shots: Path
) -> None:
    with (
        make_cluster(nanny=False, n_workers=2, threads_per_worker=2) as cluster,
        Client(cluster) as client,
        dashboard(read_only_url, cluster_name) as board,
    ):
        page.goto(board.base + "/status")
        poll(lambda: page.locator("tr.worker").count() == 2, timeout=15)
        page.evaluate("window.sameDocument = 1")  # gone if the page reloaded
        futures = client.map(slow_inc, range(400))
        poll(lambda: 0 < progress(page, "slow_inc")[0] < 400, timeout=30)
        seen = progress(page, "slow_inc")[0]
        poll(lambda: progress(page, "slow_inc")[0] > seen, timeout=30)
        page.screenshot(path=str(shots / "status.png"), full_page=True)
        assert client.gather(futures) == list(range(1, 401))
        poll(lambda: progress(page, "slow_inc") == (400, 400), timeout=30)
        assert page.evaluate("window.sameDocument") == 1
        assert page.locator("#connection.live").count() == 1
        # the task stream: one bar per run, on the lanes of the two workers
        page.goto(board.base + "/task-stream")
        poll(lambda: page.locator("rect.run").count() >= 100, timeout=15)
        lanes = [lane.get_attribute("data-worker") for lane in page.locator("text.lane").all()]
        assert lanes == sorted(client.scheduler_info()["workers"], key=name_of(client))
        ran = {bar.get_attribute("data-worker") for bar in page.locator("rect.run").all()}
        assert ran == set(lanes)  # both ran some of the map
        page.screenshot(path=str(shots / "task-stream.png"), full_page=True)
        page.goto(board.base + "/workers")
        assert page.locator("tr.worker").count() == 2
        page.screenshot(path=str(shots / "workers.png"), full_page=True)
        assert "did not answer" not in page.content() and "refused" not in page.content()


def test_a_worker_killed_by_a_memory_bomb_shows_on_the_deaths_page_with_its_logs(
    read_only_url: str,
    cluster_name: str,
    make_cluster: ClusterFactory,
    page: Any,
    shots: Path,
    tmp_path: Path,
) -> None:
    with (
        make_cluster(
            n_workers=1,
            nanny=True,
            worker_options={"memory_limit": "300MB"},
            scheduler_options={"allowed_failures": 0},
        ) as cluster,
        Client(cluster) as client,
        dashboard(read_only_url, cluster_name) as board,
    ):
        [victim] = client.scheduler_info()["workers"]
        page.goto(board.base + "/deaths")
        page.wait_for_selector("text=no worker has died")
        go = tmp_path / "go"
        future = client.submit(say_then_allocate, "about to eat all the memory", str(go))
        poll(lambda: any("about to eat" in line for _, line in client.get_worker_logs()[victim]))
        go.touch()
        with pytest.raises(KilledWorker):
            future.result(timeout=60)
        died = time.monotonic()
        row = page.locator(f'tr.death[data-worker="{victim}"]')
        poll(lambda: row.count() == 1, timeout=10)
        shown_after = time.monotonic() - died
        assert row.locator(".kind").inner_text().startswith("memory")
        assert "killed by its nanny" in row.locator(".reason").inner_text()
        assert future.key in row.inner_text()  # the task that was running
        page.screenshot(path=str(shots / "deaths.png"), full_page=True)
        row.locator("a.view-logs").click()
        page.wait_for_selector("#logs pre.logs")
        assert "dead" in page.locator("#worker h2").inner_text()
        assert "about to eat all the memory" in page.locator("#logs pre.logs").inner_text()
        assert "killed by its nanny" in page.locator("#worker .death-record").inner_text()
        page.screenshot(path=str(shots / "worker-dead.png"), full_page=True)
        page.goto(board.base + "/events")
        page.wait_for_selector("tr.event.worker-died")
        assert page.locator("tr.event.worker-died a", has_text="view logs").count() == 1
        page.screenshot(path=str(shots / "events.png"), full_page=True)
    # the death reached the page within a few seconds of the client's KilledWorker
    assert shown_after < 5, shown_after


KEY = "<script>window.pwned=1</script><img src=x onerror=window.pwned=2>-1"


def fail(x: int) -> int:
    raise ValueError("<b>not bold</b> <script>window.pwned=3</script>")


def test_a_task_key_and_an_error_holding_a_script_render_as_text(
    read_only_url: str,
    cluster_name: str,
    make_cluster: ClusterFactory,
    page: Any,
    shots: Path,
) -> None:
    with (
        make_cluster(nanny=False, n_workers=1) as cluster,
        Client(cluster) as client,
        dashboard(read_only_url, cluster_name) as board,
    ):
        future = client.submit(fail, 1, key=KEY)
        with pytest.raises(ValueError):
            future.result(timeout=20)
        page.goto(board.base + "/status")
        poll(lambda: page.locator("tr.prefix").count() == 1, timeout=15)
        page.fill("input[name=key]", KEY)
        page.press("input[name=key]", "Enter")
        page.wait_for_selector("h2.key")
        assert page.locator("h2.key").inner_text() == KEY
        assert "<b>not bold</b>" in page.locator("pre.error").inner_text()
        assert page.locator("pre.error b").count() == 0
        poll(lambda: page.locator("#task[data-updated]").count() == 1, timeout=10)  # live
        page.screenshot(path=str(shots / "task.png"), full_page=True)
        assert page.evaluate("window.pwned") is None


def test_it_reads_as_the_monitor_user_refuses_writes_and_wants_its_token(
    read_only_url: str, cluster_name: str, make_cluster: ClusterFactory
) -> None:
    token = "s3cret-token"
    with (
        make_cluster(nanny=False, n_workers=1) as cluster,
        Client(cluster) as client,
        dashboard(read_only_url, cluster_name, token=token) as board,
    ):
        assert client.submit(slow_inc, 1).result(timeout=20) == 2
        assert board.get("/status")[0] == 401
        assert board.get("/status?token=wrong")[0] == 401
        status, body, headers = board.get("/status?token=" + token)
        assert status == 200 and 'tr class="worker"' in body
        assert "HttpOnly" in headers["set-cookie"] and token in headers["set-cookie"]
        cookie = {"Cookie": f"redisdask_dashboard={token}"}
        status, _, headers = board.get("/status?token=wrong", **cookie)
        assert status == 200 and "set-cookie" not in headers  # a wrong ?token= is not kept
        assert "script-src 'self'" in headers["content-security-policy"]
        bearer = {"Authorization": f"Bearer {token}"}
        for path in ("/workers", "/deaths", "/events", "/task-stream", "/logs?w=scheduler",
                     "/worker?w=worker-0", "/task?key=x"):  # fmt: skip
            status, body, _ = board.get(path, **bearer)
            assert status == 200, path
            assert "did not answer" not in body and "refused" not in body, path
        request = urllib.request.Request(board.base + "/status", data=b"x", headers=bearer)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 405
        api = json.loads(board.get("/api/status", **bearer)[1])
        assert len(api["snap"]["workers"]) == 1
        check = [sys.executable, "-m", "redisdask.healthcheck", "dashboard", str(board.port)]
        assert subprocess.run(check, timeout=30).returncode == 0  # (no token: /health)
    assert subprocess.run(check, timeout=30, capture_output=True).returncode == 1  # stopped
    assert not any(token in line for line in board.lines)  # never logged


def test_a_redis_that_goes_away_is_said_on_the_open_page_which_recovers_with_it(
    cluster_name: str, page: Any
) -> None:
    with EmbeddedRedis() as server:
        ensure_cluster(redis.Redis.from_url(server.url), Keys(cluster_name))
        with dashboard(server.url, cluster_name + "-typo") as wrong:
            assert "no cluster named" in wrong.get("/status")[1]
        said = [json.loads(line)["message"] for line in wrong.lines]
        assert any(f"holds ['{cluster_name}']" in m for m in said), said
        with dashboard(server.url, cluster_name) as board:
            page.goto(board.base + "/status")
            page.wait_for_selector("text=no workers")
            assert "no cluster named" not in page.content()
            server.kill()  # the data dir stays for the start below
            page.wait_for_selector("p.error", timeout=15_000)
            assert "did not answer" in page.locator("p.error").inner_text()
            status, body, _ = board.get("/api/status")
            assert status == 503 and "did not answer" in json.loads(body)["error"]
            assert board.process.poll() is None
            server.start()  # the same port
            page.wait_for_selector("text=no workers", timeout=30_000)
            assert page.locator("p.error").count() == 0
        messages = [json.loads(line) for line in board.lines]
        [down] = [m for m in messages if m["level"] == "WARNING"]  # once, not per rendering
        assert down["message"].startswith(f"cannot read cluster {cluster_name!r}")
        assert any(m["message"].startswith("reading cluster") for m in messages)
        assert not [m for m in messages if m["level"] == "ERROR"]  # a clean stop, page open


def test_malformed_records_are_said_on_their_part_and_the_pages_go_on(
    redis_url: str, cluster_name: str
) -> None:
    """Records of the wrong shape (a stranger's, an older version's) in every place a
    page reads: each page answers, the part that cannot show a record says why."""
    keys, r = Keys(cluster_name), redis.Redis.from_url(redis_url)
    ensure_cluster(r, keys)
    odd = {"worker": "tcp://x:9", "name": ["n"], "time": "noon", "executing": 5,
           "processing": {"a": 1}, "evidence": "none", "kind": ["memory"],
           "reason": {"x": 1}}  # fmt: skip
    r.hset(keys.workers, mapping={"tcp://x:1": pack({"name": 5, "nthreads": "many"}),
                                  "tcp://y:2": b"\xc1 not msgpack"})  # fmt: skip
    r.hset(keys.heartbeats, "tcp://x:1", pack({"time": "then", "executing": 7, "rss": "big"}))
    r.hset(keys.heartbeats, "tcp://x:2", pack({"time": 1e18, "rss": float("nan")}))
    prefixes = {"inc": "lots", "p\revent: boom\rretry: 99999": {"memory": 1}}  # a CR in a key
    r.hset(keys.summary, mapping={"prefixes": pack(prefixes), "finished": b"\xc1"})
    well = {"worker": "tcp://ok:1", "name": "fine", "kind": "memory", "reason": "too big"}
    far = {"worker": "tcp://x:2", "time": 1e18, "kind": "signal", "reason": "far"}
    for stream, entry in (
        (keys.deaths, pack(well)),
        (keys.deaths, pack(far)),
        (keys.deaths, pack(odd)),
        (keys.deaths, b"\xc1"),
        (keys.events, pack({"kind": 5, "time": None})),
        (keys.worker_logs("tcp://x:9"), pack({"t": "x", "l": 1})),
        (keys.worker_story("tcp://x:1"), pack([[1, 2, 3], "row"])),
    ):
        r.xadd(stream, {"m": entry})
    r.hset(keys.task("k"), mapping={"state": "5", "deps": b"\xc1", "who_has": b"\xc1"})
    with dashboard(redis_url, cluster_name) as board:
        for path in ("/status", "/task-stream", "/workers", "/deaths", "/events",
                     "/worker?w=tcp://x:9", "/worker?w=tcp://x:1", "/task?key=k",
                     "/logs?w=tcp://x:9", "/api/deaths", "/api/worker?w=tcp://x:9",
                     "/api/worker?w=tcp://x:2", "/api/status"):  # fmt: skip
            status, body, _ = board.get(path)
            assert status == 200, (path, body)
            assert "Redis is malformed" not in body, (path, body)  # odd fields left out
        assert "too big" in board.get("/deaths")[1]  # beside the odd record
        # the live stream: a CR in the HTML starts no field of its own (only data lines)
        with urllib.request.urlopen(board.base + "/live/status", timeout=10) as stream:
            event = b""
            while not event.endswith(b"\n\n"):
                event += stream.read(1)
        fields = re.split(r"\r\n|\r|\n", event.decode())[:-2]
        assert fields[0] == "event: html" and fields[1:], fields[:3]
        assert all(f.startswith("data: ") for f in fields[1:]), [
            f for f in fields if not f.startswith("data: ")
        ]
        assert board.process.poll() is None


def test_local_cluster_starts_a_dashboard_and_the_client_links_to_it(
    redis_url: str, cluster_name: str
) -> None:
    with (
        LocalCluster(
            n_workers=1,
            nanny=False,
            redis_url=redis_url,
            cluster_name=cluster_name,
            dashboard_address="127.0.0.1:0",
        ) as cluster,
        Client(cluster) as client,
    ):
        link = client.dashboard_link
        assert link is not None and link == cluster.dashboard_link
        assert link.startswith("http://127.0.0.1:") and link.endswith("/status")
        with urllib.request.urlopen(link, timeout=10) as response:
            assert response.status == 200 and "worker-0" in response.read().decode()
        process = cluster.dashboard_process
        assert process is not None
    assert process.poll() is not None  # stopped with the cluster


def test_a_port_in_use_is_said_by_the_cli_and_avoided_by_local_cluster(
    redis_url: str, cluster_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    with dashboard(redis_url, cluster_name) as first:
        argv = ["dashboard", "--cluster", cluster_name, "--port", str(first.port)]
        done = run_cli(*argv, redis_url=redis_url, timeout=30)
        assert done.returncode == 1
        assert f"cannot serve the dashboard on 127.0.0.1:{first.port}" in done.stderr
        with LocalCluster(
            n_workers=1,
            nanny=False,
            redis_url=redis_url,
            cluster_name=f"{cluster_name}-2",
            dashboard_address=f":{first.port}",
        ) as cluster:
            link = cluster.dashboard_link
            assert link is not None and f":{first.port}/" not in link
            with urllib.request.urlopen(link, timeout=10) as response:
                assert response.status == 200
        assert f"port {first.port} is already in use" in caplog.text
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    for address, why in (("x:y", "not host:port"), ("192.0.2.1:8787", "cannot listen on")):
        with pytest.raises(ValueError, match=why):
            LocalCluster(redis_url=redis_url, cluster_name=cluster_name, dashboard_address=address)
    # refused before anything started
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children
