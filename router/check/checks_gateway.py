"""`router-check --gateway URL`: an Envoy (or GIE gateway) listener in front of kvroute's
ext_proc picker, probed as a client: the picker is consulted, the gateway sends each request
where the picker said, a repeated prefix comes back to its worker cached, and (with
--gateway-admin) which failure mode and body mode the gateway runs with.

Evidence comes from two response headers: `x-kvroute-worker` (set by the picker: what it
picked) and `x-gateway-destination-endpoint-served` (set by the gateway: where it went; the
`kvroute envoy-config` bootstrap adds it)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import httpx

from router.check.httpio import Fetched, bearer, fetch
from router.check.model import Report, Result, Status, failed, passed, warned
from router.check.prompts import fresh_text
from router.forward import cached_tokens_of

PICKED = "x-kvroute-worker"
SERVED = "x-gateway-destination-endpoint-served"
UNREACHABLE_FIX = (
    "start the picker (kvroute serve --ext-proc-port P) and point the gateway's ext_proc "
    "grpc_service at it (kvroute envoy-config --ext-proc HOST:P)"
)
POLICY_FIX = (
    "the gateway load-balances on its own: give the worker cluster the override_host "
    "load-balancing policy reading metadata envoy.lb / x-gateway-destination-endpoint, let "
    "ext_proc write that namespace (metadata_options.receiving_namespaces: [envoy.lb]) and "
    "clear the route cache (no disable_clear_route_cache, route_cache_action not RETAIN); "
    "`kvroute envoy-config` prints such a bootstrap"
)
UNREACHED_FIX = "start the gateway, or correct --gateway"
SERVED_FIX = (
    "add the response header x-gateway-destination-endpoint-served: %UPSTREAM_HOST% on the "
    "gateway's route (kvroute envoy-config does) so that the served endpoint can be seen"
)


@dataclass(frozen=True)
class GatewayOptions:
    gateway: str
    admin: str | None = None
    timeout_s: float = 10.0
    pairs: int = 3
    prompt_words: int = 900
    api_key: str | None = field(default=None, repr=False)  # the workers' --api-key


@dataclass
class Probe:
    status: int | None
    picked: str | None
    served: str | None
    cached: int | None = None
    error: str = ""


class GatewayContext:
    def __init__(self, opts: GatewayOptions, http: httpx.AsyncClient) -> None:
        self.opts = opts
        self.http = http
        self.base = opts.gateway.rstrip("/")
        self.model = ""
        self.answered = False  # the gateway answered at all: the other checks need it

    async def get(self, url: str) -> Fetched:
        return await fetch(self.http, "GET", url, timeout=self.opts.timeout_s)

    async def probe(self, prompt: str) -> Probe:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        url = self.base + "/v1/completions"
        try:
            resp = await self.http.post(url, json=body, timeout=self.opts.timeout_s)
        except httpx.HTTPError as exc:
            return Probe(None, None, None, error=f"{type(exc).__name__}: {exc}")
        h = resp.headers
        cached = cached_tokens_of(resp.content) if resp.status_code == 200 else None
        return Probe(resp.status_code, h.get(PICKED), h.get(SERVED), cached, resp.text[:200])


async def check_gateway(ctx: GatewayContext) -> Result:
    models = await ctx.get(ctx.base + "/v1/models")
    if models.status is None:
        return failed("gateway", f"cannot reach {ctx.base}: {models.error}", UNREACHED_FIX)
    ctx.answered = True
    data = models.body.get("data") if isinstance(models.body, dict) else None
    if not models.ok or not data:
        # the picker answers /v1/models itself: gateway-picker says why it does not
        return warned("gateway", f"GET /v1/models through the gateway: {models.describe()}")
    ctx.model = str(data[0].get("id", ""))
    return passed("gateway", f"GET /v1/models: {[m.get('id') for m in data]}", model=ctx.model)


async def check_picker(ctx: GatewayContext) -> Result:
    probes = [await ctx.probe(fresh_text(32, "gateway")) for _ in range(4)]
    picked = [p for p in probes if p.picked]
    if len(picked) == len(probes):
        return passed("gateway-picker", f"{len(probes)}/{len(probes)} requests carry a pick")
    statuses = sorted({p.status or 0 for p in probes})
    if picked:
        n = f"{len(picked)}/{len(probes)}"
        why = f"picker intermittent: only {n} requests were picked (statuses {statuses})"
    elif all((p.status or 500) >= 500 for p in probes):
        why = f"picker unreachable: the gateway answers {statuses} (fail-close)"
    else:
        why = f"picker unreachable or not consulted: answers {statuses} carry no {PICKED}"
    return failed("gateway-picker", why, UNREACHABLE_FIX)


async def check_honours_pick(ctx: GatewayContext) -> Result:
    probes = [await ctx.probe(fresh_text(32, "honour")) for _ in range(8)]
    seen = [p for p in probes if p.picked and p.served]
    if not seen:
        if any(p.picked for p in probes):
            return warned("gateway-honours-pick", f"no {SERVED} header: {SERVED_FIX}")
        return warned("gateway-honours-pick", "not run: no request was picked")
    wrong = [p for p in seen if p.served not in (p.picked or "").split(",")]
    if wrong:
        pairs = ", ".join(f"picked {p.picked} served {p.served}" for p in wrong[:3])
        return failed(
            "gateway-honours-pick", f"{len(wrong)}/{len(seen)} went elsewhere: {pairs}", POLICY_FIX
        )
    return passed("gateway-honours-pick", f"{len(seen)}/{len(seen)} served where picked")


async def check_kv_routing(ctx: GatewayContext) -> Result:
    """Fresh long prompts sent twice: the repeat lands where the first went, cached."""
    same, cached, total = 0, 0, 0
    for _ in range(ctx.opts.pairs):
        text = fresh_text(ctx.opts.prompt_words, "gateway-repeat")
        first = await ctx.probe(text)
        await asyncio.sleep(0.2)  # let the worker's KV events reach the picker
        again = await ctx.probe(text)
        total += 1
        where = (first.served or first.picked, again.served or again.picked)
        same += int(where[0] is not None and where[0] == where[1])
        cached += int((again.cached or 0) > 0)
    evidence = f"{same}/{total} repeats on the first one's worker, {cached}/{total} cached"
    if same < total:
        return failed("gateway-kv-routing", evidence, "KV routing is not live end to end: "
                      "run router-check --router against kvroute itself to see why")  # fmt: skip
    if cached == 0:
        return warned("gateway-kv-routing", evidence + " (no cached_tokens reported: run "
                      "vLLM with --enable-prompt-tokens-details to prove the hit)")  # fmt: skip
    return passed("gateway-kv-routing", evidence)


async def check_failure_mode(ctx: GatewayContext) -> Result:
    if ctx.opts.admin is None:
        return warned(
            "gateway-config", "failure mode unknown: pass --gateway-admin http://ENVOY:ADMIN"
        )
    dump = await ctx.get(ctx.opts.admin.rstrip("/") + "/config_dump")
    if not dump.ok or not isinstance(dump.body, dict):
        return warned("gateway-config", f"Envoy admin /config_dump: {dump.describe()}")
    found = read_envoy_config(dump.body)
    problems = envoy_problems(found)
    evidence = (
        f"failure mode {found['failure_mode']}, body {found['body_mode']}, "
        f"override_host {'on' if found['override_host'] else 'missing'}"
    )
    if problems:
        return failed("gateway-config", evidence + ": " + "; ".join(problems), POLICY_FIX)
    return passed("gateway-config", evidence, **found)


def read_envoy_config(dump: dict[str, Any]) -> dict[str, Any]:
    """The facts that decide whether the picker's answer is used, from /config_dump."""
    ext_procs = list(_find_typed(dump, "ext_proc.v3.ExternalProcessor"))
    ext = ext_procs[0] if ext_procs else {}
    mode = ext.get("processing_mode", {})
    receiving = ext.get("metadata_options", {}).get("receiving_namespaces", {})
    return {
        "ext_proc": bool(ext_procs),
        "failure_mode": "open" if ext.get("failure_mode_allow") else "close",
        "body_mode": mode.get("request_body_mode", "NONE"),
        "receives_envoy_lb": "envoy.lb" in receiving.get("untyped", []),
        "clears_route_cache": not ext.get("disable_clear_route_cache", False)
        and ext.get("route_cache_action") != "RETAIN",
        "override_host": any(_find_typed(dump, "override_host.v3.OverrideHost")),
    }


