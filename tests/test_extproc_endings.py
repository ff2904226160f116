"""How a request behind Envoy ended, when the ext_proc stream alone cannot say: Envoy 1.40
closes the stream the same way for a completed response, a client hang-up and a worker that
broke off its response. Its gRPC access log, pointed at the picker, tells them apart
(router/extproc/endings.py): the registry on its own with a fake timer, then a real Envoy in
front of the simulated fleet and of a worker that resets its response mid-body."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from gateway_harness import MODEL, Gateway, fixed_order, gateway, until

from router.envoy.bootstrap import ACCESS_LOG_MARK, PICKER, Endpoint
from router.extproc.endings import (
    CLIENT_GONE,
    COMPLETED,
    MARK_TRUST_S,
    UPSTREAM_BROKE,
    Endings,
    ending_of,
)
from router.procs import free_port

# ---- the registry ---------------------------------------------------------------------------


class FakeTimers:
    def __init__(self) -> None:
        self.pending: list[tuple[float, Callable[[], None], list[bool]]] = []

    def later(self, delay: float, fn: Callable[[], None]) -> Any:
        cancelled = [False]
        self.pending.append((delay, fn, cancelled))
        return _Handle(cancelled)

    def fire(self) -> None:
        for _, fn, cancelled in self.pending:
            if not cancelled[0]:
                fn()


class _Handle:
    def __init__(self, cancelled: list[bool]) -> None:
        self.cancelled = cancelled

    def cancel(self) -> None:
        self.cancelled[0] = True


def _endings(streams: int = 1) -> tuple[Endings, FakeTimers, list[str | None]]:
    timers = FakeTimers()
    endings = Endings(wait_s=2.0, later=timers.later)
    endings.streams = streams
    return endings, timers, []


def test_a_verdict_told_before_the_close_concludes_at_once() -> None:
    endings, timers, got = _endings()
    assert endings.expect("r1")
    endings.tell("r1", CLIENT_GONE)
    endings.when_known("r1", got.append)
    assert got == [CLIENT_GONE] and not timers.pending


def test_a_verdict_told_after_the_close_concludes_then() -> None:
    endings, timers, got = _endings()
    endings.expect("r1")
    endings.when_known("r1", got.append)
    assert got == [] and timers.pending[0][0] == 2.0
    endings.tell("r1", UPSTREAM_BROKE)
    timers.fire()  # cancelled: no second conclusion
    assert got == [UPSTREAM_BROKE]


def test_a_request_the_gateway_marked_waits_for_a_log_not_open_yet() -> None:
    endings, _, got = _endings(streams=0)
    endings.expect("r1")
    endings.when_known("r1", got.append, logged=True)
    assert got == []
    endings.tell("r1", CLIENT_GONE)  # Envoy opened the log with this entry
    assert got == [CLIENT_GONE]


def test_a_mark_no_log_ever_follows_is_trusted_for_a_while_only() -> None:
    """Behind a gateway that passes a client's own mark through and sends no log, marked
    requests wait for a log only for MARK_TRUST_S after the first of them."""
    now = [100.0]
    timers = FakeTimers()
    endings = Endings(wait_s=2.0, later=timers.later, clock=lambda: now[0])
    got: list[str | None] = []
    endings.expect("r1")
    endings.when_known("r1", got.append, logged=True)
    assert got == []  # waits
    now[0] += MARK_TRUST_S
    endings.expect("r2")
    endings.when_known("r2", got.append, logged=True)
    assert got == [None]  # no log ever came: concluded at once
    endings.opened()  # a log after all: the mark is trusted again
    endings.closed()
    endings.expect("r3")
    endings.when_known("r3", got.append, logged=True)
    assert got == [None]


def test_no_verdict_in_time_concludes_with_none() -> None:
    endings, timers, got = _endings()
    endings.expect("r1")
    endings.when_known("r1", got.append)
    timers.fire()
    endings.tell("r1", COMPLETED)  # too late: forgotten
    assert got == [None]


@pytest.mark.parametrize(
    ("streams", "rids"),
    [(0, ["r1"]), (1, ["r1", "r1"]), (1, [""])],
    ids=["no-access-log", "shared-id", "no-id"],
)
def test_no_verdict_to_wait_for_concludes_with_none_at_once(streams: int, rids: list[str]) -> None:
    endings, timers, got = _endings(streams)
    for rid in rids:
        endings.expect(rid)
    if streams:  # a log that cannot be trusted for this id
        endings.tell(rids[0], CLIENT_GONE)
    endings.when_known(rids[0], got.append)
    assert got == [None] and not timers.pending


def test_an_id_stays_distrusted_while_any_request_that_shared_it_is_live() -> None:
    """A and B share a client-chosen id; A ends in band while B runs; C arrives with the
    same id: B's entry must not become C's verdict (C's worker would be charged B's 502)."""
    endings, timers, got = _endings()
    assert endings.expect("x")  # A listens
    assert not endings.expect("x")  # B: shared
    endings.forget("x")  # A ended in band
    assert not endings.expect("x")  # C: B is still live
    endings.tell("x", UPSTREAM_BROKE)  # B's entry
    endings.forget("x")  # B's close (not listening)
    endings.forget("x")  # C's close (not listening)
    assert not endings._slots
    assert endings.expect("x")  # once none is live, the id is trusted again
    endings.tell("x", CLIENT_GONE)
    endings.when_known("x", got.append)
    assert got == [CLIENT_GONE] and not endings._slots and not timers.pending


def _clocked() -> tuple[Endings, list[float], list[str | None]]:
    now = [0.0]
    endings = Endings(wait_s=2.0, later=FakeTimers().later, clock=lambda: now[0])
    endings.opened()
    return endings, now, []


def test_the_late_entry_of_a_request_that_ended_in_band_is_not_the_next_ones_verdict() -> None:
    """A client reuses its id for sequential calls: call 1 ends in band and its entry comes
    after call 2 started; call 2's worker then breaks off its response."""
    endings, _, got = _clocked()
    endings.expect("trace")
    endings.ended_in_band("trace")  # call 1
    assert endings.expect("trace")  # call 2
    endings.tell("trace", COMPLETED)  # call 1's entry, late: dropped
    endings.when_known("trace", got.append)
    assert got == []
    endings.tell("trace", UPSTREAM_BROKE)  # call 2's own
    assert got == [UPSTREAM_BROKE] and not endings._tombstones


