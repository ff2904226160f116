"""Scorers, policies and filters register in one place with typed parameters; a new scorer is
one file (here: the class and its parameters below) plus one registry line. Config errors
are one line naming the field, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from engines import ADAPTERS
from indexer.clock import FakeClock
from indexer.hashing import Namespace
from router.core import config as config_module
from router.core import scorers
from router.core.config import Config, from_mapping
from router.core.decision import RouteRequest
from router.core.errors import ConfigError
from router.core.fleet import EVENTS, FleetState, WorkerState
from router.core.picker import Picker
from router.core.scoring import Candidate, ScoreRequest

# ---- the "one file" of a new scorer ---------------------------------------------------------


@dataclass(frozen=True)
class FavouriteParams:
    worker: str = ""  # the endpoint this scorer likes
    strength: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.strength <= 1:
            raise ValueError("strength must be within 0..1")


class FavouriteScorer:
    name = "favourite"

    def __init__(self, params: FavouriteParams) -> None:
        self.params = params

    def score(self, request: ScoreRequest, cands: Sequence[Candidate]) -> dict[str, float]:
        return {
            c.name: self.params.strength if c.name == self.params.worker else 0.0 for c in cands
        }


# ---------------------------------------------------------------------------------------------


@pytest.fixture
def favourite() -> Iterator[None]:
    scorers.register("favourite", FavouriteScorer, FavouriteParams, "likes one worker")
    yield
    scorers.REGISTRY.unregister("favourite")


def doc(**scoring: object) -> dict[str, object]:
    return {"workers": ["http://a:1"], "scoring": scoring}


def test_a_new_scorer_is_one_registry_line_away(favourite: None) -> None:
    config = from_mapping(
        doc(weights={"favourite": 2.0}, params={"favourite": {"worker": "w1"}})
    ).validate()
    fleet = FleetState(FakeClock())
    for name in ("w0", "w1"):
        fleet.add(WorkerState(name, EVENTS, 4, capacity_blocks=10))
    decision = Picker(fleet).pick(
        config.profile("default"), RouteRequest("", Namespace(), 8), list(range(8))
    )
    assert decision.best.worker == "w1"
    assert decision.best.weighted["favourite"] == 2.0


def test_its_parameters_are_typed_and_checked(favourite: None) -> None:
    bad_type = doc(weights={"favourite": 1}, params={"favourite": {"strength": "x"}})
    with pytest.raises(ConfigError, match=r"params\.favourite\.strength: expected a number"):
        from_mapping(bad_type).validate()
    with pytest.raises(ConfigError, match=r"strength must be within 0\.\.1"):
        from_mapping(
            doc(weights={"favourite": 1}, params={"favourite": {"strength": 3}})
        ).validate()
    with pytest.raises(ConfigError, match=r"scoring\.params\.favourite: unknown key\(s\) colour"):
        from_mapping(doc(weights={"favourite": 1}, params={"favourite": {"colour": 1}})).validate()


@pytest.mark.parametrize(
    ("raw", "field", "words"),
    [
        (doc(weights={"lod": 0.5}), "scoring.weights.lod", "unknown scorer"),
        (doc(params={"prefx": {}}), "scoring.params.prefx", "unknown scorer"),
        ({"workers": ["http://a:1"], "request_timeout_s": "ten"}, "request_timeout_s", "number"),
        (
            {"workers": ["http://a:1"], "policy_params": {"temperature": -1}},
            "policy_params",
            ">= 0",
        ),
        ({"workers": ["http://a:1"], "policy_params": {"temp": 1}}, "policy_params", "unknown"),
        ({"workers": [{"url": "http://a:1", "role": "chef"}]}, "workers[0].role", "chef"),
        ({"workers": [{"url": "http://a:1", "engine": "tgi"}]}, "workers[0].engine", "tgi"),
        ({"workers": [{"url": "http://a:x"}]}, "workers[0].url", "port"),
        ({"workers": "http://a:1"}, "workers", "list"),
        ({"workers": ["http://a:1"], "scoring": [1]}, "scoring", "mapping"),
        ({"workers": ["http://a:1"], "tokenizers": {"m": [5]}}, "tokenizers.m", "string"),
        ({"workers": ["http://a:1"], "metrics": "maybe"}, "metrics", "true or false"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_config_errors_name_the_field(raw: dict[str, object], field: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_mapping(raw).validate()
    assert field in err.value.message and words in err.value.message


def test_serve_reports_a_bad_config_in_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "kvroute.yaml"
    cfg.write_text("workers: [http://a:1]\nrequest_timeout_s: ten\nscoring: {weights: {lod: 1}}\n")
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "request_timeout_s" in done.stderr and "expected a number" in done.stderr


def test_config_knows_every_engine_adapter() -> None:
    assert set(config_module.ENGINES) == set(ADAPTERS)


def test_defaults_validate() -> None:
    Config(workers=()).profile("default")  # the shipped weights and params build
