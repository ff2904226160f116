"""vLLM 0.32 NixlConnector's wire formats, as the simulator speaks them.

- `kv_transfer_params` in HTTP bodies: what a prefill worker returns (`producer_params`,
  the exact keys of `NixlPullConnectorScheduler.request_finished`) and what a decode worker
  accepts (`RemoteParams.parse`, with vLLM's own outcomes for bad shapes).
- Side channel (ZMQ): the decode side's REQ sends msgpack `(b"get_meta_msg", pp_rank,
  tp_rank)`; the prefill side's ROUTER answers `[msgpack NixlHandshakePayload, msgpack
  perf_counter]`; the payload wraps msgpack `NixlAgentMetadata` behind a compatibility hash.
- NIXL notifications: `"{remote_request_id}:{consumers}"` when the decode side has read a
  request's blocks, `"HB:{id},{id}"` heartbeats that extend their lease.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

log = logging.getLogger("kvroute.sim.pd")

GET_META_MSG = b"get_meta_msg"
HEARTBEAT_PREFIX = "HB:"
HANDSHAKE_TIMEOUT_S = 5.0  # vLLM's RCVTIMEO on the handshake socket
_REQUIRED = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


class NixlAgentMetadata(msgspec.Struct):
    """vLLM's `NixlAgentMetadata` (encoded as a map, field for field)."""

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    block_strides: list[int]
    kv_cache_layout: str
    block_size: int
    ssm_sizes: tuple[int, int]
    attn_backend_name: str
    physical_blocks_per_logical_kv_block: int
    region_num_blocks: list[int] | None = None
    region_group_ids: list[int] | None = None
    region_names: list[str] | None = None
    region_mem_types: list[str] | None = None
    dcp_size: int = 1
    pcp_size: int = 1
    ple_block_len: int | None = None
    region_members: list[list[str]] = msgspec.field(default_factory=list)
    packed_member_layouts: dict[str, tuple[int, int]] = msgspec.field(default_factory=dict)


class NixlHandshakePayload(msgspec.Struct):
    compatibility_hash: str
    agent_metadata_bytes: bytes


class HandshakeError(RuntimeError):
    """The decode side could not get the prefill side's agent metadata."""


class MalformedParams(ValueError):
    """`kv_transfer_params` that real vLLM 0.32 does not survive (its engine crashes or the
    request never runs); the simulator answers 500 and says so in its log."""


def compatibility_hash(model: str, kv_bytes_per_token: int, block_size: int) -> str:
    """Both sides must agree on what a block holds (vLLM hashes model, dtype, layout...)."""
    factors = repr(("kvroute-sim", "0.32.0", model, kv_bytes_per_token, block_size, "pull"))
    return hashlib.sha256(factors.encode()).hexdigest()


# ---- kv_transfer_params ---------------------------------------------------------------------


def producer_params(
    *,
    block_ids: list[int],
    engine_id: str,
    request_id: str,
    host: str,
    port: int,
    num_tokens: int,
    cached_tokens: int,
) -> dict[str, Any]:
    """What a prefill worker returns for a finished `do_remote_decode` request."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [block_ids],  # one list per KV cache group
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": num_tokens,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": cached_tokens,
    }


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """A prefill leg: compute, keep the blocks for a decode worker, return params."""
    return bool(params and params.get("do_remote_decode"))


@dataclass(frozen=True)
class RemoteParams:
    """A decode leg's pull instructions, validated."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    num_tokens: int | None = None
    prefill_cached_tokens: int | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def parse(cls, params: Mapping[str, Any] | None) -> RemoteParams | None:
        """None when the request asks for no pull (vLLM recomputes silently); raises
        `MalformedParams` where real vLLM crashes or hangs."""
        if not params or not params.get("do_remote_prefill"):
            return None
        groups = params.get("remote_block_ids")
        if not groups:
            raise MalformedParams(
                "do_remote_prefill without remote_block_ids (vLLM 0.32: AssertionError "
                "`num_external_tokens == 0` in the scheduler; the engine exits)"
            )
        block_ids = _block_ids(groups)
        missing = [k for k in _REQUIRED if params.get(k) is None]
        if missing:
            raise MalformedParams(
                f"kv_transfer_params lack {', '.join(missing)} (vLLM 0.32 logs 'Got invalid "
                "KVTransferParams' and leaves the request waiting for KV that never comes)"
            )
        tp = params.get("tp_size", 1)
        if tp != 1:
            raise MalformedParams(f"tp_size={tp!r}: the simulator pulls from tp_size 1 only")
        return cls(
            engine_id=str(params["remote_engine_id"]),
            request_id=str(params["remote_request_id"]),
            host=str(params["remote_host"]),
            port=_int(params["remote_port"], "remote_port"),
            block_ids=block_ids,
            num_tokens=_opt_int(params.get("remote_num_tokens")),
            prefill_cached_tokens=_opt_int(params.get("remote_prefill_cached_tokens")),
            raw=dict(params),
        )

    @property
    def notification(self) -> bytes:
        """The message that tells the prefill side one consumer has read the blocks."""
        return f"{self.request_id}:1".encode()


