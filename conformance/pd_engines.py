"""Two engines that hand KV over with vLLM's NixlConnector, for `conformance.pd_harness` and
the `pd` conformance check: real vLLM 0.32 CPU engines (`vllm_pair`) or simulated workers
(`sim_pair`). Both bind loopback only and stop on every exit path.

Real vLLM on a small CPU host needs (DESIGN.md section 4): float32 on both engines (bfloat16
dies with SIGILL on AMX CPUs at the first pull), distinct side-channel ports, a core each
(VLLM_CPU_OMP_THREADS_BIND) and a re-pin after start (NIXL moves its worker to the last
core), and the progress-thread delay patched through a `sitecustomize` on PYTHONPATH.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from conformance.procs import free_ports, group_members
from conformance.sim_server import SimServer
from conformance.targets import DEFAULT_MODEL_DIR
from conformance.vllm_server import VllmServer, ensure_model

NIXL_SITE = Path(__file__).resolve().parent.parent / "engines" / "sim" / "nixl_site"
PD_BLOCKS = 256  # KV blocks per engine: 8,160 tokens at block size 32


class Server(Protocol):
    model: str

    @property
    def url(self) -> str: ...
    @property
    def log_path(self) -> Path: ...
    @property
    def replay_endpoint(self) -> str: ...
    def stop(self) -> None: ...


@dataclass
class PDPair:
    """A prefill engine and a decode engine that can hand KV over."""

    target: str
    prefill: Server
    decode: Server
    gap_s: float  # idle time before a timed request (a vLLM worker spins 1 s after a step)
    notes: list[str] = field(default_factory=list)

    @property
    def model(self) -> str:
        return self.prefill.model


def vllm_pd_server(
    model_dir: Path, role: str, core: str, side_port: int, log_dir: Path | None
) -> VllmServer:
    """A vLLM engine with NixlConnector, float32, on its own core and side-channel port."""
    kv = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
    env = {
        "PYTHONPATH": str(NIXL_SITE),  # the progress-thread delay (sitecustomize)
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
        "VLLM_CPU_OMP_THREADS_BIND": core,
    }
    return VllmServer(
        model_dir,
        num_gpu_blocks=PD_BLOCKS,
        extra_args=["--kv-transfer-config", json.dumps(kv), "--dtype", "float32"],
        env=env,
        log_dir=log_dir / role if log_dir else None,
    )


def repin(server: VllmServer, core: str) -> int:
    """Put every thread of the engine back on its core (NIXL's worker moved itself to the
    last one); returns how many processes were re-pinned."""
    pids = group_members(server.pid)
    for pid in pids:
        subprocess.run(
            ["taskset", "-a", "-p", "-c", core, str(pid)],
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    return len(pids)


@contextlib.contextmanager
def vllm_pair(
    model_dir: Path = DEFAULT_MODEL_DIR,
    log_dir: Path | None = None,
    cores: tuple[str, str] = ("0", "1"),
) -> Iterator[PDPair]:
    model_dir = ensure_model(model_dir)
    p_port, d_port = free_ports(2)
    prefill = vllm_pd_server(model_dir, "kv_producer", cores[0], p_port, log_dir)
    decode = vllm_pd_server(model_dir, "kv_consumer", cores[1], d_port, log_dir)
    try:
        prefill.start()
        decode.start()
        notes = [
            f"startup {prefill.startup_s:.0f} s / {decode.startup_s:.0f} s",
            f"re-pinned {repin(prefill, cores[0])} prefill and "
            f"{repin(decode, cores[1])} decode processes",
        ]
        yield PDPair("vllm", prefill, decode, gap_s=1.1, notes=notes)
    finally:
        decode.stop()
        prefill.stop()


@contextlib.contextmanager
def sim_pair(kv_bytes_per_token: int = 2048, link_mb_s: float | None = None) -> Iterator[PDPair]:
    """Simulated workers; `link_mb_s` throttles the decode side's pulls."""
    common = ["--kv-bytes-per-token", str(kv_bytes_per_token)]
    link = ["--link-mb-s", str(link_mb_s)] if link_mb_s else []
    prefill = SimServer(num_gpu_blocks=PD_BLOCKS, extra_args=["--kv-role", "producer", *common])
    decode = SimServer(
        num_gpu_blocks=PD_BLOCKS, extra_args=["--kv-role", "consumer", *common, *link]
    )
    try:
        prefill.start()
        decode.start()
        yield PDPair("sim", prefill, decode, gap_s=0.0)
    finally:
        decode.stop()
        prefill.stop()


def pd_pair(
    target: str, model_dir: Path = DEFAULT_MODEL_DIR, link_mb_s: float | None = None
) -> contextlib.AbstractContextManager[PDPair]:
    """A started pair of the target's engines (`link_mb_s`: the sim's emulated link)."""
    if target == "vllm":
        return vllm_pair(model_dir)
    if target == "sim":
        return sim_pair(link_mb_s=link_mb_s)
    raise ValueError(f"unknown target {target!r}: use vllm or sim")
