"""Prefill -> decode (P/D) settings of one simulated worker, in vLLM's own terms.

vLLM enables the handoff with `--kv-transfer-config JSON` (`kv_connector` NixlConnector,
`kv_role` kv_producer|kv_consumer|kv_both, `engine_id`, `kv_buffer_device`,
`kv_load_failure_policy` fail|recompute, `kv_connector_extra_config.kv_lease_duration`) and
the side channel's address from VLLM_NIXL_SIDE_CHANNEL_HOST / VLLM_NIXL_SIDE_CHANNEL_PORT.
The simulator reads the same flag and variables, so a vLLM command line works unchanged, plus
its own knobs: bytes of KV per token (sizes the blocks that really move) and an emulated link.

As in vLLM's pull connector, the role is advisory: any worker with a connector serves both
legs (a prefill leg whose params say `do_remote_decode`, a decode leg whose params say
`do_remote_prefill`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ROLES = {"producer": "kv_producer", "consumer": "kv_consumer", "both": "kv_both"}
CONNECTORS = ("NixlConnector", "NixlPullConnector")
POLICIES = ("fail", "recompute")
DEFAULT_KV_BYTES_PER_TOKEN = 2048  # the tiny float32 Llama of the conformance suite
DEFAULT_LEASE_S = 30.0  # vLLM's kv_lease_duration
HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"


class PDConfigError(ValueError):
    """A P/D setting the simulator cannot run with (the message names the flag and the fix)."""


@dataclass(frozen=True)
class KVTransferConfig:
    role: str = "kv_both"
    engine_id: str = ""  # "" -> a fresh uuid at start, as vLLM does
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0  # 0: a free port (vLLM's default is 5600)
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    link_mb_s: float | None = None  # None: as fast as NIXL moves it
    lease_s: float = DEFAULT_LEASE_S
    load_failure_policy: str = "fail"
    connector: str = "NixlConnector"

    def replace(self, **changes: Any) -> KVTransferConfig:
        return dataclasses.replace(self, **changes)

    def validate(self) -> KVTransferConfig:
        if self.connector not in CONNECTORS:
            raise PDConfigError(
                f"kv_connector={self.connector!r}: the simulator speaks {' / '.join(CONNECTORS)}"
            )
        if self.role not in ROLES.values():
            raise PDConfigError(f"kv_role={self.role!r}: use one of {', '.join(ROLES.values())}")
        if self.load_failure_policy not in POLICIES:
            raise PDConfigError(
                f"kv_load_failure_policy={self.load_failure_policy!r}: use fail or recompute"
            )
        if self.side_channel_host not in ("127.0.0.1", "localhost"):
            raise PDConfigError(
                f"{HOST_ENV}={self.side_channel_host!r}: the simulator binds 127.0.0.1 only"
            )
        if not 0 <= self.side_channel_port < 65536:
            raise PDConfigError(f"{PORT_ENV}={self.side_channel_port}: use 1..65535 or 0")
        if self.kv_bytes_per_token < 1:
            raise PDConfigError(f"--kv-bytes-per-token={self.kv_bytes_per_token}: must be >= 1")
        if self.link_mb_s is not None and self.link_mb_s <= 0:
            raise PDConfigError(f"--link-mb-s={self.link_mb_s}: must be > 0 (or leave it unset)")
        if self.lease_s <= 0:
            raise PDConfigError(f"kv_lease_duration={self.lease_s}: must be > 0 seconds")
        return self

    def block_bytes(self, block_size: int) -> int:
        return self.kv_bytes_per_token * block_size


def from_vllm_json(
    text: str, env: Mapping[str, str] | None = None, base: KVTransferConfig | None = None
) -> KVTransferConfig:
    """vLLM's `--kv-transfer-config` JSON (and side-channel variables) as a config."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise PDConfigError(f"--kv-transfer-config: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise PDConfigError("--kv-transfer-config: expected a JSON object")
    extra = doc.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise PDConfigError("--kv-transfer-config: kv_connector_extra_config must be an object")
    c = with_env(base or KVTransferConfig(), env)
    return c.replace(
        connector=str(doc.get("kv_connector") or c.connector),
        role=str(doc.get("kv_role") or c.role),
        engine_id=str(doc.get("engine_id") or c.engine_id),
        load_failure_policy=str(doc.get("kv_load_failure_policy") or c.load_failure_policy),
        lease_s=float(extra.get("kv_lease_duration", c.lease_s)),
    )


