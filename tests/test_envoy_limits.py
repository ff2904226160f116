"""What a real Envoy 1.40 makes of the generated bootstrap's limits and name lookups: no circuit
breaker caps the gateway below any real load (Envoy's defaults: 1,024 requests and 3
retries in flight per cluster), and a dual-stack worker name becomes the IPv4 addresses
kvroute picks from."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from gateway_harness import gateway, served_by
from test_extproc_envoy import _dead_first

from router.envoy.bootstrap import PICKER, WORKERS, Endpoint, GatewayConfig, bootstrap
from router.envoy.process import EnvoyProcess
from router.procs import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
SERVED = "x-gateway-destination-endpoint-served"
# far above what one gateway carries, and far above Envoy's defaults
FLOOR = 100_000
BREAKERS = ("max_connections", "max_pending_requests", "max_requests")


def admin_clusters(envoy: EnvoyProcess) -> list[str]:
    return httpx.get(f"{envoy.admin}/clusters", timeout=5).text.splitlines()


def thresholds(lines: list[str], cluster: str) -> dict[str, int]:
    """The `CLUSTER::default_priority::NAME::VALUE` lines, as {NAME: VALUE}."""
    prefix = f"{cluster}::default_priority::"
    pairs = (ln.removeprefix(prefix).split("::") for ln in lines if ln.startswith(prefix))
    return {name: int(value) for name, value in pairs}


def test_no_circuit_breaker_caps_the_gateway() -> None:
    """Every request in flight holds a picker stream for its whole life, and each may be on
    its fallback at once: Envoy's default caps (1,024, retries 3) would fail or round-robin
    the requests past them."""
    cfg = GatewayConfig(
        listen_port=free_port(),
        listen_host="127.0.0.1",
        ext_proc=Endpoint("127.0.0.1", free_port()),
        workers=(Endpoint("127.0.0.1", free_port()),),
        admin_port=free_port(),
    )
    with EnvoyProcess(cfg) as envoy:
        lines = admin_clusters(envoy)
    picker, workers = thresholds(lines, PICKER), thresholds(lines, WORKERS)
    for name in BREAKERS:
        assert picker[name] >= FLOOR, (name, picker)
    for name in (*BREAKERS, "max_retries"):
        assert workers[name] >= FLOOR, (name, workers)


async def test_a_burst_whose_first_choice_is_dead_all_take_their_fallback() -> None:
    """A worker died between two health checks and is every request's first choice: all
    requests of a burst retry at once, each on the next endpoint the picker listed."""
    dead = Endpoint("127.0.0.1", free_port())
    async with gateway(extra_endpoints=(dead,), make_service=_dead_first(dead)) as gw:
        answers = await asyncio.gather(*(gw.complete(f"burst {i}") for i in range(64)))
        failed = [r for r in answers if r.status_code != 200]
        assert not failed, (len(failed), failed[0].text[:300])
        second = gw.svc.decisions[-1][1][1]
        assert {served_by(gw, r) for r in answers} == {second}
        assert {r.headers[SERVED] for r in answers} == {second}
        retries = gw.envoy.stats("cluster.kvroute_workers.upstream_rq_retry")
        assert retries["cluster.kvroute_workers.upstream_rq_retry_overflow"] == 0
        assert retries["cluster.kvroute_workers.upstream_rq_retry_success"] == 64


def test_a_dual_stack_name_becomes_its_ipv4_addresses() -> None:
    """Workers and picker given by names with an A and an AAAA record: Envoy's cluster
    members are the IPv4 addresses, the ones kvroute resolves a worker to (router/workers.py
    one_family) and names in its pick; override_host reaches only members."""
    worker, picker = Endpoint("workers.test", free_port()), Endpoint("picker.test", free_port())
    cfg = GatewayConfig(
        listen_port=free_port(),
        listen_host="127.0.0.1",
        ext_proc=picker,
        workers=(worker,),
        admin_port=free_port(),
    )
    with dual_stack_dns() as dns_port:
        doc = bootstrap(cfg)
        for cluster in doc["static_resources"]["clusters"]:
            assert cluster["type"] == "STRICT_DNS"
            cluster["typed_dns_resolver_config"] = resolver_at(dns_port)
        with EnvoyProcess(cfg, doc=doc) as envoy:
            members = {
                WORKERS: {f"127.0.0.1:{worker.port}"},
                PICKER: {f"127.0.0.1:{picker.port}"},
            }
            assert wait_members(envoy, set(members)) == members


def wait_members(envoy: EnvoyProcess, clusters: set[str]) -> dict[str, set[str]]:
    """Each cluster's hosts, once every one of `clusters` has some (DNS answers come
    asynchronously)."""
    deadline = time.monotonic() + 10
    while True:
        found: dict[str, set[str]] = {}
        for ln in admin_clusters(envoy):
            if "::cx_active::" in ln:  # CLUSTER::HOST::cx_active::N, one line per host
                # from the right: an IPv6 host, [::1]:P, has "::" of its own
                cluster, _, host = ln.rsplit("::", 2)[0].partition("::")
                if cluster in clusters:
                    found.setdefault(cluster, set()).add(host)
        if set(found) == clusters or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def resolver_at(port: int) -> dict[str, Any]:
    cares = "envoy.extensions.network.dns_resolver.cares.v3.CaresDnsResolverConfig"
    return {
        "name": "envoy.network.dns_resolver.cares",
        "typed_config": {
            "@type": f"type.googleapis.com/{cares}",
            "resolvers": [Endpoint("127.0.0.1", port).address()],
            "dns_resolver_options": {"no_default_search_domain": True},
        },
    }


# ---- a DNS server on loopback: every name has A 127.0.0.1 and AAAA ::1 -------------------

_A, _AAAA = 1, 28
_RECORDS = {_A: socket.inet_aton("127.0.0.1"), _AAAA: socket.inet_pton(socket.AF_INET6, "::1")}


@contextlib.contextmanager
def dual_stack_dns() -> Iterator[int]:
    """A UDP DNS server on 127.0.0.1 (yields its port) until the block ends."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.05)
    stop = threading.Event()
    thread = threading.Thread(target=_serve_dns, args=(sock, stop), daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        sock.close()


def _serve_dns(sock: socket.socket, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            query, peer = sock.recvfrom(512)
        except TimeoutError:
            continue
        sock.sendto(_dns_answer(query), peer)


def _dns_answer(query: bytes) -> bytes:
    """One question in, its answer out: the A or AAAA record, nothing for other types."""
    end = 12
    while query[end]:  # the question's name, label by label
        end += query[end] + 1
    (qtype,) = struct.unpack(">H", query[end + 1 : end + 3])
    question = query[12 : end + 5]
    record = _RECORDS.get(qtype)
    answers = b""
    if record is not None:  # a pointer to the question's name, then type, class IN, TTL 5 s
        answers = b"\xc0\x0c" + struct.pack(">HHIH", qtype, 1, 5, len(record)) + record
    header = struct.pack(">HHHHHH", query[0] << 8 | query[1], 0x8180, 1, int(bool(answers)), 0, 0)
    return header + question + answers
