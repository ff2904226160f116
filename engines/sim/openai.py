"""OpenAI-compatible response bodies in vLLM 0.32's exact shapes, and the per-request text
stream (incremental detokenization with stop strings, as vLLM's output processor does it).

Shapes follow `vllm/entrypoints/openai/{completion,chat_completion}/protocol.py`: streamed
chunks are dumped with `exclude_unset`, the trailing usage chunk with `exclude_none`, and
non-streamed responses in full.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engines.sim.engine import Engine
from engines.sim.protocol import GenerateRequest
from engines.sim.request import Sampling
from engines.sim.tokenizer import SimTokenizer


class TextStream:
    """Generated text so far; holds back a tail that could still become a stop string."""

    def __init__(self, tokenizer: SimTokenizer, stop: list[str], include_stop: bool) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.hold = 0 if include_stop or not stop else max(len(s) for s in stop) - 1
        self.text = ""
        self.sent = 0

    def add(self, token_id: int) -> tuple[str, str | None]:
        """Append a token; returns (text to send now, the stop string it completed)."""
        before = len(self.text)
        self.text += self.tokenizer.piece(token_id)
        for s in self.stop:
            at = self.text.find(s, max(0, before - len(s) + 1))
            if at >= 0:
                self.text = self.text[: at + (len(s) if self.include_stop else 0)]
                return self._take(len(self.text)), s
        return self._take(len(self.text) - self.hold), None

    def flush(self) -> str:
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : upto], upto
        return out


@dataclass
class Delta:
    """What one engine output adds to a response."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    completion_tokens: int
    cached_tokens: int
    kv_transfer_params: dict[str, Any] | None = None  # on the last delta of a prefill leg


async def generate(
    engine: Engine, gen: GenerateRequest, tok: SimTokenizer, request_id: str | None = None
) -> AsyncIterator[Delta]:
    """Run one request on the engine; leaving the iteration early aborts it."""
    sampling = Sampling(gen.max_tokens, gen.ignore_eos, gen.min_tokens, gen.stop_token_ids)
    handle = engine.submit(
        gen.prompt_ids, sampling, gen.keys, request_id, gen.kv_transfer_params, gen.remote
    )
    text = TextStream(tok, gen.stop, gen.include_stop_str)
    n = 0
    async for out in handle.outputs():
        cached = _cached_tokens(gen, out.num_cached_tokens)
        if out.token_id is None:  # aborted under us (shutdown, reset of running requests)
            yield Delta(text.flush(), [], out.finish_reason or "abort", None, n, cached)
            return
        n += 1
        delta, matched = text.add(out.token_id)
        if matched is not None:
            handle.abort("stop", matched)
            yield Delta(delta, [out.token_id], "stop", matched, n, cached)
            return
        if out.finished:
            delta += text.flush()
        params = handle.request.kv_transfer_out if out.finished else None
        yield Delta(delta, [out.token_id], out.finish_reason, out.stop_reason, n, cached, params)


def _cached_tokens(gen: GenerateRequest, own: int) -> int:
    """A decode leg reports the prefill side's hits (`remote_prefill_cached_tokens`), not
    its own ~100% from the pull, as vLLM's output processor does."""
    remote = getattr(gen.remote, "prefill_cached_tokens", None)
    return remote if isinstance(remote, int) else own


# ---- bodies --------------------------------------------------------------------------------


def usage(prompt: int, completion: int, cached: int, full: bool) -> dict[str, Any]:
    """`UsageInfo` with `prompt_tokens_details` (the engine runs with
    --enable-prompt-tokens-details); `full` dumps every field, else only the set ones."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if full:
        details = {"cached_tokens": cached, "created_cache_tokens": None, "multimodal_tokens": None}
        out.update(prompt_tokens_details=details, completion_tokens_details=None)
    else:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def completion_body(
    rid: str, created: int, model: str, d: Delta, text: str, u: dict[str, Any], fp: str | None
) -> dict[str, Any]:
    choice = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": d.finish_reason,
        "stop_reason": d.stop_reason,
        "token_ids": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "routed_experts": None,
    }
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": fp,
        "usage": u,
        "kv_transfer_params": d.kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_body(
    rid: str, created: int, model: str, d: Delta, text: str, u: dict[str, Any], fp: str | None
) -> dict[str, Any]:
    message = {
        "role": "assistant",
        "content": text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": d.finish_reason or "stop",
        "stop_reason": d.stop_reason,
        "token_ids": None,
        "routed_experts": None,
    }
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": fp,
        "usage": u,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": d.kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


def completion_chunk(rid: str, created: int, model: str, d: Delta) -> dict[str, Any]:
    choice = {
        "index": 0,
        "text": d.text,
        "logprobs": None,
        "finish_reason": d.finish_reason,
        "stop_reason": d.stop_reason,
        "prompt_token_ids": None,
        "token_ids": None,
    }
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def chat_role_chunk(rid: str, created: int, model: str) -> dict[str, Any]:
    choice = {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
        "prompt_token_ids": None,
        "prompt_text": None,
    }


def chat_chunk(rid: str, created: int, model: str, d: Delta) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "delta": {"content": d.text},
        "logprobs": None,
        "finish_reason": d.finish_reason,
    }
    if d.finish_reason is not None:
        choice["stop_reason"] = d.stop_reason
    choice["token_ids"] = None
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def usage_chunk(
    rid: str, created: int, model: str, obj: str, u: dict[str, Any], fp: str | None
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": u,
    }
    if fp is not None:
        chunk["system_fingerprint"] = fp
    return chunk
