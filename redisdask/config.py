"""Typed, layered configuration for every redisdask process.

Why: scheduler, workers, nannies and clients must agree on timeouts and limits, and a
typo'd key or a negative TTL should fail loudly at start-up, naming *where* it came
from, instead of surfacing as a hung cluster.  So settings are pydantic models with
``extra="forbid"``, keyed Dask-style (``scheduler.allowed-failures``), and loaded in
layers, later winning:

1. model defaults (Dask's, where Dask has the setting);
2. a YAML file: ``$REDISDASK_CONFIG``, else ``~/.config/redisdask/redisdask.yaml``;
3. environment variables ``REDISDASK__SECTION__KEY=value`` (``_`` -> ``-``; values
   parsed with ``yaml.safe_load`` so ``5``/``0.5``/``false`` get their types);
4. keyword overrides, nested dicts or dotted keys.

Keys are normalised to dashes everywhere, so ``allowed_failures`` and
``allowed-failures`` are the same key; Python attributes are snake_case.
"""

from __future__ import annotations

import itertools
import os
import re
import urllib.parse
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from redisdask.errors import ConfigError  # defined there, in the tree; importable here too
from redisdask.placement import parse_resources
from redisdask.store.keyspace import validate_cluster_name
from redisdask.store.urls import parse_sentinel_url, redact, sentinel_url
from redisdask.utils import sizes

__all__ = ["Config", "ConfigError", "config_path", "load_config"]

ENV_PREFIX = "REDISDASK__"
ENV_CONFIG_PATH = "REDISDASK_CONFIG"
DEFAULT_PATH = Path("~/.config/redisdask/redisdask.yaml")
DEFAULT_SOURCE = "defaults"

Key = tuple[str, ...]


# --------------------------------------------------------------------------- value types

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
_SCALE = {
    "": 1.0, "ms": 1e-3, "s": 1.0, "sec": 1.0, "secs": 1.0, "second": 1.0, "seconds": 1.0,
    "m": 60.0, "min": 60.0, "mins": 60.0, "minute": 60.0, "minutes": 60.0,
    "h": 3600.0, "hr": 3600.0, "hour": 3600.0, "hours": 3600.0,
    "d": 86400.0, "day": 86400.0, "days": 86400.0,
}  # fmt: skip


def parse_duration(value: str | float) -> float:
    """Seconds from ``"500ms"``, ``"3s"``, ``"5 minutes"``, ``"1 hour"`` or a number."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    match = _DURATION.match(str(value))
    if match is None or match.group(2).lower() not in _SCALE:
        raise ValueError(f"not a duration: {value!r} (write e.g. 30, '500ms', '5 minutes')")
    return float(match.group(1)) * _SCALE[match.group(2).lower()]


def _duration(value: Any) -> Any:
    """Accept Dask-style ``"500ms"``/``"3s"``/``"1 hour"`` strings as well as seconds."""
    if isinstance(value, str):
        try:
            return parse_duration(value)
        except ValueError:
            return value  # the field's own validation names the problem
    return value


def _level(value: Any) -> Any:
    return value.upper() if isinstance(value, str) else value


def _resources(value: Any) -> Any:
    """Dask's ``--resources "GPU=2,MEM=10e9"`` (commas or spaces), or a mapping; the
    amounts must be finite numbers >= 0 (``placement.parse_resources`` says what is
    wrong with which entry)."""
    if value is None:
        return {}
    if isinstance(value, str | dict):
        try:
            return parse_resources(value, "")
        except TypeError as exc:
            raise ValueError(str(exc)) from None
    raise ValueError(f"resources must be NAME=AMOUNT pairs like 'GPU=2,MEM=10e9', got {value!r}")


Seconds = Annotated[float, Field(gt=0), BeforeValidator(_duration)]
NonNegSeconds = Annotated[float, Field(ge=0), BeforeValidator(_duration)]
Fraction = Annotated[float, Field(gt=0, le=1)] | Literal[False]
LogLevel = Annotated[
    Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], BeforeValidator(_level)
]


def _dash(name: str) -> str:
    return name.replace("_", "-")


class Section(BaseModel):
    """Base for all sections: dashed aliases, snake_case attributes, no unknown keys."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,  # no bool->int or "5"->5 coercion; YAML/env parsing already typed it
        alias_generator=_dash,
        populate_by_name=True,
        validate_assignment=True,
        validate_default=True,
        allow_inf_nan=False,  # `.inf` seconds or `nan` bytes are typos, not settings
    )