@pytest.mark.parametrize("case", ["told-first", "expired", "no-access-log"])
def test_an_entry_is_dropped_only_while_one_is_still_due(case: str) -> None:
    endings, now, got = _clocked()
    if case == "no-access-log":
        endings = Endings(wait_s=2.0, later=FakeTimers().later, clock=lambda: now[0])
    endings.expect("r")
    if case == "told-first":  # call 1's entry came before its end in band: none is due
        endings.tell("r", COMPLETED)
    endings.ended_in_band("r")
    if case == "expired":
        now[0] += 2.0
    endings.expect("r")
    endings.opened()
    endings.tell("r", CLIENT_GONE)
    endings.when_known("r", got.append)
    assert got == [CLIENT_GONE] and not endings._slots


def test_ids_that_ended_in_band_are_kept_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("router.extproc.endings.MAX_TOMBSTONES", 3)
    endings, now, _ = _clocked()
    for i in range(5):
        endings.expect(f"r{i}")
        endings.ended_in_band(f"r{i}")
    assert list(endings._tombstones) == ["r2", "r3", "r4"]
    now[0] += 2.0
    endings.ended_in_band("r5")  # an id with no request live: still, its entry is due
    assert list(endings._tombstones) == ["r5"]


def test_forgotten_requests_keep_nothing_and_close_concludes_the_waiting() -> None:
    endings, _, got = _endings()
    endings.expect("done")
    endings.forget("done")
    endings.tell("done", COMPLETED)
    endings.expect("waiting")
    endings.when_known("waiting", got.append)
    endings.close()
    assert got == [None] and not endings._slots


def _entry(details: str, **flags: bool) -> accesslog_pb2.HTTPAccessLogEntry:
    entry = accesslog_pb2.HTTPAccessLogEntry()
    entry.response.response_code_details = details
    for name, value in flags.items():
        setattr(entry.common_properties.response_flags, name, value)
    return entry


