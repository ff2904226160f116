"""The one picker: tokens -> block hashes -> index lookups -> filters -> scores -> a ranked
decision, for any profile over the shared fleet state.

Every door (the HTTP proxy, the Envoy picker, the prefill->decode handoff) reaches it only
through `router.routing.DecisionService`. `pick` has no side effects; `commit` records the
prediction (events mode) or the TTL entry (approx mode), counts the load and advances the
profile's policy, so selection stays pure and explainable.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from indexer.hashing import Namespace, RouterBlockHash, hash_blocks, hash_request
from indexer.index import Overlap
from router.core.decision import Decision, RouteRequest, WorkerScore
from router.core.errors import NoWorkerAvailable
from router.core.filters import apply_filters
from router.core.fleet import APPROX, EVENTS, FleetState, WorkerState
from router.core.load import Ticket
from router.core.profiles import Profile
from router.core.scoring import Candidate, ScoreRequest, clamp, uncached_tokens

Lookups = tuple[dict[str, Overlap], dict[str, Overlap], dict[str, Overlap]]

KEY_BLOCKS = 8  # the blocks of a prompt that name its placement key (siblings share them)
JOINED_LATE = "joined the fleet after this decision"
_NO_LOOKUPS: Lookups = ({}, {}, {})


class Picker:
    """Pure: time (scorer timing) is injected."""

    def __init__(self, fleet: FleetState, timer: Callable[[], float] | None = None) -> None:
        self.fleet = fleet
        self._timer = timer

    def pick(self, profile: Profile, req: RouteRequest, tokens: Sequence[int]) -> Decision:
        """Rank the eligible endpoints for this prompt. No side effects."""
        pool = list(self.fleet.workers.values())
        if not pool:
            raise NoWorkerAvailable("no workers are configured")
        hashes = {bs: _hashes(tokens, bs, req.namespace) for bs in {w.block_size for w in pool}}
        lookups = {bs: self._lookups(h, pool) for bs, h in hashes.items()}
        cands = [self._candidate(w, lookups[w.block_size]) for w in pool]
        f = apply_filters(profile.filters, req, cands, self.fleet)
        # the smallest block size's hashes, not the first in a set: replicas that learned
        # their workers in another order must derive the same key
        opening = hashes[min(hashes)] if hashes else []
        key = int(opening[min(len(opening), KEY_BLOCKS) - 1]) if opening else 0
        raw, timings = self._run_scorers(profile, ScoreRequest(req.prompt_tokens, key), f.eligible)
        weights = profile.weights
        scores = [self._score(c, raw, weights, relaxed=f.relaxed.get(c.name)) for c in f.eligible]
        ranked = profile.policy.order(scores, profile.state)
        ex = f.excluded
        out = [self._score(c, {}, weights, ex[c.name]) for c in cands if c.name in ex]
        return Decision(
            profile.name, profile.policy.name, req, ranked, out, hashes, timings, weights, tokens
        )

    def commit(
        self,
        profile: Profile,
        decision: Decision,
        worker: str,
        extra_blocks: int = 0,
        handoff: bool = False,
    ) -> Ticket:
        """The door is sending the request to `worker`: remember where the prefix now lives
        and count the load. `extra_blocks`: expected generated-token blocks. `handoff`: the
        prompt's KV reaches `worker` by a pull once another worker prefilled it, so it is
        counted as the decode step alone, and nothing is believed of its cache until the
        pull (`remember`): believed at once, a request on the same prefix decided during
        the prefill leg would be prefilled there from scratch, as if cached."""
        state = self.fleet.workers[worker]
        profile.state.turns += 1
        blocks = math.ceil(decision.prompt_tokens / state.block_size) + extra_blocks
        if handoff:
            return self.fleet.load.start(worker, 0, blocks, False)
        expects, rides = self.remember(decision, worker)
        s = decision.score_of(worker)
        uncached = uncached_tokens(decision.prompt_tokens, s.overlap_blocks, state.block_size)
        ticket = self.fleet.load.start(worker, uncached, blocks, rides)
        ticket.expects_events = expects
        return ticket

    def remember(self, decision: Decision, worker: str) -> tuple[bool, bool]:
        """`worker` holds the prompt's prefix from now: its predicted (or approximate)
        entries, its event health's wait for new blocks, a new prefix placed there. Returns
        whether its events should show new blocks, and whether part of the overlap credited
        was only predicted (a request sent a moment ago, perhaps still prefilling it)."""
        state = self.fleet.workers[worker]
        s = decision.score_of(worker)
        hashes = decision.hashes.get(state.block_size, [])
        expects = rides = False
        if not state.caching:
            pass  # prefix caching off: it will hold nothing of this prompt to credit later
        elif state.mode == EVENTS:
            self.fleet.predictions.record(worker, hashes)
            found = self.fleet.index.find_matches(hashes).get(worker)
            stored = found.blocks if found else 0
            # the events do not show all of the overlap yet: the blocks past them are the
            # prediction of a request sent a moment ago, perhaps still prefilling them
            rides = s.overlap_blocks > stored
            if state.health is not None:
                expects = len(hashes) > stored
                state.health.note_request(expects)
        else:
            self.fleet.approx.record(worker, hashes)
        if decision.new_prefix:
            self.fleet.note_new_prefix(worker, len(hashes))
        return expects, rides

    def score_late(self, decision: Decision, worker: str) -> WorkerScore:
        """The score of an endpoint the decision never saw (it joined the fleet since, and a
        gateway's fallback served the request there): no overlap claimed, its load as now.
        Kept with the decision's excluded ones, so the commit, the outcome and the access log
        read it as any other."""
        found = decision.find_score(worker)
        if found is not None:
            return found
        c = self._candidate(self.fleet.workers[worker], _NO_LOOKUPS)
        late = self._score(c, {}, decision.weights, excluded=JOINED_LATE)
        decision.excluded.append(late)
        return late

    def withdraw(self, ticket: Ticket) -> None:
        """The engine refused the request: it will store no blocks for it, so its event
        health must not wait for them."""
        state = self.fleet.workers.get(ticket.worker)
        if ticket.expects_events and state is not None and state.health is not None:
            state.health.withdraw_request()
            ticket.expects_events = False

    # ---- pieces ----------------------------------------------------------------------

    def _lookups(self, hashes: Sequence[RouterBlockHash], pool: list[WorkerState]) -> Lookups:
        """Each index is asked once per block size; it answers for every endpoint at once."""
        modes = {w.mode for w in pool}
        f = self.fleet
        exact = f.index.find_matches(hashes) if EVENTS in modes else {}
        guess = f.predictions.find_matches(hashes) if EVENTS in modes else {}
        approx = f.approx.find_matches(hashes) if APPROX in modes else {}
        return exact, guess, approx

    def _candidate(self, w: WorkerState, lookups: Lookups) -> Candidate:
        exact, guess, approx = lookups
        if w.mode == EVENTS:
            overlap = _better(exact.get(w.name), guess.get(w.name))
            cached = self.fleet.index.entries_of(w.name)
        else:
            overlap = approx.get(w.name)
            cached = self.fleet.approx.entries_of(w.name)
        return Candidate(
            name=w.name,
            block_size=w.block_size,
            overlap_by_tier=overlap.by_tier if overlap else {},
            load=self.fleet.load.view(w.name),
            cached_blocks=cached,
            capacity_blocks=w.capacity_blocks,
            caching=w.caching,
            mode=w.mode,
            recent_blocks=_recent_blocks(w, self.fleet),
            new_blocks=w.new_blocks.value() if w.new_blocks is not None else 0.0,
            refetched=w.refetched.value() if w.mode == EVENTS and w.refetched is not None else None,
        )

    def _run_scorers(
        self, profile: Profile, request: ScoreRequest, cands: list[Candidate]
    ) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
        raw: dict[str, dict[str, float]] = {}
        timings: dict[str, float] = {}
        for scorer, _ in profile.scorers:
            t0 = self._timer() if self._timer else 0.0
            out = scorer.score(request, cands)
            if self._timer:
                timings[scorer.name] = (self._timer() - t0) * 1e6
            # clamped only when outside 0..1 (NaN fails the test too): no call per value
            raw[scorer.name] = {
                c.name: v if 0.0 <= (v := out.get(c.name, 0.0)) <= 1.0 else clamp(v) for c in cands
            }
        return raw, timings

    @staticmethod
    def _score(
        c: Candidate,
        raw: dict[str, dict[str, float]],
        weights: dict[str, float],
        excluded: str | None = None,
        relaxed: str | None = None,
    ) -> WorkerScore:
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
            riders=c.load.riders,
            decode_blocks=c.load.decode_blocks,
            cached_blocks=c.cached_blocks,
            capacity_blocks=c.capacity_blocks,
            mode=c.mode,
            excluded=excluded,
            relaxed=relaxed,
            demand_blocks=c.recent_blocks,
            refetched=c.refetched,
        )


def _hashes(tokens: Sequence[int], bs: int, ns: Namespace) -> Sequence[RouterBlockHash]:
    """Block hashes, memoized on token lists that offer a `hash_memo` (cached prompts), and
    on the prefix they share with other prompts when they offer a `shared_prefix`."""
    memo: dict[object, Sequence[RouterBlockHash]] | None = getattr(tokens, "hash_memo", None)
    if memo is None:
        return hash_request(tokens, bs, ns)
    key = (bs, ns)
    found = memo.get(key)
    if found is None:
        found = memo[key] = _hashes_after_prefix(tokens, bs, ns, key)
    return found


def _hashes_after_prefix(
    tokens: Sequence[int], bs: int, ns: Namespace, key: object
) -> Sequence[RouterBlockHash]:
    """The chain is a function of the ids before each block, so the full blocks inside a
    shared prefix hash the same for every prompt that starts with it: only the blocks after
    them are hashed, seeded from the prefix's last hash."""
    shared: tuple[int, dict[object, Sequence[RouterBlockHash]]] | None = getattr(
        tokens, "shared_prefix", None
    )
    if shared is None:
        return hash_request(tokens, bs, ns)
    n, memo = shared
    head = memo.get(key)
    if head is None:
        found = hash_request(tokens, bs, ns)
        memo[key] = found[: n // bs]
        return found
    done = len(head) * bs
    seed = head[-1] if head else ns.seed(bs)
    return [*head, *hash_blocks(tokens[done:], bs, seed)]


def _recent_blocks(w: WorkerState, fleet: FleetState) -> float:
    """Demand on the endpoint's cache lately: blocks its KV events stored (decayed; the same
    on every router replica) plus this router's predictions not older than prediction_ttl_s,
    or for approx mode the blocks routed there within the TTL."""
    if w.mode == EVENTS and w.demand is not None:
        return w.demand.value() + fleet.predictions.entries_of(w.name)
    return fleet.approx.entries_of(w.name)


def _better(a: Overlap | None, b: Overlap | None) -> Overlap | None:
    if a is None:
        return b
    if b is None or a.blocks >= b.blocks:
        return a
    return b
