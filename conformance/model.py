"""Build the tiny random Llama (and a LoRA adapter) that real vLLM serves for the conformance suite.

No weights can be downloaded where this project is built, and the suite checks routing and
KV events, not text quality, so a seeded random model with the project's own tokenizer is
enough. It runs inside the vLLM virtualenv (which has torch and transformers):

    $KVROUTE_VLLM_VENV/bin/python -m conformance.model --out DIR

DIR gets config.json, generation_config.json, model.safetensors, the tokenizer files from
engines/sim/data/tokenizer, and DIR/lora-a (a PEFT-format LoRA, rank 8, on q_proj/v_proj).
A second run with the same tokenizer does nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = REPO_ROOT / "engines" / "sim" / "data" / "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MANIFEST = "kvroute-model.json"  # written last: its presence means the folder is complete
LORA_NAME = "lora-a"
# the same weights served under a second name: vLLM gives each name its own adapter id, so
# with --max-loras 1 (its default) a batch runs one of the two and holds the other's requests
LORA_B_NAME = "lora-b"
SEED = 1234

ARCH = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
}
LORA_RANK = 8
LORA_ALPHA = 16
LORA_TARGETS = ("q_proj", "v_proj")


def tokenizer_digest(tokenizer_dir: Path = TOKENIZER_DIR) -> str:
    """sha256 over the tokenizer files, so a regenerated tokenizer forces a rebuilt model."""
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        digest.update(name.encode())
        digest.update((tokenizer_dir / name).read_bytes())
    return digest.hexdigest()


def manifest(tokenizer_dir: Path = TOKENIZER_DIR) -> dict[str, Any]:
    return {
        "arch": ARCH,
        "seed": SEED,
        "lora": LORA_NAME,
        "tokenizer": tokenizer_digest(tokenizer_dir),
    }


def is_complete(out: Path, tokenizer_dir: Path = TOKENIZER_DIR) -> bool:
    """True when `out` was fully built by this script from the current tokenizer."""
    try:
        found = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return bool(found == manifest(tokenizer_dir))


def _vocab_size(tokenizer_dir: Path) -> int:
    # The tokenizer's vocabulary, read from its JSON so this module needs no `tokenizers`.
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    ids = list(data["model"]["vocab"].values()) + [t["id"] for t in data["added_tokens"]]
    return int(max(ids)) + 1


def _write_model(out: Path, vocab_size: int) -> None:
    import torch  # type: ignore[import-not-found, unused-ignore]
    from transformers import (  # type: ignore[import-not-found, unused-ignore]
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    config = LlamaConfig(
        vocab_size=vocab_size, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, **ARCH
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    # `<|im_end|>` (3) also ends generation so chat replies stop at the end of a turn.
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=[1, 3])
    model.save_pretrained(out)


def _lora_tensors(seed: int) -> dict[str, Any]:
    import torch  # type: ignore[import-not-found, unused-ignore]

    gen = torch.Generator().manual_seed(seed)
    hidden = ARCH["hidden_size"]
    tensors: dict[str, Any] = {}
    for layer in range(ARCH["num_hidden_layers"]):
        for module in LORA_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            # B is non-zero (PEFT starts it at zero) so the adapter really changes outputs.
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(LORA_RANK, hidden, generator=gen) * 0.05
            )
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(hidden, LORA_RANK, generator=gen) * 0.05
            )
    return tensors


def _lora_config() -> dict[str, Any]:
    return {
        "base_model_name_or_path": "kvroute-tiny-llama",
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "lora_alpha": LORA_ALPHA,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": LORA_RANK,
        "target_modules": list(LORA_TARGETS),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }


def _write_lora(out: Path) -> None:
    from safetensors.torch import save_file  # type: ignore[import-not-found, unused-ignore]

    out.mkdir(parents=True)
    save_file(_lora_tensors(SEED + 1), str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(_lora_config(), indent=2) + "\n")


def _replace_dir(built: Path, out: Path) -> None:
    """Move a finished build into place; only a folder this script made may be replaced."""
    if out.exists():
        if not (out / MANIFEST).exists() and any(out.iterdir()):
            raise SystemExit(f"{out} exists and was not built by conformance.model; remove it")
        shutil.rmtree(out)
    os.replace(built, out)


def build(out: Path, tokenizer_dir: Path = TOKENIZER_DIR) -> bool:
    """Build the model folder unless it is already complete. Returns True if it built."""
    if is_complete(out, tokenizer_dir):
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename, so an interrupted run never leaves a folder that
    # looks complete.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the folder is shared read-only data
    try:
        _write_model(tmp, _vocab_size(tokenizer_dir))
        for name in TOKENIZER_FILES:
            shutil.copyfile(tokenizer_dir / name, tmp / name)
        _write_lora(tmp / LORA_NAME)
        (tmp / MANIFEST).write_text(json.dumps(manifest(tokenizer_dir), indent=2) + "\n")
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the tiny random Llama for real vLLM.")
    parser.add_argument("--out", type=Path, required=True, help="model folder to create")
    parser.add_argument("--tokenizer-dir", type=Path, default=TOKENIZER_DIR)
    args = parser.parse_args(argv)
    built = build(args.out.resolve(), args.tokenizer_dir)
    print(f"{'built' if built else 'up to date'}: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
