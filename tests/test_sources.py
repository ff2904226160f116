"""Worker lists from every source (flags, file, DNS, admin API) go through one validated
path: a bad entry is refused with the field named and the current list kept."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from pathlib import Path

import httpx
import pytest

from engines.sim.config import SimConfig
from engines.sim.fleet import run_fleet
from router.app import RouterApp
from router.core.config import Config, WorkerConfig
from router.core.errors import ConfigError
from router.procs import serve_in_process
from router.serve_cli import load_config, split_model_flags
from router.sources import WorkerSources
from router.tokenize import PACKAGED_TOKENIZER

pytestmark = pytest.mark.timeout(120)

SIM = SimConfig(block_size=16, kv_blocks=256, topic="kv-events")


def flags(**kw: object) -> argparse.Namespace:
    names = [
        "config",
        "worker",
        "host",
        "port",
        "tokenizer",
        "mode",
        "policy",
        "block_size",
        "metrics",
        "admin_token",
        "health_degraded_ok",
        "worker_header",
        "seed",
        "workers_file",
        "workers_dns",
        "worker_api_key",
    ]
    return argparse.Namespace(**{n: kw.get(n) for n in names})


async def names_of(app: RouterApp, want: int) -> list[str]:
    for _ in range(500):  # 10 s: a workers file is re-read every 2 s
        if len(app.pool.handles) == want:
            break
        await asyncio.sleep(0.02)
    return sorted(app.pool.handles)


def rewrite(path: Path, text: str) -> None:
    """Writes the workers file anew. The watcher tells a change by its mtime alone, and a
    write right after the watcher's read may share the last one's clock tick: move it on."""
    before = path.stat().st_mtime_ns
    path.write_text(text)
    if path.stat().st_mtime_ns <= before:
        os.utime(path, ns=(before + 10_000_000, before + 10_000_000))


async def logged(caplog: pytest.LogCaptureFixture, text: str) -> None:
    """Waits for a log line with `text`: the watcher re-reads the file every 2 s, and a
    loaded machine may take longer."""
    for _ in range(500):
        if any(text in r.getMessage() for r in caplog.records):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"nothing logged with {text!r}")


async def test_workers_dns_on_the_command_line_finds_the_workers() -> None:
    async with run_fleet(1, SIM) as fleet:
        port = fleet.workers[0].port
        given = flags(workers_dns=f"127.0.0.1:{port}", tokenizer=[str(PACKAGED_TOKENIZER)])
        config = load_config(given, {})
        assert config.workers_dns == f"127.0.0.1:{port}" and not config.workers
        app = RouterApp(config)
        async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url) as client:
            assert await names_of(app, 1) == [f"127.0.0.1:{port}"]
            resp = await client.post(
                "/v1/completions", json={"model": "kvroute-sim", "prompt": "hi", "max_tokens": 1}
            )
            assert resp.status_code == 200


async def test_a_bad_workers_file_keeps_the_current_list(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with run_fleet(2, SIM) as fleet:
        a, b = fleet.urls
        path = tmp_path / "workers.yaml"
        path.write_text(f"workers:\n  - {a}\n")
        app = RouterApp(
            Config(workers_file=str(path), tokenizer=str(PACKAGED_TOKENIZER)).validate()
        )
        caplog.set_level(logging.WARNING, logger="kvroute.workers")
        async with serve_in_process(app):
            assert await names_of(app, 1) == [a.split("//")[1]]
            rewrite(path, f"workers:\n  - {a}\n  - url: {b}\n    block_size: many\n")
            await logged(caplog, "workers[1].block_size")  # the watcher re-read it, refused
            assert sorted(app.pool.handles) == [a.split("//")[1]]
            # a save in another encoding, a host name no resolver takes: refused the same,
            # and the watcher reads on (it once died of them, ignoring every later edit)
            before = path.stat().st_mtime_ns
            path.write_bytes(f"# M\xfcller's fleet\n- {a}\n- {b}\n".encode("latin-1"))
            os.utime(path, ns=(before + 10_000_000, before + 10_000_000))
            await logged(caplog, "can't decode")
            rewrite(path, f"- {a}\n- http://vllm-1..svc:8000\n")
            await logged(caplog, "is not an http(s)://HOST:PORT URL")
            assert sorted(app.pool.handles) == [a.split("//")[1]]
            rewrite(path, f"- {a}\n- {b}\n")  # a plain list works too
            assert len(await names_of(app, 2)) == 2
            rewrite(path, "")  # an editor mid-save: not "no workers"
            await logged(caplog, "is empty: keeping the current list")
            assert len(app.pool.handles) == 2
            rewrite(path, "workers: []\n")  # said explicitly
            assert await names_of(app, 0) == []


async def test_admin_api_validates_like_the_config() -> None:
    async with run_fleet(1, SIM) as fleet:
        dns = f"127.0.0.1:{fleet.workers[0].port}"
        config = Config(workers_dns=dns, tokenizer=str(PACKAGED_TOKENIZER), admin_insecure=True)
        app = RouterApp(config.validate())
        async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url) as client:
            bad = await client.post("/admin/workers", json={"workers": [{"url": 5}]})
            assert bad.status_code == 400
            assert bad.json()["error"]["param"] == "workers[0].url"
            twice = {"workers": ["http://h:1", "http://h:1"]}
            dup = await client.post("/admin/workers", json=twice)
            assert dup.status_code == 400 and "listed twice" in dup.json()["error"]["message"]
            assert len(app.pool.handles) == 1


def test_tokenizer_flags_split_default_and_per_model(tmp_path: Path) -> None:
    odd = tmp_path / "a=b"
    odd.mkdir()
    default, per_model = split_model_flags(
        ["/models/x", "llama=/models/llama", "qwen=remote", str(odd)]
    )
    assert default == str(odd)  # an existing folder whose name has "=" is a path
    assert per_model == {"llama": "/models/llama", "qwen": "remote"}


async def test_prefill_workers_may_hand_off_to_decode_workers_another_source_lists(
    tmp_path: Path,
) -> None:
    async with run_fleet(2, SIM) as fleet:
        a, b = fleet.urls
        path = tmp_path / "workers.yaml"
        path.write_text(f"- url: {a}\n  role: decode\n")
        config = Config(
            workers=(),
            workers_file=str(path),
            tokenizer=str(PACKAGED_TOKENIZER),
            admin_insecure=True,
            pd_probe=False,
        ).validate()
        app = RouterApp(config)
        async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url) as client:
            assert len(await names_of(app, 1)) == 1
            prefill = {"workers": [{"url": b, "role": "prefill"}]}
            resp = await client.post("/admin/workers", json=prefill)
            assert resp.status_code == 200, resp.text
            assert len(await names_of(app, 2)) == 2
            # the file then drops its decode worker: no fleet is left to hand off to
            path.write_text("[]\n")
            await asyncio.sleep(2.5)  # the watcher re-reads every 2 s
            assert len(app.pool.handles) == 2
    # a prefill worker given alone, with no other source of workers, is still refused
    with pytest.raises(ConfigError, match="decode"):
        Config(workers=(WorkerConfig(a, role="prefill"),)).validate()


async def test_every_worker_list_change_is_kept_for_a_later_sibling(tmp_path: Path) -> None:
    """--processes: a worker drained, then dropped and listed again by the workers file,
    is undrained in every process; the state a restarted process starts from must say
    so too, or it alone keeps the worker drained."""
    from types import SimpleNamespace

    handles: dict[str, SimpleNamespace] = {}

    async def set_workers(workers: tuple[WorkerConfig, ...]) -> None:
        for name in [n for n in handles if n not in {w.name for w in workers}]:
            del handles[name]
        for w in workers:
            handles.setdefault(w.name, SimpleNamespace(draining=False))

    pool = SimpleNamespace(handles=handles, set_workers=set_workers)
    state = tmp_path / "admin-state.json"
    sources = WorkerSources(Config(), pool, state)  # type: ignore[arg-type]
    b = WorkerConfig("http://b:1")
    await sources._set((b,), "workers file")
    handles["b:1"].draining = True
    sources.save_admin_state()  # the admin API's drain
    assert json.loads(state.read_text())["draining"] == ["b:1"]
    await sources._set((), "workers file")
    await sources._set((b,), "workers file")
    later = WorkerSources(Config(), pool, state)  # type: ignore[arg-type]
    assert later._read_admin_state() == []


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://bad..host:8000", "is not an http(s)://HOST:PORT URL"),
        ("http://u:s3cret@127.0.0.1:8000", "carries credentials"),
        ("http://127.0.0.1:8000/foo", "HOST:PORT only"),
        ("http://127.0.0.1:8000?x=1", "HOST:PORT only"),
    ],
)
async def test_the_admin_api_refuses_a_worker_url_requests_could_not_use(
    url: str, says: str
) -> None:
    async with run_fleet(1, SIM) as fleet:
        config = Config(
            workers=(WorkerConfig(fleet.urls[0]),),
            tokenizer=str(PACKAGED_TOKENIZER),
            admin_insecure=True,
        )
        app = RouterApp(config.validate())
        async with serve_in_process(app) as base, httpx.AsyncClient(base_url=base) as client:
            resp = await client.post("/admin/workers", json={"workers": [fleet.urls[0], url]})
            assert resp.status_code == 400, resp.text
            assert says in resp.json()["error"]["message"]
            assert "s3cret" not in resp.text
            assert sorted(app.pool.handles) == [fleet.urls[0].split("//")[1]]
            listed = (await client.get("/admin/workers")).json()
            assert url.split("//")[1] not in json.dumps(listed)


async def test_a_configured_wildcard_event_endpoint_is_dialled_at_the_worker() -> None:
    """`events: tcp://*:PORT` is how vLLM's own --kv-events-config names it."""
    async with run_fleet(1, SIM) as fleet:
        sim = fleet.workers[0]
        port = sim.events_endpoint.rpartition(":")[2]
        replay = sim.replay_endpoint.rpartition(":")[2]
        worker = WorkerConfig(
            fleet.urls[0], events=f"tcp://*:{port}", replay=f"tcp://*:{replay}", topic="kv-events"
        )
        config = Config(workers=(worker,), tokenizer=str(PACKAGED_TOKENIZER), mode="events")
        app = RouterApp(config.validate())
        async with serve_in_process(app) as base, httpx.AsyncClient(base_url=base) as client:
            prompt = " ".join(f"word{i}" for i in range(200))
            body = {"model": "kvroute-sim", "prompt": prompt, "max_tokens": 1}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            home = fleet.urls[0].split("//")[1]
            for _ in range(250):
                if app.fleet.index.entries_of(home) > 0:
                    break
                await asyncio.sleep(0.02)
            assert app.fleet.index.entries_of(home) > 0  # the worker's stored blocks arrived
            (report,) = (await client.get("/health")).json()["workers"]
            assert f"127.0.0.1:{port}" in json.dumps(report), report
