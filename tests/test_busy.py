"""Overload: the `busy` filter (max running+waiting, max KV use), relaxed when every worker
is busy, a 429 with Retry-After when shedding is on; its config, flags, explanation, metric,
and both doors (the HTTP proxy on simulated workers, the ext_proc picker's answer)."""

from __future__ import annotations

import random
from contextlib import AsyncExitStack
from pathlib import Path

import extproc_standin
import pytest
from test_serve import DOC, Setup, complete, kvroute, wait_events, worker_of

from indexer.clock import FakeClock
from indexer.hashing import Namespace
from router.cli import build_parser
from router.core.config import Config, from_env, from_mapping
from router.core.decision import Decision, RouteRequest
from router.core.errors import ConfigError, Overloaded
from router.core.filters import REGISTRY as FILTERS
from router.core.filters import BusyFilter, BusyParams
from router.core.fleet import EVENTS, FleetState, WorkerState
from router.core.load import LoadView
from router.core.picker import Picker
from router.core.scoring import Candidate
from router.serve_cli import load_config

BS = 4
NS = Namespace()
PROMPT = list(range(8 * BS))

# ---- the filter -------------------------------------------------------------------------


def cand(
    requests: int = 0, kv: float | None = None, decode: float = 0, cap: int | None = 100
) -> Candidate:
    return Candidate("w", BS, {}, LoadView(requests, 0, decode, kv), 0, cap)


@pytest.mark.parametrize(
    ("params", "c", "busy"),
    [
        (BusyParams(), cand(requests=1000, kv=1.0), None),
        (BusyParams(max_requests=4), cand(requests=3), None),
        (BusyParams(max_requests=4), cand(requests=4), "4 running+waiting >= busy_max_requests 4"),
        (BusyParams(max_kv_usage=0.9), cand(kv=0.89), None),
        (BusyParams(max_kv_usage=0.9), cand(kv=0.9), "KV cache 0.90 full >= busy_max_kv_usage"),
        (BusyParams(max_kv_usage=0.9), cand(decode=95), "KV cache 0.95 full"),
        (BusyParams(max_kv_usage=0.9), cand(decode=95, kv=0.5), None),
        (BusyParams(max_kv_usage=0.9), cand(decode=95, cap=None), None),
    ],
    ids=[
        "no-bound",
        "under-requests",
        "at-requests",
        "under-kv",
        "at-kv",
        "kv-estimated-from-decode-blocks",
        "scraped-gauge-wins",
        "kv-unknown",
    ],
)
def test_busy_bounds(params: BusyParams, c: Candidate, busy: str | None) -> None:
    out = BusyFilter(params).exclude(request(), [c], FleetState(FakeClock()))
    if busy is None:
        assert out == {}
    else:
        assert busy in out["w"] and out["w"].startswith("busy: ")


def request(dry_run: bool = False) -> RouteRequest:
    return RouteRequest(model="", namespace=NS, prompt_tokens=len(PROMPT), dry_run=dry_run)


class Fleet:
    """Two workers under a config's default profile, the pure picker, load counted by hand."""

    def __init__(self, **config: object) -> None:
        self.fleet = FleetState(FakeClock())
        for name in ("w0", "w1"):
            self.fleet.add(WorkerState(name, EVENTS, BS, capacity_blocks=100))
        self.profile = Config(**config).profile("default", random.Random(0))  # type: ignore[arg-type]
        self.picker = Picker(self.fleet)

    def busy(self, worker: str, requests: int) -> None:
        for _ in range(requests):
            self.fleet.load.start(worker, 0, 1)

    def pick(self, dry_run: bool = False) -> Decision:
        return self.picker.pick(self.profile, request(dry_run), PROMPT)


def test_a_busy_worker_gets_nothing_while_another_can_take_it() -> None:
    f = Fleet(busy_max_requests=2)
    f.busy("w0", 2)
    d = f.pick()
    assert [s.worker for s in d.ranked] == ["w1"]
    assert d.score_of("w0").excluded == "busy: 2 running+waiting >= busy_max_requests 2"
    assert "[busy: 2 running+waiting" in d.explain()


