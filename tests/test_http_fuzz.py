"""Random requests (methods, paths, headers, bodies) against the router's app with real
simulated workers behind it: the router itself never answers 5xx and never shows a
traceback; its errors are OpenAI-shaped JSON."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.sim.config import SimConfig
from engines.sim.worker import SimWorker
from router.app import RouterApp
from router.core.config import Config, WorkerConfig
from router.tokenize import PACKAGED_TOKENIZER

pytestmark = pytest.mark.timeout(300)

PATHS = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/health",
    "/ready",
    "/live",
    "/metrics",
    "/admin/workers",
    "/admin/workers/x/drain",
    "/debug/route",
]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
bodies = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries(
        {},
        optional={
            "model": json_values,
            "prompt": st.one_of(st.text(max_size=50), json_values),
            "messages": st.one_of(
                json_values,
                st.lists(
                    st.fixed_dictionaries(
                        {"role": st.sampled_from(["user", "system", 5, None])},
                        optional={"content": json_values},
                    ),
                    max_size=3,
                ),
            ),
            "max_tokens": json_values,
            "n": json_values,
            "cache_salt": json_values,
            "stream": json_values,
        },
    ).map(lambda d: json.dumps(d).encode()),
)
header_names = st.sampled_from(
    [
        "content-type",
        "content-length",
        "connection",
        "x-request-id",
        "authorization",
        "x-kvroute-worker",
    ]
)
headers = st.dictionaries(
    header_names,
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=20),
    max_size=3,
)


class World:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.worker = SimWorker(SimConfig(block_size=16, kv_blocks=256, max_model_len=512))
        self.loop.run_until_complete(self.worker.start())
        config = Config(
            workers=(WorkerConfig(f"http://127.0.0.1:{self.worker.port}"),),
            tokenizer=str(PACKAGED_TOKENIZER),
            admin_insecure=True,
        )
        self.app = RouterApp(config)
        self.loop.run_until_complete(self.app.startup())
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://router"
        )

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.run_until_complete(self.app.shutdown())
        self.loop.run_until_complete(self.worker.stop())
        self.loop.close()


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    w = World()
    yield w
    w.close()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]),
    path=st.sampled_from(PATHS),
    body=bodies,
    extra=headers,
)
def test_the_router_never_answers_5xx_to_a_bad_client(
    world: World, method: str, path: str, body: bytes, extra: dict[str, str]
) -> None:
    resp = world.loop.run_until_complete(
        world.client.request(method, path, content=body, headers=extra)
    )
    from_worker = "x-kvroute-worker" in resp.headers
    assert from_worker or resp.status_code < 500, (method, path, body[:200], resp.text[:300])
    assert "Traceback" not in resp.text
    if resp.status_code >= 400 and not from_worker and method != "HEAD":
        err: Any = resp.json()["error"]
        assert {"message", "type", "code"} <= set(err)