# --------------------------------------------------------------------------- sections


class RedisConfig(Section):
    """Where Redis is: ``url`` (``redis://``, or ``redis+sentinel://`` naming Sentinels:
    ``urls.parse_sentinel_url``), or ``sentinels`` and ``sentinel-service``, which
    stand for such a URL (with the credentials and db of a ``redis://`` ``url``).  Read
    it as ``address``."""

    url: str = "redis://127.0.0.1:6379/0"
    # the Redis ACL user every connection logs in as (``docs/security.md``): from the
    # config file or the environment, not the URL on a command line, which ``ps`` shows;
    # a user and password in the URL win over these
    username: str | None = None
    password: SecretStr | None = None
    # host:port of Redis Sentinels; with sentinel-service, every process connects to the
    # primary they name and follows it through a failover
    sentinels: list[str] = Field(default_factory=list)
    sentinel_service: str | None = None  # the primary's name in the Sentinels' config
    connect_timeout: Seconds = 5.0
    server_binary: str | None = None  # explicit redis-server for the embedded server
    down_deadline: Seconds = 30.0  # how long to retry a Redis that is down before raising
    # TLS to Redis (a rediss:// URL): redis-py's ssl_ca_certs, ssl_certfile, ssl_keyfile
    ssl_ca_certs: str | None = None  # the CA that signed the server's certificate
    ssl_certfile: str | None = None  # our client certificate, if Redis asks for one
    ssl_keyfile: str | None = None
    # replicas that must have each scheduler write (WAIT) before it counts as done, so
    # that an acknowledged batch survives a failover; a WAIT that times out is logged
    wait_replicas: Annotated[int, Field(ge=0)] = 0
    wait_timeout: Seconds = 1.0

    @model_validator(mode="after")
    def _check_sentinels(self) -> RedisConfig:
        if bool(self.sentinels) != bool(self.sentinel_service):
            raise ValueError(
                "redis.sentinels and redis.sentinel-service go together: the Sentinels' "
                "host:port addresses, and the name of the primary they watch"
            )
        if self.sentinels and self.url.startswith("rediss:"):
            raise ValueError(
                "redis.sentinels with a rediss:// redis.url: TLS through Sentinel is not "
                "supported (the connections would go in the clear); use a redis:// URL on a "
                "private network, or TLS to one Redis without Sentinel"
            )
        if self.sentinels:
            try:
                parse_sentinel_url(self.address)
            except ValueError as exc:
                raise ValueError(f"redis.sentinels: {exc}") from None
        return self

    @property
    def address(self) -> str:
        """The URL every process connects with: ``url``, or the ``redis+sentinel://``
        URL of ``sentinels`` and ``sentinel-service`` (with the login and db of ``url``)
        unless ``url`` is itself a ``redis+sentinel://`` URL (as a ``LocalCluster`` hands
        its processes)."""
        if not self.sentinels or self.url.startswith("redis+sentinel:"):
            return self.url
        parts = urllib.parse.urlsplit(self.url)
        db = parts.path.strip("/")
        return sentinel_url(
            self.sentinels,
            self.sentinel_service or "",
            urllib.parse.unquote(parts.username) if parts.username else None,
            urllib.parse.unquote(parts.password) if parts.password is not None else None,
            int(db) if db.isdigit() else 0,
        )


class ClusterConfig(Section):
    name: Annotated[str, AfterValidator(validate_cluster_name)] = "default"


class TLSConfig(Section):
    """TLS between peers (``redisdask/security.py``, distributed's ``comm.tls``): the CA
    that signed every peer's certificate, this process's certificate and its key (PEM).
    All set: TLS is on, and required; none set: plain TCP."""

    ca_file: str | None = None
    cert: str | None = None
    key: str | None = None


