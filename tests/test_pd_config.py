"""P/D configuration: roles from flags and YAML, the pd_* fields checked at start with
errors that name the field, and the decode and prefill profiles over one fleet."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from router.core.config import Config, WorkerConfig, from_mapping
from router.core.errors import ConfigError
from router.serve_cli import register


def parse(*argv: str) -> Config:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    register(sub)
    from router.serve_cli import load_config

    return load_config(parser.parse_args(["serve", *argv]), environ={})


def test_role_flags_sit_beside_worker() -> None:
    c = parse(
        "--worker",
        "http://a:1",
        "--prefill-worker",
        "http://p:1",
        "--decode-worker",
        "http://d:1",
        "--pd-threshold",
        "2048",
        "--pd-link-mb-s",
        "104",
        "--no-pd-probe",
    )
    assert [(w.name, w.role) for w in c.workers] == [
        ("a:1", "both"),
        ("p:1", "prefill"),
        ("d:1", "decode"),
    ]
    assert (c.pd_threshold, c.pd_link_mb_s, c.pd_probe, c.pd_fault_strip_params) == (
        "2048",
        104.0,
        False,
        False,
    )


def test_roles_from_yaml() -> None:
    c = from_mapping(
        {"workers": [{"url": "http://p:1", "role": "prefill"}, "http://d:1"]}
    ).validate()
    assert [w.role for w in c.workers] == ["prefill", "both"]


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"pd_threshold": "sometimes"}, "pd_threshold"),
        ({"pd_threshold": "-5"}, "pd_threshold"),
        ({"pd_link_mb_s": 0}, "pd_link_mb_s"),
        ({"pd_kv_bytes_per_token": 0}, "pd_kv_bytes_per_token"),
        ({"pd_max_prefill_inflight": 0}, "pd_max_prefill_inflight"),
        ({"workers": [{"url": "http://p:1", "role": "prefill"}]}, "workers"),
        ({"workers": [{"url": "http://p:1", "role": "prefil"}]}, "workers[0].role"),
    ],
    ids=[
        "threshold-word",
        "threshold-negative",
        "link-0",
        "kv-0",
        "inflight-0",
        "prefill-only",
        "role-typo",
    ],
)
def test_bad_pd_config_names_the_field(doc: dict[str, Any], field: str) -> None:
    base = {"workers": ["http://d:1"], **doc}
    with pytest.raises(ConfigError) as err:
        from_mapping(base).validate()
    assert err.value.param == field


@pytest.mark.parametrize(
    ("profile", "eligible"),
    [("default", {"p:1", "d:1", "b:1"}), ("decode", {"d:1", "b:1"}), ("prefill", {"p:1", "b:1"})],
)
def test_profiles_filter_by_role_over_one_fleet(profile: str, eligible: set[str]) -> None:
    from indexer.clock import MonotonicClock
    from indexer.hashing import Namespace
    from router.core.decision import RouteRequest
    from router.core.fleet import FleetState, WorkerState
    from router.core.picker import Picker

    fleet = FleetState(MonotonicClock())
    for name, role in (("p:1", "prefill"), ("d:1", "decode"), ("b:1", "both")):
        fleet.add(WorkerState(name, "events", 16, role=role))
    config = Config(workers=(WorkerConfig("http://d:1"),))
    req = RouteRequest("", Namespace(""), 64)
    decision = Picker(fleet).pick(config.profile(profile), req, list(range(64)))
    assert {s.worker for s in decision.ranked} == eligible
    assert all(s.excluded and s.excluded.startswith("role ") for s in decision.excluded)
