"""Regenerate the golden fixtures from real vLLM:

    python -m conformance.capture_fixtures --out tests/fixtures/vllm-0.32.0

Runs the conformance checks `chaining-32byte` and `chaining` against real vLLM with their
scenario captures written to --out (one folder per scenario: the frames as
`kvroute events capture --replay-endpoint` wrote them, history older than the scenario
dropped; queries.jsonl; expected.jsonl from vLLM's own cached_tokens; scenario.json), then
writes MANIFEST.json (versions, engine flags and environment). Fails, writing nothing
half-done into --out, unless every scenario's three answers agree.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conformance.checks import registry
from conformance.registry import exit_code, plan
from conformance.session import Context, Session, run_checks
from conformance.targets import DEFAULT_MODEL_DIR, ROLES, EngineSpec, VllmTarget, vllm_server

CHECKS = ("chaining-32byte", "chaining")
MANIFEST = "MANIFEST.json"


def engine_flags(model_dir: Path, spec: EngineSpec) -> dict[str, Any]:
    """The vLLM command line and environment for a role (ports shown as 0: picked per run)."""
    server = vllm_server(model_dir, spec)
    cmd = server.command()
    cmd[0] = "python"
    cmd = [a.replace(str(model_dir), "$MODEL_DIR") for a in cmd]
    env = {k: v for k, v in server.environment().items() if k.startswith(("VLLM_", "HF_"))}
    return {"command": cmd, "env": env}


def manifest(target: VllmTarget, scenarios: list[str]) -> dict[str, Any]:
    roles = {r: engine_flags(target.model_dir, ROLES[r]) for r in ("main", "bytes")}
    return {
        "generated_by": "python -m conformance.capture_fixtures",
        "generated_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "versions": target.versions(),
        "model": "conformance/model.py: seeded random tiny Llama + lora-a, packaged tokenizer",
        "engines": roles,
        "scenarios": scenarios,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="e.g. tests/fixtures/vllm-0.32.0")
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    args = p.parse_args(argv)
    target = VllmTarget(args.model_dir)
    checks = plan("vllm", CHECKS, registry())
    staging = Path(tempfile.mkdtemp(prefix="kvroute-fixtures-"))
    ctx = Context(target, Session(target, checks), staging / "work", staging / "out")
    results = asyncio.run(run_checks(ctx, checks))
    for r in results:
        print(f"{r.name}: {r.status} ({r.reason})", file=sys.stderr)
    if exit_code(results) != 0:
        print(f"not written: the checks failed; captures kept in {staging}", file=sys.stderr)
        return 1
    scenarios = sorted(d.name for d in (staging / "out").iterdir())
    doc = manifest(target, scenarios)
    (staging / "out" / MANIFEST).write_text(json.dumps(doc, indent=1) + "\n")
    if args.out.exists():
        shutil.rmtree(args.out)
    shutil.copytree(staging / "out", args.out)
    shutil.rmtree(staging, ignore_errors=True)
    print(f"wrote {len(scenarios)} scenarios to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
