"""`kvroute bench routing`: the harness end to end at tiny sizes (real simulated fleet, real
routers on loopback), its JSON shape, and the pure pieces (ideal, vLLM driver flags)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proc_state import alive, descendants

from engines.sim.fleet import start_fleet_process
from router.bench import ideal, routing, workloads
from router.bench.driver import Sample
from router.bench.routing import fleet_args
from router.bench.routing_diag import _reason, slow_tail
from router.bench.targets import with_config
from router.bench.vllm_driver import command, row_from_result
from router.tokenize import PACKAGED_TOKENIZER, LocalTokenizer

ROW_KEYS = {"cached_fraction", "ttft_ms", "itl_ms_p90", "requests_per_worker", "errors", "runs"}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_harness_json_shape_and_kvroute_beats_round_robin(tmp_path: Path) -> None:
    plan = routing.Plan(
        workloads=["seed"],
        routers=["kvroute", "round_robin"],
        replicas=(),
        runs=3,
        scale=0.25,
        install_peers=False,
    )
    out, svg = tmp_path / "r.json", tmp_path / "r.svg"
    routing.run(plan, out, svg)
    doc = json.loads(out.read_text())
    assert set(doc) >= {"workloads", "replicas"}
    seed = doc["workloads"]["seed"]
    assert 0 < seed["ideal"] <= 1
    for name in ("kvroute", "round_robin"):
        row = seed["routers"][name]
        assert set(row) >= ROW_KEYS, name
        assert set(row["ttft_ms"]) == {"p50", "p90", "p99", "mean"}
        assert row["runs"] == 3 and row["errors"] == 0
        assert sorted(row["ttft_p90_ms_runs"])[1] == row["ttft_ms"]["p90"]  # the median run
        assert sorted(row["max_min_load_runs"])[1] == row["max_min_load"]
        assert sum(row["requests_per_worker"]) > 0 and len(row["requests_per_worker"]) == 2
        computed = row["prefill_tokens_per_worker"]  # the engines' queries less their hits
        assert len(computed) == 2 and all(n > 0 for n in computed), computed
        assert row["max_min_prefill"] >= 1.0
    kv, rr = seed["routers"]["kvroute"], seed["routers"]["round_robin"]
    # a router that caches more leaves the engines less to compute
    assert sum(kv["prefill_tokens_per_worker"]) < sum(rr["prefill_tokens_per_worker"])
    # prefix-aware placement keeps each prefix on one worker; round robin thrashes both
    assert kv["cached_fraction"] > rr["cached_fraction"] + 0.05, (kv, rr)
    assert kv["cached_fraction"] <= seed["ideal"] + 0.01
    assert svg.read_text().startswith("<svg")


def test_every_workload_builds_distinct_prompts() -> None:
    for name in workloads.GENERATORS:
        w = workloads.build(name, run_seed=1, scale=0.05)
        prompts = [r.prompt for r in w.requests]
        assert len(set(prompts)) == len(prompts), name
        assert w.workers >= 2 and w.concurrency >= 1, name


def test_run_seed_changes_order_not_texts() -> None:
    a = workloads.build("seed", 0, 0.1).requests
    b = workloads.build("seed", 1, 0.1).requests
    assert sorted(r.prompt for r in a) == sorted(r.prompt for r in b)
    assert [r.prompt for r in a] != [r.prompt for r in b]


def test_lru_keeps_the_head_of_the_last_request_longest() -> None:
    lru = ideal.Lru(capacity=3)
    assert lru.touch([1, 2, 3]) == 0
    assert lru.touch([1, 2, 3]) == 3
    lru.touch([9])  # evicts the tail block (3) first, as vLLM frees a request's tail first
    assert lru.touch([1, 2, 3]) == 2


@pytest.mark.parametrize(
    ("replicas", "expected_homes"),
    [({}, 1), ({"big": 2}, 2)],
    ids=["one-home-per-group", "hot-group-spread"],
)
def test_placement_pins_groups_and_spreads_hot_ones(
    replicas: dict[str, int], expected_homes: int
) -> None:
    reqs = [workloads.Request(f"big {i}", "big", 1) for i in range(4)]
    reqs += [workloads.Request(f"small {i}", f"s{i}", 1) for i in range(2)]
    w = workloads.Workload("t", 3, 10, 1, [[[r] for r in reqs]], replicas=replicas)
    place = ideal.placement(w, {r.prompt: 100 for r in reqs}, reqs)
    assert len(set(place[:4])) == expected_homes


class _Digits:
    """A tokenizer whose tokens are the prompt's numbers: block contents by hand."""

    def completion(self, prompt: str) -> list[int]:
        return [int(x) for x in prompt.split()]


