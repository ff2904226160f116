"""Check 6: two engines behind `kvroute serve` (child process, local tokenizer = the folder
the engines load). Repeated prefixes stick to one worker and their time to first token
drops; model pools hold (the LoRA adapter only `main` serves always lands there, the base
model on both, an unknown model is a 404 naming the served ones); fields given as vLLM's
request models also read them (`max_tokens: "3"`, `stream: "false"`) are served as the
engine reads them; `router-check` passes.
Then one worker restarts without --kv-events-config: `router-check` fails naming it, and
the router's /health turns 503."""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from conformance.client import client, stream_completion
from conformance.registry import Findings, check
from conformance.session import Context
from conformance.targets import KV_EVENTS, REPLAY, RESTART, ROUTER_CHECK, Engine
from conformance.traffic import token_source
from router.procs import RouterProcess
from router.tokenize import LocalTokenizer

PREFIXES = 4
REPEATS = 4
PREFIX_TOKENS = 900  # 4 x 29 blocks fit one worker's 127, should the router use only one
# router-check's repeat-prefix compares cold and cached TTFT: long prompts make the cached
# speed-up dominate the noise of a shared 2-core machine (cold prefill grows with length).
ROUTER_CHECK_ARGS = ("--prompt-tokens", "3000")
# router-check checks whose outcome rests on timing: repeat-prefix compares TTFTs, and
# load-spread needs its burst's requests to overlap at the router (requests that arrive one
# after another, each done before the next, are placed by prefix homes, not by load: a CI run
# saw 8 of 8 on one worker so). On a shared small machine one noisy run may fail them, so a
# healthy fleet gets up to 3 runs when nothing else failed (all runs reported).
TIMING_CHECKS = frozenset({"repeat-prefix", "load-spread"})
HEALTHY_ATTEMPTS = 3
_VOCABULARY = """
the of and to in is was for on that with as by at from his her it an are were which be
this had not but they have one all their there been has when who more will would into
time only new some could these two may first then do any like my now over such our man
me even most made after also did many before must through back years where much your
way well down should because each just those people how too little state good very make
world still own see men work long get here between both life being under never day same
another know while last might us great old year off come since against go came right
used take three river garden lamp copper valley winter signal harbor meadow lantern
"""
WORDS = tuple(_VOCABULARY.split())


def router_check_cmd() -> list[str]:
    script = Path(sys.executable).parent / "router-check"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from router.check.cli import main; sys.exit(main())"]


def run_router_check(
    url: str, token: str, call_timeout_s: float = 30.0, limit_s: float = 600.0
) -> dict[str, Any]:
    """`router-check --router URL --json`; --timeout bounds each of its calls; the admin
    token goes by environment, not on the command line."""
    cmd = [*router_check_cmd(), "--router", url, "--json", "--timeout", str(call_timeout_s)]
    cmd += ROUTER_CHECK_ARGS
    started = time.monotonic()
    env = {**os.environ, "KVROUTE_ADMIN_TOKEN": token}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s, env=env)
    out: dict[str, Any] = {
        "exit_code": done.returncode,
        "seconds": round(time.monotonic() - started, 1),
    }
    try:
        out["report"] = json.loads(done.stdout)
    except ValueError:
        out["stdout_tail"] = done.stdout[-1500:]
    out["stderr_tail"] = done.stderr[-800:]
    out["text"] = done.stdout + done.stderr
    return out


def failed_checks(run: dict[str, Any]) -> set[str]:
    report = run.get("report") or {}
    return {str(c.get("name")) for c in report.get("checks", []) if c.get("status") == "FAIL"}


def router_check_healthy(url: str, token: str) -> list[dict[str, Any]]:
    """router-check on a healthy fleet: rerun only while timing checks alone fail."""
    runs = [run_router_check(url, token)]
    while runs[-1]["exit_code"] != 0 and len(runs) < HEALTHY_ATTEMPTS:
        failed = failed_checks(runs[-1])
        if not failed or not failed <= TIMING_CHECKS:
            break
        runs.append(run_router_check(url, token))
    return runs


def prose(seed: str, tokenizer: LocalTokenizer, n_tokens: int) -> str:
    rng = token_source(seed)
    words: list[str] = []
    while len(tokenizer.completion(" ".join(words))) < n_tokens:
        words += rng.choices(WORDS, k=20)
    return " ".join(words)


@dataclass
class _Sent:
    prefix: int
    worker: str | None
    ttft_ms: float
    cached_tokens: int


