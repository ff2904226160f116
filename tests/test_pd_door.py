"""The P/D door against scripted workers: vLLM NixlConnector's protocol exactly, and what
each failure of a leg means for the client (fallback, one error, aborted legs, orphans
counted). Real NIXL handoffs between simulated workers: test_pd_router.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from pd_fakes import (
    FakeWorker,
    PDSetup,
    closing_worker,
    decode_stream,
    decode_waits_for_client,
    good_params,
    pd_router,
    prefill_hangs,
    prefill_ok,
    prefill_status,
)
from prometheus_client import CollectorRegistry, generate_latest

from router.pd import legs
from router.pd.door import UNKNOWN_WORKER, PDDoor
from router.pd.metrics import PDMetrics
from router.pd.wire import PREFILL_PARAMS
from router.procs import serve_in_process

pytestmark = pytest.mark.timeout(120)

PROMPT = " ".join(f"word{i}" for i in range(300))
CLIENT = {
    "model": "m",
    "prompt": PROMPT,
    "max_tokens": 7,
    "min_tokens": 2,
    "temperature": 0.0,
    "stream": True,
    "stream_options": {"include_usage": True},
    "seed": 3,
}


async def sse(
    client: Any, body: dict[str, Any], path: str = "/v1/completions"
) -> tuple[int, str, dict[str, str]]:
    async with client.stream("POST", path, json=body, headers={"x-request-id": "rid-1"}) as r:
        text = "".join([chunk async for chunk in r.aiter_text()])
        return r.status_code, text, dict(r.headers)


async def test_the_legs_follow_the_nixl_connector_protocol() -> None:
    async with pd_router(prefill_ok(), decode_stream()) as s:
        status, text, headers = await sse(s.client, CLIENT)
        assert status == 200 and "t2" in text and text.endswith("data: [DONE]\n\n")
        assert headers["x-kvroute-pd"].startswith("split prefill=")
        assert headers["x-kvroute-worker"] == s.names["decode"]
        (p,), (d,) = s.prefill.seen, s.decode.seen
        assert p.body["stream"] is False and p.body["max_tokens"] == 1
        assert "stream_options" not in p.body and "min_tokens" not in p.body
        assert p.body["kv_transfer_params"] == PREFILL_PARAMS
        assert {k: v for k, v in p.body.items() if k in ("seed", "temperature", "prompt")} == {
            "seed": 3,
            "temperature": 0.0,
            "prompt": PROMPT,
        }
        sent_params = d.body.pop("kv_transfer_params")
        assert d.body == CLIENT  # the client's request, untouched
        assert sent_params == good_params(len(json.dumps(p.body)) // 16 + 4)
        assert p.headers["x-request-id"] == d.headers["x-request-id"] == "rid-1"
        assert await s.metric('kvroute_pd_decisions_total{decision="split"') == 1


async def test_a_chat_prefill_leg_caps_max_completion_tokens() -> None:
    async with pd_router(prefill_ok(), decode_stream()) as s:
        chat = {"messages": [{"role": "user", "content": PROMPT}], "max_completion_tokens": 9}
        status, _, _ = await sse(s.client, {**chat, "stream": True}, "/v1/chat/completions")
        assert status == 200
        p = s.prefill.seen[0].body
        assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1
        assert s.decode.seen[0].body["max_completion_tokens"] == 9


@pytest.mark.parametrize(
    ("prefill", "cause"),
    [
        (prefill_status(500), "prefill_failed"),
        (
            prefill_ok(lambda seen: {**good_params(50), "remote_block_ids": list(range(50))}),
            "prefill_bad_params",
        ),
        (prefill_ok(lambda seen: good_params(2)), "prefill_bad_params"),
        (prefill_ok(lambda seen: None), "prefill_bad_params"),
    ],
    ids=["http-500", "flat-block-list", "too-few-blocks", "no-params"],
)
async def test_a_failed_prefill_leg_falls_back_to_a_local_prefill(prefill: Any, cause: str) -> None:
    async with pd_router(prefill, decode_stream()) as s:
        status, text, _ = await sse(s.client, CLIENT)
        assert status == 200 and "t2" in text
        (d,) = s.decode.seen
        assert "kv_transfer_params" not in d.body  # malformed params never reach vLLM
        assert d.body == CLIENT
        assert await s.metric(f'kvroute_pd_local_fallbacks_total{{cause="{cause}"}}') == 1


async def test_a_split_counts_on_its_decode_worker_no_prefill_and_no_cache_until_it_pulls() -> None:
    """While its prefill leg runs, a split is the decode worker's request, but neither its
    prefill (the prefill worker computes it) nor its prefix (the KV is not there yet): a
    request on the same prefix decided meanwhile must not see it cached there, nor the
    decode worker's queue grown by it."""
    async with pd_router(prefill_hangs(), decode_stream(), first_byte_timeout_s=30) as s:
        fleet, decode = s.app.fleet, s.names["decode"]
        leg = asyncio.create_task(sse(s.client, CLIENT))
        while not s.prefill.seen:
            await asyncio.sleep(0.01)
        load = fleet.load.view(decode)
        assert load.requests == 1 and load.prefill_tokens == 0, load
        probe = {"model": "m", "prompt": PROMPT, "max_tokens": 7}
        route = (await s.client.post("/debug/route", json=probe)).json()
        overlap = {w["worker"]: w["overlap_blocks"] for w in route["workers"]}
        assert overlap[decode] == 0, route
        leg.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await leg


