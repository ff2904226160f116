"""The wrk script of the ext_proc benchmark: a ~2k-token prefix shared by every request and a
distinct tail per request (so nothing can be answered from a cache keyed by the whole body)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from router.textgen import filler
from router.tokenize import PACKAGED_TOKENIZER, LocalTokenizer

MODEL = "kvroute-sim"


def shared_prefix(tokens: int = 2000) -> str:
    return filler(LocalTokenizer(PACKAGED_TOKENIZER), tokens, random.Random(3))


def write_shared_prefix_lua(folder: Path, tokens: int = 2000) -> Path:
    # the prefix as it appears inside a JSON string, in a Lua long bracket (no escaping)
    escaped = json.dumps(shared_prefix(tokens))[1:-1]
    head = '{"model":"' + MODEL + '","max_tokens":1,"prompt":"'
    script = (
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"local head = [==[{head}{escaped}]==]\n"
        "local n = 0\n"
        "request = function()\n"
        "  n = n + 1\n"
        '  local body = head .. " tail " .. n .. " " .. math.random(1000000000) .. "\\"}"\n'
        "  return wrk.format(nil, nil, nil, body)\n"
        "end\n"
    )
    path = folder / "shared_prefix.lua"
    path.write_text(script)
    return path
