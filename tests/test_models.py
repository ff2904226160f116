"""Fleets serving several models: per-model pools, LoRA adapters, unknown models, per-model
tokenizers, the rest of vLLM's API passed through, workers behind an API key. Real uvicorn,
real ZMQ, simulated vLLM workers on loopback."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from sim_router import Setup, settle

from engines.sim.config import SimConfig
from engines.sim.fleet import run_fleet
from router.app import RouterApp
from router.core.config import Config, WorkerConfig
from router.procs import serve_in_process
from router.tokenize import PACKAGED_TOKENIZER

pytestmark = pytest.mark.timeout(120)

DOC = " ".join(f"section {i} on pools, models and adapters." for i in range(100))
LORA = (("sql-lora", "/adapters/sql"),)


def sim(model: str, **kw: Any) -> SimConfig:
    return SimConfig(block_size=16, kv_blocks=512, topic="kv-events", model=model, **kw)


@asynccontextmanager
async def two_models(*, api_key: str | None = None, **config: Any) -> AsyncIterator[Setup]:
    """Workers 0 and 1 serve model-a (+ the sql-lora adapter), worker 2 serves model-b."""
    configs = [
        sim("model-a", lora_modules=LORA, api_key=api_key),
        sim("model-a", lora_modules=LORA, api_key=api_key),
        sim("model-b", api_key=api_key),
    ]
    async with run_fleet(configs=configs) as fleet:
        config.setdefault("tokenizer", str(PACKAGED_TOKENIZER))
        config.setdefault("admin_insecure", True)
        cfg = Config(
            workers=tuple(WorkerConfig(u) for u in fleet.urls),
            scrape_interval_s=0.2,
            health_check_interval_s=0.2,
            **config,
        )
        app = RouterApp(cfg)
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        async with (
            serve_in_process(app) as url,
            httpx.AsyncClient(base_url=url, timeout=30, headers=headers) as client,
        ):
            yield Setup(fleet, app, client)


async def complete(s: Setup, model: str, prompt: str) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 2}
    return await s.client.post("/v1/completions", json=body)


async def test_each_request_goes_to_a_worker_serving_its_model() -> None:
    async with two_models() as s:
        await settle(s)
        pool_a = {s.name(0), s.name(1)}
        for i in range(6):
            for model, pool in (
                ("model-a", pool_a),
                ("sql-lora", pool_a),
                ("model-b", {s.name(2)}),
            ):
                resp = await complete(s, model, f"{DOC} request {i} for {model}")
                assert resp.status_code == 200, resp.text
                assert resp.headers["x-kvroute-worker"] in pool, (model, resp.headers)


async def test_prefix_affinity_holds_inside_a_pool() -> None:
    async with two_models() as s:
        await settle(s)
        first = await complete(s, "model-a", DOC + " first")
        home = first.headers["x-kvroute-worker"]
        for _ in range(100):
            if s.app.fleet.index.entries_of(home) > 0:
                break
            await asyncio.sleep(0.02)
        for i in range(4):
            again = await complete(s, "model-a", DOC + f" again {i}")
            assert again.headers["x-kvroute-worker"] == home
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        # the adapter's blocks hash apart: the same text is new to sql-lora's namespace
        route = await s.client.post("/debug/route", json={"model": "sql-lora", "prompt": DOC})
        assert all(w["overlap_blocks"] == 0 for w in route.json()["workers"])


@pytest.mark.parametrize("tokenizer", ["local", "remote"])
async def test_unknown_model_is_a_404_listing_the_served_ones(tokenizer: str) -> None:
    spec = "remote" if tokenizer == "remote" else str(PACKAGED_TOKENIZER)
    async with two_models(tokenizer=spec) as s:
        await settle(s)
        resp = await complete(s, "model-c", DOC)
        assert resp.status_code == 404
        err = resp.json()["error"]
        assert err["type"] == "not_found_error" and err["param"] == "model"
        for name in ("model-a", "model-b", "sql-lora"):
            assert name in err["message"]


async def test_models_lists_each_name_once() -> None:
    async with two_models() as s:
        await settle(s)
        ids = [m["id"] for m in (await s.client.get("/v1/models")).json()["data"]]
        assert sorted(ids) == ["model-a", "model-b", "sql-lora"]


async def test_the_rest_of_the_api_passes_through_by_model() -> None:
    async with two_models() as s:
        await settle(s)
        resp = await s.client.post("/tokenize", json={"model": "model-b", "prompt": "hello"})
        assert resp.status_code == 200 and resp.json()["tokens"]
        assert resp.headers["x-kvroute-worker"] == s.name(2)
        ids = resp.json()["tokens"]
        back = await s.client.post("/detokenize", json={"model": "model-a", "tokens": ids})
        assert back.status_code == 200 and "hello" in back.json()["prompt"]
        assert back.headers["x-kvroute-worker"] in {s.name(0), s.name(1)}
        missing = await s.client.post("/v1/not-an-endpoint", json={"model": "model-a"})
        assert missing.status_code == 404 and "x-kvroute-worker" in missing.headers


async def test_workers_behind_an_api_key() -> None:
    async with two_models(api_key="s3cret", worker_api_key="s3cret") as s:
        await settle(s)  # /v1/models needs the key: discovery sends it
        resp = await complete(s, "model-b", DOC)
        assert resp.status_code == 200 and resp.headers["x-kvroute-worker"] == s.name(2)
        listing = (await s.client.get("/admin/workers")).text
        health = (await s.client.get("/health")).text
        assert "s3cret" not in listing and "s3cret" not in health
        assert "s3cret" not in repr(s.app.config)
        # the router's own /v1/models asks for the key as the workers would (vLLM's 401)
        models = await s.client.get("/v1/models")
        assert models.status_code == 200 and models.json()["data"]
        for wrong in ({}, {"authorization": "Bearer nope"}, {"authorization": "s3cret"}):
            async with httpx.AsyncClient(base_url=str(s.client.base_url)) as bare:
                resp = await bare.get("/v1/models", headers=wrong)
            assert (resp.status_code, resp.json()) == (401, {"error": "Unauthorized"}), wrong


async def test_per_model_tokenizer_overrides_the_default() -> None:
    # model-b's tokenizer is remote (its worker's /tokenize); model-a's is local
    async with two_models(tokenizers={"model-b": "remote"}) as s:
        await settle(s)
        assert s.app.tokenizers.local("model-b") is None
        assert s.app.tokenizers.local("sql-lora", "model-a") is not None
        resp = await complete(s, "model-b", DOC)
        assert resp.status_code == 200
        assert s.app.routing._remote_cache.misses >= 1


async def test_data_parallel_ranks_are_endpoints_routed_by_header() -> None:
    """A worker with two data-parallel ranks: two endpoints, each indexed from its own
    events, and a repeat goes to the rank that holds its prefix (X-data-parallel-rank)."""
    dp = sim("kvroute-sim", data_parallel_size=2)
    async with run_fleet(configs=[dp]) as fleet:
        cfg = Config(
            workers=(WorkerConfig(fleet.urls[0]),),
            tokenizer=str(PACKAGED_TOKENIZER),
            admin_insecure=True,
            scrape_interval_s=0.2,
            health_check_interval_s=0.2,
        )
        app = RouterApp(cfg)
        async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url) as client:
            base = f"127.0.0.1:{fleet.workers[0].port}"
            assert sorted(app.fleet.workers) == [f"{base}#dp0", f"{base}#dp1"]
            homes = {}
            for doc in ("alpha", "beta", "gamma", "delta"):
                text = f"{doc} {doc}: {DOC}"  # distinct from the first token
                first = await client.post("/v1/completions", json=body(text))
                home = first.headers["x-kvroute-worker"]
                homes[doc] = home
                for _ in range(100):
                    if app.fleet.index.entries_of(home) > 0:
                        break
                    await asyncio.sleep(0.02)
                again = await client.post("/v1/completions", json=body(text + " more"))
                assert again.headers["x-kvroute-worker"] == home
                assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert set(homes.values()) == {f"{base}#dp0", f"{base}#dp1"}
            health = (await client.get("/health")).json()
            ranks = sorted(w.get("data_parallel_rank") for w in health["workers"])
            assert ranks == [0, 1]
            # a client's own rank header does not steer it: the rank kvroute picked (and
            # indexes and counts) serves, so the repeat, routed by the index, goes there
            # and finds the prefix cached (served by the other rank, the index would send
            # the repeat there, or the repeat would find nothing)
            picked = set()
            for doc in ("epsilon", "zeta", "eta", "theta", "iota", "kappa"):
                text = f"{doc} {doc}: {DOC}"
                counts = {w: app.fleet.index.entries_of(w) for w in app.fleet.workers}
                pinned = await client.post(
                    "/v1/completions", json=body(text), headers={"x-data-parallel-rank": "1"}
                )
                home = pinned.headers["x-kvroute-worker"]
                picked.add(home)
                for _ in range(100):
                    if app.fleet.index.entries_of(home) > counts[home]:
                        break
                    await asyncio.sleep(0.02)
                again = await client.post("/v1/completions", json=body(text + " again"))
                assert again.headers["x-kvroute-worker"] == home
                assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert f"{base}#dp0" in picked  # a pick the client's header contradicted


def body(prompt: str) -> dict[str, Any]:
    return {"model": "kvroute-sim", "prompt": prompt, "max_tokens": 2}


async def test_workers_behind_an_api_key_kvroute_was_not_given_say_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Without --worker-api-key their /v1/models answers 401: the models they serve stay
    unknown (each is eligible for any model), which /health and the log must name."""
    caplog.set_level(logging.ERROR, logger="kvroute")
    async with two_models(api_key="s3cret") as s:
        for _ in range(200):
            doc = (await s.client.get("/health")).json()
            problems = [p for w in doc["workers"] for p in w["problems"] if "--api-key" in p]
            if len(problems) == 3:
                break
            await asyncio.sleep(0.05)
        assert len(problems) == 3 and all("--worker-api-key" in p for p in problems)
        # degraded, not broken: requests naming no other model route as before
        assert [w["status"] for w in doc["workers"]] == ["degraded"] * 3
        logged = [r for r in caplog.records if "refused GET /v1/models (401)" in r.getMessage()]
        assert len(logged) == 3  # once per worker, not every health check
