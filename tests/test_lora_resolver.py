"""Workers that load LoRA adapters at their first request (vLLM's LoRA resolver plugins),
behind `kvroute serve --lora-resolver BASE`: a name no worker lists goes to a worker of the
base model's pool, which loads it; its prefixes then stick like any adapter's. Real uvicorn,
real ZMQ, simulated vLLM workers running the filesystem resolver on loopback."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest
from sim_router import Setup, settle

from engines.sim.config import ConfigError as SimConfigError
from engines.sim.config import SimConfig
from engines.sim.fleet import run_fleet
from indexer.clock import FakeClock
from router.app import RouterApp
from router.core.config import Config, WorkerConfig, from_mapping
from router.core.errors import ConfigError
from router.core.fleet import EVENTS, FleetState, WorkerState, serves
from router.procs import serve_in_process
from router.tokenize import PACKAGED_TOKENIZER
from router.worker_checks import WorkerChecks

pytestmark = pytest.mark.timeout(120)

DOC = " ".join(f"paragraph {i} of a support ticket, answered by an adapter." for i in range(80))


def adapter(root: Path, name: str, base: str, peft_type: str = "LORA") -> None:
    """An adapter folder as vLLM's filesystem resolver reads it."""
    (root / name).mkdir(parents=True)
    doc = {"peft_type": peft_type, "base_model_name_or_path": base, "r": 8}
    (root / name / "adapter_config.json").write_text(json.dumps(doc))


@asynccontextmanager
async def resolving_fleet(root: Path, **config: Any) -> AsyncIterator[Setup]:
    """Workers 0 and 1 serve model-a and resolve adapters from `root`; worker 2 serves
    model-b and resolves nothing."""
    adapter(root, "support-lora", "model-a")
    adapter(root, "b-lora", "model-b")
    adapter(root, "not-a-lora", "model-a", peft_type="IA3")

    def sim(model: str, resolver: str | None) -> SimConfig:
        return SimConfig(
            block_size=16, kv_blocks=512, topic="kv-events", model=model, lora_resolver_dir=resolver
        )

    configs = [sim("model-a", str(root)), sim("model-a", str(root)), sim("model-b", None)]
    async with run_fleet(configs=configs) as fleet:
        config.setdefault("tokenizer", str(PACKAGED_TOKENIZER))
        config.setdefault("lora_resolver", "model-a")
        cfg = Config(
            workers=tuple(WorkerConfig(u) for u in fleet.urls),
            scrape_interval_s=0.2,
            health_check_interval_s=0.2,
            admin_insecure=True,
            **config,
        )
        app = RouterApp(cfg)
        async with (
            serve_in_process(app) as url,
            httpx.AsyncClient(base_url=url, timeout=30) as client,
        ):
            s = Setup(fleet, app, client)
            await settle(s)
            yield s


async def complete(s: Setup, model: str, prompt: str) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 2}
    return await s.client.post("/v1/completions", json=body)


@pytest.mark.parametrize("tokenizer", ["local", "remote"])
async def test_an_adapter_no_worker_lists_is_served_and_its_prefix_sticks(
    tmp_path: Path, tokenizer: str
) -> None:
    spec = "remote" if tokenizer == "remote" else str(PACKAGED_TOKENIZER)
    async with resolving_fleet(tmp_path, tokenizer=spec) as s:
        pool_a = {s.name(0), s.name(1)}
        first = await complete(s, "support-lora", DOC + " first")
        assert first.status_code == 200, first.text
        home = first.headers["x-kvroute-worker"]
        assert home in pool_a
        for _ in range(100):  # its KV events, and the worker now listing the adapter
            listed = s.app.fleet.workers[home].adapters.get("support-lora") == "model-a"
            if listed and s.app.fleet.index.entries_of(home) > 0:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the loaded adapter never showed in the worker's /v1/models")
        for i in range(3):
            again = await complete(s, "support-lora", DOC + f" again {i}")
            assert again.status_code == 200, again.text
            assert again.headers["x-kvroute-worker"] == home
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        # the adapter's blocks live in its own namespace: the base model holds none of them,
        # and the base pool's other worker may still take the adapter (it would load it too)
        route = await s.client.post("/debug/route", json={"model": "support-lora", "prompt": DOC})
        doc = route.json()
        held = {w["worker"]: w["overlap_blocks"] for w in doc["workers"]}
        assert held[home] > 0
        why = {w["worker"]: w["excluded"] or "" for w in doc["workers"]}
        pool = {name for name, reason in why.items() if not reason.startswith("does not serve")}
        assert pool == pool_a, why
        base = await s.client.post("/debug/route", json={"model": "model-a", "prompt": DOC})
        assert all(w["overlap_blocks"] == 0 for w in base.json()["workers"])


