"""Workload files for `kvroute bench routing --workload-file`: the built-in workloads read
back from their files as the same runs, the run seed's order, the groups the ideal pins,
every malformed file refused naming its line, and a file driven end to end through real
routers in front of a simulated fleet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from router.bench import ideal, workloads
from router.bench.workload_file import GROUP_TOKENS, WorkloadFileError, dump, load
from router.bench.workloads import Texts
from router.tokenize import PACKAGED_TOKENIZER, LocalTokenizer


def write(path: Path, lines: list[dict[str, Any] | str]) -> Path:
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines)
    path.write_text(text + "\n")
    return path


def shape(w: workloads.Workload) -> list[list[list[tuple[str, str, int]]]]:
    return [[[(r.prompt, r.group, r.max_tokens) for r in c] for c in wave] for wave in w.waves]


@pytest.mark.parametrize(
    "name", ["multi-turn", "sibling-burst", "hot-prefix", "long-short-mix", "hot-prefix-full-batch"]
)
def test_a_written_workload_reads_back_as_the_same_run(tmp_path: Path, name: str) -> None:
    """Chains (multi-turn), waves (sibling-burst), the ideal's replicas (hot-prefix), the
    engines' length limit (long-short-mix) and batch (hot-prefix-full-batch) all survive the
    file."""
    w = workloads.build(name, run_seed=3, scale=0.1)
    path = tmp_path / f"{name}.jsonl"
    dump(w, path, taken=workloads.GENERATORS)
    back = load(path).build(run_seed=0)  # the file keeps run 3's order: shuffle false
    assert back.name == f"{name}-file"
    assert shape(back) == shape(w)
    assert (back.workers, back.kv_blocks, back.concurrency) == (
        w.workers,
        w.kv_blocks,
        w.concurrency,
    )
    assert back.replicas == w.replicas and back.sim_args == w.sim_args
    assert ideal.ideal_fraction(back) == ideal.ideal_fraction(w)


def test_each_run_seed_orders_the_chains_and_keeps_each_chain_whole(tmp_path: Path) -> None:
    convs = [
        {"prompt": f"Conversation {c} turn {t}", "chain": f"c{c}"}
        for c in range(8)
        for t in range(3)
    ]
    path = write(tmp_path / "chat.jsonl", [*convs, {"prompt": "after", "wave": 1}])
    f = load(path)
    orders = [[c[0].group for c in f.build(seed).waves[0]] for seed in range(4)]
    assert sorted(orders[0]) == [f"c{c}" for c in range(8)]
    assert len({tuple(o) for o in orders}) > 1, "every seed gave the same order"
    for seed in range(4):
        w = f.build(seed)
        for chain in w.waves[0]:  # turns in file order, one conversation per chain
            assert [r.prompt.split()[-1] for r in chain] == ["0", "1", "2"]
        assert [r.prompt for c in w.waves[1] for r in c] == ["after"]
    kept = write(tmp_path / "kept.jsonl", [{"shuffle": False}, *convs])
    assert [c[0].group for c in load(kept).build(5).waves[0]] == [f"c{c}" for c in range(8)]


def test_ungrouped_requests_are_grouped_by_their_opening_tokens(tmp_path: Path) -> None:
    tok = LocalTokenizer(PACKAGED_TOKENIZER)
    texts = Texts(tok, __import__("random").Random(0))
    system = texts.make(GROUP_TOKENS + 50, "System: ")
    other = texts.make(GROUP_TOKENS + 50, "Another system: ")
    lines: list[dict[str, Any] | str] = [{"prompt": f"{system}\nUser {i}: hello"} for i in range(3)]
    lines += [{"prompt": f"{other}\nUser 9: hi"}, {"prompt": f"{other} tail", "group": "mine"}]
    lines += [{"prompt": "Turn one", "chain": "conv"}]
    w = load(write(tmp_path / "g.jsonl", lines), tok).build(0)
    group = {r.prompt: r.group for r in w.requests}
    shared = {group[f"{system}\nUser {i}: hello"] for i in range(3)}
    assert len(shared) == 1 and shared != {group[f"{other}\nUser 9: hi"]}
    assert group[f"{other} tail"] == "mine" and group["Turn one"] == "conv"


BAD: list[tuple[str, list[dict[str, Any] | str], str]] = [
    ("empty", [""], "no requests"),
    ("header only", [{"workers": 2}], "a header but no requests"),
    ("not json", [{"prompt": "a"}, "{prompt: b}"], ":2: not JSON"),
    ("not an object", [{"prompt": "a"}, "[1, 2]"], ":2: each line must be a JSON object"),
    ("typo", [{"prompt": "a", "max_token": 3}], "unknown request key 'max_token'"),
    ("header typo", [{"worker": 2}, {"prompt": "a"}], "unknown header key 'worker'"),
    ("string count", [{"prompt": "a", "max_tokens": "16"}], "'max_tokens' must be a JSON integer"),
    ("bool count", [{"workers": True}, {"prompt": "a"}], "'workers' must be a JSON integer"),
    ("no workers", [{"workers": 0}, {"prompt": "a"}], ":1: 'workers' must be at least 1"),
    ("empty prompt", [{"prompt": "a"}, {"prompt": ""}], ":2: 'prompt' is empty"),
    ("zero tokens", [{"prompt": "a", "max_tokens": 0}], "'max_tokens' must be >= 1"),
    ("empty chain", [{"prompt": "a", "chain": ""}], "'chain' is empty"),
    ("replicas", [{"replicas": {"g": 0}}, {"prompt": "a"}], "replicas['g'] must be"),
    (
        "chain over waves",
        [{"prompt": "a", "chain": "c"}, {"prompt": "b", "chain": "c", "wave": 1}],
        ":2: chain 'c' is in wave 0 on line 1, here in wave 1",
    ),
    (
        "too long for the cache",
        [{"kv_blocks": 3, "block_size": 4}, {"prompt": "one two three four five six seven"}],
        "over the engines' 8; raise 'kv_blocks'",
    ),
    (
        "too long for the model",
        [{"max_model_len": 4}, {"prompt": "one two three four five six seven"}],
        "over the engines' 4; raise 'max_model_len'",
    ),
]


@pytest.mark.parametrize(("lines", "expected"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_file_is_refused_naming_its_line_and_the_fix(
    tmp_path: Path, lines: list[dict[str, Any] | str], expected: str
) -> None:
    path = write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(WorkloadFileError) as err:
        load(path)
    assert str(err.value).startswith(str(path)) and expected in str(err.value)


def test_the_oracle_spreads_a_repeated_text_as_the_ideal_does(tmp_path: Path) -> None:
    """One text asked four times in a group the ideal spreads over two workers: the oracle
    row keyed its placement by the text and sent every copy to one worker."""
    header = {"workload": "rep", "workers": 2, "replicas": {"g": 2}, "shuffle": False}
    path = write(
        tmp_path / "rep.jsonl", [header, *[{"prompt": "Same question?", "group": "g"}] * 4]
    )
    w = load(path).build(0)
    order = ideal.replay_order(w)
    expected = ideal.placement(w, {"Same question?": 4}, order)
    route = ideal.oracle_route(w)
    assert [route(r) for r in w.requests] == expected == [0, 1, 0, 1]


def kvroute(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "router.cli", "bench", "routing", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env, check=False)


def test_the_command_refuses_a_bad_file_and_a_taken_name_before_starting(tmp_path: Path) -> None:
    bad = write(tmp_path / "bad.jsonl", [{"prompt": "a", "max_token": 3}])
    out = kvroute("--workload-file", str(bad), "--no-install")
    assert out.returncode == 2 and "bad.jsonl:1: unknown request key 'max_token'" in out.stderr
    taken = write(tmp_path / "t.jsonl", [{"workload": "seed"}, {"prompt": "a"}])
    out = kvroute("--workload-file", str(taken), "--no-install")
    assert out.returncode == 2 and "'seed', which is already taken" in out.stderr
    out = kvroute("--workload", "seed", "--replicas", "nope", "--no-install")
    assert out.returncode == 2 and "--replicas: no workload 'nope'" in out.stderr
    for scale in ("0", "-1", "2"):
        out = kvroute("--workload", "seed", "--scale", scale, "--no-install")
        assert out.returncode == 2 and "give a fraction in (0, 1]" in out.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_hand_written_file_runs_through_the_routers(tmp_path: Path) -> None:
    """Three shared documents, each asked four times in a shuffled order on two workers
    that hold about two of them: kvroute keeps each on one worker, round robin does not."""
    tok = LocalTokenizer(PACKAGED_TOKENIZER)
    texts = Texts(tok, __import__("random").Random(1))
    docs = [texts.make(300, f"Document {d}: ") for d in range(3)]
    lines: list[dict[str, Any] | str] = [{"workload": "docs", "workers": 2, "kv_blocks": 48}]
    lines += [
        {"prompt": f"{docs[d]}\nQuestion {q}?", "max_tokens": 4} for d in range(3) for q in range(4)
    ]
    path = write(tmp_path / "docs.jsonl", lines)
    report = tmp_path / "r.json"
    out = kvroute(
        "--workload-file", str(path), "--routers", "kvroute", "round_robin",
        "--runs", "2", "--no-install", "--json", str(report),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(report.read_text())
    assert list(doc["workloads"]) == ["docs"]
    rows = doc["workloads"]["docs"]["routers"]
    kv, rr = rows["kvroute"], rows["round_robin"]
    assert kv["errors"] == 0 and sum(kv["requests_per_worker"]) == 12
    assert kv["cached_fraction"] > rr["cached_fraction"] + 0.1, (kv, rr)
    assert kv["cached_fraction"] <= doc["workloads"]["docs"]["ideal"] + 0.01


def test_the_bench_keeps_loopback_off_any_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTP_PROXY set for pip (the peers' install) must not send the bench's own loopback
    calls, nor its routers', to the proxy."""
    from router.bench_cli import _loopback_unproxied

    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "internal.example")
    monkeypatch.delenv("no_proxy", raising=False)
    _loopback_unproxied()
    _loopback_unproxied()  # twice: nothing repeated
    assert os.environ["NO_PROXY"] == "internal.example,127.0.0.1,localhost,::1"
    assert os.environ["no_proxy"] == "127.0.0.1,localhost,::1"
    assert urllib.request.proxy_bypass_environment("127.0.0.1")
