"""Check 7: the prefill->decode handoff behind `kvroute serve`. Two engines with vLLM's
NixlConnector (`conformance.pd_engines`: real vLLM 0.32 CPU engines in float32, or
simulated workers moving real bytes with NIXL) as a prefill and a decode worker:

- a router with `--pd-threshold 512`: a short prompt stays local, long ones split; each
  split's text equals the unsplit greedy text (the same prompt on the cache-reset decode
  engine alone); the decode engine's metrics prove every pull (external_kv_transfer tokens
  ~ the prompt, bytes moved); the router's own verification proves them too;
- the same router with its test fault on (`--pd-fault-strip-params`, decode legs without
  their params): the answer is the same, but nothing moved, and the router's /health turns
  degraded naming the decode worker, and router-check's pd-path check fails with the fix;
- a router with `--pd-threshold auto`: its probe handoff measures the link and the KV bytes
  per token before it splits anything.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import httpx

from conformance.client import LIMITS
from conformance.pd_engines import PDPair, pd_pair
from conformance.pd_harness import Leg, decode_leg, prompt_for, reset_cache, snapshot
from conformance.registry import Findings, check
from conformance.session import Context
from conformance.targets import ENGINE
from engines.sim.pd_config import nixl_available
from router.check.context import Options
from router.check.runner import run_checks
from router.procs import RouterProcess

THRESHOLD = 512
SHORT, LONG = 100, (1024, 3000)


def ask(client: httpx.Client, url: str, model: str, prompt: str) -> Leg:
    """A greedy streamed completion; through the router, or to an engine directly."""
    return decode_leg(client, url, model, prompt, None, f"pd-check-{uuid.uuid4().hex[:8]}")


def count(client: httpx.Client, pair: PDPair, prompt: str) -> int:
    doc = client.post(pair.decode.url + "/tokenize", json={"model": pair.model, "prompt": prompt})
    return len(doc.json()["tokens"])


def router(pair: PDPair, ctx: Context, *extra: str) -> RouterProcess:
    workers = ["--prefill-worker", pair.prefill.url, "--decode-worker", pair.decode.url]
    return RouterProcess(
        [], tokenizer=ctx.tokenizer_dir, extra=[*workers, *extra], ready_timeout=120
    )


def pd_health(r: RouterProcess) -> tuple[int, dict[str, Any]]:
    resp = httpx.get(r.url + "/health", timeout=10)
    doc: dict[str, Any] = resp.json()
    return resp.status_code, doc


def wait_health(
    r: RouterProcess, key: str, at_least: float, timeout: float = 30.0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    doc: dict[str, Any] = {}
    while time.monotonic() < deadline:
        doc = pd_health(r)[1].get("pd") or {}
        if (doc.get(key) or 0) >= at_least:
            break
        time.sleep(0.2)
    return doc


# ---- the three routers ----------------------------------------------------------------------


def split_and_local(client: httpx.Client, pair: PDPair, ctx: Context, f: Findings) -> None:
    with router(pair, ctx, "--pd-threshold", str(THRESHOLD), "--no-pd-probe") as r:
        warm = ask(client, r.url, pair.model, prompt_for(client, pair, 600, "warm"))  # handshake
        f.require(warm.status == 200 and warm.pd_header.startswith("split"), f"first split: {warm}")
        short = ask(client, r.url, pair.model, prompt_for(client, pair, SHORT, "short"))
        f.note("short_prompt", short.pd_header)
        local = short.pd_header
        f.require(local == "local reason=below_threshold", f"short prompt: {local!r}")
        f.note("splits", [one_split(client, pair, r, n, f) for n in LONG])
        doc = wait_health(r, "verified_handoffs", 1 + len(LONG))
        f.note(
            "router_verification",
            {k: doc.get(k) for k in ("verified_handoffs", "silent_recomputes", "kv_bytes_moved")},
        )
        f.require(
            doc.get("verified_handoffs") == 1 + len(LONG),
            f"the router proved {doc.get('verified_handoffs')} of {1 + len(LONG)} splits",
        )
        f.require(
            doc.get("silent_recomputes") == 0 and doc.get("status") == "ok",
            f"router P/D health: {doc}",
        )


def one_split(
    client: httpx.Client, pair: PDPair, r: RouterProcess, tokens: int, f: Findings
) -> dict[str, Any]:
    prompt = prompt_for(client, pair, tokens, f"split{tokens}x")
    n = count(client, pair, prompt)
    before = snapshot(client, pair.decode.url)
    start = time.perf_counter()
    split = ask(client, r.url, pair.model, prompt)
    seconds = time.perf_counter() - start
    moved = snapshot(client, pair.decode.url) - before
    reset_cache(client, pair.decode.url)
    time.sleep(pair.gap_s)
    whole = ask(client, pair.decode.url, pair.model, prompt)  # unsplit, on the decode engine
    proved = moved.bytes_transferred > 0 and moved.external_kv_transfer >= 0.9 * n
    decided = split.pd_header
    f.require(decided.startswith("split"), f"{n} tokens were not split: {decided!r}")
    f.require(
        split.same_output(whole),
        f"{n} tokens: split output {split.token_ids or split.text!r} != unsplit "
        f"{whole.token_ids or whole.text!r}",
    )
    f.require(
        proved,
        f"{n} tokens: the decode engine shows no pull (bytes {moved.bytes_transferred:.0f}, "
        f"external tokens {moved.external_kv_transfer:.0f})",
    )
    link = moved.link_bytes_per_s
    return {
        "prompt_tokens": n,
        "decision": split.pd_header,
        "text_equal": split.same_output(whole),
        "bytes_moved": moved.bytes_transferred,
        "xfer_ms": round(moved.xfer_seconds * 1000, 2),
        "link_mb_s": None if link is None else round(link / 1e6, 1),
        "external_kv_transfer": moved.external_kv_transfer,
        "request_ms": round(seconds * 1000, 1),
    }


def planted_silent_recompute(client: httpx.Client, pair: PDPair, ctx: Context, f: Findings) -> None:
    fault = ("--pd-threshold", str(THRESHOLD), "--no-pd-probe", "--pd-fault-strip-params")
    with router(pair, ctx, *fault) as r:
        prompt = prompt_for(client, pair, LONG[0], "silent")
        n = count(client, pair, prompt)
        before = snapshot(client, pair.decode.url)
        answer = ask(client, r.url, pair.model, prompt)
        moved = snapshot(client, pair.decode.url) - before
        f.require(answer.status == 200, f"the stripped decode leg answered {answer.status}")
        f.require(
            moved.transfers == 0 and moved.local_compute >= 0.9 * n,
            f"the stripped leg moved {moved}",
        )
        doc = wait_health(r, "silent_recomputes", 1)
        status, health = pd_health(r)
        f.note(
            "planted",
            {
                "health_status": status,
                "status": health.get("status"),
                "pd": {k: doc.get(k) for k in ("silent_recomputes", "workers", "problems", "fix")},
            },
        )
        named = pair.decode.url.split("//")[1] in (doc.get("workers") or [])
        f.require(
            status == 200 and health.get("status") == "degraded" and named,
            f"/health after a silent recompute: {status} {health.get('status')} {doc}",
        )
        report = asyncio.run(run_checks(Options(r.url, admin_token=r.admin_token, timeout_s=60)))
        pd = next((x for x in report.results if x.name == "pd-path"), None)
        f.note("router_check_pd_path", pd.to_json() if pd else None)
        f.require(
            pd is not None
            and pd.status.value == "FAIL"
            and "--pd-fault-strip-params" in (pd.fix or ""),
            f"router-check pd-path: {pd}",
        )


def auto_calibrates(pair: PDPair, ctx: Context, f: Findings) -> None:
    with router(pair, ctx) as r:
        deadline = time.monotonic() + 120
        doc: dict[str, Any] = {}
        while time.monotonic() < deadline:
            doc = pd_health(r)[1].get("pd") or {}
            if doc.get("calibration") in ("done", "failed"):
                break
            time.sleep(0.5)
        f.note(
            "auto",
            {
                k: doc.get(k)
                for k in (
                    "calibration",
                    "link_mb_s",
                    "kv_bytes_per_token",
                    "overhead_ms",
                    "problems",
                )
            },
        )
        f.require(
            doc.get("calibration") == "done" and bool(doc.get("link_mb_s")), f"auto's probe: {doc}"
        )


def run(ctx: Context, f: Findings) -> None:
    with (
        pd_pair(ctx.target.name) as pair,
        httpx.Client(timeout=180, trust_env=False, limits=LIMITS) as client,
    ):
        f.note("engines", pair.notes)
        split_and_local(client, pair, ctx, f)
        planted_silent_recompute(client, pair, ctx, f)
        auto_calibrates(pair, ctx, f)


@check(
    "pd",
    "prefill->decode behind kvroute: short local, long split, same text, every pull proved; "
    "a planted silent recompute caught; auto measures the link",
    needs=(ENGINE,),
    timeout_s=1200,
)
async def pd(ctx: Context, f: Findings) -> None:
    missing = nixl_available()
    if not f.require(missing is None, missing or ""):
        return
    await asyncio.to_thread(run, ctx, f)