def test_the_ideal_places_groups_by_their_cache_footprint_where_that_is_better() -> None:
    """Two caches of 6 blocks; group a: 20 requests on a 1-block prefix, groups b and c: 3
    each on a 5-block prefix. Balancing prompt tokens puts b and c on one cache, where
    they evict each other; each needs a cache of its own (a fits beside either)."""
    reqs = [workloads.Request(f"1 1 {100 + k}", "a", 1) for k in range(20)]
    for k in range(3):
        reqs.append(workloads.Request("2 " * 10 + str(200 + k), "b", 1))
        reqs.append(workloads.Request("3 " * 10 + str(300 + k), "c", 1))
    w = workloads.Workload("t", 2, 7, 1, [[[r] for r in reqs]], block_size=2)
    order = ideal.replay_order(w)
    tok = _Digits()
    ids = {r.prompt: tok.completion(r.prompt) for r in order}
    by_tokens = ideal.replay(
        w, order, ids, ideal.placement(w, {p: len(t) for p, t in ids.items()}, order)
    )
    assert round(by_tokens, 3) == 0.365
    assert round(ideal.ideal_fraction(w, tok), 3) == 0.619  # type: ignore[arg-type]
    route = ideal.oracle_route(w, tok)  # type: ignore[arg-type]
    homes = {g: {route(r) for r in order if r.group == g} for g in "abc"}
    assert homes["b"] != homes["c"]


def test_ideal_of_the_seed_workload_is_near_every_repeat_hitting() -> None:
    w = workloads.build("seed", 0, 0.25)
    # 3 prefixes x 2 requests: every second request hits all but its question's tail
    assert 0.4 < ideal.ideal_fraction(w) < 0.5


def test_vllm_driver_flags_mirror_the_workload() -> None:
    w = workloads.build("vllm-prefix-repetition", 0, 1.0)
    cmd = command(w, "http://127.0.0.1:1", 2, Path("/tmp/x/r.json"))
    flags = dict(itertools.pairwise(cmd))
    assert flags["--prefix-repetition-prefix-len"] == "2000"
    assert flags["--prefix-repetition-suffix-len"] == "100"
    assert flags["--prefix-repetition-num-prefixes"] == "32"
    assert flags["--prefix-repetition-output-len"] == "16"
    assert flags["--num-prompts"] == "320" and flags["--max-concurrency"] == "16"
    with pytest.raises(RuntimeError, match="vllm-prefix-repetition only"):
        command(workloads.build("seed", 0, 0.1), "http://x", 0, Path("/tmp/r.json"))


def test_vllm_result_becomes_a_row() -> None:
    doc = {"p50_ttft_ms": 1.0, "p90_ttft_ms": 2.0, "p99_ttft_ms": 3.0, "mean_ttft_ms": 1.5}
    doc |= {"p90_itl_ms": 4.0, "completed": 9, "num_prompts": 10}
    row = row_from_result(doc)
    assert row["ttft_ms"] == {"p50": 1.0, "p90": 2.0, "p99": 3.0, "mean": 1.5}
    assert row["errors"] == 1


@pytest.mark.parametrize("name", list(workloads.GENERATORS))
def test_every_prompt_fits_the_fleet_it_runs_on(name: str) -> None:
    w = workloads.build(name, run_seed=0)
    flags = dict(zip(w.sim_args[::2], w.sim_args[1::2], strict=True))
    limit = min(int(flags.get("--max-model-len", 4096)), (w.kv_blocks - 1) * w.block_size)
    tok = LocalTokenizer(PACKAGED_TOKENIZER)
    longest = max(len(tok.completion(r.prompt)) + r.max_tokens for r in w.requests)
    assert longest <= limit, f"{name}: a prompt of {longest} tokens on a {limit}-token fleet"