class CommTimeoutsConfig(Section):
    """distributed's ``comm.timeouts``.  ``tcp``: a peer that moves no byte for this
    long while a request waits on it (or mid-message) is taken for dead: the fetch fails
    over to another holder, then to the scheduler (``missing-data``); also the TCP
    keepalive and ``TCP_USER_TIMEOUT`` of every peer socket.  A deadline on progress:
    a big transfer that keeps moving is never cut.  ``idle``: a data server closes a
    connection that sent no request for this long.  ``connect``: a worker's new
    connection to a peer (connect and handshake) fails over after this long, as a silent
    pooled one does after ``tcp`` (a peer behind a network cut answers no SYN)."""

    connect: Seconds = 5.0
    tcp: Seconds = 30.0
    idle: Seconds = 300.0


class CommConfig(Section):
    tls: TLSConfig = Field(default_factory=TLSConfig)
    timeouts: CommTimeoutsConfig = Field(default_factory=CommTimeoutsConfig)
    # connections one worker's data server holds open: beyond, the oldest idle one is
    # closed, or (none idle) the new one refused
    max_connections: Annotated[int, Field(gt=0)] = 1000


class LocksConfig(Section):
    """``Lock`` and ``Semaphore`` (Dask's ``distributed.scheduler.locks``): a lease not
    renewed for this long is gone (its holder died); holders renew every fifth of it."""

    lease_timeout: Seconds = 30.0


class SchedulerConfig(Section):
    allowed_failures: Annotated[int, Field(ge=0)] = 3
    worker_ttl: Seconds = 3.0
    # renewed every third of it: a lease shorter than a few renewals' time lapses between them
    lease_ttl: Annotated[float, Field(ge=0.1), BeforeValidator(_duration)] = 5.0
    # max stream entries per read (of each input stream): a client's entry carries up to
    # client.submit-batch tasks, and 1,000 of them (175 MB) took longer to read than the
    # lease on a loaded machine
    batch_size: Annotated[int, Field(gt=0)] = 100
    client_ttl: Seconds = 30.0
    # move claimed tasks not started from busy workers to idle ones
    # (redisdask/scheduler/stealing.py; Dask's distributed.scheduler.work-stealing)
    work_stealing: bool = True
    locks: LocksConfig = Field(default_factory=LocksConfig)


Share = Annotated[float, Field(ge=0, le=1)]


class RebalanceConfig(Section):
    """``Client.rebalance`` (Dask's ``distributed.worker.memory.rebalance``), read by the
    scheduler; fractions of each worker's memory limit (ignored for a worker without
    one).  Dask's ``measure`` is not offered: the scheduler weighs what a worker holds by
    its results' sizes (Dask's managed memory)."""

    sender_min: Share = 0.30  # a worker holding less than this gives nothing
    recipient_max: Share = 0.60  # a worker holding more than this takes nothing
    # around the mean, a band this wide where a worker neither gives nor takes
    sender_recipient_gap: Share = 0.10


class WorkerMemoryConfig(Section):
    target: Fraction = 0.60
    spill: Fraction = 0.70
    pause: Fraction = 0.80
    terminate: Fraction = 0.95
    monitor_interval: Seconds = 0.2
    rebalance: RebalanceConfig = Field(default_factory=RebalanceConfig)

    @model_validator(mode="after")
    def _check_order(self) -> WorkerMemoryConfig:
        """The marks a worker passes as its process memory grows come in this order:
        spilling before pausing before the nanny's kill; a mark out of order never acts.
        (``target``, a mark of managed memory, is free, as in Dask.)"""
        marks = [(name, getattr(self, name)) for name in ("spill", "pause", "terminate")]
        set_marks = [(name, value) for name, value in marks if value is not False]
        for (low, low_value), (high, high_value) in itertools.pairwise(set_marks):
            if low_value > high_value:
                raise ValueError(
                    f"{high} ({high_value}) is below {low} ({low_value}): the marks must rise "
                    "spill <= pause <= terminate (each may be false)"
                )
        return self