async def _send_repeats(
    http: httpx.AsyncClient, model: str, tok: LocalTokenizer, gap_s: float
) -> list[_Sent]:
    """Each prefix REPEATS times, shuffled, one at a time."""
    prefixes = [prose(f"fleet-{i}", tok, PREFIX_TOKENS) for i in range(PREFIXES)]
    order = [(p, r) for p in range(PREFIXES) for r in range(REPEATS)]
    token_source("fleet-order").shuffle(order)
    sent = []
    for p, r in order:
        await asyncio.sleep(gap_s)
        done = await stream_completion(http, model, f"{prefixes[p]}\nQuestion {p}.{r}: why?")
        sent.append(_Sent(p, done.worker, round((done.ttft_s or 0) * 1e3, 1), done.cached_tokens))
    return sent


def _judge_repeats(f: Findings, sent: list[_Sent]) -> None:
    first: dict[int, _Sent] = {}
    repeats = []
    for s in sent:
        if s.prefix in first:
            repeats.append(s)
        else:
            first[s.prefix] = s
    strays = [s.__dict__ for s in repeats if s.worker != first[s.prefix].worker]
    cold = statistics.median(s.ttft_ms for s in first.values())
    warm = statistics.median(s.ttft_ms for s in repeats)
    f.note("prefix_workers", {p: s.worker for p, s in sorted(first.items())})
    f.note(
        "ttft_ms",
        {"cold": [s.ttft_ms for s in first.values()], "repeat": [s.ttft_ms for s in repeats]},
    )
    f.note("ttft_median_ms", {"cold": cold, "repeat": warm})
    f.note("repeat_cached_tokens", [s.cached_tokens for s in repeats])
    f.require(all(s.worker for s in sent), "the router sent no x-kvroute-worker header")
    f.require(not strays, f"{len(strays)} repeats left their prefix's worker: {strays[:5]}")
    f.require(warm < cold, f"repeat TTFT median {warm:.0f} ms is not below cold {cold:.0f} ms")


async def _health(http: httpx.AsyncClient) -> tuple[int, dict[str, Any]]:
    resp = await http.get("/health")
    return resp.status_code, resp.json()


async def _until_unhealthy(
    http: httpx.AsyncClient, model: str, broken: str, timeout_s: float = 120.0
) -> tuple[int, dict[str, Any], float]:
    """Poll /health while sending fresh prompts (some land on the broken worker)."""
    started = time.monotonic()
    i = 0
    while True:
        status, doc = await _health(http)
        if status == 503 and broken in doc.get("unhealthy_workers", []):
            return status, doc, time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            return status, doc, time.monotonic() - started
        prompt = " ".join(token_source(f"probe-{i}").choices(WORDS, k=80))
        await stream_completion(http, model, prompt)
        i += 1
        await asyncio.sleep(1.0)


def _worker_name(engine: Engine) -> str:
    return engine.url.split("://", 1)[1]


@check(
    "fleet",
    "two engines behind kvroute serve: repeats stick and get faster, router-check passes; "
    "a worker restarted without KV events makes router-check fail naming it and /health 503",
    needs=(KV_EVENTS, REPLAY, RESTART, ROUTER_CHECK),
    engines=("main", "peer"),
    timeout_s=1200.0,
)
async def fleet(ctx: Context, f: Findings) -> None:
    a, b = await ctx.engine("main"), await ctx.engine("peer")
    tok = LocalTokenizer(ctx.tokenizer_dir)
    router = await asyncio.to_thread(
        RouterProcess,
        [a.url, b.url],
        tokenizer=ctx.tokenizer_dir,
        ready_timeout=90.0,
        log_dir=ctx.workdir / "fleet-router",
    )
    atexit.register(router.stop)  # RouterProcess is a plain child: stop it on any exit
    try:
        f.note("router_log", str(router.log_path))
        async with client(router.url) as http:
            _judge_repeats(f, await _send_repeats(http, a.model, tok, ctx.target.ttft_gap_s))
            await _model_pools(http, a, b, tok, f)
            await _lax_fields(http, a.model, f)
            runs = await asyncio.to_thread(router_check_healthy, router.url, router.admin_token)
            f.note("router_check_healthy", {k: v for k, v in runs[-1].items() if k != "text"})
            f.note(
                "router_check_healthy_attempts",
                [{"exit_code": r["exit_code"], "failed": sorted(failed_checks(r))} for r in runs],
            )
            f.require(
                runs[-1]["exit_code"] == 0,
                f"router-check failed on a healthy fleet (exit {runs[-1]['exit_code']}, "
                f"failed {sorted(failed_checks(runs[-1]))}, {len(runs)} run(s))",
            )
            await _break_worker(b, http, a.model, router, f)
    finally:
        await asyncio.to_thread(router.stop)
        atexit.unregister(router.stop)


