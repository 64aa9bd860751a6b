"""What the benchmarks that run TRL beside HybridFlow share about TRL's side (bench/trl_env.sh builds its
virtual environment)."""

from __future__ import annotations

import os


def trl_process_env() -> dict[str, str]:
    """The environment of a process in TRL's virtual environment: nothing of HybridFlow's on its
    Python path (the two environments hold different transformers), and no Hugging Face Hub access."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env
