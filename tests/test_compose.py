"""compose.yaml and the Dockerfile, checked without a Docker engine: every command a
service runs is one ``redisdask`` accepts, Redis keeps an AOF on a volume and asks for a
password that is not in the file, Redis is not published on the host, every service has a
healthcheck and an init, and what the services refer to exists.  The Redis service's
start script and healthcheck are run for real against a redis-server.  (``docker-compose
config`` from Debian's package also accepts the file, with REDIS_PASSWORD set, and refuses
it without; no engine runs on the machines these tests run on.)"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis as redis_lib
import yaml
from polling import poll

from redisdask.cli.parser import build_parser
from redisdask.deploy.embedded import EmbeddedRedis

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
    assert set(commands) == {
        "scheduler", "scheduler-standby", "worker", "monitor", "exporter", "dashboard"
    }  # fmt: skip
    for name, command in commands.items():
        args = parser.parse_args(command)  # exits (SystemExit) on an unknown flag
        assert args.command in ("scheduler", "worker", "monitor", "exporter", "dashboard"), name
        # the URL (with its password) comes from the environment, never the command line
        assert not [part for part in command if "redis://" in part], name
    monitor = services()["monitor"]
    assert monitor["tty"] and monitor["stdin_open"] and monitor["profiles"] == ["tools"]
    assert parser.parse_args(commands["scheduler-standby"]).standby
    worker = parser.parse_args(commands["worker"])
    assert worker.nworkers == 2 and not worker.no_nanny and worker.host == "0.0.0.0"


def test_redis_keeps_an_aof_on_a_volume_and_references_resolve() -> None:
    document = yaml.safe_load((ROOT / "compose.yaml").read_text())
    redis = document["services"]["redis"]
    assert redis["image"].startswith("redis:7")
    assert "--appendonly yes" in redis["command"][-1]
    [mount] = redis["volumes"]
    assert mount.split(":")[0] in document["volumes"] and mount.endswith(":/data")
    for name, service in document["services"].items():
        for dependency in service.get("depends_on", {}):
            assert dependency in document["services"], (name, dependency)
        for volume in service.get("volumes", []):
            assert volume.split(":")[0] in document["volumes"], (name, volume)
        env = service.get("environment", {})
        if "REDISDASK__REDIS__URL" in env:
            assert env["REDISDASK__REDIS__URL"].startswith("redis://:${REDIS_PASSWORD:?")
            assert env["REDISDASK__REDIS__URL"].endswith("}@redis:6379/0")


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


def test_hardened_redis_unpublished_healthchecks_init_and_an_exporter() -> None:
    document = yaml.safe_load((ROOT / "compose.yaml").read_text())
    text = (ROOT / "compose.yaml").read_text()
    assert "REDIS_PASSWORD=" not in text.replace("'REDIS_PASSWORD=%s", "")  # no value here
    redis = document["services"]["redis"]
    assert "ports" not in redis  # not published on the host by default
    assert redis["environment"]["REDIS_PASSWORD"].startswith("${REDIS_PASSWORD:?")
    assert redis["user"] == "redis"
    for name, service in document["services"].items():
        assert service.get("init") is True, name
        check = service.get("healthcheck")
        assert check, name
        if name != "monitor":
            assert check["test"][0] in ("CMD", "CMD-SHELL"), name
    for name in ("scheduler", "scheduler-standby", "worker", "exporter", "dashboard"):
        test = document["services"][name]["healthcheck"]["test"]
        assert test[1:4] == ["python", "-m", "redisdask.healthcheck"], name
    env = document["services"]["exporter"]["environment"]
    assert env["REDISDASK__LOGGING__FORMAT"] == "json"
    [published] = document["services"]["exporter"]["ports"]
    command = build_parser().parse_args(document["services"]["exporter"]["command"])
    assert published == f"127.0.0.1:{command.port}:{command.port}" and command.host == "0.0.0.0"
    [published] = document["services"]["dashboard"]["ports"]
    command = build_parser().parse_args(document["services"]["dashboard"]["command"])
    assert published == f"127.0.0.1:{command.port}:{command.port}" and command.host == "0.0.0.0"
    assert document["services"]["dashboard"]["healthcheck"]["test"][-1] == str(command.port)
    assert "'.[dashboard]'" in (ROOT / "Dockerfile").read_text()


def _unescaped(text: str) -> str:
    return text.replace("$$", "$")  # compose's escape of a $ meant for the shell


def test_the_redis_services_start_script_and_healthcheck_work(tmp_path: Path) -> None:
    """The service's command, run by sh as the container would (redis-server from this
    machine, a port and dir of the test's own): Redis asks for the password, the password
    is not on its command line, and the healthcheck passes with it and fails without."""
    redis_service = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["redis"]
    shell, flag, script = redis_service["command"]
    assert (shell, flag) == ("sh", "-c")
    binary = EmbeddedRedis().binary
    cli = shutil.which("redis-cli", path=f"{binary.parent}:{Path(sys.executable).parent}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = _unescaped(script).replace("/tmp/redis.conf", str(tmp_path / "redis.conf"))
    script = script.replace("exec redis-server", f"exec {binary}")
    script += f" --port {port} --bind 127.0.0.1 --dir {tmp_path}"
    password = "pw" + os.urandom(8).hex()
    env = {**os.environ, "REDIS_PASSWORD": password, "PATH": f"{binary.parent}:/usr/bin:/bin"}
    server = subprocess.Popen(["sh", "-c", script], env=env, stdout=subprocess.DEVNULL)
    try:
        client = redis_lib.Redis(port=port, password=password)
        poll(lambda: _pings(client), timeout=20)
        with pytest.raises(redis_lib.AuthenticationError):
            redis_lib.Redis(port=port).ping()
        assert password not in " ".join(psutil.Process(server.pid).cmdline())
        assert (tmp_path / "redis.conf").stat().st_mode & 0o077 == 0  # only its owner reads
        if cli is not None:  # the healthcheck, as the container runs it
            check = _unescaped(redis_service["healthcheck"]["test"][1])
            check = check.replace("redis-cli", f"{cli} -p {port}")
            assert subprocess.run(["sh", "-c", check], env=env, timeout=10).returncode == 0
            wrong = {**env, "REDIS_PASSWORD": "wrong"}
            assert subprocess.run(["sh", "-c", check], env=wrong, timeout=10).returncode != 0
    finally:
        server.terminate()
        server.wait(timeout=10)


def _pings(client: redis_lib.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis_lib.ConnectionError:
        return False
