"""The P/D cost model, the wire helpers and the handoff ledger, pure: table-driven."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engines.sim.latency import LatencyModel
from engines.sim.pd_metrics import PDSnapshot
from router.pd import model as m
from router.pd.ledger import Ledger
from router.pd.wire import (
    PREFILL_PARAMS,
    decode_body,
    not_splittable,
    params_problem,
    prefill_body,
    response_params,
)

SIM = LatencyModel()


def params(**over: Any) -> dict[str, Any]:
    base = {
        "do_remote_prefill": True,
        "remote_block_ids": [[1, 2, 3, 4]],
        "remote_engine_id": "e",
        "remote_request_id": "r",
        "remote_host": "h",
        "remote_port": 5600,
        "remote_num_tokens": 60,
    }
    return {**base, **over}


# ---- wire -----------------------------------------------------------------------------------


def test_prefill_body_asks_for_one_token_and_a_remote_decode() -> None:
    doc = {"prompt": "p", "stream": True, "stream_options": {}, "min_tokens": 4, "max_tokens": 9}
    out = json.loads(prefill_body(doc, chat=False))
    assert out == {
        "prompt": "p",
        "stream": False,
        "max_tokens": 1,
        "kv_transfer_params": PREFILL_PARAMS,
    }
    chat = json.loads(prefill_body({"messages": [], "max_completion_tokens": 5}, chat=True))
    assert chat["max_tokens"] == chat["max_completion_tokens"] == 1


@pytest.mark.parametrize(
    "body", [b'{"prompt": "x", "n": 1}', b'  {"a":1}', b"{}"], ids=["plain", "space", "empty"]
)
def test_decode_body_is_the_clients_body_plus_the_params(body: bytes) -> None:
    out = json.loads(decode_body(body, {"k": [1]}))
    assert out == {**json.loads(body), "kv_transfer_params": {"k": [1]}}


@pytest.mark.parametrize(
    ("over", "problem"),
    [
        ({}, None),
        ({"remote_block_ids": [1, 2, 3, 4]}, "not a list of lists"),
        ({"remote_block_ids": [[1, 2]]}, "has 2 blocks, the prompt needs 4"),
        ({"remote_block_ids": []}, "not a list of lists"),
        ({"remote_block_ids": [[1, True, 3, 4]]}, "not a block id"),
        ({"remote_block_ids": [[1, 2, 3, 4], []]}, "not a block id"),
        ({"remote_engine_id": None}, "remote_engine_id is missing"),
        ({"remote_port": "5600"}, "is not a port"),
        ({"do_remote_prefill": False}, "do_remote_prefill"),
        ({"remote_num_tokens": None}, "the prompt needs 7"),  # falls back to the router's count
    ],
    ids=[
        "ok",
        "flat",
        "too-few",
        "empty",
        "bool-id",
        "empty-group",
        "no-engine",
        "port-str",
        "not-remote",
        "router-count",
    ],
)
def test_params_are_checked_for_the_shapes_vllm_crashes_on(
    over: dict[str, Any], problem: str | None
) -> None:
    found = params_problem(params(**over), prompt_tokens=100, block_size=16)
    assert found == problem if problem is None else problem in (found or "")


def test_params_problem_without_params() -> None:
    assert params_problem(None, 10, 16) == "the prefill answer has no kv_transfer_params"


def test_response_params_reads_params_and_cached_tokens() -> None:
    body = json.dumps(
        {"kv_transfer_params": {"a": 1}, "usage": {"prompt_tokens_details": {"cached_tokens": 32}}}
    )
    assert response_params(body.encode()) == ({"a": 1}, 32)
    assert response_params(b"not json") == (None, None)
    assert response_params(b'{"usage": [1]}') == (None, None)


@pytest.mark.parametrize(
    ("doc", "why"),
    [
        ({"prompt": "x"}, None),
        ({"prompt": "x", "n": 2}, "several sequences"),
        ({"prompt": "x", "n": "2"}, "several sequences"),  # vLLM reads "2" as 2
        ({"prompt": "x", "n": "1"}, None),
        ({"prompt": "x", "best_of": 3}, None),  # vLLM 0.32 ignores it
        ({"prompt": ["a", "b"]}, "a batch of prompts"),
        ({"prompt": [1, 2, 3]}, None),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "echo": "false"}, None),  # vLLM reads "false" as false
        ({"prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs"),
        ({"prompt": "x", "use_beam_search": True}, "beam search"),
        # what the engine refuses stays with the decode worker, which answers its 400
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}, None),
        ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        # a completion has no max_completion_tokens in vLLM: its max_tokens counts
        ({"prompt": "x", "max_completion_tokens": 4, "min_tokens": 5}, None),
        ({"prompt": "x", "max_tokens": 4, "max_completion_tokens": 99, "min_tokens": 5}, "min"),
        ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
        ({"prompt": "x", "max_tokens": 4, "min_tokens": 4}, None),
        ({"prompt": "x", "min_tokens": 17}, "min_tokens"),  # over vLLM's default 16
        ({"prompt": "x", "max_tokens": None, "min_tokens": 16}, None),
        ({"prompt": "x", "min_tokens": "abc"}, "min_tokens"),
        ({"prompt": "x", "min_tokens": 2.5}, "min_tokens"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens below 1"),
    ],
    ids=[
        *("plain", "n", "n-text", "n-text-1", "best-of", "batch", "token-ids", "echo"),
        "echo-text-false",
        *("prompt-logprobs", "beam", "stream-options-unstreamed", "stream-options-streamed"),
        *("min-over-max", "completion-ignores-max-completion", "completion-max-tokens-counts"),
        *("min-negative", "min-is-max", "min-over-the-default", "null-max-is-the-default"),
        *("min-not-a-number", "min-fraction", "max-zero"),
    ],
)
def test_not_splittable(doc: dict[str, Any], why: str | None) -> None:
    found = not_splittable(doc)
    assert found is None if why is None else why in (found or "")


@pytest.mark.parametrize(
    ("doc", "why"),
    [
        ({"max_completion_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"max_completion_tokens": None, "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"max_completion_tokens": 9, "max_tokens": 4, "min_tokens": 5}, None),
        ({"min_tokens": 500}, None),  # a chat's default is the context's room
        ({"max_completion_tokens": 0}, "max_tokens below 1"),
    ],
    ids=["max-completion", "null-falls-to-max-tokens", "max-completion-first", "no-max", "zero"],
)
def test_not_splittable_chat(doc: dict[str, Any], why: str | None) -> None:
    messages = [{"role": "user", "content": "x"}]
    found = not_splittable({"messages": messages, **doc}, chat=True)
    assert found is None if why is None else why in (found or "")


# ---- the prefill fit --------------------------------------------------------------------------


def test_the_fit_recovers_the_simulators_latency_model() -> None:
    fit = m.PrefillFit()
    for n in (128, 512, 1024, 2048, 4096, 6000):
        fit.add(n, 0, SIM.ttft_ms(n))
    for n in (300, 3000, 8000):
        assert fit.predict(n) == pytest.approx(SIM.ttft_ms(n), rel=0.02)


def test_the_fit_drops_negative_terms() -> None:
    fit = m.PrefillFit()
    for n in (100, 200, 400, 800, 1600, 3200):
        fit.add(n, 0, 10 + 0.05 * n - 1e-7 * n * n)  # slightly concave: no attention term
    coef = fit.coefficients
    assert coef is not None and min(coef) >= 0 and coef[2] == 0
    assert fit.predict(1000) == pytest.approx(60, rel=0.1)


def test_one_length_gives_a_rate_through_the_origin() -> None:
    fit = m.PrefillFit()
    fit.add(1000, 0, 50.0)
    assert fit.predict(2000) == pytest.approx(100.0)


# ---- the decision -----------------------------------------------------------------------------


def trained(threshold: str | int = "auto", link: float | None = 3e9) -> m.CostModel:
    model = m.CostModel(threshold, link, 8192)
    for n in (256, 1024, 2048, 4096, 8000):
        for w in ("p", "d"):
            model.observe_prefill(w, n, 0, SIM.ttft_ms(n))
    model.observe_overhead("d", 35.0, 0, 1)  # ~20 ms beyond the decode step
    return model


def side(worker: str, new: int, requests: int = 0) -> m.Side:
    return m.Side(worker, new, 0, requests)


@pytest.mark.parametrize(
    ("threshold", "link", "new", "busy", "split", "reason"),
    [
        ("auto", 3e9, 4096, True, True, m.SPLIT_FASTER),
        ("auto", 3e9, 4096, False, False, m.LOCAL_FASTER),  # an idle decode worker stalls nobody
        ("auto", 3e9, 128, True, False, m.LOCAL_FASTER),  # the overhead outweighs a short prefill
        ("auto", 104e6, 2048, True, False, m.LOCAL_FASTER),  # 1 GbE: the transfer costs more
        ("auto", None, 4096, True, False, m.LOCAL_LINK_UNKNOWN),
        ("never", 3e9, 4096, True, False, m.LOCAL_NEVER),
        (1000, 3e9, 999, True, False, m.LOCAL_BELOW),
        (1000, 3e9, 1000, False, True, m.SPLIT_THRESHOLD),
        (0, 3e9, 8, True, False, m.LOCAL_CACHED),  # less than a block: nothing to hand off
    ],
    ids=[
        "fast-busy",
        "fast-idle",
        "fast-short",
        "slow-link",
        "no-link",
        "never",
        "below",
        "at",
        "cached",
    ],
)
def test_decide(
    threshold: Any, link: float | None, new: int, busy: bool, split: bool, reason: str
) -> None:
    model = trained(threshold, link)
    plan = model.decide(side("d", new, 3 if busy else 0), side("p", new), block_size=16)
    assert (plan.split, plan.reason) == (split, reason)
    assert f"({reason})" in plan.explain()


def test_no_prefill_worker_or_a_saturated_one_keeps_it_local() -> None:
    model = trained()
    assert model.decide(side("d", 4096, 3), None, 16).reason == m.LOCAL_NO_PREFILL
    assert model.decide(side("d", 4096, 3), None, 16, m.LOCAL_SATURATED).reason == m.LOCAL_SATURATED


def test_auto_needs_a_prefill_rate() -> None:
    model = m.CostModel("auto", 3e9, 8192)
    assert model.decide(side("d", 4096, 3), side("p", 4096), 16).reason == m.LOCAL_RATE_UNKNOWN


def test_a_queue_on_the_prefill_worker_counts_against_the_split() -> None:
    model = trained()
    plan = model.decide(side("d", 2048, 3), m.Side("p", 2048, 0, 4, 30_000), 16)
    assert (plan.split, plan.reason) == (False, m.LOCAL_FASTER)
    assert plan.terms["remote_queue"] > 1000


def test_learning_the_link_and_bytes_per_token_from_counters() -> None:
    model = m.CostModel("auto")
    assert model.transfer_ms(1000) is None
    model.observe_transfer(8_192_000, 0.0788, 1000)  # 104 MB/s, 8 KiB per token
    assert model.transfer_ms(1000) == pytest.approx(78.8, rel=0.01)
    model.observe_transfer(1000, 0.001, 0)  # a tiny transfer barely moves it
    assert model.snapshot()["link_mb_s"] == pytest.approx(104, rel=0.15)


# ---- the seeds' numbers (README) --------------------------------------------------------------


def seeds_prefill(n: int) -> float:
    return 83.0 * n / 3997  # 83 ms for the 3,000-word prompt (351.75 MB at 88 KB/token)


def test_at_1gbe_the_seeds_model_never_splits() -> None:
    assert m.split_above(seeds_prefill, 88_000, 104e6, 2.0) is None


def test_at_nvlink_speed_the_seeds_model_splits_above_two_hundred_tokens() -> None:
    n = m.split_above(seeds_prefill, 88_000, 450e9, 2.0)
    assert n is not None and 150 <= n <= 250


# ---- the ledger -------------------------------------------------------------------------------


def snap(
    external: float, nbytes: float = 0.0, failed: float = 0.0, computed: float = 0.0
) -> PDSnapshot:
    return PDSnapshot(
        bytes_transferred=nbytes,
        transfers=1 if nbytes else 0,
        xfer_seconds=nbytes / 1e9,
        external_kv_transfer=external,
        failed_transfers=failed,
        local_compute=computed,
    )


@pytest.mark.parametrize(
    ("expected", "growth", "computed", "verified", "silent"),
    [
        ([500], 500, 0, 1, 0),
        ([500, 500], 1000, 0, 2, 0),
        ([500], 0, 500, 0, 1),  # stripped params: nothing pulled, all of it computed
        ([500, 500], 500, 500, 1, 1),
        ([500], 300, 0, 1, 0),  # the decode worker had more cached than the index knew
        # two splits sharing a prefix: the second pulled its tail and found the rest cached
        ([500, 500], 560, 0, 2, 0),
        ([500, 500], 560, 30, 2, 0),  # its tail's last block computed, as ever
    ],
    ids=["one", "two", "silent", "one-of-two", "partly-cached", "siblings", "siblings-tail"],
)
def test_ledger_proves_or_counts(
    expected: list[int], growth: float, computed: float, verified: int, silent: int
) -> None:
    ledger = Ledger()
    ledger.apply(snap(1000))
    for t in expected:
        ledger.expect(t)
    out = ledger.apply(snap(1000 + growth, growth * 1024, computed=computed))
    assert (out.verified, out.silent) == (verified, silent)
    assert ledger.pending_splits == 0


def test_tokens_pulled_before_their_split_completes_are_carried() -> None:
    ledger = Ledger(inflight=1)
    ledger.apply(snap(0))
    out = ledger.apply(snap(800))  # a running decode leg pulled; nothing completed yet
    assert (out.verified, out.silent) == (0, 0)
    ledger.inflight = 0
    ledger.expect(800)
    assert ledger.apply(snap(800)).verified == 1


def test_a_restarted_decode_worker_resets_the_ledger() -> None:
    ledger = Ledger()
    ledger.apply(snap(5000))
    ledger.expect(100)
    out = ledger.apply(snap(0))
    assert out.restarted and ledger.pending_splits == 0