def test_the_client_is_warmed_before_the_first_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's first request pays the client's own set-up; a health check per URL
    takes it before any prompt, so no prompt's TTFT counts it (and no cache is touched)."""
    import asyncio

    import httpx

    from router.bench import driver

    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.host}:{request.url.port}{request.url.path}")
        if request.url.path == "/health":
            return httpx.Response(200)
        usage = {"prompt_tokens": 4, "prompt_tokens_details": {"cached_tokens": 0}}
        body = (
            'data: {"choices": [{"text": "x"}]}\n\n'
            f'data: {{"choices": [], "usage": {json.dumps(usage)}}}\n\n'
            "data: [DONE]\n\n"
        )
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    real = httpx.AsyncClient

    def client(**kw: object) -> httpx.AsyncClient:
        return real(transport=httpx.MockTransport(answer), **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(httpx, "AsyncClient", client)
    w = workloads.build("seed", 0, scale=0.25)
    urls = ["http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9001"]
    result = asyncio.run(driver.drive(w, urls))
    assert result.errors == 0 and len(result.samples) == len(w.requests)
    assert seen[:2] == ["GET 127.0.0.1:9001/health", "GET 127.0.0.1:9002/health"]
    assert all(s.startswith("POST ") for s in seen[2:]) and len(seen) == 2 + len(w.requests)


def test_per_worker_medians_rank_each_run_busiest_first() -> None:
    # fresh fleets: the hot worker is a different index in each run
    def row(counts: list[int]) -> dict[str, object]:
        return {
            "cached_fraction": 0.8,
            "ttft_ms": {"p50": 1.0, "p90": 2.0, "p99": 3.0, "mean": 1.5},
            "itl_ms_p90": 1.0,
            "requests_per_worker": counts,
            "max_min_load": max(counts) / min(counts),
            "prefill_tokens_per_worker": [c * 10 for c in counts],
            "max_min_prefill": max(counts) / min(counts),
            "errors": 0,
        }

    rows = [row([96, 32, 32, 32]), row([32, 32, 96, 32]), row([32, 40, 24, 96])]
    out = routing.summarize(rows)
    assert out["requests_per_worker"] == [96, 32, 32, 32]
    assert out["prefill_tokens_per_worker"] == [960, 320, 320, 320]
    assert out["max_min_load"] == 3.0
    assert out["max_min_load_runs"] == [3.0, 3.0, 4.0]  # each run's, in run order


def test_replicas_print_each_runs_max_min(capsys: pytest.CaptureFixture[str]) -> None:
    """A median hides whether every run was uneven or only some: each run's is printed."""

    def row(mm: list[float]) -> dict[str, object]:
        return {
            "cached_fraction": 0.7,
            "ttft_ms": {"p50": 1.0, "p90": 2.0, "p99": 3.0, "mean": 1.5},
            "itl_ms_p90": 1.0,
            "max_min_load": sorted(mm)[len(mm) // 2],
            "max_min_load_runs": mm,
            "errors": 0,
        }

    one, two = row([1.0, 1.0, 1.0]), row([1.4, 1.0, 1.4])
    routing.print_table({"workloads": {}, "replicas": {"multi-turn": {"one": one, "two": two}}})
    out = capsys.readouterr().out
    assert "max/min per run, one: 1.00 1.00 1.00" in out
    assert "max/min per run, two: 1.40 1.00 1.40" in out


def test_paired_comparison_is_run_by_run_against_each_peer() -> None:
    def row(p90s: list[float], cached: list[float]) -> dict[str, object]:
        return {"ttft_p90_ms_runs": p90s, "cached_fraction_runs": cached}

    # medians alone: 60 against 59 (kvroute looks slower); run by run it was faster in
    # two of three, by a median 2 ms
    routers = {
        "kvroute": row([50.0, 60.0, 70.0], [0.70, 0.71, 0.70]),
        "round_robin": row([90.0, 90.0, 90.0], [0.40, 0.40, 0.40]),
        "sglang-router-cache_aware": row([52.0, 59.0, 72.0], [0.70, 0.70, 0.70]),
        "vllm-router-cache_aware": {"skipped": "vllm-router not installed"},
    }
    out = routing.paired(routers, with_config(None))
    assert set(out) == {"kvroute vs sglang-router-cache_aware"}  # peers only, not skipped
    d = out["kvroute vs sglang-router-cache_aware"]
    assert d == {
        "cached_diff": pytest.approx(0.0),
        "cached_diff_interval": pytest.approx([0.0, 0.01]),
        "ttft_p90_diff_ms": -2.0,
        "ttft_p90_diff_interval_ms": [-2.0, 1.0],
        "interval_confidence": 0.75,
        "ttft_p90_verdict": "not told apart",  # one run of three went the other way
        "ttft_p90_verdict_reason": "3 runs: 75%; 5 give 94%",
        "ttft_p90_lower_runs": 2,
        "runs": 3,
    }


def test_a_row_that_lost_requests_is_not_compared_and_fails_the_command() -> None:
    """Its figures are its answered requests': a router that shed most of them (429s)
    would look faster than one that served them all."""

    def row(errors: int) -> dict[str, object]:
        return {
            "ttft_p90_ms_runs": [50.0, 60.0, 70.0],
            "cached_fraction_runs": [0.7, 0.7, 0.7],
            "errors": errors,
        }

    routers = {"kvroute": row(15), "sglang-router-cache_aware": row(0)}
    assert routing.paired(routers, with_config(None)) == {}
    report = {"workloads": {"w": {"ideal": 0.8, "routers": routers}}, "replicas": {}}
    assert routing.missing(report) == ["w / kvroute (15 failed requests)"]
    routers["kvroute"] = row(0)
    assert set(routing.paired(routers, with_config(None))) == {
        "kvroute vs sglang-router-cache_aware"
    }
    assert routing.missing(report) == []


def test_the_paired_interval_is_the_sign_tests_and_tells_a_difference_from_noise(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from router.bench.paired import median_interval

    # ten runs: the interval drops the lowest and highest difference (97.9%: 1 - 2 * 11/1024)
    lo, hi, confidence = median_interval([5, -9, 1, 2, 3, 4, 6, 7, 8, 30])
    assert (lo, hi) == (1, 8)
    assert confidence == pytest.approx(1 - 2 * 11 / 1024)
    # thirteen: dropping three from each end still holds 90.8%, four would not
    assert median_interval(list(range(13)))[:2] == (3, 9)

    def row(p90s: list[float]) -> dict[str, object]:
        return {"ttft_p90_ms_runs": p90s, "cached_fraction_runs": [0.8] * len(p90s)}

    peer = [100.0] * 10
    faster = routing.paired(
        {"kvroute": row([97.0 - i % 3 for i in range(10)]), "sglang-router-cache_aware": row(peer)},
        with_config(None),
    )["kvroute vs sglang-router-cache_aware"]
    assert faster["ttft_p90_verdict"] == "lower"
    mixed = routing.paired(
        {"kvroute": row([95.0, 104.0] * 5), "sglang-router-cache_aware": row(peer)},
        with_config(None),
    )["kvroute vs sglang-router-cache_aware"]
    assert mixed["ttft_p90_verdict"] == "not told apart"
    slower = routing.paired(
        {"kvroute": row([101.0 + i for i in range(10)]), "sglang-router-cache_aware": row(peer)},
        with_config(None),
    )["kvroute vs sglang-router-cache_aware"]
    assert slower["ttft_p90_verdict"] == "higher"
    pairs = {"kvroute vs sglang-router-cache_aware": slower}
    routing.print_table(
        {"workloads": {"w": {"ideal": 0.8, "routers": {}, "paired": pairs}}, "replicas": {}}
    )
    assert (
        "TTFT p90 +5.5 ms (+2.0 to +9.0: higher; lower in 0 of 10 runs)" in capsys.readouterr().out
    )


@pytest.mark.parametrize(
    ("runs", "verdict"),
    [
        (1, "not told apart (1 run: 0%; 5 give 94%)"),
        (3, "not told apart (3 runs: 75%; 5 give 94%)"),
        (4, "not told apart (4 runs: 88%; 5 give 94%)"),
        (5, "lower"),
    ],
    ids=["one-run", "three-runs", "four-runs", "five-runs"],
)
def test_a_p90_verdict_needs_90_percent_confidence(
    runs: int, verdict: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every run lower: one run's interval is that run (0%), three runs' their range (75%);
    a verdict said "lower" at any confidence. Five runs reach 94%."""

    def row(p90: float) -> dict[str, object]:
        return {"ttft_p90_ms_runs": [p90] * runs, "cached_fraction_runs": [0.8] * runs}

    routers = {"kvroute": row(90.0), "sglang-router-cache_aware": row(100.0)}
    pairs = routing.paired(routers, with_config(None))
    d = pairs["kvroute vs sglang-router-cache_aware"]
    assert d["ttft_p90_verdict"] == verdict.split(" (")[0]
    assert d.get("ttft_p90_verdict_reason", "") == verdict.partition(" (")[2].rstrip(")")
    routing.print_table(
        {"workloads": {"w": {"ideal": 0.8, "routers": {}, "paired": pairs}}, "replicas": {}}
    )
    assert f"(-10.0 to -10.0: {verdict}; lower in {runs} of {runs} runs)" in capsys.readouterr().out


def _bench(*argv: str) -> int:
    """`kvroute bench routing ARGV` in this process (no SIGTERM handler installed)."""
    import argparse

    from router import bench_cli

    parser = argparse.ArgumentParser(prog="kvroute")
    bench_cli.register(parser.add_subparsers())
    args = parser.parse_args(["bench", "routing", *argv])
    code: int = args.func(args)
    return code


def _row(cached: float, seed: int) -> dict[str, object]:
    """One run's row, as `routing` measures it, with the given cached fraction."""
    return {
        "cached_fraction": cached,
        "ttft_ms": {"p50": 1.0, "p90": 2.0 + seed, "p99": 3.0, "mean": 1.5},
        "itl_ms_p90": 1.0,
        "requests_per_worker": [1, 1],
        "max_min_load": 1.0,
        "prefill_tokens_per_worker": [10, 10],
        "max_min_prefill": 1.0,
        "errors": 0,
    }


def _fake_run(
    plan: routing.Plan, w: object, seed: int, router: str, t: object
) -> dict[str, object]:
    return _row(0.82449, seed)  # the per-run line prints 0.824


def test_a_router_that_did_not_run_fails_the_command_after_the_table(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A peer that is not installed (here --no-install) is a row that names the remedy; the
    table and JSON still hold the routers that ran, and the exit status says one did not."""
    from router.bench import peers

    monkeypatch.setattr(routing, "_logged_run", _fake_run)
    monkeypatch.setattr(peers, "peer_bin", lambda name: None)
    out = tmp_path / "r.json"
    code = _bench(
        "--workload", "seed", "--scale", "0.1", "--runs", "1", "--no-install", "--json", str(out),
        "--routers", "kvroute", "sglang-router-cache_aware",
    )  # fmt: skip
    assert code == 1
    rows = json.loads(out.read_text())["workloads"]["seed"]["routers"]
    assert rows["kvroute"]["runs"] == 1
    skipped = rows["sglang-router-cache_aware"]["skipped"]
    assert "pip install sglang-router==0.3.2" in skipped and "--routers" in skipped, skipped
    printed = capsys.readouterr()
    assert "sglang-router-cache_aware   skipped: sglang-router not installed" in printed.out
    assert "their figures are not compared): seed / sglang-router-cache_aware" in printed.err


def test_a_figure_is_rounded_once_from_the_measured_value(tmp_path: Path) -> None:
    """The per-run line said cached 0.824 and the table 0.825: the median was rounded to 4
    digits, then printed to 3. The table prints the measured value, the JSON rounds it."""
    row = routing.summarize([_fake_run(routing.Plan([], [], ()), None, 0, "kvroute", None)])
    assert routing._line("kvroute", row).split()[1] == f"{0.82449:.3f}" == "0.824"
    report = {"workloads": {"w": {"ideal": 0.81234567, "routers": {"kvroute": row}}}}
    routing._write({**report, "replicas": {}}, tmp_path / "r.json", None)
    doc = json.loads((tmp_path / "r.json").read_text())["workloads"]["w"]
    assert doc["ideal"] == 0.8123 and doc["routers"]["kvroute"]["cached_fraction"] == 0.8245
    assert doc["routers"]["kvroute"]["cached_fraction_runs"] == [0.8245]


def test_routing_help_says_what_each_router_and_workload_is_and_how_peers_install(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        _bench("--help")
    text = capsys.readouterr().out
    assert "KVROUTE_PEERS_VENV" in text and "--no-install" in text
    lines = text.splitlines()
    for name in [*with_config(None), *workloads.GENERATORS]:
        described = [x for x in lines if x.split()[:1] == [name] and len(x.split()) > 3]
        assert described, f"--help does not say what {name} is"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--workload", "seed"], "--driver vllm runs vllm-prefix-repetition only"),
        (["--replicas", "vllm-prefix-repetition"], "the two-replica row would be one replica"),
        (["--routers", "oracle"], "--routers oracle with --driver vllm"),
        (["--workload", "vllm-prefix-repetition"], "no vLLM venv at"),
    ],
    ids=["other-workload", "replicas", "oracle", "no-venv"],
)
def test_driver_vllm_refuses_what_it_cannot_run_before_a_fleet_starts(
    argv: list[str],
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from router.bench import vllm_driver

    def no_fleet(*a: object, **kw: object) -> None:
        raise AssertionError("a fleet started")

    monkeypatch.setattr(routing, "start_fleet_process", no_fleet)
    if expected != "no vLLM venv at":
        (tmp_path / ".kvroute-ready").touch()
    monkeypatch.setattr(vllm_driver, "VLLM_VENV", tmp_path)
    if "--routers" not in argv:
        argv = [*argv, "--routers", "kvroute"]
    with pytest.raises(SystemExit) as exit_:
        _bench("--driver", "vllm", "--no-install", *argv)
    assert exit_.value.code == 2
    assert expected in capsys.readouterr().err


def test_full_with_driver_vllm_plans_no_oracle() -> None:
    plan = routing.plan_for(None, None, True, driver="vllm")
    assert "oracle" not in plan.routers and "kvroute" in plan.routers
    routing.check(plan, vllm_ready=lambda: True)


def test_routers_take_turns_run_by_run_and_a_failing_one_is_a_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[int, str]] = []

    def fake_run(
        plan: routing.Plan, w: object, seed: int, router: str, t: object
    ) -> dict[str, object]:
        calls.append((seed, router))
        if router == "random" and seed == 1:
            raise RuntimeError("router died")
        return _row(0.5, seed)

    monkeypatch.setattr(routing, "_logged_run", fake_run)
    plan = routing.Plan(["seed"], ["kvroute", "random", "round_robin"], (), runs=3, scale=0.1)
    out = routing._workload(plan, "seed", with_config(None), {})
    # drift on a shared machine falls on every router alike: seed by seed, not router by router
    assert calls == [
        (0, "kvroute"), (0, "random"), (0, "round_robin"),
        (1, "kvroute"), (1, "random"), (1, "round_robin"),
        (2, "kvroute"), (2, "round_robin"),
    ]  # fmt: skip
    assert out["routers"]["random"]["skipped"].startswith("failed: router died")
    assert out["routers"]["kvroute"]["ttft_p90_ms_runs"] == [2.0, 3.0, 4.0]
    assert list(out["routers"]) == ["kvroute", "random", "round_robin"]


def test_the_diagnosis_of_a_peer_router_shows_no_placement_it_cannot_know(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Peers name no worker on their responses: no "groups homed per worker: [0, 0]"."""
    from router.bench.driver import DriveResult
    from router.bench.routing_diag import report

    w = workloads.build("seed", 0, 0.25)
    samples = [Sample(10.0, [], 32, 64, group=f"g{i % 2}") for i in range(6)]
    stats = [{"blocks_evicted": 0}] * w.workers
    cached = report(w, DriveResult(samples), {}, {}, [1, 1], stats)
    out = capsys.readouterr().out
    assert cached == 0.5
    assert "placement: not known" in out and "groups homed per worker" not in out


def test_the_diagnosis_tells_a_cold_start_tail_from_a_steady_one() -> None:
    """routing_diag says whether a workload's TTFT p90 is set by the first wave (sent in the
    run's first second) or by the run as a whole."""

    def at(sent: float, ttft: float) -> Sample:
        return Sample(ttft_ms=ttft, gaps_ms=[], cached_tokens=0, prompt_tokens=1, sent=sent)

    steady = [at(100.0 + i * 0.5, 50.0) for i in range(17)]
    cold = [at(100.0, 400.0), at(100.2, 390.0), at(100.4, 380.0)]
    assert slow_tail(steady + cold) == (3, 3)
    late = [*steady, at(105.0, 400.0), at(106.0, 390.0), at(100.4, 380.0)]
    assert slow_tail(late) == (3, 1)
    assert slow_tail([]) == (0, 0)


def test_the_diagnosis_names_the_filter_that_excluded_a_groups_home() -> None:
    """routing_diag said "load bound" for every exclusion; on long-short-mix it was the
    prefill-wait filter. And an explain whose winner is not where the request went predates
    a change in the fleet: its terms do not explain the move."""
    home = {"excluded": "prefill wait: 6566 tokens before the first > 2312", "overlap_blocks": 21}
    assert _reason(home, {"overlap_blocks": 0}) == "home excluded (prefill wait)"
    busy = {"excluded": "busy: 14 running+waiting >= busy_max_requests 12"}
    assert _reason(busy, {}) == "home excluded (busy)"
    held = {"overlap_blocks": 21}
    assert _reason(held, {"overlap_blocks": 0}) == "load/headroom outweighed the overlap"
    assert _reason(held, {"overlap_blocks": 21}) == "other worker had >= overlap"
    assert _reason({"overlap_blocks": 0}, {}) == "router saw no overlap on home"
    stale = _reason(home, {"overlap_blocks": 0}, stale=True)
    assert stale == "the fleet changed between the explain and the request"


def test_the_bench_fleet_publishes_on_vllms_default_topic() -> None:
    """vllm-router's static event sources take no topic and drop frames under any other
    than vLLM's default, the empty one: under `kv-events` its kv_aware credited no prefix
    and routed like round robin. Every target sees the same fleet, so it publishes on ''."""
    w = workloads.build("seed", 0, scale=0.1)
    with start_fleet_process(2, fleet_args(w, 0)) as fleet:
        assert [x["topic"] for x in fleet.workers] == ["", ""]
        assert all(x["events_endpoint"] for x in fleet.workers)
    with start_fleet_process(2, fleet_args(w, 0, events=False)) as fleet:
        assert not any(x["events_endpoint"] for x in fleet.workers)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_bench_stopped_with_sigterm_stops_its_fleet_and_routers(tmp_path: Path) -> None:
    """A CI step's timeout or a `kill` sends SIGTERM: the bench must unwind as it does on
    Ctrl-C and stop the engines and routers it started, not leave them on their ports
    (they were left serving before the bench exited through its `with` blocks on it)."""
    cmd = [sys.executable, "-m", "router.cli", "bench", "routing", "--workload", "seed"]
    cmd += ["--routers", "kvroute", "--runs", "3", "--no-install", "--json", str(tmp_path / "r")]
    bench = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while len(started) < 2:  # the fleet and the router
            assert bench.poll() is None, "the bench ended before it started its children"
            assert time.monotonic() < deadline, "the bench started no fleet and router"
            started = descendants(bench.pid)
            time.sleep(0.2)
        time.sleep(1.0)  # the router is serving
        started = descendants(bench.pid)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 15
        while (left := {p for p in started if alive(p)}) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"children left running after SIGTERM: {sorted(left)}"
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for pid in started:  # what this test started, should it fail
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _nice_of_threads(pid: int) -> set[int]:
    """The niceness of every thread of `pid` (Linux: a thread id names one thread)."""
    return {
        os.getpriority(os.PRIO_PROCESS, int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()
    }


@pytest.mark.timeout(120)
def test_router_nice_lowers_every_router_thread_and_leaves_the_engines_alone() -> None:
    """`--router-nice`: every thread of the router under test (kvroute's tokenizer threads
    included) runs at the niceness asked for, the simulated engines at the bench's own, so
    the engines' steps come first on shared cores."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    want = min(own + 5, 19)  # five steps below the bench's own, as `nice -n 5`
    w = workloads.build("seed", 0, scale=0.1)
    seen: dict[str, set[int]] = {}

    def look(w, urls, workers, oracle):  # type: ignore[no-untyped-def]
        for pid in descendants(os.getpid()):
            with contextlib.suppress(OSError):
                seen[Path(f"/proc/{pid}/cmdline").read_text()] = _nice_of_threads(pid)
        return {}

    routing.one_run(w, with_config(None)["kvroute"], 0, look, router_nice=5)
    routers = {c: n for c, n in seen.items() if "serve" in c}
    engines = {c: n for c, n in seen.items() if "serve" not in c}
    assert routers and engines, seen
    for cmd, nices in routers.items():
        assert nices == {want}, (cmd, nices)
    for cmd, nices in engines.items():
        assert nices == {own}, (cmd, nices)


def test_a_failed_peer_install_names_the_remedy_and_is_tried_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No network: pip's retries and its bare error were all a user saw, and every call
    tried again. Now pip's last error, then what to do; no second try in this process."""
    from router.bench import peers

    calls: list[list[str]] = []

    def pip(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        if cmd[0].endswith("pip"):
            err = "WARNING: Retrying (total=0)\nERROR: No matching distribution found for x"
            raise subprocess.CalledProcessError(1, cmd, stderr=err)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(peers, "PEERS_VENV", tmp_path / "peers")
    monkeypatch.setattr(peers, "_TRIED", set(), raising=False)
    monkeypatch.setattr(peers, "peer_bin", lambda name: None)
    monkeypatch.setattr(peers.subprocess, "run", pip)
    assert peers.ensure_peers(["sglang-router"]) == {"sglang-router": None}
    assert peers.ensure_peers(["sglang-router"]) == {"sglang-router": None}
    assert [c[0].endswith("pip") for c in calls] == [False, True]  # the venv, then pip, once
    err = capsys.readouterr().err
    assert "(once)" not in err
    assert "No matching distribution found for x (pip could not reach its index)" in err
    for remedy in ("network", "pip install sglang-router==0.3.2", "on PATH", "--routers"):
        assert remedy in err, (remedy, err)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--workload", "nope"], "argument --workload: invalid choice: 'nope'"),
        (["--router", "nope"], "argument --router: invalid choice: 'nope'"),
        (["--router", "oracle"], "argument --router: invalid choice: 'oracle'"),
        (["--runs", "0"], "argument --runs: '0': a whole number of runs, at least 1"),
        (["--scale", "0"], "argument --scale: '0': a fraction in (0, 1]"),
        (["--router", "sglang-router-cache_aware"], "pip install sglang-router==0.3.2"),
    ],
    ids=["workload", "router", "oracle", "runs", "scale", "peer-not-installed"],
)
def test_the_diagnosis_refuses_bad_options_before_starting(
    argv: list[str],
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A KeyError traceback (--workload, --router) or a StatisticsError (--runs 0) was the
    answer; now argparse's error naming the option, exit status 2, no fleet."""
    from router.bench import peers, routing_diag

    def no_fleet(*a: object, **kw: object) -> None:
        raise AssertionError("a fleet started")

    monkeypatch.setattr(routing_diag, "start_fleet_process", no_fleet)
    monkeypatch.setattr(peers, "peer_bin", lambda name: None)
    monkeypatch.setattr(sys, "argv", ["routing_diag", *argv])
    with pytest.raises(SystemExit) as exit_:
        routing_diag.main()
    assert exit_.value.code == 2
    assert expected in capsys.readouterr().err


def test_the_diagnosis_help_says_what_each_option_is(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from router.bench import routing_diag

    monkeypatch.setattr(sys, "argv", ["routing_diag", "--help"])
    with pytest.raises(SystemExit):
        routing_diag.main()
    text = capsys.readouterr().out
    for said in ("a built-in workload: seed,", "the router to diagnose", "runs on seeds"):
        assert said in " ".join(text.split()), said
    assert "kvroute.yaml" in text and "shrink the built-in workload" in text
