"""Decode KV event payloads with vLLM's own `KVEventBatch` (run by the vLLM venv's python).

stdin: one {"id", "payload": base64} per line. stdout: one {"id", "batch": view} or
{"id", "error"} per line. `norm` is also what `conformance.wire` compares with, so both
sides share one view; this script imports nothing from the project (whose dependencies the
vLLM venv does not have) and imports vLLM only when run.
"""

from __future__ import annotations

import base64
import json
import sys
from typing import Any

import msgspec


def norm(value: Any) -> Any:
    """JSON-comparable form of a decoded batch's parts."""
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, list | tuple):
        return [norm(v) for v in value]
    if isinstance(value, msgspec.Struct):
        fields = {f: norm(getattr(value, f)) for f in value.__struct_fields__}
        return {"type": type(value).__name__, **fields}
    return value


def main() -> int:
    from vllm.distributed.kv_events import KVEventBatch  # type: ignore[import-not-found, unused-ignore]

    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    for line in sys.stdin:
        if not line.strip():
            continue
        item = json.loads(line)
        try:
            batch = decoder.decode(base64.b64decode(item["payload"]))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            print(json.dumps({"id": item["id"], "error": str(exc)}))
            continue
        view = {
            "ts": batch.ts,
            "events": [norm(e) for e in batch.events],
            "data_parallel_rank": batch.data_parallel_rank,
        }
        print(json.dumps({"id": item["id"], "batch": view}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
