"""`kvroute explain`: how the running router would score a prompt, from its live index."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import httpx


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "explain",
        help="show how the running router would score a prompt",
        description="Ask a running kvroute (GET/POST /debug/route) to score a prompt without "
        "sending it: each worker's cached overlap, load terms, total score, and the winner.",
        epilog="example: kvroute explain --router http://127.0.0.1:8000 --prompt 'You are...'",
    )
    p.add_argument("--router", required=True, help="the router's base URL")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="a completion prompt")
    what.add_argument("--messages", help='a chat conversation as JSON: [{"role":..,"content":..}]')
    p.add_argument("--model", default="", help="model (or LoRA adapter) the request would name")
    p.add_argument("--cache-salt", help="cache_salt the request would carry")
    p.add_argument(
        "--admin-token",
        default=os.environ.get("KVROUTE_ADMIN_TOKEN"),
        help="bearer token if the router has one (env KVROUTE_ADMIN_TOKEN)",
    )
    p.add_argument("--json", action="store_true", help="print the router's JSON answer")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"model": args.model}
    if args.prompt is not None:
        body["prompt"] = args.prompt
    else:
        try:
            body["messages"] = json.loads(args.messages)
        except json.JSONDecodeError as exc:
            print(f"kvroute explain: --messages is not JSON: {exc}", file=sys.stderr)
            return 2
    if args.cache_salt:
        body["cache_salt"] = args.cache_salt
    headers = {"authorization": f"Bearer {args.admin_token}"} if args.admin_token else {}
    try:
        resp = httpx.post(
            f"{args.router.rstrip('/')}/debug/route", json=body, headers=headers, timeout=10
        )
    except httpx.HTTPError as exc:
        print(f"kvroute explain: cannot reach {args.router}: {exc}", file=sys.stderr)
        return 2
    if resp.status_code != 200:
        print(f"kvroute explain: HTTP {resp.status_code}: {resp.text[:500]}", file=sys.stderr)
        return 1
    doc = resp.json()
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(
        f"prompt: {doc['prompt_tokens']} tokens, policy {doc['policy']}, weights {doc['weights']}"
    )
    print(
        f"{'worker':<24} {'total':>7} {'overlap':>9} {'in flight':>9} {'cache':>12} "
        f"{'demand':>7} {'refetched':>9} {'riding':>6}  terms"
    )
    for w in doc["workers"]:
        terms = " + ".join(f"{k} {v:.3f}" for k, v in w["weighted"].items())
        cache = f"{w['cached_blocks']}/{w['capacity_blocks'] or '?'}"
        # what the placement scorer weighs: blocks stored lately, stored again after
        # eviction (none for a worker without KV events), and the requests there waiting
        # on a prefill in progress
        refetched = w.get("refetched_blocks")
        lost = "-" if refetched is None else f"{refetched:.0f}"
        why = w["excluded"] or w.get("relaxed")
        note = f"  [{why}]" if why else ""
        print(
            f"{w['worker']:<24} {w['total']:>7.3f} {w['overlap_blocks']:>5} blk "
            f"{w['requests_in_flight']:>9} {cache:>12} {w.get('demand_blocks', 0):>7.0f} "
            f"{lost:>9} {w.get('riders_in_flight', 0):>6}  {terms}{note}"
        )
    print(f"winner: {doc['winner']}")
    pd = doc.get("pd")
    if pd:  # a prefill->decode fleet: the split decision, its reason code and terms
        print(f"P/D: {pd['explain']}")
        print(f"P/D estimates: {pd['estimates']}, threshold {pd['threshold']}")
    return 0
