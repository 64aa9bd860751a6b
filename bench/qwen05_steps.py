"""Three GRPO steps of a 0.5B-parameter model (Qwen2.5-0.5B's shapes, random weights) on this machine.

Builds the model from a `Qwen2Config` with Qwen2.5-0.5B's sizes (494M parameters, 24 layers,
hidden 896, vocabulary 151,936, tied embeddings; weights saved in bfloat16), with
SmolLM2-135M-Instruct's tokenizer and chat template (tests/real_model.py; its token ids are all
below the vocabulary size), then runs `hybridflow recipe=grpo` on 2 ranks with float32 master
weights, computing in `model=local_hf`'s dtype (`model.dtype=auto`: bfloat16 on a CPU with bf16
instructions, float32 elsewhere; add `model.dtype=bfloat16` to ask for it), and prints each step's
peak and resident memory and its update and generation seconds (the floor they are read against:
docs/memory.md, "Memory").

    PYTHONPATH=. .venv/bin/python bench/qwen05_steps.py --work /tmp/qwen05 rollout.dtype=bfloat16
    PYTHONPATH=. .venv/bin/python bench/qwen05_steps.py --dry-run rollout.dtype=bfloat16   # tiny shapes; run nothing

(extra arguments are Hydra overrides; with the default float32 engine this machine runs out of memory,
docs/results/memory.md "A 0.5B-parameter model")

`--dry-run` builds the model through the same builder at tiny shapes (`TINY`, with the tiny model's
character tokenizer instead of SmolLM2's) into a temporary directory, checks what it saved, composes
and checks the command as `hybridflow` checks it (the model, the step count and the two ranks must
reach the composed config), and prints the steps of a small metrics.jsonl it writes as a run's are
printed. It starts no Ray, engine or training and leaves --work alone.
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
# The dry run's: Qwen2.5-0.5B's settings at sizes that build in a moment (its vocabulary: the tokenizer's)
TINY = {**QWEN05, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}


def build(directory: Path, shape: dict = QWEN05, tokenizer_dir: Path | None = None) -> Path:
    """A `Qwen2ForCausalLM` of `shape` with random weights in bfloat16 and the tokenizer of `tokenizer_dir`
    (default SmolLM2-135M-Instruct's), saved to `directory` (kept when there already)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from tests.real_model import real_model_dir

    if (directory / "config.json").exists():
        return directory
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or real_model_dir())
    config = Qwen2Config(**shape, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(directory)
    return directory


def overrides_of(work: Path, model: Path, train: Path, val: Path, steps: int, run_name: str,
                 extra: list[str]) -> list[str]:
    """The `hybridflow` overrides of the run."""
    return ["recipe=grpo", "model=local_hf", f"model.path={model}", "data=files", f"data.train_path={train}",
            f"data.val_path={val}", "data.max_prompt_tokens=64",
            f"reward.fn={ROOT / 'tests/e2e/fixtures/varied_reward.py'}:score", "rollout.max_response_tokens=16",
            "trainer.prompts_per_step=2", "rollout.samples_per_prompt=2", f"trainer.total_steps={steps}",
            "trainer.val_every_steps=0", "trainer.val_prompts=4", "trainer.export_hf=false",
            f"logger.output_root={work / 'runs'}", f"logger.run_name={run_name}", *extra]


def print_steps(metrics: Path) -> None:
    """Each step's memory and stage seconds, from a run's metrics.jsonl."""
    for row in (json.loads(line) for line in metrics.read_text().splitlines()):
        print(f"step {row['step']}: peak {row['memory/global_peak_gib']:.2f} GiB, resident at the end "
              f"{row['memory/global_rss_gib']:.2f} GiB, update {row['timing/update_s']:.0f} s, "
              f"generate {row['timing/generate_s']:.0f} s")


def dry_run(steps: int, extra: list[str], work: Path) -> None:
    """The model built at tiny shapes and checked, the command composed and checked as `hybridflow`
    checks it, and a small metrics.jsonl's steps printed; nothing run."""
    from hybridflow.builders import build_tiny_model
    from hybridflow.builders.tiny_model import tiny_vocab_size
    from hybridflow.config.model_facts import ModelFacts
    from hybridflow.run.pipeline_stages import compose_command
    from hybridflow.planning.auto import decide_plan
    from tests.real_model import write_chat_addition

    shape = {**TINY, "vocab_size": tiny_vocab_size()}
    model = build(work / "model", shape, tokenizer_dir=build_tiny_model(work / "tiny"))
    facts, written = ModelFacts.from_dir(model), json.loads((model / "config.json").read_text())
    saved = (facts.architecture, (facts.hidden, facts.layers, facts.heads, facts.vocab), facts.tied_embeddings,
             written.get("dtype") or written.get("torch_dtype"))  # the key's name depends on transformers' version
    wanted = ("Qwen2ForCausalLM", tuple(shape[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                          "vocab_size")), True, "bfloat16")
    if saved != wanted:
        raise SystemExit(f"{model}: the builder saved (architecture, shape, tied, dtype) {saved}, not {wanted}")
    train, val = write_chat_addition(work / "data", train_rows=200, val_rows=16)
    overrides = overrides_of(work, model, train, val, steps, "grpo", extra)
    config = compose_command(overrides)
    ranks = decide_plan(config).plan.devices_of("actor")
    if (config.model.path, config.trainer.total_steps, ranks) != (str(model), steps, 2):
        raise SystemExit(f"the composed config runs model.path={config.model.path}, trainer.total_steps="
                         f"{config.trainer.total_steps} on {ranks} actor rank(s), not {model}, {steps} on 2")
    print(f"model: {facts.parameters:,} parameters, {facts.layers} layers, hidden {facts.hidden}, vocabulary "
          f"{facts.vocab} (the run builds {QWEN05['num_hidden_layers']} layers, hidden {QWEN05['hidden_size']}, "
          f"vocabulary {QWEN05['vocab_size']})")
    print(f"grpo: hybridflow {' '.join(overrides)}")
    metrics = work / "runs" / "grpo" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    metrics.write_text("".join(json.dumps({"step": step, "memory/global_peak_gib": 4.0 + step / 4,
                                           "memory/global_rss_gib": 3.5, "timing/update_s": 60.0 * step,
                                           "timing/generate_s": 30.0}) + "\n" for step in range(1, steps + 1)))
    print_steps(metrics)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/qwen05"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dry-run", action="store_true", help="build at tiny shapes into a temporary directory, "
                                                               "compose and check the command; run nothing")
    args, extra = parser.parse_known_args()
    if args.dry_run:
        import tempfile

        with tempfile.TemporaryDirectory() as work:
            dry_run(args.steps, extra, Path(work))
        return
    from tests.real_model import write_chat_addition

    model = build(args.work / "model")
    train, val = write_chat_addition(args.work / "data", train_rows=200, val_rows=16)
    run_name = "grpo"
    shutil.rmtree(args.work / "runs" / run_name, ignore_errors=True)
    command = [str(Path(sys.executable).parent / "hybridflow"),
               *overrides_of(args.work, model, train, val, args.steps, run_name, extra)]
    print(" ".join(command), flush=True)
    done = subprocess.run(command, cwd=ROOT)
    print_steps(args.work / "runs" / run_name / "metrics.jsonl")
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
