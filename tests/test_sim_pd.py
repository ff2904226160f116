"""Prefill -> decode handoff between simulated workers in separate processes, with real NIXL
transfers (UCX, DRAM) on loopback: vLLM 0.32's NixlConnector protocol, its metrics as the
proof of a pull, and its failure behaviour."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import zmq

from engines.sim.pd_fleet import PDFleetProcess, start_pd_fleet
from engines.sim.pd_metrics import PDSnapshot, pd_snapshot
from engines.vllm.discovery import parse_metrics
from engines.vllm.events import BlockStored, decode_wire

pytestmark = pytest.mark.slow

BS = 16
KV_BYTES = 4096  # per token: a 16-token block is 64 KiB
LEASE_S = 5.0  # long enough for a handshake on a loaded CI box, short for the orphan test
USABLE = 925  # the default 926 blocks, less vLLM's null block
COMMON = ["--kv-bytes-per-token", str(KV_BYTES), "--kv-lease-s", str(LEASE_S)]
VLLM_PARAM_KEYS = {
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "transfer_mode",
    "remote_prefill_cached_tokens",
}


@pytest.fixture(scope="module")
def fleet() -> Iterator[PDFleetProcess]:
    with start_pd_fleet(1, 1, COMMON) as f:
        yield f


def prompt(tag: str, words: int = 200) -> str:
    return " ".join(f"{tag}{i}" for i in range(words))


def post(url: str, body: dict[str, Any], path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"x-request-id": "t1"}, timeout=30)


def prefill_leg(url: str, text: str) -> dict[str, Any]:
    body = {"prompt": text, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    r = post(url, body)
    r.raise_for_status()
    params: dict[str, Any] = r.json()["kv_transfer_params"]
    return params


def decode_leg(url: str, text: str, params: dict[str, Any] | None, **extra: Any) -> httpx.Response:
    body: dict[str, Any] = {"prompt": text, "max_tokens": 8, "ignore_eos": True, **extra}
    if params is not None:
        body["kv_transfer_params"] = params
    return post(url, body)


def snap(url: str) -> PDSnapshot:
    return pd_snapshot(httpx.get(url + "/metrics", timeout=10).text)


def n_tokens(url: str, text: str) -> int:
    count: int = httpx.post(url + "/tokenize", json={"prompt": text}, timeout=10).json()["count"]
    return count


def sim_stats(url: str) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(url + "/sim/stats", timeout=10).json()
    return stats


def wait_for(cond: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def stored_events(replay: str) -> list[BlockStored]:
    """Every BlockStored the worker still buffers, through its replay socket."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(replay)
    out: list[BlockStored] = []
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        while sock.poll(5000):
            _, _, seq, payload = sock.recv_multipart()
            if seq == b"\xff" * 8:
                break
            batch, _ = decode_wire(payload)
            out += [e for e in batch.events if isinstance(e, BlockStored)]
    finally:
        sock.close()
        ctx.term()
    return out


