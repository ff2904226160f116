"""The HTTP side of the simulated handoff: which decode legs pull, and the errors real vLLM
0.32 answers (or dies of) instead."""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING

from engines.sim.errors import ApiError
from engines.sim.pd_pull import CRASH_NOTE
from engines.sim.pd_wire import MalformedParams, RemoteParams
from engines.sim.protocol import GenerateRequest

if TYPE_CHECKING:
    from engines.sim.worker import SimWorker

log = logging.getLogger("kvroute.sim.pd")


def internal_error(message: str = "Internal server error") -> ApiError:
    """vLLM's GenerationError: 500, type InternalServerError."""
    return ApiError(message, "InternalServerError", 500)


def decode_leg(w: SimWorker, gen: GenerateRequest) -> RemoteParams | None:
    """The pull a request's `kv_transfer_params` ask for; None when there is none (no
    connector, no params, or no `do_remote_prefill`: vLLM then computes the prompt here,
    silently). Raises a 500 for params real vLLM crashes on."""
    if w.connector is None:
        return None
    try:
        remote = RemoteParams.parse(gen.kv_transfer_params)
    except MalformedParams as exc:
        log.error("%s; %s", exc, CRASH_NOTE)
        raise internal_error(f"{exc}; {CRASH_NOTE}") from None
    if remote is None:
        return None
    bs = w.config.block_size
    n = len(gen.prompt_ids)
    cached = min(w.engine.cached_tokens(gen.prompt_ids, gen.keys), ((n - 1) // bs) * bs)
    missing = w.connector.missing_blocks(remote, n, cached)
    if missing:
        message = f"remote_block_ids is {missing} block(s) short of this prompt; {CRASH_NOTE}"
        log.error("%s", message)
        raise internal_error(message)
    return remote


def engine_request_id(rid: str, chat: bool, prompt: int = 0) -> str:
    """vLLM's internal request id (what `remote_request_id` carries): the response id, the
    prompt index for completions, and a random 8-hex suffix."""
    suffix = uuid.uuid4().hex[:8]
    return f"{rid}-{suffix}" if chat else f"{rid}-{prompt}-{suffix}"
