"""One configuration object, loaded once (YAML file, then environment, then flags: flags
win) and validated at start with errors that name the field and the fix."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any
from urllib.parse import urlsplit

from indexer.index import DEFAULT_MAX_ENTRIES
from router.core.errors import ConfigError

MODES = ("events", "approx", "auto")
POLICIES = ("kv", "round_robin", "random", "least_load")
ENV_PREFIX = "KVROUTE_"


@dataclass(frozen=True)
class WorkerConfig:
    url: str
    events: str | None = None  # tcp://host:port; discovered from /kv_event_sources if unset
    replay: str | None = None
    topic: str | None = None
    mode: str | None = None  # overrides the router-wide mode
    block_size: int | None = None  # learned from events or cache_config_info if unset

    @property
    def name(self) -> str:
        """host:port, the name used in metrics, logs and the chosen-worker header."""
        parts = urlsplit(self.url)
        return parts.netloc or self.url


@dataclass(frozen=True)
class ScoringConfig:
    weights: dict[str, float] = field(
        default_factory=lambda: {"prefix": 1.0, "load": 0.5, "headroom": 0.1}
    )
    tier_credit: dict[str, float] = field(
        default_factory=lambda: {"GPU": 1.0, "CPU": 0.75, "DISK": 0.25, "STORAGE": 0.25}
    )
    temperature: float = 0.0  # 0 = argmax; > 0 samples softmax(score / temperature)
    balance_abs: int = 8  # a worker may run this many requests above the least loaded...
    balance_rel: float = 1.5  # ...or this multiple of it, whichever is larger


@dataclass(frozen=True)
class Config:
    workers: tuple[WorkerConfig, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    mode: str = "auto"
    policy: str = "kv"
    tokenizer: str | None = None  # a folder with tokenizer.json, or "remote"
    block_size: int | None = None
    model: str = ""  # the hash namespace's model part; one pool per router
    metrics: bool = True
    admin_token: str | None = None
    worker_header: str = "x-kvroute-worker"
    health_degraded_ok: bool = False
    prediction_ttl_s: float = 5.0
    approx_ttl_s: float = 120.0
    event_grace_s: float = 10.0
    scrape_interval_s: float = 1.0
    health_check_interval_s: float = 2.0
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 600.0
    max_body_bytes: int = 32 * 1024 * 1024
    # worker x block pairs; <100 bytes each (C core; ~180 pure-Python), so ~400 MB at most.
    # A fleet's total KV blocks should fit well below it (see indexer.index on the bound).
    max_index_entries: int = DEFAULT_MAX_ENTRIES
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    seed: int | None = None
    workers_file: str | None = None  # reloaded on change
    workers_dns: str | None = None  # HOST:PORT of a headless Service: one worker per A record
    dns_interval_s: float = 5.0

    def validate(self) -> Config:
        if not self.workers and not self.workers_file and not self.workers_dns:
            raise ConfigError(
                "workers: no workers configured; pass --worker http://HOST:PORT (repeatable), "
                "list them under `workers:` in kvroute.yaml, set --workers-file, or set "
                "--workers-dns HEADLESS_SERVICE:PORT"
            )
        if self.workers_dns is not None:
            host, _, port = self.workers_dns.rpartition(":")
            _check(
                bool(host) and port.isdigit(),
                "workers_dns",
                f"{self.workers_dns!r}: use HOST:PORT, e.g. vllm-workers.default.svc:8000",
            )
        _check(self.mode in MODES, "mode", f"{self.mode!r} is not one of {', '.join(MODES)}")
        _check(
            self.policy in POLICIES,
            "policy",
            f"{self.policy!r} is not one of {', '.join(POLICIES)}",
        )
        _check(1 <= self.port <= 65535, "port", f"{self.port} is not a TCP port")
        if self.block_size is not None:
            _check(self.block_size > 0, "block_size", "must be a positive number of tokens")
        for name in (
            "prediction_ttl_s",
            "approx_ttl_s",
            "event_grace_s",
            "scrape_interval_s",
            "connect_timeout_s",
            "request_timeout_s",
            "health_check_interval_s",
        ):
            _check(getattr(self, name) > 0, name, "must be a positive number of seconds")
        _check(self.scoring.temperature >= 0, "scoring.temperature", "must be >= 0")
        for scorer, weight in self.scoring.weights.items():
            _check(weight >= 0, f"scoring.weights.{scorer}", "weights must be >= 0")
        seen: set[str] = set()
        for i, w in enumerate(self.workers):
            where = f"workers[{i}]"
            parts = urlsplit(w.url)
            _check(
                parts.scheme in ("http", "https") and bool(parts.hostname),
                f"{where}.url",
                f"{w.url!r} is not an http(s)://HOST:PORT URL",
            )
            _check(w.name not in seen, f"{where}.url", f"{w.url} is listed twice")
            seen.add(w.name)
            if w.mode is not None:
                _check(w.mode in MODES, f"{where}.mode", f"{w.mode!r} not in {MODES}")
            for key in ("events", "replay"):
                ep = getattr(w, key)
                if ep is not None:
                    _check(ep.startswith("tcp://"), f"{where}.{key}", f"{ep!r}: use tcp://H:P")
            if w.block_size is not None:
                _check(w.block_size > 0, f"{where}.block_size", "must be positive")
        return self

    def worker_mode(self, w: WorkerConfig) -> str:
        return w.mode or self.mode


def _check(ok: bool, field_name: str, problem: str) -> None:
    if not ok:
        raise ConfigError(f"config field {field_name}: {problem}", param=field_name)


def from_mapping(doc: dict[str, Any], base: Config | None = None) -> Config:
    """Build a Config from a YAML-shaped mapping (unknown keys are errors: typos must not
    pass silently)."""
    base = base or Config()
    known = {f.name for f in fields(Config)}
    unknown = set(doc) - known
    if unknown:
        raise ConfigError(
            f"unknown config field(s): {', '.join(sorted(unknown))}; known: "
            f"{', '.join(sorted(known))}"
        )
    values: dict[str, Any] = dict(doc)
    if "workers" in values:
        values["workers"] = tuple(_worker(i, w) for i, w in enumerate(values["workers"] or []))
    if "scoring" in values:
        values["scoring"] = _scoring(values["scoring"] or {})
    try:
        return replace(base, **values)
    except TypeError as exc:
        raise ConfigError(f"config: {exc}") from None


def _worker(i: int, raw: Any) -> WorkerConfig:
    if isinstance(raw, str):
        return WorkerConfig(url=raw)
    if not isinstance(raw, dict) or "url" not in raw:
        raise ConfigError(f"config field workers[{i}]: give a URL or a mapping with url:")
    allowed = {f.name for f in fields(WorkerConfig)}
    bad = set(raw) - allowed
    if bad:
        raise ConfigError(
            f"config field workers[{i}]: unknown key(s) {', '.join(sorted(bad))}; "
            f"known: {', '.join(sorted(allowed))}"
        )
    return WorkerConfig(**raw)


def _scoring(raw: dict[str, Any]) -> ScoringConfig:
    allowed = {f.name for f in fields(ScoringConfig)}
    bad = set(raw) - allowed
    if bad:
        raise ConfigError(f"config field scoring: unknown key(s) {', '.join(sorted(bad))}")
    base = ScoringConfig()
    if "weights" in raw:
        raw = {**raw, "weights": {**base.weights, **raw["weights"]}}
    if "tier_credit" in raw:
        raw = {**raw, "tier_credit": {**base.tier_credit, **raw["tier_credit"]}}
    return replace(base, **raw)


def from_env(base: Config, environ: dict[str, str] | None = None) -> Config:
    """KVROUTE_<FIELD> for scalar fields; KVROUTE_WORKERS is a comma-separated URL list."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in fields(Config):
        raw = env.get(ENV_PREFIX + f.name.upper())
        if raw is None or f.name == "scoring":
            continue
        values[f.name] = _parse_scalar(f.name, raw, getattr(base, f.name))
    if "workers" in values:
        values["workers"] = tuple(
            WorkerConfig(u.strip()) for u in str(values["workers"]).split(",") if u.strip()
        )
    return replace(base, **values)


def _parse_scalar(name: str, raw: str, current: Any) -> Any:
    if name == "workers":
        return raw
    if isinstance(current, bool):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r}: use true or false")
    if isinstance(current, int) or name in ("block_size", "seed"):
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r}: not an integer") from None
    if isinstance(current, float):
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r}: not a number") from None
    return raw