async def test_prefill_legs_queued_behind_others_teach_no_prefill_time() -> None:
    """Four splits at once on a prefill worker that runs one prefill at a time: the later
    legs' times are mostly queue, which the model adds apart (queue_P); learnt as prefill
    time, P would look ever slower under exactly the load where splitting pays."""
    answer, one_at_a_time = prefill_ok(), asyncio.Lock()

    async def serial(w: FakeWorker, seen: Any, send: Any) -> None:
        async with one_at_a_time:
            await asyncio.sleep(0.3)
        await answer(w, seen, send)

    async with pd_router(serial, decode_stream()) as s:
        bodies = [{**CLIENT, "prompt": f"{i} {PROMPT}"} for i in range(4)]
        answers = await asyncio.gather(*(sse(s.client, b) for b in bodies))
        assert all(h["x-kvroute-pd"].startswith("split") for _, _, h in answers)
        learnt = s.app.pd.model.fits[s.names["prefill"]].samples
        assert learnt and all(ms < 550 for _, _, ms in learnt), learnt


async def test_a_failed_calibration_is_run_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe handoff at start failed (the prefill engine was still loading its model):
    it runs again, so `auto` splits once the worker is ready, not only after a restart."""
    from router.asgi import send_json
    from router.pd import calibrate, door

    monkeypatch.setattr(calibrate, "WAIT_S", 1.0)
    monkeypatch.setattr(door, "RETRY_S", (0.5, 1.0))
    ready, answer = asyncio.Event(), prefill_ok()

    async def loading(w: FakeWorker, seen: Any, send: Any) -> None:
        if not ready.is_set():
            await send_json(send, 503, {"error": {"message": "the model is loading"}})
            return
        await answer(w, seen, send)

    async with pd_router(loading, decode_stream(), pd_threshold="auto", pd_probe=True) as s:
        for _ in range(100):
            health = (await s.client.get("/health")).json()
            if health["pd"]["calibration"] == "failed":
                break
            await asyncio.sleep(0.05)
        assert health["pd"]["calibration"] == "failed" and health["pd"]["problems"], health
        ready.set()
        for _ in range(200):
            health = (await s.client.get("/health")).json()
            if health["pd"]["calibration"] == "done":
                break
            await asyncio.sleep(0.05)
        assert health["pd"]["calibration"] == "done" and not health["pd"]["problems"], health
        # a retry probes no local prefills on D, which may be serving by then
        local = s.app.pd.model.fits[s.names["decode"]].samples
        assert len(local) == len(calibrate.PROBE_TOKENS) - 1, local


async def test_a_retried_local_request_teaches_no_prefill_time() -> None:
    """A local request whose first worker hung and was retried elsewhere: its wait was the
    first byte timeout plus another worker's prefill, learnt for neither (taught to the
    first, that worker would look slow for good and always be split for)."""
    served = 0
    stream = decode_stream()

    async def first_hangs(w: FakeWorker, seen: Any, send: Any) -> None:
        nonlocal served
        served += 1
        if served == 1:
            await seen.gone.wait()  # a hung engine: no head, no chunk
            return
        await stream(w, seen, send)

    d2 = FakeWorker(first_hangs)
    async with (
        serve_in_process(d2) as d2_url,
        pd_router(
            prefill_ok(),
            first_hangs,
            more_decode=(d2_url,),
            pd_threshold="100000",  # every request local
            first_byte_timeout_s=1.0,
        ) as s,
    ):
        status, text, headers = await sse(s.client, {**CLIENT, "max_tokens": 3})
        assert status == 200 and "t2" in text and served == 2
        assert headers["x-kvroute-pd"].startswith("local")
        assert not any(fit.samples for fit in s.app.pd.model.fits.values()), s.app.pd.model.fits
        # a local request answered by its first worker still teaches it
        status, _, headers = await sse(s.client, {**CLIENT, "prompt": f"again {PROMPT}"})
        learnt = s.app.pd.model.fits.get(headers["x-kvroute-worker"])
        assert status == 200 and learnt is not None and len(learnt.samples) == 1


async def test_a_probe_on_a_serving_fleet_teaches_the_link_but_no_prefill_time() -> None:
    """A calibration probe while the decode worker serves a request: its prefill leg's time
    is partly that request's, so it teaches no prefill rate; the link it measured stands."""
    from engines.sim.pd_metrics import PDSnapshot
    from router.openai_req import parse_request
    from router.pd.probe import ProbeResult

    async with pd_router(prefill_ok(), decode_stream()) as s:
        svc, cal, model = s.app.routing, s.app.pd.calibration, s.app.pd.model
        p, d = (s.app.pool.handles[s.names[k]] for k in ("prefill", "decode"))
        moved = PDSnapshot(bytes_transferred=4e6, xfer_seconds=0.01, external_kv_transfer=1000)
        probe = ProbeResult(p.name, d.name, 1000, 80.0, None, moved)
        body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 2}).encode()
        decision = await svc.decide(parse_request("completion", "/v1/completions", body))
        serving = svc.start(decision, d.name)
        cal._learn(p, d, probe, sample=True)
        assert model.link.value is not None and p.name not in model.fits
        svc.finish(serving, status=200)
        cal._learn(p, d, probe, sample=True)  # idle now: learnt
        assert len(model.fits[p.name].samples) == 1


