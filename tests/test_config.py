"""One config object: YAML, then environment, then flags; errors name the field and the fix."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from router.core.config import (
    Config,
    WorkerConfig,
    env_notes,
    from_env,
    from_mapping,
    shown,
)
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
        ({"workers_dns": "localhost:99999"}, "workers_dns"),
        ({"workers": ["http://a:1"], "worker_header": "x kv:worker"}, "worker_header"),
        ({"workers": ["http://a:1"], "tokenizer": ""}, "tokenizer"),
        (
            {"workers": ["http://a:1"], "scoring": {"params": {"placement": {"slack": -1}}}},
            "scoring.params.placement",
        ),
        (
            {"workers": ["http://a:1"], "scoring": {"params": {"placement": {"others": 5}}}},
            "scoring.params.placement",
        ),
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
        "dns-port",
        "worker-header",
        "empty-tokenizer",
        "placement-slack",
        "placement-others",
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


def test_a_value_refused_at_validation_names_its_variable(tmp_path: Path) -> None:
    """`mode` is checked once the sources are merged: a bad KVROUTE_MODE must be named as
    the variable, not as the YAML field the operator would look for."""
    env = {"KVROUTE_MODE": "exact", "KVROUTE_WORKERS": "http://a:1"}
    with pytest.raises(ConfigError, match=r"^KVROUTE_MODE='exact': "):
        load_config(args(), env)
    cfg = tmp_path / "kvroute.yaml"
    cfg.write_text("workers: [http://a:1]\nmode: exact\n")
    with pytest.raises(ConfigError) as err:
        load_config(args(config=cfg), {})
    assert "KVROUTE_MODE" not in err.value.message  # from the file: named as its field


def test_env_values_are_checked() -> None:
    with pytest.raises(ConfigError, match="KVROUTE_PORT"):
        from_env(Config(), {"KVROUTE_PORT": "eighty"})
    with pytest.raises(ConfigError, match="KVROUTE_PORT"):  # not a ValueError traceback
        from_env(Config(), {"KVROUTE_PORT": "--5"})
    assert from_env(Config(), {"KVROUTE_METRICS": "off"}).metrics is False
    assert from_env(Config(), {"KVROUTE_METRICS": "on"}).metrics is True
    assert from_env(Config(), {"KVROUTE_WORKERS": "http://a:1, http://b:2"}).workers == (
        WorkerConfig("http://a:1"),
        WorkerConfig("http://b:2"),
    )


def test_worker_name_is_host_port() -> None:
    assert WorkerConfig("http://10.0.0.5:8000/").name == "10.0.0.5:8000"


def test_every_serve_flag_reaches_the_config() -> None:
    """A flag whose name is a config field must be carried into it (`--otel` once was not,
    and started a router without tracing and without a word)."""
    from router.cli import build_parser
    from router.serve_cli import _PLAIN, _TUNING

    parser = build_parser(only="serve")
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    fields = {f for f in Config.__dataclass_fields__}
    carried = {*_PLAIN, *(t[1] for t in _TUNING), "workers", "tokenizer", "tokenizers"}
    carried |= {"chat_template", "chat_templates"}
    named = {a.dest for a in serve._actions if a.dest in fields}
    assert named and named <= carried, sorted(named - carried)
    cfg = load_config(parser.parse_args(["serve", "--worker", "http://a:1", "--otel"]), {})
    assert cfg.otel is True


def test_start_up_errors_name_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from router.cli import main

    cert, key = tmp_path / "missing.pem", tmp_path / "missing.key"
    worker = ["serve", "--worker", "http://127.0.0.1:9", "--tokenizer", "remote"]
    assert main([*worker, "--tls-cert", str(cert), "--tls-key", str(key)]) == 2
    err = capsys.readouterr().err
    assert str(cert) in err and "PEM" in err
    cert.write_text("not a certificate")
    key.write_text("nor a key")
    assert main([*worker, "--tls-cert", str(cert), "--tls-key", str(key)]) == 2
    assert str(cert) in capsys.readouterr().err
    assert main(["--log-level", "VERBOSE", *worker]) == 2
    assert "DEBUG, INFO" in capsys.readouterr().err


def test_a_config_files_log_format_is_used(tmp_path: Path) -> None:
    """Logging starts before the config file is read; its log_format must still apply."""
    import json
    import subprocess
    import sys

    from router.procs import free_port

    cfg = tmp_path / "kvroute.yaml"
    cfg.write_text(
        f"workers: [http://127.0.0.1:9]\nport: {free_port()}\nlog_format: json\ntokenizer: remote\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "serve", "--config", str(cfg)],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline().decode()  # the start-up line
        assert json.loads(line)["message"].startswith("kvroute ")
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()


def test_kubernetes_service_links_are_not_settings() -> None:
    """A Service named kvroute in the namespace puts KVROUTE_PORT=tcp://IP:PORT (and more) in
    every pod's environment: kvroute must still start, on its own port."""
    links = {
        "KVROUTE_PORT": "tcp://10.96.0.5:8000",
        "KVROUTE_SERVICE_HOST": "10.96.0.5",
        "KVROUTE_SERVICE_PORT": "8000",
        "KVROUTE_SERVICE_PORT_HTTP": "8000",
        "KVROUTE_PORT_8000_TCP": "tcp://10.96.0.5:8000",
        "KVROUTE_PORT_8000_TCP_PROTO": "tcp",
        "KVROUTE_PORT_8000_TCP_PORT": "8000",
        "KVROUTE_PORT_8000_TCP_ADDR": "10.96.0.5",
        "KVROUTE_EPP_PORT": "tcp://10.96.0.6:9002",
        "KVROUTE_EPP_SERVICE_HOST": "10.96.0.6",
    }
    assert from_env(Config(), links).port == Config().port
    assert from_env(Config(), {**links, "KVROUTE_METRICS": "off"}).metrics is False
    (note,) = env_notes(links)
    assert note.startswith("KVROUTE_PORT='tcp://10.96.0.5:8000' is a Kubernetes service link")
    assert from_env(Config(), {"KVROUTE_PORT": "9000"}).port == 9000


