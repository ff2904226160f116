"""A prefill -> decode handoff by hand, over raw HTTP, between two engines with vLLM's
NixlConnector: two real vLLM 0.32 CPU engines (`--target vllm`) or two simulated workers
(`--target sim`). No router: this is what a router must do, and the evidence it can use.

For each prompt: the unsplit greedy text and TTFT on the (cache-reset) decode engine; then
the prefill leg on the prefill engine (`max_tokens=1`, `kv_transfer_params.do_remote_decode`)
and the decode leg on the (cache-reset) decode engine with the returned params. Checked:
the split text equals the unsplit text; the decode engine's /metrics prove the pull
(`vllm:nixl_bytes_transferred` grew, `prompt_tokens_by_source{source="external_kv_transfer"}`
grew by about the prompt length); a decode leg stripped of its params answers 200 and
recomputes (`local_compute` grows, nothing moves) while the prefill engine holds the orphaned
blocks (its `vllm:kv_cache_usage_perc` > 0) until the lease ends.
The engines are started by `conformance.pd_engines` (with the real-vLLM gotchas handled).

    python -m conformance.pd_harness --target vllm --json out/pd-vllm.json
    python -m conformance.pd_harness --target sim

From a check: `with pd_pair("vllm") as pair: report = run_handoffs(pair)`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import zmq

from conformance.client import LIMITS
from conformance.pd_engines import PDPair, pd_pair
from conformance.targets import DEFAULT_MODEL_DIR
from engines.sim.pd_metrics import PDSnapshot, pd_snapshot
from engines.vllm.events import BlockStored, decode_wire

DEFAULT_TOKENS = (256, 1024, 3000)
MAX_TOKENS = 16


# ---- the two legs, by hand ----------------------------------------------------------------


@dataclass
class Leg:
    status: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # vLLM's return_token_ids
    ttft_s: float | None = None
    latency_s: float = 0.0
    error: str | None = None
    pd_header: str = ""  # kvroute's x-kvroute-pd answer header, when sent through the router

    def same_output(self, other: Leg) -> bool:
        """Greedy outputs agree: by token ids where the engine returns them (a random tiny
        model's tokens may decode to no text at all), else by non-empty text."""
        if self.token_ids or other.token_ids:
            return self.token_ids == other.token_ids
        return bool(self.text) and self.text == other.text


def prefill_leg(
    client: httpx.Client, pair: PDPair, prompt: str, rid: str
) -> tuple[dict[str, Any] | None, float]:
    """The router's first leg: stream off, one token, `do_remote_decode`. Returns the params
    the prefill engine hands back (None if it gave none) and the leg's latency."""
    body = {
        "model": pair.model,
        "prompt": prompt,
        "max_tokens": 1,
        "stream": False,
        "temperature": 0.0,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    start = time.perf_counter()
    r = client.post(pair.prefill.url + "/v1/completions", json=body, headers={"X-Request-Id": rid})
    elapsed = time.perf_counter() - start
    r.raise_for_status()
    params: dict[str, Any] | None = r.json().get("kv_transfer_params")
    return params, elapsed


def decode_leg(
    client: httpx.Client, url: str, model: str, prompt: str, params: dict[str, Any] | None, rid: str
) -> Leg:
    """The client's own request (streamed, greedy), plus the params unchanged."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    start = time.perf_counter()
    leg = Leg(status=0)
    with client.stream(
        "POST", url + "/v1/completions", json=body, headers={"X-Request-Id": rid}
    ) as r:
        leg.status = r.status_code
        leg.pd_header = r.headers.get("x-kvroute-pd", "")
        for line in r.iter_lines():
            _take_sse(leg, line, start)
    leg.latency_s = time.perf_counter() - start
    return leg


def _take_sse(leg: Leg, line: str, start: float) -> None:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return
    chunk = json.loads(line[len("data: ") :])
    if "error" in chunk:
        leg.error = str(chunk["error"].get("message"))
        return
    for choice in chunk.get("choices", []):
        ids = choice.get("token_ids") or []
        if (choice.get("text") or ids) and leg.ttft_s is None:
            leg.ttft_s = time.perf_counter() - start
        leg.text += choice.get("text") or ""
        leg.token_ids += ids


def snapshot(client: httpx.Client, url: str) -> PDSnapshot:
    return pd_snapshot(client.get(url + "/metrics").text)


def kv_usage(client: httpx.Client, url: str) -> float:
    for line in client.get(url + "/metrics").text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def reset_cache(client: httpx.Client, url: str) -> bool:
    r = client.post(url + "/reset_prefix_cache")
    return r.status_code == 200 and r.json().get("success", True) is not False


def replayed(endpoint: str) -> list[tuple[int, list[BlockStored]]]:
    """(sequence, BlockStored events) of every batch the engine still buffers."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    out: list[tuple[int, list[BlockStored]]] = []
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        while sock.poll(5000):
            frames = sock.recv_multipart()
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq < 0:
                break
            batch, _ = decode_wire(frames[3])
            out.append((seq, [e for e in batch.events if isinstance(e, BlockStored)]))
    finally:
        sock.close()
        ctx.term()
    return out


def stored_tokens_since(endpoint: str, after_seq: int) -> list[int]:
    """Token ids of the blocks the engine published as stored after `after_seq`."""
    batches = [events for seq, events in replayed(endpoint) if seq > after_seq]
    return [t for events in batches for e in events for t in e.token_ids]


def last_seq(endpoint: str) -> int:
    return max((seq for seq, _ in replayed(endpoint)), default=-1)


def prompt_of(words: int, tag: str) -> str:
    return " ".join(f"{tag}{i % 97} item{i}" for i in range(words))


def prompt_for(client: httpx.Client, pair: PDPair, tokens: int, tag: str) -> str:
    """A prompt of about `tokens` tokens in this engine's tokenizer (within a few %)."""
    words = max(tokens // 4, 1)
    for _ in range(3):
        n = _prompt_tokens(client, pair.decode.url, pair.model, prompt_of(words, tag))
        if abs(n - tokens) <= max(tokens // 50, 2):
            break
        words = max(int(words * tokens / n), 1)
    return prompt_of(words, tag)


# ---- what is measured and checked ---------------------------------------------------------


@dataclass
class HandoffResult:
    prompt_tokens: int
    text_equal: bool
    split_text: str
    unsplit_text: str
    unsplit_ttft_ms: float | None
    prefill_leg_ms: float
    decode_ttft_ms: float | None  # the decode leg's own TTFT (transfer included)
    split_ttft_ms: float | None  # what a client sees: prefill leg + decode leg TTFT
    bytes_transferred: float
    transfers: float
    xfer_ms: float
    link_mb_s: float | None
    external_kv_transfer: float
    local_compute: float
    params_keys: list[str]
    proved: bool  # bytes moved and external tokens ~ the prompt
    pulled_blocks_published: bool = False  # BlockStored for the prompt's full blocks on D


def measure(client: httpx.Client, pair: PDPair, tokens: int) -> HandoffResult:
    prompt = prompt_for(client, pair, tokens, f"t{tokens}x")
    d = pair.decode.url
    reset_cache(client, d)
    time.sleep(pair.gap_s)
    unsplit = decode_leg(client, d, pair.model, prompt, None, f"unsplit-{uuid.uuid4().hex[:8]}")
    reset_cache(client, d)
    time.sleep(pair.gap_s)
    rid = f"pd-{uuid.uuid4().hex[:8]}"
    before, seq = snapshot(client, d), last_seq(pair.decode.replay_endpoint)
    params, prefill_s = prefill_leg(client, pair, prompt, rid)
    split = decode_leg(client, d, pair.model, prompt, params, rid)
    moved = snapshot(client, d) - before
    ids = _prompt_ids(client, d, pair.model, prompt)
    stored = stored_tokens_since(pair.decode.replay_endpoint, seq)
    result = _result(len(ids), unsplit, split, prefill_s, moved, params)
    full = (len(ids) // block_size(params)) * block_size(params)
    result.pulled_blocks_published = full > 0 and stored[:full] == ids[:full]
    return result


def block_size(params: dict[str, Any] | None) -> int:
    """Tokens per block, from the params (remote_num_tokens over the blocks offered)."""
    if not params or not params.get("remote_block_ids"):
        return 1
    blocks = len(params["remote_block_ids"][0])
    return max(-(-int(params.get("remote_num_tokens") or 0) // blocks), 1)


def _prompt_ids(client: httpx.Client, url: str, model: str, prompt: str) -> list[int]:
    body = {"model": model, "prompt": prompt}
    ids: list[int] = client.post(url + "/tokenize", json=body).json()["tokens"]
    return ids


def _prompt_tokens(client: httpx.Client, url: str, model: str, prompt: str) -> int:
    return len(_prompt_ids(client, url, model, prompt))


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000, 2)


def _result(
    n: int,
    unsplit: Leg,
    split: Leg,
    prefill_s: float,
    moved: PDSnapshot,
    params: dict[str, Any] | None,
) -> HandoffResult:
    rate = moved.link_bytes_per_s
    split_ttft = None if split.ttft_s is None else prefill_s + split.ttft_s
    return HandoffResult(
        prompt_tokens=n,
        text_equal=split.same_output(unsplit),
        split_text=split.text,
        unsplit_text=unsplit.text,
        unsplit_ttft_ms=_ms(unsplit.ttft_s),
        prefill_leg_ms=round(prefill_s * 1000, 2),
        decode_ttft_ms=_ms(split.ttft_s),
        split_ttft_ms=_ms(split_ttft),
        bytes_transferred=moved.bytes_transferred,
        transfers=moved.transfers,
        xfer_ms=round(moved.xfer_seconds * 1000, 3),
        link_mb_s=None if rate is None else round(rate / 1e6, 1),
        external_kv_transfer=moved.external_kv_transfer,
        local_compute=moved.local_compute,
        params_keys=sorted(params or {}),
        proved=moved.bytes_transferred > 0 and moved.external_kv_transfer >= 0.9 * n,
    )


@dataclass
class SilentRecompute:
    status: int
    text_equal: bool
    transfers: float
    local_compute: float
    prompt_tokens: int
    prefill_kv_usage: float  # > 0: the prefill engine holds the orphaned blocks
    detected: bool  # the decode engine's metrics show a recompute, not a pull


def silent_recompute(client: httpx.Client, pair: PDPair, tokens: int) -> SilentRecompute:
    """A decode leg whose params were stripped: 200 and the same text, but no pull."""
    prompt = prompt_for(client, pair, tokens, "silent")
    d = pair.decode.url
    reset_cache(client, d)
    time.sleep(pair.gap_s)
    reference = decode_leg(client, d, pair.model, prompt, None, "silent-ref")
    reset_cache(client, d)
    rid = f"silent-{uuid.uuid4().hex[:8]}"
    before = snapshot(client, d)
    prefill_leg(client, pair, prompt, rid)
    leg = decode_leg(client, d, pair.model, prompt, None, rid)
    moved = snapshot(client, d) - before
    n = _prompt_tokens(client, d, pair.model, prompt)
    return SilentRecompute(
        status=leg.status,
        text_equal=leg.same_output(reference),
        transfers=moved.transfers,
        local_compute=moved.local_compute,
        prompt_tokens=n,
        prefill_kv_usage=kv_usage(client, pair.prefill.url),
        detected=moved.transfers == 0 and moved.local_compute >= 0.9 * n,
    )


@dataclass
class PDReport:
    target: str
    first_handoff_ms: float  # includes the NIXL handshake
    handoffs: list[HandoffResult]
    silent: SilentRecompute
    notes: list[str]

    @property
    def ok(self) -> bool:
        return (
            all(h.text_equal and h.proved and h.pulled_blocks_published for h in self.handoffs)
            and self.silent.status == 200
            and self.silent.text_equal
            and self.silent.detected
        )

    def failures(self) -> list[str]:
        out = []
        for h in self.handoffs:
            if not h.text_equal:
                out.append(f"{h.prompt_tokens} tokens: split text {h.split_text!r} != unsplit")
            if not h.pulled_blocks_published:
                out.append(f"{h.prompt_tokens} tokens: no BlockStored for the pulled blocks")
            if not h.proved:
                out.append(
                    f"{h.prompt_tokens} tokens: no proof of a pull on the decode engine "
                    f"(bytes {h.bytes_transferred:.0f}, external tokens "
                    f"{h.external_kv_transfer:.0f})"
                )
        if not self.silent.detected:
            out.append(f"a stripped decode leg was not seen as a recompute: {self.silent}")
        return out

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "failures": self.failures(), **asdict(self)}


def run_handoffs(pair: PDPair, tokens: Sequence[int] = DEFAULT_TOKENS) -> PDReport:
    """Every measurement and check above, on a started pair."""
    with httpx.Client(timeout=120, trust_env=False, limits=LIMITS) as client:
        warm, _ = prefill_leg(client, pair, prompt_of(40, "warm"), "warm")
        start = time.perf_counter()
        first = decode_leg(client, pair.decode.url, pair.model, prompt_of(40, "warm"), warm, "warm")
        first_ms = (time.perf_counter() - start) * 1000
        if first.status != 200 or first.error:
            raise RuntimeError(f"the first handoff failed: {first}")
        handoffs = [measure(client, pair, n) for n in tokens]
        silent = silent_recompute(client, pair, tokens[0])
    return PDReport(pair.target, round(first_ms, 1), handoffs, silent, pair.notes)


# ---- command line --------------------------------------------------------------------------


def summary(report: PDReport) -> str:
    lines = [f"P/D handoff on {report.target}: first handoff {report.first_handoff_ms:.0f} ms"]
    for h in report.handoffs:
        lines.append(
            f"  {h.prompt_tokens:5d} tokens: {h.bytes_transferred / 1e6:7.2f} MB in "
            f"{h.xfer_ms:7.2f} ms ({h.link_mb_s} MB/s); TTFT unsplit {h.unsplit_ttft_ms} ms, "
            f"split {h.split_ttft_ms} ms (prefill leg {h.prefill_leg_ms} + decode "
            f"{h.decode_ttft_ms}); text equal {h.text_equal}; proved {h.proved}; "
            f"BlockStored {h.pulled_blocks_published}"
        )
    s = report.silent
    lines.append(
        f"  stripped decode leg: HTTP {s.status}, transfers {s.transfers:.0f}, local compute "
        f"{s.local_compute:.0f}/{s.prompt_tokens} tokens, prefill KV usage "
        f"{s.prefill_kv_usage:.3f}; detected {s.detected}"
    )
    rates = [h.link_mb_s for h in report.handoffs if h.link_mb_s]
    if rates:
        lines.append(f"  median link {statistics.median(rates):.0f} MB/s")
    lines += [f"  note: {n}" for n in report.notes]
    lines.append("OK" if report.ok else "FAILED: " + "; ".join(report.failures()))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=("vllm", "sim"), default="vllm")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument(
        "--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="prompt lengths"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument(
        "--link-mb-s", type=float, default=None, help="sim only: emulate a link this fast"
    )
    args = parser.parse_args(argv)
    tokens = [int(n) for n in args.tokens.split(",")]
    with pd_pair(args.target, args.model_dir, args.link_mb_s) as pair:
        report = run_handoffs(pair, tokens)
    print(summary(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
