"""One config object: YAML, then environment, then flags; errors name the field and the fix."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from router.core.config import Config, WorkerConfig, from_env, from_mapping
from router.core.errors import ConfigError
from router.serve_cli import load_config


def args(**kw: object) -> argparse.Namespace:
    base = dict(
        config=None,
        worker=None,
        host=None,
        port=None,
        tokenizer=None,
        mode=None,
        policy=None,
        block_size=None,
        metrics=None,
        admin_token=None,
        health_degraded_ok=None,
        worker_header=None,
        seed=None,
        workers_file=None,
        workers_dns=None,
    )
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({}, "workers"),
        ({"workers": ["http://a:1"], "mode": "magic"}, "mode"),
        ({"workers": ["http://a:1"], "policy": "best"}, "policy"),
        ({"workers": ["ftp://a:1"]}, "workers[0].url"),
        ({"workers": ["http://a:1", "http://a:1"]}, "workers[1].url"),
        ({"workers": [{"url": "http://a:1", "events": "a:5557"}]}, "workers[0].events"),
        ({"workers": ["http://a:1"], "block_size": 0}, "block_size"),
        ({"workers": ["http://a:1"], "approx_ttl_s": -1}, "approx_ttl_s"),
        ({"workers": ["http://a:1"], "warm_connections": -1}, "warm_connections"),
        ({"workers_dns": "no-port"}, "workers_dns"),
        (
            {"workers": ["http://a:1"], "scoring": {"prefill_wait_over": 0.5}},
            "scoring.prefill_wait_over",
        ),
        (
            {"workers": ["http://a:1"], "scoring": {"prefill_wait_floor_tokens": -1}},
            "scoring.prefill_wait_floor_tokens",
        ),
    ],
    ids=[
        "no-workers",
        "mode",
        "policy",
        "scheme",
        "duplicate",
        "events-scheme",
        "block-size",
        "ttl",
        "warm",
        "dns",
        "prefill-wait-over",
        "prefill-wait-floor",
    ],
)
def test_bad_config_names_the_field(doc: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_mapping(doc).validate()
    assert field in str(err.value)


def test_unknown_keys_are_errors_not_silence() -> None:
    with pytest.raises(ConfigError, match=r"unknown config field.*wokers"):
        from_mapping({"wokers": ["http://a:1"]})
    with pytest.raises(ConfigError, match=r"workers\[0\].*evnts"):
        from_mapping({"workers": [{"url": "http://a:1", "evnts": "tcp://a:1"}]})


def test_yaml_then_env_then_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "kvroute.yaml"
    cfg.write_text(
        "workers:\n  - url: http://a:8000\n    events: tcp://a:5557\n    block_size: 32\n"
        "port: 9000\nmode: events\nscoring:\n  weights: {load: 0.9}\n"
    )
    env = {"KVROUTE_PORT": "9100", "KVROUTE_POLICY": "least_load"}
    c = load_config(args(config=cfg, mode="approx"), env)
    assert c.port == 9100  # env over YAML
    assert c.mode == "approx"  # flag over YAML
    assert c.policy == "least_load"
    assert c.workers == (WorkerConfig("http://a:8000", events="tcp://a:5557", block_size=32),)
    assert c.scoring.weights["load"] == 0.9 and c.scoring.weights["prefix"] == 1.0
    c2 = load_config(args(config=cfg, worker=["http://b:1"]), {})
    assert [w.url for w in c2.workers] == ["http://b:1"]  # --worker replaces the YAML list


def test_env_values_are_checked() -> None:
    with pytest.raises(ConfigError, match="KVROUTE_PORT"):
        from_env(Config(), {"KVROUTE_PORT": "eighty"})
    assert from_env(Config(), {"KVROUTE_WORKERS": "http://a:1, http://b:2"}).workers == (
        WorkerConfig("http://a:1"),
        WorkerConfig("http://b:2"),
    )


def test_worker_name_is_host_port() -> None:
    assert WorkerConfig("http://10.0.0.5:8000/").name == "10.0.0.5:8000"
