"""compose.yaml and the Dockerfile, checked without a Docker engine: every command a
service runs is one ``redisdask`` accepts, Redis keeps an AOF on a volume, and what the
services refer to exists.  (``docker-compose config`` from Debian's package also
accepts the file; see the README: no engine runs on the machines these tests run on.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from redisdask.cli import build_parser

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parent.parent


def services() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]


def test_every_service_command_is_a_valid_redisdask_command() -> None:
    parser = build_parser()
    commands = {
        name: s["command"]
        for name, s in services().items()
        if s.get("image", "").startswith("redisdask")
    }
    assert set(commands) == {"scheduler", "scheduler-standby", "worker", "monitor"}
    for name, command in commands.items():
        args = parser.parse_args(command)  # exits (SystemExit) on an unknown flag
        assert args.command in ("scheduler", "worker", "monitor"), name
    monitor = services()["monitor"]
    assert monitor["tty"] and monitor["stdin_open"] and monitor["profiles"] == ["tools"]
    assert parser.parse_args(commands["scheduler-standby"]).standby
    worker = parser.parse_args(commands["worker"])
    assert worker.nworkers == 2 and not worker.no_nanny and worker.host == "0.0.0.0"


def test_redis_keeps_an_aof_on_a_volume_and_references_resolve() -> None:
    document = yaml.safe_load((ROOT / "compose.yaml").read_text())
    redis = document["services"]["redis"]
    assert redis["image"].startswith("redis:7")
    assert "--appendonly" in redis["command"] and "yes" in redis["command"]
    [mount] = redis["volumes"]
    assert mount.split(":")[0] in document["volumes"] and mount.endswith(":/data")
    for name, service in document["services"].items():
        for dependency in service.get("depends_on", {}):
            assert dependency in document["services"], (name, dependency)
        for volume in service.get("volumes", []):
            assert volume.split(":")[0] in document["volumes"], (name, volume)
        env = service.get("environment", {})
        if "REDISDASK__REDIS__URL" in env:
            assert env["REDISDASK__REDIS__URL"].startswith("redis://redis:6379")


def test_the_dockerfile_installs_every_package_and_runs_the_cli() -> None:
    text = (ROOT / "Dockerfile").read_text()
    for package in ("redisdask", "workers", "nanny"):
        assert f"COPY {package} ./{package}" in text
    assert 'ENTRYPOINT ["redisdask"]' in text and "python:3.11" in text
    # the processes must not start in the source folder, where ./redisdask would shadow the
    # installed package (which holds redisdask.workers and redisdask.nanny)
    workdirs = [line.split()[1] for line in text.splitlines() if line.startswith("WORKDIR")]
    copied_to = workdirs[0]
    assert len(workdirs) == 2 and workdirs[-1] != copied_to