def test_every_worker_busy_is_relaxed_by_default() -> None:
    f = Fleet(busy_max_requests=2)
    f.busy("w0", 3)
    f.busy("w1", 2)
    d = f.pick()
    assert {s.worker for s in d.ranked} == {"w0", "w1"} and not d.excluded
    notes = {s.worker: s.relaxed for s in d.ranked}
    assert (
        notes["w0"]
        == "busy: 3 running+waiting >= busy_max_requests 2 (relaxed: no other worker left)"
    )
    assert "relaxed" in d.explain()


def test_every_worker_busy_with_shed_is_a_429_naming_the_bound_and_the_fix() -> None:
    f = Fleet(busy_max_requests=2, busy_max_kv_usage=0.9, shed=True)
    f.busy("w0", 2)
    f.busy("w1", 5)
    with pytest.raises(Overloaded) as err:
        f.pick()
    e = err.value
    assert e.status == 429 and e.headers() == [("retry-after", "1")]
    body = e.body()["error"]
    assert body["type"] == "rate_limit_error" and body["code"] == 429
    for needle in ("All 2 eligible workers are busy", "--busy-max-requests", "add workers"):
        assert needle in body["message"]
    assert "w0" not in body["message"]  # addresses only in the log's detail
    assert e.detail is not None and "w0 busy: 2 running+waiting" in e.detail


def test_a_dry_run_explains_instead_of_shedding() -> None:
    f = Fleet(busy_max_requests=1, shed=True)
    f.busy("w0", 1)
    f.busy("w1", 1)
    d = f.pick(dry_run=True)
    assert {s.worker for s in d.ranked} == {"w0", "w1"}
    assert all("busy: 1 running+waiting" in (s.relaxed or "") for s in d.ranked)


def test_the_prefill_profile_never_sheds() -> None:
    cfg = Config(busy_max_requests=1, shed=True)
    busy = [f for f in cfg.profile("prefill").filters if f.name == "busy"]
    assert isinstance(busy[0], BusyFilter) and not busy[0].params.shed
    decode = [f for f in cfg.profile("decode").filters if f.name == "busy"]
    assert isinstance(decode[0], BusyFilter) and decode[0].params.shed


# ---- config and flags -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "field", "fix"),
    [
        ({"busy_max_requests": 0}, "busy_max_requests", "at least 1"),
        ({"busy_max_requests": "lots"}, "busy_max_requests", "an integer"),
        ({"busy_max_kv_usage": 0}, "busy_max_kv_usage", "(0, 1]"),
        ({"busy_max_kv_usage": 95}, "busy_max_kv_usage", "e.g. 0.95"),
        ({"shed": True}, "shed", "--busy-max-requests"),
    ],
    ids=["requests-zero", "requests-not-a-number", "kv-zero", "kv-percent", "shed-no-bound"],
)
def test_bad_busy_config_names_the_field_and_the_fix(
    doc: dict[str, object], field: str, fix: str
) -> None:
    with pytest.raises(ConfigError) as err:
        from_mapping({"workers": ["http://a:1"], **doc}).validate()
    assert err.value.param == field and fix in err.value.message


def test_busy_filter_params_are_checked_by_the_registry() -> None:
    with pytest.raises(ConfigError, match=r"filters\.busy.*max_kv_usage"):
        FILTERS.build("busy", {"max_kv_usage": 2.0}, "filters.busy", "filters")


def test_busy_config_from_yaml_env_and_flags(tmp_path: Path) -> None:
    yaml = tmp_path / "kvroute.yaml"
    yaml.write_text("workers: [http://a:1]\nbusy_max_requests: 32\nbusy_max_kv_usage: 0.9\n")
    args = build_parser("serve").parse_args(["serve", "--config", str(yaml)])
    c = load_config(args, {})
    assert (c.busy_max_requests, c.busy_max_kv_usage, c.shed) == (32, 0.9, False)
    args = build_parser("serve").parse_args(
        ["serve", "--config", str(yaml), "--busy-max-requests", "8", "--shed"]
    )
    c = load_config(args, {"KVROUTE_BUSY_MAX_KV_USAGE": "0.8"})
    assert (c.busy_max_requests, c.busy_max_kv_usage, c.shed) == (8, 0.8, True)
    with pytest.raises(ConfigError, match="KVROUTE_BUSY_MAX_REQUESTS"):
        from_env(Config(), {"KVROUTE_BUSY_MAX_REQUESTS": "many"})


