"""The capacity-aware ideal of a workload: the cached-token fraction a router with perfect
affinity would get from engines with these caches, replayed in a simplified order. It is a
reference, not a bound: measured placements can do a little better (on hot-prefix the
engines' own order and batching do) or worse (blocks that running requests hold).

Placement: each group (shared prefix, conversation) lives on one worker; a group the
workload marks for `replicas` workers alternates over that many, request by request. Two
placements are replayed and the better kept: groups spread so every worker gets about the
same prompt tokens (largest first), and groups spread by their cache footprint (largest
first onto the worker with the most cache left), which wins where prefixes differ in length
and in demand. Caches: per worker an LRU of `kv_blocks - 1` blocks (vLLM's null block
excluded), keyed by the real chained token blocks; a request hits its leading blocks present
(capped below its last token, as vLLM serves), then touches its blocks tail first so the
head is the last to go, as vLLM frees them.

Order (`replay_order`): wave by wave, the chains in fixed batches of `concurrency`, each
batch interleaved turn by turn (every chain's first request, then every second one, ...)
and finished before the next batch starts. The driver instead keeps `concurrency` chains in
flight and starts the next chain as soon as any one ends, so its order differs where chains
differ in length or speed. Requests are replayed one at a time: blocks held by running
requests and generated tokens are left out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from router.bench.workloads import Request, Workload
from router.tokenize import PACKAGED_TOKENIZER, LocalTokenizer


def ideal_fraction(w: Workload, tok: LocalTokenizer | None = None) -> float:
    return best_placement(w, tok)[1]


def best_placement(w: Workload, tok: LocalTokenizer | None = None) -> tuple[list[int], float]:
    """The better of the two placements (`placement`, `placement_by_footprint`) by the
    replay, with its cached fraction: even prompt tokens suit groups of one size, even
    cache footprints groups whose prefixes differ in length and in demand."""
    tok = tok or LocalTokenizer(PACKAGED_TOKENIZER)
    order = replay_order(w)
    ids = {r.prompt: tok.completion(r.prompt) for r in order}
    lengths = {p: len(t) for p, t in ids.items()}
    candidates = [placement(w, lengths, order), placement_by_footprint(w, lengths, order)]
    scored = [(replay(w, order, ids, place), place) for place in candidates]
    fraction, place = max(scored, key=lambda s: s[0])  # the first on a tie
    return place, fraction


def replay(
    w: Workload, order: Sequence[Request], ids: dict[str, list[int]], place: list[int]
) -> float:
    """The cached-token fraction of `order` with request i on worker `place[i]`."""
    caches = [Lru(w.kv_blocks - 1) for _ in range(w.workers)]
    cached = prompt = 0
    for i, r in enumerate(order):
        tokens = ids[r.prompt]
        blocks = chained_blocks(tokens, w.block_size)
        hit = caches[place[i]].touch(blocks)
        cached += min(hit * w.block_size, (len(tokens) - 1) // w.block_size * w.block_size)
        prompt += len(tokens)
    return cached / max(prompt, 1)


def oracle_route(w: Workload, tok: LocalTokenizer | None = None) -> Callable[[Request], int]:
    """The ideal's placement as a router: request -> worker index (the `oracle` row sends
    each request straight to that worker). Keyed by the text and how many times it was asked
    before: a text a workload file repeats in a group spread over replicas alternates as
    the ideal's copies do, where a key of the text alone sent every copy to one worker."""
    order = replay_order(w)
    place, _ = best_placement(w, tok)
    homes: dict[str, list[int]] = {}
    for i, r in enumerate(order):
        homes.setdefault(r.prompt, []).append(place[i])
    asked: dict[str, int] = {}

    def route(r: Request) -> int:
        n = asked.get(r.prompt, 0)
        asked[r.prompt] = n + 1
        copies = homes[r.prompt]
        return copies[n % len(copies)]

    return route


def replay_order(w: Workload) -> list[Request]:
    out: list[Request] = []
    for wave in w.waves:
        for start in range(0, len(wave), w.concurrency):
            batch = wave[start : start + w.concurrency]
            for turn in range(max(len(c) for c in batch)):
                out += [c[turn] for c in batch if turn < len(c)]
    return out


def placement(w: Workload, lengths: dict[str, int], order: Sequence[Request]) -> list[int]:
    """Worker index per request in `order`: groups largest first onto the least loaded."""
    weight: dict[str, int] = {}
    for r in order:
        weight[r.group] = weight.get(r.group, 0) + lengths[r.prompt]
    load = [0.0] * w.workers
    homes: dict[str, list[int]] = {}
    for group in sorted(weight, key=lambda g: (-weight[g], g)):
        n = min(w.replicas.get(group, 1), w.workers)
        chosen = sorted(range(w.workers), key=lambda i: (load[i], i))[:n]
        for i in chosen:
            load[i] += weight[group] / n
        homes[group] = chosen
    return per_request(homes, order)


def placement_by_footprint(
    w: Workload, lengths: dict[str, int], order: Sequence[Request]
) -> list[int]:
    """Worker index per request in `order`: groups by their cache footprint (their longest
    prompt, in blocks), largest first, onto the worker with the most cache left, then the
    fewest prompt tokens: a long prefix asked a few times gets room of its own where the
    token-balanced placement stacks two of them on one cache."""
    footprint: dict[str, int] = {}
    weight: dict[str, int] = {}
    for r in order:
        blocks = -(-lengths[r.prompt] // w.block_size)
        footprint[r.group] = max(footprint.get(r.group, 0), blocks)
        weight[r.group] = weight.get(r.group, 0) + lengths[r.prompt]
    room = [float(w.kv_blocks - 1)] * w.workers
    load = [0.0] * w.workers
    homes: dict[str, list[int]] = {}
    for group in sorted(footprint, key=lambda g: (-footprint[g], -weight[g], g)):
        n = min(w.replicas.get(group, 1), w.workers)
        chosen = sorted(range(w.workers), key=lambda i: (-room[i], load[i], i))[:n]
        for i in chosen:
            room[i] -= footprint[group]
            load[i] += weight[group] / n
        homes[group] = chosen
    return per_request(homes, order)


def per_request(homes: dict[str, list[int]], order: Sequence[Request]) -> list[int]:
    """Worker index per request in `order`: its group's home, alternating over a group's
    homes request by request."""
    seen: dict[str, int] = {}
    out = []
    for r in order:
        k = seen.get(r.group, 0)
        seen[r.group] = k + 1
        out.append(homes[r.group][k % len(homes[r.group])])
    return out


def chained_blocks(tokens: Sequence[int], block_size: int) -> list[int]:
    out: list[int] = []
    parent = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        out.append(parent)
    return out


class Lru:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def touch(self, blocks: list[int]) -> int:
        """Leading blocks present, then all of them become the most recent, head last."""
        hit = 0
        while hit < len(blocks) and blocks[hit] in self.blocks:
            hit += 1
        for b in reversed(blocks):
            self.blocks[b] = None
            self.blocks.move_to_end(b)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        return hit
