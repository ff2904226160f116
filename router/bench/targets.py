"""The routers the routing bench compares, each started in front of one simulated fleet.

A target is a context manager factory: given the fleet's workers (as `kvroute fleet`
describes them) and the run's seed, it starts the router(s) and yields the URLs a client
should alternate over (two for `kvroute-replicas`), and stops them on exit.

  kvroute                    kvroute serve, KV events from every worker (the default mode)
  kvroute-approx             kvroute serve in front of workers that publish no events
                             (the fleet starts with --no-events-on every worker)
  round_robin, random        kvroute serve --policy round_robin / random
  sglang-router-cache_aware  sglang-router launch --policy cache_aware
  vllm-router-cache_aware    vllm-router --policy cache_aware
  vllm-router-kv_aware       vllm-router --policy kv_aware, subscribed to the workers' ZMQ
                             events (--kv-event-source / --kv-event-replay-source)
  oracle                     no router: each request goes straight to the worker the ideal
                             places its group on (router.bench.ideal), measured
  kvroute-replicas           two kvroute serve processes, each consuming every worker's
                             events and sharing placements (--peer-publish, --peer); the
                             client alternates between them per request
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conformance.procs import free_ports
from router.bench import peers
from router.procs import RouterProcess, free_port
from router.tokenize import PACKAGED_TOKENIZER


class Urls(list[str]):
    """The URLs a client alternates over, and the router logs behind them (kvroute's)."""

    logs: list[Path]

    def ejections(self) -> int:
        """Workers kvroute ejected on failed health checks during the run: on a loaded
        machine a false ejection also clears that worker's index when it comes back."""
        logs = getattr(self, "logs", [])
        return sum(p.read_text(errors="replace").count(" ejected: ") for p in logs)


Launch = Callable[[list[dict[str, Any]], int], AbstractContextManager[list[str]]]
MODEL = "kvroute-sim"


@dataclass(frozen=True)
class Target:
    launch: Launch
    events: bool = True  # the fleet publishes KV events
    peer: str | None = None  # the peer binary it needs, if any
    oracle: bool = False  # no router: the driver sends each request to its ideal worker


def _urls(workers: list[dict[str, Any]]) -> list[str]:
    return [str(w["url"]) for w in workers]


def _kvroute(policy: str = "kv", replicas: int = 1, extra: Sequence[str] = ()) -> Launch:
    @contextlib.contextmanager
    def launch(workers: list[dict[str, Any]], seed: int) -> Iterator[list[str]]:
        with contextlib.ExitStack() as stack:
            urls = Urls()
            urls.logs = []
            links = [f"tcp://127.0.0.1:{port}" for port in free_ports(replicas)]
            for i in range(replicas):
                args = ["--seed", str(seed), *extra]
                if replicas > 1:  # replicas share their placements (router/peers.py)
                    args += ["--peer-publish", links[i]]
                    args += [a for j, link in enumerate(links) if j != i for a in ("--peer", link)]
                router = RouterProcess(
                    _urls(workers), policy=policy, tokenizer=PACKAGED_TOKENIZER, extra=args
                )
                stack.enter_context(router)
                urls.append(router.url)
                urls.logs.append(router.log_path)
            yield urls

    return launch


def _peer(binary_name: str, policy: str, kv_events: bool = False) -> Launch:
    @contextlib.contextmanager
    def launch(workers: list[dict[str, Any]], seed: int) -> Iterator[list[str]]:
        binary = peers.peer_bin(binary_name)
        if binary is None:
            raise RuntimeError(f"{binary_name} is not installed")
        port = free_port()
        if binary_name == "sglang-router":
            cmd = peers.sglang_command(binary, port, _urls(workers), policy)
        else:
            extra = _kv_event_flags(workers) if kv_events else []
            cmd = peers.vllm_router_command(binary, port, _urls(workers), policy, extra)
        with peers.child(cmd, f"http://127.0.0.1:{port}", "/readiness") as peer:
            url = peer.url
            yield [url]

    return launch


def _kv_event_flags(workers: list[dict[str, Any]]) -> list[str]:
    """vllm-router's static event sources: one PUB (and replay) endpoint per worker URL."""
    out = ["--kv-event-block-size", str(workers[0]["block_size"]), "--kv-event-model", MODEL]
    for w in workers:
        out += ["--kv-event-source", f"{w['url']}={w['events_endpoint']}"]
        if w.get("replay_endpoint"):
            out += ["--kv-event-replay-source", f"{w['url']}={w['replay_endpoint']}"]
    return out


TARGETS: dict[str, Target] = {
    "kvroute": Target(_kvroute()),
    "kvroute-approx": Target(_kvroute(), events=False),
    "round_robin": Target(_kvroute("round_robin")),
    "random": Target(_kvroute("random")),
    "sglang-router-cache_aware": Target(
        _peer("sglang-router", "cache_aware"), peer="sglang-router"
    ),
    "vllm-router-cache_aware": Target(_peer("vllm-router", "cache_aware"), peer="vllm-router"),
    "vllm-router-kv_aware": Target(
        _peer("vllm-router", "kv_aware", kv_events=True), peer="vllm-router"
    ),
}


# one line each for `kvroute bench routing --help` (the module docstring says more)
SUMMARIES = {
    "kvroute": "kvroute serve, KV events from every worker (the default mode)",
    "kvroute-approx": "kvroute serve, workers publish no events (approximate mode)",
    "round_robin": "kvroute serve --policy round_robin: the baseline",
    "random": "kvroute serve --policy random",
    "sglang-router-cache_aware": "sglang-router launch --policy cache_aware (peer, from PyPI)",
    "vllm-router-cache_aware": "vllm-router --policy cache_aware (peer, from PyPI)",
    "vllm-router-kv_aware": "vllm-router --policy kv_aware on the workers' ZMQ KV events",
    "oracle": "no router: each request straight to the ideal's worker",
}


def replicas_target(config: Path | None = None) -> Target:
    """Two kvroute replicas (the client alternates), with the same config as `kvroute`."""
    return Target(_kvroute(replicas=2, extra=["--config", str(config)] if config else []))


@contextlib.contextmanager
def _direct(workers: list[dict[str, Any]], seed: int) -> Iterator[list[str]]:
    yield _urls(workers)


# Not a router: the ideal's placement measured on the same engines (perfect affinity).
ORACLE = Target(_direct, oracle=True)
TARGETS["oracle"] = ORACLE


def with_config(config: Path | None) -> dict[str, Target]:
    """The targets, kvroute's own started with `--config FILE` (scoring experiments)."""
    if config is None:
        return TARGETS
    extra = ["--config", str(config)]
    out = dict(TARGETS)
    out["kvroute"] = Target(_kvroute(extra=extra))
    out["kvroute-approx"] = Target(_kvroute(extra=extra), events=False)
    return out
