"""`kvroute events ...`: look at a worker's KV event stream the way the router does.

capture  write raw frames to a folder (the layout the golden tests read)
replay   build an index from a capture folder and print overlaps for queries
tail     print decoded events as they arrive
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from indexer.capture import CapturedMessage, CaptureWriter, read_capture

_EXAMPLES = """examples:
  kvroute events tail --endpoint tcp://10.0.0.5:5557
  kvroute events capture --endpoint tcp://127.0.0.1:5557 --replay-endpoint tcp://127.0.0.1:5558 \\
      --topic kv-events --out /tmp/cap --seconds 30
  kvroute events replay /tmp/cap --query queries.jsonl
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "events",
        help="capture, replay and tail vLLM KV event streams",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    esub = p.add_subparsers(dest="events_command", metavar="ACTION", required=True)

    cap = esub.add_parser(
        "capture", help="write raw frames to a folder (until a bound, Ctrl-C or SIGTERM)"
    )
    _endpoint_args(cap)
    cap.add_argument("--out", type=Path, required=True, help="folder to write frames into")
    stop = cap.add_mutually_exclusive_group()
    stop.add_argument("--batches", type=int, help="stop after this many live batches")
    stop.add_argument("--seconds", type=float, help="stop after this many seconds")
    cap.set_defaults(func=_capture)

    rep = esub.add_parser("replay", help="index a capture folder and answer overlap queries")
    rep.add_argument("folder", type=Path, help="a folder written by `kvroute events capture`")
    rep.add_argument(
        "--query",
        type=Path,
        required=True,
        help='JSONL, one {"id", "token_ids", "lora_name"?, "cache_salt"?} per line',
    )
    rep.add_argument("--model", default="", help="model name the router namespaces hashes with")
    rep.set_defaults(func=_replay)

    tail = esub.add_parser("tail", help="print decoded events as they arrive (JSON lines)")
    _endpoint_args(tail)
    tail.add_argument("--batches", type=int, help="stop after this many batches")
    tail.set_defaults(func=_tail)


def _endpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", required=True, help="the engine's KV event PUB socket, tcp://H:P")
    p.add_argument("--replay-endpoint", help="its replay ROUTER socket, tcp://H:R (optional)")
    p.add_argument("--topic", default="", help='topic to subscribe to (vLLM default "")')


def _subscribe(args: argparse.Namespace) -> Any:
    import zmq

    ctx: zmq.Context[Any] = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    sub.connect(args.endpoint)
    return sub


def _stop_on_sigterm() -> None:
    """SIGTERM ends a capture or tail as Ctrl-C does, with the index written and the count
    printed: containers, systemd and `timeout` stop with SIGTERM, and a shell's background job
    ignores SIGINT (it would never stop)."""

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def _capture(args: argparse.Namespace) -> int:
    _stop_on_sigterm()
    sub = _subscribe(args)
    writer = CaptureWriter(args.out)
    time.sleep(0.3)  # let the subscription reach the publisher before asking for history
    if args.replay_endpoint and not _capture_history(args.replay_endpoint, writer):
        print(
            f"warning: the replay socket {args.replay_endpoint} did not answer; batches "
            "published before this capture started are missing",
            file=sys.stderr,
        )
    writer.flush()  # the index exists from here on: readers can tell the capture is live
    print(f"capturing from {args.endpoint} into {args.out}", file=sys.stderr, flush=True)
    deadline = time.monotonic() + args.seconds if args.seconds else None
    live = 0
    try:
        while args.batches is None or live < args.batches:
            if deadline is not None and time.monotonic() >= deadline:
                break
            if not sub.poll(200):
                continue
            frames = sub.recv_multipart()
            if len(frames) != 3:
                print(f"skipping a message with {len(frames)} frames", file=sys.stderr)
                continue
            writer.add("pub", frames)
            live += 1
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()
    print(f"captured {live} live batches ({len(writer)} messages) into {args.out}")
    return 0


def _capture_history(endpoint: str, writer: CaptureWriter, attempts: int = 3) -> bool:
    """Ask the replay socket for everything from sequence 0; True once its end marker came.
    A fresh DEALER per attempt, so a late answer to an earlier one cannot interleave."""
    import zmq

    from indexer.subscriber import END_SEQ

    for _ in range(attempts):
        dealer: Any = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        frames: list[list[bytes]] = []
        done = False
        while dealer.poll(5000):
            reply = dealer.recv_multipart()
            if len(reply) != 4:
                continue
            frames.append(reply[1:])
            if reply[2] == END_SEQ:
                done = True
                break
        dealer.close()
        if done:
            for topic, seq, payload in frames:
                writer.add("replay", [topic, seq, payload], prefix="replay_from0")
            return True
    return False


def _replay(args: argparse.Namespace) -> int:
    from engines.vllm.events import decode_batch
    from indexer.clock import MonotonicClock
    from indexer.hashing import Namespace, hash_request
    from indexer.index import PrefixIndex
    from indexer.ingest import WorkerIngest

    messages = list(read_capture(args.folder))
    index = PrefixIndex()
    index.add_worker("captured", model=args.model)
    ingest = WorkerIngest("captured", index, decode_batch, MonotonicClock())
    _feed(ingest, messages)
    block_size = ingest.block_size
    if block_size is None:
        print("the capture holds no BlockStored event: block size unknown", file=sys.stderr)
        return 1
    for line_no, line in enumerate(args.query.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            ns = Namespace(args.model, q.get("lora_name"), q.get("cache_salt"))
            hashes = hash_request(q["token_ids"], block_size, ns)
        except (ValueError, KeyError, TypeError) as exc:
            print(f"{args.query}:{line_no}: bad query: {exc}", file=sys.stderr)
            return 2
        overlap = index.find_matches(hashes).get("captured")
        print(json.dumps({"id": q.get("id"), "overlap_blocks": overlap.blocks if overlap else 0}))
    return 0


def _feed(ingest: Any, messages: list[CapturedMessage]) -> None:
    """Feed a capture through the same ingest logic as live traffic; gaps are answered from
    the replay answers the capture holds."""
    replayed = [(m.seq, m.payload) for m in messages if m.kind == "replay" and m.seq >= 0]
    if replayed:
        ingest.finish_replay(replayed)
    for m in messages:
        if m.kind != "pub":
            continue
        request = ingest.on_live(m.seq, m.payload)
        if request is not None:
            ingest.finish_replay([(s, p) for s, p in replayed if s >= request.start_seq] or None)


def _tail(args: argparse.Namespace) -> int:
    from engines.vllm.events import MalformedPayload, decode_wire

    _stop_on_sigterm()
    sub = _subscribe(args)
    seen = 0
    try:
        while args.batches is None or seen < args.batches:
            frames = sub.recv_multipart()
            seen += 1
            if len(frames) != 3:
                print(json.dumps({"error": f"{len(frames)} frames"}), flush=True)
                continue
            seq = int.from_bytes(frames[1], "big")
            try:
                batch, _ = decode_wire(frames[2])
            except MalformedPayload as exc:
                print(json.dumps({"seq": seq, "error": str(exc)}), flush=True)
                continue
            for event in batch.events:
                doc = msgspec.to_builtins(event, enc_hook=_hex_bytes)
                doc["seq"] = seq
                print(json.dumps(doc), flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()
    return 0


def _hex_bytes(obj: Any) -> Any:
    if isinstance(obj, bytes):
        return obj.hex()
    raise TypeError(f"cannot encode {type(obj).__name__}")
