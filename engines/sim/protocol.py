"""Request bodies of the OpenAI-compatible endpoints, parsed and checked the way vLLM 0.32
does (`engines.sim.validation` has the checks, in vLLM's order), into what the engine runs:
one sequence per prompt and choice (a batch of prompts, `n` choices each)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from engines.sim.blockpool import NO_KEYS, CacheKeys
from engines.sim.errors import ApiError, bad_request, invalid, schema_error, schema_errors
from engines.sim.tokenizer import ChatTemplateError, SimTokenizer
from engines.sim.validation import (
    MISSING,
    NO_TRUNCATION,
    SamplingFields,
    Truncation,
    before_checks,
    cache_salt,
    clamp,
    get,
    output_budget,
    sampling_checks,
    suffix_check,
    token_budget_checks,
    truncation,
)
from engines.vllm.lax import NotAPrompt, lax_prompt


def stop_list(body: Mapping[str, Any]) -> list[str]:
    """`stop` as a list; empty strings are kept for vLLM's check to refuse."""
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise schema_error(("stop",), "union", "Input should be a string or a list of strings", stop)


# ---- requests ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request and the output tokens it may have (`get_max_tokens`)."""

    ids: list[int]
    max_tokens: int


@dataclass
class GenerateRequest:
    """What the engine needs from a completion or chat request: its prompts (a completion
    may carry a batch; chat has one), each run as `n` sequences."""

    model: str
    prompts: list[Prompt]
    keys: CacheKeys
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # only with include_usage, as vLLM's should_include_usage
    stop: list[str] = field(default_factory=list)
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    report_cached: bool = False  # vllm_xargs {"kv_cache_report_mode": "full"}
    return_token_ids: bool = False
    body: Mapping[str, Any] = field(default_factory=dict)
    kv_transfer_params: dict[str, Any] | None = None
    remote: Any = None  # the decode leg's validated pull (engines.sim.pd_wire.RemoteParams)

    @property
    def prompt_ids(self) -> list[int]:
        """The first prompt's ids (P/D handoff and rendering look at one prompt)."""
        return self.prompts[0].ids

    @property
    def max_tokens(self) -> int:
        return self.prompts[0].max_tokens


