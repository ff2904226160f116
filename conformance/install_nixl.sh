#!/usr/bin/env bash
# Installs NIXL (the KV transfer library vLLM's NixlConnector uses) into a virtualenv:
#   bash conformance/install_nixl.sh [VENV]      (default .venv)
# `pip install nixl` would pull gigabytes of CUDA torch, and a pip extra cannot say
# --no-deps, so the wheels go in here without their dependencies: nixl's Python API and its
# UCX plugin need only numpy on a CPU host. Idempotent: a venv that already imports them
# costs one interpreter start. Used by the Makefile's venv step and conformance/setup_vllm.sh.
set -euo pipefail
VENV="${1:-.venv}"
PY="$VENV/bin/python"
# Versions verified end to end with vLLM 0.32 on the CPU (DESIGN.md section 4).
PKGS=("nixl==1.5.2" "nixl-cu12==1.5.1" "numpy")
CHECK='import numpy, nixl._api; from nixl._api import nixl_agent, nixl_agent_config'
if [ ! -x "$PY" ]; then
    echo "install_nixl.sh: no python at $PY (create the venv first)" >&2
    exit 2
fi
if "$PY" -c "$CHECK" 2>/dev/null; then
    exit 0
fi
"$PY" -m pip install -q --no-deps "${PKGS[@]}" >&2
"$PY" -c "$CHECK" || {
    echo "install_nixl.sh: nixl installed into $VENV but does not import (see above)" >&2
    exit 1
}
echo "install_nixl.sh: nixl ready in $VENV" >&2
