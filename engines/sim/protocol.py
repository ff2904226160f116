"""Request bodies of the OpenAI-compatible endpoints, parsed the way vLLM validates them, and
vLLM's error bodies.

Errors: `{"error": {"message", "type", "param", "code"}}`. Schema violations come out as
vLLM's validation handler writes them (type "Bad Request", message "N validation error(s):
..."); semantic ones as `BadRequestError`; an unknown model as 404 `NotFoundError`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engines.sim.blockpool import NO_KEYS, CacheKeys
from engines.sim.tokenizer import ChatTemplateError, SimTokenizer

_MISSING = object()


class ApiError(Exception):
    def __init__(self, message: str, err_type: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.err_type = err_type
        self.status = status
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(message, "BadRequestError", 400, param)


def schema_error(loc: Sequence[str | int], kind: str, msg: str, value: object) -> ApiError:
    """One pydantic-style validation error, as vLLM's RequestValidationError handler says it."""
    shown = value if isinstance(value, (str, int, float, bool)) or value is None else "..."
    err = {"type": kind, "loc": ("body", *loc), "msg": msg, "input": shown}
    param = ".".join(str(p) for p in ("body", *loc))
    return ApiError(f"1 validation error:\n  {err}", "Bad Request", 400, param)


def media_type_error() -> ApiError:
    msg = "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
    return ApiError(msg, "Bad Request", 400, None)


# ---- typed field access ------------------------------------------------------------------


def get(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name, _MISSING)
    if value is _MISSING or (value is None and default is None):
        if default is _MISSING:
            raise schema_error((name,), "missing", "Field required", None)
        return default
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise schema_error((name,), f"{names}_type", f"Input should be a valid {names}", value)
    return value


def non_negative(body: Mapping[str, Any], name: str, default: int | None) -> int | None:
    value: int | None = get(body, name, int, default)
    if value is not None and value < 0:
        raise schema_error((name,), "greater_than_equal", "Input should be >= 0", value)
    return value


def stop_list(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise schema_error(("stop",), "union", "Input should be a string or a list of strings", stop)


# ---- requests ------------------------------------------------------------------------------


@dataclass
class GenerateRequest:
    """What the engine needs from a completion or chat request."""

    model: str
    prompt_ids: list[int]
    keys: CacheKeys
    max_tokens: int
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    return_token_ids: bool = False
    body: Mapping[str, Any] = field(default_factory=dict)
    kv_transfer_params: dict[str, Any] | None = None
    remote: Any = None  # the decode leg's validated pull (engines.sim.pd_wire.RemoteParams)


class Renderer:
    """Turns request bodies into token ids, as vLLM's renderer does for this model."""

    def __init__(
        self,
        tokenizer: SimTokenizer,
        model: str,
        max_model_len: int,
        loras: Mapping[str, CacheKeys] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.max_model_len = max_model_len
        self.loras = dict(loras or {})

    def served(self) -> list[str]:
        return [self.model, *self.loras]

    def keys_for(self, body: Mapping[str, Any]) -> CacheKeys:
        """LoRA and cache_salt of a request; 404 for a model this worker does not serve."""
        name = get(body, "model", str, None)
        salt = get(body, "cache_salt", str, None)
        if salt is not None and not salt:
            raise schema_error(
                ("cache_salt",), "string_too_short", "String should have at least 1 character", salt
            )
        if name and name != self.model and name not in self.loras:
            raise ApiError(
                f"The model `{name}` does not exist. Valid aliases: {self.model}.",
                "NotFoundError",
                404,
                "model",
            )
        base = self.loras.get(name or "", NO_KEYS)
        return CacheKeys(base.lora_name, base.lora_path, base.lora_id, salt)

    def completion_ids(self, body: Mapping[str, Any], add_special: bool = True) -> list[int]:
        prompt = body.get("prompt", _MISSING)
        if prompt is _MISSING or prompt is None:
            raise schema_error(("prompt",), "missing", "Field required", None)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=add_special)
        if isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) > 1:
            raise bad_request("the simulator serves one prompt per request", "prompt")
        raise schema_error(
            ("prompt",), "union", "Input should be a string or a list of token ids", prompt
        )

    def chat_ids(self, body: Mapping[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise schema_error(("messages",), "missing", "Field required", messages)
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise schema_error(("messages", i, "role"), "missing", "Field required", None)
        gen = get(body, "add_generation_prompt", bool, True)
        cont = get(body, "continue_final_message", bool, False)
        if gen and cont:
            raise bad_request(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        kwargs = get(body, "chat_template_kwargs", dict, None)
        add_special = get(body, "add_special_tokens", bool, False)
        try:
            return self.tokenizer.encode_chat(messages, gen, cont, add_special, kwargs)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from None

    def prompt_ids(self, body: Mapping[str, Any]) -> list[int]:
        """Token ids of `token_ids`, `messages` or `prompt`, whichever the body has."""
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
        return self.completion_ids(body)

    def check_length(self, ids: Sequence[int]) -> None:
        if not ids:
            raise bad_request("The prompt cannot be empty.", "prompt")
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise bad_request(f"Token id {bad} is out of vocabulary", "prompt")
        if len(ids) >= self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt contains {len(ids)} input tokens, which exceeds this limit even "
                "without any output tokens. Please reduce the length of the input prompt.",
                "input_tokens",
            )

    def generate_request(self, body: Mapping[str, Any], chat: bool) -> GenerateRequest:
        keys = self.keys_for(body)
        _unsupported(body)
        ids = self.chat_ids(body) if chat else self.completion_ids(body)
        self.check_length(ids)
        room = self.max_model_len - len(ids)
        if chat:
            explicit = non_negative(body, "max_completion_tokens", None)
            if explicit is None:
                explicit = non_negative(body, "max_tokens", None)
        else:
            explicit = non_negative(body, "max_tokens", 16)
        if explicit == 0:
            raise bad_request("max_tokens must be at least 1, got 0.", "max_tokens")
        options = get(body, "stream_options", dict, None) or {}
        stream = get(body, "stream", bool, False)
        return GenerateRequest(
            model=get(body, "model", str, None) or self.model,
            prompt_ids=ids,
            keys=keys,
            max_tokens=min(room, explicit if explicit is not None else room),
            stream=stream,
            include_usage=stream and bool(options.get("include_usage")),
            continuous_usage=stream and bool(options.get("continuous_usage_stats")),
            stop=stop_list(body),
            stop_token_ids=tuple(get(body, "stop_token_ids", list, None) or ()),
            include_stop_str=get(body, "include_stop_str_in_output", bool, False),
            ignore_eos=get(body, "ignore_eos", bool, False),
            min_tokens=non_negative(body, "min_tokens", 0) or 0,
            return_token_ids=bool(get(body, "return_token_ids", bool, False)),
            body=body,
            kv_transfer_params=get(body, "kv_transfer_params", dict, None),
        )


def _is_token(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def _unsupported(body: Mapping[str, Any]) -> None:
    n = get(body, "n", int, 1)
    if n != 1:
        raise bad_request(f"n={n}: the simulator generates one choice per request (n=1)", "n")
    for name in ("best_of", "use_beam_search", "echo", "logprobs", "prompt_logprobs"):
        value = body.get(name)
        if value not in (None, False, 1 if name == "best_of" else None):
            raise bad_request(f"{name} is not supported by the simulator", name)
