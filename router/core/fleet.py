"""Fleet state: what every routing profile reads and the doors' commits update: the prefix
index (exact, from KV events), the short-lived predictions, the approximate (TTL) index, the
in-flight load, and per-endpoint facts (mode, block size, capacity, health, served models).

An endpoint is one place a request can be sent: a worker, or one data-parallel rank of a
worker (vLLM routes to a rank by the `X-data-parallel-rank` header). The index, load and
predictions are kept per endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from indexer.clock import Clock
from indexer.demand import DecayingCount
from indexer.health import HealthTracker
from indexer.index import PrefixIndex
from indexer.ttl import TtlIndex
from router.core.load import LoadTracker

EVENTS = "events"
APPROX = "approx"


@dataclass
class WorkerState:
    """What routing knows about one endpoint; the worker pool keeps it current."""

    name: str  # unique: the worker's host:port, plus "#dpN" for a data-parallel rank
    mode: str  # effective mode now: "events" or "approx"
    block_size: int
    capacity_blocks: int | None = None
    available: bool = True  # false while ejected by health checks
    draining: bool = False  # an operator took it out of rotation; in-flight requests finish
    caching: bool = True  # the engine's prefix caching (vllm:cache_config_info)
    health: HealthTracker | None = None
    worker: str = ""  # the worker this endpoint belongs to (its name when there is no DP)
    rank: int | None = None  # data-parallel rank to ask for; None: let the engine choose
    address: str = ""  # host:port the worker listens on (gateways dial this)
    models: frozenset[str] | None = None  # served names (base + adapters); None: not known yet
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapter -> its base model
    role: str = "both"  # prefill | decode | both
    max_model_len: int | None = None  # the base model's context length (its /v1/models card)
    demand: DecayingCount | None = None  # blocks stored lately, from its KV events
    # blocks of the new prefixes routers sent it lately (decayed like demand), each counted
    # once at its first prompt: this replica's own at the send, its peers' as their
    # placements arrive (router/peers.py)
    new_blocks: DecayingCount | None = None
    # blocks its KV events stored again soon after evicting them, decayed like demand
    refetched: DecayingCount | None = None

    def __post_init__(self) -> None:
        self.worker = self.worker or self.name
        self.address = self.address or self.worker


class FleetState:
    """Shared by every profile and every door."""

    def __init__(
        self,
        clock: Clock,
        *,
        prediction_ttl_s: float = 5.0,
        approx_ttl_s: float = 120.0,
        max_index_entries: int = 4_000_000,
    ) -> None:
        self.clock = clock
        self.index = PrefixIndex(max_entries=max_index_entries)
        self.predictions = TtlIndex(clock, prediction_ttl_s)
        # what was routed to each approx-mode endpoint within approx_ttl_s: its cache guess,
        # and its recent demand on its cache (the placement scorer)
        self.approx = TtlIndex(clock, approx_ttl_s, max_entries=max_index_entries)
        self.load = LoadTracker(clock=clock)
        self.workers: dict[str, WorkerState] = {}
        # `kvroute serve --lora-resolver BASE`: a model name no endpoint lists is a LoRA
        # adapter of BASE, which every endpoint serving BASE loads at its first request
        # (vLLM's LoRA resolver plugins); None: such a name is unknown (a 404)
        self.lora_resolver: str | None = None

    def add(self, state: WorkerState, model: str = "") -> None:
        if state.demand is None:
            state.demand = DecayingCount(self.clock)
        if state.new_blocks is None:
            state.new_blocks = DecayingCount(self.clock)
        if state.refetched is None:
            state.refetched = DecayingCount(self.clock)
        self.workers[state.name] = state
        self.index.add_worker(state.name, model=model)

    def remove(self, name: str) -> None:
        self.forget_cache(name)
        self.workers.pop(name, None)
        self.index.remove_worker(name)
        self.predictions.remove_worker(name)
        self.approx.remove_worker(name)
        self.load.forget(name)

    def set_capacity(self, name: str, blocks: int) -> None:
        """What an endpoint can hold (its KV capacity, with the index margin) bounds what
        is believed of it: exact, predicted and approximate entries alike."""
        self.index.set_worker_cap(name, blocks)
        self.predictions.set_worker_cap(name, blocks)
        self.approx.set_worker_cap(name, blocks)

    def forget_cache(self, name: str) -> None:
        """Drop everything believed about an endpoint's cache (exact, predicted, approximate)."""
        self.index.clear_worker(name)
        self.predictions.forget_worker(name)
        self.approx.forget_worker(name)
        w = self.workers.get(name)
        if w is not None and w.demand is not None:
            w.demand.clear()
        if w is not None and w.new_blocks is not None:
            w.new_blocks.clear()
        if w is not None and w.refetched is not None:
            w.refetched.clear()

    def note_new_prefix(self, name: str, blocks: int) -> None:
        """A router sent `name` a prompt of `blocks` blocks that no endpoint held any of
        (the placement scorer's new prefix)."""
        w = self.workers.get(name)
        if w is not None and w.new_blocks is not None:
            w.new_blocks.add(blocks)

    def served_models(self) -> list[str]:
        """Every model and adapter name some endpoint serves, sorted."""
        names: set[str] = set()
        for w in self.workers.values():
            names |= w.models or frozenset()
        return sorted(names)

    def max_model_len(self, model: str) -> int | None:
        """The shortest context length among the endpoints serving `model` (any, if "")."""
        via = self.resolver_base(model)
        lens = [
            w.max_model_len
            for w in self.workers.values()
            if w.max_model_len and (not model or (w.models is not None and serves(w, model, via)))
        ]
        return min(lens) if lens else None

    def base_of(self, model: str) -> str | None:
        """The base model of a LoRA adapter name, None for anything else."""
        for w in self.workers.values():
            base = w.adapters.get(model)
            if base is not None:
                return base
        return self.resolver_base(model)

    def resolver_base(self, model: str) -> str | None:
        """The base model whose engines load `model` on demand (`lora_resolver`): a name no
        endpoint lists, or an adapter of that base some endpoint loaded already (every
        endpoint serving the base may load it too). None for anything else: a base model,
        another base's adapter, or no resolver configured.

        An endpoint whose models are not known yet (starting, or behind an API key kvroute
        lacks, which /health names) is not asked: it is eligible for every name anyway, and
        waiting for it would send every adapter there alone during each rollout. A name it
        serves as its own model, and no known worker lists, may meanwhile go to BASE's
        workers too, which answer 404."""
        base = self.lora_resolver
        if base is None or not model or model == base:
            return None
        for w in self.workers.values():
            if w.models is not None and model in w.models and w.adapters.get(model) != base:
                return None
        return base


def serves(w: WorkerState, model: str, via: str | None = None) -> bool:
    """A request naming no model may go anywhere (the engine picks its default); an endpoint
    whose models are not known yet is not ruled out. `via`: the base model whose engines
    load this adapter on demand (FleetState.resolver_base), so any endpoint serving it
    serves the adapter too."""
    if not model or w.models is None or model in w.models:
        return True
    return via is not None and via in w.models
