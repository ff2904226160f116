"""A generation request's response, whole or streamed, from the deltas of all its choices, as
vLLM 0.32's `OpenAIServingCompletion` and `OpenAIServingChat` assemble it.

Several choices (a batch of prompts, `n` each): choices are indexed prompt * n + sample;
usage counts each prompt's tokens once and sums the completion tokens of every choice. The
cached tokens reported are those of one engine request, the one vLLM reads them from: whole
responses take the final output of the last prompt (with n > 1, the sample that finished
last), streams the first output that came.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from engines.sim import openai as oa
from engines.sim.asgi import dumps
from engines.sim.pd_http import engine_request_id, internal_error
from engines.sim.protocol import GenerateRequest

if TYPE_CHECKING:
    from engines.sim.worker import SimWorker


def request_ids(rid: str, chat: bool, gen: GenerateRequest) -> list[str | None]:
    """vLLM's engine request ids: one per prompt, and `k_<id>` for the k-th of n samples."""
    out: list[str | None] = []
    for p in range(len(gen.prompts)):
        parent = engine_request_id(rid, chat, p)
        out += [parent] if gen.n == 1 else [f"{k}_{parent}" for k in range(gen.n)]
    return out


def _deltas(w: SimWorker, gen: GenerateRequest, rid: str, chat: bool) -> AsyncIterator[oa.Delta]:
    return oa.generate(w.engine, gen, w.tokenizer, request_ids(rid, chat, gen))


def _prompt_tokens(gen: GenerateRequest) -> int:
    return sum(len(p.ids) for p in gen.prompts)


async def collect(
    w: SimWorker, gen: GenerateRequest, rid: str, created: int, chat: bool
) -> dict[str, Any]:
    """The whole response, once every choice has finished."""
    texts: dict[int, list[str]] = {}
    ids: dict[int, list[int]] = {}
    final: dict[int, oa.Delta] = {}
    last_of_prompt: dict[int, oa.Delta] = {}  # the output vLLM reports a prompt from
    async for d in _deltas(w, gen, rid, chat):
        texts.setdefault(d.index, []).append(d.text)
        ids.setdefault(d.index, []).extend(d.token_ids)
        if d.finish_reason is not None:
            final[d.index] = last_of_prompt[d.prompt] = d
    if any(d.finish_reason == "error" for d in final.values()):
        raise internal_error()  # e.g. a failed KV pull under policy "fail"
    done = [final[i] for i in sorted(final)]
    completion = sum(d.completion_tokens for d in done)
    cached = last_of_prompt[len(gen.prompts) - 1].cached_tokens
    details = w.config.prompt_tokens_details
    u = oa.usage(_prompt_tokens(gen), completion, cached, full=True, details=details)
    choice = oa.chat_choice if chat else oa.completion_choice
    choices = [choice(d, "".join(texts[d.index])) for d in done]
    shape = oa.chat_body if chat else oa.completion_body
    params = last_of_prompt[0].kv_transfer_params
    body = shape(rid, created, gen.model, choices, u, params, w.fingerprint)
    if gen.return_token_ids:  # the prompt as the engine ran it (truncated), and the output
        for c, d in zip(choices, done, strict=True):
            c["token_ids"] = ids[d.index]
            if not chat:
                c["prompt_token_ids"] = gen.prompts[d.prompt].ids
        if chat:
            body["prompt_token_ids"] = gen.prompt_ids
    return body


async def stream(
    w: SimWorker, gen: GenerateRequest, rid: str, created: int, chat: bool
) -> AsyncIterator[str]:
    """Server-sent events: a role chunk per choice (chat), a chunk per delta, the usage
    chunk when asked for, then [DONE]."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    if chat:
        for i in range(gen.n):
            chunk = oa.chat_role_chunk(rid, created, gen.model, i)
            if gen.return_token_ids:
                chunk["prompt_token_ids"] = gen.prompt_ids
            if gen.continuous_usage:  # vLLM: usage on the role chunk too, 0 completion tokens
                chunk["usage"] = _running_usage(len(gen.prompt_ids), 0, chat)
            yield dumps(chunk)
    first: oa.Delta | None = None
    tokens: dict[int, int] = {}
    async for d in _deltas(w, gen, rid, chat):
        if d.finish_reason == "error":  # vLLM: an error event, then [DONE]
            yield dumps(internal_error().body())
            break
        if first is None:
            first = d
        chunk = _chunk(w, gen, rid, created, chat, d)
        if gen.return_token_ids:  # each delta's ids; a completion's prompt on its first
            choice = chunk["choices"][0]
            choice["token_ids"] = d.token_ids
            if not chat and d.index not in tokens:
                choice["prompt_token_ids"] = gen.prompts[d.prompt].ids
        tokens[d.index] = d.completion_tokens
        yield dumps(chunk)
    else:
        if gen.include_usage and first is not None:
            completion = sum(tokens.values())
            details = w.config.prompt_tokens_details
            prompt = _prompt_tokens(gen)
            u = oa.usage(prompt, completion, first.cached_tokens, full=False, details=details)
            yield dumps(oa.usage_chunk(rid, created, gen.model, obj, u, w.fingerprint))
    yield "[DONE]"


def _chunk(
    w: SimWorker, gen: GenerateRequest, rid: str, created: int, chat: bool, d: oa.Delta
) -> dict[str, Any]:
    chunk = (oa.chat_chunk if chat else oa.completion_chunk)(rid, created, gen.model, d)
    if d.finish_reason is not None and not gen.include_usage:
        chunk["system_fingerprint"] = w.fingerprint  # the last message when no usage follows
    if gen.continuous_usage:
        prompt = len(gen.prompts[d.prompt].ids)
        chunk["usage"] = _running_usage(prompt, d.completion_tokens, chat)
    return chunk


def _running_usage(prompt: int, completion: int, chat: bool) -> dict[str, Any]:
    """A chunk's continuous usage, dumped with exclude_unset: chat sets
    completion_tokens_details (None) explicitly, completions do not."""
    u: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if chat:
        u["completion_tokens_details"] = None
    return u
