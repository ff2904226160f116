"""The router's own endpoints (everything that is not forwarded to a worker):

GET  /health          the detailed report: 503 only when routing is broken or silent, naming
                      each broken worker, the reason and the fix (a client's 4xx never counts)
GET  /ready           200 once an endpoint can take traffic (a replica: and its peers heard)
GET  /live            200 while the process runs (never depends on the workers)
GET  /metrics         Prometheus
GET  /v1/models       the union of the workers' models (their --api-key asked, if any)
GET|POST /admin/workers                 the worker list (POST replaces it)
POST /admin/workers/NAME/drain|undrain  take a worker out of rotation (in-flight requests
                                        finish) before a rolling update, and back
GET|POST /debug/route                   how a prompt would be routed, from the live index

/admin and /debug need the admin token (`Authorization: Bearer T`); without a token
configured they answer 404 unless --admin-insecure is given.

With `--processes N` an admin change reaches one process; it applies it and passes it on to
the others over their private unix sockets (router/processes.py) before answering, so every
process routes alike. A process that cannot take it is named in a 502 (retry the call).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import httpx
import msgspec

from router.asgi import Receive, Scope, Send, header, read_body, send_bytes, send_json
from router.core.decision import Decision
from router.core.errors import (
    BadRequest,
    ConfigError,
    Forbidden,
    MethodNotAllowed,
    NotFound,
    UpstreamError,
)
from router.metrics import RouterMetrics
from router.openai_req import parse
from router.routing import DecisionService
from router.sources import WorkerSources
from router.verdicts import worker_reports

if TYPE_CHECKING:
    from router.pd.door import PDDoor
    from router.processes import ProcessRole

FANOUT = b"x-kvroute-fanout"  # an admin change passed on by a sibling process
FANOUT_TIMEOUT_S = 10.0

log = logging.getLogger("kvroute.proxy")

PATHS = frozenset(
    {"/health", "/ready", "/live", "/metrics", "/v1/models", "/admin/workers", "/debug/route"}
)
GET_ONLY = frozenset({"/health", "/ready", "/live", "/metrics", "/v1/models"})


def is_control(path: str) -> bool:
    return path in PATHS or path.startswith("/admin/")


class Control:
    def __init__(
        self,
        svc: DecisionService,
        sources: WorkerSources,
        metrics: RouterMetrics,
        role: ProcessRole | None = None,
    ) -> None:
        self.role = role
        self.svc = svc
        self.sources = sources
        self.pool = sources.pool
        self.metrics = metrics
        self.config = svc.config
        self.pd: PDDoor | None = None  # the P/D door: its health item, its /debug/route part

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        if path in GET_ONLY and method != "GET":
            raise MethodNotAllowed(f"{path} takes GET")
        if path == "/metrics" and not self.config.metrics:
            raise NotFound("/metrics is off (--no-metrics)")
        if path.startswith("/admin/workers/"):
            self._authorize(scope)
            await self._drain(path, method, send, scope)
        elif path == "/health":
            status, doc = self.health()
            await send_json(send, status, doc)
        elif path == "/ready":
            ready = self.svc.ready  # once: it turns with the clock (a replica's peer wait)
            await send_json(send, 200 if ready else 503, {"ready": ready})
        elif path == "/live":
            await send_json(send, 200, {"live": True})
        elif path == "/metrics":
            await send_bytes(send, 200, self.metrics.render(), b"text/plain; version=0.0.4")
        elif path == "/v1/models":
            if not self._api_key_ok(scope):
                # vLLM's own answer (--api-key guards /v1/*): the list is the workers'
                await send_json(send, 401, {"error": "Unauthorized"})
                return
            await send_json(send, 200, self.svc.models_doc())
        elif path == "/admin/workers":
            self._authorize(scope)
            if method == "POST":
                body = await read_body(receive, 1 << 20)
                await self._reload_workers(body)  # saved for later siblings as it is set
                await self._fan_out(scope, body)
            elif method != "GET":
                raise MethodNotAllowed("/admin/workers takes GET or POST")
            await send_json(send, 200, {"workers": self.worker_list()})
        else:
            self._authorize(scope)
            body = await read_body(receive, self.config.max_body_bytes) if method == "POST" else b""
            await send_json(send, 200, await self.debug_route(scope, body))

    def _api_key_ok(self, scope: Scope) -> bool:
        """Where workers run with vLLM's --api-key, the router's own /v1/models asks for
        one of their keys as they would; without keys it is open, as they are."""
        keys = {h.api_key for h in self.pool.handles.values() if h.api_key}
        if not keys:
            return True
        scheme, _, given = (header(scope, b"authorization") or b"").partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        digest = hashlib.sha256(given).digest()
        wanted = (hashlib.sha256(k.encode()).digest() for k in keys)
        return any([hmac.compare_digest(digest, w) for w in wanted])

    def _authorize(self, scope: Scope) -> None:
        token = self.config.admin_token
        if token is None:
            if self.config.admin_insecure:
                return
            raise NotFound(
                f"no route for {scope['method']} {scope['path']} (admin and debug endpoints "
                "are off: start kvroute with --admin-token)"
            )
        given = header(scope, b"authorization") or b""
        if not hmac.compare_digest(given, f"Bearer {token}".encode()):
            raise Forbidden("admin endpoint: send 'Authorization: Bearer <admin_token>'")

    async def _fan_out(self, scope: Scope, body: bytes) -> None:
        """Pass an admin change this process applied on to its sibling processes."""
        if self.role is None or self.role.count < 2:
            return
        server = scope.get("server")
        if header(scope, FANOUT) and server is not None and server[1] is None:
            return  # came from a sibling over its unix socket: already passed on
        headers = {FANOUT.decode(): "1", "content-type": "application/json"}
        auth = header(scope, b"authorization")
        if auth:
            headers["authorization"] = auth.decode()
        scheme = "https" if self.config.tls_cert else "http"
        failed = []
        for i in self.role.siblings:
            transport = httpx.AsyncHTTPTransport(uds=str(self.role.admin_socket(i)))
            # our own sibling behind a 0600 socket: its certificate names the public host
            async with httpx.AsyncClient(
                transport=transport, timeout=FANOUT_TIMEOUT_S, verify=False
            ) as client:
                try:
                    r = await client.post(
                        f"{scheme}://kvroute{scope['path']}", content=body, headers=headers
                    )
                    if r.status_code != 200:
                        failed.append(f"process {i + 1}: {r.status_code} {r.text[:200]}")
                except httpx.HTTPError as exc:
                    failed.append(f"process {i + 1}: {exc!r}")
        if failed:
            raise UpstreamError(
                f"applied by process {self.role.index + 1} of {self.role.count}, but not by "
                f"{'; '.join(failed)}; send the call again",
            )

    async def _drain(self, path: str, method: str, send: Send, scope: Scope) -> None:
        """POST /admin/workers/NAME/drain | /undrain (NAME: host:port as listed)."""
        name, _, action = path.removeprefix("/admin/workers/").rpartition("/")
        if action not in ("drain", "undrain") or not name:
            raise NotFound(f"no route for {method} {path}")
        if method != "POST":
            raise MethodNotAllowed(f"{path} takes POST")
        h = self.pool.handles.get(name)
        if h is None:
            known = ", ".join(sorted(self.pool.handles)) or "none"
            raise NotFound(f"unknown worker {name!r}; workers: {known}", param="worker")
        h.set_draining(action == "drain")
        self.sources.save_admin_state()
        await self._fan_out(scope, b"")
        inflight = sum(self.svc.fleet.load.view(s.name).requests for s in h.states)
        log.warning("worker %s %sed by the admin API (%d in flight)", name, action, inflight)
        await send_json(send, 200, {"worker": name, "draining": h.draining, "in_flight": inflight})

    def health(self) -> tuple[int, dict[str, Any]]:
        reports = [r for h in self.pool.handles.values() for r in worker_reports(self.pool, h)]
        statuses = {r["status"] for r in reports}
        drained = [r["name"] for r in reports if r["draining"]]
        serving = any(r["available"] and not r["draining"] for r in reports)
        if "unhealthy" in statuses or not serving:
            status = "unhealthy"
        elif statuses - {"ok"}:  # degraded or ejected workers: routing goes on without them
            status = "degraded"
        else:
            status = "ok"
        degraded_ok = status == "degraded" and self.config.health_degraded_ok
        code = 200 if status == "ok" or degraded_ok else 503
        pd = self.pd.health() if self.pd is not None else None
        if pd is not None and pd["status"] != "ok" and status == "ok":
            status = "degraded"  # a P/D finding is named, never a 503: requests are served
        if not self.config.health_details:  # no addresses, no problem texts
            counts: dict[str, int] = {}
            for r in reports:
                counts[r["status"]] = counts.get(r["status"], 0) + 1
            summary = {"status": status, "workers": counts, "draining_workers": len(drained)}
            return code, {**summary, **self._process()}
        doc: dict[str, Any] = {
            "status": status,
            "unhealthy_workers": [r["name"] for r in reports if r["status"] != "ok"],
            "draining_workers": drained,
            "workers": reports,
        }
        if any(r["available"] for r in reports) and not serving:
            doc["reason"] = (
                "every available worker is drained: requests are refused 503; "
                "POST /admin/workers/NAME/undrain returns one to rotation"
            )
        if pd is not None:
            doc["pd"] = pd
        return code, {**doc, **self._process()}

    def _process(self) -> dict[str, Any]:
        """Which of the --processes answered (nothing with one process)."""
        if self.role is None:
            return {}
        return {"process": {"index": self.role.index + 1, "of": self.role.count}}

    def worker_list(self) -> list[dict[str, Any]]:
        out = []
        for h in self.pool.handles.values():
            for f in h.feeds:
                s = f.state
                out.append(
                    {
                        "name": s.name,
                        "url": h.config.url,
                        "available": s.available,
                        "mode": s.mode,
                        "block_size": s.block_size,
                        "configured_block_size": h.config.block_size or self.config.block_size,
                        "mode_setting": h.mode_setting,
                        "draining": s.draining,
                        "models": sorted(s.models or ()),
                        "role": s.role,
                        "data_parallel_rank": s.rank,
                        "topic": f.source.topic if f.source else None,
                        "events_endpoint": f.source.endpoint if f.source else None,
                        "replay_endpoint": f.source.replay_endpoint if f.source else None,
                    }
                )
        return out

    async def _reload_workers(self, body: bytes) -> None:
        try:
            doc = msgspec.json.decode(body)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise BadRequest(f"body is not JSON: {exc}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("workers"), list):
            raise BadRequest('send {"workers": [URL or {url, events?, replay?, ...}, ...]}')
        try:
            await self.sources.replace_listed(doc["workers"])
        except ConfigError as err:
            raise BadRequest(err.message, param=err.param) from None

    async def debug_route(self, scope: Scope, body: bytes) -> dict[str, Any]:
        """Score a prompt without sending it anywhere. `?tokens=1` adds the router's token ids
        (`prompt_token_ids`), so router-check can compare them with the engine's /tokenize."""
        qs = parse_qs(scope.get("query_string", b"").decode())
        if body:
            try:
                doc = msgspec.json.decode(body)
            except (msgspec.DecodeError, RecursionError) as exc:
                raise BadRequest(f"request body is not valid JSON: {exc}") from None
            kind = "chat" if isinstance(doc, dict) and "messages" in doc else "completion"
        else:
            prompt = (qs.get("prompt") or [""])[0]
            model = (qs.get("model") or [""])[0]
            body, kind = msgspec.json.encode({"prompt": prompt, "model": model}), "completion"
        rin = parse(kind, body)
        pd = self.pd if self.pd is not None and self.pd.active else None
        decision = await self.svc.decide(rin, profile="decode" if pd else "default", dry_run=True)
        out = decision_doc(decision)
        if pd is not None:
            out["pd"] = await pd.explain(decision, rin, msgspec.json.decode(body))
        if (qs.get("tokens") or ["0"])[0] in ("1", "true", "yes"):
            out["prompt_token_ids"] = list(decision.tokens)
        return out


