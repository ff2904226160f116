"""The simulated worker's descriptive endpoints, in vLLM's shapes: models, health, version,
load, KV event sources, server/model info (what peer routers probe) and the render API."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from engines.sim.asgi import Json, json_body
from engines.sim.config import VLLM_VERSION
from engines.sim.protocol import GenerateRequest, Prompt

if TYPE_CHECKING:
    from engines.sim.worker import SimWorker

Endpoint = Callable[["SimWorker", Request], Awaitable[Response]]


def info_routes() -> list[tuple[str, Endpoint, str]]:
    return [
        ("/v1/models", models, "GET"),
        ("/health", health, "GET"),
        ("/version", version, "GET"),
        ("/load", load, "GET"),
        ("/kv_event_sources", kv_event_sources, "GET"),
        ("/server_info", server_info, "GET"),
        ("/model_info", model_info, "GET"),
        ("/get_model_info", model_info, "GET"),
        ("/v1/completions/render", render_completion, "POST"),
        ("/v1/chat/completions/render", render_chat, "POST"),
        ("/sim/stats", sim_stats, "GET"),
    ]


async def sim_stats(w: SimWorker, _: Request) -> Response:
    """The simulator's own counters (not a vLLM endpoint)."""
    s = w.engine.stats()
    pool = w.scheduler.kv.pool
    return Json(
        {
            **dataclasses.asdict(s),
            "free_blocks": pool.num_free,
            "cached_blocks": len(pool.cached_hashes()),
            "blocks_evicted": pool.counters.evicted,
            "blocks_stored": pool.counters.stored,
            "event_batches": w.publisher.seq if w.publisher else 0,
            "kv_transfer": w.connector.stats() if w.connector else None,
        }
    )


def _permission() -> dict[str, Any]:
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": int(time.time()),
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


def _card(name: str, root: str, parent: str | None, max_len: int | None) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_len,
        "permission": [_permission()],
    }


async def models(w: SimWorker, _: Request) -> Response:
    cards = [_card(w.config.model, w.config.model, None, w.max_model_len)]
    for name, keys in w.renderer.loras.items():  # --lora-modules, then those resolved
        cards.append(_card(name, keys.lora_path or "", w.config.model, None))
    return Json({"object": "list", "data": cards})


async def health(w: SimWorker, _: Request) -> Response:
    return Response(status_code=200)


async def version(w: SimWorker, _: Request) -> Response:
    return Json({"version": VLLM_VERSION})


async def load(w: SimWorker, _: Request) -> Response:
    s = w.engine.stats()
    return Json({"server_load": s.running + s.waiting})


async def kv_event_sources(w: SimWorker, _: Request) -> Response:
    """`{dp_rank: KVEventsConfig}`; `{}` when no publisher runs (vLLM without
    --kv-events-config, the silent failure `--no-events` reproduces)."""
    pub = w.publisher
    if pub is None:
        return Json({})
    source = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": pub.endpoint,
        "replay_endpoint": pub.replay_endpoint,
        "buffer_steps": pub.config.buffer_steps,
        "hwm": pub.config.hwm,
        "max_queue_size": 100_000,
        "topic": pub.config.topic,
    }
    return Json({"0": source})


def _config_summary(w: SimWorker) -> dict[str, Any]:
    c = w.config
    return {
        "model_config": {
            "model": c.model,
            "tokenizer": str(c.tokenizer),
            "max_model_len": w.max_model_len,
            "served_model_name": c.model,
        },
        "cache_config": {
            "block_size": c.block_size,
            "num_gpu_blocks": c.kv_blocks,
            "num_gpu_blocks_override": c.kv_blocks,
            "enable_prefix_caching": c.enable_prefix_caching,
            "prefix_caching_hash_algo": "sha256",
        },
        "scheduler_config": {
            "max_num_seqs": c.max_num_seqs,
            "max_num_batched_tokens": c.max_num_batched_tokens,
            "enable_chunked_prefill": True,
        },
        "kv_events_config": {"enable_kv_cache_events": w.publisher is not None},
        "simulator": {"name": c.name, "latency": dataclasses.asdict(c.latency), "seed": c.seed},
    }


async def server_info(w: SimWorker, request: Request) -> Response:
    summary = _config_summary(w)
    as_json = request.query_params.get("config_format", "text") == "json"
    env = {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": w.config.int_hashes}
    return Json(
        {
            "vllm_config": summary if as_json else str(summary),
            "vllm_env": env,
            "system_env": {"simulator": "kvroute engines.sim"},
        }
    )


async def model_info(w: SimWorker, _: Request) -> Response:
    return Json(
        {
            "model_path": w.config.model,
            "tokenizer_path": str(w.config.tokenizer),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "max_model_len": w.max_model_len,
        }
    )


def _sampling_params(gen: GenerateRequest, prompt: Prompt) -> dict[str, Any]:
    body = gen.body
    return {
        "n": gen.n,
        "presence_penalty": float(body.get("presence_penalty") or 0.0),
        "frequency_penalty": float(body.get("frequency_penalty") or 0.0),
        "repetition_penalty": float(body.get("repetition_penalty") or 1.0),
        "temperature": float(body["temperature"]) if body.get("temperature") is not None else 1.0,
        "top_p": float(body.get("top_p") or 1.0),
        "top_k": int(body.get("top_k") or 0),
        "min_p": float(body.get("min_p") or 0.0),
        "seed": body.get("seed"),
        "stop": gen.stop,
        "stop_token_ids": list(gen.stop_token_ids),
        "ignore_eos": gen.ignore_eos,
        "max_tokens": prompt.max_tokens,
        "min_tokens": gen.min_tokens,
        "logprobs": None,
        "prompt_logprobs": None,
        "detokenize": True,
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "include_stop_str_in_output": gen.include_stop_str,
    }


def _render(gen: GenerateRequest, request_id: str, prompt: Prompt) -> dict[str, Any]:
    """vLLM's `GenerateRequest` (`/inference/v1/generate` input) for one rendered prompt."""
    return {
        "request_id": request_id,
        "token_ids": prompt.ids,
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": _sampling_params(gen, prompt),
        "model": gen.body.get("model"),
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": gen.stream,
        "stream_options": gen.body.get("stream_options") if gen.stream else None,
        "cache_salt": gen.keys.cache_salt,
        "priority": int(gen.body.get("priority") or 0),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


def _request_id(request: Request, prefix: str) -> str:
    return f"{prefix}-{request.headers.get('x-request-id') or uuid.uuid4().hex}"


async def render_completion(w: SimWorker, request: Request) -> Response:
    gen = w.renderer.generate_request(await json_body(request), chat=False)
    base = _request_id(request, "cmpl")
    ids = [base] if len(gen.prompts) == 1 else [f"{base}-{i}" for i in range(len(gen.prompts))]
    return Json([_render(gen, rid, p) for rid, p in zip(ids, gen.prompts, strict=True)])


async def render_chat(w: SimWorker, request: Request) -> Response:
    gen = w.renderer.generate_request(await json_body(request), chat=True)
    return Json(_render(gen, _request_id(request, "chatcmpl"), gen.prompts[0]))