@pytest.mark.parametrize(
    ("entry", "ending"),
    [
        (_entry("via_upstream"), COMPLETED),
        (
            _entry("downstream_remote_disconnect", downstream_connection_termination=True),
            CLIENT_GONE,
        ),
        (_entry("via_upstream", downstream_remote_reset=True), CLIENT_GONE),
        (
            _entry(
                "upstream_reset_after_response_started{protocol_error}",
                upstream_protocol_error=True,
            ),
            UPSTREAM_BROKE,
        ),
        (_entry("upstream_reset_after_response_started{remote_reset}"), UPSTREAM_BROKE),
        (_entry("stream_idle_timeout", stream_idle_timeout=True), UPSTREAM_BROKE),
        (_entry("via_upstream", upstream_request_timeout=True), UPSTREAM_BROKE),
        (_entry("request_payload_too_large"), None),
    ],
    ids=[
        "completed",
        "client-gone",
        "h2-client-reset",
        "worker-broke",
        "worker-reset",
        "idle",
        "ut",
        "local-reply",
    ],
)
def test_what_an_access_log_entry_says(
    entry: accesslog_pb2.HTTPAccessLogEntry, ending: str | None
) -> None:
    assert ending_of(entry) == ending


# ---- against a real Envoy -------------------------------------------------------------------

HCM = "envoy.filters.network.http_connection_manager"


