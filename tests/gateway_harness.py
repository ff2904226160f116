"""A real Envoy in front of simulated vLLM workers, with kvroute's ext_proc picker deciding:
everything on loopback, started and stopped per test.

The picker's decision service is a parameter (`make_service`): today the stand-in of
tests/extproc_standin.py, which ranks workers in a seeded random order and records every
accounting call; switching the tests to the real `router.routing.DecisionService` means
passing a factory that builds it for the fleet -- nothing else changes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import extproc_standin
import httpx

from engines.sim.config import SimConfig
from router.envoy.bootstrap import Endpoint, GatewayConfig, bootstrap, parse_worker
from router.envoy.process import EnvoyProcess
from router.procs import FleetProcess, free_port

extproc_standin.install()

from router.extproc.server import ExtProcServer  # noqa: E402  (after the stand-in)

# the fleet runs in its own process: the picker's event loop must not wait on the engines
FAST = ["--ttft-base-ms", "1", "--decode-ms-per-step", "1"]
MODEL = SimConfig().model
MakeService = Callable[[list[str]], Any]


def standin_service(addresses: list[str]) -> Any:
    return extproc_standin.DecisionService(addresses, models=(MODEL,))


class FixedOrder(extproc_standin.DecisionService):
    """Always ranks the workers in the order given (first choice first)."""

    async def decide(self, rin: Any, *, profile: str = "default", constraints: Any = None) -> Any:
        decision = await super().decide(rin, profile=profile, constraints=constraints)
        order = {w: i for i, w in enumerate(self.workers)}
        ranked = sorted(decision.ranked, key=lambda s: order[s.worker])
        self.decisions[-1] = (rin.model, [s.worker for s in ranked])
        return extproc_standin.Decision(rin, ranked)


def fixed_order(addresses: list[str]) -> Any:
    return FixedOrder(addresses, models=(MODEL,))


async def until(ok: Callable[[], bool], timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not ok():
        assert loop.time() < deadline, "never happened"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def real_service(addresses: list[str], **config: Any) -> AsyncIterator[Any]:
    """kvroute's own DecisionService (router.routing) over the fleet, its control plane
    (KV events, health, scraping) running in this event loop, as `kvroute serve` runs it;
    ready once every worker is known and available. `config`: Config fields to change."""
    from router.app import RouterApp
    from router.core.config import Config, WorkerConfig
    from router.procs import serve_in_process
    from router.tokenize import PACKAGED_TOKENIZER

    cfg = Config(
        workers=tuple(WorkerConfig(f"http://{a}") for a in addresses),
        tokenizer=str(PACKAGED_TOKENIZER),
        admin_insecure=True,
        **{"scrape_interval_s": 0.2, "health_check_interval_s": 0.2, **config},
    )
    app = RouterApp(cfg)
    async with serve_in_process(app) as url:
        app.routing.proxy_url = url  # type: ignore[attr-defined]  # the same brain's HTTP door
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 15
        workers = app.routing.fleet.workers
        while not (
            app.routing.ready
            and len(workers) >= len(addresses)
            and all(w.available and w.models for w in workers.values())
        ):
            assert loop.time() < deadline, "the decision service never became ready"
            await asyncio.sleep(0.05)
        yield app.routing


def slow_health_service(addresses: list[str]) -> Any:
    """real_service whose health checks and scrapes come every 30 s: a worker that dies is
    still believed alive for a while, as between two checks in production."""
    return real_service(addresses, scrape_interval_s=30.0, health_check_interval_s=30.0)


@dataclass
class Gateway:
    fleet: FleetProcess  # the first of `fleets`
    fleets: list[FleetProcess]
    prints: dict[str, str]  # system_fingerprint -> worker address
    svc: Any
    picker: ExtProcServer | None
    envoy: EnvoyProcess
    client: httpx.AsyncClient
    picker_port: int = 0

    @property
    def urls(self) -> list[str]:
        return [u for f in self.fleets for u in f.urls]

    @property
    def addresses(self) -> list[str]:
        return [address(u) for u in self.urls]

    async def kill_picker(self) -> None:
        """The picker goes away (its port closes); Envoy finds out by itself."""
        assert self.picker is not None
        self.picker_port = self.picker.port
        await self.picker.stop(0)
        self.picker = None

    async def revive_picker(self) -> None:
        self.picker = ExtProcServer(
            self.svc, "127.0.0.1", self.picker_port, max_body_bytes=self.envoy.cfg.max_body_bytes
        )
        await self.picker.start()
        if self.envoy.cfg.failure_mode == "open":
            await wait_cluster(self.envoy, "kvroute_picker", healthy=True)

    async def complete(self, prompt: str, **extra: Any) -> httpx.Response:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra}
        return await self.client.post("/v1/completions", json=body)


def address(url: str) -> str:
    e = parse_worker(url)
    return f"{e.host}:{e.port}"


def served_by(gw: Gateway, resp: httpx.Response) -> str | None:
    """The worker whose engine produced this response (JSON or SSE)."""
    fps = gw.prints
    text = resp.text
    if text.startswith("data:") or "\ndata:" in text:
        for line in text.splitlines():
            if line.startswith("data: {") and "system_fingerprint" in line:
                return fps.get(json.loads(line[6:]).get("system_fingerprint"))
        return None
    return fps.get(resp.json().get("system_fingerprint"))


@dataclass
class Options:
    """How `gateway()` sets things up (its keyword arguments)."""

    workers: int = 2  # per fleet process
    # engine flags after FAST, one fleet process per entry (workers of different models)
    engine_args: tuple[tuple[str, ...], ...] = ((),)
    body_mode: str = "buffered"
    failure_mode: str = "close"
    response_body: str = "read"
    make_service: MakeService = standin_service
    # cluster members that are not in the fleet (a port nobody listens on: the fallback test)
    extra_endpoints: tuple[Endpoint, ...] = ()
    eds_path: Path | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    message_timeout_s: float = 5.0
    tweak: Callable[[dict[str, Any]], None] | None = None  # edits the bootstrap before start
    timeout_s: float = 30.0
    picker_tls: Any = None  # the picker's TLS (TlsFiles, SelfSigned); the tweak dials it


@contextlib.asynccontextmanager
async def gateway(**options: Any) -> AsyncIterator[Gateway]:
    """Fleet (its own process) + decision service + picker + Envoy, all on loopback."""
    o = Options(**options)
    with contextlib.ExitStack() as processes:
        fleets = [
            processes.enter_context(FleetProcess(o.workers, extra=[*FAST, *args]))
            for args in o.engine_args
        ]
        urls = [u for f in fleets for u in f.urls]
        prints = await _fingerprints(urls)
        members = tuple(parse_worker(u) for u in urls) + o.extra_endpoints
        made = o.make_service([f"{e.host}:{e.port}" for e in members])
        async with contextlib.AsyncExitStack() as stack:
            svc = await stack.enter_async_context(made) if hasattr(made, "__aenter__") else made
            picker = ExtProcServer(
                svc, "127.0.0.1", 0, tls=o.picker_tls, max_body_bytes=o.max_body_bytes
            )
            await picker.start()
            gw = Gateway(fleets[0], fleets, prints, svc, picker, None, None, picker.port)  # type: ignore[arg-type]
            try:
                gw.envoy = stack.enter_context(_envoy(o, members, picker.port))
                gw.client = await stack.enter_async_context(_client(gw.envoy.url, o.timeout_s))
                if o.failure_mode == "open":  # only then is the picker health-checked
                    await wait_cluster(gw.envoy, "kvroute_picker", healthy=True)
                yield gw
            finally:
                await stack.aclose()  # client and Envoy first, then the picker
                if gw.picker is not None:  # the test may have replaced it
                    await gw.picker.stop(0.5)


def _envoy(o: Options, members: tuple[Endpoint, ...], picker_port: int) -> EnvoyProcess:
    cfg = GatewayConfig(
        listen_port=free_port(),
        ext_proc=Endpoint("127.0.0.1", picker_port),
        workers=() if o.eds_path else members,
        body_mode=o.body_mode,
        failure_mode=o.failure_mode,
        response_body=o.response_body,
        admin_port=free_port(),
        listen_host="127.0.0.1",
        eds_path=o.eds_path,
        picker_health_interval_s=0.5,
        max_body_bytes=o.max_body_bytes,
        message_timeout_s=o.message_timeout_s,
    )
    doc = bootstrap(cfg)
    if o.tweak is not None:
        o.tweak(doc)
    return EnvoyProcess(cfg, doc=doc)


def _client(url: str, timeout_s: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    return httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits)


async def _fingerprints(urls: list[str]) -> dict[str, str]:
    """Ask each worker directly once: its system_fingerprint names it in every response."""
    out = {}
    async with httpx.AsyncClient(timeout=10) as client:
        for url in urls:
            body = {"prompt": "who are you", "max_tokens": 1}  # whatever model it serves
            resp = await client.post(f"{url}/v1/completions", json=body)
            out[resp.json()["system_fingerprint"]] = address(url)
    return out


async def wait_cluster(
    envoy: EnvoyProcess, cluster: str, *, healthy: bool, timeout_s: float = 10.0
) -> None:
    """Until Envoy's health checking sees every host of `cluster` as (un)healthy."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with httpx.AsyncClient() as admin:
        while loop.time() < deadline:
            text = (await admin.get(f"{envoy.admin}/clusters")).text
            if _all_health(text, cluster) == healthy:
                return
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{cluster} never became {'healthy' if healthy else 'unhealthy'}")