class Renderer:
    """Turns request bodies into token ids, as vLLM's renderer does for this model."""

    def __init__(
        self,
        tokenizer: SimTokenizer,
        model: str,
        max_model_len: int,
        loras: Mapping[str, CacheKeys] | None = None,
        resolver_dir: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.max_model_len = max_model_len
        self.loras = dict(loras or {})
        self.resolver_dir = resolver_dir

    def served(self) -> list[str]:
        return [self.model, *self.loras]

    def resolve(self, name: str) -> CacheKeys | None:
        """vLLM's filesystem LoRA resolver (VLLM_LORA_RESOLVER_CACHE_DIR): an adapter named
        `name` is loaded at its first request when `<dir>/<name>/adapter_config.json` is a
        LoRA of this base model (`base_model_name_or_path`: vLLM compares its --model, the
        simulator its model name), and served under that name from then on."""
        if self.resolver_dir is None:
            return None
        path = os.path.join(self.resolver_dir, name)
        try:
            with open(os.path.join(path, "adapter_config.json")) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(doc, dict) or doc.get("peft_type") != "LORA":
            return None
        if doc.get("base_model_name_or_path") != self.model:
            return None
        keys = CacheKeys(lora_name=name, lora_path=path, lora_id=len(self.loras) + 1)
        self.loras[name] = keys
        return keys

    def keys_for(self, body: Mapping[str, Any]) -> CacheKeys:
        """LoRA and cache_salt of a request; 404 for a model this worker does not serve."""
        name = get(body, "model", str, None)
        salt = cache_salt(body)
        if name and name != self.model and name not in self.loras and not self.resolve(name):
            raise ApiError(
                f"The model `{name}` does not exist. Valid aliases: {self.model}.",
                "NotFoundError",
                404,
                "model",
            )
        base = self.loras.get(name or "", NO_KEYS)
        return CacheKeys(base.lora_name, base.lora_path, base.lora_id, salt)

    def completion_batch(
        self, body: Mapping[str, Any], cut: Truncation = NO_TRUNCATION
    ) -> list[list[int]]:
        """Token ids of each prompt of a completion: a string, token ids, or a batch of
        either (vLLM's `str | list[str] | list[int] | list[list[int]]`), truncated as `cut`
        says."""
        prompt = body.get("prompt", MISSING)
        if prompt is MISSING or prompt is None:
            raise schema_error(("prompt",), "missing", "Field required", body)
        special = get(body, "add_special_tokens", bool, True)
        try:
            _, prompts = lax_prompt(prompt)  # 1.0, true and "7" are token ids, as in vLLM
        except NotAPrompt:
            prompts = []
        ids_ok = all(isinstance(p, str) or all(t >= 0 for t in p) for p in prompts)
        if not ids_ok or not prompts or not prompt:
            raise schema_error(
                ("prompt",), "union", "Input should be a string or a list of token ids", prompt
            )
        return [
            cut.encoded(partial(self.tokenizer.encode, p, special))
            if isinstance(p, str)
            else cut.cut(p)
            for p in prompts
        ]

    def tokenize_ids(self, body: Mapping[str, Any]) -> list[int]:
        """/tokenize: `messages`, or `prompt` as one string (vLLM's TokenizeRequest union of
        a completion and a chat form: anything else fails both)."""
        if "messages" in body:
            return self.chat_ids(body)
        prompt = body.get("prompt", MISSING)
        if not isinstance(prompt, str):
            first = (
                (("prompt",), "missing", "Field required", body)
                if prompt is MISSING
                else (("prompt",), "string_type", "Input should be a valid string", prompt)
            )
            raise schema_errors([first, (("messages",), "missing", "Field required", body)])
        add_special = get(body, "add_special_tokens", bool, True)
        return self.tokenizer.encode(prompt, add_special_tokens=add_special)

    def chat_ids(self, body: Mapping[str, Any], cut: Truncation = NO_TRUNCATION) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise schema_error(("messages",), "missing", "Field required", body)
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise schema_error(("messages", i, "role"), "missing", "Field required", m)
        # vLLM's before-validator reads both as sent ("false" is truthy there), then the
        # template reads them as the model parsed them
        raw = body.get("continue_final_message") and body.get("add_generation_prompt")
        gen = get(body, "add_generation_prompt", bool, True)
        cont = get(body, "continue_final_message", bool, False)
        if raw or (gen and cont):
            raise bad_request(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        kwargs = get(body, "chat_template_kwargs", dict, None)
        add_special = get(body, "add_special_tokens", bool, False)
        encode = partial(self.tokenizer.encode_chat, messages, gen, cont, add_special, kwargs)
        try:
            return cut.encoded(encode)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from None

    def prompt_ids(self, body: Mapping[str, Any]) -> list[int]:
        """Token ids of `token_ids`, `messages` or `prompt` (one), whichever the body has."""
        if "token_ids" in body:
            ids = body["token_ids"]
            if not isinstance(ids, list) or not ids or not all(_is_token(t) for t in ids):
                raise schema_error(
                    ("token_ids",),
                    "list_type",
                    "Input should be a non-empty list of token ids",
                    ids,
                )
            return list(ids)
        if "messages" in body:
            return self.chat_ids(body)
        batch = self.completion_batch(body)
        if len(batch) != 1:
            raise bad_request("give one prompt: cached tokens are reported per prompt", "prompt")
        return batch[0]

    def check_length(self, ids: Sequence[int]) -> None:
        """The renderer's length check (`_token_len_check`): a prompt of exactly the context
        passes it, and then fails the sampling check, its max_tokens clamped to 0."""
        if len(ids) > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt contains {len(ids)} input tokens, which exceeds this limit even "
                "without any output tokens. Please reduce the length of the input prompt.",
                "input_tokens",
            )

    def check_tokens(self, ids: Sequence[int]) -> None:
        """The engine's input checks, after the sampling ones: an empty prompt (a request
        truncated to 0 tokens) and ids out of the vocabulary."""
        if not ids:
            raise invalid("The decoder prompt cannot be empty")
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise bad_request(f"Token id {bad} is out of vocabulary", "prompt")

    def generate_request(self, body: Mapping[str, Any], chat: bool) -> GenerateRequest:
        """Check `body` in vLLM's order (see engines.sim.validation) and render it."""
        before_checks(body, chat)
        keys = self.keys_for(body)
        _unsupported(body)
        if not chat:
            suffix_check(body)
        budget = output_budget(body, chat)
        token_budget_checks(body, budget, self.max_model_len)
        cut = truncation(body, budget, self.max_model_len)
        batch = [self.chat_ids(body, cut)] if chat else self.completion_batch(body, cut)
        for ids in batch:
            self.check_length(ids)
        stop = stop_list(body)
        fields = SamplingFields.parse(body, chat, stop)
        prompts = [Prompt(ids, clamp(budget, self.max_model_len - len(ids))) for ids in batch]
        for p in prompts:
            sampling_checks(body, fields, p.max_tokens)
        for p in prompts:
            self.check_tokens(p.ids)
        options = get(body, "stream_options", dict, None) or {}
        stream = bool(get(body, "stream", bool, None))
        include_usage = stream and bool(options.get("include_usage"))
        return GenerateRequest(
            model=get(body, "model", str, None) or self.model,
            prompts=prompts,
            keys=keys,
            n=fields.n,
            stream=stream,
            include_usage=include_usage,
            continuous_usage=include_usage and bool(options.get("continuous_usage_stats")),
            stop=stop,
            stop_token_ids=tuple(get(body, "stop_token_ids", list, None) or ()),
            include_stop_str=get(body, "include_stop_str_in_output", bool, False),
            ignore_eos=get(body, "ignore_eos", bool, False),
            min_tokens=fields.min_tokens,
            report_cached=_report_mode(body) == "full",
            return_token_ids=bool(get(body, "return_token_ids", bool, None)),
            body=body,
            kv_transfer_params=get(body, "kv_transfer_params", dict, None),
        )


def _report_mode(body: Mapping[str, Any]) -> str:
    """vLLM reads `kv_cache_report_mode` from the request's `vllm_xargs` (its sampling
    params' extra_args): "full" republishes the blocks a request found cached."""
    xargs = get(body, "vllm_xargs", dict, None) or {}
    for key, value in xargs.items():  # vLLM's field: dict[str, str | int | float | list[...]]
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(v, str | int | float) for v in items):
            raise schema_error(
                ("vllm_xargs", str(key)),
                "value_error",
                "Input should be a string, a number or a list of them",
                value,
            )
    return str(xargs.get("kv_cache_report_mode", "incremental"))


def _is_token(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def _unsupported(body: Mapping[str, Any]) -> None:
    # vLLM 0.32 has no best_of: its request models keep it as an unknown field, unused
    flags = [n for n in ("use_beam_search", "echo") if get(body, n, bool, None)]
    numbers = [n for n in ("logprobs", "prompt_logprobs") if body.get(n) not in (None, False)]
    if unsupported := flags + numbers:
        raise bad_request(f"{unsupported[0]} is not supported by the simulator", unsupported[0])