async def test_a_name_no_resolver_finds_gets_the_engines_404(tmp_path: Path) -> None:
    async with resolving_fleet(tmp_path, tokenizer="remote") as s:
        for name in ("no-such-lora", "b-lora", "not-a-lora"):
            resp = await complete(s, name, DOC)
            # the engine's answer, relayed: not a router 503 for /tokenize, not a retry
            assert resp.status_code == 404, (name, resp.text)
            assert resp.headers["x-kvroute-worker"] in {s.name(0), s.name(1)}
            assert "does not exist" in resp.json()["error"]["message"]
        health = await s.client.get("/health")
        assert health.status_code == 200, health.text
        ok = await complete(s, "model-b", DOC)  # another base model is still its own pool
        assert ok.status_code == 200 and ok.headers["x-kvroute-worker"] == s.name(2)


async def test_a_refused_name_leaves_nothing_believed_and_counts_under_the_base(
    tmp_path: Path,
) -> None:
    async with resolving_fleet(tmp_path) as s:
        for _ in range(2):
            assert (await complete(s, "no-such-lora", DOC)).status_code == 404
        # the engine stored nothing: the pick's prediction of its blocks is withdrawn
        route = await s.client.post("/debug/route", json={"model": "no-such-lora", "prompt": DOC})
        assert all(w["overlap_blocks"] == 0 for w in route.json()["workers"]), route.json()
        assert (await complete(s, "support-lora", DOC)).status_code == 200
        page = (await s.client.get("/metrics")).text
        # client-chosen names never become label values: adapters count under their base
        assert 'model="model-a"' in page
        assert "no-such-lora" not in page and "support-lora" not in page


async def test_a_resolver_base_no_worker_serves_is_named_in_the_404(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="kvroute.workers"):
        async with resolving_fleet(tmp_path, lora_resolver="model-c") as s:
            resp = await complete(s, "support-lora", DOC)
            assert resp.status_code == 404
            message = resp.json()["error"]["message"]
            assert "--lora-resolver names `model-c`" in message and "model-a" in message
            for _ in range(3):  # health rounds refresh the models: said once all the same
                rounds = s.app.pool.checks.health_rounds
                while s.app.pool.checks.health_rounds == rounds:
                    await asyncio.sleep(0.05)
    told = [r.getMessage() for r in caplog.records if "--lora-resolver names" in r.getMessage()]
    assert len(told) == 1 and "'model-c'" in told[0] and "model-b" in told[0], told