async def test_a_hung_prefill_leg_times_out_into_a_local_prefill() -> None:
    async with pd_router(prefill_hangs(), decode_stream(), first_byte_timeout_s=0.5) as s:
        status, _, _ = await sse(s.client, CLIENT)
        assert status == 200
        assert "kv_transfer_params" not in s.decode.seen[0].body
        assert await s.metric('kvroute_pd_local_fallbacks_total{cause="prefill_timeout"}') == 1


@pytest.mark.parametrize("generating", [True, False], ids=["busy", "hung"])
async def test_a_prefill_leg_timing_out_counts_only_on_an_idle_engine(generating: bool) -> None:
    # a prefill worker whose engine finishes other prefills meanwhile is busy, not hung
    async with pd_router(
        prefill_hangs(), decode_stream(), first_byte_timeout_s=0.5, scrape_interval_s=0.1
    ) as s:
        s.prefill.generating = generating
        status, _, _ = await sse(s.client, CLIENT)
        assert status == 200  # prefilled on the decode worker instead
        h = s.app.pool.handles[s.names["prefill"]]
        assert h.timeouts == (0 if generating else 1)


async def test_a_decode_leg_waiting_on_its_pull_is_not_a_hung_worker() -> None:
    # the first-byte timeout is shorter than the pull: the leg gets room for the transfer,
    # and the decode worker is neither timed out nor ejected
    async with pd_router(prefill_ok(), decode_stream(delay_s=1.5), first_byte_timeout_s=0.5) as s:
        for i in range(3):  # distinct prompts: a repeat is cached on the decode worker
            status, text, _ = await sse(s.client, {**CLIENT, "prompt": f"{i} {PROMPT}"})
            assert status == 200 and "t2" in text
        h = s.app.pool.handles[s.names["decode"]]
        assert h.available and h.timeouts == 0


