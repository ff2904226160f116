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


def _subscribe(args: argparse.Namespace, *, unbounded: bool = False) -> Any:
    import zmq

    ctx: zmq.Context[Any] = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    if unbounded:
        sub.setsockopt(zmq.RCVHWM, 0)
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
    # subscribed before the history is asked for, so no batch falls between the two; the
    # queue is unbounded because live batches wait in it while the history is written
    sub = _subscribe(args, unbounded=True)
    writer = CaptureWriter(args.out)
    try:
        time.sleep(0.3)  # let the subscription reach the publisher before asking for history
        if args.replay_endpoint and not _capture_history(args.replay_endpoint, writer):
            print(
                f"warning: the replay socket {args.replay_endpoint} did not answer; batches "
                "published before this capture started are missing",
                file=sys.stderr,
            )
        writer.open_index()  # the index exists from here on: readers can tell the capture is live
        print(f"capturing from {args.endpoint} into {args.out}", file=sys.stderr, flush=True)
        _capture_live(sub, writer, args.batches, args.seconds)
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()
        writer.close()  # stopped at any point, the index lists every message received
    live = writer.counts["pub"]
    print(f"captured {live} live batches ({len(writer)} messages) into {args.out}")
    return 0


def _capture_live(
    sub: Any, writer: CaptureWriter, batches: int | None, seconds: float | None
) -> None:
    deadline = time.monotonic() + seconds if seconds else None
    while batches is None or writer.counts["pub"] < batches:
        if deadline is not None and time.monotonic() >= deadline:
            return
        if not sub.poll(200):
            continue
        frames = sub.recv_multipart()
        if len(frames) != 3:
            print(f"skipping a message with {len(frames)} frames", file=sys.stderr)
            continue
        writer.add("pub", frames)


def _capture_history(endpoint: str, writer: CaptureWriter, rounds: int = 4) -> bool:
    """Ask the replay socket for everything from sequence 0 and write it in sequence order,
    its end marker last; True once an end marker came. vLLM's ROUTER drops what outruns its
    queue to this socket, so a reply with holes, or cut short, is asked again from its first
    missing batch, as the router's ReplayClient does."""
    from indexer.subscriber import _first_missing

    got: dict[int, list[bytes]] = {}
    end: list[bytes] | None = None
    floor = 0  # batches below it are out of the engine's buffer
    start: int | None = 0
    for _ in range(rounds):
        if start is None:
            break
        batches, marker = _fetch_history(endpoint, start)
        if not batches and marker is None:
            break  # the engine does not answer: asking again waits as long again
        if batches and min(batches) > start:
            floor = max(floor, min(batches))
        got.update(batches)
        end = marker or end
        start = _first_missing(dict.fromkeys(got, b""), floor, end is not None)
    for frames in [*(got[seq] for seq in sorted(got)), *([end] if end else [])]:
        writer.add("replay", frames, prefix="replay_from0")
    return end is not None


def _fetch_history(endpoint: str, start: int) -> tuple[dict[int, list[bytes]], list[bytes] | None]:
    """One replay request on a fresh DEALER (a late answer to an earlier one cannot
    interleave): [topic, seq, payload] of each batch by seq, and the end marker's frames,
    None if it did not come."""
    import zmq

    from indexer.subscriber import END_SEQ, parse_seq, seq_bytes

    dealer: Any = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    # unbounded: the engine's ROUTER drops, without a word, what overflows this queue
    dealer.setsockopt(zmq.RCVHWM, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", seq_bytes(start)])
    batches: dict[int, list[bytes]] = {}
    try:
        while dealer.poll(5000):
            reply = dealer.recv_multipart()
            frames = _reply_frames(reply)
            if frames is None:
                print(f"skipping a replay reply of {len(reply)} frames", file=sys.stderr)
            elif frames[1] == END_SEQ:
                return batches, frames
            else:
                batches[parse_seq(frames[1])] = frames
        return batches, None
    finally:
        dealer.close()


def _reply_frames(reply: list[bytes]) -> list[bytes] | None:
    """[topic, seq, payload] of a replay reply in either shape vLLM sent (the older one has
    no topic frame: written empty); None for a reply of neither shape."""
    from indexer.subscriber import parse_replay_reply, seq_bytes

    try:
        parsed = parse_replay_reply(reply)
    except ValueError:  # a sequence frame that is not 8 bytes
        return None
    if parsed is None:
        return None
    seq, payload = parsed
    return [reply[1] if len(reply) == 4 else b"", seq_bytes(seq), payload]


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