def envoy_problems(found: dict[str, Any]) -> list[str]:
    checks = [
        (found["ext_proc"], "no ext_proc filter: the picker is never asked"),
        (found["override_host"], "override_host policy missing"),
        (found["receives_envoy_lb"], "ext_proc drops the envoy.lb metadata"),
        (found["clears_route_cache"], "route cache not cleared"),
        (
            not (found["failure_mode"] == "open" and found["body_mode"] == "FULL_DUPLEX_STREAMED"),
            "fail-open with FULL_DUPLEX_STREAMED bodies cannot fail open",
        ),
    ]
    return [text for ok, text in checks if not ok]


def _find_typed(node: Any, type_suffix: str) -> Any:
    if isinstance(node, dict):
        if str(node.get("@type", "")).endswith(type_suffix):
            yield node
        for v in node.values():
            yield from _find_typed(v, type_suffix)
    elif isinstance(node, list):
        for v in node:
            yield from _find_typed(v, type_suffix)


GATEWAY_CHECKS = (
    ("gateway", check_gateway),
    ("gateway-picker", check_picker),
    ("gateway-honours-pick", check_honours_pick),
    ("gateway-kv-routing", check_kv_routing),
    ("gateway-config", check_failure_mode),
)
GATEWAY_NAMES = tuple(name for name, _ in GATEWAY_CHECKS)


async def run_gateway_checks(opts: GatewayOptions, skip: frozenset[str] = frozenset()) -> Report:
    report = Report(opts.gateway)
    async with httpx.AsyncClient(headers=bearer(opts.api_key)) as http:
        ctx = GatewayContext(opts, http)
        for name, check in GATEWAY_CHECKS:
            if name in skip:
                continue
            result = await _bounded(name, check(ctx), 20 * opts.timeout_s)
            if name == "gateway" and not ctx.answered:
                # whatever stopped it (refused, timed out, an error), nothing was reached:
                # the later checks would only warn, and a run of warnings reads as OK
                result = _unreached(ctx, result)
                report.fatal = result.evidence
            report.results.append(result)
            if report.fatal is not None:
                break
    return report


def _unreached(ctx: GatewayContext, result: Result) -> Result:
    if result.status is Status.FAIL:
        return result
    return failed("gateway", f"cannot reach {ctx.base}: {result.evidence}", UNREACHED_FIX)


async def _bounded(name: str, run: Any, budget: float) -> Result:
    try:
        result: Result = await asyncio.wait_for(run, budget)
    except TimeoutError:
        return warned(name, f"did not finish within {budget:g} s")
    except Exception as exc:  # reported, never a silent PASS
        return warned(name, f"could not run: {type(exc).__name__}: {exc}")
    return result