def test_defaults_are_no_bound_and_no_shedding() -> None:
    c = Config()
    assert (c.busy_max_requests, c.busy_max_kv_usage, c.shed) == (None, None, False)


def test_help_teaches_the_overload_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser("serve").parse_args(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    needles = ("--busy-max-requests N", "--busy-max-kv-usage F", "--busy-learn-batch", "--shed")
    for needle in (*needles, "429", "--max-num-seqs"):
        assert needle in out
    assert "When every worker is busy the request still goes to the best of them" in out
    assert "busy_max_requests, busy_max_kv_usage, busy_learn_batch, shed" in out


# ---- the ext_proc door ------------------------------------------------------------------


async def test_the_picker_answers_a_shed_request_with_429_and_retry_after() -> None:
    from router.extproc import gie
    from router.extproc.exchange import Exchange

    svc = extproc_standin.DecisionService(["127.0.0.1:1"], shed=True)
    req = gie.ProcessingRequest()
    for key, value in ((":method", "POST"), (":path", "/v1/completions")):
        req.request_headers.headers.headers.add(key=key, raw_value=value.encode())
    req.request_headers.end_of_stream = True
    (resp,) = await Exchange(svc).handle(req)  # type: ignore[arg-type]
    imm = resp.immediate_response
    assert imm.status.code == 429
    headers = {h.header.key: h.header.raw_value for h in imm.headers.set_headers}
    assert headers["retry-after"] == b"1"
    assert b"rate_limit_error" in imm.body


# ---- end to end: kvroute serve over simulated workers ----------------------------------

LONG = {"max_tokens": 3000, "ignore_eos": True, "stream": True}


async def hold(s: Setup, stack: AsyncExitStack) -> str:
    """A long streaming request, open until `stack` closes: returns the worker serving it."""
    body = {"model": "kvroute-sim", "prompt": DOC, **LONG}
    resp = await stack.enter_async_context(s.client.stream("POST", "/v1/completions", json=body))
    assert resp.status_code == 200
    chunks = resp.aiter_bytes()
    # a dropped iterator would close the response (a client disconnect): keep it to the end
    stack.push_async_callback(chunks.aclose)  # type: ignore[attr-defined]
    await anext(chunks)  # its first token: it is running
    return worker_of(resp)


# scrapes only at start: the test is about this router's own count of in-flight requests
OVERLOAD = {"busy_max_requests": 1, "scrape_interval_s": 30.0}


async def test_a_worker_past_its_bound_gets_no_new_requests() -> None:
    async with kvroute(**OVERLOAD) as s, AsyncExitStack() as stack:
        warm = await complete(s.client, DOC)
        await wait_events(s.app, worker_of(warm))
        first = await hold(s, stack)
        assert first == worker_of(warm)  # the prefix's holder, while it was not busy
        route = (await s.client.post("/debug/route", json={"prompt": DOC})).json()
        (busy,) = [w for w in route["workers"] if w["worker"] == first]
        assert busy["excluded"] == "busy: 1 running+waiting >= busy_max_requests 1"
        for i in range(3):  # the prefix lives on `first`, yet it is busy
            resp = await complete(s.client, DOC + f" q{i}")
            assert resp.status_code == 200 and worker_of(resp) != first
        second = await hold(s, stack)
        assert second != first
        relaxed = await complete(s.client, DOC)  # both busy, no --shed: still served
        assert relaxed.status_code == 200


async def test_shed_answers_429_in_openai_shape_when_every_worker_is_busy() -> None:
    async with kvroute(shed=True, **OVERLOAD) as s, AsyncExitStack() as stack:
        workers = {await hold(s, stack), await hold(s, stack)}
        assert len(workers) == 2
        shed = await complete(s.client, DOC)
        assert shed.status_code == 429 and shed.headers["retry-after"] == "1"
        err = shed.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == 429
        assert "--busy-max-requests" in err["message"] and "add workers" in err["message"]
        assert "x-kvroute-worker" not in shed.headers
        route = await s.client.post("/debug/route", json={"prompt": DOC})
        assert route.status_code == 200  # an explanation, not a refusal
        assert all("relaxed" in (w["relaxed"] or "") for w in route.json()["workers"])
        metrics = (await s.client.get("/metrics")).text
        assert 'kvroute_requests_shed_total{model="kvroute-sim"} 1.0' in metrics