async def _lax_fields(http: httpx.AsyncClient, model: str, f: Findings) -> None:
    """Fields as vLLM's request models read them (pydantic's lax mode) pass the router and
    are served as the engine reads them: "false" is no stream, "3" and 2.0 are integers,
    `model: null` is the default model, and 300.0, true and "301" are token ids."""
    body = {"model": model, "prompt": "Lax fields, read as the engine reads them.", "n": 2.0}
    body |= {"max_tokens": "3", "ignore_eos": "true", "temperature": 0.7, "stream": "false"}
    r = await http.post("/v1/completions", json=body)
    kind = r.headers.get("content-type", "")
    seen: dict[str, Any] = {"status": r.status_code, "content_type": kind}
    if r.status_code == 200 and kind.startswith("application/json"):
        doc = r.json()
        seen |= {"choices": len(doc["choices"]), "output": doc["usage"]["completion_tokens"]}
    r = await http.post("/v1/completions", json=body | {"stream": "on", "n": "1"})
    seen["streamed"] = r.status_code == 200 and b"data: [DONE]" in r.content
    # no model named (null: the engine's default), token ids as numbers pydantic takes
    ids: dict[str, Any] = {"model": None, "prompt": [300.0, True, "301", 302], "max_tokens": 2}
    r = await http.post("/v1/completions", json=ids)
    seen["ids"] = r.status_code
    seen["ids_batch"] = (
        await http.post("/v1/completions", json=ids | {"prompt": [[300.0, 301], [True, 5.0]]})
    ).status_code
    f.note("lax_fields", seen)
    want = {"status": 200, "choices": 2, "output": 6, "streamed": True, "ids": 200}
    want["ids_batch"] = 200
    f.require(
        {k: seen.get(k) for k in want} == want,
        f'max_tokens "3", n 2.0, stream "false" then "on" through kvroute: {seen}',
    )


async def _model_pools(
    http: httpx.AsyncClient, a: Engine, b: Engine, tok: LocalTokenizer, f: Findings
) -> None:
    """`a` serves the base model and its LoRA adapter, `b` the base model only."""
    lora = a.lora_name
    f.require(lora is not None and b.lora_name is None, "engine specs changed: no LoRA on main")
    assert lora is not None
    landed: dict[str, list[str | None]] = {a.model: [], lora: []}
    for i in range(6):
        for model in landed:
            done = await stream_completion(http, model, prose(f"pool-{model}-{i}", tok, 200))
            landed[model].append(done.worker)
    f.note("model_pools", landed)
    strays = [w for w in landed[lora] if w != _worker_name(a)]
    f.require(not strays, f"{len(strays)} {lora} requests went to a worker without the adapter")
    f.require(
        None not in landed[a.model], "a base-model request came back without the worker header"
    )
    resp = await http.post("/v1/completions", json={"model": "no-such-model", "prompt": "hi"})
    message = resp.json().get("error", {}).get("message", "") if resp.status_code == 404 else ""
    f.note("unknown_model", {"status": resp.status_code, "message": message})
    f.require(
        resp.status_code == 404 and a.model in message and lora in message,
        f"an unknown model got {resp.status_code}, not a 404 naming the served models",
    )


async def _break_worker(
    b: Engine, http: httpx.AsyncClient, model: str, router: RouterProcess, f: Findings
) -> None:
    name = _worker_name(b)
    await asyncio.to_thread(b.restart, kv_events=False)
    f.note("restarted_without_events", name)
    failed = await asyncio.to_thread(run_router_check, router.url, router.admin_token)
    f.note("router_check_broken", {k: v for k, v in failed.items() if k != "text"})
    f.require(failed["exit_code"] != 0, "router-check passed with a worker publishing no KV events")
    f.require(name in failed["text"], f"router-check's output does not name {name}")
    status, doc, waited = await _until_unhealthy(http, model, name)
    f.note("health_after", {"status": status, "seconds": round(waited, 1), "doc": doc})
    f.require(
        status == 503, f"/health answered {status}, not 503, {waited:.0f} s after the restart"
    )
    f.require(name in doc.get("unhealthy_workers", []), f"/health does not name {name}")
