"""Three GRPO steps of a 0.5B-parameter model (Qwen2.5-0.5B's shapes, random weights) on this machine.

Builds the model from a `Qwen2Config` with Qwen2.5-0.5B's sizes (494M parameters, 24 layers,
hidden 896, vocabulary 151,936, tied embeddings; weights saved in bfloat16), with
SmolLM2-135M-Instruct's tokenizer and chat template (tests/real_model.py; its token ids are all
below the vocabulary size), then runs `hybridflow recipe=grpo` in the model's bfloat16 compute
with float32 master weights on 2 ranks, and prints each step's memory beside the floor
(hybridflow/memory_budget.py; docs/performance.md, "Memory").

    PYTHONPATH=. .venv/bin/python bench/qwen05_steps.py --work /tmp/qwen05 rollout.dtype=bfloat16

(extra arguments are Hydra overrides; with the default float32 engine this machine runs out of memory,
docs/performance.md "A 0.5B-parameter model")
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QWEN05 = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
              num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
              tie_word_embeddings=True, rms_norm_eps=1e-6)


def build(directory: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from tests.real_model import real_model_dir

    if (directory / "config.json").exists():
        return directory
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir())
    config = Qwen2Config(**QWEN05, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/qwen05"))
    parser.add_argument("--steps", type=int, default=3)
    args, extra = parser.parse_known_args()
    from tests.real_model import write_chat_addition

    model = build(args.work / "model")
    train, val = write_chat_addition(args.work / "data", train_rows=200, val_rows=16)
    run_name = "grpo"
    shutil.rmtree(args.work / "runs" / run_name, ignore_errors=True)
    command = [str(Path(sys.executable).parent / "hybridflow"), "recipe=grpo", "model=local_hf", f"model.path={model}",
               "data=files", f"data.train_path={train}", f"data.val_path={val}", "data.max_prompt_tokens=64",
               f"reward.fn={ROOT / 'tests/e2e/fixtures/varied_reward.py'}:score", "rollout.max_response_tokens=16",
               "trainer.prompts_per_step=2", "rollout.samples_per_prompt=2",
               f"trainer.total_steps={args.steps}", "trainer.val_every_steps=0", "trainer.val_prompts=4",
               "trainer.export_hf=false", f"logger.output_root={args.work / 'runs'}", f"logger.run_name={run_name}",
               *extra]
    print(" ".join(command), flush=True)
    done = subprocess.run(command, cwd=ROOT)
    rows = [json.loads(line) for line in (args.work / "runs" / run_name / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        print(f"step {row['step']}: peak {row['memory/global_peak_gib']:.2f} GiB, resident at the end "
              f"{row['memory/global_rss_gib']:.2f} GiB, update {row['timing/update_s']:.0f} s, "
              f"generate {row['timing/generate_s']:.0f} s")
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
