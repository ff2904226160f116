"""Eligibility filters: every "who may receive this request" rule is one of these, listed in
a routing profile, never an `if` in a door.

A filter names the endpoints it rules out and why (the reason shows in the decision's
explanation). When it would rule out every endpoint left, it either fails the request with
its own error (`when_empty` returns one: a model nobody serves is a 404 naming the served
models) or is relaxed (`when_empty` returns None: a load bound must not refuse work that
nobody else can take). A relaxed filter's reasons still show, as notes on the endpoints it
let through.

    model       the endpoint serves the requested model or adapter, or the base model whose
                engines load adapters on demand (--lora-resolver); 404 otherwise
    available   not ejected (health checks, connect failures, timeouts), not draining (503)
    subset      in the gateway's subset hint, when the door passes one (503)
    tried       not already tried for this request (503)
    busy        under the fleet's busy bounds: fewer than max_requests running+waiting, KV
                cache less than max_kv_usage full (relaxed when every endpoint is busy: the
                least bad one still serves; with shed on, a 429 naming the bound instead)
    load_bound  not more than balance_abs requests above the least loaded endpoint, or
                balance_rel times it (relaxed: a hot prefix spills over, never refused)
    prefill_wait
                the prefill tokens it would compute before this prompt's first token (its
                queued prefills plus the prompt's uncached part there) not more than `over`
                times the fastest endpoint's plus `floor_tokens` (relaxed: never refuses)
    role        the endpoint's P/D role is one of `roles` (the decode and prefill profiles
                of a prefill->decode fleet; 503 when none is left)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from router.core.decision import RouteRequest
from router.core.errors import KvrouteError, NotFound, NoWorkerAvailable, Overloaded
from router.core.fleet import FleetState, serves
from router.core.registry import Registry
from router.core.scoring import Candidate, NoParams, uncached_tokens


class Filter(Protocol):
    name: str

    def exclude(
        self, req: RouteRequest, cands: Sequence[Candidate], fleet: FleetState
    ) -> dict[str, str]: ...

    def when_empty(
        self, req: RouteRequest, excluded: Mapping[str, str], fleet: FleetState
    ) -> KvrouteError | None: ...


def unknown_model(model: str, fleet: FleetState) -> NotFound:
    served = ", ".join(fleet.served_models()) or "none known yet"
    why = ""
    if fleet.resolver_base(model) is not None:
        why = (
            f" --lora-resolver names `{fleet.lora_resolver}` as the base model of adapters "
            "loaded on demand, and no worker serves it: name one of the served base models"
        )
    return NotFound(
        f"The model `{model}` does not exist on this fleet. Served models: {served}.{why}",
        param="model",
    )


class ModelFilter:
    name = "model"

    def __init__(self, params: NoParams) -> None:
        pass

    def exclude(
        self, req: RouteRequest, cands: Sequence[Candidate], fleet: FleetState
    ) -> dict[str, str]:
        via = fleet.resolver_base(req.model)
        return {
            c.name: f"does not serve {req.model!r}"
            for c in cands
            if not serves(fleet.workers[c.name], req.model, via)
        }

    def when_empty(
        self, req: RouteRequest, excluded: Mapping[str, str], fleet: FleetState
    ) -> KvrouteError | None:
        return unknown_model(req.model, fleet)


class AvailableFilter:
    name = "available"

    def __init__(self, params: NoParams) -> None:
        pass

    def exclude(
        self, req: RouteRequest, cands: Sequence[Candidate], fleet: FleetState
    ) -> dict[str, str]:
        out = {}
        for c in cands:
            w = fleet.workers[c.name]
            if not w.available:
                out[c.name] = "failing health checks"
            elif w.draining:
                out[c.name] = "draining"
        return out

    def when_empty(
        self, req: RouteRequest, excluded: Mapping[str, str], fleet: FleetState
    ) -> KvrouteError | None:
        reasons = sorted(set(excluded.values()))
        names = ", ".join(f"{n} ({why})" for n, why in sorted(excluded.items()))
        return NoWorkerAvailable(
            f"no worker available ({len(excluded)} {' or '.join(reasons)})",
            detail=f"not available: {names}",
        )


class SubsetFilter:
    name = "subset"

    def __init__(self, params: NoParams) -> None:
        pass

    def exclude(
        self, req: RouteRequest, cands: Sequence[Candidate], fleet: FleetState
    ) -> dict[str, str]:
        subset = req.constraints.subset
        if subset is None:
            return {}
        return {
            c.name: "not in the gateway's subset hint"
            for c in cands
            if fleet.workers[c.name].address not in subset
        }

    def when_empty(
        self, req: RouteRequest, excluded: Mapping[str, str], fleet: FleetState
    ) -> KvrouteError | None:
        hint = ", ".join(sorted(req.constraints.subset or ())) or "empty"
        return NoWorkerAvailable(
            "no eligible worker in the gateway's subset hint", detail=f"subset hint: {hint}"
        )


class TriedFilter:
    name = "tried"

    def __init__(self, params: NoParams) -> None:
        pass

    def exclude(
        self, req: RouteRequest, cands: Sequence[Candidate], fleet: FleetState
    ) -> dict[str, str]:
        tried = req.constraints.exclude
        return {c.name: "already tried" for c in cands if c.name in tried}

    def when_empty(
        self, req: RouteRequest, excluded: Mapping[str, str], fleet: FleetState
    ) -> KvrouteError | None:
        names = ", ".join(sorted(excluded))
        return NoWorkerAvailable(
            f"no worker available ({len(excluded)} already tried)",
            detail=f"already tried: {names}",
        )


@dataclass(frozen=True)
class LoadBoundParams:
    balance_abs: int = 32  # an endpoint may run this many requests above the least loaded...
    balance_rel: float = 1.5  # ...or this multiple of it, whichever is larger


class LoadBoundFilter:
    name = "load_bound"

    def __init__(self, params: LoadBoundParams) -> None:
        self.params = params

    def exclude(
        self, req: RouteRequest, cands: Sequence[Candidate], fleet: FleetState
    ) -> dict[str, str]:
        if not cands:
            return {}
        least = min(c.load.requests for c in cands)
        p = self.params
        bound = max(least + p.balance_abs, math.ceil(least * p.balance_rel))
        return {
            c.name: f"load bound: {c.load.requests} in flight > {bound}"
            for c in cands
            if c.load.requests > bound
        }

    def when_empty(
        self, req: RouteRequest, excluded: Mapping[str, str], fleet: FleetState
    ) -> KvrouteError | None:
        return None


@dataclass(frozen=True)
class PrefillWaitParams:
    over: float = 2.0  # an endpoint may make the prompt wait this multiple of the fastest's...
    floor_tokens: int = 2048  # ...plus this many prefill tokens (over 0: off)


class PrefillWaitFilter:
    """A cached prefix is not worth any wait. Measured on long-short-mix: short prompts on a
    cached 300-token template queued behind a 6,000-token document's cold prefill on their
    template's worker (TTFT 250-600 ms); recomputing the template elsewhere takes ~20 ms.
    The prefix credit cannot see that: it is a fraction of this prompt, the load score a
    fraction of the busiest worker's. So an endpoint is ruled out when the prefill tokens it
    would compute before this prompt's first token (queued prefills + this prompt's
    uncached part there) pass `over` times the fastest endpoint's plus `floor_tokens`.
    Siblings of a prefix that is still prefilling stay: their wait there is the prefix's own
    prefill, about what recomputing it elsewhere costs."""

    name = "prefill_wait"

    def __init__(self, params: PrefillWaitParams) -> None:
        self.params = params

    def exclude(
        self, req: RouteRequest, cands: Sequence[Candidate], fleet: FleetState
    ) -> dict[str, str]:
        p = self.params
        if not cands or p.over <= 0:
            return {}
        waits = {
            c.name: c.load.prefill_tokens
            + uncached_tokens(req.prompt_tokens, c.overlap_blocks, c.block_size)
            for c in cands
        }
        bound = p.over * min(waits.values()) + p.floor_tokens
        return {
            name: f"prefill wait: {w} tokens before the first > {bound:.0f}"
            for name, w in waits.items()
            if w > bound
        }

    def when_empty(
        self, req: RouteRequest, excluded: Mapping[str, str], fleet: FleetState
    ) -> KvrouteError | None:
        return None


@dataclass(frozen=True)
class BusyParams:
    """Dynamo's busy thresholds (`--active-decode-blocks-threshold`); None: no bound."""

    max_requests: int | None = None  # busy at this many running+waiting requests
    max_kv_usage: float | None = None  # busy at this KV cache use, 0..1
    # busy at the engine's batch limit, where its scrapes taught it (`LoadView.batch_limit`)
    learn_batch: bool = True
    shed: bool = False  # every endpoint busy: refuse with 429 instead of relaxing

    def __post_init__(self) -> None:
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests {self.max_requests}: must be >= 1 (or unset)")
        if self.max_kv_usage is not None and not 0 < self.max_kv_usage <= 1:
            raise ValueError(f"max_kv_usage {self.max_kv_usage}: must be in (0, 1] (or unset)")