def decision_doc(decision: Decision) -> dict[str, Any]:
    """A decision as JSON: what `/debug/route` answers and `kvroute explain` prints."""
    return {
        "profile": decision.profile,
        "policy": decision.policy,
        "model": decision.request.model,
        "prompt_tokens": decision.prompt_tokens,
        "winner": decision.best.worker,
        "weights": dict(decision.weights),
        "workers": [
            {
                "worker": s.worker,
                "total": round(s.total, 4),
                "scores": {k: round(v, 4) for k, v in s.raw.items()},
                "weighted": {k: round(v, 4) for k, v in s.weighted.items()},
                "overlap_blocks": s.overlap_blocks,
                "overlap_by_tier": s.overlap_by_tier,
                "block_size": s.block_size,
                "requests_in_flight": s.requests,
                "prefill_tokens_in_flight": s.prefill_tokens,
                "riders_in_flight": s.riders,
                "decode_blocks": s.decode_blocks,
                "cached_blocks": s.cached_blocks,
                "capacity_blocks": s.capacity_blocks,
                "demand_blocks": round(s.demand_blocks, 1),
                "refetched_blocks": None if s.refetched is None else round(s.refetched, 1),
                "mode": s.mode,
                "excluded": s.excluded,
                "relaxed": s.relaxed,
            }
            for s in [*decision.ranked, *decision.excluded]
        ],
        "scorer_us": {k: round(v, 1) for k, v in decision.scorer_us.items()},
        "explain": decision.explain(),
    }
