"""vLLM's NixlConnector protocol as the router speaks it (DESIGN.md section 4). Pure.

Prefill leg: the client's request with `stream=false`, one token (`max_tokens=1`, and
`max_completion_tokens=1` where the API has it), no `stream_options`, no `min_tokens`, and
`kv_transfer_params` asking for a remote decode. Decode leg: the client's request byte for
byte, plus the `kv_transfer_params` the prefill worker returned, unchanged. The params are
checked for shape first: real vLLM 0.32 crashes outright (the API server exits) on a flat
`remote_block_ids` or too few block ids, so a malformed answer is never forwarded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeGuard

import msgspec

from engines.vllm.lax import NotABool, NotAnInt, lax_bool, lax_int
from router.openai_req import BOM, asked_tokens

_decoder = msgspec.json.Decoder()
_encode = msgspec.json.encode

# what the prefill leg asks for: vLLM's own proxy sends exactly these keys
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_REQUIRED_TEXT = ("remote_engine_id", "remote_request_id", "remote_host")


def request_doc(body: bytes) -> dict[str, Any]:
    """The client's JSON object (the door parsed it once already: it is valid)."""
    doc = _decoder.decode(body[3:] if body.startswith(BOM) else body)
    assert isinstance(doc, dict)
    return doc


def not_splittable(doc: dict[str, Any], chat: bool = False) -> str | None:
    """Why the engine cannot hand this request off (None: it can). A prefill leg computes
    one token; whatever needs the prompt's own outputs or several sequences stays local.
    `chat`: a chat completion (its own output-length fields)."""
    if _int(doc.get("n"), 1) > 1:  # vLLM 0.32 has no best_of: it ignores one sent
        return "several sequences (n > 1)"
    if _set(doc.get("use_beam_search")):
        return "beam search"
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return "a batch of prompts"
    if _set(doc.get("echo")):
        return "echo returns the prompt's own outputs"
    if doc.get("prompt_logprobs") is not None:
        return "prompt_logprobs are computed by the prefill"
    # the prefill leg drops these, so the prefill worker would take a request the engine
    # refuses: left to the decode worker, its 400 costs no prefill and no KV held for a pull
    if doc.get("stream_options") is not None and not _set(doc.get("stream")):
        return "stream_options without stream (the engine refuses it)"
    least = _int(doc.get("min_tokens"), -1) if doc.get("min_tokens") is not None else 0
    most = asked_tokens(doc, chat)
    if most is None and not chat:
        most = 16  # vLLM's default for a completion (normalize_null_max_tokens)
    if least < 0 or (most is not None and least > most):
        return "min_tokens outside 0..max_tokens (the engine refuses it)"
    if most is not None and most < 1:  # the prefill leg would ask for 1
        return "max_tokens below 1 (the engine refuses it)"
    return None


def prefill_body(doc: Mapping[str, Any], chat: bool) -> bytes:
    """The prefill leg's body."""
    out = {k: v for k, v in doc.items() if k not in ("stream_options", "min_tokens")}
    out["stream"] = False
    out["max_tokens"] = 1
    if chat or "max_completion_tokens" in doc:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return _encode(out)


def decode_body(body: bytes, params: Mapping[str, Any]) -> bytes:
    """The client's body, untouched, with `kv_transfer_params` as its first member (the
    door refuses bodies that carry their own)."""
    head, brace, rest = body.partition(b"{")
    member = b'"kv_transfer_params":' + _encode(params)
    joint = b"" if rest.lstrip().startswith(b"}") else b","
    return head + brace + member + joint + rest


def params_problem(params: Any, prompt_tokens: int, block_size: int) -> str | None:
    """What is wrong with a prefill worker's `kv_transfer_params` (None: safe to forward)."""
    if not isinstance(params, dict):
        return "the prefill answer has no kv_transfer_params"
    if params.get("do_remote_prefill") is not True:
        return "kv_transfer_params.do_remote_prefill is not true"
    for key in _REQUIRED_TEXT:
        if not isinstance(params.get(key), str) or not params[key]:
            return f"kv_transfer_params.{key} is missing"
    port = params.get("remote_port")
    if not _is_int(port) or not 0 < port < 65536:
        return f"kv_transfer_params.remote_port {port!r} is not a port"
    tokens = params.get("remote_num_tokens")
    needed = -(-(tokens if _is_int(tokens) and tokens > 0 else prompt_tokens) // block_size)
    return _blocks_problem(params.get("remote_block_ids"), needed)


def _blocks_problem(groups: Any, needed: int) -> str | None:
    """One list of block ids per KV cache group; the first covers the whole prompt."""
    if not isinstance(groups, list) or not groups or not all(isinstance(g, list) for g in groups):
        return "kv_transfer_params.remote_block_ids is not a list of lists (vLLM would crash)"
    for g in groups:
        if not g or not all(_is_int(b) and b >= 0 for b in g):
            return "kv_transfer_params.remote_block_ids holds something not a block id"
    if len(groups[0]) < needed:
        return (
            f"kv_transfer_params.remote_block_ids has {len(groups[0])} blocks, the prompt needs "
            f"{needed} (vLLM would crash)"
        )
    return None


def response_params(body: bytes) -> tuple[Any, int | None]:
    """A prefill answer's `kv_transfer_params` and its cached prompt tokens."""
    try:
        doc = _decoder.decode(body)
    except msgspec.DecodeError:
        return None, None
    if not isinstance(doc, dict):
        return None, None
    usage = doc.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return doc.get("kv_transfer_params"), cached if _is_int(cached) else None


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _set(value: Any) -> bool:
    """A request's boolean field as the engine reads it ("false" is false); unset is false."""
    try:
        return value is not None and lax_bool(value)
    except NotABool:
        return bool(value)  # the engine refuses it: nothing to split


def _int(value: Any, default: int) -> int:
    """A request's integer field as the engine reads it ("2" is 2); `default` if unset or
    no integer (the door answered those already)."""
    if value is None:
        return default
    try:
        return lax_int(value)
    except NotAnInt:
        return default