LEARNED = "learned from its /metrics"  # ends a busy reason that only the learned limit gave


class BusyFilter:
    """An endpoint at a busy bound takes no new request while another one can. KV use is
    the engine's own gauge when scraped, else this router's decode blocks over the cache."""

    name = "busy"

    def __init__(self, params: BusyParams) -> None:
        self.params = params

    def exclude(
        self, req: RouteRequest, cands: Sequence[Candidate], fleet: FleetState
    ) -> dict[str, str]:
        out = {}
        for c in cands:
            why = self._why(c)
            if why is not None:
                out[c.name] = why
        return out

    def _why(self, c: Candidate) -> str | None:
        """Why `c` is busy (None: it is not): the operator's bounds first, then the learned
        batch limit, which never sheds (`when_empty`)."""
        p = self.params
        if p.max_requests is not None and c.load.requests >= p.max_requests:
            return f"busy: {c.load.requests} running+waiting >= busy_max_requests {p.max_requests}"
        usage = kv_usage(c)
        if p.max_kv_usage is not None and usage is not None and usage >= p.max_kv_usage:
            return f"busy: KV cache {usage:.2f} full >= busy_max_kv_usage {p.max_kv_usage}"
        limit = c.load.batch_limit
        if p.learn_batch and limit is not None and c.load.requests >= limit:
            return (
                f"busy: {c.load.requests} running+waiting >= its engine's batch of {limit}, "
                f"{LEARNED}"
            )
        return None

    def when_empty(
        self, req: RouteRequest, excluded: Mapping[str, str], fleet: FleetState
    ) -> KvrouteError | None:
        if not self.params.shed or req.dry_run:
            return None
        if any(why.endswith(LEARNED) for why in excluded.values()):
            # a learned limit is kvroute's inference, not the operator's bound: queueing on
            # the engine beats a 429, and a limit learned too low could never show itself
            # wrong if requests past it were refused
            return None
        return Overloaded(
            f"All {len(excluded)} eligible workers are busy ({self._bounds()}) and kvroute "
            "sheds load: retry shortly. Operators: raise --busy-max-requests or "
            "--busy-max-kv-usage, or add workers.",
            detail="; ".join(f"{n} {why}" for n, why in sorted(excluded.items())),
        )

    def _bounds(self) -> str:
        p = self.params
        bounds = []
        if p.max_requests is not None:
            bounds.append(f"{p.max_requests} running+waiting requests, --busy-max-requests")
        if p.max_kv_usage is not None:
            bounds.append(f"KV cache {p.max_kv_usage} full, --busy-max-kv-usage")
        return "; ".join(bounds)


