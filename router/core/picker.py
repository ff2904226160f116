"""The one picker: tokens -> block hashes -> index lookups -> scores -> a ranked decision.

Both front doors (the HTTP proxy and the Envoy ext_proc server) call `RoutingCore.route` and
then, for the worker they actually use, `RoutingCore.commit`. `route` has no side effects;
`commit` records the prediction (events mode) or the TTL entry (approx mode) and counts the
load, so selection stays pure and explainable.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from indexer.clock import Clock
from indexer.hashing import Namespace, RouterBlockHash, hash_request
from indexer.health import HealthTracker
from indexer.index import Overlap, PrefixIndex
from indexer.ttl import TtlIndex
from router.core.config import ScoringConfig
from router.core.errors import NoWorkerAvailable
from router.core.load import LoadTracker, Ticket
from router.core.scoring import Candidate, Scorer, ScoreRequest, build_scorers, clamp

EVENTS = "events"
APPROX = "approx"


@dataclass
class WorkerState:
    """What the picker knows about one worker; the host keeps it current."""

    name: str
    mode: str  # effective mode now: "events" or "approx"
    block_size: int
    capacity_blocks: int | None = None
    available: bool = True  # false while ejected by health checks
    caching: bool = True  # the engine's prefix caching (vllm:cache_config_info)
    health: HealthTracker | None = None


@dataclass(frozen=True)
class WorkerScore:
    worker: str
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
    excluded: str | None = None  # why it is not eligible (load bound)


@dataclass(frozen=True)
class Decision:
    policy: str
    prompt_tokens: int
    ranked: list[WorkerScore]  # best first: the next ones are the retry order
    hashes: dict[int, list[RouterBlockHash]] = field(default_factory=dict)  # per block size
    scorer_us: dict[str, float] = field(default_factory=dict)

    @property
    def best(self) -> WorkerScore:
        return self.ranked[0]

    def score_of(self, worker: str) -> WorkerScore:
        return next(s for s in self.ranked if s.worker == worker)

    def explain(self) -> str:
        """The formula with its terms filled in, one line per worker."""
        lines = []
        for s in self.ranked:
            terms = " + ".join(f"{k} {s.weighted[k]:.3f} ({s.raw[k]:.3f})" for k in s.raw)
            note = f"  [{s.excluded}]" if s.excluded else ""
            lines.append(
                f"{s.worker}: total {s.total:.3f} = {terms or 'n/a'}; overlap "
                f"{s.overlap_blocks} blocks {s.overlap_by_tier}, load {s.requests} req / "
                f"{s.prefill_tokens} prefill tok / {s.decode_blocks:.0f} decode blk, cache "
                f"{s.cached_blocks}/{s.capacity_blocks or '?'} blk ({s.mode}){note}"
            )
        return "\n".join(lines)


class RoutingCore:
    """The routing brain. Pure: time, randomness and scorer timing are injected."""

    def __init__(
        self,
        clock: Clock,
        *,
        scoring: ScoringConfig | None = None,
        policy: str = "kv",
        prediction_ttl_s: float = 5.0,
        approx_ttl_s: float = 120.0,
        max_index_entries: int = 4_000_000,
        rng: random.Random | None = None,
        timer: Callable[[], float] | None = None,
    ) -> None:
        self.scoring = scoring or ScoringConfig()
        self.policy = policy
        self.index = PrefixIndex(max_entries=max_index_entries)
        self.predictions = TtlIndex(clock, prediction_ttl_s)
        self.approx = TtlIndex(clock, approx_ttl_s)
        self.load = LoadTracker()
        self.workers: dict[str, WorkerState] = {}
        self._scorers: list[tuple[Scorer, float]] = build_scorers(
            self.scoring.weights, self.scoring.tier_credit
        )
        self._weights = {s.name: w for s, w in self._scorers}
        self._rng = rng or random.Random(0)
        self._timer = timer
        self._rr = 0

    # ---- workers ---------------------------------------------------------------------

    def add_worker(self, state: WorkerState, model: str = "") -> None:
        self.workers[state.name] = state
        self.index.add_worker(state.name, model=model)

    def remove_worker(self, name: str) -> None:
        self.forget_cache(name)
        self.workers.pop(name, None)
        self.index.remove_worker(name)
        self.load.forget(name)

    def forget_cache(self, name: str) -> None:
        """Drop everything believed about a worker's cache (exact, predicted, approximate)."""
        self.index.clear_worker(name)
        self.predictions.forget_worker(name)
        self.approx.forget_worker(name)

    # ---- routing ---------------------------------------------------------------------

    def route(self, tokens: Sequence[int], ns: Namespace, exclude: Iterable[str] = ()) -> Decision:
        """Rank the available workers for this prompt. No side effects."""
        skip = set(exclude)
        pool = [w for w in self.workers.values() if w.available and w.name not in skip]
        if not pool:
            raise NoWorkerAvailable(self._why_none(skip))
        hashes = {bs: _hashes(tokens, bs, ns) for bs in {w.block_size for w in pool}}
        lookups = {bs: self._lookups(h, pool) for bs, h in hashes.items()}
        cands = [self._candidate(w, lookups[w.block_size]) for w in pool]
        request = ScoreRequest(prompt_tokens=len(tokens))
        raw, timings = self._run_scorers(request, cands)
        excluded = self._load_bound(cands)
        scores = [self._worker_score(c, raw, excluded.get(c.name)) for c in cands]
        ranked = self._order(scores)
        return Decision(self.policy, len(tokens), ranked, hashes, timings)

    def commit(self, decision: Decision, worker: str, extra_blocks: int = 0) -> Ticket:
        """The host is sending the request to `worker`: remember where the prefix now lives
        and count the load. `extra_blocks`: expected generated-token blocks."""
        state = self.workers[worker]
        s = decision.score_of(worker)
        hashes = decision.hashes.get(state.block_size, [])
        if state.mode == EVENTS:
            self.predictions.record(worker, hashes)
            if state.health is not None:
                known = self.index.find_matches(hashes).get(worker)
                state.health.note_request(len(hashes) > (known.blocks if known else 0))
        else:
            self.approx.record(worker, hashes)
        if self.policy == "round_robin":
            self._rr += 1
        uncached = max(0, decision.prompt_tokens - s.overlap_blocks * state.block_size)
        blocks = math.ceil(decision.prompt_tokens / state.block_size) + extra_blocks
        return self.load.start(worker, uncached, blocks)

    # ---- pieces ----------------------------------------------------------------------

    def _why_none(self, skip: set[str]) -> str:
        if not self.workers:
            return "no workers are configured"
        down = [w.name for w in self.workers.values() if not w.available]
        parts = []
        if down:
            parts.append(f"failing health checks: {', '.join(sorted(down))}")
        if skip:
            parts.append(f"already tried: {', '.join(sorted(skip))}")
        return "no worker available (" + "; ".join(parts) + ")"

    def _lookups(
        self, hashes: list[RouterBlockHash], pool: list[WorkerState]
    ) -> tuple[dict[str, Overlap], dict[str, Overlap], dict[str, Overlap]]:
        """Each index is asked once per block size; it answers for every worker at once."""
        modes = {w.mode for w in pool}
        exact = self.index.find_matches(hashes) if EVENTS in modes else {}
        guess = self.predictions.find_matches(hashes) if EVENTS in modes else {}
        approx = self.approx.find_matches(hashes) if APPROX in modes else {}
        return exact, guess, approx

    def _candidate(
        self,
        w: WorkerState,
        lookups: tuple[dict[str, Overlap], dict[str, Overlap], dict[str, Overlap]],
    ) -> Candidate:
        exact, guess, approx = lookups
        if w.mode == EVENTS:
            overlap = _better(exact.get(w.name), guess.get(w.name))
            cached = self.index.entries_of(w.name)
        else:
            overlap = approx.get(w.name)
            cached = self.approx.entries_of(w.name)
        return Candidate(
            name=w.name,
            block_size=w.block_size,
            overlap_by_tier=overlap.by_tier if overlap else {},
            load=self.load.view(w.name),
            cached_blocks=cached,
            capacity_blocks=w.capacity_blocks,
            caching=w.caching,
        )

    def _run_scorers(
        self, request: ScoreRequest, cands: list[Candidate]
    ) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
        raw: dict[str, dict[str, float]] = {}
        timings: dict[str, float] = {}
        for scorer, _ in self._scorers:
            t0 = self._timer() if self._timer else 0.0
            out = scorer.score(request, cands)
            if self._timer:
                timings[scorer.name] = (self._timer() - t0) * 1e6
            raw[scorer.name] = {c.name: clamp(out.get(c.name, 0.0)) for c in cands}
        return raw, timings

    def _load_bound(self, cands: list[Candidate]) -> dict[str, str]:
        """Workers too far above the least loaded one are not eligible (a hot prefix spills
        over instead of piling up)."""
        least = min(c.load.requests for c in cands)
        bound = max(least + self.scoring.balance_abs, math.ceil(least * self.scoring.balance_rel))
        out = {
            c.name: f"load bound: {c.load.requests} in flight > {bound}"
            for c in cands
            if c.load.requests > bound
        }
        return out if len(out) < len(cands) else {}

    def _worker_score(
        self, c: Candidate, raw: dict[str, dict[str, float]], excluded: str | None
    ) -> WorkerScore:
        weights = self._weights
        mine = {name: per[c.name] for name, per in raw.items()}
        weighted = {name: weights[name] * v for name, v in mine.items()}
        return WorkerScore(
            worker=c.name,
            total=sum(weighted.values()),
            raw=mine,
            weighted=weighted,
            overlap_blocks=c.overlap_blocks,
            overlap_by_tier=dict(c.overlap_by_tier),
            block_size=c.block_size,
            requests=c.load.requests,
            prefill_tokens=c.load.prefill_tokens,
            decode_blocks=c.load.decode_blocks,
            cached_blocks=c.cached_blocks,
            capacity_blocks=c.capacity_blocks,
            mode=self.workers[c.name].mode,
            excluded=excluded,
        )

    def _order(self, scores: list[WorkerScore]) -> list[WorkerScore]:
        if self.policy == "round_robin":
            names = sorted(s.worker for s in scores)
            start = self._rr % len(names)
            order = names[start:] + names[:start]
            return sorted(scores, key=lambda s: order.index(s.worker))
        if self.policy == "random":
            shuffled = list(scores)
            self._rng.shuffle(shuffled)
            return shuffled
        if self.policy == "least_load":
            return sorted(scores, key=lambda s: (s.requests, s.prefill_tokens, s.worker))
        return self._order_kv(scores)

    def _order_kv(self, scores: list[WorkerScore]) -> list[WorkerScore]:
        # eligible first, best total first; ties break by name so decisions are repeatable
        ranked = sorted(scores, key=lambda s: (s.excluded is not None, -s.total, s.worker))
        temp = self.scoring.temperature
        if temp <= 0 or len(ranked) < 2:
            return ranked
        eligible = [s for s in ranked if s.excluded is None]
        top = max(s.total for s in eligible)
        weights = [math.exp((s.total - top) / temp) for s in eligible]
        first = self._rng.choices(eligible, weights=weights)[0]
        return [first, *[s for s in ranked if s is not first]]


def _hashes(tokens: Sequence[int], bs: int, ns: Namespace) -> list[RouterBlockHash]:
    """Block hashes, memoized on token lists that offer a `hash_memo` (cached prompts)."""
    memo: dict[object, list[RouterBlockHash]] | None = getattr(tokens, "hash_memo", None)
    if memo is None:
        return hash_request(tokens, bs, ns)
    key = (bs, ns)
    found = memo.get(key)
    if found is None:
        found = memo[key] = hash_request(tokens, bs, ns)
    return found


def _better(a: Overlap | None, b: Overlap | None) -> Overlap | None:
    if a is None:
        return b
    if b is None or a.blocks >= b.blocks:
        return a
    return b
