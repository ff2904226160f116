"""vLLM's own KV event publisher with a full replay buffer, for the `replay-buffer` check.

Runs inside the vLLM virtualenv (it imports vLLM):

    $KVROUTE_VLLM_VENV/bin/python -m conformance.vllm_replay_publisher \
        --events-port P --replay-port R --batches 10000 --blocks 64

It starts `vllm.distributed.kv_events.ZmqEventPublisher` as an engine does (its publisher
thread, PUB socket, ROUTER replay socket and its default 10,000-batch buffer), publishes
`--batches` batches of one `BlockStored` of `--blocks` blocks each, the way a busy engine
fills its buffer, waits until the thread has sent them all, prints one JSON line saying so,
and serves replays until its standard input closes. Block i of batch b has the hash
b * blocks + i + 1 and chains from the block before it in the same batch; the tokens of
batch b are `tokens_of(b, ...)`, so the reader can hash them itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def tokens_of(batch: int, blocks: int, block_size: int) -> list[int]:
    """Token ids of a batch's chain: distinct per batch, within a small vocabulary."""
    return [(batch * 7919 + t) % 30_000 + 1 for t in range(blocks * block_size)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events-port", type=int, required=True)
    p.add_argument("--replay-port", type=int, required=True)
    p.add_argument("--batches", type=int, default=10_000)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--topic", default="kv-events")
    args = p.parse_args(argv)

    from vllm.distributed.kv_events import (  # type: ignore[import-not-found, unused-ignore]
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )

    # "::" makes vLLM bind the PUB socket (it dials out to plain tcp://host:port endpoints)
    publisher = ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=f"tcp://[::ffff:127.0.0.1]:{args.events_port}",
        replay_endpoint=f"tcp://127.0.0.1:{args.replay_port}",
        topic=args.topic,
    )
    started = time.monotonic()
    for b in range(args.batches):
        first = b * args.blocks + 1
        event = BlockStored(
            block_hashes=list(range(first, first + args.blocks)),
            parent_block_hash=None,
            token_ids=tokens_of(b, args.blocks, args.block_size),
            block_size=args.block_size,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
        publisher.publish(KVEventBatch(ts=time.time(), events=[event]))
    publisher._event_queue.join()  # the publisher thread has sent and buffered every batch
    print(
        json.dumps({"published": args.batches, "seconds": round(time.monotonic() - started, 2)}),
        flush=True,
    )
    sys.stdin.read()  # serve replays until the check closes our standard input
    publisher.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