def with_env(c: KVTransferConfig, env: Mapping[str, str] | None = None) -> KVTransferConfig:
    env = os.environ if env is None else env
    port = env.get(PORT_ENV)
    try:
        return c.replace(
            side_channel_host=env.get(HOST_ENV) or c.side_channel_host,
            side_channel_port=int(port) if port else c.side_channel_port,
        )
    except ValueError:
        raise PDConfigError(f"{PORT_ENV}={port!r}: not a port number") from None


def add_pd_args(p: argparse.ArgumentParser) -> None:
    """`kvroute sim` flags for the prefill -> decode handoff."""
    g = p.add_argument_group(
        "prefill -> decode handoff (vLLM NixlConnector, real NIXL transfers)",
        "Side channel: VLLM_NIXL_SIDE_CHANNEL_HOST / VLLM_NIXL_SIDE_CHANNEL_PORT, as vLLM "
        "(default here 127.0.0.1 and a free port). Needs NIXL: bash conformance/install_nixl.sh",
    )
    g.add_argument(
        "--kv-transfer-config",
        default=None,
        metavar="JSON",
        help='vLLM\'s flag, e.g. \'{"kv_connector":"NixlConnector","kv_role":"kv_producer"}\'',
    )
    g.add_argument(
        "--kv-role",
        choices=sorted(ROLES),
        default=None,
        help="shorthand for a NixlConnector config with kv_role kv_ROLE",
    )
    g.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=None,
        help=f"KV bytes per token; a block moves block_size x this (default "
        f"{DEFAULT_KV_BYTES_PER_TOKEN})",
    )
    g.add_argument(
        "--link-mb-s",
        type=float,
        default=None,
        help="emulate a slower link (MB = 1e6 bytes): after the real NIXL READ the decode "
        "worker sleeps for the time the bytes would still need at this rate, so transfer "
        "time, nixl_xfer_time and TTFT are as on that link (default: unthrottled)",
    )
    g.add_argument(
        "--kv-load-failure-policy",
        choices=POLICIES,
        default=None,
        help="failed pull: fail the request (vLLM's default) or recompute it locally",
    )
    g.add_argument(
        "--kv-lease-s",
        type=float,
        default=None,
        help=f"how long a prefill worker holds unread blocks (default {DEFAULT_LEASE_S:g})",
    )


def kv_transfer_from_args(
    args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> KVTransferConfig | None:
    """The handoff config the flags ask for; None when no connector is configured."""
    text, role = getattr(args, "kv_transfer_config", None), getattr(args, "kv_role", None)
    if text is None and role is None:
        return None
    c = from_vllm_json(text, env) if text is not None else with_env(KVTransferConfig(), env)
    if role is not None:
        c = c.replace(role=ROLES[role])
    over: dict[str, Any] = {
        "kv_bytes_per_token": args.kv_bytes_per_token,
        "link_mb_s": args.link_mb_s,
        "load_failure_policy": args.kv_load_failure_policy,
        "lease_s": args.kv_lease_s,
    }
    return c.replace(**{k: v for k, v in over.items() if v is not None}).validate()


def nixl_available() -> str | None:
    """None when NIXL imports; otherwise what to run to install it."""
    try:
        importlib.import_module("nixl._api")
    except ImportError as exc:
        return (
            f"NIXL is not installed ({exc}); run: bash conformance/install_nixl.sh "
            "[VENV] (it installs nixl nixl-cu12 with --no-deps)"
        )
    return None
