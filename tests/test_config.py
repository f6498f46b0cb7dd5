"""Tests for redisdask.config: layering defaults <- file <- env <- kwargs, and errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from redisdask.config import Config, ConfigError, load_config
from redisdask.store.urls import parse_sentinel_url
from redisdask.utils import sizes


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Isolate from the developer's env vars and ~/.config file."""
    import os

    for name in list(os.environ):
        if name.startswith("REDISDASK_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def write_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> Path:
    path = tmp_path / "redisdask.yaml"
    path.write_text(text)
    monkeypatch.setenv("REDISDASK_CONFIG", str(path))
    return path


def test_defaults() -> None:
    config = load_config()
    assert config.redis.url == "redis://127.0.0.1:6379/0"
    assert config.redis.connect_timeout == 5.0
    assert config.redis.server_binary is None
    assert config.redis.down_deadline == 30.0
    assert config.cluster.name == "default"
    assert config.get("scheduler.allowed-failures") == 3
    assert config.scheduler.worker_ttl == 3.0
    assert config.scheduler.lease_ttl == 5.0
    assert config.scheduler.batch_size == 100
    assert config.scheduler.client_ttl == 30.0
    assert config.worker.nthreads is None
    assert config.worker.memory_limit == "auto"
    assert config.worker.heartbeat_interval == 0.5
    assert config.worker.connection_limit == 50
    assert config.worker.transfer_batch_bytes == 200_000_000
    assert config.worker.claim_horizon == 0.02
    memory = config.worker.memory
    assert (memory.target, memory.spill, memory.pause, memory.terminate) == (
        0.60, 0.70, 0.80, 0.95,
    )  # fmt: skip
    assert config.get("worker.memory.monitor-interval") == 0.2
    assert config.client.heartbeat_interval == 2.0
    assert config.client.submit_batch == 1000
    assert config.logging.level == "INFO"
    assert config == Config()


def test_get_unknown_key() -> None:
    config = load_config()
    with pytest.raises(KeyError, match=r"scheduler\.nope"):
        config.get("scheduler.nope")
    assert config.get("scheduler.nope", None) is None
    assert config.get("worker.memory").target == 0.6


def test_yaml_file_via_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_config(
        tmp_path,
        monkeypatch,
        "scheduler:\n  allowed-failures: 7\n  worker-ttl: 1500ms\n"
        "worker:\n  memory:\n    target: false\n",
    )
    config = load_config()
    assert config.scheduler.allowed_failures == 7
    assert config.scheduler.worker_ttl == 1.5
    assert config.worker.memory.target is False
    assert config.worker.memory.spill == 0.70


def test_default_file_location(tmp_path: Path) -> None:
    path = tmp_path / "home" / ".config" / "redisdask" / "redisdask.yaml"
    path.parent.mkdir(parents=True)
    path.write_text("cluster:\n  name: from-home\n")
    assert load_config().cluster.name == "from-home"


def test_env_overrides_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_config(tmp_path, monkeypatch, "scheduler:\n  allowed-failures: 7\n")
    monkeypatch.setenv("REDISDASK__SCHEDULER__ALLOWED_FAILURES", "5")
    monkeypatch.setenv("REDISDASK__WORKER__MEMORY__TARGET", "false")
    monkeypatch.setenv("REDISDASK__WORKER__MEMORY__MONITOR_INTERVAL", "0.5")
    monkeypatch.setenv("REDISDASK__REDIS__URL", "redis://10.0.0.1:6380/2")
    config = load_config()
    assert config.scheduler.allowed_failures == 5
    assert config.worker.memory.target is False
    assert config.worker.memory.monitor_interval == 0.5
    assert config.redis.url == "redis://10.0.0.1:6380/2"


def test_kwargs_beat_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDISDASK__SCHEDULER__ALLOWED_FAILURES", "5")
    monkeypatch.setenv("REDISDASK__WORKER__NTHREADS", "2")
    config = load_config({"scheduler.allowed-failures": 9, "worker": {"memory": {"spill": False}}})
    assert config.scheduler.allowed_failures == 9
    assert config.worker.nthreads == 2
    assert config.worker.memory.spill is False
    assert load_config({"scheduler": {"allowed_failures": 1}}).scheduler.allowed_failures == 1


def test_file_error_names_key_value_and_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_config(tmp_path, monkeypatch, "scheduler:\n  lease-ttl: -1\n")
    with pytest.raises(ConfigError) as info:
        load_config()
    message = str(info.value)
    assert "scheduler.lease-ttl" in message and "-1" in message and str(path) in message
    assert info.value.key == "scheduler.lease-ttl"
    assert info.value.value == -1


def test_env_error_names_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDISDASK__WORKER__MEMORY__TARGET", "1.5")
    with pytest.raises(ConfigError, match=r"worker\.memory\.target = 1\.5") as info:
        load_config()
    assert "REDISDASK__WORKER__MEMORY__TARGET" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_kwargs_error_wrong_type() -> None:
    with pytest.raises(ConfigError, match=r"scheduler\.allowed-failures = 'many'.*keyword"):
        load_config({"scheduler.allowed-failures": "many"})
    with pytest.raises(ConfigError, match=r"worker\.nthreads = True"):
        load_config({"worker.nthreads": True})


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"worker.nthread": 4}, "worker.nthread"),
        ({"bogus": {"deep": 1}}, "bogus"),
        ({"worker.memory.everything": 0.5}, "worker.memory.everything"),
    ],
)
def test_unknown_key_rejected(overrides: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match="unknown key") as info:
        load_config(overrides)
    assert info.value.key == key
    assert "keyword override" in str(info.value)