def _block_ids(groups: object) -> tuple[int, ...]:
    """One KV cache group: `[[ids...]]`. vLLM indexes the groups without checking the
    shape, so a flat list or a second group crashes it."""
    if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
        raise MalformedParams(
            "remote_block_ids must be a list of lists, one per KV cache group, e.g. "
            "[[1, 2, 3]] (vLLM 0.32 crashes on a flat list: TypeError, the API server exits)"
        )
    if len(groups) != 1:
        raise MalformedParams(
            f"remote_block_ids has {len(groups)} groups, this model has 1 (vLLM 0.32: "
            "AssertionError in the NIXL worker, the engine exits)"
        )
    ids = groups[0]
    if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids):
        raise MalformedParams("remote_block_ids must hold non-negative block ids")
    return tuple(ids)


def _int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MalformedParams(f"{name}={value!r}: expected an integer")
    return value


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# ---- side channel ---------------------------------------------------------------------------


class SideChannel:
    """The prefill side's handshake listener: a ROUTER on host:port that hands out this
    worker's encoded `NixlHandshakePayload` (tp rank 0, pp rank 0) and its perf_counter."""

    def __init__(self, ctx: zmq.asyncio.Context, host: str, port: int, payload: bytes) -> None:
        self.payload = payload
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            self.sock.bind(f"tcp://{host}:*")
        endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(endpoint.rsplit(":", 1)[1])

    async def serve(self) -> None:
        while True:
            identity, _, msg = await self.sock.recv_multipart()
            try:
                kind, pp_rank, tp_rank = msgspec.msgpack.decode(msg)
            except (msgspec.DecodeError, ValueError, TypeError):
                log.warning("side channel: undecodable handshake query %r", msg[:64])
                continue
            if kind != GET_META_MSG or (pp_rank, tp_rank) != (0, 0):
                log.warning("side channel: unexpected query %r pp=%r tp=%r", kind, pp_rank, tp_rank)
            ts = msgspec.msgpack.encode(time.perf_counter())
            await self.sock.send_multipart((identity, b"", self.payload, ts))

    def close(self) -> None:
        self.sock.close(linger=0)


async def handshake(
    ctx: zmq.asyncio.Context,
    host: str,
    port: int,
    expected_engine_id: str,
    compat: str,
    timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> NixlAgentMetadata:
    """Ask a prefill worker's side channel for its agent metadata, checked as vLLM does."""
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        await sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
        if not await sock.poll(timeout=timeout_s * 1000):
            raise HandshakeError(f"no answer from side channel {host}:{port} in {timeout_s:g}s")
        parts = await sock.recv_multipart()
    finally:
        sock.close(linger=0)
    return _check_payload(parts, expected_engine_id, compat)


def _check_payload(parts: list[bytes], expected: str, compat: str) -> NixlAgentMetadata:
    if len(parts) != 2:
        raise HandshakeError(f"handshake reply has {len(parts)} frames, expected 2")
    try:
        payload = msgspec.msgpack.decode(parts[0], type=NixlHandshakePayload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise HandshakeError(f"Failed to decode NixlHandshakePayload: {exc}") from None
    if payload.compatibility_hash != compat:
        raise HandshakeError(
            "NIXL compatibility hash mismatch: prefill and decode workers differ in model, "
            "--kv-bytes-per-token or --block-size"
        )
    try:
        meta = msgspec.msgpack.decode(payload.agent_metadata_bytes, type=NixlAgentMetadata)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise HandshakeError(f"Failed to decode NixlAgentMetadata: {exc}") from None
    if meta.engine_id != expected:
        raise HandshakeError(
            f"Remote NIXL agent engine ID mismatch. Expected {expected}, received {meta.engine_id}."
        )
    return meta