@contextlib.asynccontextmanager
async def breaking_worker() -> AsyncIterator[Endpoint]:
    """A worker that starts an SSE response, sends three events and resets the connection."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for i in range(3):
            event = b'data: {"n": %d}\n\n' % i
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.transport.abort()

    port = free_port()
    server = await asyncio.start_server(answer, "127.0.0.1", port)
    try:
        yield Endpoint("127.0.0.1", port)
    finally:
        server.close()
        await server.wait_closed()


async def _warm_up(gw: Gateway) -> None:
    """One completed request: Envoy opens its access-log stream with the first entry."""
    resp = await gw.complete("warm up", stream=True)
    assert resp.status_code == 200, resp.text[:300]
    assert gw.picker is not None
    await until(lambda: gw.picker is not None and gw.picker.endings.streams > 0)
    await until(lambda: gw.svc.inflight() == 0)
    (ticket,) = gw.svc.tickets
    assert ticket.events[-1][0] == "finish" and ticket.events[-1][1][0] == 200


async def _stream(
    url: str, body: dict[str, Any], *, hang_up_when: Callable[[], bool] | None = None
) -> None:
    """POST and read the response; hang up once `hang_up_when()` holds, or read it to the
    end (a response cut short raises in the client: ignored)."""

    async def read() -> None:
        async with (
            httpx.AsyncClient(base_url=url, timeout=30) as client,
            client.stream("POST", "/v1/completions", json=body) as resp,
        ):
            async for _ in resp.aiter_bytes():
                pass

    task = asyncio.create_task(read())
    if hang_up_when is not None:
        await until(lambda: hang_up_when() or task.done())
        assert not task.done(), "the response ended before the hang-up"
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
        await task


def _headers_came(gw: Gateway) -> Callable[[], bool]:
    """Whether the next request's response has reached the picker (its first_token): a
    hang-up before it would be another case, concluded otherwise."""
    n = len(gw.svc.tickets)
    return lambda: len(gw.svc.tickets) > n and ("first_token", None) in gw.svc.tickets[n].events


@pytest.mark.parametrize(
    ("mode", "response_body"),
    [("buffered", "skip"), ("full-duplex", "skip"), ("buffered", "read")],
)
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_hang_up_after_the_headers_is_told_from_a_completed_response(
    mode: str, response_body: str
) -> None:
    """Bodies skipped, the stream's close is the only end Envoy shows: a completed response
    keeps its status, a client that hangs up mid-stream is client_disconnected."""
    slow = (("--decode-ms-per-step", "30"),)
    async with gateway(body_mode=mode, response_body=response_body, engine_args=slow) as gw:
        await _warm_up(gw)
        body = {"model": MODEL, "prompt": "long " * 20, "max_tokens": 300, "stream": True}
        await _stream(gw.envoy.url, body, hang_up_when=_headers_came(gw))
        await until(lambda: gw.svc.inflight() == 0)
        ticket = gw.svc.tickets[-1]
        assert ("first_token", None) in ticket.events  # the headers had come
        assert ticket.events[-1] == ("finish", (0, "client_disconnected")), ticket.events


@pytest.mark.parametrize(
    ("mode", "response_body"),
    [("buffered", "read"), ("full-duplex", "read"), ("buffered", "skip")],
)
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_worker_that_breaks_off_its_response_is_an_upstream_failure(
    mode: str, response_body: str
) -> None:
    """The worker resets mid-body: counted on it as the proxy counts it (a 502), not as a
    client hang-up nor as a completed response."""
    async with (
        breaking_worker() as broken,
        gateway(
            body_mode=mode,
            response_body=response_body,
            extra_endpoints=(broken,),
            make_service=fixed_order,
        ) as gw,
    ):
        await _warm_up(gw)  # on a live worker: the broken one is last in the order
        address = f"{broken.host}:{broken.port}"
        gw.svc.workers[:] = [address, *gw.addresses]
        body = {"model": MODEL, "prompt": "break " * 20, "max_tokens": 50, "stream": True}
        await _stream(gw.envoy.url, body)
        await until(lambda: gw.svc.inflight() == 0)
        ticket = gw.svc.tickets[-1]
        assert ticket.events[0] == ("start", address)
        assert ticket.events[-1] == ("finish", (502, None)), ticket.events


def without_access_log(doc: dict[str, Any]) -> None:
    """A bootstrap written by hand before the picker took Envoy's access log (and so
    without the mark that says it does)."""
    listener = doc["static_resources"]["listeners"][0]
    (hcm,) = [f for f in listener["filter_chains"][0]["filters"] if f["name"] == HCM]
    (log,) = hcm["typed_config"].pop("access_log")
    assert log["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"] == {
        "cluster_name": PICKER
    }
    for f in hcm["typed_config"]["http_filters"]:
        rules = f["typed_config"].get("mutations", {}).get("request_mutations")
        if rules is not None:
            marks = [r for r in rules if "append" in r]
            assert [m["append"]["header"]["key"] for m in marks] == [ACCESS_LOG_MARK]
            rules.remove(marks[0])


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_the_first_requests_wait_for_the_log_envoy_has_not_opened_yet() -> None:
    """Envoy opens its access-log stream at its first entry, just after the first request's
    ext_proc stream closed: that request is still concluded by its entry, not by a guess
    (bodies skipped, a hang-up would be a completed 200)."""
    slow = (("--decode-ms-per-step", "30"),)
    async with gateway(body_mode="full-duplex", response_body="skip", engine_args=slow) as gw:
        assert gw.picker is not None and gw.picker.endings.streams == 0
        body = {"model": MODEL, "prompt": "long " * 20, "max_tokens": 300, "stream": True}
        await _stream(gw.envoy.url, body, hang_up_when=_headers_came(gw))
        await until(lambda: gw.svc.inflight() == 0)
        ticket = gw.svc.tickets[-1]
        assert ticket.events[-1] == ("finish", (0, "client_disconnected")), ticket.events


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_without_the_access_log_every_request_is_still_concluded() -> None:
    """An Envoy that sends no access log: the close is concluded at once by the old guess
    (bodies skipped: the headers' status), so no load is left counted on the worker."""
    slow = (("--decode-ms-per-step", "30"),)
    async with gateway(
        body_mode="buffered", response_body="skip", engine_args=slow, tweak=without_access_log
    ) as gw:
        body = {"model": MODEL, "prompt": "long " * 20, "max_tokens": 300, "stream": True}
        await _stream(gw.envoy.url, body, hang_up_when=_headers_came(gw))
        await until(lambda: gw.svc.inflight() == 0, timeout_s=1.5)  # no 2 s wait for a log
        assert gw.picker is not None and gw.picker.endings.streams == 0
        ticket = gw.svc.tickets[-1]
        assert ticket.events[-1] == ("finish", (200, None)), ticket.events