class WorkerConfig(Section):
    nthreads: Annotated[int, Field(gt=0)] | None = None  # None: one per CPU
    memory_limit: int | float | str | None = "auto"
    heartbeat_interval: Seconds = 0.5
    local_directory: str | None = None
    connection_limit: Annotated[int, Field(gt=0)] = 50
    transfer_batch_bytes: Annotated[int, Field(gt=0)] = 200_000_000
    # a result at most this big (pickled) travels with its report into its task's record
    # in Redis: no fetch from the worker, and it survives the worker's death; 0: never
    inline_result_bytes: Annotated[int, Field(ge=0)] = 65_536
    # ... but not once Redis's used_memory passes this share of its maxmemory, or this
    # many bytes (None: no cap), as the workers' heartbeats read it: Redis keeps room for
    # the cluster's records, and a big map's results stay on the workers
    inline_results_redis_fraction: Annotated[float, Field(gt=0, le=1)] = 0.5
    inline_results_redis_bytes: Annotated[int, Field(ge=0)] | None = None
    claim_horizon: NonNegSeconds = 0.02  # seconds of estimated run time to claim ahead
    hang_timeout: Seconds = 10.0  # silent and idle this long: the nanny restarts it
    # abstract amounts tasks may ask for (submit(..., resources={"GPU": 1})), as in Dask
    resources: Annotated[dict[str, float], BeforeValidator(_resources)] = Field(
        default_factory=dict
    )
    memory: WorkerMemoryConfig = Field(default_factory=WorkerMemoryConfig)

    @field_validator("memory_limit")
    @classmethod
    def _check_memory_limit(cls, value: int | float | str | None) -> int | float | str | None:
        """Dask's forms: "auto", bytes, a "4GiB"-style string, a fraction, or None/0."""
        if isinstance(value, bool):
            raise ValueError("must be 'auto', a byte count, a size like '4GiB', or a fraction")
        if value is not None and value != "auto":
            try:
                sizes.memory_limit(value, 1)
            except ValueError as exc:
                raise ValueError(
                    f"must be 'auto', a byte count, a size or a fraction: {exc}"
                ) from None
        return value


class ClientConfig(Section):
    heartbeat_interval: Seconds = 2.0
    # tasks per stream entry; the scheduler applies an entry in one batch, which must end
    # well within its lease even on a loaded machine (5,000 took 3.9 s at a load of 10)
    submit_batch: Annotated[int, Field(gt=0)] = 1000
    # result()/gather()/wait() raise ClusterNotRunningError once no scheduler has led the
    # cluster, or no worker has been registered, this long (seen at each heartbeat)
    no_scheduler_timeout: Seconds = 30.0
    # client.run, register_plugin, upload_file: how long each worker has to answer
    run_timeout: Seconds = 60.0


class AdminConfig(Section):
    """Dask's ``distributed.admin``."""

    # a task's error message longer than this (characters) is cut to it, and a pickled
    # traceback longer than this (bytes) is not sent (distributed's default)
    max_error_length: Annotated[int, Field(ge=0)] = 10_000


class LoggingConfig(Section):
    level: LogLevel = "INFO"
    # text: one readable line per record; json: one JSON object per line (redisdask/utils/logs.py),
    # for log shippers
    format: Literal["text", "json"] = "text"


class RetentionConfig(Section):
    """How much history a cluster keeps in Redis: the event, death and story streams are
    trimmed to exactly this many entries at every append, so a cluster that runs for
    months does not grow Redis."""

    events: Annotated[int, Field(gt=0)] = 10_000  # rd:{c}:events
    deaths: Annotated[int, Field(gt=0)] = 10_000  # rd:{c}:deaths
    story: Annotated[int, Field(gt=0)] = 5_000  # scheduler story entries (<= 100 transitions)
    worker_story: Annotated[int, Field(gt=0)] = 500  # per worker, entries of <= 100 lines
    worker_story_ttl: Seconds = 3600.0  # how long a departed worker's story is kept
    logs: Annotated[int, Field(ge=0)] = 10_000  # log records per process stream; 0: none
    logs_bytes: Annotated[int, Field(gt=0)] = 4_000_000  # and their bytes, at most (about)
    logs_ttl: Seconds = 86_400.0  # how long a process's logs are kept after its last record