async def test_a_decode_worker_that_never_answers_counts_its_timeouts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # no head at all (an API server hung): a timeout toward ejecting it, as on the proxy's
    # way, where its engine generated nothing meanwhile
    monkeypatch.setattr(legs, "HANDSHAKE_S", 0.2)  # the room for a pull's handshake
    async with pd_router(prefill_ok(), prefill_hangs(), first_byte_timeout_s=0.3) as s:
        status, _, _ = await sse(s.client, CLIENT)
        assert status == 504
        assert s.app.pool.handles[s.names["decode"]].timeouts == 1


async def test_a_decode_leg_dying_mid_stream_is_one_error_never_a_second_stream() -> None:
    async with pd_router(prefill_ok(), decode_stream(die_after=1)) as s:
        status, text, _ = await sse(s.client, CLIENT)
        assert status == 200
        assert text.count('"error"') == 1 and text.endswith("data: [DONE]\n\n")
        assert len(s.prefill.seen) == 1 and len(s.decode.seen) == 1


async def test_a_client_gone_during_the_decode_leg_aborts_it() -> None:
    async with pd_router(prefill_ok(), decode_waits_for_client()) as s:
        async with s.client.stream("POST", "/v1/completions", json=CLIENT) as r:
            async for _ in r.aiter_text():
                break  # the first token arrived; hang up
        await asyncio.wait_for(s.decode.seen[0].gone.wait(), 5)


async def test_a_client_gone_during_the_prefill_leg_aborts_it_and_sends_no_decode() -> None:
    async with pd_router(prefill_hangs(), decode_stream()) as s:
        task = asyncio.create_task(sse(s.client, CLIENT))
        for _ in range(100):
            if s.prefill.seen:
                break
            await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.wait_for(s.prefill.seen[0].gone.wait(), 5)
        await asyncio.sleep(0.2)
        assert s.decode.seen == []


@pytest.mark.parametrize(
    ("extra", "reason"),
    [({"n": 2}, "not_splittable"), ({"echo": True}, "not_splittable")],
    ids=["n-2", "echo"],
)
async def test_requests_the_engine_cannot_hand_off_stay_local(
    extra: dict[str, Any], reason: str
) -> None:
    async with pd_router(prefill_ok(), decode_stream()) as s:
        status, _, headers = await sse(s.client, {**CLIENT, **extra})
        assert status == 200 and headers["x-kvroute-pd"] == f"local reason={reason}"
        assert s.prefill.seen == []


async def test_a_clients_own_kv_transfer_params_are_refused() -> None:
    async with pd_router(prefill_ok(), decode_stream()) as s:
        r = await s.client.post(
            "/v1/completions", json={**CLIENT, "kv_transfer_params": good_params(3)}
        )
        assert r.status_code == 400 and "kv_transfer_params" in r.text
        assert s.prefill.seen == [] and s.decode.seen == []


async def baselined(s: PDSetup) -> None:
    """Waits for the verifier's first snapshot of the decode worker: a split that ends
    before it exists is never proved, nor counted as a silent recompute."""
    for _ in range(200):
        ledger = s.app.pd.verifier.ledgers.get(s.names["decode"])
        if ledger is not None and ledger.last is not None:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the verifier never read the decode worker's metrics")


async def test_a_split_the_decode_worker_did_not_pull_degrades_health() -> None:
    async with pd_router(prefill_ok(), decode_stream(pull=False)) as s:
        await baselined(s)
        assert (await sse(s.client, CLIENT))[0] == 200
        for _ in range(200):
            health = await s.client.get("/health")
            if health.json()["pd"]["silent_recomputes"]:
                break
            await asyncio.sleep(0.05)
        doc = health.json()
        assert health.status_code == 200 and doc["status"] == "degraded"
        assert doc["pd"]["status"] == "degraded" and doc["pd"]["workers"] == [s.names["decode"]]
        assert "silent recompute" in doc["pd"]["problems"][0] and "kv_consumer" in doc["pd"]["fix"]


async def test_a_proved_split_keeps_health_ok() -> None:
    async with pd_router(prefill_ok(), decode_stream()) as s:
        await baselined(s)
        assert (await sse(s.client, CLIENT))[0] == 200
        for _ in range(200):
            doc = (await s.client.get("/health")).json()
            if doc["pd"]["verified_handoffs"]:
                break
            await asyncio.sleep(0.05)
        assert doc["status"] == "ok" and doc["pd"]["verified_handoffs"] == 1
        assert doc["pd"]["kv_bytes_moved"] == s.decode.nixl_bytes > 0


