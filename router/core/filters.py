"""Eligibility filters: every "who may receive this request" rule is one of these, listed in
a routing profile, never an `if` in a door.

A filter names the endpoints it rules out and why (the reason shows in the decision's
explanation). When it would rule out every endpoint left, it either fails the request with
its own error (`when_empty` returns one: a model nobody serves is a 404 naming the served
models) or is relaxed (`when_empty` returns None: a load bound must not refuse work that
nobody else can take).

    model       the endpoint serves the requested model or adapter (404 otherwise)
    available   not ejected (health checks, connect failures, timeouts), not draining (503)
    subset      in the gateway's subset hint, when the door passes one (503)
    tried       not already tried for this request (503)
    load_bound  not more than balance_abs requests above the least loaded endpoint, or
                balance_rel times it (relaxed: a hot prefix spills over, never refused)
    role        the endpoint's P/D role is one of `roles` (the decode and prefill profiles
                of a prefill->decode fleet; 503 when none is left)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from router.core.decision import RouteRequest
from router.core.errors import KvrouteError, NotFound, NoWorkerAvailable
from router.core.fleet import FleetState, WorkerState
from router.core.registry import Registry
from router.core.scoring import Candidate, NoParams


class Filter(Protocol):
    name: str

    def exclude(
        self, req: RouteRequest, cands: Sequence[Candidate], fleet: FleetState
    ) -> dict[str, str]: ...

    def when_empty(
        self, req: RouteRequest, excluded: Mapping[str, str], fleet: FleetState
    ) -> KvrouteError | None: ...


def serves(w: WorkerState, model: str) -> bool:
    """A request naming no model may go anywhere (the engine picks its default); an endpoint
    whose models are not known yet is not ruled out."""
    return not model or w.models is None or model in w.models


def unknown_model(model: str, fleet: FleetState) -> NotFound:
    served = ", ".join(fleet.served_models()) or "none known yet"
    return NotFound(
        f"The model `{model}` does not exist on this fleet. Served models: {served}.",
        param="model",
    )


class ModelFilter:
    name = "model"

    def __init__(self, params: NoParams) -> None:
        pass

    def exclude(
        self, req: RouteRequest, cands: Sequence[Candidate], fleet: FleetState
    ) -> dict[str, str]:
        return {
            c.name: f"does not serve {req.model!r}"
            for c in cands
            if not serves(fleet.workers[c.name], req.model)
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
    balance_abs: int = 8  # an endpoint may run this many requests above the least loaded...
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
register("load_bound", LoadBoundFilter, LoadBoundParams)
register("role", RoleFilter, RoleParams)


def apply_filters(
    filters: Sequence[Filter],
    req: RouteRequest,
    cands: Sequence[Candidate],
    fleet: FleetState,
) -> tuple[list[Candidate], dict[str, str]]:
    """The eligible candidates, and every excluded one with the first reason that hit it."""
    eligible = list(cands)
    excluded: dict[str, str] = {}
    for f in filters:
        out = f.exclude(req, eligible, fleet)
        if not out:
            continue
        if len(out) >= len(eligible):
            err = f.when_empty(req, out, fleet)
            if err is not None:
                raise err
            continue  # relaxed: it may not rule out everyone left
        excluded.update(out)
        eligible = [c for c in eligible if c.name not in out]
    return eligible, excluded
