"""The decode side's remote KV load inside the simulated engine, and P/D configuration, without
NIXL: a fake loader on simulated time (`VirtualClock`), asserted on simulated time."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from engines.sim.blockpool import Block
from engines.sim.config import ConfigError, SimConfig
from engines.sim.engine import Output, VirtualClock
from engines.sim.pd_config import KVTransferConfig, PDConfigError, from_vllm_json
from engines.sim.pd_connector import NixlConnector
from engines.sim.pd_metrics import NixlMetrics
from engines.sim.request import Sampling, SimRequest
from engines.sim.scheduler import LoadResult
from engines.sim.worker import SimWorker
from engines.vllm.events import BlockStored, WireEvent
from indexer.clock import FakeClock
from router.cli import build_parser

BS = 16


class FakeLoader:
    """Takes `seconds` of simulated time per pull and answers `result`."""

    def __init__(
        self,
        clock: VirtualClock,
        seconds: float,
        result: LoadResult = "ok",
        recompute: bool = False,
    ) -> None:
        self.clock = clock
        self.seconds = seconds
        self.result: LoadResult = result
        self.recompute_failed_loads = recompute
        self.gate: asyncio.Event | None = None
        self.loaded: list[SimRequest] = []

    def on_submit(self, req: SimRequest) -> None:
        pass

    async def load(self, req: SimRequest) -> LoadResult:
        self.loaded.append(req)
        if self.gate is not None:
            await self.gate.wait()
        await self.clock.sleep(self.seconds)
        return self.result


@pytest.fixture
def clock() -> VirtualClock:
    return VirtualClock()


PUBLISHED: list[WireEvent] = []


async def capture(ts: float, events: list[WireEvent]) -> None:
    PUBLISHED.extend(events)


async def worker_with(loader: FakeLoader, clock: VirtualClock) -> SimWorker:
    worker = SimWorker(SimConfig(replay_endpoint=None), clock=clock, sleep=clock.sleep)
    worker.engine.loader = loader
    worker.engine._publish = capture  # the events a subscriber would get, without ZMQ
    PUBLISHED.clear()
    await worker.engine.start()
    return worker


def ids(worker: SimWorker, n: int, salt: int = 0) -> list[int]:
    words = worker.tokenizer.word_ids
    return [0] + [words[(i * 7 + salt) % len(words)] for i in range(n - 1)]


async def outputs(worker: SimWorker, prompt: list[int], remote: object) -> list[Output]:
    handle = worker.engine.submit(prompt, Sampling(max_tokens=3, ignore_eos=True), remote=remote)
    return [o async for o in handle.outputs()]


async def test_a_pulled_prompt_pays_the_transfer_then_one_token(clock: VirtualClock) -> None:
    loader = FakeLoader(clock, seconds=0.050)
    worker = await worker_with(loader, clock)
    prompt = ids(worker, 1000)
    start = clock.now()
    outs = await outputs(worker, prompt, remote=object())
    ttft = outs[0].time - start
    lat = worker.config.latency
    assert ttft == pytest.approx(0.050 + lat.ttft_ms(1000, cached_tokens=999) / 1000, abs=1e-6)
    assert ttft < lat.ttft_ms(1000) / 1000 + 0.050  # cheaper than computing it
    req = loader.loaded[0]
    assert req.num_external_tokens == 1000 and req.num_cached_tokens == 1000
    stored = [e for e in PUBLISHED if isinstance(e, BlockStored)]
    assert stored[0].token_ids == prompt[: (1000 // BS) * BS]  # the pulled blocks, published
    assert worker.engine.cached_tokens(prompt) == (1000 // BS) * BS
    await worker.engine.stop()


async def test_only_the_uncached_part_is_pulled(clock: VirtualClock) -> None:
    loader = FakeLoader(clock, seconds=0.0)
    worker = await worker_with(loader, clock)
    prompt = ids(worker, 400)
    await outputs(worker, prompt[:200], remote=None)  # computed here, cached
    await outputs(worker, prompt, remote=object())
    req = loader.loaded[0]
    hit = (199 // BS) * BS
    assert req.num_cached_tokens - req.num_external_tokens == hit
    assert req.num_external_tokens == 400 - hit
    await worker.engine.stop()


@pytest.mark.parametrize(
    ("result", "recompute", "finish"),
    [("failed", True, "length"), ("failed", False, "error"), ("fatal", True, "error")],
    ids=["recompute", "fail", "malformed-always-fails"],
)
async def test_a_failed_pull_follows_the_policy(
    clock: VirtualClock, result: LoadResult, recompute: bool, finish: str
) -> None:
    worker = await worker_with(FakeLoader(clock, 0.01, result, recompute), clock)
    outs = await outputs(worker, ids(worker, 300), remote=object())
    assert outs[-1].finish_reason == finish
    if finish == "length":
        assert len(outs) == 3
    pool = worker.scheduler.kv.pool
    assert pool.num_free == pool.usable  # nothing leaks either way
    await worker.engine.stop()


async def test_an_abort_mid_pull_frees_the_blocks_when_the_pull_ends(clock: VirtualClock) -> None:
    loader = FakeLoader(clock, 0.0)
    loader.gate = asyncio.Event()
    worker = await worker_with(loader, clock)
    handle = worker.engine.submit(ids(worker, 300), Sampling(max_tokens=3), remote=object())
    while not loader.loaded:
        await asyncio.sleep(0)
    pool = worker.scheduler.kv.pool
    handle.abort()
    assert pool.num_free < pool.usable  # the READ may still write into them
    loader.gate.set()
    for _ in range(20):
        await asyncio.sleep(0)
    assert pool.num_free == pool.usable
    await worker.engine.stop()


async def test_retained_blocks_stay_until_released(clock: VirtualClock) -> None:
    worker = await worker_with(FakeLoader(clock, 0.0), clock)
    kept: list[SimRequest] = []
    worker.scheduler.retain = lambda req: kept.append(req) is None
    await outputs(worker, ids(worker, 100), remote=None)
    pool = worker.scheduler.kv.pool
    assert len(kept) == 1 and pool.num_free == pool.usable - len(kept[0].blocks)
    worker.scheduler.kv.free(kept[0])
    assert pool.num_free == pool.usable
    await worker.engine.stop()


# ---- configuration ----------------------------------------------------------------------------


def test_vllm_flag_and_environment_build_the_config() -> None:
    text = (
        '{"kv_connector":"NixlConnector","kv_role":"kv_consumer","engine_id":"e1",'
        '"kv_buffer_device":"cpu","kv_load_failure_policy":"recompute",'
        '"kv_connector_extra_config":{"kv_lease_duration":5}}'
    )
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "localhost", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601"}
    c = from_vllm_json(text, env).validate()
    assert (c.role, c.engine_id, c.load_failure_policy, c.lease_s) == (
        "kv_consumer",
        "e1",
        "recompute",
        5,
    )
    assert (c.side_channel_host, c.side_channel_port) == ("localhost", 5601)


def test_sim_flags_take_vllms_form_or_the_shorthand() -> None:
    from engines.sim.cli import config_from_args

    argv = [
        "sim",
        "--kv-transfer-config",
        '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}',
    ]
    argv += ["--kv-bytes-per-token", "8192", "--link-mb-s", "104"]
    c = config_from_args(build_parser("sim").parse_args(argv)).kv_transfer
    assert c is not None and (c.role, c.kv_bytes_per_token, c.link_mb_s) == (
        "kv_producer",
        8192,
        104,
    )
    short = config_from_args(build_parser("sim").parse_args(["sim", "--kv-role", "both"]))
    assert short.kv_transfer == KVTransferConfig(role="kv_both")
    assert config_from_args(build_parser("sim").parse_args(["sim"])).kv_transfer is None


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (
            ["--kv-transfer-config", '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'],
            "kv_connector",
        ),
        (["--kv-role", "both", "--link-mb-s", "0"], "--link-mb-s"),
        (["--kv-role", "both", "--kv-bytes-per-token", "0"], "--kv-bytes-per-token"),
        (["--kv-transfer-config", "{not json"], "--kv-transfer-config"),
    ],
    ids=["other-connector", "zero-link", "zero-bytes", "bad-json"],
)
def test_bad_pd_flags_fail_naming_the_flag(argv: list[str], names: str) -> None:
    from engines.sim.cli import config_from_args

    with pytest.raises(ConfigError, match=names):
        config_from_args(build_parser("sim").parse_args(["sim", *argv]))


def test_a_bad_policy_is_refused() -> None:
    with pytest.raises(PDConfigError, match="fail or recompute"):
        KVTransferConfig(load_failure_policy="retry").validate()


# ---- the prefill side's leases, without NIXL --------------------------------------------------


class FakeKV:
    """Stands in for the NIXL agent: notifications a test queues, tags it ignores."""

    def __init__(self) -> None:
        self.inbox: list[bytes] = []

    def write_tags(self, block_ids: object, tags: object) -> None:
        pass

    def notifications(self) -> list[bytes]:
        out, self.inbox = self.inbox, []
        return out


@dataclass
class Rig:
    """A prefill-side connector on a fake clock, its fake agent and what it released."""

    connector: NixlConnector
    kv: FakeKV
    clock: FakeClock
    released: list[SimRequest]
    registry: CollectorRegistry

    def counted(self, name: str) -> float | None:
        return self.registry.get_sample_value(name, {"model_name": "m", "engine": "0"})


def leasing(lease_s: float = 30.0) -> Rig:
    registry, released, clock, kv = CollectorRegistry(), [], FakeClock(), FakeKV()
    connector = NixlConnector(
        KVTransferConfig(role="kv_producer", lease_s=lease_s),
        block_size=BS,
        num_blocks=64,
        model="m",
        metrics=NixlMetrics(registry, ("m", "0")),
        release=released.append,
        clock=clock,
    )
    connector.kv = kv  # type: ignore[assignment]
    return Rig(connector, kv, clock, released, registry)


def finished_prefill(rid: str) -> SimRequest:
    req = SimRequest(
        rid, list(range(40)), Sampling(1), kv_transfer_params={"do_remote_decode": True}
    )
    req.blocks = [Block(i) for i in (5, 6, 7)]
    req.num_computed = 40
    req.finish_reason = "length"
    return req


def test_a_prefill_leg_returns_vllms_params_and_holds_its_blocks() -> None:
    rig = leasing()
    req = finished_prefill("cmpl-x-0-abcdef12")
    assert rig.connector.on_finished(req) is True
    out = req.kv_transfer_out
    assert out is not None and out["remote_block_ids"] == [[5, 6, 7]]
    assert out["remote_request_id"] == "cmpl-x-0-abcdef12" and out["remote_num_tokens"] == 40
    rig.kv.inbox.append(b"cmpl-x-0-abcdef12:1")
    for message in rig.kv.notifications():
        rig.connector._on_notification(message.decode())
    assert rig.released == [req] and not rig.connector.leases


def test_leases_expire_heartbeats_extend_them_and_late_reads_are_counted() -> None:
    rig = leasing(lease_s=30)
    a, b = finished_prefill("a"), finished_prefill("b")
    rig.connector.on_finished(a)
    rig.connector.on_finished(b)
    rig.clock.advance(20)
    rig.connector._on_notification("HB:b,unknown")
    rig.clock.advance(11)
    rig.connector._expire(rig.clock.now())
    assert rig.released == [a] and list(rig.connector.leases) == ["b"]  # b's was renewed
    assert rig.counted("vllm:nixl_num_kv_expired_reqs_total") == 1
    rig.connector._on_notification("a:1")  # D read a after its blocks went back
    assert rig.counted("vllm:nixl_num_notifications_after_expiry_total") == 1


def test_aborted_or_plain_requests_are_not_held() -> None:
    connector = leasing().connector
    aborted = finished_prefill("c")
    aborted.finish_reason = "abort"
    plain = finished_prefill("d")
    plain.kv_transfer_params = None
    assert connector.on_finished(aborted) is False and connector.on_finished(plain) is False
    assert aborted.kv_transfer_out is None and not connector.leases
