"""A stand-in for `router.routing` (issue 9's decision service) with exactly the calls the
ext_proc picker makes, for the picker's tests until the real service is merged. It ranks the
eligible workers in a seeded random order and records every accounting call, so that a test
can check what the picker chose against where Envoy really sent the request.

`install()` registers it as `router.routing` only when the real module is missing: once the
real one exists, `tests/test_extproc_*` keep using this class through their fixture (a fixture
change switches them to the real DecisionService)."""

from __future__ import annotations

import importlib
import random
import sys
from dataclasses import dataclass, field
from typing import Any

from router.core.errors import NotFound, NoWorkerAvailable, Overloaded
from router.openai_req import RoutingInput

ROUTES = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}


@dataclass(frozen=True)
class Constraints:
    subset: frozenset[str] | None = None
    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True)
class WorkerScore:
    worker: str
    score: float = 0.0


@dataclass(frozen=True)
class Decision:
    rin: RoutingInput
    ranked: list[WorkerScore]


@dataclass
class Ticket:
    worker: str
    model: str
    events: list[tuple[str, Any]] = field(default_factory=list)


@dataclass
class DecisionService:
    """Workers are named by their "ip:port" address (name == address)."""

    workers: list[str]
    models: tuple[str, ...] = ("kvroute-sim",)
    seed: int = 0
    shed: bool = False
    ready: bool = True
    live: bool = True
    rng: random.Random = field(init=False)
    decisions: list[tuple[str, list[str]]] = field(default_factory=list)  # (model, ranked)
    tickets: list[Ticket] = field(default_factory=list)
    passed_over_told: list[str] = field(default_factory=list)  # endpoints, in order told

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def route_path(self, path: str) -> str | None:
        return ROUTES.get(path)

    async def decide(
        self, rin: RoutingInput, *, profile: str = "default", constraints: Any = None
    ) -> Decision:
        if rin.model and rin.model not in self.models:
            raise NotFound(f"model {rin.model!r} not served; served: {', '.join(self.models)}")
        if self.shed:
            raise Overloaded("every worker is over its load bound")
        eligible = [w for w in self.workers if _allowed(w, constraints)]
        if not eligible:
            raise NoWorkerAvailable("no eligible worker")
        self.rng.shuffle(eligible)
        self.decisions.append((rin.model, eligible))
        return Decision(rin, [WorkerScore(w) for w in eligible])

    def address_of(self, worker: str) -> str:
        return worker

    def worker_at(self, address: str) -> str | None:
        return address if address in self.workers else None

    def rank_of(self, worker: str) -> int | None:
        return None  # no endpoint here is a data-parallel rank

    def start(self, decision: Decision, worker: str) -> Ticket:
        ticket = Ticket(worker, decision.rin.model, [("start", worker)])
        self.tickets.append(ticket)
        return ticket

    def passed_over(self, worker: str, why: str) -> None:
        self.passed_over_told.append(worker)

    def reassign(self, ticket: Ticket, worker: str) -> Ticket:
        ticket.events.append(("reassign", worker))
        ticket.worker = worker
        return ticket

    def first_token(self, ticket: Ticket) -> None:
        ticket.events.append(("first_token", None))

    def finish(
        self,
        ticket: Ticket,
        *,
        status: int,
        cached_tokens: int | None = None,
        outcome: str | None = None,
    ) -> None:
        # a failure that never produced a response (a client hang-up) records its outcome
        ticket.events.append(("finish", (status, cached_tokens if outcome is None else outcome)))

    def models_doc(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": m, "object": "model", "owned_by": "kvroute"} for m in self.models],
        }

    def inflight(self) -> int:
        return sum(1 for t in self.tickets if not any(e[0] == "finish" for e in t.events))


def _allowed(worker: str, constraints: Any) -> bool:
    if constraints is None:
        return True
    if constraints.subset is not None and worker not in constraints.subset:
        return False
    return worker not in constraints.exclude


def bodyless(model: str = "") -> RoutingInput:
    return RoutingInput("completion", model)


def install() -> None:
    """Make `router.routing` importable (this module) unless the real one exists."""
    try:
        importlib.import_module("router.routing")
    except ImportError:
        sys.modules["router.routing"] = sys.modules[__name__]
    if not hasattr(RoutingInput, "bodyless"):
        RoutingInput.bodyless = staticmethod(bodyless)  # type: ignore[attr-defined]
