"""The ``redisdask`` command line: help, config, exit codes, bad input."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "redisdask", *args],
        capture_output=True,
        text=True,
        timeout=45,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    "command", [[], ["scheduler"], ["worker"], ["exporter"], ["demo"], ["config"]]
)
def test_help_on_every_command(command: list[str]) -> None:
    result = run(*command, "--help")
    assert result.returncode == 0
    assert "usage: redisdask" in result.stdout
    if command in (["scheduler"], ["worker"], ["exporter"]):
        assert "redis_url" in result.stdout and "--cluster" in result.stdout


def test_config_show_prints_the_effective_config() -> None:
    result = run("config", "show", env={"REDISDASK__SCHEDULER__ALLOWED_FAILURES": "7"})
    assert result.returncode == 0
    assert "allowed-failures: 7" in result.stdout


def test_an_owner_pipe_that_names_no_open_file_is_said_and_not_watched() -> None:
    """``REDISDASK_OWNER_FD`` (``redisdask/utils/owner.py``) copied into an environment
    instead of handed on with its pipe: the command says so and runs, unwatched."""
    result = run("config", "show", env={"REDISDASK_OWNER_FD": "987"})
    assert result.returncode == 0, result.stderr
    assert "REDISDASK_OWNER_FD=987 names no open file here" in result.stderr
    assert "allowed-failures" in result.stdout


def test_invalid_config_exits_2_naming_the_key() -> None:
    result = run("config", "show", env={"REDISDASK__SCHEDULER__WORKER_TTL": "-1"})
    assert result.returncode == 2
    assert "scheduler.worker-ttl" in result.stderr
    assert "REDISDASK__SCHEDULER__WORKER_TTL" in result.stderr


def test_an_unknown_log_format_exits_2_naming_the_key() -> None:
    result = run("config", "show", env={"REDISDASK__LOGGING__FORMAT": "xml"})
    assert result.returncode == 2
    assert "logging.format" in result.stderr and "REDISDASK__LOGGING__FORMAT" in result.stderr
    assert "json" in result.stderr  # the values it takes


def test_bad_usage_exits_2() -> None:
    assert run("no-such-command").returncode == 2


@pytest.mark.parametrize(
    "command",
    [["scheduler"], ["worker"], ["status"], ["monitor"], ["inspect", "deaths"],
     ["inspect", "events", "--follow"]],
)  # fmt: skip
def test_unreachable_redis_exits_1_with_a_clear_message(command: list[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    where = 2 if command[0] == "inspect" else 1  # the URL follows the (sub)command
    args = [*command[:where], f"redis://127.0.0.1:{port}/0", *command[where:]]
    result = run(*args, env={"REDISDASK__REDIS__CONNECT_TIMEOUT": "2"})
    assert result.returncode == 1
    assert f"127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["scheduler", "--lease-ttl", "0"], "scheduler.lease-ttl"),
        (["scheduler", "--lease-ttl", "nan"], "scheduler.lease-ttl"),
        (["scheduler", "--lease-ttl", ".inf"], "scheduler.lease-ttl"),
        (["scheduler", "--allowed-failures", "-1"], "scheduler.allowed-failures"),
        (["worker", "--nthreads", "0"], "worker.nthreads"),
        (["worker", "--nthreads", "["], "worker.nthreads"),
        (["worker", "--port", "99999"], "--port"),
        (["worker", "--nworkers", "0"], "--nworkers"),
        (["worker", "--memory-limit", "1e400"], "worker.memory-limit"),
        (["worker", "--memory-limit", "2"], "2 bytes"),
        (["worker", "--lifetime", "0"], "--lifetime"),
        (["inspect", "events", "-n", "-5"], "--count"),
        (["monitor", "--interval", "inf"], "--interval"),
        (["demo", "--workers", "0"], "--workers"),
        (["scheduler", "--lease-ttl", "0.0001"], "scheduler.lease-ttl"),
        (["scheduler", "--cluster", "a b{x}"], "--cluster"),
        (["worker", "--cluster", "a" * 200], "--cluster"),
        (["status", "--cluster", "{x}"], "--cluster"),
        (["worker", "--host", "999.1.1.1"], "--host"),
        (["worker", "--no-nanny", "--host", "8.8.8.8"], "--host"),  # (not this machine's)
        (["exporter", "--host", "8.8.8.8"], "--host"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag_without_a_traceback(args: list[str], named: str) -> None:
    """Flags that set a config key go through the config's validation, naming the flag;
    the others are checked by their argparse types.  Nothing starts, nothing crashes."""
    result = run(*args, "redis://127.0.0.1:1/0")
    assert result.returncode == 2, result.stderr
    assert named in result.stderr
    assert "Traceback" not in result.stderr
    assert named in result.stderr.strip().splitlines()[-1]  # one line says it (after usage)
    if "." in named and not named.startswith("-"):
        assert "command-line flag --" in result.stderr


def test_a_flag_overrides_the_config_and_is_validated_like_it() -> None:
    """`--allowed-failures 0` is accepted (a valid config value), `-1` refused as the
    environment variable would be: one validation for both."""
    env = {"REDISDASK__SCHEDULER__ALLOWED_FAILURES": "-1"}
    from_env = run("config", "show", env=env)
    assert from_env.returncode == 2 and "REDISDASK__SCHEDULER__ALLOWED_FAILURES" in from_env.stderr
    from_flag = run("scheduler", "--allowed-failures", "-1", "redis://127.0.0.1:1/0")
    assert from_flag.returncode == 2
    assert "Input should be greater than or equal to 0" in from_env.stderr
    assert "Input should be greater than or equal to 0" in from_flag.stderr


def test_version_has_one_source() -> None:
    """`redisdask --version`, `redisdask.__version__` and pyproject.toml agree."""
    import tomllib
    from pathlib import Path

    import redisdask

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    declared = tomllib.loads(pyproject.read_text())["project"]["version"]
    result = run("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"redisdask {declared}" == f"redisdask {redisdask.__version__}"