class Config(Section):
    """All settings. Attribute access is snake_case; ``get`` takes dotted dashed keys."""

    redis: RedisConfig = Field(default_factory=RedisConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    comm: CommConfig = Field(default_factory=CommConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    worker: WorkerConfig = Field(default_factory=WorkerConfig)
    client: ClientConfig = Field(default_factory=ClientConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    admin: AdminConfig = Field(default_factory=AdminConfig)
    retention: RetentionConfig = Field(default_factory=RetentionConfig)

    @model_validator(mode="after")
    def _check_heartbeats(self) -> Config:
        """A worker that beats more slowly than the scheduler waits for is declared dead
        between two beats: refuse that at start instead of losing workers at run time."""
        beat, ttl = self.worker.heartbeat_interval, self.scheduler.worker_ttl
        if beat >= ttl:
            raise ValueError(
                f"worker.heartbeat-interval ({beat}s) must be shorter than "
                f"scheduler.worker-ttl ({ttl}s), or every worker is declared dead between beats"
            )
        beat, ttl = self.client.heartbeat_interval, self.scheduler.client_ttl
        if beat >= ttl:
            raise ValueError(
                f"client.heartbeat-interval ({beat}s) must be shorter than "
                f"scheduler.client-ttl ({ttl}s), or every client is declared gone between beats"
            )
        return self

    def get(self, key: str, default: Any = ...) -> Any:
        """``config.get("worker.memory.target")``; sections come back as models."""
        node: Any = self
        for part in key.split("."):
            name = part.replace("-", "_")
            if not isinstance(node, BaseModel) or name not in type(node).model_fields:
                if default is not ...:
                    return default
                raise KeyError(f"unknown config key {key!r}")
            node = getattr(node, name)
        return node

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict with the dashed YAML keys."""
        return self.model_dump(by_alias=True, mode="json")

    def to_yaml(self) -> str:
        """The effective configuration as YAML (``redisdask config show``), with the
        password of the Redis URL masked."""
        data = self.to_dict()
        data["redis"]["url"] = redact(data["redis"]["url"])
        return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


# --------------------------------------------------------------------------- layering


class _Layers:
    """A merged nested dict plus, per leaf key, the source that set it."""

    def __init__(self) -> None:
        self.tree: dict[str, Any] = {}
        self.sources: dict[Key, str] = {}

    def set(self, key: Key, value: Any, source: str) -> None:
        node = self.tree
        for part in key[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[key[-1]] = value
        self.sources = {k: s for k, s in self.sources.items() if k[: len(key)] != key}
        self.sources[key] = source

    def source_of(self, key: Key) -> str:
        for end in range(len(key), 0, -1):
            if key[:end] in self.sources:
                return self.sources[key[:end]]
        below = [s for k, s in self.sources.items() if k[: len(key)] == key]
        return ", ".join(dict.fromkeys(below)) or DEFAULT_SOURCE


def _split(key: str) -> Key:
    return tuple(_dash(part.strip()) for part in key.split("."))


def _flatten(data: Mapping[str, Any], prefix: Key = ()) -> Iterable[tuple[Key, Any]]:
    """Nested and/or dotted mappings -> ``(("scheduler", "allowed-failures"), 5)`` pairs."""
    for raw, value in data.items():
        key = prefix + _split(str(raw))
        if isinstance(value, Mapping):
            yield from _flatten(value, key)  # an empty mapping sets nothing
        else:
            yield key, value


def config_path() -> Path | None:
    """The YAML file to read: ``$REDISDASK_CONFIG`` (must exist), else the default if present."""
    explicit = os.environ.get(ENV_CONFIG_PATH)
    if explicit:
        return Path(explicit).expanduser()
    default = DEFAULT_PATH.expanduser()
    return default if default.is_file() else None


def _read_file(path: Path) -> Mapping[str, Any]:
    source = f"config file {path}"
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{source} does not exist (set by ${ENV_CONFIG_PATH})") from None
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {source}: {exc}", source=source) from exc
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source} must contain a mapping, got {type(data).__name__}")
    return data


# taken from the environment as written: a password of digits, or "yes", is a string;
# so is a path
_VERBATIM = {
    ("redis", "username"), ("redis", "password"),
    ("redis", "ssl-ca-certs"), ("redis", "ssl-certfile"), ("redis", "ssl-keyfile"),
    ("comm", "tls", "ca-file"), ("comm", "tls", "cert"), ("comm", "tls", "key"),
}  # fmt: skip


def _env_items(environ: Mapping[str, str]) -> Iterable[tuple[Key, Any, str]]:
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or len(name) == len(ENV_PREFIX):
            continue
        source = f"environment variable {name}"
        key = tuple(_dash(part.lower()) for part in name[len(ENV_PREFIX) :].split("__"))
        if key in _VERBATIM:
            yield key, environ[name], source
            continue
        try:
            value = yaml.safe_load(environ[name])
        except yaml.YAMLError as exc:
            dotted = ".".join(key)
            raise ConfigError(
                f"config key {dotted}: cannot parse {environ[name]!r} from {source}: {exc}",
                key=dotted, value=environ[name], source=source,
            ) from exc  # fmt: skip
        yield key, value, source


def _collect(
    overrides: Mapping[str, Any] | None,
    environ: Mapping[str, str],
    labels: Mapping[str, str] | None = None,
) -> _Layers:
    layers = _Layers()
    path = config_path()
    if path is not None:
        for key, value in _flatten(_read_file(path)):
            layers.set(key, value, f"config file {path}")
    for key, value, source in _env_items(environ):
        layers.set(key, value, source)
    for key, value in _flatten(overrides or {}):
        dotted = ".".join(key)
        layers.set(key, value, (labels or {}).get(dotted) or f"keyword override {dotted!r}")
    return layers


# --------------------------------------------------------------------------- errors


def _error_key(loc: tuple[int | str, ...], tree: Mapping[str, Any]) -> Key:
    """Trim pydantic's loc (which may end in union-member tags) to the input key path."""
    key: list[str] = []
    node: Any = tree
    for part in loc:
        if not isinstance(node, Mapping) or part not in node:
            break
        key.append(str(part))
        node = node[part]
    return tuple(key) or tuple(str(p) for p in loc[:1])


def _lookup(tree: Mapping[str, Any], key: Key) -> Any:
    node: Any = tree
    for part in key:
        node = node[part]
    return node


def _config_error(exc: ValidationError, layers: _Layers) -> ConfigError:
    problems: dict[Key, list[str]] = {}
    across: list[tuple[Key, str]] = []  # a section's own check, over several of its keys
    for err in exc.errors():
        if err["type"] == "value_error" and not _is_leaf(err["loc"]):
            section = tuple(_dash(str(part)) for part in err["loc"])
            across.append((section, err["msg"].removeprefix("Value error, ")))
            continue
        key = _error_key(err["loc"], layers.tree)
        if err["type"] == "extra_forbidden":
            problems.setdefault(key, []).insert(0, "unknown key")
        else:
            problems.setdefault(key, []).append(err["msg"].removeprefix("Value error, "))
    lines: list[str] = []
    first: tuple[str, Any, str] | None = None
    for key, messages in problems.items():
        dotted, source = ".".join(key), layers.source_of(key)
        value = _lookup(layers.tree, key)
        reasons = "; or ".join(dict.fromkeys(messages))
        lines.append(f"invalid config {dotted} = {value!r} (from {source}): {reasons}")
        first = first or (dotted, value, source)
    for section, message in across:
        dotted, source = ".".join(section) or "settings", layers.source_of(section)
        lines.append(f"invalid config {dotted} (from {source}): {message}")
        first = first or (dotted, None, source)
    assert first is not None
    return ConfigError("\n".join(lines), *first)


def _is_leaf(loc: tuple[int | str, ...]) -> bool:
    """Whether a pydantic error location names a setting (not a section of them)."""
    node: Any = Config
    for part in loc:
        fields = getattr(node, "model_fields", None)
        if fields is None or part not in fields:
            return True  # past the models: a union member's tag, or a value
        node = fields[part].annotation
        if not (isinstance(node, type) and issubclass(node, BaseModel)):
            return True
    return False


def load_config(
    overrides: Mapping[str, Any] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
) -> Config:
    """Build the effective :class:`Config`: defaults <- file <- env <- ``overrides``.

    ``labels`` names the source of an override in error messages, by dotted key (the CLI
    passes ``{"scheduler.lease-ttl": "command-line flag --lease-ttl"}``)."""
    layers = _collect(overrides, os.environ if environ is None else environ, labels)
    try:
        return Config.model_validate(layers.tree)
    except ValidationError as exc:
        raise _config_error(exc, layers) from None
