"""Typed field access and the request checks vLLM 0.32 runs, in its order.

1. `before_checks`: the request models' `mode="before"` validators (pydantic runs the last
   defined first): prompt list length, empty prompt, stream_options without stream.
2. (the model is looked up: 404)
3. `suffix_check` (completions; the renderer has no FIM template for this model), then
   `token_budget_checks`: `TokenizeParams.__post_init__`, before the prompt is tokenized.
4. (tokenize, truncated as `truncation` says; then the context length)
5. `sampling_checks` per prompt: `SamplingParams._verify_args`, with max_tokens already
   clamped to the room the prompt leaves (`get_max_tokens`), then the greedy-sampling check.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from engines.sim.errors import bad_request, invalid, schema_error
from engines.vllm.lax import NotABool, NotAnInt, lax_bool, lax_int

MISSING = object()
MAX_N = 16384  # VLLM_MAX_N_SEQUENCES
MAX_PROMPTS = 1024  # VLLM_MAX_COMPLETION_PROMPTS
_SAMPLING_EPS = 1e-5


# ---- typed field access ------------------------------------------------------------------


def get(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name, MISSING)
    if value is MISSING or (value is None and default is None):
        if default is MISSING:
            raise schema_error((name,), "missing", "Field required", body)
        return default
    if kind is int or kind is bool:  # pydantic's lax mode, as vLLM's request models read
        try:  # "16" and 16.0 are 16; "false", "off" and 0 are false
            return lax_int(value) if kind is int else lax_bool(value)
        except (NotAnInt, NotABool) as exc:
            raise schema_error((name,), exc.code, str(exc), value) from None
    if not isinstance(value, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        code, noun = _PYDANTIC_TYPES.get(kinds[0], (kinds[0].__name__, kinds[0].__name__))
        raise schema_error((name,), f"{code}_type", f"Input should be a valid {noun}", value)
    return value


# pydantic's error type and noun per Python type ("int_type", "a valid integer")
_PYDANTIC_TYPES = {
    str: ("string", "string"),
    int: ("int", "integer"),
    bool: ("bool", "boolean"),
    dict: ("dict", "dictionary"),
    list: ("list", "list"),
}


def number(body: Mapping[str, Any], name: str) -> float | None:
    """A `float | None` field, pydantic's lax way (ints, bools, numeric strings)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            msg = "Input should be a valid number, unable to parse string as a number"
            raise schema_error((name,), "float_parsing", msg, value) from None
    raise schema_error((name,), "float_type", "Input should be a valid number", value)


# ---- 1. the request models' before-validators -------------------------------------------


def before_checks(body: Mapping[str, Any], chat: bool) -> None:
    if not chat:
        prompt = body.get("prompt")
        is_ids = isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        )
        if isinstance(prompt, list) and prompt and not is_ids and len(prompt) > MAX_PROMPTS:
            raise invalid(
                f"prompt list length {len(prompt)} exceeds the maximum allowed count of "
                f"{MAX_PROMPTS}. To increase this limit, set the VLLM_MAX_COMPLETION_PROMPTS "
                "environment variable.",
                "prompt",
            )
        if (prompt is None or prompt == "") and not body.get("prompt_embeds"):
            raise invalid(
                "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
            )
    if body.get("stream_options") and not body.get("stream"):
        raise invalid("Stream options can only be defined when `stream=True`.", "stream_options")
    side = body.get("truncation_side")
    if side is not None and side not in ("left", "right"):
        raise schema_error(
            ("truncation_side",),
            "literal_error",
            "Input should be 'left' or 'right'",
            side,
            {"expected": "'left' or 'right'"},
        )