async def test_debug_route_explains_the_pd_decision() -> None:
    async with pd_router(prefill_ok(), decode_stream(), pd_threshold="auto") as s:
        doc = (await s.client.post("/debug/route", json={"prompt": PROMPT})).json()
        assert doc["profile"] == "decode" and doc["winner"] == s.names["decode"]
        assert doc["pd"]["decision"] == "local" and doc["pd"]["reason"] == "link_unknown"
        assert "uncached tokens" in doc["pd"]["explain"]


async def test_debug_route_sends_nothing_so_it_waits_for_no_placement() -> None:
    """Its prefill side is a dry run too: no placement wait (--peers), nothing shed."""
    async with pd_router(prefill_ok(), decode_stream()) as s:
        s.app.routing.placement_wait = lambda: 2.0
        t0 = asyncio.get_running_loop().time()
        doc = (await s.client.post("/debug/route", json={"prompt": PROMPT})).json()
        assert doc["pd"]["decision"] == "split"
        assert asyncio.get_running_loop().time() - t0 < 1.5


def _stalls_after_head() -> Any:
    """A JSON answer whose head comes and whose body stops partway (a hung engine)."""

    async def handle(w: Any, seen: Any, send: Any) -> None:
        head = [(b"content-type", b"application/json"), (b"content-length", b"1000")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": b'{"choices":[', "more_body": True})
        await seen.gone.wait()

    return handle


async def test_a_decode_leg_whose_body_stalls_frees_its_load() -> None:
    async with pd_router(prefill_ok(), _stalls_after_head(), inter_chunk_timeout_s=0.5) as s:
        r = await s.client.post("/v1/completions", json={**CLIENT, "stream": False})
        assert r.status_code == 504
        load = s.app.fleet.load.known(s.names["decode"])
        assert (load.requests, load.prefill_tokens, load.decode_blocks) == (0, 0, 0)
        assert await s.metric('kvroute_inflight_requests{worker="' + s.names["decode"]) == 0


async def test_a_prefill_leg_whose_body_stalls_is_aborted_and_prefilled_locally() -> None:
    async with pd_router(_stalls_after_head(), decode_stream(), inter_chunk_timeout_s=0.5) as s:
        status, text, _ = await sse(s.client, CLIENT)
        assert status == 200 and "t2" in text
        # the engine is told at once, so it frees the prefill's KV instead of holding it
        await asyncio.wait_for(s.prefill.seen[0].gone.wait(), 3)
        assert await s.metric('kvroute_pd_local_fallbacks_total{cause="prefill_timeout"}') == 1


async def test_a_decode_leg_refused_counts_its_prefill_orphaned() -> None:
    async with pd_router(prefill_ok(), prefill_status(503)) as s:
        status, _, _ = await sse(s.client, CLIENT)
        assert status == 503
        assert "kv_transfer_params" in s.decode.seen[0].body  # it was asked to pull
        assert await s.metric("kvroute_pd_orphaned_prefills_total") == 1


async def test_prefill_legs_failing_in_a_row_degrade_health_and_say_so_per_response() -> None:
    async with pd_router(prefill_status(500), decode_stream()) as s:
        for i in range(3):
            status, text, headers = await sse(s.client, {**CLIENT, "prompt": f"{i} {PROMPT}"})
            assert status == 200 and "t2" in text
            assert headers["x-kvroute-pd"] == (
                f"local reason=prefill_fallback cause=prefill_failed prefill={s.names['prefill']}"
            )
        doc = (await s.client.get("/health")).json()
        assert doc["status"] == "degraded" and doc["pd"]["workers"] == [s.names["prefill"]]
        assert "its last 3 prefill legs failed" in doc["pd"]["problems"][0]
        s.prefill.handler = prefill_ok()  # mended: one good leg clears it
        status, _, headers = await sse(s.client, {**CLIENT, "prompt": f"ok {PROMPT}"})
        assert status == 200 and headers["x-kvroute-pd"].startswith("split prefill=")
        assert s.names["prefill"] not in (await s.client.get("/health")).json()["pd"]["workers"]


async def test_splits_count_on_their_decode_worker_from_the_decision() -> None:
    """Concurrent splits must see each other on the decode worker while their prefill legs
    run: the busy bound and shedding hold for them as for local requests."""

    def slow_prefill() -> Any:
        inner = prefill_ok()

        async def handle(w: Any, seen: Any, send: Any) -> None:
            await asyncio.sleep(0.5)
            await inner(w, seen, send)

        return handle

    async with pd_router(
        slow_prefill(),
        decode_stream(delay_s=0.5),
        busy_max_requests=2,
        shed=True,
        pd_max_prefill_inflight=100,
    ) as s:
        bodies = [{**CLIENT, "prompt": f"q{i} {PROMPT}"} for i in range(6)]
        answers = await asyncio.gather(*(sse(s.client, b) for b in bodies))
        assert sorted(status for status, _, _ in answers) == [200, 200, 429, 429, 429, 429]
        assert len(s.decode.seen) == 2
        load = s.app.fleet.load.known(s.names["decode"])
        assert (load.requests, load.prefill_tokens, load.decode_blocks) == (0, 0, 0)


async def test_requests_that_pass_through_never_go_to_a_prefill_worker() -> None:
    """Embeddings, responses and the rest are whole requests: only a decode (or both) worker
    takes those, as the Envoy picker already decided."""
    async with pd_router(prefill_ok(), decode_stream()) as s:
        for i in range(8):
            r = await s.client.post("/v1/embeddings", json={"model": "m", "input": f"x {i}"})
            assert r.headers["x-kvroute-worker"] == s.names["decode"]


async def test_a_request_the_prefill_leg_refuses_is_the_clients_fault_not_the_workers() -> None:
    """vLLM's 400 on the prefill leg (`temperature: -5`) judges the request: the decode
    worker's own answer goes to the client (a cause of the leg's alone, such as a shorter
    context there, loses nothing), and no run of them degrades health."""
    async with pd_router(prefill_status(400), decode_stream()) as s:
        for i in range(4):
            status, text, headers = await sse(s.client, {**CLIENT, "prompt": f"{i} {PROMPT}"})
            assert status == 200 and "t2" in text
            assert "cause=prefill_refused" in headers["x-kvroute-pd"]
        doc = (await s.client.get("/health")).json()
        assert doc["status"] == "ok" and doc["pd"]["workers"] == []
        assert await s.metric('kvroute_pd_local_fallbacks_total{cause="prefill_refused"}') == 4
        assert await s.metric('kvroute_pd_local_fallbacks_total{cause="prefill_failed"}') == 0


async def test_a_decode_worker_removed_while_the_prefill_side_is_decided_loses_nothing() -> None:
    async with pd_router(prefill_ok(), decode_stream()) as s:
        d2 = FakeWorker(decode_stream())
        async with serve_in_process(d2) as d2_url:
            s.app.routing.placement_wait = lambda: 0.5  # what --peers sets: a window
            t = asyncio.create_task(sse(s.client, CLIENT))
            await asyncio.sleep(0.75)  # the decode side was decided, the prefill side waits
            workers = [
                {"url": "http://" + s.names["prefill"], "role": "prefill"},
                {"url": d2_url, "role": "decode"},
            ]
            assert (await s.client.post("/admin/workers", json={"workers": workers})).is_success
            status, text, headers = await t
            assert status == 200 and "t2" in text
            assert headers["x-kvroute-pd"] == (
                f"local reason=decode_fallback cause=decode_removed decode={s.names['decode']}"
            )
            assert len(d2.seen) == 1 and not s.decode.seen


async def test_a_decode_worker_ejected_during_the_prefill_leg_is_sent_no_decode_leg() -> None:
    """The decode worker was ejected (hung, unreachable) while the prefill ran: the decode
    leg goes nowhere near it, where it would wait out its timeouts; the request is decided
    again, and the prefill counted orphaned."""
    answer, ejected, apps = prefill_ok(), [], []

    async def eject_then_answer(w: FakeWorker, seen: Any, send: Any) -> None:
        app = apps[0]
        for name, state in app.fleet.workers.items():  # the split's D counts it already
            if state.role == "decode" and app.fleet.load.view(name).requests:
                app.pool.eject(name, "connect failed: ConnectError")
                ejected.append(name)
        await answer(w, seen, send)

    calm = {"health_check_interval_s": 30.0, "first_byte_timeout_s": 20}
    other = FakeWorker(decode_stream())
    async with (
        serve_in_process(other) as other_url,
        pd_router(eject_then_answer, decode_stream(), more_decode=(other_url,), **calm) as s,
    ):
        apps.append(s.app)
        status, text, headers = await sse(s.client, CLIENT)
        assert status == 200 and "t2" in text, text
        (gone,) = ejected
        assert headers["x-kvroute-pd"] == (
            f"local reason=decode_fallback cause=decode_unavailable decode={gone}"
        )
        workers = {s.names["decode"]: s.decode, other_url.split("//")[1]: other}
        assert workers[gone].seen == [] and sum(len(w.seen) for w in workers.values()) == 1
        assert await s.metric('kvroute_pd_local_fallbacks_total{cause="decode_unavailable"}') == 1
        assert await s.metric('kvroute_pd_orphaned_prefills_total{cause="decode_unavailable"') == 1


async def test_a_decode_leg_answering_an_error_leaves_no_belief_of_its_pull() -> None:
    """A non-streaming decode leg's first byte is its whole answer, here a 500: it pulled
    nothing, so D is not left credited with the prompt (nor peers told so)."""
    async with pd_router(prefill_ok(), prefill_status(500)) as s:
        whole = {k: v for k, v in CLIENT.items() if k not in ("stream", "stream_options")}
        resp = await s.client.post("/v1/completions", json=whole)
        assert resp.status_code == 500 and resp.headers["x-kvroute-pd"].startswith("split")
        route = (await s.client.post("/debug/route", json=whole)).json()
        overlap = {w["worker"]: w["overlap_blocks"] for w in route["workers"]}
        assert overlap[s.names["decode"]] == 0, route


async def test_taking_back_a_requests_cache_belief_twice_takes_it_back_once() -> None:
    """A failed decode leg's belief is taken back by the door and by the outcome (a 4xx):
    the second must not take back a sibling's claim on the same prompt's record."""
    from router.openai_req import parse_request

    async with pd_router(prefill_ok(), decode_stream()) as s:
        svc, decode = s.app.routing, s.names["decode"]
        body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 2}).encode()
        decision = await svc.decide(parse_request("completion", "/v1/completions", body))
        sibling, failed = svc.start(decision, decode), svc.start(decision, decode)
        svc.finish(failed, status=400)  # the outcome takes it back...
        svc.unbelieve(failed)  # ...and so does the door
        hashes = decision.hashes[s.app.fleet.workers[decode].block_size]
        assert decode in s.app.fleet.approx.find_matches(hashes)  # the sibling's stays
        svc.finish(sibling, status=200)