def test_handoff_pulls_every_block_and_decode_proves_it(fleet: PDFleetProcess) -> None:
    p, d = fleet.prefill_urls[0], fleet.decode_urls[0]
    text = prompt("a")
    n = n_tokens(d, text)
    n_blocks = -(-n // BS)
    before = snap(d)
    params = prefill_leg(p, text)
    assert set(params) == VLLM_PARAM_KEYS
    assert params["do_remote_prefill"] is True and params["transfer_mode"] == "pull"
    assert len(params["remote_block_ids"]) == 1 and len(params["remote_block_ids"][0]) == n_blocks
    assert params["remote_num_tokens"] == n and params["remote_request_id"].startswith("cmpl-t1-0-")
    assert params["remote_port"] == fleet.prefill[0]["kv_transfer"]["side_channel_port"]
    assert sim_stats(p)["free_blocks"] <= USABLE - n_blocks  # held under the lease

    r = decode_leg(d, text, params)
    assert r.status_code == 200, r.text
    moved = snap(d) - before
    assert moved.bytes_transferred == n_blocks * BS * KV_BYTES and moved.transfers == 1
    assert moved.external_kv_transfer == n and moved.local_compute == 0
    assert moved.xfer_seconds > 0
    # vLLM reports the prefill side's hits on the decode leg, not its own ~100%
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # P freed the blocks on D's notification, long before the lease ends
    assert wait_for(lambda: sim_stats(p)["kv_transfer"]["leases_read"] >= 1, timeout=LEASE_S / 2)
    assert sim_stats(d)["kv_transfer"]["tag_mismatches"] == 0
    # the pulled full blocks are D's prefix cache now, published as BlockStored
    cached = post(d, {"prompt": text}, "/sim/cached_tokens").json()
    assert cached["cached_blocks"] == n // BS
    ids = httpx.post(d + "/tokenize", json={"prompt": text}, timeout=10).json()["tokens"]
    stored = [t for e in stored_events(fleet.decode[0]["replay_endpoint"]) for t in e.token_ids]
    assert stored[: (n // BS) * BS] == ids[: (n // BS) * BS]


def test_split_text_equals_unsplit_text(fleet: PDFleetProcess) -> None:
    p, d = fleet.prefill_urls[0], fleet.decode_urls[0]
    text = prompt("b", 120)
    split = decode_leg(d, text, prefill_leg(p, text)).json()["choices"][0]["text"]
    whole = decode_leg(p, text, None).json()["choices"][0]["text"]
    assert split == whole and split


def test_only_blocks_missing_on_decode_move(fleet: PDFleetProcess) -> None:
    p, d = fleet.prefill_urls[0], fleet.decode_urls[0]
    base = prompt("c", 160)
    assert decode_leg(d, base, prefill_leg(p, base)).status_code == 200
    longer = base + " " + prompt("tail", 60)
    n = n_tokens(d, longer)
    hit = post(d, {"prompt": longer}, "/sim/cached_tokens").json()["cached_tokens"]
    assert hit > 0
    before = snap(d)
    assert decode_leg(d, longer, prefill_leg(p, longer)).status_code == 200
    moved = snap(d) - before
    assert moved.bytes_transferred == (-(-n // BS) - hit // BS) * BS * KV_BYTES
    assert moved.local_cache_hit == hit and moved.external_kv_transfer == n - hit


def test_chat_and_streaming_legs(fleet: PDFleetProcess) -> None:
    p, d = fleet.prefill_urls[0], fleet.decode_urls[0]
    messages = [{"role": "user", "content": prompt("e", 100)}]
    body = {"messages": messages, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    params = post(p, body, "/v1/chat/completions").json()["kv_transfer_params"]
    assert params["remote_request_id"].startswith("chatcmpl-t1-")
    before = snap(d)
    stream = {"messages": messages, "max_tokens": 4, "stream": True, "kv_transfer_params": params}
    r = post(d, stream, "/v1/chat/completions")
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert (snap(d) - before).transfers == 1


def test_decode_leg_without_params_recomputes_and_prefill_lease_expires(
    fleet: PDFleetProcess,
) -> None:
    p, d = fleet.prefill_urls[0], fleet.decode_urls[0]
    text = prompt("f")
    n = n_tokens(d, text)
    p_before, d_before = snap(p), snap(d)
    prefill_leg(p, text)  # its params never reach the decode worker
    r = decode_leg(d, text, None)
    assert r.status_code == 200
    moved = snap(d) - d_before
    assert moved.transfers == 0 and moved.local_compute == n  # the silent recompute
    held = USABLE - sim_stats(p)["free_blocks"]
    assert held >= -(-n // BS)  # P still holds the orphan's blocks...
    assert wait_for(lambda: (snap(p) - p_before).kv_expired == 1, timeout=LEASE_S + 5)
    assert sim_stats(p)["kv_transfer"]["leases_expired"] >= 1  # ...until the lease ends


def test_malformed_block_ids_answer_500_and_the_worker_lives(fleet: PDFleetProcess) -> None:
    p, d = fleet.prefill_urls[0], fleet.decode_urls[0]
    text = prompt("g")
    params = prefill_leg(p, text)
    flat = {**params, "remote_block_ids": params["remote_block_ids"][0]}
    r = decode_leg(d, text, flat)
    assert r.status_code == 500 and "would crash" in r.json()["error"]["message"]
    short = {**params, "remote_block_ids": [params["remote_block_ids"][0][:2]]}
    r = decode_leg(d, text, short)
    assert r.status_code == 500 and "short" in r.json()["error"]["message"]
    assert decode_leg(d, text, params).status_code == 200  # the real params still work
    assert httpx.get(d + "/health", timeout=5).status_code == 200


def _waiting(url: str) -> tuple[float, float]:
    """The decode worker's vllm:num_requests_waiting and its "deferred" part."""
    m = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
    return m.waiting, m.deferred if m.deferred is not None else -1.0


def test_throttled_link_takes_at_least_its_time(fleet: PDFleetProcess) -> None:
    """A lower bound only: the emulated link sleeps the time the bytes still need. While
    the pull runs, the request waits and is "deferred", as vLLM counts it (not waiting for
    a slot: kvroute learns no batch limit from it)."""
    with start_pd_fleet(0, 1, COMMON, decode_args=["--link-mb-s", "20"]) as slow:
        url = slow.decode_urls[0]
        text = prompt("h", 1000)
        n_blocks = -(-n_tokens(url, text) // BS)
        params = prefill_leg(fleet.prefill_urls[0], text)
        with ThreadPoolExecutor(1) as pool:
            leg = pool.submit(decode_leg, url, text, params)
            seen = set()
            while not leg.done():
                seen.add(_waiting(url))
            r = leg.result()
        assert r.status_code == 200
        assert (1.0, 1.0) in seen, seen
        assert _waiting(url) == (0.0, 0.0)
        moved = snap(url)
        assert moved.bytes_transferred == n_blocks * BS * KV_BYTES
        assert moved.xfer_seconds >= moved.bytes_transferred / 20e6


def test_prefill_killed_between_legs_fails_or_recomputes_by_policy() -> None:
    fail = start_pd_fleet(1, 1, COMMON)
    recompute = start_pd_fleet(0, 1, [*COMMON, "--kv-load-failure-policy", "recompute"])
    try:
        p = fail.prefill_urls[0]
        for d in (fail.decode_urls[0], recompute.decode_urls[0]):  # handshake while P lives
            text = prompt("warm" + d[-5:])
            assert decode_leg(d, text, prefill_leg(p, text)).status_code == 200
        texts = [prompt("k"), prompt("m")]
        params = [prefill_leg(p, t) for t in texts]
        fail.procs[0].kill()
        fail.procs[0].wait(10)
        d_fail, d_recompute = fail.decode_urls[0], recompute.decode_urls[0]
        r = decode_leg(d_fail, texts[0], params[0])
        assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
        assert snap(d_fail).failed_transfers == 1
        before = snap(d_recompute)
        r = decode_leg(d_recompute, texts[1], params[1])
        assert r.status_code == 200
        moved = snap(d_recompute) - before
        assert moved.failed_transfers == 1 and moved.local_compute == n_tokens(d_fail, texts[1])
    finally:
        fail.stop()
        recompute.stop()
