"""OpenAI-compatible response bodies in vLLM 0.32's exact shapes, and the per-request text
stream (incremental detokenization with stop strings, as vLLM's output processor does it).

Shapes follow `vllm/entrypoints/openai/{completion,chat_completion}/protocol.py`: streamed
chunks are dumped with `exclude_unset`, the trailing usage chunk with `exclude_none`, and
non-streamed responses in full.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from engines.sim.engine import Engine, Output, RequestHandle
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


@dataclass(frozen=True)
class Delta:
    """What one engine output adds to one choice of a response."""

    index: int  # the choice: prompt * n + sample, as vLLM numbers them
    prompt: int  # which prompt of the request
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    completion_tokens: int  # this choice's so far
    cached_tokens: int
    kv_transfer_params: dict[str, Any] | None = None  # on the last delta of a prefill leg


class _Choice:
    """One sequence of a request (a prompt's k-th sample), as its text stream sees it."""

    def __init__(self, index: int, prompt: int, handle: RequestHandle, text: TextStream) -> None:
        self.index = index
        self.prompt = prompt
        self.handle = handle
        self.text = text
        self.tokens = 0
        self.done = False

    def take(self, out: Output, cached: int) -> Delta:
        if out.token_id is None:  # aborted under us (shutdown, reset of running requests)
            self.done = True
            return self._delta(self.text.flush(), [], out.finish_reason or "abort", None, cached)
        self.tokens += 1
        text, matched = self.text.add(out.token_id)
        if matched is not None:  # finished here, as vLLM's output processor does
            self.done = True
            self.handle.abort("stop", matched)
            return self._delta(text, [out.token_id], "stop", matched, cached)
        params = None
        if out.finished:
            self.done = True
            text += self.text.flush()
            params = self.handle.request.kv_transfer_out
        return self._delta(text, [out.token_id], out.finish_reason, out.stop_reason, cached, params)

    def _delta(
        self,
        text: str,
        ids: list[int],
        reason: str | None,
        stop: int | str | None,
        cached: int,
        params: dict[str, Any] | None = None,
    ) -> Delta:
        return Delta(self.index, self.prompt, text, ids, reason, stop, self.tokens, cached, params)


async def generate(
    engine: Engine, gen: GenerateRequest, tok: SimTokenizer, request_ids: Sequence[str | None]
) -> AsyncIterator[Delta]:
    """Run every sequence of `gen` (each prompt `n` times: vLLM's child requests, submitted
    together, so a sibling finds the blocks the first one just allocated) and yield their
    deltas in the order the engine produced them. Leaving the iteration early aborts the
    sequences still running, as a client's disconnect."""
    queue: asyncio.Queue[Output] = asyncio.Queue()
    choices = _submit(engine, gen, tok, request_ids, queue)
    live = len(choices)
    try:
        while live:
            out = await queue.get()
            choice = choices[out.request_id]
            if choice.done:  # e.g. the end a stop string's abort queued
                continue
            delta = choice.take(out, _cached_tokens(gen, out.num_cached_tokens))
            live -= choice.done
            yield delta
    finally:
        for choice in choices.values():
            if not choice.handle.request.finished:
                choice.handle.cancel()


def _submit(
    engine: Engine,
    gen: GenerateRequest,
    tok: SimTokenizer,
    request_ids: Sequence[str | None],
    queue: asyncio.Queue[Output],
) -> dict[str, _Choice]:
    """Every sequence of `gen` on the engine, prompt by prompt, sample by sample."""
    choices: dict[str, _Choice] = {}
    for index, (p, k) in enumerate(itertools.product(range(len(gen.prompts)), range(gen.n))):
        prompt = gen.prompts[p]
        sampling = Sampling(
            prompt.max_tokens,
            gen.ignore_eos,
            gen.min_tokens,
            gen.stop_token_ids,
            report_cached=gen.report_cached,
        )
        remote = gen.remote if p == 0 else None  # the handoff was checked for the first prompt
        handle = engine.submit(
            prompt.ids,
            sampling,
            gen.keys,
            request_ids[index],
            gen.kv_transfer_params,
            remote,
            variant=k,
            queue=queue,
        )
        text = TextStream(tok, gen.stop, gen.include_stop_str)
        choices[handle.request.request_id] = _Choice(index, p, handle, text)
    return choices


def _cached_tokens(gen: GenerateRequest, own: int) -> int:
    """A decode leg reports the prefill side's hits (`remote_prefill_cached_tokens`), not
    its own ~100% from the pull, as vLLM's output processor does."""
    remote = getattr(gen.remote, "prefill_cached_tokens", None)
    return remote if isinstance(remote, int) else own


# ---- bodies --------------------------------------------------------------------------------


def usage(
    prompt: int, completion: int, cached: int, full: bool, details: bool = True
) -> dict[str, Any]:
    """`UsageInfo`; `full` dumps every field, else only those not None. `details`: with
    `prompt_tokens_details`, as vLLM started with --enable-prompt-tokens-details."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if full:
        info = {"cached_tokens": cached, "created_cache_tokens": None, "multimodal_tokens": None}
        out.update(prompt_tokens_details=info if details else None, completion_tokens_details=None)
    elif details:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def completion_choice(d: Delta, text: str) -> dict[str, Any]:
    return {
        "index": d.index,
        "text": text,
        "logprobs": None,
        "finish_reason": d.finish_reason,
        "stop_reason": d.stop_reason,
        "token_ids": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "routed_experts": None,
    }


def completion_body(
    rid: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    u: dict[str, Any],
    params: dict[str, Any] | None,
    fp: str | None,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": fp,
        "usage": u,
        "kv_transfer_params": params,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_choice(d: Delta, text: str) -> dict[str, Any]:
    message = {
        "role": "assistant",
        "content": text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    return {
        "index": d.index,
        "message": message,
        "logprobs": None,
        "finish_reason": d.finish_reason or "stop",
        "stop_reason": d.stop_reason,
        "token_ids": None,
        "routed_experts": None,
    }


def chat_body(
    rid: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    u: dict[str, Any],
    params: dict[str, Any] | None,
    fp: str | None,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": fp,
        "usage": u,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": params,
        "ec_transfer_params": None,
        "metrics": None,
    }


def completion_chunk(rid: str, created: int, model: str, d: Delta) -> dict[str, Any]:
    choice = {
        "index": d.index,
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


def chat_role_chunk(rid: str, created: int, model: str, index: int = 0) -> dict[str, Any]:
    choice = {
        "index": index,
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
        "index": d.index,
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