async def test_a_decode_stream_cut_after_its_first_token_keeps_the_pull_believed() -> None:
    """A decode stream that dies after its first token is relayed as an error, but its
    pull happened: D holds the prompt, and a repeat must find it there."""
    async with pd_router(prefill_ok(), decode_stream(die_after=1)) as s:
        _, text, headers = await sse(s.client, CLIENT)
        assert headers["x-kvroute-pd"].startswith("split") and '"error"' in text, text
        probe = {"model": "m", "prompt": PROMPT, "max_tokens": 7}
        route = (await s.client.post("/debug/route", json=probe)).json()
        overlap = {w["worker"]: w["overlap_blocks"] for w in route["workers"]}
        assert overlap[s.names["decode"]] > 0, route


async def test_a_body_with_a_byte_order_mark_is_split_like_any() -> None:
    """vLLM's JSON parser skips a UTF-8 byte-order mark, and so does the door."""
    async with pd_router(prefill_ok(), decode_stream()) as s:
        body = b"\xef\xbb\xbf" + json.dumps(CLIENT).encode()
        headers = {"content-type": "application/json"}
        resp = await s.client.post("/v1/completions", content=body, headers=headers)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-kvroute-pd"].startswith("split")


async def test_a_removed_decode_worker_no_longer_degrades_health() -> None:
    async with pd_router(prefill_ok(), decode_stream(pull=False)) as s:
        assert (await sse(s.client, CLIENT))[0] == 200
        for _ in range(100):
            doc = (await s.client.get("/health")).json()
            if doc["pd"]["workers"]:
                break
            await asyncio.sleep(0.05)
        assert doc["pd"]["workers"] == [s.names["decode"]]  # a silent recompute
        d2 = FakeWorker(decode_stream())
        async with serve_in_process(d2) as d2_url:
            workers = [
                {"url": "http://" + s.names["prefill"], "role": "prefill"},
                {"url": d2_url, "role": "decode"},
            ]
            assert (await s.client.post("/admin/workers", json={"workers": workers})).is_success
            doc = (await s.client.get("/health")).json()
            assert doc["pd"]["status"] == "ok" and doc["pd"]["workers"] == []
            assert doc["pd"]["silent_recomputes"] == 1  # its totals stay counted
            assert (await sse(s.client, {**CLIENT, "prompt": f"x {PROMPT}"}))[0] == 200
            for _ in range(100):  # the next sweep forgets the removed worker's ledger
                if s.names["decode"] not in s.app.pd.verifier.ledgers:
                    break
                await asyncio.sleep(0.05)
            assert s.names["decode"] not in s.app.pd.verifier.accounts
            assert (await s.client.get("/health")).json()["pd"]["silent_recomputes"] == 1


