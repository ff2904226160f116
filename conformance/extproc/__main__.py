"""python -m conformance.extproc --picker HOST:PORT --endpoints HOST:PORT,... [--report F]

Plays Envoy's ext_proc filter against an endpoint picker (any implementation of the Gateway
API Inference Extension protocol) and checks each case: the decision in both the header and
the envoy.lb metadata, clear_route_cache, BUFFERED and FULL_DUPLEX_STREAMED bodies, the
subset hint (and 503 when it leaves nothing), OpenAI-shaped 400/404 immediate responses,
GET /v1/models, body-less requests, client headers that must not steer, the response side.
--endpoints are the pool members the picker knows (ip:port, as it names them). Prints one
line per case; writes {"cases": [{"name", "status", "detail"}]}; exits 0 when none failed."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from conformance.extproc.cases import CASES, CaseSkipped, Kit
from conformance.extproc.wire import Stream, request_headers


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m conformance.extproc",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--picker", required=True, metavar="HOST:PORT", help="the picker's gRPC port")
    p.add_argument(
        "--endpoints", required=True, metavar="HOST:PORT,...", help="the pool the picker serves"
    )
    p.add_argument("--report", type=Path, help="write the JSON report here")
    p.add_argument("--model", help="model to ask for (default: the picker's /v1/models answer)")
    p.add_argument("--case", action="append", default=[], help="run only this case (repeatable)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per message (default 5)")
    return p.parse_args(argv)


async def run(
    picker: str,
    endpoints: list[str],
    *,
    model: str | None = None,
    only: Sequence[str] = (),
    timeout_s: float = 5.0,
) -> list[dict[str, Any]]:
    """Run the cases against `picker`; one {"name", "status", "detail"} per case."""
    unknown = sorted(set(only) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; cases are {', '.join(CASES)}")
    async with grpc.aio.insecure_channel(picker) as channel:
        kit = Kit(channel, endpoints, model or "", timeout_s)
        kit.model = model or await _model_of(kit)
        return [await _one(kit, name) for name in CASES if not only or name in only]


async def _model_of(kit: Kit) -> str:
    """The first model the picker lists, so that requests name a model it serves."""
    s = Stream(kit.channel, kit.timeout_s)
    try:
        ans = await s.ask(request_headers("GET", "/v1/models", end_of_stream=True))
    except (grpc.RpcError, TimeoutError, EOFError):
        return "model"
    finally:
        await s.close()
    doc = ans.json() if ans.kind == "immediate_response" else None
    data = doc.get("data") if isinstance(doc, dict) else None
    return str(data[0].get("id", "model")) if data and isinstance(data[0], dict) else "model"


async def _one(kit: Kit, name: str) -> dict[str, Any]:
    try:
        detail = await CASES[name](kit)
        status = "pass"
    except CaseSkipped as exc:
        status, detail = "skip", str(exc)
    except AssertionError as exc:
        status, detail = "fail", str(exc) or "assertion failed"
    except (grpc.RpcError, TimeoutError, EOFError) as exc:
        status, detail = "fail", f"{type(exc).__name__}: {_rpc_text(exc)}"
    return {"name": name, "status": status, "detail": detail}


def _rpc_text(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name} {exc.details()}"
    return str(exc) or "timed out"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    endpoints = [e.strip() for e in args.endpoints.split(",") if e.strip()]
    cases = asyncio.run(
        run(args.picker, endpoints, model=args.model, only=args.case, timeout_s=args.timeout)
    )
    for c in cases:
        print(f"{c['status'].upper():<5} {c['name']:<26} {c['detail']}")
    failed = sum(c["status"] == "fail" for c in cases)
    print(f"{len(cases) - failed} passed, {failed} failed")
    if args.report is not None:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps({"picker": args.picker, "cases": cases}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
