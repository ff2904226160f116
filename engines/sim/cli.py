"""`kvroute sim`: run one simulated vLLM worker."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

from engines.sim.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_KV_BLOCKS,
    DEFAULT_MODEL,
    ConfigError,
    SimConfig,
)
from engines.sim.latency import LatencyModel
from engines.sim.pd_config import PDConfigError, add_pd_args, kv_transfer_from_args
from engines.sim.tokenizer import DEFAULT_TOKENIZER_DIR

log = logging.getLogger("kvroute.sim")

DESCRIPTION = """\
Run one simulated vLLM 0.32 worker on loopback: vLLM's HTTP API (/v1/completions,
/v1/chat/completions, /tokenize, /metrics, /kv_event_sources, /reset_prefix_cache, ...), a
vLLM-v1 prefix cache of --kv-blocks blocks, and KV events on ZMQ byte-identical to vLLM's
(PUB + replay ROUTER). Prints one JSON line with its URL and endpoints, then serves until
Ctrl-C / SIGTERM.

Latency model (per engine step): a step that runs any prefill costs --ttft-base-ms plus, per
prefill chunk of N new tokens after C computed ones, N * --prefill-ms-per-token +
--attention-ms-per-mpair * (N*C + N*N/2) / 1e6; a decode-only step costs
--decode-ms-per-step. Defaults match the seeds' vLLM measurement: a 1,500-token prompt
~80 ms to first token uncached, ~15 ms cached; a 3,500-token prefill stalls running streams
for ~227 ms unless --max-num-batched-tokens chunks it."""

EPILOG = """\
examples:
  kvroute sim --port 8001 --kv-blocks 926 --events-endpoint tcp://127.0.0.1:5557 \\
      --replay-endpoint tcp://127.0.0.1:5558 --topic kv-events
  kvroute sim --port 8002 --no-events          # caching works, nothing is published
  kvroute sim --kv-role producer --kv-bytes-per-token 2048        # a prefill worker (NIXL)
  VLLM_NIXL_SIDE_CHANNEL_PORT=5601 kvroute sim --kv-transfer-config \
      '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}' --link-mb-s 104
  curl -s localhost:8001/sim/cached_tokens -H content-type:application/json \\
      -d '{"prompt": "hello"}'                 # ground truth, changes nothing"""


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Options shared by `kvroute sim` and `kvroute fleet`."""
    g = p.add_argument_group("model and cache")
    g.add_argument("--model", default=DEFAULT_MODEL, help="served model name (default %(default)s)")
    g.add_argument(
        "--tokenizer",
        type=Path,
        default=DEFAULT_TOKENIZER_DIR,
        help="tokenizer folder (tokenizer.json + tokenizer_config.json); default: packaged",
    )
    g.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    g.add_argument(
        "--kv-blocks",
        type=int,
        default=DEFAULT_KV_BLOCKS,
        help="KV blocks incl. vLLM's null block (default %(default)s: 14,816 tokens at 16)",
    )
    g.add_argument("--max-model-len", type=int, default=None, help="default: tokenizer's")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    g.add_argument(
        "--bytes-hashes",
        dest="int_hashes",
        action="store_false",
        help="publish 32-byte block hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)",
    )
    g.add_argument(
        "--int-hashes",
        dest="int_hashes",
        action="store_true",
        default=True,
        help="publish block hashes as uint64, vLLM's default",
    )
    g.add_argument("--topic", default=None, help="KV event topic (vLLM's default is '')")
    g.add_argument(
        "--lora-modules",
        nargs="*",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters served as extra model names (their blocks hash apart)",
    )
    g.add_argument(
        "--lora-resolver-dir",
        metavar="DIR",
        help="load a LoRA adapter at its first request from DIR/NAME, as vLLM's filesystem "
        "resolver does (VLLM_LORA_RESOLVER_CACHE_DIR with VLLM_ALLOW_RUNTIME_LORA_UPDATING="
        "True): DIR/NAME/adapter_config.json must say peft_type LORA and name this model "
        "as base_model_name_or_path",
    )
    g.add_argument(
        "--max-loras",
        type=int,
        default=1,
        help="LoRA adapters one batch may run (vLLM's --max-loras, default 1): a request for "
        "another adapter waits, counted as deferred, while the requests behind it pass",
    )
    g.add_argument(
        "--api-key", default=None, help="require this bearer key on /v1/* (vLLM's --api-key)"
    )
    g.add_argument(
        "--no-prompt-tokens-details",
        dest="prompt_tokens_details",
        action="store_false",
        help="leave usage.prompt_tokens_details (cached_tokens) out of responses, as a vLLM "
        "started without --enable-prompt-tokens-details (default: reported)",
    )
    g.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engines behind one server, each with its KV cache and event publisher; "
        "X-data-parallel-rank picks one (vLLM's --data-parallel-size)",
    )
    s = p.add_argument_group("scheduling and latency")
    s.add_argument("--max-batch", type=int, default=64, help="max running requests (max_num_seqs)")
    s.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="token budget per step; smaller values chunk long prefills (default %(default)s)",
    )
    d = LatencyModel()
    s.add_argument(
        "--ttft-base-ms",
        type=float,
        default=d.ttft_base_ms,
        help="fixed cost of a step that runs any prefill (default %(default)s)",
    )
    s.add_argument(
        "--decode-ms-per-step",
        type=float,
        default=d.decode_ms_per_step,
        help="cost of a decode-only step: the inter-token latency (default %(default)s)",
    )
    s.add_argument(
        "--prefill-ms-per-token",
        type=float,
        default=d.prefill_ms_per_token,
        help="linear prefill cost per uncached token (default %(default)s)",
    )
    s.add_argument(
        "--attention-ms-per-mpair",
        type=float,
        default=d.attention_ms_per_mpair,
        help="attention cost per million (new token, earlier token) pairs (default %(default)s)",
    )
    s.add_argument("--output-len", default="16:64", help="MIN:MAX tokens before the model's EOS")
    s.add_argument("--seed", type=int, default=0, help="seed of the generated text")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "sim",
        help="run one simulated vLLM worker",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--port", type=int, default=0, help="HTTP port (default: a free one)")
    p.add_argument("--host", default="127.0.0.1", help="only 127.0.0.1 is accepted")
    p.add_argument("--events-endpoint", default="tcp://127.0.0.1:0", help="ZMQ PUB endpoint")
    p.add_argument("--replay-endpoint", default="tcp://127.0.0.1:0", help="ZMQ replay endpoint")
    p.add_argument("--no-replay", action="store_true", help="publish without a replay socket")
    p.add_argument("--no-events", action="store_true", help="publish nothing (the silent failure)")
    p.add_argument("--name", default="sim", help="worker name in logs and JSON")
    add_engine_args(p)
    add_pd_args(p)
    p.set_defaults(func=run)


def config_from_args(
    args: argparse.Namespace, default_topic: str = "", **over: object
) -> SimConfig:
    lo, _, hi = str(args.output_len).partition(":")
    try:
        output_len = (int(lo), int(hi or lo))
        latency = LatencyModel(
            ttft_base_ms=args.ttft_base_ms,
            decode_ms_per_step=args.decode_ms_per_step,
            prefill_ms_per_token=args.prefill_ms_per_token,
            attention_ms_per_mpair=args.attention_ms_per_mpair,
        )
    except ValueError as exc:
        raise ConfigError(f"--output-len / latency: {exc}") from None
    try:
        kv_transfer = kv_transfer_from_args(args)
    except PDConfigError as exc:
        raise ConfigError(str(exc)) from None
    topic = args.topic if args.topic is not None else default_topic
    config = SimConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        block_size=args.block_size,
        kv_blocks=args.kv_blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_batch,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        topic=str(topic),
        int_hashes=args.int_hashes,
        none_hash_seed=os.environ.get("PYTHONHASHSEED") or SimConfig.none_hash_seed,
        latency=latency,
        seed=args.seed,
        output_len=output_len,
        lora_modules=_lora_modules(args.lora_modules),
        max_loras=args.max_loras,
        lora_resolver_dir=args.lora_resolver_dir,
        api_key=args.api_key,
        kv_transfer=kv_transfer,
        data_parallel_size=args.data_parallel_size,
        prompt_tokens_details=args.prompt_tokens_details,
    )
    return config.replace(**over).validate()


def _lora_modules(specs: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name:
            raise ConfigError(f"--lora-modules {spec!r}: use NAME=PATH")
        out.append((name, path))
    return tuple(out)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(
            args,
            host=args.host,
            port=args.port,
            name=args.name,
            events=not args.no_events,
            events_endpoint=args.events_endpoint,
            replay_endpoint=None if args.no_replay else args.replay_endpoint,
        )
    except ConfigError as exc:
        print(f"kvroute sim: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(config))


async def _serve(config: SimConfig) -> int:
    from engines.sim.dp import sim_worker

    worker = sim_worker(config)
    try:
        await worker.start()
    except (RuntimeError, OSError) as exc:
        print(f"kvroute sim: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(worker.info()), flush=True)
    await wait_for_signal()
    await worker.stop()
    return 0


async def wait_for_signal() -> None:
    """Until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