def test_unknown_key_in_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_config(tmp_path, monkeypatch, "schedular:\n  allowed-failures: 1\n")
    with pytest.raises(ConfigError, match="schedular") as info:
        load_config()
    assert str(path) in str(info.value)


def test_missing_or_bad_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDISDASK_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match=r"missing\.yaml does not exist"):
        load_config()
    write_config(tmp_path, monkeypatch, "- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config()


def test_to_yaml_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config(
        {"worker.memory.target": False, "cluster.name": "c1", "worker.nthreads": 3}
    )
    text = config.to_yaml()
    assert "allowed-failures: 3" in text
    assert yaml.safe_load(text)["worker"]["memory"]["target"] is False
    write_config(tmp_path, monkeypatch, text)
    assert load_config() == config


def test_assignment_is_validated() -> None:
    config = load_config()
    with pytest.raises(ValueError):
        config.scheduler.worker_ttl = -1.0


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"scheduler.lease-ttl": float("inf")}, "scheduler.lease-ttl"),
        ({"scheduler.worker-ttl": float("nan")}, "scheduler.worker-ttl"),
        ({"worker.heartbeat-interval": 3}, "worker.heartbeat-interval (3.0s) must be shorter"),
        ({"client.heartbeat-interval": "1 minute"}, "client.heartbeat-interval (60.0s)"),
        ({"worker.memory.pause": 0.5}, "pause (0.5) is below spill (0.7)"),
        ({"worker.memory.spill": 0.99}, "pause (0.8) is below spill (0.99)"),
        ({"worker.memory-limit": 2}, "2 bytes"),
        ({"worker.memory-limit": "1e400"}, "finite"),
    ],
)
def test_settings_that_cannot_work_are_refused_at_start(
    overrides: dict[str, object], named: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)) as info:
        load_config(overrides)
    assert "keyword override" in str(info.value)


def test_marks_may_be_switched_off_and_a_limit_of_one_is_all_memory() -> None:
    config = load_config({"worker.memory.spill": False, "worker.memory.pause": 0.65})
    assert config.worker.memory.spill is False
    assert load_config({"worker.memory.target": 0.9}).worker.memory.target == 0.9  # as Dask
    assert sizes.memory_limit(1, 1) == sizes.memory_limit(1.0, 1) > 2**20


def test_sentinels_and_their_service_stand_for_a_sentinel_url() -> None:
    config = load_config(
        {
            "redis.url": "redis://alice:p%40ss@ignored:6379/3",
            "redis.sentinels": ["10.0.0.1:26379", "10.0.0.2"],
            "redis.sentinel-service": "mymaster",
        },
        environ={},
    )
    address = config.redis.address
    assert address == "redis+sentinel://alice:p%40ss@10.0.0.1:26379,10.0.0.2/mymaster/3"
    parsed = parse_sentinel_url(address)
    assert parsed is not None
    assert parsed.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26379))
    assert (parsed.service, parsed.db, parsed.username, parsed.password) == (
        "mymaster",
        3,
        "alice",
        "p@ss",
    )
    # a redis+sentinel:// URL (what a LocalCluster hands its processes) wins
    url = "redis+sentinel://127.0.0.1:26380/other/0"
    assert load_config({"redis.url": url}, environ={}).redis.address == url
    assert load_config({}, environ={}).redis.address == "redis://127.0.0.1:6379/0"


def test_sentinels_without_a_service_are_refused_naming_both_keys() -> None:
    with pytest.raises(ConfigError, match=r"redis\.sentinels and redis\.sentinel-service go"):
        load_config({"redis.sentinels": ["h:26379"]}, environ={})
    with pytest.raises(ConfigError, match="bad Sentinel address 'h:x'"):
        load_config({"redis.sentinels": ["h:x"], "redis.sentinel-service": "m"}, environ={})
    with pytest.raises(ConfigError, match="wait-replicas"):
        load_config({"redis.wait-replicas": -1}, environ={})
    with pytest.raises(ConfigError, match="TLS through Sentinel is not supported"):
        load_config(
            {"redis.url": "rediss://h:6380/0", "redis.sentinels": ["h:26379"],
             "redis.sentinel-service": "m"}, environ={},
        )  # fmt: skip


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://u:hunter2@h:6379/0", "redis://u:***@h:6379/0"),
        ("redis://:hunter2@h/0", "redis://:***@h/0"),
        ("redis://h:6379/0?password=hunter2&db=1", "redis://h:6379/0?password=***&db=1"),
        (
            "redis://h/0?socket_timeout=5&Password=hunter2",
            "redis://h/0?socket_timeout=5&Password=***",
        ),
        ("redis://h:6379/0", "redis://h:6379/0"),
    ],
)
def test_redact_hides_a_password_in_the_address_or_the_query(url: str, shown: str) -> None:
    from redisdask.store.urls import redact

    assert redact(url) == shown