def kv_usage(c: Candidate) -> float | None:
    """The engine's KV cache use (0..1): scraped, or estimated from decode blocks."""
    if c.load.kv_usage is not None:
        return c.load.kv_usage
    if c.capacity_blocks:
        return c.load.decode_blocks / c.capacity_blocks
    return None


@dataclass(frozen=True)
class RoleParams:
    roles: tuple[str, ...] = ("decode", "both")  # prefill | decode | both


class RoleFilter:
    name = "role"

    def __init__(self, params: RoleParams) -> None:
        self.roles = frozenset(params.roles)

    def exclude(
        self, req: RouteRequest, cands: Sequence[Candidate], fleet: FleetState
    ) -> dict[str, str]:
        return {
            c.name: f"role {fleet.workers[c.name].role}"
            for c in cands
            if fleet.workers[c.name].role not in self.roles
        }

    def when_empty(
        self, req: RouteRequest, excluded: Mapping[str, str], fleet: FleetState
    ) -> KvrouteError | None:
        wanted = " or ".join(sorted(self.roles))
        return NoWorkerAvailable(
            f"no worker with role {wanted} is eligible",
            detail=f"not {wanted}: {', '.join(sorted(excluded))}",
        )


REGISTRY: Registry[Filter] = Registry("filter")
register = REGISTRY.register

register("model", ModelFilter, NoParams)
register("available", AvailableFilter, NoParams)
register("subset", SubsetFilter, NoParams)
register("tried", TriedFilter, NoParams)
register("busy", BusyFilter, BusyParams)
register("load_bound", LoadBoundFilter, LoadBoundParams)
register("prefill_wait", PrefillWaitFilter, PrefillWaitParams)
register("role", RoleFilter, RoleParams)


@dataclass
class Filtered:
    eligible: list[Candidate]
    excluded: dict[str, str]  # endpoint -> the first reason that ruled it out
    relaxed: dict[str, str]  # eligible endpoint -> the first reason a relaxed filter waived


def apply_filters(
    filters: Sequence[Filter],
    req: RouteRequest,
    cands: Sequence[Candidate],
    fleet: FleetState,
) -> Filtered:
    """Run the profile's filters in order over the candidates."""
    done = Filtered(list(cands), {}, {})
    for f in filters:
        out = f.exclude(req, done.eligible, fleet)
        if not out:
            continue
        if len(out) >= len(done.eligible):
            err = f.when_empty(req, out, fleet)
            if err is not None:
                raise err
            for name, why in out.items():  # relaxed: it may not rule out everyone left
                done.relaxed.setdefault(name, f"{why} (relaxed: no other worker left)")
            continue
        done.excluded.update(out)
        done.eligible = [c for c in done.eligible if c.name not in out]
    return done