def test_a_misspelt_variable_is_named_with_the_nearest_setting() -> None:
    env = {
        "KVROUTE_DRAIN_TIMEOUT": "90",
        "KVROUTE_BLURB": "x",
        "KVROUTE_LOG_FORMAT": "json",  # read by the log setup, not a field
        "KVROUTE_DRAIN_TIMEOUT_S": "90",
        "PATH": "/bin",
    }
    assert env_notes(env) == [
        "KVROUTE_BLURB is not a kvroute setting and is ignored",
        "KVROUTE_DRAIN_TIMEOUT is not a kvroute setting and is ignored: did you mean "
        "KVROUTE_DRAIN_TIMEOUT_S?",
    ]


def test_a_variable_that_may_hold_a_secret_is_named_without_its_value() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(args(), {"KVROUTE_WORKERS": "ftp://a:1"})
    assert err.value.message.startswith("KVROUTE_WORKERS (value not shown): ")
    assert shown("KVROUTE_ADMIN_TOKEN", "t0k") == "KVROUTE_ADMIN_TOKEN (value not shown)"
    assert shown("KVROUTE_MODE", "exact") == "KVROUTE_MODE='exact'"


ONE = (WorkerConfig("http://h:8000"),)


@pytest.mark.parametrize(
    "name", ["drain_timeout_s", "keep_alive_timeout_s", "request_timeout_s", "timeout_hold_s"]
)
def test_an_infinite_timeout_is_refused_with_a_finite_one_named(name: str) -> None:
    with pytest.raises(ConfigError, match="finite") as err:
        Config(workers=ONE, **{name: math.inf}).validate()
    assert err.value.param == name


def test_an_empty_admin_token_is_refused_not_left_locking_admin_out() -> None:
    with pytest.raises(ConfigError, match="is empty") as err:
        Config(workers=ONE, admin_token="").validate()
    assert err.value.param == "admin_token"
    assert Config(workers=ONE, admin_token="t").validate().admin_token == "t"


@pytest.mark.parametrize(
    ("endpoint", "ok"),
    [
        ("tcp://*:5557", True),
        ("tcp://10.0.0.5:5557", True),
        ("tcp://vllm-0.vllm:5557", True),
        ("tcp://10.0.0.2;10.0.0.1:5557", True),  # ZMQ's source address
        ("tcp://", False),
        ("tcp://*:0", False),
        ("tcp://h:70000", False),
        ("tcp://bad..host:5557", False),
        ("ipc:///tmp/kv", False),
    ],
)
def test_a_worker_event_endpoint_is_tcp_host_and_port(endpoint: str, ok: bool) -> None:
    config = Config(workers=(WorkerConfig("http://h:8000", events=endpoint),))
    if ok:
        config.validate()
        return
    with pytest.raises(ConfigError, match="tcp://HOST:PORT") as err:
        config.validate()
    assert err.value.param == "workers[0].events"


@pytest.mark.parametrize("field_name", ["workers_dns", "peers_dns"])
def test_a_dns_name_with_an_empty_label_is_refused(field_name: str) -> None:
    with pytest.raises(ConfigError) as err:
        Config(workers=ONE, **{field_name: "vllm-workers..default.svc:8000"}).validate()
    assert err.value.param == field_name


def test_mapping_fields_in_the_environment_are_named_as_unread() -> None:
    env = {"KVROUTE_TOKENIZERS": "m=remote", "KVROUTE_SCORING": "{}", "KVROUTE_MODE": "events"}
    notes = env_notes(env)
    assert any("KVROUTE_TOKENIZERS is not read" in n and "--tokenizer" in n for n in notes)
    assert any("KVROUTE_SCORING is not read" in n for n in notes)
    assert not any("KVROUTE_MODE" in n for n in notes)


@pytest.mark.parametrize(
    ("yaml_text", "env"),
    [
        ("port: 70000\n", {"KVROUTE_PORT": "tcp://10.0.0.5:8000"}),  # a service link
        ("scoring: {weights: {lod: 0.5}}\n", {"KVROUTE_SCORING": '{"weights": {}}'}),
    ],
)
def test_a_config_error_is_not_blamed_on_a_variable_kvroute_did_not_read(
    tmp_path: Path, yaml_text: str, env: dict[str, str]
) -> None:
    yaml_file = tmp_path / "kvroute.yaml"
    yaml_file.write_text("workers: [http://h:8000]\n" + yaml_text)
    with pytest.raises(ConfigError) as err:
        load_config(args(config=yaml_file), env)
    assert "KVROUTE_" not in err.value.message, err.value.message


def test_a_replica_may_publish_on_a_wildcard_but_dials_a_peer_by_name() -> None:
    Config(workers=ONE, peer_publish="tcp://*:5570").validate()  # ZMQ binds it
    with pytest.raises(ConfigError) as err:
        Config(workers=ONE, peers=("tcp://*:5570",)).validate()
    assert err.value.param == "peers[0]"