def test_an_empty_fleet_is_not_told_its_resolver_base_is_served_nowhere(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fleet = FleetState(FakeClock())
    fleet.lora_resolver = "model-a"
    checks = WorkerChecks(cast(Any, SimpleNamespace(fleet=fleet, config=Config())))
    with caplog.at_level(logging.ERROR, logger="kvroute.workers"):
        # the last worker removed while its models were read: nothing known of the base yet
        checks._check_resolver_base()
        fleet.add(WorkerState("b", EVENTS, 16, models=frozenset({"model-b"})))
        checks._check_resolver_base()
    told = [r.getMessage() for r in caplog.records if "--lora-resolver names" in r.getMessage()]
    assert len(told) == 1 and "model-b" in told[0], told


def test_a_worker_of_unknown_models_does_not_turn_the_resolver_off() -> None:
    fleet = FleetState(FakeClock())
    fleet.lora_resolver = "model-a"
    fleet.add(WorkerState("a", EVENTS, 16, models=frozenset({"model-a"})))
    fleet.add(WorkerState("new", EVENTS, 16))  # starting: its /v1/models not read yet
    # adapters still go to the base's known workers (the new one takes any name anyway)
    assert fleet.resolver_base("support-lora") == "model-a"
    assert serves(fleet.workers["a"], "support-lora", "model-a")
    fleet.workers["new"].models = frozenset({"model-b", "b-lora"})
    fleet.workers["new"].adapters = {"b-lora": "model-b"}
    # known: another base and its adapter keep their own pool
    assert fleet.resolver_base("model-b") is None and fleet.resolver_base("b-lora") is None
    assert fleet.resolver_base("model-a") is None  # the base itself
    assert fleet.base_of("support-lora") == "model-a" and fleet.base_of("b-lora") == "model-b"


async def test_without_the_flag_an_unlisted_adapter_is_kvroutes_404(tmp_path: Path) -> None:
    async with resolving_fleet(tmp_path, lora_resolver=None) as s:
        resp = await complete(s, "support-lora", DOC)
        assert resp.status_code == 404
        assert "x-kvroute-worker" not in resp.headers  # no engine was asked to load it
        assert "Served models: model-a, model-b" in resp.json()["error"]["message"]


def test_the_resolver_base_is_a_config_field() -> None:
    cfg = from_mapping({"workers": ["http://a:8000"], "lora_resolver": "llama"}).validate()
    assert cfg.lora_resolver == "llama"
    with pytest.raises(ConfigError, match="lora_resolver"):
        from_mapping({"workers": ["http://a:8000"], "lora_resolver": ""}).validate()


async def test_the_simulator_resolves_as_vllms_filesystem_resolver(tmp_path: Path) -> None:
    adapter(tmp_path, "support-lora", "model-a")
    adapter(tmp_path, "wrong-base", "model-z")
    cfg = SimConfig(block_size=16, kv_blocks=512, model="model-a", lora_resolver_dir=str(tmp_path))
    async with (
        run_fleet(configs=[cfg]) as fleet,
        httpx.AsyncClient(base_url=fleet.urls[0], timeout=30) as http,
    ):

        async def models() -> dict[str, Any]:
            return {m["id"]: m["parent"] for m in (await http.get("/v1/models")).json()["data"]}

        assert await models() == {"model-a": None}
        for name in ("wrong-base", "absent"):
            body = {"model": name, "prompt": DOC, "max_tokens": 1}
            assert (await http.post("/v1/completions", json=body)).status_code == 404
        body = {"model": "support-lora", "prompt": DOC, "max_tokens": 1}
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        assert await models() == {"model-a": None, "support-lora": "model-a"}


async def test_a_data_parallel_simulator_serves_an_adapter_one_rank_loaded(
    tmp_path: Path,
) -> None:
    # one API server in front of the ranks, as vLLM's: what a resolver loaded for one rank
    # every rank serves, and /v1/models (answered by rank 0) lists
    adapter(tmp_path, "support-lora", "model-a")
    cfg = SimConfig(
        block_size=16,
        kv_blocks=512,
        model="model-a",
        lora_resolver_dir=str(tmp_path),
        data_parallel_size=2,
    )
    async with (
        run_fleet(configs=[cfg]) as fleet,
        httpx.AsyncClient(base_url=fleet.urls[0], timeout=30) as http,
    ):
        body = {"model": "support-lora", "prompt": DOC, "max_tokens": 1}
        rank1 = {"x-data-parallel-rank": "1"}
        assert (await http.post("/v1/completions", json=body, headers=rank1)).status_code == 200
        ids = [m["id"] for m in (await http.get("/v1/models")).json()["data"]]
        assert ids == ["model-a", "support-lora"]
        rank0 = {"x-data-parallel-rank": "0"}
        assert (await http.post("/v1/completions", json=body, headers=rank0)).status_code == 200


def test_the_simulator_refuses_a_resolver_folder_that_is_not_one(tmp_path: Path) -> None:
    with pytest.raises(SimConfigError, match="not a directory"):
        SimConfig(model="model-a", lora_resolver_dir=str(tmp_path / "absent")).validate()
