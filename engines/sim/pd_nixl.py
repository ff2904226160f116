"""A simulated worker's KV blocks in DRAM, registered with a real NIXL agent (UCX backend).

One contiguous buffer of `num_blocks * block_bytes`, block i at offset i * block_bytes, as
vLLM lays out one KV region on the CPU. Every block starts with a 32-byte tag chained over
the tokens it holds (`block_tags`), written by the prefill side when it hands a request's
blocks out, so the decode side can check that the bytes it read are the ones it needed.

All NIXL calls stay on the event loop's thread: the agent runs without a listener thread,
so NIXL does no locking of its own (NIXL_THREAD_SYNC_NONE).
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engines.sim.nixl_site import sitecustomize as nixl_site
from engines.sim.pd_wire import NixlAgentMetadata

TAG_BYTES = 32
INIT_AGENT = "NIXL_INIT_AGENT"


def block_tags(tokens: Sequence[int], block_size: int, n_blocks: int) -> list[bytes]:
    """Tag of block i = sha256(tag of block i-1 + its tokens as uint32), the last block
    possibly partial. Pure; the decode side recomputes them from its own prompt."""
    arr = np.asarray(tokens, dtype=np.uint32)
    out: list[bytes] = []
    prev = b""
    for i in range(n_blocks):
        prev = hashlib.sha256(prev + arr[i * block_size : (i + 1) * block_size].tobytes()).digest()
        out.append(prev)
    return out


def _nixl_logs_to_stderr() -> None:
    """NIXL logs to stdout, where `kvroute sim` prints its one line of JSON."""
    for handler in logging.getLogger("nixl").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


@dataclass(frozen=True)
class RemoteAgent:
    engine_id: str
    name: Any  # NIXL returns the agent name as bytes
    blocks: Any  # prepped descriptor list over the remote's blocks
    num_blocks: int


class NixlKV:
    def __init__(self, name: str, num_blocks: int, block_bytes: int) -> None:
        nixl_site.install()  # a non-zero progress-thread delay before the agent exists
        api = importlib.import_module("nixl._api")  # untyped; optional until P/D is used
        _nixl_logs_to_stderr()

        self.name = name
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
        # Touch every page now, as vLLM's zeroed KV tensors are: an untouched page costs a
        # page fault on both sides of its first transfer (5x slower pulls, measured here).
        self.buf = np.empty(num_blocks * block_bytes, dtype=np.uint8)
        self.buf.fill(0)
        self.base = int(self.buf.ctypes.data)
        self._reg = self.agent.register_memory([(self.base, self.buf.nbytes, 0, "")], "DRAM")
        descs = self._descs(self.base, num_blocks)
        self.local = self.agent.prep_xfer_dlist(INIT_AGENT, descs, "DRAM")

    def _descs(self, base: int, n: int) -> list[tuple[int, int, int]]:
        return [(base + i * self.block_bytes, self.block_bytes, 0) for i in range(n)]

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def add_remote(self, meta: NixlAgentMetadata) -> RemoteAgent:
        name = self.agent.add_remote_agent(meta.agent_metadata)
        base = meta.kv_caches_base_addr[0]
        blocks = self.agent.prep_xfer_dlist(name, self._descs(base, meta.num_blocks), "DRAM")
        return RemoteAgent(meta.engine_id, name, blocks, meta.num_blocks)

    def remove_remote(self, remote: RemoteAgent) -> None:
        self.agent.release_dlist_handle(remote.blocks)
        self.agent.remove_remote_agent(remote.name)

    def post_read(
        self, remote: RemoteAgent, local_ids: Sequence[int], remote_ids: Sequence[int]
    ) -> Any:
        """Start a READ of `remote_ids` into `local_ids`; returns the transfer handle."""
        bad = [b for b in remote_ids if b >= remote.num_blocks]
        if bad:
            raise IndexError(f"remote block ids {bad[:5]} >= the remote's {remote.num_blocks}")
        handle = self.agent.make_prepped_xfer(
            "READ", self.local, list(local_ids), remote.blocks, list(remote_ids)
        )
        if self.agent.transfer(handle) == "ERR":
            self.agent.release_xfer_handle(handle)
            raise RuntimeError("NIXL refused to post the READ")
        return handle

    def state(self, handle: Any) -> str:
        """ "DONE", "PROC" or "ERR"."""
        return str(self.agent.check_xfer_state(handle))

    def release(self, handle: Any) -> None:
        self.agent.release_xfer_handle(handle)

    def notifications(self) -> list[bytes]:
        return [m for msgs in self.agent.get_new_notifs().values() for m in msgs]

    def notify(self, remote: RemoteAgent, message: bytes) -> None:
        self.agent.send_notif(remote.name, message)

    def write_tags(self, block_ids: Sequence[int], tags: Sequence[bytes]) -> None:
        for block_id, tag in zip(block_ids, tags, strict=True):
            at = block_id * self.block_bytes
            self.buf[at : at + TAG_BYTES] = np.frombuffer(tag, dtype=np.uint8)

    def tags(self, block_ids: Sequence[int]) -> list[bytes]:
        out = []
        for block_id in block_ids:
            at = block_id * self.block_bytes
            out.append(self.buf[at : at + TAG_BYTES].tobytes())
        return out

    def agent_metadata(self, engine_id: str, block_size: int) -> NixlAgentMetadata:
        """What the side channel hands out, in vLLM's `NixlAgentMetadata` shape."""
        return NixlAgentMetadata(
            engine_id=engine_id,
            agent_metadata=self.metadata(),
            kv_caches_base_addr=[self.base],
            device_id=0,
            num_blocks=self.num_blocks,
            block_lens=[self.block_bytes],
            block_strides=[self.block_bytes],
            kv_cache_layout="NHD",
            block_size=block_size,
            ssm_sizes=(0, 0),
            attn_backend_name="SIM",
            physical_blocks_per_logical_kv_block=1,
        )

    def close(self) -> None:
        self.agent.release_dlist_handle(self.local)
        self.agent.deregister_memory(self._reg)