async def wait_member(
    envoy: EnvoyProcess, cluster: str, addr: str, timeout_s: float = 10.0
) -> None:
    """Until `addr` is a host of `cluster` (EDS updates land asynchronously)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with httpx.AsyncClient() as admin:
        while loop.time() < deadline:
            if f"{cluster}::{addr}::" in (await admin.get(f"{envoy.admin}/clusters")).text:
                return
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{addr} never joined {cluster}")


def _all_health(clusters_text: str, cluster: str) -> bool | None:
    flags = [
        ln
        for ln in clusters_text.splitlines()
        if ln.startswith(cluster + "::") and "::health_flags::" in ln
    ]
    if not flags:
        return None
    states = {ln.endswith("::healthy") for ln in flags}
    return states.pop() if len(states) == 1 else None


# ---- HTTP/2 with request trailers (no client library here sends them) ---------------------

_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST, _SETTINGS, _PING, _GOAWAY = 0, 1, 3, 4, 6, 7
_END_STREAM, _ACK, _END_HEADERS = 0x1, 0x1, 0x4
_MAX_FRAME = 16_384  # HTTP/2's default SETTINGS_MAX_FRAME_SIZE
# HPACK's static table: the statuses an encoder sends as one indexed byte
_STATIC_STATUS = {0x88: 200, 0x89: 204, 0x8A: 206, 0x8B: 304, 0x8C: 400, 0x8D: 404, 0x8E: 500}


@dataclass
class H2Answer:
    status: int | None  # None: not one of HPACK's indexed statuses (the body tells)
    body: bytes


async def h2_post(
    url: str, path: str, body: bytes, *, trailers: tuple[tuple[str, str], ...]
) -> H2Answer:
    """POST over cleartext HTTP/2 (prior knowledge), the body ended by request trailers."""
    e = parse_worker(url)
    reader, writer = await asyncio.open_connection(e.host, e.port)
    head = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "x")]
    head.append(("content-type", "application/json"))
    try:
        writer.write(_H2_PREFACE + _frame(_SETTINGS, 0, 0, b""))
        await _settings_acked(reader, writer)  # the gateway's flow-control windows apply
        writer.write(_frame(_HEADERS, _END_HEADERS, 1, _hpack(head)))
        for i in range(0, len(body), _MAX_FRAME):
            writer.write(_frame(_DATA, 0, 1, body[i : i + _MAX_FRAME]))
        writer.write(_frame(_HEADERS, _END_HEADERS | _END_STREAM, 1, _hpack(list(trailers))))
        return await _h2_answer(reader, writer)
    finally:
        writer.close()


async def _settings_acked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        length, kind, flags, _ = struct.unpack(">3sBBI", await reader.readexactly(9))
        await reader.readexactly(int.from_bytes(length, "big"))
        if kind == _SETTINGS and not flags & _ACK:
            writer.write(_frame(_SETTINGS, _ACK, 0, b""))
            return


async def _h2_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> H2Answer:
    answer = H2Answer(None, b"")
    while True:
        length, kind, flags, stream = struct.unpack(">3sBBI", await reader.readexactly(9))
        payload = await reader.readexactly(int.from_bytes(length, "big"))
        if kind in (_SETTINGS, _PING) and not flags & _ACK:
            writer.write(_frame(kind, _ACK, 0, b"" if kind == _SETTINGS else payload))
        elif kind == _GOAWAY or (kind == _RST and stream == 1):
            return answer
        elif kind == _HEADERS and stream == 1 and answer.status is None:
            answer.status = _STATIC_STATUS.get(payload[0])
        elif kind == _DATA and stream == 1:
            answer.body += payload
        if stream == 1 and kind in (_DATA, _HEADERS) and flags & _END_STREAM:
            return answer


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream) + payload


def _hpack(headers: list[tuple[str, str]]) -> bytes:
    """Each header a literal without indexing, no Huffman coding (names and values < 127)."""
    out = b""
    for name, value in headers:
        n, v = name.encode(), value.encode()
        assert len(n) < 127 and len(v) < 127
        out += b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v
    return out
