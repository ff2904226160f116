"""A base model's tokenizer folder has no chat template: the router still starts and
routes completions (its start-up tokenizer probe skips the chat), and answers chats 400
as vLLM does. Real router, simulated worker, on loopback."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import httpx
import pytest

from engines.sim.fleet import run_fleet
from router.app import RouterApp
from router.core.config import Config, WorkerConfig
from router.procs import serve_in_process
from router.tokenize import PACKAGED_TOKENIZER

pytestmark = pytest.mark.timeout(60)


def base_model_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "base"
    shutil.copytree(PACKAGED_TOKENIZER, folder)
    cfg_file = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    del cfg["chat_template"]
    cfg_file.write_text(json.dumps(cfg))
    return folder


async def test_a_tokenizer_without_chat_template_starts_and_routes_completions(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = base_model_folder(tmp_path)
    async with run_fleet(1) as fleet:
        cfg = Config(workers=(WorkerConfig(fleet.urls[0]),), tokenizer=str(folder))
        app = RouterApp(cfg)
        with caplog.at_level(logging.WARNING, logger="kvroute.workers"):
            async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url) as client:
                while not app.routing.ready:
                    await client.get("/ready")
                body = {"prompt": "The quick brown fox", "max_tokens": 2}
                completion = await client.post("/v1/completions", json=body)
                chat = await client.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                )
                problems = (await client.get("/health")).json()
    assert completion.status_code == 200, completion.text
    assert chat.status_code == 400 and "chat template" in chat.text, chat.text
    assert "chat tokenizer probe skipped" in caplog.text
    assert "tokenizer mismatch" not in json.dumps(problems)
