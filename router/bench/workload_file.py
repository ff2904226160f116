"""Your own workload for `kvroute bench routing --workload-file F`: a JSON-lines file, one
request per line, after an optional first line that sets the fleet's shape.

    {"workload": "support-bot", "workers": 4, "kv_blocks": 926, "concurrency": 16}
    {"prompt": "You are the support agent of ... User: where is my order?", "group": "support"}
    {"prompt": "Conversation 7 ... User: hi\\nAssistant:", "chain": "conv-7", "max_tokens": 32}
    {"prompt": "Conversation 7 ... User: hi\\nAssistant: hello\\nUser: ...", "chain": "conv-7"}
    {"prompt": "...", "wave": 1}

Header (every key optional): `workload` (the name in the report; the file's stem),
`workers` (4), `kv_blocks` per worker, vLLM's null block included (926: ~14,800 tokens),
`concurrency` (chains in flight, 16), `block_size` (16), `max_model_len` (the simulated
engines' limit; the packaged tokenizer's 4,096), `max_num_seqs` (the requests each engine
runs at once, vLLM's --max-num-seqs; the simulator's 64), `shuffle` (true: each run seed orders the
chains of a wave differently, as the built-in workloads do; false: file order every run),
`replicas` ({group: workers the ideal spreads that group over}).

Request keys: `prompt` (the completion prompt text), `max_tokens` (16), `chain` (requests
naming the same chain run one after another in file order: a conversation's turns), `wave`
(0; a wave starts when the one before has finished) and `group`: the prefix the request
shares, which the ideal pins to one worker. `group` defaults to the chain; a request with
neither is grouped with the requests whose first 256 tokens are its own.

Token counts are the packaged tokenizer's, which the simulated engines use. A file is checked
whole before anything starts; each error names the line and the fix.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.sim.make_tokenizer import MODEL_MAX_LENGTH
from router.bench.workloads import BLOCK_SIZE, Request, Workload, _shuffled
from router.tokenize import PACKAGED_TOKENIZER, LocalTokenizer

GROUP_TOKENS = 256  # an ungrouped request's group: the prompts sharing this many first tokens
DEFAULT_KV_BLOCKS = 926
DEFAULT_MAX_TOKENS = 16
HEADER = {
    "workload": str,
    "workers": int,
    "kv_blocks": int,
    "concurrency": int,
    "block_size": int,
    "max_model_len": int,
    "max_num_seqs": int,
    "shuffle": bool,
    "replicas": dict,
}
REQUEST = {"prompt": str, "group": str, "max_tokens": int, "chain": str, "wave": int}
LEAST = {
    "workers": 1,
    "kv_blocks": 2,
    "concurrency": 1,
    "block_size": 1,
    "max_model_len": 2,
    "max_num_seqs": 1,
}


class WorkloadFileError(ValueError):
    """A workload file that cannot run; the message names the file, the line and the fix."""


@dataclass(frozen=True)
class FileWorkload:
    name: str
    workers: int
    kv_blocks: int
    concurrency: int
    block_size: int
    waves: tuple[tuple[tuple[Request, ...], ...], ...]  # in file order
    shuffle: bool = True
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    replicas: dict[str, int] = field(default_factory=dict)

    def build(self, run_seed: int) -> Workload:
        """The workload of one run: the file's chains, in an order of the run's seed."""
        waves = [[list(chain) for chain in wave] for wave in self.waves]
        if self.shuffle:
            waves = [_shuffled(wave, run_seed) for wave in waves]
        w = Workload(
            self.name, self.workers, self.kv_blocks, self.concurrency, waves, self.block_size
        )
        w.replicas = dict(self.replicas)
        w.seed = run_seed
        flags: tuple[str, ...] = ()
        if self.max_model_len is not None:
            flags += ("--max-model-len", str(self.max_model_len))
        if self.max_num_seqs is not None:
            flags += ("--max-batch", str(self.max_num_seqs))
        w.sim_args = flags
        return w


def load(path: Path, tok: LocalTokenizer | None = None) -> FileWorkload:
    """Read and check a workload file (every line, every prompt's length)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadFileError(f"{path}: cannot read it: {exc}") from None
    docs = [(n, _object(path, n, text)) for n, text in enumerate(lines, 1) if text.strip()]
    if not docs:
        raise WorkloadFileError(f"{path}: no requests (one JSON object per line, see --help)")
    header: dict[str, Any] = {}
    if "prompt" not in docs[0][1]:
        n, header = docs.pop(0)
        _check_keys(path, n, header, HEADER, "header")
        _check_header(path, n, header)
    if not docs:
        raise WorkloadFileError(f"{path}: a header but no requests")
    shape = _shape(path, header)
    requests = [
        (n, doc.get("wave", 0), doc.get("chain"), _request(path, n, doc)) for n, doc in docs
    ]
    seen = _measure(requests, tok or LocalTokenizer(PACKAGED_TOKENIZER))
    _check_lengths(path, requests, shape, seen)
    return FileWorkload(
        waves=_waves(path, requests, seen),
        shuffle=header.get("shuffle", True),
        replicas=dict(header.get("replicas", {})),
        **shape,
    )


def dump(w: Workload, path: Path, taken: Iterable[str] = ()) -> None:
    """Write a workload as a file `load` reads back: this run's order (`shuffle` false),
    chains and waves named, every request's group. Named after the file, so that it runs
    next to the workload it came from (`taken`: names already in use)."""
    name = path.stem if path.stem not in set(taken) else f"{path.stem}-file"
    header: dict[str, Any] = {
        "workload": name,
        "workers": w.workers,
        "kv_blocks": w.kv_blocks,
        "concurrency": w.concurrency,
        "block_size": w.block_size,
        "shuffle": False,
    }
    flags = dict(zip(w.sim_args[::2], w.sim_args[1::2], strict=False))
    if "--max-model-len" in flags:
        header["max_model_len"] = int(flags["--max-model-len"])
    if "--max-batch" in flags:
        header["max_num_seqs"] = int(flags["--max-batch"])
    if w.replicas:
        header["replicas"] = w.replicas
    with path.open("w", encoding="utf-8") as f:
        f.write(json.dumps(header) + "\n")
        for line in _request_lines(w):
            f.write(json.dumps(line, ensure_ascii=False) + "\n")


def _request_lines(w: Workload) -> Iterable[dict[str, Any]]:
    for i, wave in enumerate(w.waves):
        for j, chain in enumerate(wave):
            for r in chain:
                line: dict[str, Any] = {"prompt": r.prompt, "group": r.group}
                line["max_tokens"] = r.max_tokens
                if len(chain) > 1:
                    line["chain"] = f"w{i}c{j}"
                if i:
                    line["wave"] = i
                yield line


# ---- checks -------------------------------------------------------------------------------


def _object(path: Path, n: int, text: str) -> dict[str, Any]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise WorkloadFileError(f"{path}:{n}: not JSON ({exc.msg}, column {exc.colno})") from None
    if not isinstance(doc, dict):
        raise WorkloadFileError(f"{path}:{n}: each line must be a JSON object")
    return doc


def _check_keys(path: Path, n: int, doc: dict[str, Any], kinds: dict[str, type], what: str) -> None:
    unknown = sorted(set(doc) - set(kinds))
    if unknown:
        known = ", ".join(kinds)
        raise WorkloadFileError(f"{path}:{n}: unknown {what} key {unknown[0]!r} (known: {known})")
    for key, kind in kinds.items():
        value = doc.get(key)
        # bool is an int to Python; a count given as true is a mistake
        wrong = isinstance(value, bool) and kind is int
        if key in doc and (wrong or not isinstance(value, kind)):
            raise WorkloadFileError(f"{path}:{n}: {key!r} must be a JSON {_json_type(kind)}")


def _json_type(kind: type) -> str:
    return {str: "string", int: "integer", bool: "true or false", dict: "object"}[kind]


def _check_header(path: Path, n: int, header: dict[str, Any]) -> None:
    for key, least in LEAST.items():
        if key in header and header[key] < least:
            raise WorkloadFileError(f"{path}:{n}: {key!r} must be at least {least}")
    for group, count in header.get("replicas", {}).items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise WorkloadFileError(
                f"{path}:{n}: replicas[{group!r}] must be a whole number of workers >= 1"
            )


def _shape(path: Path, header: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": header.get("workload") or path.stem,
        "workers": header.get("workers", 4),
        "kv_blocks": header.get("kv_blocks", DEFAULT_KV_BLOCKS),
        "concurrency": header.get("concurrency", 16),
        "block_size": header.get("block_size", BLOCK_SIZE),
        "max_model_len": header.get("max_model_len"),
        "max_num_seqs": header.get("max_num_seqs"),
    }


def _request(path: Path, n: int, doc: dict[str, Any]) -> Request:
    _check_keys(path, n, doc, REQUEST, "request")
    if not doc["prompt"]:
        raise WorkloadFileError(f"{path}:{n}: 'prompt' is empty")
    max_tokens = doc.get("max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens < 1 or doc.get("wave", 0) < 0:
        raise WorkloadFileError(f"{path}:{n}: 'max_tokens' must be >= 1 and 'wave' >= 0")
    for key in ("group", "chain"):
        if key in doc and not doc[key]:
            raise WorkloadFileError(f"{path}:{n}: {key!r} is empty (leave it out instead)")
    group = doc.get("group") or doc.get("chain") or ""
    return Request(doc["prompt"], group, max_tokens)


Numbered = tuple[int, int, str | None, Request]  # line, wave, chain, request
Seen = dict[str, tuple[int, str]]  # prompt -> its tokens, the group of its opening tokens


def _measure(requests: list[Numbered], tok: LocalTokenizer) -> Seen:
    """Each distinct prompt tokenized once: its length, and the group its opening names
    (kept instead of the ids, so a large file is not held as token lists)."""
    seen: Seen = {}
    for _, _, _, r in requests:
        if r.prompt not in seen:
            ids = tok.completion(r.prompt)
            head = repr(ids[:GROUP_TOKENS]).encode()
            seen[r.prompt] = (
                len(ids),
                "opening-" + hashlib.blake2b(head, digest_size=6).hexdigest(),
            )
    return seen


def _check_lengths(path: Path, requests: list[Numbered], shape: dict[str, Any], seen: Seen) -> None:
    """What the simulated engines would refuse, refused here with the header key to raise."""
    cap = (shape["kv_blocks"] - 1) * shape["block_size"]
    limit = min(shape["max_model_len"] or MODEL_MAX_LENGTH, cap)
    fix = "raise 'max_model_len' in the header" if limit < cap else "raise 'kv_blocks'"
    for n, _, _, r in requests:
        need = seen[r.prompt][0] + r.max_tokens
        if need > limit:
            raise WorkloadFileError(
                f"{path}:{n}: the prompt and max_tokens need {need} tokens, over the "
                f"engines' {limit}; {fix}, or shorten the prompt"
            )


def _waves(
    path: Path, requests: list[Numbered], seen: Seen
) -> tuple[tuple[tuple[Request, ...], ...], ...]:
    """Chains in the order of their first request, per wave; a chain stays in one wave."""
    waves: dict[int, dict[object, list[Request]]] = {}
    wave_of: dict[str, tuple[int, int]] = {}
    for n, wave, chain, r in requests:
        if chain is not None:
            first = wave_of.setdefault(chain, (wave, n))
            if first[0] != wave:
                raise WorkloadFileError(
                    f"{path}:{n}: chain {chain!r} is in wave {first[0]} on line {first[1]}, "
                    f"here in wave {wave}; a chain's requests run in one wave"
                )
        if not r.group:
            r = Request(r.prompt, seen[r.prompt][1], r.max_tokens)
        key: object = chain if chain is not None else ("line", n)
        waves.setdefault(wave, {}).setdefault(key, []).append(r)
    return tuple(tuple(tuple(c) for c in waves[k].values()) for k in sorted(waves))
