"""The built-in scorers (registered in `router/core/scorers.py`)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.core.scoring import (
    NEW_BELOW,
    Candidate,
    NoParams,
    ScoreRequest,
    is_new_prefix,
    uncached_tokens,
)


@dataclass(frozen=True)
class PrefixParams:
    # credit per cached token by where the block lives: a CPU or disk hit still has to be
    # loaded back into GPU memory, so it saves less prefill time than a GPU hit
    tier_credit: dict[str, float] = field(
        default_factory=lambda: {"GPU": 1.0, "CPU": 0.75, "DISK": 0.25, "STORAGE": 0.25}
    )


class PrefixScorer:
    name = "prefix"

    def __init__(self, params: PrefixParams) -> None:
        self.tier_credit = dict(params.tier_credit)

    def credited_tokens(self, c: Candidate) -> float:
        return sum(
            blocks * c.block_size * self.tier_credit.get(tier, 0.25)
            for tier, blocks in c.overlap_by_tier.items()
        )

    def score(self, request: ScoreRequest, cands: Sequence[Candidate]) -> dict[str, float]:
        total = max(request.prompt_tokens, 1)
        return {c.name: self.credited_tokens(c) / total for c in cands}


class LoadScorer:
    name = "load"

    def __init__(self, params: NoParams) -> None:
        pass

    @staticmethod
    def load_blocks(c: Candidate) -> float:
        return c.load.prefill_tokens / c.block_size + c.load.decode_blocks

    def score(self, request: ScoreRequest, cands: Sequence[Candidate]) -> dict[str, float]:
        loads = {c.name: self.load_blocks(c) for c in cands}
        worst = max(loads.values(), default=0.0)
        if worst <= 0:
            return dict.fromkeys(loads, 1.0)
        return {name: 1.0 - load / worst for name, load in loads.items()}


@dataclass(frozen=True)
class PlacementParams:
    # a prompt whose best prefix credit on any worker is below this fraction is new
    new_below: float = NEW_BELOW
    # demands within this fraction of the most demanded worker's count as equal
    bucket: float = 0.03
    # the most any other worker scores for a new prompt (the winner scores 1)
    others: float = 0.3
    # only workers running at most this many requests more than the least loaded may be
    # the winner: a burst of new prompts must not all queue on the least demanded cache
    slack: int = 2
    # a cache whose recent demand plus the new prompt stays under this fraction of its
    # size has room: among such caches the new prefix goes where it waits least and
    # delays fewest requests (0 turns this off: always the least demanded cache)
    room: float = 0.5
    # rank first by the blocks of the new prefixes each worker was given lately (each
    # counted at its first prompt, decayed like demand), then by demand (false: demand
    # alone; vllm-prefix-repetition, one router, 5 seeds: homes 8/8/8/8 in 5 of 5 runs,
    # cached 0.739 median, against 2 of 5 and 0.721 by demand alone)
    homes: bool = True
    # a prompt whose best-cached worker's cache churns (recent demand plus the prompt's
    # uncached tail over its size) moves where it costs least: each uncached token costs 1
    # where it fits and 1 + `churn` where it must evict what other requests will ask for
    # again (0: never move a prompt some worker holds part of)
    churn: float = 2.0

    def __post_init__(self) -> None:
        # out of range, these do not degrade placement: they break it for every new prompt
        # (a negative slack leaves no worker to place on)
        for name in ("new_below", "others"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be within 0..1, got {getattr(self, name)}")
        for name in ("bucket", "slack", "room", "churn"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


class PlacementScorer:
    """Where a new prefix should live. Load spreads requests, but not prefixes: on a fleet
    whose caches are full, the worker that was least loaded at the moment each new prefix
    arrived is effectively random, and a worker that ends up home to more prefixes than its
    cache holds evicts them in turn (measured: groups homed 7/8/8/9 over four workers gave a
    0.654 cached fraction where 8/8/8/8 gave 0.727). So for a new prompt this ranks the
    workers by the new prefixes each homes lately (`homes`, last paragraph), then by their
    recent demand: the blocks their caches stored lately (KV events, decayed with a 60 s
    half-life; the same figure on every router replica) plus this router's own predictions
    of the last few seconds (so one router does not pile a burst of new prefixes on one
    worker before their events arrive).

    Router replicas must agree on where a new prefix goes, or two requests sharing it that
    reach two replicas before its blocks show in the events are prefilled on two workers
    (measured with two replicas: 7-11 of 32 groups split). So the winner is chosen only from
    what every replica sees alike: among the workers in the lowest bucket, the
    rendezvous hash of the prompt's opening blocks picks one; it scores 1, the others at most
    0.3 (by demand), which with the default weights no load or headroom term overturns. Only
    workers running at most `slack` requests more than the least loaded one take part
    (`_running`), so a burst of new prompts spreads instead of queueing on the least
    demanded cache.

    Demand matters only where a cache is short of room. While a cache's recent demand plus
    the new prompt is under `room` of its size, the new prefix goes to the roomy worker
    where its prefill costs least in time (`_cost`): measured on the hot-prefix workload,
    the least demanded cache was the hot prefix's worker (its repeats store few blocks), so
    new prefixes landed there and their cold prefills delayed the hot stream (TTFT p90
    285 -> 262 ms, p99 360 -> 388, mean 96 -> 93, medians of 5 runs, with the warm
    upstream connections in both). Router replicas and processes get `room` 0 unless it is
    configured (`Config.profile`): load reaches the other replicas milliseconds late, and
    they must agree. For a prompt some worker already holds it is neutral (1 for all) and
    the prefix credit decides.

    Workers are ranked first by the blocks of the new prefixes each was sent lately
    (`homes`), counted once at the first prompt, and only then by demand. Demand grows with
    every turn a conversation adds and with every repeat a prefix draws, so a worker whose
    conversations started a moment ago, or whose prefixes happened to be asked for less so
    far, looks light and draws more new ones: two replicas deciding milliseconds apart homed
    multi-turn's conversations 7 / 5 in about half the runs, and one router homed
    vllm-prefix-repetition's 32 prefixes 9 / 8 / 7 / 8 (cached 0.691 against the ideal's
    0.747; what a worker homes beyond its cache it evicts in turn). Every replica counts its
    own new prefixes at the send and its peers' as their placements arrive.

    A prompt some worker holds part of moves only where that worker's cache churns
    (`churn`, `_moved`): sessions that open with one shared system prompt all find it on
    the worker that served the first of them, and each session's own context, stored there
    too, then evicts the others' (measured on agent sessions sharing an 800-token system
    prompt next to retrieval queries, 4 workers: every session on one worker, 3,617 blocks
    evicted there and none elsewhere, cached 0.61 against the ideal's 0.81, TTFT p90 over a
    second against round robin's 0.17). Moving costs the shared part once per worker it
    moves to; after that the shared part is cached there too. Where it may move to is
    judged by what that cache loses, not by its demand (`_loses_blocks`), except a cache
    that holds part of the prompt, which is judged by demand as the holder is: the prompt
    may have left it for that demand, and judged by what it loses the next turn went back
    (agent-sessions, 5 seeds: sessions bounced between two workers up to five times,
    recomputing their own context each time, cached 0.759 against 0.798 without)."""

    name = "placement"

    def __init__(self, params: PlacementParams) -> None:
        self.new_below = params.new_below
        self.bucket = params.bucket
        self.others = params.others
        self.slack = params.slack
        self.room = params.room
        self.homes = params.homes
        self.churn = params.churn

    def score(self, request: ScoreRequest, cands: Sequence[Candidate]) -> dict[str, float]:
        if not cands:
            return {}
        overlaps = ((c.overlap_blocks, c.block_size) for c in cands)
        if is_new_prefix(request.prompt_tokens, overlaps, self.new_below):
            winner = self._placed(request, cands)
        elif (moved := self._moved(request, cands)) is not None:
            winner = moved
        else:
            return {c.name: 1.0 for c in cands}
        most = max(c.recent_blocks for c in cands)
        out = {c.name: self.others * (1 - c.recent_blocks / most if most else 1) for c in cands}
        out[winner.name] = 1.0
        return out

    def _placed(self, request: ScoreRequest, cands: Sequence[Candidate]) -> Candidate:
        """Where a new prefix goes."""
        most = max(c.recent_blocks for c in cands)
        step = self.bucket * most
        homed = self.bucket * max(c.new_blocks for c in cands) if self.homes else 0.0

        def level(c: Candidate) -> tuple[int, int]:
            return (
                int(c.new_blocks // homed) if homed > 0 else 0,
                int(c.recent_blocks // step) if step > 0 else 0,
            )

        free = self._free(cands)
        roomy = [c for c in free if self._has_room(request, c)]
        if roomy:
            return min(roomy, key=lambda c: self._cost(request, c, level(c)))
        low = min(level(c) for c in free)
        tied = [c for c in free if level(c) == low]
        return max(tied, key=lambda c: rendezvous(request.key, c.name))

    def _free(self, cands: Sequence[Candidate]) -> list[Candidate]:
        least = min(_running(c) for c in cands)
        return [c for c in cands if _running(c) <= least + self.slack]

    def _moved(self, request: ScoreRequest, cands: Sequence[Candidate]) -> Candidate | None:
        """Where a prompt some worker holds part of costs least, when that is not the worker
        holding most of it (None: it stays, and the prefix credit decides)."""
        if self.churn <= 0:
            return None
        # ties by the rendezvous hash: the worker list's order differs between replicas
        best = max(cands, key=lambda c: (c.overlap_blocks, rendezvous(request.key, c.name)))
        if not self._churns(request, best):
            return None

        def cost(c: Candidate) -> tuple[float, bool, int]:
            tail = uncached_tokens(request.prompt_tokens, c.overlap_blocks, c.block_size)
            churns = c is best or _loses_blocks(request, c)  # the holder churns, as found
            # a move must cost less: at equal cost the holder keeps it
            return tail * (1 + self.churn * churns), c is not best, -rendezvous(request.key, c.name)

        winner = min([best, *self._free(cands)], key=cost)
        return None if winner is best else winner

    @staticmethod
    def _churns(request: ScoreRequest, c: Candidate) -> bool:
        """The worker's cache cannot keep what it stored lately and this prompt's tail."""
        if not c.capacity_blocks:
            return False
        tail = uncached_tokens(request.prompt_tokens, c.overlap_blocks, c.block_size)
        return c.recent_blocks + tail / c.block_size > c.capacity_blocks

    def _has_room(self, request: ScoreRequest, c: Candidate) -> bool:
        if not c.capacity_blocks:  # unknown size: demand decides, as before it was known
            return False
        need = request.prompt_tokens / c.block_size
        return c.recent_blocks + need <= self.room * c.capacity_blocks

    @staticmethod
    def _cost(
        request: ScoreRequest, c: Candidate, level: tuple[int, int]
    ) -> tuple[int, tuple[int, int], int]:
        """Where a new prompt costs least while caches have room, in prefill tokens: it
        waits for the worker's queued prefills, and its own prefill stalls every request
        running there and about as many arriving while it runs (engines batch every
        waiting prefill into one step). A worker serving a stream of repeats of a hot prefix
        has little prefill queued, but a cold prefill there delays the whole stream. Requests
        running there: `_running` (measured on multi-turn with the moment's count alone:
        three new conversations in a row landed on a worker between its sessions' turns).
        Requests that ride a prefix another one is still prefilling there (`riders`) count
        twice: they queue little prefill of their own, but they run in the engine's next
        step, which this prompt's prefill would join (measured on hot-prefix, 10 seeds: in
        two, a cold prefix placed on the hot prefix's worker in the first wave, where it
        had the least prefill queued, held 10-11 siblings back ~90 ms, TTFT p90 +91-106 ms).
        Ties: the less demanded cache, then the rendezvous hash, as replicas agree."""
        stalled = _running(c) + c.load.riders
        wait = c.load.prefill_tokens + 2 * request.prompt_tokens * stalled
        return (wait, level, -rendezvous(request.key, c.name))


def _loses_blocks(request: ScoreRequest, c: Candidate) -> bool:
    """Whether a worker a prompt would move to churns: its KV events show it storing again
    blocks it evicted lately. Its demand is no measure here: demand counts every stored
    block, one-off query tails too, which an LRU drops harmlessly, so on a busy fleet every
    cache stores more than it holds (measured on agent-sessions: every cache's demand past
    its size within a second, none of them evicting, and a new session then stayed with the
    system prompt on the one cache that did). An approx-mode worker shows no evictions: its
    demand decides. So does it for a cache that holds part of the prompt, as for the holder
    (`PlacementScorer`'s last paragraph): the prompt may have left it for that demand."""
    if c.refetched is not None and c.refetched >= 1.0:
        return True
    if c.refetched is None or c.overlap_blocks > 0:
        return PlacementScorer._churns(request, c)
    return False


def _running(c: Candidate) -> int:
    """Requests a worker runs, for placing a new prefix: the more of the moment's count and
    its last second's average, in whole requests (so that idle workers still tie). A worker
    serving chat sessions runs nothing for the few milliseconds between their turns, and a
    hot prefix's worker little for the moment between its waves: measured on hot-prefix with
    two replicas, the moment's count made that worker the only one within `slack` of the
    least loaded as its first wave ended, and it took a cold prefix whose prefill then
    stalled its stream. The average also moves little between replicas that hear each
    other's requests milliseconds late."""
    return max(c.load.requests, round(c.load.busy))


def rendezvous(key: int, worker: str) -> int:
    """Highest-random-weight hashing: the same on every replica (Python's own str hash is
    salted per process)."""
    digest = hashlib.blake2b(f"{key}:{worker}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class HeadroomScorer:
    name = "headroom"

    def __init__(self, params: NoParams) -> None:
        pass

    def score(self, request: ScoreRequest, cands: Sequence[Candidate]) -> dict[str, float]:
        out: dict[str, float] = {}
        most = max((c.cached_blocks for c in cands), default=0)
        for c in cands:
            if not c.caching:  # an empty cache that can never keep anything is not room
                out[c.name] = 0.0
            elif c.capacity_blocks:
                out[c.name] = 1.0 - min(1.0, c.cached_blocks / c.capacity_blocks)
            else:
                out[c.name] = 1.0 - (c.cached_blocks / most if most else 0.0)
        return out