async def test_a_split_writes_its_access_log_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvroute.access")
    async with pd_router(prefill_ok(), decode_stream(), access_log=True) as s:
        status, _, headers = await sse(s.client, CLIENT)
        assert status == 200 and headers["x-kvroute-pd"].startswith("split")
        (line,) = [r for r in caplog.records if r.name == "kvroute.access"]
        fields = line.fields  # type: ignore[attr-defined]
        assert fields["worker"] == s.names["decode"] and fields["prefill"] == s.names["prefill"]
        assert fields["status"] == 200 and fields["ttft_ms"] is not None


async def test_a_decode_worker_dropping_the_connection_is_served_elsewhere() -> None:
    """The engine died with the decode leg (it aborts a request whose connection closed):
    like the proxy's way, the worker is ejected and the request served by another, not a
    504 "did not answer in time"."""
    async with (
        closing_worker() as dead,
        pd_router(prefill_ok(), decode_stream(), more_decode=(dead,)) as s,
    ):
        name = dead.split("//")[1]
        for i in range(10):
            status, text, headers = await sse(s.client, {**CLIENT, "prompt": f"{i} {PROMPT}"})
            assert status == 200 and "t2" in text
            if headers["x-kvroute-pd"].startswith("local reason=decode_fallback"):
                assert headers["x-kvroute-pd"].endswith(f"cause=decode_closed decode={name}")
                break
        else:
            pytest.fail("no split went to the dying decode worker")
        assert not s.app.pool.handles[name].available
        assert await s.metric('kvroute_pd_decode_errors_total{cause="closed"') == 1
        prefill = s.names["prefill"]
        orphaned = f'kvroute_pd_orphaned_prefills_total{{cause="decode_failed",worker="{prefill}"}}'
        assert await s.metric(orphaned) == 1
        # workers leave the fleet: their series by cause go (pods come back under new names)
        decode = {"url": "http://" + s.names["decode"], "role": "decode"}
        for workers in ([{"url": "http://" + prefill, "role": "prefill"}, decode], [decode]):
            assert (await s.client.post("/admin/workers", json={"workers": workers})).is_success
        page = (await s.client.get("/metrics")).text
        assert f'worker="{name}"' not in page and orphaned not in page


def test_a_cause_counted_for_a_worker_that_left_keeps_no_series() -> None:
    """A leg in flight when its worker left the fleet ends after the removal forgot the
    worker's series: counting it there would bring one back for good."""
    metrics = PDMetrics(CollectorRegistry(), dict, owner=True)
    door = SimpleNamespace(metrics=metrics, svc=SimpleNamespace(fleet=SimpleNamespace()))
    door.svc.fleet.workers = {"p:1": object()}

    def series() -> str:
        return generate_latest(metrics.orphans).decode()

    for worker in ("p:1", "gone:2", UNKNOWN_WORKER):
        PDDoor._count(door, metrics.orphans, worker, "decode_failed")  # type: ignore[arg-type]
    assert 'worker="p:1"' in series() and f'worker="{UNKNOWN_WORKER}"' in series()
    assert 'worker="gone:2"' not in series()
