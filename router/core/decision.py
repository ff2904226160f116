"""What a routing decision says: the eligible endpoints in order, the ones filtered out and
why, and every scorer's term, so that doors, logs, `/debug/route` and `kvroute explain` can
show the formula with its terms filled in."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from indexer.hashing import Namespace, RouterBlockHash
from router.core.scoring import is_new_prefix


@dataclass(frozen=True)
class Constraints:
    """Per-request limits a door adds: a gateway's subset hint (worker addresses), workers
    already tried."""

    subset: frozenset[str] | None = None
    exclude: frozenset[str] = frozenset()


@dataclass(slots=True)  # built per request: a frozen init costs ~3x
class RouteRequest:
    """The facts filters and scorers see (the prompt itself is already hashed)."""

    model: str  # as the client named it; "" when it named none
    namespace: Namespace
    prompt_tokens: int
    constraints: Constraints = Constraints()
    max_tokens: int = 16
    n: int = 1
    dry_run: bool = False  # /debug/route: nothing is sent, so nothing is refused for load


@dataclass(slots=True)  # built per request: a frozen init costs ~3x
class WorkerScore:
    worker: str  # the endpoint's name
    total: float
    raw: dict[str, float]  # scorer -> 0..1
    weighted: dict[str, float]  # scorer -> weight * raw
    overlap_blocks: int
    overlap_by_tier: dict[str, int]
    block_size: int
    requests: int
    prefill_tokens: int
    decode_blocks: float
    cached_blocks: int
    capacity_blocks: int | None
    mode: str
    excluded: str | None = None  # why it is not eligible (the filter's reason)
    relaxed: str | None = None  # eligible only because a filter was relaxed, and which
    demand_blocks: float = 0.0  # blocks its cache stored lately, decayed (placement's demand)
    refetched: float | None = None  # blocks it stored again soon after evicting them
    riders: int = 0  # requests waiting on a prefill in progress there (placement's cost)


@dataclass(slots=True)  # built per request: a frozen init costs ~3x
class Decision:
    profile: str
    policy: str
    request: RouteRequest
    ranked: list[WorkerScore]  # eligible, best first: the next ones are the retry order
    excluded: list[WorkerScore] = field(default_factory=list)  # not eligible, with the reason
    hashes: dict[int, Sequence[RouterBlockHash]] = field(default_factory=dict)  # per block size
    scorer_us: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    tokens: Sequence[int] = ()  # the prompt's token ids, as the router tokenized them

    @property
    def prompt_tokens(self) -> int:
        return self.request.prompt_tokens

    @property
    def best(self) -> WorkerScore:
        return self.ranked[0]

    @property
    def new_prefix(self) -> bool:
        """No eligible endpoint holds NEW_BELOW of the prompt (the placement scorer's new
        prefix at its default): the picker counts it as one, a follower replica waits."""
        overlaps = ((s.overlap_blocks, s.block_size) for s in self.ranked)
        return is_new_prefix(self.prompt_tokens, overlaps)

    def score_of(self, worker: str) -> WorkerScore:
        found = self.find_score(worker)
        if found is None:
            raise KeyError(f"no score for worker {worker!r}")
        return found

    def find_score(self, worker: str) -> WorkerScore | None:
        for scores in (self.ranked, self.excluded):
            for s in scores:
                if s.worker == worker:
                    return s
        return None

    def explain(self) -> str:
        """The formula with its terms filled in, one line per endpoint."""
        return "\n".join(_line(s) for s in [*self.ranked, *self.excluded])


def _line(s: WorkerScore) -> str:
    terms = " + ".join(f"{k} {s.weighted[k]:.3f} ({s.raw[k]:.3f})" for k in s.raw)
    why = s.excluded or s.relaxed
    note = f"  [{why}]" if why else ""
    return (
        f"{s.worker}: total {s.total:.3f} = {terms or 'n/a'}; overlap "
        f"{s.overlap_blocks} blocks {s.overlap_by_tier}, load {s.requests} req / "
        f"{s.prefill_tokens} prefill tok{f' ({s.riders} riding)' if s.riders else ''} / "
        f"{s.decode_blocks:.0f} decode blk, cache "
        f"{s.cached_blocks}/{s.capacity_blocks or '?'} blk, demand {s.demand_blocks:.0f} blk"
        f"{'' if s.refetched is None else f', refetched {s.refetched:.0f}'} ({s.mode}){note}"
    )
