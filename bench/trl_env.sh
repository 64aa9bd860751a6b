#!/usr/bin/env bash
# A separate virtual environment for TRL, used by bench/grpo_vs_trl.py (git-ignored).
#
#     bash bench/trl_env.sh [VENV_DIR]      # default: bench/.trl-venv
#
# TRL's own releases need a newer transformers than HybridFlow's .venv may hold, so TRL gets
# its own environment instead of changing HybridFlow's. torch is pinned to the CPU build that
# HybridFlow uses (torch==2.13.0, found on local disk through pip's find-links), so both sides
# run the same kernels. PyPI's torchvision, if a dependency drags it in, is built against
# another torch and breaks `import transformers` ("operator torchvision::nms does not exist");
# nothing here uses it, so it is removed. A no-op when the environment already matches.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${1:-$HERE/.trl-venv}"
PYTHON="${PYTHON:-python3.11}"
TORCH="torch==2.13.0"
TRL="trl==1.16.0"
PINS="$TORCH $TRL transformers==5.23.0 accelerate==1.15.0 datasets==5.2.0"
STAMP="$VENV/.hybridflow-bench-pins"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$PINS" ]]; then
    exit 0
fi
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
# torch first and alone: the pinned CPU wheel, never a CUDA build from the index.
"$VENV/bin/pip" install --quiet "$TORCH"
"$VENV/bin/pip" install --quiet $PINS
"$VENV/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" - <<'PY'
import torch, transformers, trl
from trl import GRPOConfig, GRPOTrainer  # noqa: F401  (fails here, not in the benchmark)
assert "+cpu" in torch.__version__, f"expected the CPU build of torch, got {torch.__version__}"
print(f"TRL environment: torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}")
PY
echo "$PINS" > "$STAMP"
