"""Routing-quality workloads: small seeded generators, each with its fleet shape.

A workload is waves of chains of requests. The driver runs one wave at a time; inside a
wave at most `concurrency` chains run at once, and a chain's requests run in order (a chat
conversation is one chain, an independent request a chain of one). Every prompt is distinct
(English-like filler from the packaged tokenizer's words, so token counts are real), and
each request names its `group`: the prefix it shares with others, which the ideal pins to a
worker.

  seed                    the seeds' experiment (DESIGN.md section 6): 2 workers x 14,816
                          KV tokens, 12 ~1,500-token prefixes x 6 requests, one at a time
  shared-system           16 system prompts x 12 users, 8 workers whose caches hold ~4 of
                          the prompts each (capacity-bound), 16 in flight
  multi-turn              24 conversations x 5 turns (each turn extends the previous prompt
                          with a reply and a question), 4 workers, 8 conversations at once
  sibling-burst           12 bursts of 8 requests sharing one new 1,500-token prefix, each
                          burst sent at once (0 overlap is known before the first event)
  hot-prefix              half of 192 requests on one prefix, the rest on 12 others, 32 in
                          flight on 4 workers: the hot prefix must spill (the ideal puts
                          it on two workers; at the engines' default batch of 64 one
                          worker still runs its stream at once: hot-prefix-full-batch
                          caps them at 12)
  hot-prefix-full-batch   hot-prefix on engines that run 12 requests at most at once
                          (vLLM's --max-num-seqs): the hot stream cannot all run on one
                          worker, so one that keeps it queues
  long-short-mix          4 6,000-token documents x 8 next to 160 short prompts on 8
                          300-token templates, 16 in flight, 4 workers
  vllm-prefix-repetition  vLLM's `prefix_repetition` as the issue ran it: 32 prefixes x
                          2,000 tokens + 100-token suffixes, 320 prompts, 16 in flight,
                          output 16, four workers with 1,000 KV blocks each
  agent-sessions          8 agent sessions x 6 turns, all opening with one 800-token system
                          prompt and growing by a tool result and a reply each turn, next
                          to 60 retrieval queries over 5 documents (one asked 3 times as
                          often), 12 in flight, 4 workers whose caches hold ~6,400 tokens

`scale` (0..1] shrinks counts and lengths for tests. The order of requests depends on the
run's seed; the texts do not (the same prompts in another order).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from router.textgen import filler
from router.tokenize import PACKAGED_TOKENIZER, LocalTokenizer

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Request:
    prompt: str
    group: str  # the shared prefix (or conversation) this request belongs to
    max_tokens: int


Chain = list[Request]


@dataclass
class Workload:
    name: str
    workers: int
    kv_blocks: int  # per worker, vLLM's null block included
    concurrency: int
    waves: list[list[Chain]]
    block_size: int = BLOCK_SIZE
    replicas: dict[str, int] = field(default_factory=dict)  # group -> workers in the ideal
    vllm_dataset: tuple[str, ...] = ()  # the same workload as `vllm bench serve` flags
    seed: int = 0  # the run seed the order came from
    sim_args: tuple[str, ...] = ()  # extra `kvroute fleet` flags this workload needs

    @property
    def requests(self) -> list[Request]:
        return [r for wave in self.waves for chain in wave for r in chain]


@dataclass
class Texts:
    """Deterministic distinct texts; tokenizer shared across generators."""

    tok: LocalTokenizer
    rng: random.Random

    def make(self, tokens: int, head: str) -> str:
        return filler(self.tok, max(tokens, 1), self.rng, head=head)


def _n(value: int, scale: float, least: int = 1) -> int:
    return max(least, round(value * scale))


def _shuffled(items: list[Chain], seed: int) -> list[Chain]:
    out = list(items)
    random.Random(seed).shuffle(out)
    return out


def seed_workload(t: Texts, run_seed: int, scale: float = 1.0) -> Workload:
    prefixes, repeats = _n(12, scale, 2), _n(6, scale, 2)
    docs = [t.make(_n(1500, scale, 32), f"Document {i}: ") for i in range(prefixes)]
    order = [(p, k) for p in range(prefixes) for k in range(repeats)]
    random.Random(run_seed).shuffle(order)
    chains = [
        [Request(f"{docs[p]}\nQuestion {k}: what does section {k} say?", f"doc{p}", 8)]
        for p, k in order
    ]
    # 14,816 tokens per worker at full scale: half of the prefixes fit on each
    kv = 926 if scale >= 1 else max(8, round(926 * scale * 0.9))
    return Workload("seed", 2, kv, 1, [chains])


def shared_system(t: Texts, run_seed: int, scale: float = 1.0) -> Workload:
    systems, users = _n(16, scale, 2), _n(12, scale, 2)
    sys_prompts = [t.make(_n(1200, scale, 32), f"System {i}: agent {i}. ") for i in range(systems)]
    chains = [
        [Request(f"{sys_prompts[s]}\nUser {u}: {t.make(_n(150, scale), '')}", f"sys{s}", 16)]
        for s in range(systems)
        for u in range(users)
    ]
    return Workload("shared-system", 8, _n(320, scale, 8), 16, [_shuffled(chains, run_seed)])


def multi_turn(t: Texts, run_seed: int, scale: float = 1.0) -> Workload:
    convs, turns = _n(24, scale, 2), _n(5, scale, 2)
    chains: list[Chain] = []
    for c in range(convs):
        prompt = t.make(_n(400, scale, 16), f"Conversation {c}: ")
        chain = []
        for _ in range(turns):
            prompt += f"\nUser: {t.make(_n(60, scale, 4), '')}\nAssistant:"
            chain.append(Request(prompt, f"conv{c}", 16))
            prompt += " " + t.make(_n(60, scale, 4), "")  # the reply the next turn carries
        chains.append(chain)
    return Workload("multi-turn", 4, _n(400, scale, 8), 8, [_shuffled(chains, run_seed)])


def sibling_burst(t: Texts, run_seed: int, scale: float = 1.0) -> Workload:
    bursts, siblings = _n(12, scale, 2), _n(8, scale, 2)
    waves = []
    for b in range(bursts):
        prefix = t.make(_n(1500, scale, 32), f"Burst {b} shared context: ")
        wave = [
            [Request(f"{prefix}\nTask {s}: {t.make(_n(50, scale), '')}", f"burst{b}", 16)]
            for s in range(siblings)
        ]
        waves.append(wave)
    random.Random(run_seed).shuffle(waves)
    return Workload("sibling-burst", 4, _n(926, scale, 8), siblings, waves)


def hot_prefix(t: Texts, run_seed: int, scale: float = 1.0) -> Workload:
    total, others = _n(192, scale, 8), _n(12, scale, 2)
    docs = [t.make(_n(1500, scale, 32), f"Prefix {i}: ") for i in range(others + 1)]
    chains = []
    for k in range(total):
        p = 0 if k % 2 == 0 else 1 + (k // 2) % others
        chains.append([Request(f"{docs[p]}\nAsk {k}: {t.make(_n(100, scale), '')}", f"p{p}", 32)])
    w = Workload("hot-prefix", 4, _n(926, scale, 8), 32, [_shuffled(chains, run_seed)])
    w.replicas["p0"] = 2  # half the traffic: half the fleet
    return w


def hot_prefix_full_batch(t: Texts, run_seed: int, scale: float = 1.0) -> Workload:
    """hot-prefix on engines that run at most 12 requests at once (vLLM's --max-num-seqs):
    the hot prefix's ~16 requests in flight cannot all run on one worker, and what its
    worker cannot run waits in its queue (docs/bench/history.md, "Hot-prefix with the
    engines' batch full")."""
    w = hot_prefix(t, run_seed, scale)
    w.name = "hot-prefix-full-batch"
    w.sim_args = ("--max-batch", "12")
    return w


def long_short_mix(t: Texts, run_seed: int, scale: float = 1.0) -> Workload:
    longs, long_repeats = _n(4, scale, 1), _n(8, scale, 2)
    templates, shorts = _n(8, scale, 2), _n(160, scale, 4)
    docs = [t.make(_n(6000, scale, 64), f"Long document {i}: ") for i in range(longs)]
    temps = [t.make(_n(300, scale, 16), f"Template {i}: ") for i in range(templates)]
    chains = [
        [Request(f"{docs[d]}\nSummarize part {k}.", f"long{d}", 16)]
        for d in range(longs)
        for k in range(long_repeats)
    ]
    chains += [
        [
            Request(
                f"{temps[k % templates]}\n{t.make(_n(40, scale), f'Item {k}: ')}",
                f"t{k % templates}",
                16,
            )
        ]
        for k in range(shorts)
    ]
    w = Workload("long-short-mix", 4, _n(926, scale, 8), 16, [_shuffled(chains, run_seed)])
    w.sim_args = ("--max-model-len", "8192")  # the packaged tokenizer says 4,096
    return w


@dataclass(frozen=True)
class Repetition:
    """The shape of a prefix-repetition workload: `prefixes` shared prefixes, each sent
    `per_prefix` times with a distinct suffix, in shuffled order, `concurrency` in flight."""

    prefixes: int
    per_prefix: int
    prefix_len: int
    suffix_len: int
    concurrency: int
    workers: int
    kv_blocks: int
    block_size: int = BLOCK_SIZE
    output_len: int = 16


def prefix_repetition(t: Texts, run_seed: int, shape: Repetition, name: str) -> Workload:
    """vLLM's `prefix_repetition` dataset, with the bench's distinct English-like texts."""
    s = shape
    docs = [t.make(s.prefix_len, f"Prefix {i}: ") for i in range(s.prefixes)]
    chains = [
        [Request(f"{docs[p]}\n{t.make(s.suffix_len, f'Suffix {p}.{k}: ')}", f"p{p}", s.output_len)]
        for p in range(s.prefixes)
        for k in range(s.per_prefix)
    ]
    waves = [_shuffled(chains, run_seed)]
    return Workload(name, s.workers, s.kv_blocks, s.concurrency, waves, s.block_size)


def vllm_prefix_repetition(t: Texts, run_seed: int, scale: float = 1.0) -> Workload:
    prefixes, per_prefix = _n(32, scale, 2), _n(10, scale, 2)
    prefix_len, suffix_len = _n(2000, scale, 32), _n(100, scale)
    kv = 1000 if scale >= 1 else _n(1000, scale, 8)
    shape = Repetition(prefixes, per_prefix, prefix_len, suffix_len, 16, 4, kv)
    w = prefix_repetition(t, run_seed, shape, "vllm-prefix-repetition")
    w.vllm_dataset = (
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(prefix_len),
        "--prefix-repetition-suffix-len", str(suffix_len),
        "--prefix-repetition-num-prefixes", str(prefixes),
        "--prefix-repetition-output-len", "16",
    )  # fmt: skip
    return w


def agent_sessions(t: Texts, run_seed: int, scale: float = 1.0) -> Workload:
    """Sessions that share only their opening (the system prompt) and then grow their own
    context: the worker that served the first session holds the opening, so a router that
    follows the longest cached prefix sends every session there, whose cache then churns."""
    sessions, turns, queries = _n(8, scale, 2), _n(6, scale, 2), _n(60, scale, 4)
    system = t.make(_n(800, scale, 32), "You are an agent with tools: ")
    chains: list[Chain] = []
    for a in range(sessions):
        context = f"{system}\n{t.make(_n(300, scale, 8), f'Session {a} task: ')}"
        chain = []
        for turn in range(turns):
            context += f"\nTool result {turn}: {t.make(_n(120, scale, 4), '')}"
            chain.append(Request(f"{context}\nAssistant:", f"agent{a}", 24))
            context += " " + t.make(_n(40, scale, 2), "")  # the reply the next turn carries
        chains.append(chain)
    docs = [t.make(_n(1200, scale, 32), f"Retrieved document {d}: ") for d in range(5)]
    asked = random.Random("agent-sessions/queries")  # which document: texts, not the order
    for q in range(queries):
        d = asked.choice([0, 0, 0, 1, 1, 2, 3, 4])
        prompt = f"{docs[d]}\nQuestion: {t.make(_n(40, scale), f'Q{q} ')}"
        chains.append([Request(prompt, f"doc{d}", 16)])
    kv = 400 if scale >= 1 else _n(400, scale, 8)
    return Workload("agent-sessions", 4, kv, 12, [_shuffled(chains, run_seed)])


GENERATORS: dict[str, Callable[[Texts, int, float], Workload]] = {
    "seed": seed_workload,
    "shared-system": shared_system,
    "multi-turn": multi_turn,
    "sibling-burst": sibling_burst,
    "hot-prefix": hot_prefix,
    "hot-prefix-full-batch": hot_prefix_full_batch,
    "long-short-mix": long_short_mix,
    "vllm-prefix-repetition": vllm_prefix_repetition,
    "agent-sessions": agent_sessions,
}
# one line each for `kvroute bench routing --help` (the module docstring says more)
SUMMARIES = {
    "seed": "the seeds' experiment: 12 prefixes x 6 requests, 2 workers",
    "shared-system": "16 system prompts x 12 users, 8 capacity-bound workers",
    "multi-turn": "24 conversations x 5 turns, each extending the last",
    "sibling-burst": "bursts of 8 requests on one new prefix, sent at once",
    "hot-prefix": "half the requests on one prefix: it must spill over workers",
    "hot-prefix-full-batch": "hot-prefix on engines running 12 requests at most at once",
    "long-short-mix": "6,000-token documents next to short templated prompts",
    "vllm-prefix-repetition": "vLLM's prefix_repetition: 32 x 2,000-token prefixes, tight",
    "agent-sessions": "agent sessions sharing one system prompt, plus retrieval",
}


def texts_for(name: str) -> Texts:
    """The text source of workload `name`: the same texts for every run seed."""
    return Texts(LocalTokenizer(PACKAGED_TOKENIZER), random.Random(f"{name}/texts"))


def build(name: str, run_seed: int, scale: float = 1.0) -> Workload:
    """The named workload; the same texts for every run seed, only their order differs."""
    w = GENERATORS[name](texts_for(name), run_seed, scale)
    w.seed = run_seed
    return w