def cache_salt(body: Mapping[str, Any]) -> str | None:
    """vLLM's `validate_cache_salt` (a before-validator too)."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        msg = "Parameter 'cache_salt' must be a non-empty string if provided."
        raise invalid(msg, "cache_salt")
    if len(salt) > 128 or any(c in "@/\\\x00" for c in salt):
        raise invalid(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\\\', or NUL.",
            "cache_salt",
        )
    return salt


# ---- 3. before tokenizing ----------------------------------------------------------------


def suffix_check(body: Mapping[str, Any]) -> None:
    """vLLM's `render_completion`: this model's renderer has no fill-in-the-middle template."""
    suffix = get(body, "suffix", str, None)
    if suffix is None:
        return
    prompt = body.get("prompt")
    if get(body, "echo", bool, None):
        raise bad_request("Echo is unsupported with suffix.", "suffix")
    if body.get("truncate_prompt_tokens") is not None:
        raise bad_request("suffix is not supported with truncate_prompt_tokens", "suffix")
    texts = isinstance(prompt, list) and all(isinstance(p, str) for p in prompt)
    if isinstance(prompt, str) or texts:
        raise bad_request(
            "suffix is only supported for models with FIM completion rendering", "suffix"
        )
    raise bad_request("suffix requires text prompt input for FIM completion rendering", "suffix")


@dataclass(frozen=True)
class Budget:
    """What a request asks of the context: the output tokens (None: as many as fit)."""

    max_tokens: int | None
    param: str  # the field the client set: max_tokens or max_completion_tokens


def output_budget(body: Mapping[str, Any], chat: bool) -> Budget:
    if chat:
        explicit = get(body, "max_completion_tokens", int, None)
        if explicit is not None:
            return Budget(explicit, "max_completion_tokens")
        return Budget(get(body, "max_tokens", int, None), "max_tokens")
    explicit = get(body, "max_tokens", int, None)
    return Budget(16 if explicit is None else explicit, "max_tokens")  # null means 16


def token_budget_checks(body: Mapping[str, Any], budget: Budget, max_model_len: int) -> None:
    """`TokenizeParams.__post_init__` (vLLM names the limit `max_model_len`)."""
    wanted = budget.max_tokens or 0
    if wanted > max_model_len:
        raise invalid(
            f"{budget.param}={wanted} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            budget.param,
            wanted,
        )
    truncate = get(body, "truncate_prompt_tokens", int, None)
    if truncate is not None and truncate < -1:
        raise schema_error(
            ("truncate_prompt_tokens",),
            "greater_than_equal",
            "Input should be greater than or equal to -1",
            truncate,
            {"ge": -1},
        )
    if truncate is not None and truncate > max_model_len:
        raise invalid(
            f"truncate_prompt_tokens={truncate} cannot be greater than max_model_len = "
            f"{max_model_len}. Please request a smaller truncation size.",
            "truncate_prompt_tokens",
            truncate,
        )


@dataclass(frozen=True)
class Truncation:
    """What vLLM's `TokenizeParams` keeps of a prompt: `keep` ids (None: all), from `side`
    ("left" keeps the last ones, "right" the first; None: the tokenizer's own truncation,
    which for a generative model is from the left and keeps the special tokens it adds)."""

    keep: int | None = None
    side: str | None = None

    def cut(self, ids: list[int]) -> list[int]:
        """`TokenizeParams._truncation_slice` over ids already encoded: a prompt of token
        ids, or one encoded whole because the request named a side."""
        if self.keep is None or self.keep >= len(ids):
            return ids
        if self.keep == 0:
            return []
        return ids[: self.keep] if self.side == "right" else ids[-self.keep :]

    def encoded(self, encode: Callable[[int | None], list[int]]) -> list[int]:
        """A text prompt, `encode(keep)` encoding it: without a side the tokenizer truncates
        it as it encodes (keeping the special tokens it adds); with a side vLLM encodes it
        whole and slices; of 0 it keeps nothing."""
        if self.keep == 0:
            return []
        if self.side is None:
            return encode(self.keep)
        return self.cut(encode(None))


NO_TRUNCATION = Truncation()


def truncation(body: Mapping[str, Any], budget: Budget, max_model_len: int) -> Truncation:
    """`truncate_prompt_tokens` -1 is `max_truncation_tokens`: the context, less one token
    held back when the request asks for any output (so the prompt leaves room for it)."""
    keep = get(body, "truncate_prompt_tokens", int, None)
    if keep is not None and keep < 0:
        keep = max_model_len - 1 if budget.max_tokens else max_model_len
    return Truncation(keep, get(body, "truncation_side", str, None))


def clamp(budget: Budget, room: int) -> int:
    """vLLM's `get_max_tokens`: the asked-for output tokens, at most the room left."""
    return room if budget.max_tokens is None else min(room, budget.max_tokens)


# ---- 5. SamplingParams -------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingFields:
    """The request's sampling fields that vLLM checks (None: the default applies)."""

    n: int
    temperature: float
    top_p: float
    min_tokens: int
    stop: list[str]

    @classmethod
    def parse(cls, body: Mapping[str, Any], chat: bool, stop: list[str]) -> SamplingFields:
        n = get(body, "n", int, None if chat else 1)
        temperature = number(body, "temperature")
        top_p = number(body, "top_p")
        return cls(
            n=1 if n is None else n,
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            min_tokens=get(body, "min_tokens", int, 0),
            stop=stop,
        )


def sampling_checks(body: Mapping[str, Any], s: SamplingFields, max_tokens: int) -> None:
    """`SamplingParams._verify_args` in its order, then the greedy-sampling check."""
    _n_check(s.n)
    _penalty_checks(body)
    _temperature_check(s.temperature)
    if not 0.0 < s.top_p <= 1.0:
        raise invalid(f"top_p must be in (0, 1], got {s.top_p}.", "top_p", s.top_p)
    _top_k_min_p_checks(body)
    if max_tokens < 1:
        raise invalid(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    if s.min_tokens < 0:
        raise bad_request(f"min_tokens must be greater than or equal to 0, got {s.min_tokens}.")
    if s.min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {s.min_tokens}."
        )
    if any(not stop for stop in s.stop):
        raise bad_request("stop cannot contain an empty string.")
    if s.temperature < _SAMPLING_EPS and s.n > 1:
        raise bad_request(f"n must be 1 when using greedy sampling, got {s.n}.")


def _n_check(n: int) -> None:
    if n < 1:
        raise bad_request(f"n must be at least 1, got {n}.")
    if n > MAX_N:
        raise bad_request(
            f"n must be at most {MAX_N}, got {n}. To increase this limit, set the "
            "VLLM_MAX_N_SEQUENCES environment variable."
        )


def _penalty_checks(body: Mapping[str, Any]) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        value = number(body, name)
        if value is not None and not -2.0 <= value <= 2.0:
            raise bad_request(f"{name} must be in [-2, 2], got {value}.")
    rep = number(body, "repetition_penalty")
    if rep is not None and not math.isfinite(rep):
        raise bad_request(f"repetition_penalty must be a finite number, got {rep}.")
    if rep is not None and rep <= 0.0:
        raise bad_request(f"repetition_penalty must be greater than zero, got {rep}.")


def _temperature_check(t: float) -> None:
    if not math.isfinite(t):
        raise invalid(f"temperature must be a finite number, got {t}.", "temperature", t)
    if t < 0.0:
        raise invalid(f"temperature must be non-negative, got {t}.", "temperature", t)
    if t > 2.0:
        raise invalid(f"temperature must be in [0, 2], got {t}.", "temperature", t)


def _top_k_min_p_checks(body: Mapping[str, Any]) -> None:
    top_k = get(body, "top_k", int, None)
    if top_k is not None and top_k < -1:
        raise bad_request(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    min_p = number(body, "min_p")
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise bad_request(f"min_p must be in [0, 1], got {min_p}.")
